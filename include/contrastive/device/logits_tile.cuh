// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The logits tile of algorithm::chunked computed on tensor cores and consumed in registers (chunk_options::
/// fused_tiles). A 128 x 128 tile of S_c = Q_c K^T (16-bit inputs, float accumulation: mma.sync m16n8k16 fed by
/// cp.async double buffering and ldmatrix, sm_80 and later) is never written to memory; its epilogue either
///   - reduces it (forward): per row of the tile the negatives' (max, sum exp) over the tile's 128 columns, per column
///     the same over the tile's 128 rows, the positive's logit and a non-finite flag; a small kernel then merges the
///     row partials of all column tiles (row statistics, loss, reported max) and another the column partials into the
///     running column state, or
///   - turns it into G_c = dL/dS_c (backward), rounded to the element type (fp16: times 2^k), which the two cuBLAS
///     products dQ_c = G_c K and dK += G_c^T Q_c then read.
/// Per logit that is 2 bytes of HBM traffic written and 4 read (G_c) instead of 26 with a float S_c (written twice,
/// read three times) and G_c. The element-wise math is the shared tile math (online_lse, logit_gradient,
/// exact_positive_gradient, finish_row) that the host engine and the other kernels use.
///
/// Requirements (checked by the caller, chunked.cuh): 16-bit element type, dim % 8 == 0, q and k 16-byte aligned
/// (rows are then 16-byte aligned too), a device of compute capability 8.0 or later.

