// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `contrastive::device::core<Element, Algorithm>`: the policy-free device call, for frameworks that own the
/// temperature and the loss scaling themselves (PyTorch: the `logit_scale` parameter and its GradScaler); the device
/// counterpart of `contrastive::core` (core.hpp):
///   (problem, s, b, loss scale) -> loss, dQ, dK (Element, times the loss scale), d loss / d log s, d loss / d b,
///   the largest logit and the first non-finite site.
///
///   using C = contrastive::device::core<__nv_bfloat16, algorithm::chunked>;   // or fused, materialized
///   C::values_type* d_values;                          // device memory, sizeof(C::values_type) bytes
///   C::step(nullptr, bytes, p, s, b, loss_scale, dq, dk, d_values, handle, stream);  // size query
///   C::step(d_temp, bytes, p, s, b, loss_scale, dq, dk, d_values, handle, stream);   // the pass
///   // d_values->record: loss, grad_logit_scale (d loss / d log s), grad_logit_bias (d loss / d b), both already
///   // divided by the loss scale, max_logit, first_nonfinite; written in stream order (nothing synchronizes).
///
/// fused and materialized take `stream` after `d_values`; algorithm::chunked (device/chunked.cuh, cuBLAS) takes the
/// cuBLAS handle, then the stream and its chunk_options. No temperature, scaler or step count is kept: the call is
/// the device loss (device/loss.cuh) at the call's logit scale s and a static loss scale, whose state the call writes
/// into `d_values` in stream order before the pass (a kernel argument: nothing is copied from pageable memory, so the
/// call can be captured in a CUDA graph). `d_values` is the only thing besides dq, dk and the workspace that it
/// writes; a refused call writes none of them. The sigmoid objective's bias b is used as given; the softmax
/// objectives take b = 0 only (they are invariant to it).

#include <contrastive/checks.hpp>
#include <contrastive/detail/cuda_status.cuh>
#include <contrastive/device/loss.cuh>
#include <contrastive/device/util.cuh>
#include <contrastive/numeric/math.hpp>
#include <contrastive/policy/bias.hpp>
#include <contrastive/policy/scaler.hpp>
#include <contrastive/policy/temperature.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>

#include <cstddef>
#include <string>
#include <type_traits>

#include <cuda_runtime.h>

namespace contrastive
{
namespace detail
{
/// The temperature of a core call: the caller's logit scale s itself (a fixed temperature stores tau, and about one s
/// in seven is no float's reciprocal, so it would run at s off by an ulp). Nothing trains it; wants_gradient is true,
/// so a non-finite d loss / d log s is diagnosed, as contrastive::core diagnoses it.
struct given_logit_scale
{
  static constexpr bool is_learnable = false;
  static constexpr const char* name = "given";

  float s = 1.0f;

