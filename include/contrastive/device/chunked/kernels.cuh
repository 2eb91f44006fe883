// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The chunked device algorithm's element-wise part (device/chunked.cuh describes the algorithm): its constants, the
/// cuBLAS type and status translations, the chunk kernels' arguments and the kernels themselves (row statistics,
/// column partials and their finish, G_c, the sigmoid objective's one-pass chunk, the scaled rows of dQ and dK),
/// built from the shared per-logit math.
/// Internal to the chunked loss and the NCCL loss (distributed/nccl.cuh); device/chunked/runner.cuh orders them.

#include <contrastive/device/kernels.cuh>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/numeric/online_lse.hpp>
#include <contrastive/numeric/sigmoid_math.hpp>

#include <contrastive/status.hpp>

#include <cub/block/block_reduce.cuh>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace contrastive
{
namespace device
{
/// The chunked step's phases: its kernels (this header) and its runner (device/chunked/runner.cuh), shared by the
/// one-process chunked loss and the NCCL loss.
namespace chunked_phases
{
/// The default chunk's floor: S_c and G_c in at most this (and default_min_rows), what earlier versions always used.
inline constexpr std::size_t default_budget = std::size_t(384) << 20;
/// Default chunks hold at least this many rows: below about dim / 2 rows per chunk, re-reading K for every chunk's
/// products costs more memory traffic than the chunk itself (matters from N ~ 500k at dim = 512).
inline constexpr std::size_t default_min_rows = 256;
/// Default chunks take at most 1/free_divisor of the device memory free after the step's other workspace buffers.
inline constexpr std::size_t free_divisor = 4;
/// The default chunk's rows where free memory allows (and the floor is lower): each chunk reads and writes the
/// n_k x dim float dK accumulator and reads K about three times, ~14 n_k dim bytes (16-bit K), beside 8 rows n_k dim
/// flops: 1.75 / rows bytes per flop, at 4096 rows 6-9% of an H200's bf16 GEMM time (at 256 rows 100-140%; the
/// accumulator alone is 8 of the 14 bytes; docs/performance.md).
inline constexpr std::size_t default_max_rows = 4096;
inline constexpr std::size_t row_align = 64;
inline constexpr int threads = 256;

template <class T>
constexpr cudaDataType_t cuda_type() noexcept
{
  if constexpr (std::is_same_v<T, float>)
  {
    return CUDA_R_32F;
  }
  else if constexpr (std::is_same_v<T, __half>)
  {
    return CUDA_R_16F;
  }
  else
  {
    return CUDA_R_16BF;
  }
}

/// A cuBLAS result as a status: errc::cuda_error naming the call `what`, with cuBLAS's name and text and
/// native() = {cublas, s}.
inline status cublas_status(cublasStatus_t s, const char* what)
{
  if (s == CUBLAS_STATUS_SUCCESS)
  {
    return {};
  }
  return {errc::cuda_error,
          what,
          std::string(cublasGetStatusName(s)) + ": " + cublasGetStatusString(s),
          {native_api::cublas, static_cast<int>(s)}};
}

/// A cuBLAS result as the cudaError_t of the CUB-style calls (the status calls keep cuBLAS's own code).
inline cudaError_t from_cublas(cublasStatus_t s) noexcept
{
  switch (s)
  {
  case CUBLAS_STATUS_SUCCESS:
    return cudaSuccess;
  case CUBLAS_STATUS_ALLOC_FAILED:
    return cudaErrorMemoryAllocation;
  case CUBLAS_STATUS_INVALID_VALUE:
    return cudaErrorInvalidValue;
  case CUBLAS_STATUS_NOT_SUPPORTED:
  case CUBLAS_STATUS_ARCH_MISMATCH:
    return cudaErrorNotSupported;
  default:
    return cudaErrorUnknown;
  }
}

struct lse_merge
{
  __device__ online_lse operator()(online_lse a, const online_lse& b) const noexcept
  {
    a.merge(b);
    return a;
  }
};

/// fp16 only: G_c is stored times 2^k. |G| <= 2 max(coef) (the positive's term), and the softmax entries P ~ 1/n
/// carry a further max(coef); k lifts max(coef) to [0.5, 1) and then by 2^min(ceil(log2 n), 12), which keeps |G 2^k|
/// below 2^15 and P ~ 1/n near 2^-4 .. 2^0. bf16 (float's exponent range) and float keep k = 0.
template <class T>
int gradient_shift(const grad_coefficients& gc, std::size_t n) noexcept
{
  if constexpr (!std::is_same_v<T, __half>)
  {
    (void)gc;
    (void)n;
    return 0;
  }
  else
  {
    const float c = std::max(gc.row_coef, gc.col_coef);
    int k = 0;
    while (k < 62 && c * static_cast<float>(std::uint64_t(1) << k) < 0.5f)
    {
      ++k;
    }
    int log_n = 0;
    while (log_n < 12 && (std::size_t(1) << log_n) < n)
    {
      ++log_n;
    }
    return std::min(k + log_n, 100);
  }
}

/// Plain arguments of the element-wise kernels.
struct chunk_args
{
  const float* logits = nullptr; ///< S_c without the scale: q_i . k_j, row-major rows x ld
  long long ld = 0;
  int n_k = 0;
  const std::int32_t* labels = nullptr; ///< info_nce labels (device), null: the diagonal
  const kernels::step_scalars* scalars = nullptr;
  float* row_lse = nullptr;
  float* row_loss = nullptr;
  float* row_max = nullptr; ///< reported max logit per row (positive included; sigmoid: of z = s S + b)
  float* pos = nullptr;     ///< the positive logit of each row (sigmoid: its z)
  float* col_max = nullptr; ///< symmetric: running column state of the negatives
  float* col_sum = nullptr;
  float* col_lse = nullptr;
  float* col_loss = nullptr;
  int* flags = nullptr; ///< [0] logits, [1] dQ, [2] dK non-finite
};

__device__ CONTRASTIVE_FORCEINLINE long long positive_of(const chunk_args& a, long long i) noexcept
{
  return a.labels != nullptr ? static_cast<long long>(a.labels[i]) : i;
}

/// One block per chunk row: the row's negatives, its positive, its loss and reported max.
template <int = 0> // a template, like every kernel in a header: one definition across translation units
__global__ void __launch_bounds__(threads) row_statistics(chunk_args a, long long c0)
{
  const long long r = blockIdx.x;
  const long long i = c0 + r;
  const float s = a.scalars->scale;
  const float* x = a.logits + r * a.ld;
  const long long p = positive_of(a, i);
  online_lse neg{};
  bool bad = false;
  for (int j = threadIdx.x; j < a.n_k; j += threads)
  {
    const float v = s * x[j];
    bad |= !detail::finite(v);
    if (j != p)
    {
      neg.absorb(v);
    }
  }
  using reduce_t = cub::BlockReduce<online_lse, threads>;
  __shared__ typename reduce_t::TempStorage tmp;
  const online_lse all = reduce_t(tmp).Reduce(neg, lse_merge{});
  if (__syncthreads_or(bad) && threadIdx.x == 0)
  {
    a.flags[0] = 1;
  }
  if (threadIdx.x == 0)
  {
    // An out-of-range label (not checked on the device) has no positive: -inf makes the row's loss +inf.
    const float positive = p >= 0 && p < a.n_k ? s * x[p] : -detail::infinity_f;
    const row_loss rl = finish_row(all, positive);
    a.row_lse[i] = rl.lse;
    a.row_loss[i] = rl.loss;
    a.row_max[i] = kernels::nan_max{}(all.max, positive);
    a.pos[i] = positive;
  }
}

/// Symmetric: 32 columns x 8 row slices per block; the chunk's negatives of each column merged into the running
/// state (`first`: the state starts here). Each row's positive (its label, or the diagonal) is left out.
template <int = 0> // a template, like every kernel in a header: one definition across translation units
__global__ void __launch_bounds__(threads) column_partials(chunk_args a, long long c0, int rows, int first)
{
  const int j = blockIdx.x * 32 + threadIdx.x;
  const float s = a.scalars->scale;
  online_lse st{};
  if (j < a.n_k)
  {
    for (int r = threadIdx.y; r < rows; r += 8)
    {
      if (positive_of(a, c0 + r) != j) // the diagonal, or (a block of a distributed batch) the row's label
      {
        st.absorb(s * a.logits[r * a.ld + j]);
      }
    }
  }
  __shared__ float smax[8][32];
  __shared__ float ssum[8][32];
  smax[threadIdx.y][threadIdx.x] = st.max;
  ssum[threadIdx.y][threadIdx.x] = st.sum;
  __syncthreads();
  if (threadIdx.y == 0 && j < a.n_k)
  {
    online_lse run = first ? online_lse{} : online_lse{a.col_max[j], a.col_sum[j]};
    for (int y = 0; y < 8; ++y)
    {
      run.merge(online_lse{smax[y][threadIdx.x], ssum[y][threadIdx.x]});
    }
    a.col_max[j] = run.max;
    a.col_sum[j] = run.sum;
  }
}

/// Symmetric: each column's log-sum-exp and loss from its negatives and positive (row j's positive logit).
template <int = 0> // a template, like every kernel in a header: one definition across translation units
__global__ void __launch_bounds__(threads) finish_columns(chunk_args a)
{
  for (int j = blockIdx.x * threads + threadIdx.x; j < a.n_k; j += gridDim.x * threads)
  {
    const row_loss rl = finish_row(online_lse{a.col_max[j], a.col_sum[j]}, a.pos[j]);
    a.col_lse[j] = rl.lse;
    a.col_loss[j] = rl.loss;
  }
}

/// G_c = dL/dS for the chunk's rows, times 2^k, rounded to T into g (row stride ld; may be the logits themselves
/// when T is float: each element is read before it is written, by the same thread).
template <class T>
__global__ void __launch_bounds__(threads)
    chunk_gradient(chunk_args a, long long c0, int rows, grad_coefficients gc, int symmetric, float factor, T* g)
{
  const float s = a.scalars->scale;
  for (int r = blockIdx.y; r < rows; r += gridDim.y)
  {
    const long long i = c0 + r;
    const long long p = positive_of(a, i);
    const float lr = a.row_lse[i];
    const float pos_g = exact_positive_gradient(
        a.row_loss[i], symmetric && p >= 0 && p < a.n_k ? a.col_loss[p] : 0.0f, gc, symmetric != 0);
    const float* x = a.logits + r * a.ld;
    T* out = g + r * a.ld;
    for (int j = blockIdx.x * threads + threadIdx.x; j < a.n_k; j += gridDim.x * threads)
    {
      const float v = s * x[j];
      float gv = logit_gradient(v, lr, symmetric ? a.col_lse[j] : 0.0f, gc, symmetric != 0);
      gv = j == p ? pos_g : gv;
      out[j] = element_traits<T>::from_float(gv * factor);
    }
  }
}

/// A sigmoid row's sums over its columns: loss terms, G (for d loss / d b) and the largest z.
struct sigmoid_row
{
  float loss;
  float grad_sum;
  float max;
};

struct sigmoid_row_merge
{
  __device__ sigmoid_row operator()(const sigmoid_row& a, const sigmoid_row& b) const noexcept
  {
    return {a.loss + b.loss, a.grad_sum + b.grad_sum, kernels::nan_max{}(a.max, b.max)};
  }
};

/// The sigmoid objective, one block per chunk row: forward and G_c in one pass (no normaliser couples the logits).
/// z = s x + b; the row's loss sum_j softplus(-l_ij z_ij) into row_loss (and row_lse, as the host keeps it), its
/// largest z into row_max, its positive's z into pos, the sum of its G = coef (-l sigmoid(-l z)) into grad_sum
/// (before rounding: d loss / d b); G times 2^k rounded to T into g (row stride ld; may be the logits themselves
/// when T is float: each element is read before it is written, by the same thread). An out-of-range label (not
/// checked on the device) leaves the row without a positive: its loss is +inf, so the step is skipped as the
/// softmax objectives skip it.
template <class T>
__global__ void __launch_bounds__(threads)
    sigmoid_chunk(chunk_args a, long long c0, float coef, float factor, T* g, float* grad_sum)
{
  const long long r = blockIdx.x;
  const long long i = c0 + r;
  const float s = a.scalars->scale;
  const float b = a.scalars->bias;
  const float* x = a.logits + r * a.ld;
  T* out = g + r * a.ld;
  const long long p = positive_of(a, i);
  sigmoid_row part{0.0f, 0.0f, -detail::infinity_f};
  bool bad = false;
  for (int j = threadIdx.x; j < a.n_k; j += threads)
  {
    const float z = s * x[j] + b;
    bad |= !detail::finite(z);
    const sigmoid_term t = j == p ? sigmoid_positive(z) : sigmoid_negative(z);
    const float gv = coef * t.grad;
    part.loss += t.loss;
    part.grad_sum += gv;
    part.max = kernels::nan_max{}(part.max, z);
    out[j] = element_traits<T>::from_float(gv * factor);
    if (j == p)
    {
      a.pos[i] = z;
    }
  }
  using reduce_t = cub::BlockReduce<sigmoid_row, threads>;
  __shared__ typename reduce_t::TempStorage tmp;
  const sigmoid_row all = reduce_t(tmp).Reduce(part, sigmoid_row_merge{});
  if (__syncthreads_or(bad) && threadIdx.x == 0)
  {
    a.flags[0] = 1;
  }
  if (threadIdx.x == 0)
  {
    const bool has_positive = p >= 0 && p < a.n_k;
    const float loss = has_positive ? all.loss : detail::infinity_f;
    a.row_loss[i] = loss;
    a.row_lse[i] = loss;
    a.row_max[i] = all.max;
    grad_sum[i] = all.grad_sum;
    if (!has_positive)
    {
      a.pos[i] = -detail::infinity_f;
    }
  }
}

/// Rows of a float product (row-major, `dim` per row) scaled by loss_scale * s, rounded to T; optionally the dot of
/// each unscaled row with the matching row of `rows_in` (d loss / d log s). One block per row.
template <class T>
__global__ void __launch_bounds__(threads) store_rows(const float* acc,
                                                      int dim,
                                                      const T* rows_in,
                                                      T* out,
                                                      const kernels::step_scalars* scalars,
                                                      float* row_dot,
                                                      int* flag)
{
  const long long r = blockIdx.x;
  const float f = scalars->loss_scale * scalars->scale;
  const float* in = acc + r * dim;
  T* o = out + r * dim;
  float dot = 0.0f;
  bool bad = false;
  for (int c = threadIdx.x; c < dim; c += threads)
  {
    const float v = in[c];
    const T t = element_traits<T>::from_float(f * v);
    o[c] = t;
    bad |= !detail::finite(element_traits<T>::to_float(t));
    if (row_dot != nullptr)
    {
      dot += v * element_traits<T>::to_float(rows_in[r * dim + c]);
    }
  }
  if (row_dot != nullptr)
  {
    using reduce_t = cub::BlockReduce<float, threads>;
    __shared__ typename reduce_t::TempStorage tmp;
    const float total = reduce_t(tmp).Sum(dot);
    if (threadIdx.x == 0)
    {
      row_dot[r] = total;
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0)
  {
    *flag = 1;
  }
}
} // namespace chunked_phases
} // namespace device
} // namespace contrastive
