// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The materialized algorithm's backward on the host: one elementwise pass turns the stored element-type logits into
/// dA = round_T(s round_T(loss_scale G)) in place (materialized_chain), then dQ = dA K over row blocks and
/// dK = dA^T Q over key tiles, each task owning its output rows (no shared accumulator).

#include <contrastive/host/engine_state.hpp>

#include <algorithm>
#include <cstddef>

namespace contrastive
{
namespace host
{
/// Block (i0, j0) of the stored element-type matrix (rows x cols) into ws.tile as float, zero up to block_m rows and
/// `width` (>= cols) columns.
template <class T, class Gemm>
void load_matrix_tile(const engine_state<T, Gemm>& st,
                      std::size_t i0,
                      std::size_t j0,
                      std::size_t rows,
                      std::size_t cols,
                      std::size_t width,
                      worker_scratch& ws) noexcept
{
  for (std::size_t ii = 0; ii < block_m; ++ii)
  {
    float* out = &ws.tile[ii * block_n];
    std::size_t jj = 0;
    if (ii < rows)
    {
      const T* m = &st.logits[(i0 + ii) * st.n_k + j0];
      for (; jj < cols; ++jj)
      {
        out[jj] = element_traits<T>::to_float(m[jj]);
      }
    }
    std::fill(out + jj, out + width, 0.0f);
  }
}

/// Backward of `loss_scale * loss` for the materialized algorithm after `forward<materialized>`.
template <class T, class Gemm, class Out>
backward_result
materialized_backward(engine_state<T, Gemm>& st, float loss_scale, const grad_coefficients& gc, Out* dq, Out* dk)
{
  using traits = element_traits<T>;
  const std::size_t row_tasks = st.nq_pad / block_m;
  backward_partials parts;

  // 1. dA in place of A, and d(loss_scale * loss)/d log s = s * sum dS * A.
  parallel_for(st.pool,
               row_tasks,
               st.workers,
               [&](std::size_t t, unsigned w)
               {
                 worker_scratch& ws = st.scratch[w];
                 const std::size_t i0 = t * block_m;
                 const std::size_t rows = std::min(block_m, st.n_q - i0);
                 for (std::size_t j0 = 0; j0 < st.n_k; j0 += block_n)
                 {
                   const std::size_t cols = std::min(block_n, st.n_k - j0);
                   st.template scaled_tile<algorithm::materialized>(i0, j0, rows, cols, ws);
                   st.gradient_tile(false, i0, j0, rows, cols, gc, ws);
                   for (std::size_t ii = 0; ii < rows; ++ii)
                   {
                     T* m = &st.logits[(i0 + ii) * st.n_k + j0];
                     const float* g = &ws.tile[ii * block_n];
                     parts.dlogs[w] +=
                         lane_sum(cols,
                                  [&](std::size_t jj)
                                  {
                                    const float ds = materialized_chain<T>::scaled_gradient(g[jj], loss_scale);
                                    const float prod = ds * traits::to_float(m[jj]);
                                    m[jj] = traits::from_float(materialized_chain<T>::product_gradient(ds, st.scale));
                                    return prod;
                                  });
                   }
                 }
               });

  // 2. dQ = dA K, one row block per task.
  parallel_for(st.pool,
               row_tasks,
               st.workers,
               [&](std::size_t t, unsigned w)
               {
                 worker_scratch& ws = st.scratch[w];
                 const std::size_t i0 = t * block_m;
                 const std::size_t rows = std::min(block_m, st.n_q - i0);
                 float* acc = ws.acc.data();
                 std::fill(acc, acc + block_m * st.dp, 0.0f);
                 for (std::size_t j0 = 0; j0 < st.n_k; j0 += block_n)
                 {
                   const std::size_t cols = std::min(block_n, st.n_k - j0);
                   load_matrix_tile(st, i0, j0, rows, cols, cols, ws);
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
  parallel_for(st.pool,
               st.nk_pad / block_n,
               st.workers,
               [&](std::size_t t, unsigned w)
               {
                 worker_scratch& ws = st.scratch[w];
                 const std::size_t j0 = t * block_n;
                 if (j0 >= st.n_k)
                 {
                   return;
                 }
                 const std::size_t cols = std::min(block_n, st.n_k - j0);
                 const std::size_t m_pad = round_up(cols, kernel_mr);
                 float* acc = ws.acc.data();
                 std::fill(acc, acc + block_n * st.dp, 0.0f);
                 for (std::size_t i0 = 0; i0 < st.n_q; i0 += block_m)
                 {
                   load_matrix_tile(st, i0, j0, std::min(block_m, st.n_q - i0), cols, m_pad, ws);
                   st.mm.dk_queries(i0, cols, ws, acc);
                 }
                 bool bad = false;
                 for (std::size_t jj = 0; jj < cols; ++jj)
                 {
                   bad |= st.store_row(acc + jj * st.dp, 1.0f, dk + (j0 + jj) * st.d);
                 }
                 parts.bad_k[w] |= bad ? 1 : 0;
               });

  return parts.combine(st.workers, static_cast<double>(st.scale));
}
} // namespace host
} // namespace contrastive
