// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The global-batch loss on GPUs: `distributed::device_loss<Element, Temperature, Scaler>`, the device counterpart of
/// `distributed::loss` built on the chunked device algorithm (device/chunked.cuh, cuBLAS), over `distributed::
/// comm::nccl` (NCCL collectives on device buffers and a stream; comm/nccl.cuh), with the small kernels
/// around its collectives in distributed/nccl_kernels.cuh. Include this header in a .cu file and link NCCL and cuBLAS
/// (CMake: `contrastive::nccl`). Users of anything else need neither.
///
/// The step is the host distributed loss's (docs/distributed.md), with device buffers:
///   agreement (call, step count, the caller's iteration, shapes and every host-side check, all-gathered through
///   NCCL; ranks out of step and errors are refused on every rank, naming the ranks: comm/agreement.hpp) -> K
///   all-gathered (grouped broadcasts, so ranks may hold unequal rows) -> the rank's block of rows through the chunked
///   runner with the global coefficients -> symmetric: column partials combined (all-reduce max of N floats, sum of 2
///   N) -> backward -> dK partials reduce-scattered (grouped reduces) and rounded -> sums and flags all-reduced -> the
///   record on every rank. The sigmoid objective (SigLIP; positives on the global diagonal or global labels, the bias
///   from each rank's state) has no column phase: the rank's rows against the gathered keys in one pass per chunk,
///   dK reduce-scattered, and d loss / d b all-reduced with the sums. `finish_step` all-reduces the first non-finite
///   site, so a `parameters` site found by one rank's `unscale_and_check` skips the step on every rank.
///
/// One rank per GPU and per host thread: set the rank's device (cudaSetDevice) before constructing and calling its
/// loss (the agreement synchronizes the stream, so one thread cannot drive several ranks), and do not share one
/// comm::nccl between threads (copies share its staging buffer).
///
/// Differences from the single-GPU device API, by design: the loss owns its workspace (grown with cudaMalloc when a
/// step needs more, freed by the destructor; a default chunk_options chunk is sized from the free memory at the first
/// step of a shape and kept for the steps of that shape); the agreement synchronizes the stream (host-side checks need
/// every rank's answer), so a distributed step cannot be captured in a CUDA graph; labels and finiteness are not
/// checked up front (as on one GPU: an out-of-range label makes its row's loss infinite, a non-finite input non-finite
/// logits, and the step is skipped on every rank). NCCL's max of a NaN is unspecified: a NaN logit is still flagged
/// (the step is skipped) but the recorded max logit may not show it.

#include <contrastive/comm/agreement.hpp>
#include <contrastive/comm/communicator.hpp>
#include <contrastive/comm/nccl.cuh>
#include <contrastive/device/chunked.cuh>
#include <contrastive/device/loss.cuh>
#include <contrastive/distributed/nccl_kernels.cuh>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/numeric/online_lse.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>
#include <contrastive/step/logic.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

namespace contrastive
{
namespace distributed
{
/// The global-batch loss on GPUs (see the file comment). One per rank; not thread-safe.
template <class Element, class Temperature = temperature::learnable, class Scaler = scaler::static_scale>
class device_loss
{
public:
  /// The single-GPU chunked loss whose state, kernels and policy steps each rank uses.
  using single = contrastive::device::loss<Element, Temperature, Scaler, algorithm::chunked>;
  /// The step state (policies, step record), in device memory; the same as on one GPU.
  using state_type = typename single::state_type;