  CONTRASTIVE_HOST_DEVICE float scale() const noexcept
  {
    return s;
  }
  CONTRASTIVE_HOST_DEVICE float tau() const noexcept
  {
    return static_cast<float>(1.0 / static_cast<double>(s));
  }
  CONTRASTIVE_HOST_DEVICE bool wants_gradient() const noexcept
  {
    return true;
  }
  CONTRASTIVE_HOST_DEVICE void advance(float) noexcept {}
  CONTRASTIVE_HOST_DEVICE const char* validate() const noexcept
  {
    return s > 0.0f && detail::finite(s) && temperature::valid_tau(tau())
               ? ""
               : "it must be finite and > 0 (it is 1/tau), with |log(logit_scale)| <= 80";
  }
};
} // namespace detail

namespace device
{
/// Where a core call reads its logit scale s and logit bias b from device memory, in stream order, instead of
/// taking them as host numbers: nothing is read on the host, so a training step that hands its parameters' device
/// tensors over never waits for the device (and a CUDA graph can capture it with the pointers fixed and the values
/// changing between replays). `logit_scale` is one float (required); `bias` one float, or null for b = 0 (the softmax
/// objectives ignore it). A value the host call would refuse is reported by the step itself: an s that is not finite
/// and > 0 with |log s| <= 80, or a non-finite b, becomes NaN in the step, which then records first_nonfinite =
/// logits, a NaN loss and skipped = true.
struct device_scalars
{
  const float* logit_scale = nullptr; ///< s = 1 / tau, one float in device memory
  const float* bias = nullptr;        ///< the sigmoid objective's b, one float in device memory; null: b = 0
};

namespace kernels
{
/// Writes s and b from device memory into a core call's uploaded state (see device_scalars): a value the host call
/// would refuse becomes NaN, which the step reports as a non-finite logit.
template <class Values>
__global__ void read_device_scalars(Values* values, device_scalars from)
{
  const float s = *from.logit_scale;
  const bool s_ok = s > 0.0f && contrastive::detail::finite(s) && temperature::valid_tau(1.0f / s);
  values->temperature.s = s_ok ? s : __int_as_float(0x7fffffff);
  if (from.bias != nullptr)
  {
    const float b = *from.bias;
    values->bias.value = contrastive::detail::finite(b) ? b : __int_as_float(0x7fffffff);
  }
}
} // namespace kernels

/// The policy-free device call (see the file comment): loss and gradients at the logit scale, logit bias and loss
/// scale each call gives, results in device memory; it keeps no temperature, scaler or step count.
template <class Element, class Algorithm = algorithm::fused>
struct core
{
  /// The device loss this call runs: the call's logit scale and a static loss scale.
  using loss_type = loss<Element, detail::given_logit_scale, scaler::static_scale, Algorithm>;
  /// What a call writes its results into (device memory): `record` holds them (see the file comment); the policies
  /// beside it are the call's s and loss scale.
  using values_type = typename loss_type::state_type;

private:
  template <class A>
  using loss_of = loss<Element, detail::given_logit_scale, scaler::static_scale, A>;
  template <class A, class... Handle>
  static auto check_accepts(int) -> decltype(loss_of<A>::check(std::declval<const problem<Element>&>(),
                                                               std::declval<const Element*>(),
                                                               std::declval<const Element*>(),
                                                               std::declval<const values_type*>(),
                                                               std::declval<Handle>()...),
                                             std::true_type{});
  template <class A, class... Handle>
  static std::false_type check_accepts(...);
  /// Whether algorithm A's loss checks its arguments with these handles after the state: none for fused and
  /// materialized, a cuBLAS handle for algorithm::chunked. Decides which `step` applies.
  template <class A, class... Handle>
  static constexpr bool checks_with = decltype(check_accepts<A, Handle...>(0))::value;

  /// What both `step`s do before the pass, in this order, so that a refused call writes nothing: the numbers
  /// (make_values), d_values, the loss's argument check (`check`), and with a workspace its verdict (`needed` writes
  /// the bytes the pass needs) and then the upload of the call's state.
  template <class Check, class Needed>
  static status checked_upload(void* d_temp,
                               std::size_t temp_bytes,
                               objective code,
                               float logit_scale,
                               float bias,
                               float loss_scale,
                               values_type* d_values,
                               cudaStream_t stream,
                               Check check,
                               Needed needed)
  {
    values_type v;
    CONTRASTIVE_RETURN_IF_ERROR(make_values(code, logit_scale, bias, loss_scale, v));
    CONTRASTIVE_RETURN_IF_ERROR(check_values(d_values));
    CONTRASTIVE_RETURN_IF_ERROR(check());
    if (d_temp == nullptr)
    {
      return {};
    }
    std::size_t bytes = 0;
    CONTRASTIVE_RETURN_IF_ERROR(needed(bytes));
    CONTRASTIVE_RETURN_IF_ERROR(util::workspace_status(d_temp, temp_bytes, bytes));
    return detail::cuda_status(loss_type::upload_state(v, d_values, stream), "upload_state");
  }

public:
  /// Whether `step` takes a cuBLAS handle after d_values (algorithm::chunked) or the stream (fused, materialized).
  static constexpr bool needs_handle = !checks_with<Algorithm>;

