// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Device API, in CUB's style: a two-phase workspace (a null `d_temp` writes the bytes needed and returns), a
/// stream, a `cudaError_t` result. Every CUDA call is checked; nothing aborts or prints.
///
///   using L = contrastive::device::loss<__half, temperature::clamped, scaler::dynamic, algorithm::fused>;
///   L::state_type host_state;                    // built and validated on the host with L::make_state(...)
///   cudaMemcpy(d_state, &host_state, ...);       // policies and the step record live in device memory
///   size_t bytes = 0;
///   L::step(nullptr, bytes, problem, d_dq, d_dk, d_state, stream);   // size query
///   L::step(d_temp, bytes, problem, d_dq, d_dk, d_state, stream);    // forward, backward, scaler, temperature
///
/// The step reads tau and the loss scale from `d_state` and writes the updated policies and `d_state->record` back
/// with device kernels only, so a whole step can be captured in a CUDA graph; copy `record` to the host
/// asynchronously when you want to look at it. Problem pointers (q, k, labels) and dq/dk are device pointers.
///
/// Differences from the host path, by design: shapes and pointers are checked on the host (cudaErrorInvalidValue;
/// also for a workspace that is too small or not 256-byte aligned, n > 2^30 or dim > 2^24);
/// labels and input finiteness are not checked up front (that would need a host round trip): an out-of-range label
/// matches no key, which makes its row's loss infinite (the step is skipped, diagnosed `loss`), and non-finite inputs
/// surface as non-finite logits (skipped, diagnosed `logits`).

#include <contrastive/checks.hpp>
#include <contrastive/device/kernels.cuh>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/policy/range_guard.hpp>
#include <contrastive/policy/scaler.hpp>
#include <contrastive/policy/temperature.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>

#include <cub/device/device_reduce.cuh>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

namespace contrastive
{
namespace device
{
/// Policies, step counter and the last step record, in device memory.
template <class Temperature, class Scaler>
struct state
{
  Temperature temperature;
  Scaler scaler;
  std::int64_t step;
  step_record record;
};

namespace detail
{
inline std::size_t align256(std::size_t x) noexcept
{
  return (x + 255) / 256 * 256;
}

/// Sub-buffers of the workspace, 256-byte aligned.
struct workspace_layout
{
  std::size_t row_lse, row_loss, row_max, col_lse, col_loss, col_max, acc_q, acc_k, partials, sums, flags, scalars, cub,
      matrix, total;
  std::size_t n_partials, cub_bytes, ld_acc, nq_pad, nk_pad;
};

inline constexpr int elementwise_blocks = 1024;

/// The two CUB reductions of a step, one signature for the size query and the calls (the same offset type, int, and
/// the same operator: CUB sizes its temporary storage per offset type and operator). The max propagates NaN, so a NaN
/// row maximum reaches the record's max logit.
inline cudaError_t
reduce_sum(void* tmp, std::size_t& bytes, const float* in, float* out, int n, cudaStream_t stream = 0)
{
  return cub::DeviceReduce::Sum(tmp, bytes, in, out, n, stream);
}

inline cudaError_t
reduce_max(void* tmp, std::size_t& bytes, const float* in, float* out, int n, cudaStream_t stream = 0)
{
  return cub::DeviceReduce::Reduce(
      tmp, bytes, in, out, n, kernels::nan_max{}, -contrastive::detail::infinity_f, stream);
}

#define CONTRASTIVE_CUDA_TRY(expr)                                                                                     \
  do                                                                                                                   \
  {                                                                                                                    \
    const cudaError_t contrastive_err_ = (expr);                                                                       \
    if (contrastive_err_ != cudaSuccess)                                                                               \
      return contrastive_err_;                                                                                         \
  } while (0)
} // namespace detail

template <class Element,
          class Temperature = temperature::learnable,
          class Scaler = scaler::static_scale,
          class Algorithm = algorithm::fused>
struct loss
{
  static_assert(is_element_type_v<Element>, "Element must be float, __half or __nv_bfloat16");
  static_assert(temperature::is_temperature_policy_v<Temperature>, "Temperature must be a temperature policy");
  static_assert(scaler::is_scaler_policy_v<Scaler>, "Scaler must be a scaler policy");
  static_assert(is_algorithm_v<Algorithm>,
                "Algorithm must be algorithm::fused, algorithm::materialized or algorithm::chunked");
  static_assert(!std::is_same_v<Algorithm, algorithm::chunked>,
                "algorithm::chunked on the device needs #include <contrastive/device/chunked.cuh> and cuBLAS "
                "(CMake: link contrastive::cublas)");
  using state_type = state<Temperature, Scaler>;
  using traits = kernel_traits<Element>;
  static constexpr bool materialized = std::is_same_v<Algorithm, algorithm::materialized>;

