// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// CUDA kernels of the device path. Only CUDA translation units include this file.
///
/// One tiled "row pass" kernel serves every direction: for each row a of A it walks all rows b of B, forming the
/// logits S_ab = s <A_a, B_b> tile by tile (tensor cores for 16-bit types). In `forward` mode it keeps the online
/// log-sum-exp of row a's negatives and its positive logit; in `backward` mode it rebuilds G from the saved
/// log-sum-exps and accumulates dA_a = sum_b G_ab B_b. The CLIP loss runs it with (A, B) = (Q, K) for rows and
/// dQ, and (K, Q) for columns and dK, so dQ is row-parallel, dK column-parallel, and no atomics touch the O(N^2 D)
/// work. The materialized algorithm reuses the same kernel with logits read from its element-type matrix.
///
/// Its parts: kernels/args.cuh (what a pass is given), kernels/tiles.cuh (the logits tile), kernels/step.cuh (the
/// step's small kernels around the passes: prologue, finish, unscale).

#include <contrastive/device/kernel_traits.cuh>
#include <contrastive/device/kernels/args.cuh>
#include <contrastive/device/kernels/step.cuh>
#include <contrastive/device/kernels/tiles.cuh>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/numeric/online_lse.hpp>
#include <contrastive/step/logic.hpp>

#include <cub/block/block_reduce.cuh>

#include <cstdint>
#include <mma.h>

