// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The epilogues of the chunked logits tile (device/logits_tile.cuh), applied to the tile in registers: the
/// statistics (forward: the negatives' row and column partials, the positives, the non-finite flag) and the
/// gradient (backward: G_c rounded to the element type). Only CUDA translation units include this file.

#include <contrastive/device/logits_tile/product.cuh>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/numeric/online_lse.hpp>

#include <contrastive/device/kernels/args.cuh>
#include <contrastive/device/tile_layout.hpp>
#include <contrastive/numeric/loss_math.hpp>

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
namespace logits_tile
{
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
            bad |= !detail::finite(v);
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
} // namespace logits_tile
} // namespace device
} // namespace contrastive
