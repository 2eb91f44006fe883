// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Device API, in CUB's style: a two-phase workspace (a null `d_temp` writes the bytes needed and returns), a
/// stream, a `cudaError_t` result. Every CUDA call is checked; nothing aborts or prints.
///
///   using L = contrastive::device::loss<__half, temperature::clamped, scaler::dynamic, algorithm::fused>;
///   L::state_type host_state;                    // built and validated on the host with L::make_state(...)
///   L::upload_state(host_state, d_state, stream); // policies and the step record live in device memory
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
///
/// Layers: this header checks the caller's arguments; device/dispatch.cuh sizes and carves the workspace, chooses the
/// kernels' compile-time configuration and launches them; device/kernels.cuh holds the kernels.

#include <contrastive/checks.hpp>
#include <contrastive/device/dispatch.cuh>
#include <contrastive/device/kernels.cuh>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/policy/bias.hpp>
#include <contrastive/policy/range_guard.hpp>
#include <contrastive/policy/scaler.hpp>
#include <contrastive/policy/temperature.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

namespace contrastive
{
namespace device
{
/// Policies, step counter and the last step record, in device memory; the sigmoid objective's logit bias after them.
template <class Temperature, class Scaler>
struct state
{
  Temperature temperature; ///< the temperature policy, moved by finish_step after a finite step
  Scaler scaler;           ///< the loss scaler, updated by every finish_step
  std::int64_t step;       ///< steps finished (finish_step calls, skipped steps included)
  step_record record;      ///< the last step's record (pending from forward_backward to finish_step)
  /// The sigmoid objective's logit bias (z = s <q, k> + b; algorithm::chunked), fixed or learnable, moved by
  /// finish_step after a finite sigmoid step as the host loss moves it. The softmax objectives neither read nor move
  /// it (they are invariant to a bias).
  logit_bias bias;
  std::int32_t bias_step; ///< 1 from a sigmoid step's forward_backward to its finish_step: the bias moves then
};

/// The device training step (see the file comment): static calls over a state in device memory, for
/// algorithm::fused and algorithm::materialized; algorithm::chunked is its specialization in device/chunked.cuh.
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
  /// The policies, step count and step record the calls read and write, in device memory.
  using state_type = state<Temperature, Scaler>;
  /// A validated initial state (copy it to device memory with upload_state), with a logit bias fixed at 0.
  static status make_state(const Temperature& t, const Scaler& s, state_type& out)
  {
    return make_state(t, s, logit_bias{}, out);
  }

  /// The same with the sigmoid objective's logit bias `b` (`logit_bias::fixed(b)`, or `logit_bias::learnable(b,
  /// optimizer)`: SigLIP and open_clip start at -10 with t = 10; invalid_argument "logit_bias" when invalid).
  static status make_state(const Temperature& t, const Scaler& s, const logit_bias& b, state_type& out)
  {
    if (const char* why = t.validate(); why[0] != '\0')
    {
      return {errc::invalid_temperature, "temperature", why};
    }
    if (const char* why = s.validate(); why[0] != '\0')
    {
      return {errc::invalid_scaler, "scaler", why};
    }
    if (const char* why = b.validate(); why[0] != '\0')
    {
      return {errc::invalid_argument, "logit_bias", why};
    }
    out = state_type{t, s, 0, step_record{}, b, 0};
    return {};
  }

  /// Writes `st` (make_state's, or a state copied back earlier) to `d_state`, in order on `stream`: the state is the
  /// argument of a one-thread kernel, so nothing is copied from pageable memory, the host does not wait for the
  /// stream, `st` may go out of scope on return, and a CUDA graph capturing the stream captures the value (a
  /// cudaMemcpyAsync from pageable memory is staged by the driver, which may wait for the stream first). Null
  /// d_state: cudaErrorInvalidValue, nothing launched.
  [[nodiscard]] static cudaError_t upload_state(const state_type& st, state_type* d_state, cudaStream_t stream = 0)
  {
    static_assert(std::is_trivially_copyable_v<state_type> && sizeof(state_type) <= 4096,
                  "a kernel argument: trivially copyable, at most 4 KiB");
    if (d_state == nullptr)
    {
      return cudaErrorInvalidValue;
    }
    kernels::store_state<state_type><<<1, 1, 0, stream>>>(d_state, st);
    return cudaPeekAtLastError();
  }