  /// `comm` wraps this rank's ncclComm_t; `handle` is this rank's cuBLAS handle (its stream and pointer mode are
  /// set for each call and restored).
  device_loss(comm::nccl comm, cublasHandle_t handle, chunk_options opts = {})
      : comm_(std::move(comm)), handle_(handle), opts_(opts)
  {
    // Its own small buffer, written once here: every call's collectives need it, so a rank without it says so in
    // the agreement (every rank refuses) instead of leaving the others in a collective.
    const small_buffer init{{0.0f, 1.0f}, {0, 0}};
    if (cudaMalloc(&small_, sizeof(small_buffer)) != cudaSuccess ||
        cudaMemcpy(small_, &init, sizeof init, cudaMemcpyHostToDevice) != cudaSuccess)
    {
      cudaGetLastError();
      cudaFree(small_);
      small_ = nullptr;
    }
  }
  device_loss(const device_loss&) = delete;
  device_loss& operator=(const device_loss&) = delete;
  ~device_loss()
  {
    cudaFree(ws_);
    cudaFree(small_);
  }

  /// A validated initial state with a logit bias fixed at 0 (see device::loss::make_state); every rank starts from the
  /// same one.
  static status make_state(const Temperature& t, const Scaler& s, state_type& out)
  {
    return single::make_state(t, s, out);
  }
  /// With the sigmoid objective's logit bias (see device::loss::make_state); every rank starts from the same one.
  static status make_state(const Temperature& t, const Scaler& s, const logit_bias& b, state_type& out)
  {
    return single::make_state(t, s, b, out);
  }
  /// Bytes of device workspace this loss holds now (grown by the steps that need more).
  std::size_t workspace_bytes() const noexcept
  {
    return ws_bytes_;
  }
  /// Queries over all ranks in the last forward_backward's global batch; 0 before the first.
  std::size_t global_queries() const noexcept
  {
    return g_.n_q_total;
  }
  /// Keys over all ranks in the last forward_backward's global batch; 0 before the first.
  std::size_t global_keys() const noexcept
  {
    return g_.n_k_total;
  }
  /// Steps this loss has finished (agreed on every rank; what the agreement compares, with the caller's iteration).
  std::int64_t steps() const noexcept
  {
    return steps_;
  }

