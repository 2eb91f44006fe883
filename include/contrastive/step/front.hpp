// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `contrastive::step::front<Driver>`: what the front ends over a step driver (`basic_loss`, step/loss.hpp; `core`,
/// core.hpp) share: the driver's configuration, sizes and results passed through, and the diagnosis of the last
/// forward + backward pair.

#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>
#include <contrastive/step/driver.hpp>
#include <contrastive/step/logic.hpp>

#include <cstddef>
#include <utility>

namespace contrastive
{
namespace step
{
/// What every front end over a driver (basic_loss, core) exposes unchanged: the configuration, the sizes, the batch of
/// the last agreed forward and what the last forward and backward found. The front end adds its calls.
template <class Driver>
class front
{
public:
  using problem_type = typename Driver::problem_type;

  unsigned threads() const noexcept
  {
    return driver_.threads();
  }
  /// The communicator (comm::self for one process).
  decltype(auto) communicator() const noexcept
  {
    return driver_.communicator();
  }
  /// algorithm::chunked only: rows per chunk, or the chunk buffer's budget (see chunk_options); applies from the next
  /// call. Other algorithms refuse it (invalid_argument "chunk"), so a setting never silently does nothing.
  status set_chunk(const chunk_options& o)
  {
    return driver_.set_chunk(o);
  }
  /// algorithm::automatic only: the memory budget in bytes its per-call choice compares materialized's buffers with (0,
  /// the default: a quarter of the memory available at each call). Other algorithms refuse it (invalid_argument
  /// "budget").
  status set_memory_budget(std::size_t bytes)
  {
    return driver_.set_memory_budget(bytes);
  }
  /// The budget algorithm::automatic uses now.
  std::size_t memory_budget() const noexcept
  {
    return driver_.memory_budget();
  }
  /// algorithm::automatic: whether a call on `p` at logit scale `s` (s = 1/tau) now would run materialized (false for
  /// the other algorithms): float whose buffers fit the memory budget (16-bit elements run fused at any s).
  bool materializes(const problem_type& p, float s) const noexcept
  {
    return driver_.materializes(p, s);
  }
  /// The algorithm the last call ran: the configured one, or algorithm::automatic's choice ("none" before any call).
  const char* algorithm_used() const noexcept
  {
    return driver_.algorithm_used();
  }
  /// algorithm::chunked: rows per chunk a problem would use (a multiple of the row block, at most all rows).
  std::size_t chunk_rows_for(const problem_type& p) const noexcept
  {
    return driver_.chunk_rows_for(p);
  }
  /// Bytes of host memory held between calls (operands, saved statistics, scratch, materialized logits; ranks: also
  /// the gathered K and the float partials).
  std::size_t bytes_held() const noexcept
  {
    return driver_.bytes_held();
  }
  /// The batch of the last agreed forward: total queries and keys, and this rank's first query and key index.
  std::size_t global_queries() const noexcept
  {
    return driver_.batch().n_q_total;
  }
  std::size_t global_keys() const noexcept
  {
    return driver_.batch().n_k_total;
  }
  std::size_t query_offset() const noexcept
  {
    return driver_.batch().q_off;
  }
  std::size_t key_offset() const noexcept
  {
    return driver_.batch().k_off;
  }
  /// What the last successful forward saw (loss, largest logit, whether a logit was non-finite) and the last backward
  /// produced (whether dQ/dK held a non-finite value, d(loss_scale * loss)/d(log s)).
  const forward_values& last_forward() const noexcept
  {
    return driver_.last_forward();
  }
  const backward_values& last_backward() const noexcept
  {
    return driver_.last_backward();
  }

protected:
  template <class... Args>
  explicit front(Args&&... args) : driver_(std::forward<Args>(args)...)
  {
  }
  /// The first non-finite site of the last forward + backward pair, in the order of `step_record::first_nonfinite`
  /// (d loss / d log s counts when `wants_gradient`, d loss / d b when `wants_bias_gradient`), from the unscaled
  /// gradients as a step record has them (a scaled value can be finite where its division by a small loss scale is
  /// not).
  nonfinite_site first_nonfinite(bool wants_gradient, bool wants_bias_gradient = false) const noexcept
  {
    const forward_values& f = driver_.last_forward();
    const backward_values& b = driver_.last_backward();
    const float ls = driver_.last_loss_scale();
    const nonfinite_site site = detail::first_nonfinite(
        f.logits_nonfinite, f.loss, b.dq_nonfinite, b.dk_nonfinite, wants_gradient, b.grad_logit_scale / ls);
    if (site == nonfinite_site::none && wants_bias_gradient && !detail::finite(b.grad_logit_bias / ls))
    {
      return nonfinite_site::grad_logit_bias;
    }
    return site;
  }

  Driver driver_;
};
} // namespace step
} // namespace contrastive