  /// The state a call with these numbers uploads, validated (host code, no CUDA call): logit_scale s = 1/tau finite,
  /// > 0 and within the temperature policies' domain |log s| <= 80 (invalid_temperature "logit_scale"), loss_scale
  /// finite and > 0 (invalid_scaler "loss_scale"), the logit bias finite and 0 unless the objective is sigmoid
  /// (invalid_argument "logit_bias"). The host's contrastive::core takes any finite s > 0; the device's policies keep
  /// |log s| <= 80 (s in [1.8e-35, 5.5e34]).
  static status make_values(objective code, float logit_scale, float bias, float loss_scale, values_type& out)
  {
    const detail::given_logit_scale t{logit_scale};
    if (const char* why = t.validate(); why[0] != '\0')
    {
      return {errc::invalid_temperature, "logit_scale", "logit_scale = " + std::to_string(logit_scale) + "; " + why};
    }
    CONTRASTIVE_RETURN_IF_ERROR(check_loss_scale(loss_scale));
    CONTRASTIVE_RETURN_IF_ERROR(objectives::check_known(code));
    return objectives::visit(code,
                             [&](auto o)
                             {
                               return make_values_as<decltype(o)>(t, bias, loss_scale, out);
                             });
  }

private:
  /// make_values for objective O, after the scales' checks.
  template <class O>
  static status make_values_as(const detail::given_logit_scale& t, float bias, float loss_scale, values_type& out)
  {
    CONTRASTIVE_RETURN_IF_ERROR(objectives::check_logit_bias<O>(bias));
    // The sigmoid objective's bias is marked learnable so that the record flags a non-finite d loss / d b
    // (grad_logit_bias), as contrastive::core does; nothing moves it (a core call never finishes a step).
    const logit_bias b = O::has_bias ? logit_bias::learnable(bias) : logit_bias::fixed(bias);
    return loss_type::make_state(t, scaler::static_scale(loss_scale), b, out);
  }

public:
  /// A null `d_values` is refused (null_pointer "d_values"); its size is the caller's (sizeof(values_type)).
  static status check_values(const values_type* d_values)
  {
    if (d_values == nullptr)
    {
      return {errc::null_pointer, "d_values", "null results buffer (device memory of sizeof(values_type) bytes)"};
    }
    return {};
  }

  /// fused and materialized: one forward + backward pass of `loss_scale * loss` at logit scale s (and, sigmoid, logit
  /// bias b). A null d_temp writes the bytes needed to temp_bytes (and checks the arguments). Statuses as
  /// device::loss::forward_backward_status's: the argument refused, named; a CUDA failure with CUDA's code.
  template <class A = Algorithm, std::enable_if_t<checks_with<A>, int> = 0>
  static status step(void* d_temp,
                     std::size_t& temp_bytes,
                     const problem<Element>& p,
                     float logit_scale,
                     float bias,
                     float loss_scale,
                     Element* dq,
                     Element* dk,
                     values_type* d_values,
                     cudaStream_t stream = 0)
  {
    CONTRASTIVE_RETURN_IF_ERROR(checked_upload(
        d_temp,
        temp_bytes,
        objectives::code_of(p),
        logit_scale,
        bias,
        loss_scale,
        d_values,
        stream,
        [&]
        {
          return loss_type::check(p, dq, dk, d_values);
        },
        [&](std::size_t& needed)
        {
          return detail::cuda_status(loss_type::workspace_bytes(p, needed), "workspace_bytes");
        }));
    return loss_type::forward_backward_status(d_temp, temp_bytes, p, dq, dk, d_values, stream);
  }

