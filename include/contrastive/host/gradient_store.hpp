// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The last pass of the host's fused backwards (softmax, fused.hpp; sigmoid, sigmoid.hpp): the float dQ and dK
/// accumulators scaled, rounded and checked into the outputs, over the engine's state (host/engine_state.hpp).

#include <contrastive/host/pass_results.hpp>
#include <contrastive/host/thread_pool.hpp>

#include <algorithm>
#include <cstddef>

namespace contrastive
{
namespace host
{
/// The last pass of the fused backwards: float accumulators (row stride ld) scaled by `factor`, rounded into dq
/// (n_q rows) and dk (n_k rows) and checked, with the per-worker sums of <dQ_i, q_i> (before rounding) for
/// d loss / d log s.
template <class State, class Out>
backward_partials
store_accumulators(State& st, const float* dq_acc, const float* dk_acc, std::size_t ld, float factor, Out* dq, Out* dk)
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