  /// Steps 1-3 over the global batch (collective): `p` holds this rank's rows (device pointers; info_nce labels are
  /// global key indices); dq/dk receive the gradients of loss_scale * (global loss) for them; the pending record is
  /// in d_state on every rank. Ranks out of step (another call or step count, or another `iteration`: the
  /// caller's own step number, optional, as on the host) are refused on every rank at the first wrong call.
  status forward_backward(const problem<Element>& p,
                          Element* dq,
                          Element* dk,
                          state_type* d_state,
                          cudaStream_t stream = nullptr,
                          std::int64_t iteration = no_iteration)
  {
    comm_.set_stream(stream);
    status local = check_problem(p, dq, dk, true, /*check_labels=*/false);
    if (local.ok())
    {
      (void)(local = check_device_problem(p));
    }
    if (local.ok() && small_ == nullptr)
    {
      (void)(local = no_small_buffer());
    }
    if (local.ok() && (d_state == nullptr || handle_ == nullptr))
    {
      (void)(local = status{
                 errc::null_pointer, d_state == nullptr ? "d_state" : "handle", "null device state or cuBLAS handle"});
    }
    if (local.ok())
    {
      (void)(local = contrastive::device::util::device_limits(p));
    }
    CONTRASTIVE_RETURN_IF_ERROR(agreement::agree_on_problem(comm_,
                                                            p,
                                                            steps_,
                                                            iteration,
                                                            local,
                                                            g_,
                                                            [&](const agreement::global_shape& g)
                                                            {
                                                              return size_workspace(p, g);
                                                            }));
    iteration_ = iteration;
    return objectives::visit(p,
                             [&](auto o)
                             {
                               return run_step<decltype(o)>(p, dq, dk, d_state, stream);
                             });
  }

private:
  /// This rank's part of an agreed step, for objective O (forward_backward dispatches on the problem's once).
  template <class O>
  status run_step(const problem<Element>& p, Element* dq, Element* dk, state_type* d_state, cudaStream_t stream)
  {
    constexpr bool sym = O::columns;
    const std::size_t n = g_.n_k_total, d = p.dim;
    const unsigned blocks = 1024;
    auto f = [&](std::size_t off)
    {
      return reinterpret_cast<float*>(static_cast<char*>(ws_) + off);
    };

    // From here every rank runs every collective whatever happens locally: a local CUDA or cuBLAS failure is
    // remembered, the local work is skipped, and the failure is all-reduced with the results, so every rank returns
    // it instead of the others waiting in a collective this rank never reaches.
    cudaError_t local_err = cudaSuccess;
    auto note = [&](cudaError_t e)
    {
      if (local_err == cudaSuccess && e != cudaSuccess)
      {
        local_err = e;
      }
    };

    // K from every rank, the rows' global positives.
    Element* k_all = reinterpret_cast<Element*>(static_cast<char*>(ws_) + x_.k_all);
    auto* labels = reinterpret_cast<std::int32_t*>(static_cast<char*>(ws_) + x_.labels);
    CONTRASTIVE_RETURN_IF_ERROR(comm_.allgatherv_rows(p.k, g_.k_rows.data(), d * sizeof(Element), k_all));
    nccl_kernels::fill_labels<><<<blocks, nccl_kernels::threads, 0, stream>>>(
        labels, p.labels, static_cast<long long>(p.n_q), static_cast<long long>(g_.q_off));
    note(cudaPeekAtLastError());

    problem<Element> block = p;
    block.k = k_all;
    block.n_k = n;
    block.labels = labels;
    // The global batch's coefficients (symmetric: n_q_total == n, so 0.5/n_q + 0.5/n is 2 * (0.5/n_q) exactly).
    const grad_coefficients gc = O::coefficients(g_.n_q_total, n);
    contrastive::device::chunked_phases::handle_guard guard{handle_};
    note(contrastive::device::chunked_phases::from_cublas(guard.enter(stream)));
    contrastive::device::chunked_phases::runner<Element, O> run(block, w_, ws_, handle_, stream, gc);
    if (local_err == cudaSuccess)
    {
      note(run.begin(d_state));
    }

    if constexpr (sym)
    {
      float* gmax = f(x_.col_max);
      float* pack = f(x_.col_pack);
      if (local_err == cudaSuccess)
      {
        note(run.forward_all());
      }
      if (local_err == cudaSuccess)
      {
        note(cudaMemcpyAsync(gmax, run.a.col_max, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
      }
      CONTRASTIVE_RETURN_IF_ERROR(comm_.allreduce(gmax, n, reduce_op::max));
      if (local_err == cudaSuccess)
      {
        nccl_kernels::rescale_columns<><<<blocks, nccl_kernels::threads, 0, stream>>>(
            run.a.col_max, run.a.col_sum, gmax, pack, static_cast<long long>(n));
        nccl_kernels::scatter_positives<><<<blocks, nccl_kernels::threads, 0, stream>>>(
            run.a.pos, pack + n, static_cast<long long>(p.n_q), static_cast<long long>(g_.q_off));
        note(cudaPeekAtLastError());
      }
      CONTRASTIVE_RETURN_IF_ERROR(comm_.allreduce(pack, 2 * n, reduce_op::sum));
      if (local_err == cudaSuccess)
      {
        nccl_kernels::finish_global_columns<><<<blocks, nccl_kernels::threads, 0, stream>>>(
            gmax, pack, run.a.col_lse, run.a.col_loss, static_cast<long long>(n));
        note(cudaPeekAtLastError());
      }
    }
    if (local_err == cudaSuccess)
    {
      note(run.backward_all(dq));
    }

    // dK back to its owners, rounded once.
    float* dk_local = f(x_.dk_local);
    CONTRASTIVE_RETURN_IF_ERROR(comm_.reduce_scatter_sum(run.dk_accumulator(), g_.dk_counts.data(), dk_local));
    if (local_err == cudaSuccess)
    {
      note(run.store_dk(dk_local, dk, p.n_k));
    }

    // Sums, flags and the failure flag over ranks (the column losses are global already), then the record.
    float* red = f(x_.red);
    if (local_err == cudaSuccess)
    {
      note(run.reduce_local());
    }
    if (local_err == cudaSuccess)
    {
      nccl_kernels::pack_results<><<<1, 1, 0, stream>>>(run.sums(), run.flags(), red);
      note(cudaPeekAtLastError());
    }
    // The failure flag is sent from the constant 0 or 1 in small_ (no copy that could fail first), and all three
    // reductions are enqueued whatever one of them returns, so this rank never leaves the others in one.
    const float* failed = small_flags() + (local_err == cudaSuccess ? 0 : 1);
    const status sums = comm_.allreduce(red, 5, reduce_op::sum);
    const status fails = comm_.allreduce(failed, red + 5, 1, reduce_op::sum);
    const status maxes = comm_.allreduce(red + 6, 1, reduce_op::max);
    // The sigmoid objective's d loss / d b, summed in place (its own collective: every rank's objective is this one).
    float* dbias = reinterpret_cast<float*>(reinterpret_cast<char*>(run.sums()) +
                                            offsetof(contrastive::device::kernels::step_sums, dbias));
    const status biases = O::has_bias ? comm_.allreduce(dbias, 1, reduce_op::sum) : status{};
    CONTRASTIVE_RETURN_IF_ERROR(sums);
    CONTRASTIVE_RETURN_IF_ERROR(fails);
    CONTRASTIVE_RETURN_IF_ERROR(maxes);
    CONTRASTIVE_RETURN_IF_ERROR(biases);
    float any_failed = 0.0f;
    CONTRASTIVE_RETURN_IF_ERROR(
        cuda(cudaMemcpyAsync(&any_failed, red + 5, sizeof any_failed, cudaMemcpyDeviceToHost, stream)));
    CONTRASTIVE_RETURN_IF_ERROR(cuda(cudaStreamSynchronize(stream)));
    if (any_failed != 0.0f)
    {
      return {errc::cuda_error,
              "cuda",
              std::string("a CUDA or cuBLAS call failed on ") + (any_failed > 1.5f ? "several ranks" : "one rank") +
                  " during the step (this rank: " +
                  (local_err == cudaSuccess ? "none" : cudaGetErrorString(local_err)) + "); no policy changed",
              {local_err == cudaSuccess ? native_api::none : native_api::cuda, static_cast<int>(local_err)}};
    }
    nccl_kernels::unpack_results<><<<1, 1, 0, stream>>>(red, run.sums(), run.flags());
    return cuda(run.finish(d_state, g_.n_q_total, n)); // its cudaPeekAtLastError also sees unpack's launch
  }

public:
  /// This rank's own gradients (device), as on one GPU.
  status unscale_and_check(float* grads, std::size_t n, state_type* d_state, cudaStream_t stream = nullptr)
  {
    return cuda(single::unscale_and_check(grads, n, d_state, stream));
  }

  /// Step 4 (collective): every rank takes the earliest non-finite site over all ranks, then steps its policies.
  /// Its first collective is forward_backward's (the agreement's all-gather), so a rank in another call or at another
  /// step is refused on every rank. If any rank has no pending step (or no state, or its device failed reading it),
  /// every rank returns an error and none steps.
  status finish_step(state_type* d_state, cudaStream_t stream = nullptr)
  {
    comm_.set_stream(stream);
    constexpr auto none = static_cast<std::int32_t>(nonfinite_site::none);
    constexpr std::int32_t none_on_device = 1 << 30; // site_out's "none" (so that a minimum finds the earliest)
    status local;
    bool pending = false;
    std::int32_t site = none;
    if (small_ == nullptr)
    {
      (void)(local = no_small_buffer());
    }
    else if (d_state == nullptr)
    {
      (void)(local = status{errc::null_pointer, "d_state", "null device state"});
    }
    else
    {
      std::int32_t mine[2] = {none_on_device, -1};
      nccl_kernels::site_out<state_type><<<1, 1, 0, stream>>>(d_state, small_site());
      cudaError_t e = cudaPeekAtLastError();
      if (e == cudaSuccess)
      {
        e = cudaMemcpyAsync(mine, small_site(), sizeof mine, cudaMemcpyDeviceToHost, stream);
      }
      if (e == cudaSuccess)
      {
        e = cudaStreamSynchronize(stream);
      }
      if (e != cudaSuccess)
      {
        (void)(local = cuda(e));
      }
      else
      {
        pending = mine[1] == 0;
        site = mine[0] == none_on_device ? none : mine[0];
      }
    }
    // Every rank reaches this collective, whatever failed above.
    CONTRASTIVE_RETURN_IF_ERROR(agreement::agree_on_finish(comm_, steps_, iteration_, pending, local, site));
    const std::int32_t agreed[2] = {site == none ? none_on_device : site, 0}; // pageable: copied before return
    CONTRASTIVE_RETURN_IF_ERROR(
        cuda(cudaMemcpyAsync(small_site(), agreed, sizeof agreed, cudaMemcpyHostToDevice, stream)));
    nccl_kernels::site_in<state_type><<<1, 1, 0, stream>>>(d_state, small_site());
    CONTRASTIVE_RETURN_IF_ERROR(cuda(cudaPeekAtLastError()));
    CONTRASTIVE_RETURN_IF_ERROR(cuda(single::finish_step(d_state, stream)));
    // Saturates, as the host losses' count does (every rank holds the same count, so all saturate together). A rank
    // whose device failed above does not count the step: its next call is refused on every rank.
    steps_ = detail::saturating_increment(steps_);
    return {};
  }

  /// forward_backward, then finish_step (collective); the first error is returned and the rest not run.
  status step(const problem<Element>& p,
              Element* dq,
              Element* dk,
              state_type* d_state,
              cudaStream_t stream = nullptr,
              std::int64_t iteration = no_iteration)
  {
    CONTRASTIVE_RETURN_IF_ERROR(forward_backward(p, dq, dk, d_state, stream, iteration));
    return finish_step(d_state, stream);
  }

private:
  /// The loss's own device constants and finish_step's agreement buffer (allocated and written at construction).
  struct small_buffer
  {
    float flag[2];        ///< 0 and 1: the failure flag forward_backward sends
    std::int32_t site[2]; ///< finish_step: this rank's first non-finite site and pending flag, then the agreed site
  };

  /// Why every call is refused when the small buffer could not be allocated at construction.
  static status no_small_buffer()
  {
    return {errc::resource_exhausted,
            "memory",
            "the loss's " + std::to_string(sizeof(small_buffer)) +
                "-byte device buffer could not be allocated at construction"};
  }

  const float* small_flags() const noexcept
  {
    return reinterpret_cast<const float*>(reinterpret_cast<const char*>(small_) + offsetof(small_buffer, flag));
  }
  std::int32_t* small_site() const noexcept
  {
    return reinterpret_cast<std::int32_t*>(reinterpret_cast<char*>(small_) + offsetof(small_buffer, site));
  }

  /// The distributed buffers after the chunked runner's (byte offsets).
  struct extras
  {
    std::size_t k_all, labels, col_max, col_pack, dk_local, red, total;
  };

  static status cuda(cudaError_t e)
  {
    if (e == cudaSuccess)
    {
      return {};
    }
    return {errc::cuda_error,
            "cuda",
            std::string("a CUDA or cuBLAS call failed: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e),
            {native_api::cuda, static_cast<int>(e)}};
  }

  /// The distributed buffers laid out from byte offset `base` (after the chunked runner's), for n global keys.
  static extras extras_after(const problem<Element>& p, std::size_t n, std::size_t base) noexcept
  {
    extras x{};
    contrastive::device::util::carver c{base};
    x.k_all = c.take(n * p.dim * sizeof(Element));
    x.labels = c.take(p.n_q * sizeof(std::int32_t));
    x.col_max = c.take(n * sizeof(float));
    x.col_pack = c.take(2 * n * sizeof(float));
    x.dk_local = c.take(p.n_k * p.dim * sizeof(float));
    x.red = c.take(8 * sizeof(float));
    x.total = c.offset;
    return x;
  }

  /// What a default chunk size was chosen for (this rank's rows, the global keys, dim, objective).
  struct layout_key
  {
    std::size_t n_q, n_k, dim;
    objective code;
    bool operator==(const layout_key& o) const noexcept
    {
      return n_q == o.n_q && n_k == o.n_k && dim == o.dim && code == o.code;
    }
  };

  /// Lays out the workspace for this rank's block and grows it if needed (runs after the global facts are known).
  status size_workspace(const problem<Element>& p, const agreement::global_shape& g)
  {
    // The step reads K from k_all (carved from the workspace, 256-byte aligned), not from p.k: the layout (and
    // chunk_options::fused_tiles's alignment test) sees that pointer's alignment, which null stands for.
    problem<Element> block = p;
    block.k = nullptr;
    block.n_k = g.n_k_total;
    const std::size_t n = g.n_k_total;
    // The default chunk is sized once per shape, from the free memory (this loss's own workspace counted as free:
    // it is reused or regrown) less the buffers below, and then kept: a later step's free memory, lowered by the
    // workspace itself, does not change the rows and with them the order of dK's sums.
    const layout_key key{p.n_q, n, p.dim, objectives::code_of(p)};
    cudaError_t laid = cudaSuccess;
    if (!single::is_default(opts_))
    {
      laid = single::make_layout(block, opts_, w_);
    }
    else if (sized_for_ && *sized_for_ == key)
    {
      const bool tiles = w_.tiles;
      std::size_t cub = 0;
      laid = single::layout_for_rows(block, tiles, w_.chunk_rows, cub, w_);
    }
    else
    {
      const std::size_t free_now = contrastive::device::chunked_phases::device_free_bytes();
      const std::size_t extras = extras_after(p, n, 0).total;
      const std::size_t avail = free_now == 0 ? 0 : free_now + ws_bytes_;
      laid = single::make_layout(block, opts_, avail > extras ? avail - extras : 0, w_);
    }
    if (laid != cudaSuccess)
    {
      sized_for_.reset();
      return {errc::size_overflow, "n_k", "this rank's workspace for the global batch does not fit in size_t bytes"};
    }
    sized_for_ = key;
    x_ = extras_after(p, n, w_.total);
    if (x_.total > ws_bytes_)
    {
      cudaFree(ws_);
      ws_ = nullptr;
      ws_bytes_ = 0;
      if (cudaMalloc(&ws_, x_.total) != cudaSuccess)
      {
        cudaGetLastError();
        sized_for_.reset(); // the next call sizes a default chunk again, from the memory free then
        return {errc::resource_exhausted, "memory", "cudaMalloc of " + std::to_string(x_.total) + " bytes failed"};
      }
      ws_bytes_ = x_.total;
    }
    return {};
  }

  comm::nccl comm_;
  cublasHandle_t handle_;
  chunk_options opts_;
  agreement::global_shape g_;
  contrastive::device::chunked_phases::layout w_{};
  std::optional<layout_key> sized_for_; ///< the shape w_'s default chunk rows were sized for (none: size again)
  extras x_{};
  void* ws_ = nullptr;
  std::size_t ws_bytes_ = 0;
  small_buffer* small_ = nullptr;         ///< null if its allocation failed (every call then refused on every rank)
  std::int64_t steps_ = 0;                ///< finished steps (agreed)
  std::int64_t iteration_ = no_iteration; ///< the caller's iteration of the last agreed forward_backward
};
} // namespace distributed
} // namespace contrastive