  /// algorithm::chunked (include device/chunked.cuh): the same with the caller's cuBLAS handle, then the stream and
  /// the chunk options (see device/chunked.cuh).
  template <class Handle, class A = Algorithm, std::enable_if_t<checks_with<A, Handle>, int> = 0>
  static status step(void* d_temp,
                     std::size_t& temp_bytes,
                     const problem<Element>& p,
                     float logit_scale,
                     float bias,
                     float loss_scale,
                     Element* dq,
                     Element* dk,
                     values_type* d_values,
                     Handle handle,
                     cudaStream_t stream = 0,
                     const chunk_options& opts = {})
  {
    return chunked_pass(
        d_temp, temp_bytes, p, logit_scale, bias, loss_scale, dq, dk, d_values, handle, stream, opts, nullptr);
  }

  /// algorithm::chunked and automatic with s and b read from device memory (device_scalars): the same pass without
  /// a host read of either value. The arguments are checked as `step` checks them (null `from.logit_scale`:
  /// null_pointer "logit_scale"); the values are checked by the step on the device (see device_scalars).
  template <class Handle, class A = Algorithm, std::enable_if_t<checks_with<A, Handle>, int> = 0>
  static status step(void* d_temp,
                     std::size_t& temp_bytes,
                     const problem<Element>& p,
                     device_scalars from,
                     float loss_scale,
                     Element* dq,
                     Element* dk,
                     values_type* d_values,
                     Handle handle,
                     cudaStream_t stream = 0,
                     const chunk_options& opts = {})
  {
    if (from.logit_scale == nullptr)
    {
      return {errc::null_pointer, "logit_scale", "null device pointer to the logit scale"};
    }
    if (!objectives::traits_of(p).has_bias)
    {
      from.bias = nullptr; // the softmax objectives are invariant to a bias: b = 0
    }
    // The host numbers stand in (s = 1, b = 0, valid) for the checks and the upload; the kernel then writes the
    // device values over them before the pass, in stream order.
    return chunked_pass(d_temp, temp_bytes, p, 1.0f, 0.0f, loss_scale, dq, dk, d_values, handle, stream, opts, &from);
  }

private:
  /// The chunked and automatic pass: checks and upload at the host numbers (s, b), then, where `from` is given and
  /// this is the pass (not the size query), s and b from device memory over them, then forward and backward.
  template <class Handle>
  static status chunked_pass(void* d_temp,
                             std::size_t& temp_bytes,
                             const problem<Element>& p,
                             float logit_scale,
                             float bias,
                             float loss_scale,
                             Element* dq,
                             Element* dk,
                             values_type* d_values,
                             Handle handle,
                             cudaStream_t stream,
                             const chunk_options& opts,
                             const device_scalars* from)
  {
    CONTRASTIVE_RETURN_IF_ERROR(checked_upload(
        d_temp,
        temp_bytes,
        objectives::code_of(p),
        logit_scale,
        bias,
        loss_scale,
        d_values,
        stream,
        [&]
        {
          return loss_type::check(p, dq, dk, d_values, handle);
        },
        [&](std::size_t& needed)
        {
          typename loss_type::layout_type w{};
          const status st =
              detail::cuda_status(loss_type::layout_to_fit(p, opts, temp_bytes, w), "the workspace layout");
          needed = w.total;
          return st;
        }));
    if (from != nullptr && d_temp != nullptr) // the pass (a size query goes on to write the bytes it needs)
    {
      kernels::read_device_scalars<values_type><<<1, 1, 0, stream>>>(d_values, *from);
      CONTRASTIVE_RETURN_IF_ERROR(detail::cuda_status(cudaPeekAtLastError(), "read_device_scalars"));
    }
    return loss_type::forward_backward_status(d_temp, temp_bytes, p, dq, dk, d_values, handle, stream, opts);
  }
};
} // namespace device
} // namespace contrastive
