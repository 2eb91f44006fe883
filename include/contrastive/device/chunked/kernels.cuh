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
/// The default chunk's floor: S_c and G_c in at most this (and default_min_rows).
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

/// The statistics pass's tile: a block reads `stat_rows` rows x `stat_cols` columns of S_c, 4 columns per lane
/// (one 16-byte load) and `stat_rows_per_warp` rows per warp and pass, over `stat_passes` passes of 64 rows.
inline constexpr int stat_cols = 128;
inline constexpr int stat_rows_per_warp = 8;
inline constexpr int stat_slab = stat_rows_per_warp * (threads / 32); // 64 rows per pass
inline constexpr int stat_passes = 4;
inline constexpr int stat_rows = stat_slab * stat_passes; // 256 rows per block

/// Column tiles and row tiles of the statistics pass over `rows` x `n_k` (the partials' counts).
constexpr long long stat_col_tiles(long long n_k) noexcept
{
  return (n_k + stat_cols - 1) / stat_cols;
}
constexpr long long stat_row_tiles(long long rows) noexcept
{
  return (rows + stat_rows - 1) / stat_rows;
}

/// Four floats x[0 .. 3] of which the first n (>= 1) exist: one 16-byte load where all four do and `vec` (x is
/// 16-byte aligned), else element by element with `fill` past the n-th. `Stream`: an evict-first load, for data read
/// once.
template <bool Stream = false>
__device__ CONTRASTIVE_FORCEINLINE float4 load4(const float* x, int n, bool vec, float fill) noexcept
{
  if (vec && n >= 4)
  {
    const auto* p = reinterpret_cast<const float4*>(x);
    return Stream ? __ldcs(p) : *p;
  }
  return make_float4(x[0], n > 1 ? x[1] : fill, n > 2 ? x[2] : fill, n > 3 ? x[3] : fill);
}

/// Four scaled logits s * S_c[r][j0 .. j0 + 3] (load4, streamed past L2: read once; -inf for columns at or past
/// n_k).
__device__ CONTRASTIVE_FORCEINLINE float4 load_scaled4(const float* row, int j0, int n_k, float s, bool vec) noexcept
{
  const int n = n_k - j0;
  constexpr float none = -detail::infinity_f;
  if (n <= 0)
  {
    return make_float4(none, none, none, none);
  }
  const float4 v = load4<true>(row + j0, n, vec, 0.0f);
  return make_float4(s * v.x, n > 1 ? s * v.y : none, n > 2 ? s * v.z : none, n > 3 ? s * v.w : none);
}

/// Component c of v (c in [0, 4); a compile-time c after unrolling, or a run-time one: selects, no local memory).
__device__ CONTRASTIVE_FORCEINLINE float lane_of(const float4& v, int c) noexcept
{
  return c == 0 ? v.x : (c == 1 ? v.y : (c == 2 ? v.z : v.w));
}

/// Sets component c of v (c in [0, 4)) to x.
__device__ CONTRASTIVE_FORCEINLINE void set_lane(float4& v, int c, float x) noexcept
{
  v.x = c == 0 ? x : v.x;
  v.y = c == 1 ? x : v.y;
  v.z = c == 2 ? x : v.z;
  v.w = c == 3 ? x : v.w;
}

/// exp(x - m) summed over a's four values, for a shift m that is -inf only when all four are -inf (then 0).
__device__ CONTRASTIVE_FORCEINLINE float sum_exp4(const float4& v, float m) noexcept
{
  const float shift = m == -detail::infinity_f ? 0.0f : m;
  return detail::exp_approx(v.x - shift) + detail::exp_approx(v.y - shift) + detail::exp_approx(v.z - shift) +
         detail::exp_approx(v.w - shift);
}

