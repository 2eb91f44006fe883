// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The host engine behind `contrastive::loss`: sizes and owns every buffer, checks and packs the operands, and runs
/// the algorithms (engine_state.hpp: forward and the shared tile work; fused.hpp, materialized.hpp: the backward
/// passes) on a persistent worker pool.
///
/// Work per symmetric forward+backward: fused 8 n_q n_k d flops (the backward recomputes the logits), materialized
/// 6 n_q n_k d. Memory: see `bytes_for`.

#include <contrastive/detail/checked.hpp>
#include <contrastive/host/engine_state.hpp>
#include <contrastive/host/fused.hpp>
#include <contrastive/host/gemm.hpp>
#include <contrastive/host/materialized.hpp>
#include <contrastive/host/operands.hpp>
#include <contrastive/host/thread_pool.hpp>
#include <contrastive/problem.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace contrastive
{
namespace host
{
/// Reusable host state. Not thread-safe; one engine per concurrent caller.
template <class T>
class engine
{
public:
  explicit engine(unsigned threads = 0)
  {
    st_.threads = threads == 0 ? default_threads() : threads;
  }

  unsigned threads() const noexcept
  {
    return st_.threads;
  }

  /// Workers a problem uses: never more than its row count (a loss built with many threads holds scratch only for
  /// the workers that run).
  template <class Problem>
  unsigned workers_for(const Problem& p) const noexcept
  {
    return static_cast<unsigned>(std::min<std::size_t>(st_.threads, std::max<std::size_t>(1, p.n_q)));
  }

  /// Bytes `prepare<Algorithm>(p)` holds, computed without wrapping (flagged when a product overflows size_t).
  /// In floats unless said otherwise, with dp = d rounded up to NR, nq_pad / nk_pad = n_q / n_k rounded up to the
  /// row block / key tile, W workers:
  ///   keys        2 nk_pad dp                        K packed for S = Q K^T and for dQ = G K
  ///   statistics  5 n_q + n_k                        row lse, loss, max, positive; column lse
  ///   scratch     W (2 block_m dp + 3 block_m block_n + max(block_m, block_n) dp [+ 2 nk_pad symmetric])
  ///   fused       (n_q + nk_pad) dp                  dQ, dK accumulators, unless float with d % NR == 0 and
  ///                                                  n_k % MR == 0 (then the caller's dq/dk accumulate in place)
  ///   materialized  nq_pad dp + n_q n_k elements of T   Q packed for dK = dA^T Q, and the logits
  template <class Algorithm, class Problem>
  detail::checked_size bytes_for(const Problem& p) const noexcept
  {
    using detail::checked_size;
    const checked_size dp = detail::round_up(checked_size(p.dim), kernel_nr);
    const checked_size nq_pad = detail::round_up(checked_size(p.n_q), block_m);
    const checked_size nk_pad = detail::round_up(checked_size(p.n_k), block_n);
    const checked_size f = sizeof(float);
    const bool sym = p.obj == objective::symmetric;
    const checked_size keys = checked_size(2) * nk_pad * dp;
    const checked_size stats = checked_size(5) * checked_size(p.n_q) + checked_size(p.n_k);
    checked_size per_worker = checked_size(2 * block_m) * dp + checked_size(3 * block_m * block_n) +
                              checked_size(std::max(block_m, block_n)) * dp;
    if (sym)
    {
      per_worker = per_worker + checked_size(2) * nk_pad;
    }
    checked_size floats = keys + stats + checked_size(workers_for(p)) * per_worker;
    checked_size bytes{};
    if constexpr (std::is_same_v<Algorithm, algorithm::fused>)
    {
      if (!fused_in_place<T>(p.n_k, p.dim))
      {
        floats = floats + (checked_size(p.n_q) + nk_pad) * dp;
      }
      bytes = floats * f;
    }
    else
    {
      floats = floats + nq_pad * dp;
      bytes = floats * f + checked_size(p.n_q) * checked_size(p.n_k) * checked_size(sizeof(T));
    }
    return bytes;
  }

  /// Index (row * dim + col) + 1 of the first non-finite element of q (negative: of k), or 0 when all are finite.
  /// Reads only the caller's arrays: a problem refused here leaves the engine exactly as it was.
  template <class Problem>
  std::ptrdiff_t first_nonfinite(const Problem& p)
  {
    const std::ptrdiff_t bad_q = scan_nonfinite(st_.pool, p.q, p.n_q, p.dim, workers_for(p));
    if (bad_q != 0)
    {
      return bad_q;
    }
    return -scan_nonfinite(st_.pool, p.k, p.n_k, p.dim, workers_for(p));
  }

  /// Sizes every buffer for `p` (the only place the engine allocates; may throw std::bad_alloc or
  /// std::length_error, which `loss` turns into errc::resource_exhausted) and packs K (and, materialized, Q). The
  /// caller's q and k are read again by forward and backward: keep them alive until backward.
  template <class Algorithm, class Problem>
  void prepare(const Problem& p)
  {
    engine_state<T>& s = st_;
    ready_ = false;
    s.q = p.q;
    s.k = p.k;
    s.n_q = p.n_q;
    s.n_k = p.n_k;
    s.d = p.dim;
    s.dp = round_up(s.d, kernel_nr);
    s.nq_pad = round_up(s.n_q, block_m);
    s.nk_pad = round_up(s.n_k, block_n);
    s.obj = p.obj;
    s.labels = p.labels;
    s.workers = workers_for(p);
    constexpr bool materialized = std::is_same_v<Algorithm, algorithm::materialized>;
    const bool sym = s.symmetric();
    s.k_logit.resize(s.nk_pad * s.d);
    s.k_rows.resize(s.nk_pad * s.dp);
    s.row_lse.resize(s.n_q);
    s.row_loss.resize(s.n_q);
    s.row_max.resize(s.n_q);
    s.pos.resize(s.n_q);
    s.col_lse.resize(sym ? s.n_k : 0);
    if constexpr (materialized)
    {
      s.q_rows.resize(s.nq_pad * s.dp);
      s.logits.resize(s.n_q * s.n_k);
      free(s.dq_acc);
      free(s.dk_acc);
    }
    else
    {
      free(s.q_rows);
      std::vector<T>().swap(s.logits);
      const bool in_place = fused_in_place<T>(s.n_k, s.d);
      s.dq_acc.resize(in_place ? 0 : s.n_q * s.dp);
      s.dk_acc.resize(in_place ? 0 : s.nk_pad * s.dp);
    }
    s.scratch.resize(s.workers);
    for (auto& ws : s.scratch)
    {
      ws.qa.resize(block_m * s.d);
      ws.qb.resize(block_m * s.dp);
      ws.tile.resize(block_m * block_n);
      ws.ga.resize(block_m * block_n);
      ws.gt.resize(block_m * block_n);
      ws.acc.resize(std::max(block_m, block_n) * s.dp);
      ws.col_max.resize(sym ? s.nk_pad : 0);
      ws.col_sum.resize(sym ? s.nk_pad : 0);
    }
    // Keys: b_panels over d (logits) and over keys (dQ); materialized also queries over queries (dK).
    parallel_for(s.pool,
                 s.nk_pad / kernel_nr,
                 s.workers,
                 [&](std::size_t c, unsigned)
                 {
                   const std::size_t r0 = c * kernel_nr;
                   const std::size_t rows = r0 < s.n_k ? std::min<std::size_t>(kernel_nr, s.n_k - r0) : 0;
                   pack_rows_over_dim(s.k, s.d, r0, rows, kernel_nr, s.k_logit.data() + r0 * s.d);
                   pack_rows_over_rows(s.k, s.d, s.dp, r0, rows, kernel_nr, s.nk_pad, s.k_rows.data() + r0 * kernel_nr);
                 });
    if constexpr (materialized)
    {
      parallel_for(s.pool,
                   s.nq_pad / kernel_nr,
                   s.workers,
                   [&](std::size_t c, unsigned)
                   {
                     const std::size_t r0 = c * kernel_nr;
                     const std::size_t rows = r0 < s.n_q ? std::min<std::size_t>(kernel_nr, s.n_q - r0) : 0;
                     pack_rows_over_rows(
                         s.q, s.d, s.dp, r0, rows, kernel_nr, s.nq_pad, s.q_rows.data() + r0 * kernel_nr);
                   });
    }
    ready_ = true;
  }

  /// True after a `prepare` that completed (a failed one leaves the engine unprepared).
  bool prepared() const noexcept
  {
    return ready_;
  }

  /// Forward with logits S = scale * Q K^T. Saves the row (and, symmetric, column) log-sum-exps for `backward`.
  template <class Algorithm>
  forward_result forward(float scale)
  {
    return st_.template forward<Algorithm>(scale);
  }

  /// Backward of `loss_scale * loss` after `forward`. Writes dq (n_q x dim) and dk (n_k x dim) in T.
  template <class Algorithm>
  backward_result backward(float loss_scale, T* dq, T* dk)
  {
    if constexpr (std::is_same_v<Algorithm, algorithm::materialized>)
    {
      return materialized_backward(st_, loss_scale, dq, dk);
    }
    else
    {
      return fused_backward(st_, loss_scale, dq, dk);
    }
  }

  const std::vector<float>& row_lse() const noexcept
  {
    return st_.row_lse;
  }
  const std::vector<float>& col_lse() const noexcept
  {
    return st_.col_lse;
  }

  /// Bytes held by every buffer of the engine (packed keys and queries, statistics, accumulators, per-worker
  /// scratch, the materialized matrix). `bytes_for` gives the same number before allocating.
  std::size_t bytes_held() const noexcept
  {
    const engine_state<T>& s = st_;
    std::size_t b = (s.k_logit.capacity() + s.k_rows.capacity() + s.q_rows.capacity() + s.row_lse.capacity() +
                     s.row_loss.capacity() + s.row_max.capacity() + s.pos.capacity() + s.col_lse.capacity() +
                     s.dq_acc.capacity() + s.dk_acc.capacity()) *
                        sizeof(float) +
                    s.logits.capacity() * sizeof(T);
    for (const auto& ws : s.scratch)
    {
      b += ws.capacity_bytes();
    }
    return b;
  }

  /// Frees every buffer (after a failed `prepare`, so that a half-sized engine holds no memory).
  void release() noexcept
  {
    engine_state<T>& s = st_;
    for (auto* v : {&s.k_logit,
                    &s.k_rows,
                    &s.q_rows,
                    &s.row_lse,
                    &s.row_loss,
                    &s.row_max,
                    &s.pos,
                    &s.col_lse,
                    &s.dq_acc,
                    &s.dk_acc})
    {
      free(*v);
    }
    std::vector<T>().swap(s.logits);
    std::vector<worker_scratch>().swap(s.scratch);
    ready_ = false;
  }

private:
  static void free(std::vector<float>& v) noexcept
  {
    std::vector<float>().swap(v);
  }

  engine_state<T> st_;
  bool ready_ = false;
};
} // namespace host
} // namespace contrastive