namespace contrastive
{
namespace device
{
namespace kernels
{
/// Forward row pass: per row of A, the log-sum-exp and cross-entropy over B, and the row's largest logit.
template <class T, source Src>
__global__ void __launch_bounds__(256) forward_pass(pass_args p)
{
  using traits = kernel_traits<T>;
  __shared__ shared_tiles<T> sm;
  const T* A = static_cast<const T*>(p.a);
  const T* B = static_cast<const T*>(p.b);
  const float s = p.scalars->scale;
  const int row0 = blockIdx.x * traits::block_m;
  const int r = threadIdx.x / 4, sub = threadIdx.x % 4;
  const int row = row0 + r;
  // A NaN logit must reach the reported loss and max logit: every max that feeds them propagates NaN (nan_max; for
  // NaN-free rows it is fmaxf, so the online log-sum-exp is unchanged).
  const nan_max max_of{};
  online_lse neg{};
  float pos = -detail::infinity_f;
  bool bad = false;
  for (int col0 = 0; col0 < p.n_b; col0 += traits::block_n)
  {
    if constexpr (Src == source::compute)
    {
      compute_s_tile<T>(sm, A, B, row0, col0, p);
    }
    if (row < p.n_a)
    {
      float x[traits::block_n / 4];
      float m = -detail::infinity_f;
#pragma unroll
      for (int t = 0; t < traits::block_n / 4; ++t)
      {
        const int c = sub + 4 * t;
        const int col = col0 + c;
        x[t] = -detail::infinity_f;
        if (col < p.n_b)
        {
          const float v = logit_at<T, Src>(sm, p, r, c, row, col, s);
          bad |= !detail::finite(v);
          if (is_positive<T>(p, row, col))
          {
            pos = v;
          }
          else
          {
            x[t] = v;
            m = max_of(m, v);
          }
        }
      }
      if (!(m == -detail::infinity_f)) // some negative in this slice (a NaN one included)
      {
        neg.rebase(max_of(neg.max, m)); // the tile update host and device share (online_lse::rebase)
        const float shift = neg.shift();
        float sum = 0.0f;
#pragma unroll
        for (int t = 0; t < traits::block_n / 4; ++t)
        {
          sum += detail::exp_approx(x[t] - shift);
        }
        neg.sum += sum;
      }
    }
    if constexpr (Src == source::compute)
    {
      __syncthreads(); // the next tile overwrites sm.st
    }
  }
  // Merge the four partial states of each row (consecutive lanes of one warp).
#pragma unroll
  for (int off = 1; off < 4; off *= 2)
  {
    const online_lse other{__shfl_xor_sync(0xffffffffu, neg.max, off), __shfl_xor_sync(0xffffffffu, neg.sum, off)};
    neg.merge(other);
    pos = max_of(pos, __shfl_xor_sync(0xffffffffu, pos, off)); // the other lanes hold -inf: keep a NaN positive
  }
  if (sub == 0 && row < p.n_a)
  {
    const row_loss rl = finish_row(neg, pos);
    p.lse[row] = rl.lse;
    p.loss[row] = rl.loss;
    p.max_logit[row] = max_of(neg.max, pos); // rl.shift (the larger of the two), a NaN propagated
    if (p.log_sum != nullptr)
    {
      p.log_sum[row] = rl.log_sum;
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0)
  {
    atomicOr(&p.flags[0], 1);
  }
}

/// Backward row pass: dA = out_scale * sum_b G_ab B_b in the element type, accumulated in float.
template <class T, source Src>
__global__ void __launch_bounds__(256) backward_pass(pass_args p)
{
  using traits = kernel_traits<T>;
  using tiles = shared_tiles<T>;
  using stage_t = typename tiles::stage_t;
  constexpr int bm = traits::block_m, bn = traits::block_n, dc = traits::d_chunk;
  __shared__ shared_tiles<T> sm;
  const T* A = static_cast<const T*>(p.a);
  const T* B = static_cast<const T*>(p.b);
  // Only the fused tiles need s inside the loop; the epilogue reads it again, so that the materialized passes keep no
  // register live across the loop for it (on sm_80 that register was spilled).
  const float s = Src == source::compute ? p.scalars->scale : 1.0f;
  const int tid = threadIdx.x;
  const int row0 = blockIdx.x * bm;
  const int r = tid / 4, sub = tid % 4;
  const int row = row0 + r;
  // G is stored divided by the larger coefficient so that it sits near [-2, 1] in 16-bit storage; fp16 also scales
  // it by 2^k ~ n so that entries near 1/n stay normal (kernel_traits::scale_gradient_tile), and the products are
  // scaled back by 2^-k in the epilogue (`out_norm`). Powers of two: both scalings are exact.
  constexpr bool scale_tile = traits::scale_gradient_tile && Src == source::compute;
  const float norm = Src == source::compute ? fmaxf(p.coef_a, p.coef_b) : 1.0f;
  float inv_norm = 1.0f / norm;
  float out_norm = norm;
  if constexpr (scale_tile)
  {
    const int k = gradient_tile_shift(max(p.n_a, p.n_b), traits::max_gradient_shift);
    inv_norm *= __int_as_float((127 + k) << 23); // 2^k
    out_norm *= __int_as_float((127 - k) << 23); // 2^-k
  }
  // A missing row term (the info_nce column pass) is an infinite log-sum-exp: its exp is 0, never 0 * inf.
  const float lse_row =
      (Src == source::compute && row < p.n_a && p.lse_a != nullptr) ? p.lse_a[row] : detail::infinity_f;
  const grad_coefficients coef{p.coef_a, p.coef_b, p.coef_pos};
  float* acc_block = p.acc + static_cast<long long>(row0) * p.ld_acc;
  for (int col0 = 0; col0 < p.n_b; col0 += bn)
  {
    if constexpr (Src == source::compute)
    {
      compute_s_tile<T>(sm, A, B, row0, col0, p);
    }
    if constexpr (Src == source::compute)
    {
      // G is formed from the S tile it then overwrites, so it waits in registers for a barrier.
      float gv[bn / 4];
#pragma unroll
      for (int t = 0; t < bn / 4; ++t)
      {
        const int c = sub + 4 * t;
        const int col = col0 + c;
        float g = 0.0f;
        if (row < p.n_a && col < p.n_b)
        {
          const float x = s * sm.v.st[r][c];
          const bool two_sided = p.lse_b != nullptr;
          g = logit_gradient(x, lse_row, two_sided ? p.lse_b[col] : 0.0f, coef, two_sided);
          if (is_positive<T>(p, row, col))
          {
            g = exact_positive_gradient(p.loss_a != nullptr ? p.loss_a[row] : 0.0f,
                                        p.loss_b != nullptr ? p.loss_b[col] : 0.0f,
                                        coef,
                                        two_sided);
          }
          g *= inv_norm;
        }
        gv[t] = g;
      }
      __syncthreads(); // every thread has read its S values: the G tile may overwrite them
#pragma unroll
      for (int t = 0; t < bn / 4; ++t)
      {
        sm.v.g[r][sub + 4 * t] = to_stage<stage_t>(gv[t]);
      }
    }
    else
    {
      // The matrix already holds dA = round_T(s round_T(ls G)) in T: copied as it is. No S tile is in shared memory
      // (the previous tile's products ended with a barrier), so it goes straight to the G tile, through one base
      // pointer and stride, 8 loads in flight (fewer live registers: no spill, <= 64 registers on sm_80 and sm_90).
      const T* m = static_cast<const T*>(p.matrix);
      const stage_t zero = stage_t(element_traits<T>::from_float(0.0f));
      const long long stride = Src == source::matrix ? 4 : 4LL * p.matrix_ld;
      const T* src = m + (Src == source::matrix ? static_cast<long long>(row) * p.matrix_ld + col0 + sub
                                                : static_cast<long long>(col0 + sub) * p.matrix_ld + row);
#pragma unroll 8
      for (int t = 0; t < bn / 4; ++t)
      {
        const int c = sub + 4 * t;
        sm.v.g[r][c] = (row < p.n_a && col0 + c < p.n_b) ? stage_t(src[t * stride]) : zero;
      }
    }
    __syncthreads();
    for (int d0 = 0; d0 < p.ld_acc; d0 += dc)
    {
      for (int e = tid; e < bn * dc; e += traits::threads)
      {
        const int j = e / dc, c = e % dc;
        const int gj = col0 + j, gc = d0 + c;
        const bool in = gj < p.n_b && gc < p.dim;
        if constexpr (traits::use_tensor_cores)
        {
          sm.u.d.bd[j][c] = in ? B[static_cast<long long>(gj) * p.dim + gc] : element_traits<T>::from_float(0.0f);
        }
        else
        {
          sm.u.d.bd[j][c] = in ? element_traits<T>::to_float(B[static_cast<long long>(gj) * p.dim + gc]) : 0.0f;
        }
      }
      __syncthreads();
      if constexpr (traits::use_tensor_cores)
      {
        using namespace nvcuda;
        const int warp = tid / 32;
        const int fr = warp / 2, fc0 = (warp % 2) * 2;
        for (int f = 0; f < 2; ++f)
        {
          float* cptr = acc_block + static_cast<long long>(fr * 16) * p.ld_acc + d0 + (fc0 + f) * 16;
          wmma::fragment<wmma::accumulator, 16, 16, 16, float> cf;
          wmma::load_matrix_sync(cf, cptr, p.ld_acc, wmma::mem_row_major);
          for (int kk = 0; kk < bn; kk += 16)
          {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> af;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bf;
            wmma::load_matrix_sync(af, &sm.v.g[fr * 16][kk], bn + tiles::pad);
            wmma::load_matrix_sync(bf, &sm.u.d.bd[kk][(fc0 + f) * 16], dc + tiles::pad);
            wmma::mma_sync(cf, af, bf, cf);
          }
          wmma::store_matrix_sync(cptr, cf, p.ld_acc, wmma::mem_row_major);
        }
      }
      else
      {
        const int ty = tid / 16, tx = tid % 16;
        float c[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
        {
#pragma unroll
          for (int j = 0; j < 4; ++j)
          {
            c[i][j] = acc_block[static_cast<long long>(ty * 4 + i) * p.ld_acc + d0 + tx * 4 + j];
          }
        }
        for (int k = 0; k < bn; ++k)
        {
          float gv[4], bv[4];
#pragma unroll
          for (int i = 0; i < 4; ++i)
          {
            gv[i] = sm.v.g[ty * 4 + i][k];
            bv[i] = sm.u.d.bd[k][tx * 4 + i];
          }
#pragma unroll
          for (int i = 0; i < 4; ++i)
          {
#pragma unroll
            for (int j = 0; j < 4; ++j)
            {
              c[i][j] += gv[i] * bv[j];
            }
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
        {
#pragma unroll
          for (int j = 0; j < 4; ++j)
          {
            acc_block[static_cast<long long>(ty * 4 + i) * p.ld_acc + d0 + tx * 4 + j] = c[i][j];
          }
        }
      }
      __syncthreads();
    }
  }
  // Epilogue: scale, round once to T, test finiteness; <dA, A> for d loss / d log s.
  const float out_scale = p.out_is_final ? 1.0f : p.scalars->loss_scale * p.scalars->scale * out_norm;
  T* out = static_cast<T*>(p.out);
  float dlogs = 0.0f;
  bool bad = false;
  const long long rows = min(bm, p.n_a - row0);
  for (long long e = tid; e < rows * p.dim; e += traits::threads)
  {
    const long long rr = e / p.dim;
    const int c = static_cast<int>(e % p.dim);
    const long long grow = row0 + rr;
    const float v = acc_block[static_cast<long long>(rr) * p.ld_acc + c];
    const T o = element_traits<T>::from_float(out_scale * v);
    out[grow * p.dim + c] = o;
    bad |= !element_traits<T>::is_finite(o);
    if (p.dlogs_partial != nullptr)
    {
      dlogs += out_norm * v * element_traits<T>::to_float(A[grow * p.dim + c]);
    }
  }
  if (p.dlogs_partial != nullptr)
  {
    using reduce_t = cub::BlockReduce<float, traits::threads>;
    __shared__ typename reduce_t::TempStorage tmp;
    const float total = reduce_t(tmp).Sum(dlogs);
    if (tid == 0)
    {
      p.dlogs_partial[blockIdx.x] = total;
    }
  }
  if (__syncthreads_or(bad) && tid == 0)
  {
    atomicOr(&p.flags[p.flag_index], 1);
  }
}

/// Materialized forward, first kernel: M = round_T(Q K^T) (the autocast matmul output).
template <class T>
__global__ void __launch_bounds__(256) materialize_logits(pass_args p)
{
  using traits = kernel_traits<T>;
  __shared__ shared_tiles<T> sm;
  T* m = static_cast<T*>(const_cast<void*>(p.matrix));
  const long long col_tiles = (p.n_b + traits::block_n - 1) / traits::block_n;
  const long long tiles = (p.n_a + traits::block_m - 1) / traits::block_m * col_tiles;
  // Grid-stride over tiles: any n_q x n_k fits the 1-D grid limit.
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x)
  {
    const int row0 = static_cast<int>(t / col_tiles) * traits::block_m;
    const int col0 = static_cast<int>(t % col_tiles) * traits::block_n;
    compute_s_tile<T>(sm, static_cast<const T*>(p.a), static_cast<const T*>(p.b), row0, col0, p);
    for (int e = threadIdx.x; e < traits::block_m * traits::block_n; e += traits::threads)
    {
      const int r = e / traits::block_n, c = e % traits::block_n;
      if (row0 + r < p.n_a && col0 + c < p.n_b)
      {
        m[static_cast<long long>(row0 + r) * p.matrix_ld + col0 + c] = element_traits<T>::from_float(sm.v.st[r][c]);
      }
    }
    __syncthreads(); // the next tile overwrites sm
  }
}

/// Materialized backward, elementwise: M <- dA = round_T(s dS), dS = round_T(loss_scale G); per-block sum dS * A.
/// P (and C) from each log-sum-exp split as (shift, log_sum), as the host's materialized backward forms them: the
/// positive's G_pp = P_pp - 1 is then formed by subtraction from a P_pp good to a few float ulps, as a framework's
/// softmax minus one-hot forms it. (From exp(S - lse), P_pp also carried lse's rounding, ~eps |lse| absolute, which
/// the subtraction keeps: 4.6e-4 relative error in float dQ/dK at n_q 1, n_k 7, dim 3, tau 0.1 on an H200.)
template <class T>
__global__ void __launch_bounds__(256)
    materialized_gradient(pass_args p, split_lse rows, split_lse cols, grad_coefficients gc)
{
  T* m = static_cast<T*>(const_cast<void*>(p.matrix));
  const float s = p.scalars->scale;
  const float ls = p.scalars->loss_scale;
  const long long total = static_cast<long long>(p.n_a) * p.n_b;
  float dlogs = 0.0f;
  for (long long idx = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<long long>(gridDim.x) * blockDim.x)
  {
    const int row = static_cast<int>(idx / p.n_b), col = static_cast<int>(idx % p.n_b);
    const float a = element_traits<T>::to_float(m[idx]);
    const float x = materialized_chain<T>::logit(a, s);
    const bool sym = cols.shift != nullptr;
    float g = logit_gradient(
        x, rows.shift[row], rows.log_sum[row], sym ? cols.shift[col] : 0.0f, sym ? cols.log_sum[col] : 0.0f, gc, sym);
    if (is_positive<T>(p, row, col))
    {
      g = positive_gradient(g, gc);
    }
    const float ds = materialized_chain<T>::scaled_gradient(g, ls);
    dlogs += ds * a;
    m[idx] = element_traits<T>::from_float(materialized_chain<T>::product_gradient(ds, s));
  }
  using reduce_t = cub::BlockReduce<float, 256>;
  __shared__ typename reduce_t::TempStorage tmp;
  const float block_total = reduce_t(tmp).Sum(dlogs);
  if (threadIdx.x == 0)
  {
    p.dlogs_partial[blockIdx.x] = block_total;
  }
}

} // namespace kernels
} // namespace device
} // namespace contrastive
