// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The schedule both fused gradient passes share (softmax backward, fused.hpp; sigmoid forward + backward,
/// sigmoid.hpp), over the engine's state (host/engine_state.hpp): the float dQ and dK accumulators zeroed, the W
/// rounds of row groups x key groups, and the last pass that scales, rounds and checks the accumulators into the
/// outputs.
///
/// The rounds: the row blocks form W row groups and the key tiles W key groups; in round r (r = 0..W-1) worker w
/// takes row group w against key group (w + r) mod W. Within a round no two workers touch the same dQ rows or the
/// same dK rows, so dQ and dK accumulate in one shared float buffer each, in a fixed order for a given thread count.
/// Within a round the key tiles are the outer loop: each tile is packed once per round, as the logits' and as dQ's
/// operand.

#include <contrastive/host/builtin_gemm.hpp>
#include <contrastive/host/pass_results.hpp>
#include <contrastive/host/thread_pool.hpp>

#include <algorithm>
#include <cstddef>

namespace contrastive
{
namespace host
{
/// The number of row groups (and rounds) for the engine's workers: at most one per row block.
template <class State>
unsigned fused_groups(const State& st) noexcept
{
  return static_cast<unsigned>(std::min<std::size_t>(st.workers, st.nq_pad / block_m));
}

/// Zeroes the accumulators (row stride ld; dk_acc `dk_rows` rows, the engine's own also its padding up to the last
/// MR panel), one slice per group; `also(q0, q1)` clears the group's rows [q0, q1) of whatever else it sums.
template <class State, class F>
void zero_accumulators(
    State& st, unsigned groups, float* dq_acc, float* dk_acc, std::size_t ld, std::size_t dk_rows, F&& also)
{
  parallel_for(st.pool,
               groups,
               groups,
               [&](std::size_t g, unsigned)
               {
                 const std::size_t q0 = st.n_q * g / groups, q1 = st.n_q * (g + 1) / groups;
                 std::fill(dq_acc + q0 * ld, dq_acc + q1 * ld, 0.0f);
                 const std::size_t k0 = dk_rows * g / groups, k1 = dk_rows * (g + 1) / groups;
                 std::fill(dk_acc + k0 * ld, dk_acc + k1 * ld, 0.0f);
                 also(q0, q1);
               });
}

/// The rounds (see the file comment): for each key tile of the worker's key group, packed once per round for the
/// logits and dQ, and each row block of its row group, prepared, f(i0, rows, j0, cols, ws, w, last); `last` says that
/// the block is the group's last against this key tile (the dK product may wait for several blocks until then).
template <class State, class F>
void for_fused_rounds(State& st, unsigned groups, F&& f)
{
  const std::size_t row_blocks = st.nq_pad / block_m;
  const std::size_t key_tiles = st.nk_pad / block_n;
  for (unsigned round = 0; round < groups; ++round)
  {
    st.pool.run(groups,
                [&](unsigned w)
                {
                  worker_scratch& ws = st.scratch[w];
                  const unsigned kg = (w + round) % groups;
                  const std::size_t b0 = row_blocks * w / groups, b1 = row_blocks * (w + 1) / groups;
                  const std::size_t t0 = key_tiles * kg / groups, t1 = key_tiles * (kg + 1) / groups;
                  for (std::size_t t = t0; t < t1; ++t)
                  {
                    const std::size_t j0 = t * block_n;
                    if (j0 >= st.n_k)
                    {
                      break;
                    }
                    const std::size_t cols = std::min(block_n, st.n_k - j0);
                    st.mm.key_tiles(j0, cols, ws, true);
                    for (std::size_t b = b0; b < b1; ++b)
                    {
                      const std::size_t i0 = b * block_m;
                      const std::size_t rows = std::min(block_m, st.n_q - i0);
                      st.query_block(i0, ws, true);
                      f(i0, rows, j0, cols, ws, w, b + 1 == b1);
                    }
                  }
                });
  }
}

/// The last pass of the fused backwards: float accumulators (row stride ld) scaled by `factor`, rounded into dq
/// (n_q rows) and dk (n_k rows) and checked, with the per-worker sums of <dQ_i, q_i> (before rounding) for
/// d loss / d log s.
template <class State, class Out>
backward_partials
store_accumulators(State& st, const float* dq_acc, const float* dk_acc, std::size_t ld, double factor, Out* dq, Out* dk)
{
  backward_partials parts;
  constexpr std::size_t chunk = 64;
  parallel_for(st.pool,
               (st.n_q + chunk - 1) / chunk,
               st.workers,
               [&](std::size_t t, unsigned w)
               {
                 const std::size_t end = std::min(st.n_q, (t + 1) * chunk);
                 for (std::size_t i = t * chunk; i < end; ++i)
                 {
                   const float* acc = dq_acc + i * ld;
                   parts.dlogs[w] += static_cast<double>(st.dot_query(acc, i));
                   parts.bad_q[w] |= st.store_row(acc, factor, dq + i * st.d) ? 1 : 0;
                 }
               });
  parallel_for(st.pool,
               (st.n_k + chunk - 1) / chunk,
               st.workers,
               [&](std::size_t t, unsigned w)
               {
                 const std::size_t end = std::min(st.n_k, (t + 1) * chunk);
                 for (std::size_t j = t * chunk; j < end; ++j)
                 {
                   parts.bad_k[w] |= st.store_row(dk_acc + j * ld, factor, dk + j * st.d) ? 1 : 0;
                 }
               });
  return parts;
}
} // namespace host
} // namespace contrastive