#include <contrastive/device/kernels.cuh>
#include <contrastive/device/tile_layout.hpp>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/numeric/online_lse.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace contrastive
{
namespace device
{
namespace tile_detail
{
template <class T>
struct smem_tiles
{
  T a[config::stages][config::bm][config::pitch];
  T b[config::stages][config::bn][config::pitch];
};

/// Shared memory of the epilogue's cross-warp reductions (reuses the tiles' bytes).
struct smem_reduce
{
  float row_max[config::warps_n][config::bm];
  float row_sum[config::warps_n][config::bm];
  float col_max[config::warps_m][config::bn];
  float col_sum[config::warps_m][config::bn];
};

template <class T>
constexpr std::size_t smem_bytes = sizeof(smem_tiles<T>) > sizeof(smem_reduce) ? sizeof(smem_tiles<T>)
                                                                               : sizeof(smem_reduce);

/// Plain arguments of the tile kernels.
struct tile_args
{
  const void* q = nullptr; ///< Q_c: the chunk's first row, `rows` x dim, row-major
  const void* k = nullptr; ///< K: n_k x dim, row-major
  int rows = 0;
  int n_k = 0;
  int dim = 0;
  long long c0 = 0;                     ///< global index of the chunk's first row (labels, row statistics)
  const std::int32_t* labels = nullptr; ///< positive column of each row (device), null: the diagonal
  const kernels::step_scalars* scalars = nullptr;
  // forward (statistics)
  float2* row_part = nullptr; ///< [rows][column tiles]: (max, sum) of each row's negatives in one column tile
  float2* col_part = nullptr; ///< [row tiles][n_k]: (max, sum) of each column's negatives in one row tile
  float* pos = nullptr;       ///< [n_q]: the positive logit of each row (written by the tile that holds it)
  int* flag = nullptr;        ///< set to 1 on a non-finite logit
  // backward (gradient)
  const float* row_lse = nullptr;
  const float* row_loss = nullptr;
  const float* col_lse = nullptr;  ///< symmetric only
  const float* col_loss = nullptr; ///< symmetric only
  grad_coefficients gc{};
  int symmetric = 0;
  float factor = 1.0f; ///< 2^k (fp16), else 1
  void* g = nullptr;   ///< G_c: rows x ld, element type
  long long ld = 0;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define CONTRASTIVE_TILE_MMA 1
#endif

/// 16 bytes global -> shared, zero-filled when `valid` is false (the source is then not read).
__device__ CONTRASTIVE_FORCEINLINE void cp_async_16(void* dst, const void* src, bool valid) noexcept
{
#ifdef CONTRASTIVE_TILE_MMA
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(bytes) : "memory");
#else
  (void)dst;
  (void)src;
  (void)valid;
#endif
}

__device__ CONTRASTIVE_FORCEINLINE void cp_async_commit() noexcept
{
#ifdef CONTRASTIVE_TILE_MMA
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int Pending>
__device__ CONTRASTIVE_FORCEINLINE void cp_async_wait() noexcept
{
#ifdef CONTRASTIVE_TILE_MMA
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
}

/// Four 8 x 8 matrices of 16-bit values from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ CONTRASTIVE_FORCEINLINE void ldmatrix_x4(unsigned (&r)[4], const void* p) noexcept
{
#ifdef CONTRASTIVE_TILE_MMA
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
#else
  (void)p;
  r[0] = r[1] = r[2] = r[3] = 0u;
#endif
}

/// c += a b for one m16n8k16 tile (a row-major 16 x 16, b column-major 16 x 8, float accumulators).
template <class T>
__device__ CONTRASTIVE_FORCEINLINE void
mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) noexcept
{
#ifdef CONTRASTIVE_TILE_MMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
  {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  else
  {
    static_assert(std::is_same_v<T, __half>, "16-bit element types only");
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  (void)c;
  (void)a;
  (void)b0;
  (void)b1;
#endif
}

/// One stage of the block's A (Q_c rows) and B (K rows) tiles, depth [k0, k0 + bk); rows past the end and depth past
/// dim are zero-filled.
template <class T>
__device__ CONTRASTIVE_FORCEINLINE void
load_stage(smem_tiles<T>& sm, int stage, const tile_args& a, int row0, int col0, int k0) noexcept
{
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int it = 0; it < config::a_loads; ++it)
  {
    const int r = lane_map::load_row(tid, it);
    const int c = lane_map::load_depth(tid, it);
    const bool ok = row0 + r < a.rows && k0 + c < a.dim;
    const T* src = ok ? q + (static_cast<long long>(row0 + r) * a.dim + k0 + c) : q;
    cp_async_16(&sm.a[stage][r][c], src, ok);
  }
#pragma unroll
  for (int it = 0; it < config::b_loads; ++it)
  {
    const int r = lane_map::load_row(tid, it);
    const int c = lane_map::load_depth(tid, it);
    const bool ok = col0 + r < a.n_k && k0 + c < a.dim;
    const T* src = ok ? k + (static_cast<long long>(col0 + r) * a.dim + k0 + c) : k;
    cp_async_16(&sm.b[stage][r][c], src, ok);
  }
}

/// The block's 128 x 128 tile of Q_c K^T in registers. acc[mi][ni][2 h + e] is the product at tile row
/// warp_row + mi * 16 + c_row(lane, h) and tile column warp_col + ni * 8 + c_col(lane, e) (lane_map).
template <class T>
__device__ CONTRASTIVE_FORCEINLINE void tile_product(
    smem_tiles<T>& sm, const tile_args& a, int row0, int col0, float (&acc)[config::mt][config::nt][4]) noexcept
{
#pragma unroll
  for (int mi = 0; mi < config::mt; ++mi)
  {
#pragma unroll
    for (int ni = 0; ni < config::nt; ++ni)
    {
#pragma unroll
      for (int e = 0; e < 4; ++e)
      {
        acc[mi][ni][e] = 0.0f;
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap(); // the host side runs these kernels only on sm_80 and later (chunked_phases::use_tiles)
#endif
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int wrow = lane_map::warp_row(warp);
  const int wcol = lane_map::warp_col(warp);
  const int ktiles = (a.dim + config::bk - 1) / config::bk;
  load_stage(sm, 0, a, row0, col0, 0);
  cp_async_commit();
  for (int kt = 0; kt < ktiles; ++kt)
  {
    const int st = kt % config::stages;
    if (kt + 1 < ktiles)
    {
      load_stage(sm, (kt + 1) % config::stages, a, row0, col0, (kt + 1) * config::bk);
      cp_async_commit();
      cp_async_wait<1>();
    }
    else
    {
      cp_async_wait<0>();
    }
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < config::bk; ks += 16)
    {
      unsigned af[config::mt][4];
#pragma unroll
      for (int mi = 0; mi < config::mt; ++mi)
      {
        // matrices: rows 0-7 / 8-15 of the m16 tile at depth ks, then the same at depth ks + 8
        ldmatrix_x4(af[mi], &sm.a[st][wrow + mi * 16 + lane_map::a_row(lane)][ks + lane_map::a_depth(lane)]);
      }
#pragma unroll
      for (int nj = 0; nj < config::nt / 2; ++nj)
      {
        // matrices: n8 tile 2 nj at depth ks / ks + 8, then n8 tile 2 nj + 1 at depth ks / ks + 8
        unsigned bf[4];
        ldmatrix_x4(bf, &sm.b[st][wcol + nj * 16 + lane_map::b_row(lane)][ks + lane_map::b_depth(lane)]);
#pragma unroll
        for (int mi = 0; mi < config::mt; ++mi)
        {
          mma_16816<T>(acc[mi][2 * nj], af[mi], bf[0], bf[1]);
          mma_16816<T>(acc[mi][2 * nj + 1], af[mi], bf[2], bf[3]);
        }
      }
    }
    __syncthreads(); // the next iteration's load overwrites the stage just read
  }
}

/// Two adjacent elements stored with one 4-byte access.
template <class T>
struct alignas(2 * sizeof(T)) element_pair
{
  T x, y;
};

__device__ CONTRASTIVE_FORCEINLINE online_lse shfl_merge(online_lse v, int lane_mask) noexcept
{
  const online_lse o{__shfl_xor_sync(0xffffffffu, v.max, lane_mask), __shfl_xor_sync(0xffffffffu, v.sum, lane_mask)};
  v.merge(o);
  return v;
}

__device__ CONTRASTIVE_FORCEINLINE long long positive_of(const tile_args& a, long long i) noexcept
{
  return a.labels != nullptr ? static_cast<long long>(a.labels[i]) : i;
}

/// The accumulators of one block: tile_product's layout (lane_map).
using tile_accumulators = float[config::mt][config::nt][4];

/// Forward epilogue: the tile's row and column partials of the negatives, the positives, the non-finite flag.
struct statistics_epilogue
{
  template <class T>
  __device__ static CONTRASTIVE_FORCEINLINE void
  apply(const tile_args& a, tile_accumulators& acc, unsigned char* raw, int row0, int col0) noexcept;
};

/// Backward epilogue: G_c of the tile, times `factor`, rounded to T into g (row stride ld).
struct gradient_epilogue
{
  template <class T>
  __device__ static CONTRASTIVE_FORCEINLINE void
  apply(const tile_args& a, tile_accumulators& acc, unsigned char* raw, int row0, int col0) noexcept;
};

/// One 128 x 128 logits tile per block: the tensor-core product into registers, then the epilogue (statistics or
/// gradient). Grid: (column tiles, row tiles of the chunk), each block's tile taken in grouped order (grouped_tile:
/// a group of row tiles shares K tiles in L2); config::threads threads; 40 KiB of static shared memory, which the
/// epilogue may reuse. The epilogues index partials by the tile (row0 / bm, col0 / bn), never by blockIdx.
template <class T, class Epilogue>
__global__ void __launch_bounds__(config::threads) tile_kernel(tile_args a)
{
  __shared__ alignas(16) unsigned char raw[smem_bytes<T>];
  const tile_coord tile = grouped_tile(static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x,
                                       static_cast<int>(gridDim.y),
                                       static_cast<int>(gridDim.x));
  const int row0 = tile.row * config::bm;
  const int col0 = tile.col * config::bn;
  tile_accumulators acc;
  tile_product<T>(*reinterpret_cast<smem_tiles<T>*>(raw), a, row0, col0, acc);
  Epilogue::template apply<T>(a, acc, raw, row0, col0);
}

template <class T>
__device__ CONTRASTIVE_FORCEINLINE void
statistics_epilogue::apply(const tile_args& a, tile_accumulators& acc, unsigned char* raw, int row0, int col0) noexcept
{
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int wm_i = lane_map::warp_m(warp);
  const int wn_i = lane_map::warp_n(warp);
  const int wrow = lane_map::warp_row(warp);
  const int wcol = lane_map::warp_col(warp);
  const float s = a.scalars->scale;
  online_lse rs[config::mt][2];
  online_lse cs[config::nt][2];
  bool bad = false;
#pragma unroll
  for (int mi = 0; mi < config::mt; ++mi)
  {
#pragma unroll
    for (int h = 0; h < 2; ++h)
    {
      const int r = row0 + wrow + mi * 16 + lane_map::c_row(lane, h);
      const bool row_ok = r < a.rows;
      const long long i = a.c0 + r;
      const long long p = row_ok ? positive_of(a, i) : -1;
#pragma unroll
      for (int ni = 0; ni < config::nt; ++ni)
      {
#pragma unroll
        for (int e = 0; e < 2; ++e)
        {
          const int j = col0 + wcol + ni * 8 + lane_map::c_col(lane, e);
          if (row_ok && j < a.n_k)
          {
            const float v = s * acc[mi][ni][2 * h + e];
            bad |= !contrastive::detail::finite(v);
            if (j == p)
            {
              a.pos[i] = v;
            }
            else
            {
              rs[mi][h].absorb(v);
              if (a.symmetric != 0)
              {
                cs[ni][e].absorb(v);
              }
            }
          }
        }
      }
    }
  }
  // Rows: the four lanes of a quad hold the same rows. Columns: lanes with the same lane % 4 hold the same columns.
#pragma unroll
  for (int mi = 0; mi < config::mt; ++mi)
  {
#pragma unroll
    for (int h = 0; h < 2; ++h)
    {
#pragma unroll
      for (int x = 0; x < lane_map::row_shuffles; ++x)
      {
        rs[mi][h] = shfl_merge(rs[mi][h], lane_map::row_xor(x));
      }
    }
  }
  const bool columns = a.symmetric != 0; // info_nce has no column statistics (uniform across the block)
  if (columns)
  {
#pragma unroll
    for (int ni = 0; ni < config::nt; ++ni)
    {
#pragma unroll
      for (int e = 0; e < 2; ++e)
      {
#pragma unroll
        for (int x = 0; x < lane_map::col_shuffles; ++x)
        {
          cs[ni][e] = shfl_merge(cs[ni][e], lane_map::col_xor(x));
        }
      }
    }
  }
  // tile_product ended with a barrier: the tiles' shared bytes are free.
  smem_reduce& red = *reinterpret_cast<smem_reduce*>(raw);
  if (lane_map::row_writer(lane))
  {
#pragma unroll
    for (int mi = 0; mi < config::mt; ++mi)
    {
#pragma unroll
      for (int h = 0; h < 2; ++h)
      {
        const int lr = wrow + mi * 16 + lane_map::c_row(lane, h);
        red.row_max[wn_i][lr] = rs[mi][h].max;
        red.row_sum[wn_i][lr] = rs[mi][h].sum;
      }
    }
  }
  if (columns && lane_map::col_writer(lane))
  {
#pragma unroll
    for (int ni = 0; ni < config::nt; ++ni)
    {
#pragma unroll
      for (int e = 0; e < 2; ++e)
      {
        const int lc = wcol + ni * 8 + lane_map::c_col(lane, e);
        red.col_max[wm_i][lc] = cs[ni][e].max;
        red.col_sum[wm_i][lc] = cs[ni][e].sum;
      }
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0)
  {
    *a.flag = 1;
  }
  const int t = static_cast<int>(threadIdx.x);
  if (t < config::bm)
  {
    online_lse v{};
#pragma unroll
    for (int w = 0; w < config::warps_n; ++w)
    {
      v.merge(online_lse{red.row_max[w][t], red.row_sum[w][t]});
    }
    if (row0 + t < a.rows)
    {
      a.row_part[static_cast<long long>(row0 + t) * gridDim.x + col0 / config::bn] = make_float2(v.max, v.sum);
    }
  }
  else if (columns && t < config::bm + config::bn)
  {
    const int c = t - config::bm;
    online_lse v{};
#pragma unroll
    for (int w = 0; w < config::warps_m; ++w)
    {
      v.merge(online_lse{red.col_max[w][c], red.col_sum[w][c]});
    }
    if (col0 + c < a.n_k)
    {
      a.col_part[static_cast<long long>(row0 / config::bm) * a.n_k + col0 + c] = make_float2(v.max, v.sum);
    }
  }
}

template <class T>
__device__ CONTRASTIVE_FORCEINLINE void
gradient_epilogue::apply(const tile_args& a, tile_accumulators& acc, unsigned char* raw, int row0, int col0) noexcept
{
  (void)raw;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int wrow = lane_map::warp_row(warp);
  const int wcol = lane_map::warp_col(warp);
  const float s = a.scalars->scale;
  const bool sym = a.symmetric != 0;
  float clse[config::nt][2];
#pragma unroll
  for (int ni = 0; ni < config::nt; ++ni)
  {
#pragma unroll
    for (int e = 0; e < 2; ++e)
    {
      const int j = col0 + wcol + ni * 8 + lane_map::c_col(lane, e);
      clse[ni][e] = sym && j < a.n_k ? a.col_lse[j] : 0.0f;
    }
  }
  T* g = static_cast<T*>(a.g);
#pragma unroll
  for (int mi = 0; mi < config::mt; ++mi)
  {
#pragma unroll
    for (int h = 0; h < 2; ++h)
    {
      const int r = row0 + wrow + mi * 16 + lane_map::c_row(lane, h);
      if (r >= a.rows)
      {
        continue;
      }
      const long long i = a.c0 + r;
      const long long p = positive_of(a, i);
      const float rlse = a.row_lse[i];
      const float pos_g =
          exact_positive_gradient(a.row_loss[i], sym && p >= 0 && p < a.n_k ? a.col_loss[p] : 0.0f, a.gc, sym);
      T* out = g + static_cast<long long>(r) * a.ld;
#pragma unroll
      for (int ni = 0; ni < config::nt; ++ni)
      {
        const int j = col0 + wcol + ni * 8 + lane_map::c_col(lane, 0); // even; ld % 32 == 0: out + j 4-byte aligned
        T gv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e)
        {
          const float v = s * acc[mi][ni][2 * h + e];
          const float x = j + e == p ? pos_g : logit_gradient(v, rlse, clse[ni][e], a.gc, sym);
          gv[e] = element_traits<T>::from_float(x * a.factor);
        }
        if (j + 1 < a.n_k)
        {
          *reinterpret_cast<element_pair<T>*>(out + j) = element_pair<T>{gv[0], gv[1]};
        }
        else if (j < a.n_k)
        {
          out[j] = gv[0];
        }
      }
    }
  }
}

/// Forward, after the statistics tiles: each row's statistics from its column tiles' partials and its positive (as
/// chunked_phases::row_statistics). One warp per row.
template <int = 0> // a template, like every kernel in a header: one definition across translation units
__global__ void __launch_bounds__(256) finish_tile_rows(const float2* row_part,
                                                        int tiles,
                                                        int rows,
                                                        long long c0,
                                                        int n_k,
                                                        const std::int32_t* labels,
                                                        float* out_lse,
                                                        float* out_loss,
                                                        float* out_max,
                                                        float* pos)
{
  const int r = static_cast<int>(blockIdx.x) * 8 + static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (r >= rows)
  {
    return;
  }
  online_lse v{};
  for (int t = lane; t < tiles; t += 32)
  {
    const float2 part = row_part[static_cast<long long>(r) * tiles + t];
    v.merge(online_lse{part.x, part.y});
  }
#pragma unroll
  for (int m = 16; m > 0; m /= 2)
  {
    v = shfl_merge(v, m);
  }
  if (lane == 0)
  {
    const long long i = c0 + r;
    const long long p = labels != nullptr ? static_cast<long long>(labels[i]) : i;
    // An out-of-range label (not checked on the device) has no positive: -inf makes the row's loss +inf.
    const float positive = p >= 0 && p < n_k ? pos[i] : -contrastive::detail::infinity_f;
    const row_loss rl = finish_row(v, positive);
    out_lse[i] = rl.lse;
    out_loss[i] = rl.loss;
    out_max[i] = kernels::nan_max{}(v.max, positive);
    pos[i] = positive;
  }
}

/// Forward, symmetric, after the statistics tiles: the chunk's column partials (row tiles) merged into the running
/// column state (`first`: the state starts here).
template <int = 0> // a template, like every kernel in a header: one definition across translation units
__global__ void __launch_bounds__(256)
    merge_tile_columns(const float2* col_part, int tiles, int n_k, int first, float* col_max, float* col_sum)
{
  for (int j = static_cast<int>(blockIdx.x) * 256 + static_cast<int>(threadIdx.x); j < n_k;
       j += static_cast<int>(gridDim.x) * 256)
  {
    online_lse run = first ? online_lse{} : online_lse{col_max[j], col_sum[j]};
    for (int t = 0; t < tiles; ++t)
    {
      const float2 part = col_part[static_cast<long long>(t) * n_k + j];
      run.merge(online_lse{part.x, part.y});
    }
    col_max[j] = run.max;
    col_sum[j] = run.sum;
  }
}
} // namespace tile_detail
} // namespace device
} // namespace contrastive

#undef CONTRASTIVE_TILE_MMA
