// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The tensor-core product of the chunked logits tile (device/logits_tile.cuh): the tile kernels' arguments and
/// shared memory, cp.async double buffering, ldmatrix and mma.sync m16n8k16, and the block's 128 x 128 tile of
/// Q_c K^T in registers. Only CUDA translation units include this file.

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
} // namespace logits_tile
} // namespace device
} // namespace contrastive