  /// The workspace bytes forward_backward and step need for a problem: the same answer as their size query
  /// (`d_temp` null), without checking the problem's pointers. A problem whose workspace does not fit in size_t bytes
  /// is refused with cudaErrorInvalidValue.
  static cudaError_t workspace_bytes(const problem<Element>& p, std::size_t& bytes)
  {
    typename dispatch_type::layout w{};
    CONTRASTIVE_CUDA_TRY(dispatch_type::make_layout(p, w));
    bytes = w.total;
    return cudaSuccess;
  }

  /// Why forward_backward and step refuse these arguments (cudaErrorInvalidValue), as a status naming the argument
  /// and saying what is wrong: the host's problem checks (labels not read: they are device memory), the state
  /// pointer, the device path's objectives and size limits. Host code, no CUDA call: callers that want the reason
  /// (the PyTorch binding) ask first. A workspace that is too small or misaligned is refused by the call only.
  static status check(const problem<Element>& p, const Element* dq, const Element* dk, const state_type* d_state)
  {
    CONTRASTIVE_RETURN_IF_ERROR(check_problem(p, dq, dk, true, /*check_labels=*/false));
    CONTRASTIVE_RETURN_IF_ERROR(check_device_problem(p));
    if (d_state == nullptr)
    {
      return {errc::null_pointer, "d_state", "null device state (make_state, then upload_state)"};
    }
    CONTRASTIVE_RETURN_IF_ERROR(util::row_pass_objective(p));
    return util::device_limits(p);
  }

  /// Steps 1-3: forward and backward at the state's tau and loss scale; fills `d_state->record` (pending). Checks the
  /// arguments here (`check`); the workspace, the configuration and the launches are the dispatch layer's
  /// (device/dispatch.cuh).
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
    if (!check(p, dq, dk, d_state).ok())
    {
      return cudaErrorInvalidValue;
    }
    return dispatch_type::dispatch(d_temp, temp_bytes, p, dq, dk, d_state, stream);
  }

  /// forward_backward with a status instead of a cudaError_t, for callers that report errors to people (the PyTorch
  /// binding): an argument the call refuses is named (`check`; a workspace too small, errc::workspace_too_small
  /// "temp_bytes", or misaligned, "d_temp"), and a CUDA failure names the call with CUDA's own code in
  /// status::native(). The same work, size query included.
  static status forward_backward_status(void* d_temp,
                                        std::size_t& temp_bytes,
                                        const problem<Element>& p,
                                        Element* dq,
                                        Element* dk,
                                        state_type* d_state,
                                        cudaStream_t stream = 0)
  {
    CONTRASTIVE_RETURN_IF_ERROR(check(p, dq, dk, d_state));
    if (d_temp != nullptr)
    {
      std::size_t needed = 0;
      CONTRASTIVE_RETURN_IF_ERROR(detail::cuda_status(workspace_bytes(p, needed), "workspace_bytes"));
      CONTRASTIVE_RETURN_IF_ERROR(util::workspace_status(d_temp, temp_bytes, needed));
    }
    return detail::cuda_status(dispatch_type::dispatch(d_temp, temp_bytes, p, dq, dk, d_state, stream),
                               "forward_backward");
  }

  /// step with a status (see forward_backward_status).
  static status step_status(void* d_temp,
                            std::size_t& temp_bytes,
                            const problem<Element>& p,
                            Element* dq,
                            Element* dk,
                            state_type* d_state,
                            cudaStream_t stream = 0)
  {
    CONTRASTIVE_RETURN_IF_ERROR(forward_backward_status(d_temp, temp_bytes, p, dq, dk, d_state, stream));
    if (d_temp == nullptr)
    {
      return {};
    }
    return detail::cuda_status(finish_step(d_state, stream), "finish_step");
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

private:
  using dispatch_type = dispatch::loss_dispatch<Element, Algorithm::element_logits>;
};
} // namespace device
} // namespace contrastive
