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
/// Backward of `loss_scale * loss` for the materialized algorithm after `forward<materialized>`.
template <class O, class T, class Gemm, class Out>
backward_result
materialized_backward(engine_state<T, Gemm>& st, float loss_scale, const grad_coefficients& gc, Out* dq, Out* dk)
{
  using traits = element_traits<T>;
  constexpr bool biased = O::has_bias; // z = S + b: d b = sum dS
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
          for (std::size_t ii = 0; ii < rows; ++ii)
          {
            T* m = &st.logits[(i0 + ii) * st.n_k + j0];
            const float* g = &ws.tile[ii * block_n];
            if constexpr (biased) // d b = sum dS (z = S + b: dz = dS), of the element-type values a framework sums
            {
              parts.dbias[w] +=
                  static_cast<double>(lane_sum(cols,
                                               [&](std::size_t jj)
                                               {
                                                 return materialized_chain<T>::scaled_gradient(g[jj], loss_scale);
                                               }));
            }
            parts.dlogs[w] += lane_sum(cols,
                                       [&](std::size_t jj)
                                       {
                                         const float ds = materialized_chain<T>::scaled_gradient(g[jj], loss_scale);
                                         const float prod = ds * traits::to_float(m[jj]);
                                         m[jj] =
                                             traits::from_float(materialized_chain<T>::product_gradient(ds, st.scale));
                                         return prod;
                                       });
          }
        }
      });

  // 2. dQ = dA K, one row block per task.
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

  // 3. dK = dA^T Q, one key tile per task.
  st.for_key_tiles(
      [&](std::size_t j0, std::size_t cols, worker_scratch& ws, unsigned w)
      {
        const std::size_t m_pad = round_up(cols, kernel_mr);
        float* acc = ws.acc.data();
        std::fill(acc, acc + block_n * st.dp, 0.0f);
        for (std::size_t i0 = 0; i0 < st.n_q; i0 += block_m)
        {
          load_tile(&st.logits[i0 * st.n_k + j0], st.n_k, std::min(block_m, st.n_q - i0), cols, m_pad, ws);
          st.mm.dk_queries(i0, cols, ws, acc);
        }
        bool bad = false;
        for (std::size_t jj = 0; jj < cols; ++jj)
        {
          bad |= st.store_row(acc + jj * st.dp, 1.0f, dk + (j0 + jj) * st.d);
        }
        parts.bad_k[w] |= bad ? 1 : 0;
      });

  return parts.combine(st.workers, static_cast<double>(st.scale), 1.0);
}
} // namespace host
} // namespace contrastive