  /// A validated initial state (copy it to device memory yourself).
  static status make_state(const Temperature& t, const Scaler& s, state_type& out)
  {
    if (const char* why = t.validate(); why[0] != '\0')
    {
      return {errc::invalid_temperature, "temperature", why};
    }
    if (const char* why = s.validate(); why[0] != '\0')
    {
      return {errc::invalid_scaler, "scaler", why};
    }
    out = state_type{t, s, 0, step_record{}};
    return {};
  }

  /// Workspace layout for a problem (also the size query). Every size is computed without wrapping: a problem whose
  /// workspace does not fit in size_t bytes is refused with cudaErrorInvalidValue before any CUDA call.
  static cudaError_t layout(const problem<Element>& p, detail::workspace_layout& w)
  {
    {
      using contrastive::detail::checked_size;
      const checked_size nq_pad = contrastive::detail::round_up(checked_size(p.n_q), traits::block_m);
      const checked_size nk_pad = contrastive::detail::round_up(checked_size(p.n_k), traits::block_m);
      const checked_size ld = contrastive::detail::round_up(checked_size(p.dim), traits::d_chunk);
      const checked_size f = sizeof(float);
      // Generous bound on the sum of the aligned sub-buffers: 16 x 256 bytes of alignment slack, the statistics, the
      // accumulators and the materialized matrix.
      checked_size bound = checked_size(16 * 256) + checked_size(3) * (checked_size(p.n_q) + p.n_k) * f +
                           (nq_pad + nk_pad) * ld * f + checked_size(detail::elementwise_blocks) * f;
      if (materialized)
      {
        bound = bound + checked_size(p.n_q) * checked_size(p.n_k) * sizeof(Element);
      }
      if (!bound.ok())
      {
        return cudaErrorInvalidValue;
      }
    }
    const std::size_t bm = traits::block_m;
    w.nq_pad = (p.n_q + bm - 1) / bm * bm;
    w.nk_pad = (p.n_k + bm - 1) / bm * bm;
    w.ld_acc = (p.dim + traits::d_chunk - 1) / traits::d_chunk * traits::d_chunk;
    w.n_partials = materialized ? static_cast<std::size_t>(detail::elementwise_blocks) : w.nq_pad / bm;
    // The calls' own counts are ints (n <= 2^30 is checked before any layout is used for a launch); query with the
    // largest of them through the same functions the calls use.
    const int n_max = static_cast<int>(std::min<std::size_t>(std::max(std::max(p.n_q, p.n_k), w.n_partials), 1u << 30));
    std::size_t sum_bytes = 0, max_bytes = 0;
    CONTRASTIVE_CUDA_TRY(detail::reduce_sum(nullptr, sum_bytes, nullptr, nullptr, n_max));
    CONTRASTIVE_CUDA_TRY(detail::reduce_max(nullptr, max_bytes, nullptr, nullptr, n_max));
    w.cub_bytes = std::max(sum_bytes, max_bytes);
    std::size_t off = 0;
    auto take = [&](std::size_t bytes)
    {
      const std::size_t at = off;
      off += detail::align256(bytes);
      return at;
    };
    w.row_lse = take(p.n_q * sizeof(float));
    w.row_loss = take(p.n_q * sizeof(float));
    w.row_max = take(p.n_q * sizeof(float));
    w.col_lse = take(p.n_k * sizeof(float));
    w.col_loss = take(p.n_k * sizeof(float));
    w.col_max = take(p.n_k * sizeof(float));
    w.acc_q = take(w.nq_pad * w.ld_acc * sizeof(float));
    w.acc_k = take(w.nk_pad * w.ld_acc * sizeof(float));
    w.partials = take(w.n_partials * sizeof(float));
    w.sums = take(sizeof(kernels::step_sums));
    w.flags = take(3 * sizeof(int)); // logits, dQ, dK non-finite
    w.scalars = take(sizeof(kernels::step_scalars));
    w.cub = take(w.cub_bytes);
    w.matrix = take(materialized ? p.n_q * p.n_k * sizeof(Element) : 0);
    w.total = off;
    return cudaSuccess;
  }

