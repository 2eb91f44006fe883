// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The row pass's tiles (device/kernels.cuh): the shared-memory stages, the positive test, the unscaled logits tile
/// st = A_blk B_blk^T (tensor cores for 16-bit types) and one scaled logit from it or from the materialized matrix.
/// Only CUDA translation units include this file.

#include <contrastive/device/kernel_traits.cuh>
#include <contrastive/device/kernels/args.cuh>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/loss_math.hpp>

#include <mma.h>
#include <type_traits>

namespace contrastive
{
namespace device
{
namespace kernels
{
/// A float as a shared-memory stage element (T for the tensor-core types, float otherwise) through element_traits,
/// never an implicit conversion: PyTorch's extension builder compiles with -D__CUDA_NO_HALF_CONVERSIONS__ (and its
/// bfloat16 sibling), under which __half(float) does not exist.
template <class S>
__device__ CONTRASTIVE_FORCEINLINE S to_stage(float x) noexcept
{
  if constexpr (std::is_same_v<S, float>)
  {
    return x;
  }
  else
  {
    return element_traits<S>::from_float(x);
  }
}

template <class T>
struct shared_tiles
{
  using traits = kernel_traits<T>;
  using stage_t = std::conditional_t<traits::use_tensor_cores, T, float>;
  static constexpr int bm = traits::block_m, bn = traits::block_n, bk = traits::block_k, dc = traits::d_chunk;
  static constexpr int pad = traits::pad;
  union operands
  {
    struct
    {
      alignas(32) stage_t a[bm][bk + pad];
      alignas(32) stage_t b[bn][bk + pad];
    } s;
    struct
    {
      alignas(32) stage_t bd[bn][dc + pad];
    } d;
  };
  operands u;
  // The S tile and the G tile are never live at once (G is built in registers from S, then stored after a barrier).
  union results
  {
    alignas(32) float st[bm][traits::s_ld];
    alignas(32) stage_t g[bm][bn + pad];
  };
  results v;
};

template <class T>
__device__ __forceinline__ bool is_positive(const pass_args& p, int row, int col)
{
  switch (p.pos)
  {
  case positive_mode::row_label:
    return p.labels[row] == col;
  case positive_mode::col_label:
    return p.labels[col] == row;
  default:
    return row == col;
  }
}

/// st[r][c] = <A_{row0 + r}, B_{col0 + c}> (unscaled, float). Rows/columns past the ends read zeros.
template <class T>
__device__ void compute_s_tile(shared_tiles<T>& sm, const T* A, const T* B, int row0, int col0, const pass_args& p)
{
  using traits = kernel_traits<T>;
  using tiles = shared_tiles<T>;
  using stage_t = typename tiles::stage_t;
  constexpr int bm = tiles::bm, bn = tiles::bn, bk = tiles::bk;
  const int tid = threadIdx.x;
  const stage_t zero = stage_t(element_traits<T>::from_float(0.0f));
  auto load = [&](const T* src, int n, int r0, stage_t(*dst)[bk + tiles::pad], int rows, int k0)
  {
    for (int e = tid; e < rows * bk; e += traits::threads)
    {
      const int r = e / bk, c = e % bk;
      const int gr = r0 + r, gc = k0 + c;
      if constexpr (traits::use_tensor_cores)
      {
        dst[r][c] = (gr < n && gc < p.dim) ? src[static_cast<long long>(gr) * p.dim + gc] : zero;
      }
      else
      {
        dst[r][c] =
            (gr < n && gc < p.dim) ? element_traits<T>::to_float(src[static_cast<long long>(gr) * p.dim + gc]) : 0.0f;
      }
    }
  };
  if constexpr (traits::use_tensor_cores)
  {
    using namespace nvcuda;
    const int warp = tid / 32;
    const int fr = warp / 2, fc0 = (warp % 2) * 2;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
    wmma::fill_fragment(acc[0], 0.0f);
    wmma::fill_fragment(acc[1], 0.0f);
    for (int k0 = 0; k0 < p.dim; k0 += bk)
    {
      load(A, p.n_a, row0, sm.u.s.a, bm, k0);
      load(B, p.n_b, col0, sm.u.s.b, bn, k0);
      __syncthreads();
      for (int kk = 0; kk < bk; kk += 16)
      {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> af;
        wmma::load_matrix_sync(af, &sm.u.s.a[fr * 16][kk], bk + tiles::pad);
        for (int f = 0; f < 2; ++f)
        {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bf;
          wmma::load_matrix_sync(bf, &sm.u.s.b[(fc0 + f) * 16][kk], bk + tiles::pad);
          wmma::mma_sync(acc[f], af, bf, acc[f]);
        }
      }
      __syncthreads();
    }
    for (int f = 0; f < 2; ++f)
    {
      wmma::store_matrix_sync(&sm.v.st[fr * 16][(fc0 + f) * 16], acc[f], traits::s_ld, wmma::mem_row_major);
    }
  }
  else
  {
    const int ty = tid / 16, tx = tid % 16;
    float c[4][4] = {};
    for (int k0 = 0; k0 < p.dim; k0 += bk)
    {
      load(A, p.n_a, row0, sm.u.s.a, bm, k0);
      load(B, p.n_b, col0, sm.u.s.b, bn, k0);
      __syncthreads();
#pragma unroll
      for (int k = 0; k < bk; ++k)
      {
        float av[4], bv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
        {
          av[i] = sm.u.s.a[ty * 4 + i][k];
          bv[i] = sm.u.s.b[tx * 4 + i][k];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
        {
#pragma unroll
          for (int j = 0; j < 4; ++j)
          {
            c[i][j] += av[i] * bv[j];
          }
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
    {
#pragma unroll
      for (int j = 0; j < 4; ++j)
      {
        sm.v.st[ty * 4 + i][tx * 4 + j] = c[i][j];
      }
    }
  }
  __syncthreads();
}

/// The scaled logit of (row, col): from the tile (fused) or from the element-type matrix (materialized, rounded
/// exactly as S = round_T(s * A)).
template <class T, source Src>
__device__ __forceinline__ float
logit_at(const shared_tiles<T>& sm, const pass_args& p, int r, int c, int row, int col, float s)
{
  if constexpr (Src == source::compute)
  {
    return s * sm.v.st[r][c];
  }
  else
  {
    const T* m = static_cast<const T*>(p.matrix);
    const long long idx = Src == source::matrix ? static_cast<long long>(row) * p.matrix_ld + col
                                                : static_cast<long long>(col) * p.matrix_ld + row;
    return materialized_chain<T>::logit(element_traits<T>::to_float(m[idx]), s);
  }
}
} // namespace kernels
} // namespace device
} // namespace contrastive
