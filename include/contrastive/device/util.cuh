// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What every device algorithm shares on the host side (device::util): `CONTRASTIVE_CUDA_TRY`, the CUB-style
/// two-phase workspace protocol and the workspace carver, the two CUB reductions of a step and their sizes, the
/// device path's limits as a status, and the one place where runtime flags become template arguments.

#include <contrastive/detail/checked.hpp>
#include <contrastive/detail/cuda_status.cuh>
#include <contrastive/device/kernels/args.cuh>
#include <contrastive/numeric/math.hpp>
#include <contrastive/objectives/objectives.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>

#include <cub/device/device_reduce.cuh>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <cuda_runtime.h>

#define CONTRASTIVE_CUDA_TRY(expr)                                                                                     \
  do                                                                                                                   \
  {                                                                                                                    \
    const cudaError_t contrastive_err_ = (expr);                                                                       \
    if (contrastive_err_ != cudaSuccess)                                                                               \
      return contrastive_err_;                                                                                         \
  } while (0)

namespace contrastive
{
namespace device
{
namespace util
{
inline std::size_t align256(std::size_t x) noexcept
{
  return (x + 255) / 256 * 256;
}

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
  return cub::DeviceReduce::Reduce(tmp, bytes, in, out, n, kernels::nan_max{}, -detail::infinity_f, stream);
}

/// Whether a device algorithm other than algorithm::chunked runs this objective, as a status naming the argument:
/// the sigmoid objective runs on the device with algorithm::chunked only (refused here instead of computed as a
/// softmax loss).
template <class Problem>
status row_pass_objective(const Problem& p)
{
  if (!objectives::traits_of(p).softmax)
  {
    return {errc::invalid_argument,
            objectives::field,
            "the sigmoid objective runs on the device with algorithm::chunked (device/chunked.cuh) only; fused and "
            "materialized: on the host"};
  }
  return {};
}

/// The device path's size limits, as a status naming the argument (host code: no CUDA call; its kernels index with
/// int and 32-bit grid dimensions): n_q, n_k <= 2^30, dim <= 2^24.
template <class Problem>
status device_limits(const Problem& p)
{
  if (p.n_q > (std::size_t(1) << 30) || p.n_k > (std::size_t(1) << 30) || p.dim > (std::size_t(1) << 24))
  {
    return {errc::size_overflow,
            p.dim > (std::size_t(1) << 24)   ? "dim"
            : p.n_q > (std::size_t(1) << 30) ? "n_q"
                                             : "n_k",
            "the device path takes n_q, n_k <= 2^30 and dim <= 2^24 (n_q = " + std::to_string(p.n_q) +
                ", n_k = " + std::to_string(p.n_k) + ", dim = " + std::to_string(p.dim) + ")"};
  }
  return {};
}

/// The CUB-style two-phase workspace protocol: with a null d_temp, writes `needed` to temp_bytes and answers true
/// (`query`); otherwise checks that the workspace is large enough and 256-byte aligned (cudaMalloc memory always is).
inline cudaError_t workspace_phase(void* d_temp, std::size_t& temp_bytes, std::size_t needed, bool& query) noexcept
{
  query = d_temp == nullptr;
  if (query)
  {
    temp_bytes = needed;
    return cudaSuccess;
  }
  return temp_bytes < needed || reinterpret_cast<std::uintptr_t>(d_temp) % 256 != 0 ? cudaErrorInvalidValue
                                                                                    : cudaSuccess;
}

/// What workspace_phase refuses (cudaErrorInvalidValue), as a status naming the argument: a workspace of
/// `temp_bytes` smaller than the `needed` bytes (errc::workspace_too_small, "temp_bytes"), or one not 256-byte
/// aligned (errc::invalid_argument, "d_temp").
inline status workspace_status(const void* d_temp, std::size_t temp_bytes, std::size_t needed)
{
  if (temp_bytes < needed)
  {
    return {errc::workspace_too_small,
            "temp_bytes",
            "the workspace holds " + std::to_string(temp_bytes) + " bytes; this problem needs " +
                std::to_string(needed) + " (the size query, d_temp = nullptr, writes the bytes needed)"};
  }
  if (reinterpret_cast<std::uintptr_t>(d_temp) % 256 != 0)
  {
    return {errc::invalid_argument, "d_temp", "the workspace must be 256-byte aligned (cudaMalloc memory always is)"};
  }
  return {};
}

/// A status of the status-returning device calls as the cudaError_t of their CUB-style siblings: CUDA's own code
/// where CUDA failed, cudaErrorInvalidValue for an argument or workspace the call refused. (cuBLAS codes are mapped by
/// the chunked loss, which includes cuBLAS.)
inline cudaError_t cuda_error_of(const status& st) noexcept
{
  if (st.ok())
  {
    return cudaSuccess;
  }
  return st.native().api == native_api::cuda ? static_cast<cudaError_t>(st.native().code) : cudaErrorInvalidValue;
}

/// Temporary bytes for reduce_sum and reduce_max over up to n items (the size query of every layout).
inline cudaError_t reduction_bytes(int n, std::size_t& bytes)
{
  std::size_t sum_bytes = 0, max_bytes = 0;
  CONTRASTIVE_CUDA_TRY(reduce_sum(nullptr, sum_bytes, nullptr, nullptr, n));
  CONTRASTIVE_CUDA_TRY(reduce_max(nullptr, max_bytes, nullptr, nullptr, n));
  bytes = sum_bytes > max_bytes ? sum_bytes : max_bytes;
  return cudaSuccess;
}

/// Carves a workspace into 256-byte aligned sub-buffers: c.take(bytes) returns the next one's offset.
struct carver
{
  std::size_t offset = 0;
  std::size_t take(std::size_t bytes) noexcept
  {
    const std::size_t at = offset;
    offset += align256(bytes);
    return at;
  }
};

/// The one place where runtime flags become template arguments: calls f(std::bool_constant<flags>...) with the
/// flags in order, e.g. static_switch(f, symmetric, labels) calls f(std::true_type{}, std::false_type{}).
template <class F>
auto static_switch(F&& f)
{
  return std::forward<F>(f)();
}

template <class F, class... Flags>
auto static_switch(F&& f, bool flag, Flags... rest)
{
  if (flag)
  {
    return static_switch(
        [&](auto... more)
        {
          return f(std::true_type{}, more...);
        },
        rest...);
  }
  return static_switch(
      [&](auto... more)
      {
        return f(std::false_type{}, more...);
      },
      rest...);
}
} // namespace util
} // namespace device
} // namespace contrastive