  /// Steps 1-3: forward and backward at the state's tau and loss scale; fills `d_state->record` (pending).
  [[nodiscard]] static cudaError_t forward_backward(void* d_temp,
                                                    std::size_t& temp_bytes,
                                                    const problem<Element>& p,
                                                    Element* dq,
                                                    Element* dk,
                                                    state_type* d_state,
                                                    cudaStream_t stream = 0)
  {
    // Labels are device memory: their range is not read here (see the file comment). check_problem also refuses
    // sizes whose byte counts overflow and outputs that overlap each other or the inputs.
    if (!check_problem(p, dq, dk, true, /*check_labels=*/false).ok() || d_state == nullptr || p.n_q > (1u << 30) ||
        p.n_k > (1u << 30) || p.dim > (1u << 24))
    {
      return cudaErrorInvalidValue;
    }
    detail::workspace_layout w{};
    CONTRASTIVE_CUDA_TRY(layout(p, w));
    if (d_temp == nullptr)
    {
      temp_bytes = w.total;
      return cudaSuccess;
    }
    if (temp_bytes < w.total || reinterpret_cast<std::uintptr_t>(d_temp) % 256 != 0)
    {
      return cudaErrorInvalidValue; // workspace too small, or not 256-byte aligned (cudaMalloc memory always is)
    }
    char* base = static_cast<char*>(d_temp);
    auto f = [&](std::size_t off)
    {
      return reinterpret_cast<float*>(base + off);
    };
    int* flags = reinterpret_cast<int*>(base + w.flags);
    auto* scalars = reinterpret_cast<kernels::step_scalars*>(base + w.scalars);
    auto* sums = reinterpret_cast<kernels::step_sums*>(base + w.sums);
    const bool sym = p.obj == objective::symmetric;
    const int n_q = static_cast<int>(p.n_q), n_k = static_cast<int>(p.n_k), dim = static_cast<int>(p.dim);
    const grad_coefficients gc = make_grad_coefficients(p.obj, p.n_q, p.n_k);

    CONTRASTIVE_CUDA_TRY(cudaMemsetAsync(flags, 0, 3 * sizeof(int), stream));
    CONTRASTIVE_CUDA_TRY(cudaMemsetAsync(sums, 0, sizeof(kernels::step_sums), stream));
    CONTRASTIVE_CUDA_TRY(cudaMemsetAsync(f(w.acc_q), 0, w.nq_pad * w.ld_acc * sizeof(float), stream));
    CONTRASTIVE_CUDA_TRY(cudaMemsetAsync(f(w.acc_k), 0, w.nk_pad * w.ld_acc * sizeof(float), stream));
    kernels::prologue<state_type><<<1, 1, 0, stream>>>(d_state, scalars);
    CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());

    kernels::pass_args rows{};
    rows.a = p.q;
    rows.b = p.k;
    rows.n_a = n_q;
    rows.n_b = n_k;
    rows.dim = dim;
    rows.ld_acc = static_cast<int>(w.ld_acc);
    rows.labels = p.labels;
    rows.pos = p.labels != nullptr ? kernels::positive_mode::row_label : kernels::positive_mode::diagonal;
    rows.matrix = base + w.matrix;
    rows.matrix_ld = n_k;
    rows.scalars = scalars;
    rows.flags = flags;
    kernels::pass_args cols = rows;
    cols.a = p.k;
    cols.b = p.q;
    cols.n_a = n_k;
    cols.n_b = n_q;
    cols.pos = p.labels != nullptr ? kernels::positive_mode::col_label : kernels::positive_mode::diagonal;

    const dim3 block(traits::threads);
    const dim3 row_grid(static_cast<unsigned>(w.nq_pad / traits::block_m));
    const dim3 col_grid(static_cast<unsigned>(w.nk_pad / traits::block_m));
    constexpr kernels::source src_rows = materialized ? kernels::source::matrix : kernels::source::compute;
    constexpr kernels::source src_cols = materialized ? kernels::source::matrix_transposed : kernels::source::compute;

    // Forward.
    if constexpr (materialized)
    {
      const long long tiles = static_cast<long long>(w.nq_pad / traits::block_m) * (w.nk_pad / traits::block_n);
      const dim3 grid(static_cast<unsigned>(std::min<long long>(tiles, 1 << 20)));
      kernels::materialize_logits<Element><<<grid, block, 0, stream>>>(rows);
      CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    }
    rows.lse = f(w.row_lse);
    rows.loss = f(w.row_loss);
    rows.max_logit = f(w.row_max);
    kernels::forward_pass<Element, src_rows><<<row_grid, block, 0, stream>>>(rows);
    CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    if (sym)
    {
      cols.lse = f(w.col_lse);
      cols.loss = f(w.col_loss);
      cols.max_logit = f(w.col_max);
      kernels::forward_pass<Element, src_cols><<<col_grid, block, 0, stream>>>(cols);
      CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    }

