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
/// Its parts: logits_tile/product.cuh (arguments, shared memory, the tensor-core product), logits_tile/epilogues.cuh
/// (statistics, gradient); this file holds the tile kernel and the kernels that merge its partials.
///
/// Requirements (checked by the caller, chunked.cuh): 16-bit element type, dim % 8 == 0, q and k 16-byte aligned
/// (rows are then 16-byte aligned too), a device of compute capability 8.0 or later.

#include <contrastive/device/kernels.cuh>
#include <contrastive/device/logits_tile/epilogues.cuh>
#include <contrastive/device/logits_tile/product.cuh>
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
namespace logits_tile
{
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

/// Forward, after the statistics tiles (or chunked_phases::chunk_statistics on float S_c): each row's statistics
/// from its column tiles' partials and its positive. One warp per row.
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
    const float positive = p >= 0 && p < n_k ? pos[i] : -detail::infinity_f;
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
} // namespace logits_tile
} // namespace device
} // namespace contrastive

#undef CONTRASTIVE_TILE_MMA