/// The forward's one pass over a chunk of float logits: each row's negatives (every column but its positive) and,
/// symmetric, each column's negatives over the chunk's rows, as (max, sum exp) partials per tile, with one
/// exponential per logit and direction. Grid: x = column tiles of 128, y = row tiles of 256 rows. Row partials go to
/// row_part[r * gridDim.x + tile] (logits_tile::finish_tile_rows merges them with the positive, written to pos[i] by
/// the block that holds it); column partials to col_part[row tile * n_k + j] (logits_tile::merge_tile_columns).
/// A non-finite scaled logit sets flags[0]. The positive of row i (its label, else i) is left out of both.
template <int = 0> // a template, like every kernel in a header: one definition across translation units
__global__ void __launch_bounds__(threads)
    chunk_statistics(chunk_args a, long long c0, int rows, int symmetric, float2* row_part, float2* col_part)
{
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int j0 = static_cast<int>(blockIdx.x) * stat_cols + lane * 4;
  const int row_base = static_cast<int>(blockIdx.y) * stat_rows;
  const float s = a.scalars->scale;
  const bool vec = (a.ld % 4) == 0;
  online_lse col[4]; // this thread's rows of its four columns
  bool bad = false;
  for (int pass = 0; pass < stat_passes; ++pass)
  {
    const int r_first = row_base + pass * stat_slab + warp * stat_rows_per_warp;
    if (row_base + pass * stat_slab >= rows)
    {
      break;
    }
    float4 v[stat_rows_per_warp];
#pragma unroll
    for (int t = 0; t < stat_rows_per_warp; ++t)
    {
      const int r = r_first + t;
      if (r < rows)
      {
        v[t] = load_scaled4(a.logits + static_cast<long long>(r) * a.ld, j0, a.n_k, s, vec);
        const long long p = positive_of(a, c0 + r) - j0;
        bad |= !detail::finite(v[t].x) && j0 < a.n_k;
        bad |= !detail::finite(v[t].y) && j0 + 1 < a.n_k;
        bad |= !detail::finite(v[t].z) && j0 + 2 < a.n_k;
        bad |= !detail::finite(v[t].w) && j0 + 3 < a.n_k;
        if (p >= 0 && p < 4 && j0 + p < a.n_k)
        {
          a.pos[c0 + r] = lane_of(v[t], static_cast<int>(p));
          set_lane(v[t], static_cast<int>(p), -detail::infinity_f);
        }
      }
      else
      {
        v[t] = make_float4(-detail::infinity_f, -detail::infinity_f, -detail::infinity_f, -detail::infinity_f);
      }
    }
    // Rows: a warp holds 8 rows x 128 columns; max over the warp, then the sum of exponentials.
#pragma unroll
    for (int t = 0; t < stat_rows_per_warp; ++t)
    {
      const kernels::nan_max mx{};
      float m = mx(mx(v[t].x, v[t].y), mx(v[t].z, v[t].w));
#pragma unroll
      for (int o = 16; o > 0; o /= 2)
      {
        m = mx(m, __shfl_xor_sync(0xffffffffu, m, o));
      }
      float e = sum_exp4(v[t], m);
#pragma unroll
      for (int o = 16; o > 0; o /= 2)
      {
        e += __shfl_xor_sync(0xffffffffu, e, o);
      }
      const int r = r_first + t;
      if (lane == 0 && r < rows)
      {
        row_part[static_cast<long long>(r) * gridDim.x + blockIdx.x] =
            make_float2(m, m == -detail::infinity_f ? 0.0f : e);
      }
    }
    if (symmetric)
    {
#pragma unroll
      for (int c = 0; c < 4; ++c)
      {
        const kernels::nan_max mx{};
        float m = -detail::infinity_f;
#pragma unroll
        for (int t = 0; t < stat_rows_per_warp; ++t)
        {
          m = mx(m, lane_of(v[t], c));
        }
        float e = 0.0f;
        const float shift = m == -detail::infinity_f ? 0.0f : m;
#pragma unroll
        for (int t = 0; t < stat_rows_per_warp; ++t)
        {
          e += detail::exp_approx(lane_of(v[t], c) - shift);
        }
        col[c].merge(online_lse{m, m == -detail::infinity_f ? 0.0f : e});
      }
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0)
  {
    a.flags[0] = 1;
  }
  if (!symmetric)
  {
    return;
  }
  // Columns: merge the 8 warps' states of each of the tile's 128 columns.
  __shared__ float2 part[threads / 32][stat_cols];
#pragma unroll
  for (int c = 0; c < 4; ++c)
  {
    part[warp][lane * 4 + c] = make_float2(col[c].max, col[c].sum);
  }
  __syncthreads();
  if (threadIdx.x < stat_cols)
  {
    const int j = static_cast<int>(blockIdx.x) * stat_cols + static_cast<int>(threadIdx.x);
    online_lse all{};
#pragma unroll
    for (int w = 0; w < threads / 32; ++w)
    {
      const float2 q = part[w][threadIdx.x];
      all.merge(online_lse{q.x, q.y});
    }
    if (j < a.n_k)
    {
      col_part[static_cast<long long>(blockIdx.y) * a.n_k + j] = make_float2(all.max, all.sum);
    }
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

/// Four values rounded to T and stored at out[0..3] (one 8-byte store for 16-bit T, 16 bytes for float, where `vec`;
/// else element by element, the first `n` only).
template <class T>
__device__ CONTRASTIVE_FORCEINLINE void store4(T* out, const float4& g, bool vec, int n) noexcept
{
  if (vec && n >= 4)
  {
    if constexpr (std::is_same_v<T, float>)
    {
      *reinterpret_cast<float4*>(out) = g;
    }
    else
    {
      alignas(8) T h[4] = {element_traits<T>::from_float(g.x),
                           element_traits<T>::from_float(g.y),
                           element_traits<T>::from_float(g.z),
                           element_traits<T>::from_float(g.w)};
      *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(h);
    }
    return;
  }
  const float v[4] = {g.x, g.y, g.z, g.w};
  for (int c = 0; c < 4 && c < n; ++c)
  {
    out[c] = element_traits<T>::from_float(v[c]);
  }
}

/// G_c = dL/dS for the chunk's rows, times 2^k, rounded to T into g (row stride ld; may be the logits themselves
/// when T is float: each element is read before it is written, by the same thread). Four columns per thread (16-byte
/// loads of S_c and the column log-sum-exps); grid x covers the columns, y the rows (each block loops over rows).
template <class T>
__global__ void __launch_bounds__(threads)
    chunk_gradient(chunk_args a, long long c0, int rows, grad_coefficients gc, int symmetric, float factor, T* g)
{
  const float s = a.scalars->scale;
  const int j0 = (static_cast<int>(blockIdx.x) * threads + static_cast<int>(threadIdx.x)) * 4;
  if (j0 >= a.n_k)
  {
    return;
  }
  const bool vec = (a.ld % 4) == 0;
  const int n = a.n_k - j0;
  // The column log-sum-exps (256-byte aligned, j0 a multiple of 4: 16-byte loads).
  const float4 cl = symmetric ? load4(a.col_lse + j0, n, true, 0.0f) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int r = blockIdx.y; r < rows; r += gridDim.y)
  {
    const long long i = c0 + r;
    const long long p = positive_of(a, i) - j0;
    const float lr = a.row_lse[i];
    const float4 v = load4(a.logits + static_cast<long long>(r) * a.ld + j0, n, vec, 0.0f);
    float4 gv;
    gv.x = logit_gradient(s * v.x, lr, cl.x, gc, symmetric != 0) * factor;
    gv.y = logit_gradient(s * v.y, lr, cl.y, gc, symmetric != 0) * factor;
    gv.z = logit_gradient(s * v.z, lr, cl.z, gc, symmetric != 0) * factor;
    gv.w = logit_gradient(s * v.w, lr, cl.w, gc, symmetric != 0) * factor;
    if (p >= 0 && p < 4)
    {
      const long long pc = p + j0;
      const float pos_g =
          exact_positive_gradient(a.row_loss[i], symmetric && pc < a.n_k ? a.col_loss[pc] : 0.0f, gc, symmetric != 0);
      set_lane(gv, static_cast<int>(p), pos_g * factor);
    }
    store4(g + static_cast<long long>(r) * a.ld + j0, gv, vec, n);
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
  const bool vec = (a.ld % 4) == 0;
  // Four columns per thread and pass: 16-byte loads of S_c, 8-byte (16-bit T) or 16-byte (float) stores of G_c.
  for (int j0 = threadIdx.x * 4; j0 < a.n_k; j0 += threads * 4)
  {
    const int n = a.n_k - j0;
    const float4 v = load4(x + j0, n, vec, 0.0f);
    float4 gv;
#pragma unroll
    for (int c = 0; c < 4; ++c)
    {
      if (c < n)
      {
        const float z = s * lane_of(v, c) + b;
        bad |= !detail::finite(z);
        const bool positive = j0 + c == p;
        const sigmoid_term t = positive ? sigmoid_positive(z) : sigmoid_negative(z);
        const float gc = coef * t.grad;
        part.loss += t.loss;
        part.grad_sum += gc;
        part.max = kernels::nan_max{}(part.max, z);
        set_lane(gv, c, gc * factor);
        if (positive)
        {
          a.pos[i] = z;
        }
      }
      else
      {
        set_lane(gv, c, 0.0f);
      }
    }
    store4(out + j0, gv, vec, n);
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
