// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The fused algorithm for the sigmoid objective on the host: one pass over the tiles. The sigmoid loss has no
/// normaliser (each logit's term needs its own z only), so the forward forms each tile's z = s Q K^T + b, its loss
/// terms and its gradient G from one exponential per logit, and multiplies G into the float accumulators
/// dQ += G K and dK += G^T Q at once: 6 n_q n_k d flops for forward and backward together (the softmax fused path
/// needs 8), memory O((n_q + n_k) d). The backward then only scales (loss_scale * s / n_q), rounds and checks.
///
/// Work is split as fused.hpp splits its backward (row groups x key groups in W rounds, every dQ and dK row written
/// by one worker per round, a fixed order for a given thread count); each row's loss is summed by the one worker
/// that owns its row group.

#include <contrastive/host/engine_state.hpp>
#include <contrastive/host/fused_rounds.hpp>

#include <algorithm>
#include <cstddef>

namespace contrastive
{
namespace host
{
/// Forward of the sigmoid objective, fused: the loss and the unnormalised gradient accumulators (st.dq_acc,
/// st.dk_acc, st.sigmoid_g_sum) in one pass.
template <class O, class T, class Gemm>
row_pass fused_sigmoid_forward_rows(engine_state<T, Gemm>& st, float s)
{
  st.scale = s;
  st.begin_forward();
  const unsigned groups = fused_groups(st);
  // The caller's float outputs (row stride d) where prepare was given them, else the engine's (stride dp).
  const bool in_place = st.out_dq != nullptr;
  float* dq_acc = in_place ? st.out_dq : st.dq_acc.data();
  float* dk_acc = in_place ? st.out_dk : st.dk_acc.data();
  const std::size_t ld = in_place ? st.d : st.dp;
  zero_accumulators(st,
                    groups,
                    dq_acc,
                    dk_acc,
                    ld,
                    in_place ? st.n_k : st.nk_pad,
                    [&](std::size_t q0, std::size_t q1)
                    {
                      std::fill(st.row_loss.begin() + static_cast<std::ptrdiff_t>(q0),
                                st.row_loss.begin() + static_cast<std::ptrdiff_t>(q1),
                                0.0f);
                      std::fill(st.row_max.begin() + static_cast<std::ptrdiff_t>(q0),
                                st.row_max.begin() + static_cast<std::ptrdiff_t>(q1),
                                -detail::infinity_f);
                    });
  double g_sum[max_threads] = {};
  unsigned char bad[max_threads] = {};
  for_fused_rounds(
      st,
      groups,
      [&](std::size_t i0, std::size_t rows, std::size_t j0, std::size_t cols, worker_scratch& ws, unsigned w, bool last)
      {
        bad[w] |= st.template scaled_tile<algorithm::fused, O>(i0, j0, rows, cols, ws) ? 1 : 0;
        st.mask_positives(i0, j0, rows, cols, ws, true);
        g_sum[w] += pairwise_tile<O>(st, i0, j0, rows, cols, ws, st.row_loss.data() + i0, st.row_max.data() + i0, true);
        st.mm.dq_product(j0, rows, cols, ws, dq_acc + i0 * ld, ld, ld);
        st.mm.dk_block(cols, ws, dk_acc + j0 * ld, ld, ld, last);
      });
  bool any_bad = false;
  st.sigmoid_g_sum = 0.0;
  for (unsigned w = 0; w < st.workers; ++w)
  {
    any_bad |= bad[w] != 0;
    st.sigmoid_g_sum += g_sum[w];
  }
  for (std::size_t i = 0; i < st.n_q; ++i) // the positives' terms are in row_loss already
  {
    set_pairwise_row<O>(st, i, st.row_loss[i], st.row_max[i], false);
  }
  return st.template finish_rows<O>(any_bad);
}

/// Backward of `loss_scale * loss` for the sigmoid objective, fused, after its forward: dQ = (loss_scale s / n) G K
/// and dK likewise from the accumulators, rounded and checked; d loss / d log s = sum_i <dQ_i, q_i>, d loss / d b
/// from the forward's sum of G.
template <class T, class Gemm, class Out>
backward_result
fused_sigmoid_backward(engine_state<T, Gemm>& st, float loss_scale, const grad_coefficients& gc, Out* dq, Out* dk)
{
  const double out_scale = backward_output_factor(loss_scale, st.scale, gc.row_coef);
  // Accumulated in place (the forward was given these outputs: each row is scaled where it lies) or in the engine.
  const bool in_place = st.out_dq != nullptr;
  const float* dq_acc = in_place ? st.out_dq : st.dq_acc.data();
  const float* dk_acc = in_place ? st.out_dk : st.dk_acc.data();
  const std::size_t ld = in_place ? st.d : st.dp;
  const backward_partials parts = store_accumulators(st, dq_acc, dk_acc, ld, out_scale, dq, dk);
  backward_result r = parts.combine(st.workers, out_scale);
  r.grad_logit_bias =
      static_cast<float>(static_cast<double>(loss_scale) * static_cast<double>(gc.row_coef) * st.sigmoid_g_sum);
  return r;
}
} // namespace host
} // namespace contrastive
