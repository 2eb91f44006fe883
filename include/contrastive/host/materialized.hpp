// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The materialized algorithm's backward on the host: one elementwise pass turns the stored element-type logits into
/// dA = round_T(s round_T(loss_scale G)) in place (materialized_chain; sigmoid: G from z = round_T(S + b), and
/// d b = sum round_T(loss_scale G)), then dQ = dA K over row blocks and
/// dK = dA^T Q over key tiles, each task owning its output rows (no shared accumulator).

#include <contrastive/host/engine_state.hpp>

#include <algorithm>
#include <cstddef>

namespace contrastive
{
namespace host
{
/// Phase 1's element-type chain on one tile of G in ws.tile (rows x cols at (i0, j0)): dS = round_T(loss_scale G),
/// dA = round_T(s dS) in place of the stored logits, d(loss_scale * loss)/d log s = s sum dS A and (`Biased`: z =
/// S + b) d b = sum dS into the worker's partials. Kept out of line and off the objective: one copy per element type.
template <class T, bool Biased, class Gemm>
CONTRASTIVE_NOINLINE void materialized_chain_tile(engine_state<T, Gemm>& st,
                                                  std::size_t i0,
                                                  std::size_t j0,
                                                  std::size_t rows,
                                                  std::size_t cols,
                                                  float loss_scale,
                                                  const worker_scratch& ws,
                                                  backward_partials& parts,
                                                  unsigned w) noexcept
{
  // materialized_chain<T>'s steps a row at a time (host/element_rows.hpp: vectorised conversions).
  float ds[block_n], a[block_n];
  for (std::size_t ii = 0; ii < rows; ++ii)
  {
    T* m = &st.logits[(i0 + ii) * st.n_k + j0];
    const float* g = &ws.tile[ii * block_n];
    for (std::size_t jj = 0; jj < cols; ++jj) // dS = round_T(loss_scale G)
    {
      ds[jj] = loss_scale * g[jj];
    }
    round_row<T>(ds, cols);
    to_float_row(m, cols, a);
    if constexpr (Biased) // d b = sum dS (z = S + b: dz = dS), of the element-type values a framework sums
    {
      parts.dbias[w] += static_cast<double>(lane_sum(cols,
                                                     [&](std::size_t jj)
                                                     {
                                                       return ds[jj];
                                                     }));
    }
    parts.dlogs[w] += lane_sum(cols,
                               [&](std::size_t jj)
                               {
                                 return ds[jj] * a[jj];
                               });
    for (std::size_t jj = 0; jj < cols; ++jj) // dA = s dS, rounded to T in place of A
    {
      a[jj] = st.scale * ds[jj];
    }
    from_float_row(a, cols, m);
  }
}

/// Phases 2 and 3 of the materialized backward, the same for every objective (so compiled once per element type and
/// GEMM, not per objective): dQ = dA K and dK = dA^T Q from dA in place of the logits, the outputs' non-finite flags
/// into `parts`.
template <class T, class Gemm, class Out>
void materialized_products(engine_state<T, Gemm>& st, backward_partials& parts, Out* dq, Out* dk)
{
  // dQ = dA K, one row block per task.
  st.for_row_blocks(
      [&](std::size_t i0, std::size_t rows, worker_scratch& ws, unsigned w)
      {
        float* acc = ws.acc.data();
        std::fill(acc, acc + block_m * st.dp, 0.0f);
        for (std::size_t j0 = 0; j0 < st.n_k; j0 += block_n)
        {
          const std::size_t cols = std::min(block_n, st.n_k - j0);
          load_tile(&st.logits[i0 * st.n_k + j0], st.n_k, rows, cols, cols, ws);
          st.mm.dq_product(j0, rows, cols, ws, acc, st.dp, st.dp);
        }
        bool bad = false;
        for (std::size_t ii = 0; ii < rows; ++ii)
        {
          bad |= st.store_row(acc + ii * st.dp, 1.0f, dq + (i0 + ii) * st.d);
        }
        parts.bad_q[w] |= bad ? 1 : 0;
      });

  // dK = dA^T Q, one key tile per task.
  st.for_key_tiles(
      [&](std::size_t j0, std::size_t cols, worker_scratch& ws, unsigned w)
      {
        const std::size_t m_pad = round_up(cols, kernel_mr);
        float* acc = ws.acc.data();
        std::fill(acc, acc + block_n * st.dp, 0.0f);
        for (std::size_t i0 = 0; i0 < st.n_q; i0 += block_m)
        {
          load_tile(&st.logits[i0 * st.n_k + j0], st.n_k, std::min(block_m, st.n_q - i0), cols, m_pad, ws);
          st.mm.dk_queries(i0, cols, ws, acc, i0 + block_m >= st.n_q);
        }
        bool bad = false;
        for (std::size_t jj = 0; jj < cols; ++jj)
        {
          bad |= st.store_row(acc + jj * st.dp, 1.0f, dk + (j0 + jj) * st.d);
        }
        parts.bad_k[w] |= bad ? 1 : 0;
      });
}

/// Backward of `loss_scale * loss` for the materialized algorithm after `forward<materialized>`.
template <class O, class T, class Gemm, class Out>
backward_result
materialized_backward(engine_state<T, Gemm>& st, float loss_scale, const grad_coefficients& gc, Out* dq, Out* dk)
{
  backward_partials parts;

  // 1. dA in place of A, and d(loss_scale * loss)/d log s = s * sum dS * A.
  st.for_row_blocks(
      [&](std::size_t i0, std::size_t rows, worker_scratch& ws, unsigned w)
      {
        for (std::size_t j0 = 0; j0 < st.n_k; j0 += block_n)
        {
          const std::size_t cols = std::min(block_n, st.n_k - j0);
          st.template scaled_tile<algorithm::materialized, O>(i0, j0, rows, cols, ws);
          st.template gradient_tile<O>(false, i0, j0, rows, cols, gc, ws);
          materialized_chain_tile<T, O::has_bias>(st, i0, j0, rows, cols, loss_scale, ws, parts, w);
        }
      });

  // 2, 3. dQ = dA K, dK = dA^T Q.
  materialized_products(st, parts, dq, dk);
  return parts.combine(st.workers, static_cast<double>(st.scale), 1.0);
}
} // namespace host
} // namespace contrastive
