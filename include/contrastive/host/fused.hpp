// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The fused algorithm on the host: the forward streams K past the row blocks, and the backward recomputes the logits
/// tiles (bit-identical to the forward's), turns them into G and multiplies them into dQ = s G K and dK = s G^T Q,
/// without ever storing the n_q x n_k matrix or a packed copy of K: every key tile is packed into worker scratch
/// when it is used (forward: once per run of key_run keys and worker; backward: once per tile and round).
///
/// Forward: worker w takes the row blocks parallel_for would give it (every W-th) and, for each run of key_run keys,
/// packs the run once and passes each of its row blocks over it; a row's running state advances over the key tiles
/// in order and a column's over the worker's rows in order, exactly as one row block at a time would.
///
/// Backward: work is split so that no worker needs an n_k x D accumulator of its own and every result is
/// bit-reproducible for a given thread count: W rounds of row groups x key groups (host/fused_rounds.hpp), dQ and dK
/// accumulated in one shared float buffer each (the caller's dq/dk themselves when the element type is float and the
/// shapes are aligned).

#include <contrastive/host/engine_state.hpp>
#include <contrastive/host/fused_rounds.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>

namespace contrastive
{
namespace host
{
/// Forward of the softmax objectives, fused: the finished row statistics and (symmetric) each worker's column
/// partials, as engine_state::forward_rows gives them. The rows' running states live in row_max and row_lse until
/// the rows are finished.
template <class O, class T, class Gemm>
row_pass fused_forward_rows(engine_state<T, Gemm>& st, float s)
{
  st.scale = s;
  st.sigmoid_g_sum = 0.0;
  const std::size_t row_blocks = st.nq_pad / block_m;
  const unsigned workers =
      static_cast<unsigned>(std::max<std::size_t>(1, std::min<std::size_t>(st.workers, row_blocks)));
  st.begin_forward();
  st.reset_column_partials();
  std::fill(st.row_max.begin(), st.row_max.end(), -detail::infinity_f);
  std::fill(st.row_lse.begin(), st.row_lse.end(), 0.0f);
  unsigned char bad[max_threads] = {};
  st.pool.run(workers,
              [&](unsigned w)
              {
                worker_scratch& ws = st.scratch[w];
                online_lse row_state[block_m];
                for (std::size_t r0 = 0; r0 < st.n_k; r0 += key_run)
                {
                  const std::size_t run = std::min(key_run, st.n_k - r0);
                  st.mm.key_tiles(r0, run, ws, false);
                  for (std::size_t t = w; t < row_blocks; t += workers)
                  {
                    const std::size_t i0 = t * block_m;
                    const std::size_t rows = std::min(block_m, st.n_q - i0);
                    st.query_block(i0, ws, false);
                    for (std::size_t ii = 0; ii < rows; ++ii)
                    {
                      row_state[ii] = online_lse{st.row_max[i0 + ii], st.row_lse[i0 + ii]};
                    }
                    for (std::size_t j0 = r0; j0 < r0 + run; j0 += block_n)
                    {
                      const std::size_t cols = std::min(block_n, st.n_k - j0);
                      bad[w] |= st.template forward_tile<algorithm::fused, O>(
                                    i0, j0, rows, cols, ws, row_state, nullptr, nullptr)
                                    ? 1
                                    : 0;
                    }
                    for (std::size_t ii = 0; ii < rows; ++ii)
                    {
                      st.row_max[i0 + ii] = row_state[ii].max;
                      st.row_lse[i0 + ii] = row_state[ii].sum;
                    }
                  }
                }
                for (std::size_t t = w; t < row_blocks; t += workers)
                {
                  const std::size_t i0 = t * block_m;
                  for (std::size_t i = i0; i < std::min(i0 + block_m, st.n_q); ++i)
                  {
                    st.template finish_forward_row<O>(i, online_lse{st.row_max[i], st.row_lse[i]}, 0.0f, 0.0f);
                  }
                }
              });
  bool any_bad = false;
  for (unsigned w = 0; w < workers; ++w)
  {
    any_bad |= bad[w] != 0;
  }
  return st.template finish_rows<O>(any_bad);
}

/// Backward of `loss_scale * loss` for the fused algorithm after `forward<fused>`.
template <class O, class T, class Gemm, class Out>
backward_result
fused_backward(engine_state<T, Gemm>& st, float loss_scale, const grad_coefficients& gc, Out* dq, Out* dk)
{
  const double out_scale = backward_output_factor(loss_scale, st.scale);
  const unsigned groups = fused_groups(st);
  const bool in_place = gemm_backend<Gemm, T>::in_place_ok(st.n_k, st.d);
  float* dq_acc = in_place ? reinterpret_cast<float*>(dq) : st.dq_acc.data();
  float* dk_acc = in_place ? reinterpret_cast<float*>(dk) : st.dk_acc.data();
  const std::size_t ld = in_place ? st.d : st.dp;
  zero_accumulators(st, groups, dq_acc, dk_acc, ld, in_place ? st.n_k : st.nk_pad, [](std::size_t, std::size_t) {});
  // dQ accumulates straight into its rows of dq_acc.
  for_fused_rounds(
      st,
      groups,
      [&](std::size_t i0, std::size_t rows, std::size_t j0, std::size_t cols, worker_scratch& ws, unsigned, bool last)
      {
        st.template scaled_tile<algorithm::fused, O>(i0, j0, rows, cols, ws);
        st.template gradient_tile<O>(true, i0, j0, rows, cols, gc, ws);
        st.mm.dq_product(j0, rows, cols, ws, dq_acc + i0 * ld, ld, ld);
        st.mm.dk_block(cols, ws, dk_acc + j0 * ld, ld, ld, last);
      });

  // Scale, round and check; d loss / d log s = sum_i <dQ_i, q_i> (before the element-type rounding).
  const backward_partials parts = store_accumulators(st, dq_acc, dk_acc, ld, out_scale, dq, dk);
  return parts.combine(st.workers, out_scale);
}
} // namespace host
} // namespace contrastive