    // Backward.
    rows.acc = f(w.acc_q);
    rows.out = dq;
    rows.flag_index = 1;
    cols.acc = f(w.acc_k);
    cols.out = dk;
    cols.flag_index = 2;
    if constexpr (materialized)
    {
      kernels::materialized_gradient<Element><<<detail::elementwise_blocks, 256, 0, stream>>>(
          [&]
          {
            kernels::pass_args e = rows;
            e.dlogs_partial = f(w.partials);
            return e;
          }(),
          f(w.row_lse),
          sym ? f(w.col_lse) : nullptr,
          gc);
      CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
      rows.out_is_final = cols.out_is_final = true;
    }
    else
    {
      rows.lse_a = f(w.row_lse);
      rows.loss_a = f(w.row_loss);
      rows.coef_a = gc.row_coef;
      rows.lse_b = sym ? f(w.col_lse) : nullptr;
      rows.loss_b = sym ? f(w.col_loss) : nullptr;
      rows.coef_b = sym ? gc.col_coef : 0.0f;
      rows.coef_pos = gc.pos_coef;
      rows.dlogs_partial = f(w.partials);
      // dK: rows are keys, columns queries; G^T_ji = col_coef C_ij + row_coef P_ij - pos.
      cols.lse_a = sym ? f(w.col_lse) : nullptr;
      cols.loss_a = sym ? f(w.col_loss) : nullptr;
      cols.loss_b = f(w.row_loss);
      cols.coef_a = sym ? gc.col_coef : 0.0f;
      cols.lse_b = f(w.row_lse);
      cols.coef_b = gc.row_coef;
      cols.coef_pos = gc.pos_coef;
    }
    kernels::backward_pass<Element, src_rows><<<row_grid, block, 0, stream>>>(rows);
    CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    kernels::backward_pass<Element, src_cols><<<col_grid, block, 0, stream>>>(cols);
    CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());

    // Reductions (CUB) and the record.
    void* cub_tmp = base + w.cub;
    std::size_t cub_bytes = w.cub_bytes;
    CONTRASTIVE_CUDA_TRY(detail::reduce_sum(cub_tmp, cub_bytes, f(w.row_loss), &sums->row_loss, n_q, stream));
    if (sym)
    {
      cub_bytes = w.cub_bytes;
      CONTRASTIVE_CUDA_TRY(detail::reduce_sum(cub_tmp, cub_bytes, f(w.col_loss), &sums->col_loss, n_k, stream));
    }
    cub_bytes = w.cub_bytes;
    CONTRASTIVE_CUDA_TRY(detail::reduce_sum(cub_tmp,
                                            cub_bytes,
                                            f(w.partials),
                                            &sums->dlogs,
                                            static_cast<int>(materialized ? w.n_partials : row_grid.x),
                                            stream));
    cub_bytes = w.cub_bytes;
    CONTRASTIVE_CUDA_TRY(detail::reduce_max(cub_tmp, cub_bytes, f(w.row_max), &sums->max_logit, n_q, stream));
    kernels::finish_forward_backward<state_type>
        <<<1, 1, 0, stream>>>(d_state, scalars, sums, flags, n_q, n_k, sym ? 1 : 0, materialized ? 1 : 0);
    return cudaPeekAtLastError();
  }

  /// One pass over a caller gradient buffer: unscale in place and flag non-finite values (site `parameters`).
  [[nodiscard]] static cudaError_t
  unscale_and_check(float* grads, std::size_t n, state_type* d_state, cudaStream_t stream = 0)
  {
    if (d_state == nullptr || (grads == nullptr && n != 0))
    {
      return cudaErrorInvalidValue;
    }
    if (n == 0)
    {
      return cudaSuccess;
    }
    const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((n + 255) / 256, 1024));
    kernels::unscale_and_check<state_type><<<blocks, 256, 0, stream>>>(grads, static_cast<long long>(n), d_state);
    return cudaPeekAtLastError();
  }

  /// Step 4: scaler update, then the temperature update if the step was finite; increments the step counter.
  [[nodiscard]] static cudaError_t finish_step(state_type* d_state, cudaStream_t stream = 0)
  {
    if (d_state == nullptr)
    {
      return cudaErrorInvalidValue;
    }
    kernels::finish_step<Element, state_type><<<1, 1, 0, stream>>>(d_state);
    return cudaPeekAtLastError();
  }

  /// A whole step: forward_backward then finish_step.
  [[nodiscard]] static cudaError_t step(void* d_temp,
                                        std::size_t& temp_bytes,
                                        const problem<Element>& p,
                                        Element* dq,
                                        Element* dk,
                                        state_type* d_state,
                                        cudaStream_t stream = 0)
  {
    CONTRASTIVE_CUDA_TRY(forward_backward(d_temp, temp_bytes, p, dq, dk, d_state, stream));
    if (d_temp == nullptr)
    {
      return cudaSuccess;
    }
    return finish_step(d_state, stream);
  }
};
} // namespace device
} // namespace contrastive
