// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The host engine behind `contrastive::loss`: sizes and owns every buffer, checks and packs the operands, and runs
/// the algorithms (engine_state.hpp: forward and the shared tile work; fused.hpp, materialized.hpp: the backward
/// passes) on a persistent worker pool.
///
/// Work per symmetric forward+backward: fused 8 n_q n_k d flops (the backward recomputes the logits), materialized
/// 6 n_q n_k d, chunked 6 (one chunk) or 8. Memory: see `bytes_for`.

#include <contrastive/detail/checked.hpp>
#include <contrastive/host/algorithms.hpp>
#include <contrastive/host/builtin_gemm.hpp>
#include <contrastive/host/chunked.hpp>
#include <contrastive/host/engine_state.hpp>
#include <contrastive/host/fused.hpp>
#include <contrastive/host/gemm.hpp>
#include <contrastive/host/materialized.hpp>
#include <contrastive/host/operands.hpp>
#include <contrastive/host/thread_pool.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace contrastive
{
namespace host
{
/// Reusable host state. Not thread-safe; one engine per concurrent caller. Gemm: gemm::builtin or gemm::cblas.
template <class T, class Gemm = gemm::builtin>
class engine
{
  static_assert(gemm_backend_available<Gemm>::value,
                "gemm::cblas needs #include <contrastive/host/cblas_gemm.hpp> and a CBLAS library "
                "(CMake: link contrastive::cblas)");
  using backend = gemm_backend<Gemm, T>;

public:
  explicit engine(unsigned threads = 0)
  {
    st_.threads = threads == 0 ? default_threads() : threads;
  }

  unsigned threads() const noexcept
  {
    return st_.threads;
  }

  /// The largest embedding dimension the GEMM backend can represent (gemm::cblas: its int arguments).
  static constexpr std::size_t max_dim = backend::max_dim;
  /// size_overflow "dim" for a dim above max_dim (the single- and multi-process losses check it before any read).
  static status check_dim(std::size_t dim)
  {
    if (dim <= max_dim)
    {
      return {};
    }
    return {errc::size_overflow,
            "dim",
            "dim = " + std::to_string(dim) + " exceeds the largest the " + Gemm::name + " GEMM backend can pass, " +
                std::to_string(max_dim)};
  }

  /// Chunk size of algorithm::chunked (used from the next `prepare`).
  void set_chunk(const chunk_options& o) noexcept
  {
    st_.chunk_request = o;
  }
  const chunk_options& chunk() const noexcept
  {
    return st_.chunk_request;
  }
  /// Rows per chunk algorithm::chunked uses for `p`.
  template <class Problem>
  std::size_t chunk_rows_for(const Problem& p) const noexcept
  {
    return detail::chunk_rows_for(
        st_.chunk_request, p.n_q, chunk_row_bytes(round_up(p.n_k, block_n)), block_m, default_host_chunk_budget);
  }

  /// Workers a problem uses: never more than its row count (a loss built with many threads holds scratch only for
  /// the workers that run), nor than the GEMM backend lets call it at once (gemm::cblas: the cores).
  template <class Problem>
  unsigned workers_for(const Problem& p) const noexcept
  {
    const std::size_t w = std::min<std::size_t>(st_.threads, std::max<std::size_t>(1, p.n_q));
    return static_cast<unsigned>(std::min<std::size_t>(w, backend::max_workers()));
  }

  /// algorithm::automatic: the budget its choice compares materialized's bytes with; 0 (the default): a quarter of
  /// the memory available at each call (default_memory_budget).
  void set_memory_budget(std::size_t bytes) noexcept
  {
    memory_budget_ = bytes;
  }
  /// The budget algorithm::automatic uses now: the one set, else a quarter of the available memory.
  std::size_t memory_budget() const noexcept
  {
    return memory_budget_ != 0 ? memory_budget_ : default_memory_budget(bytes_held());
  }
  /// algorithm::automatic's accuracy rule: whether materialized's logits are as accurate as fused's at logit scale
  /// `s`: float's always (they are float); 16-bit's never, at any s (rounded to the element type, they are all of a
  /// learned batch's gradient, tags.hpp's algorithm::automatic; float16's also overflow).
  static constexpr bool materialized_accurate_at(float s) noexcept
  {
    (void)s;
    return std::is_same_v<T, float>;
  }
  /// algorithm::automatic's memory rule: whether materialized's buffers for `p` fit memory_budget().
  template <class Problem>
  bool materialized_fits(const Problem& p, bool outputs_known = false) const noexcept
  {
    const detail::checked_size b = bytes_for<algorithm::materialized>(p, outputs_known);
    return b.ok() && b.value <= memory_budget();
  }
  /// algorithm::automatic's work rule: whether materialized does less work than fused for `p`'s objective. The softmax
  /// objectives' fused backward forms the logits a second time (8 n_q n_k d flops to materialized's 6); the sigmoid
  /// objective's fused step takes one pass over them (6 to 6) and stores none, so it is as fast or faster (measured
  /// 0.86-0.94x materialized's time, docs/algorithms.md) at a fraction of the memory: automatic runs it fused.
  template <class Problem>
  static bool materialized_saves_work(const Problem& p) noexcept
  {
    return objectives::traits_of(p).softmax;
  }
  /// algorithm::automatic's choice for `p` at logit scale `s`: materialized where every rule allows it
  /// (materialized_saves_work(p), materialized_accurate_at(s) and materialized_fits(p)), else fused.
  template <class Problem>
  bool materializes(const Problem& p, bool outputs_known, float s) const noexcept
  {
    return materialized_saves_work(p) && materialized_accurate_at(s) && materialized_fits(p, outputs_known);
  }
  /// The algorithm the last `prepare` ran: Algorithm's, or automatic's choice ("none" before one, or after one that
  /// failed).
  const char* algorithm_used() const noexcept
  {
    return used_;
  }
  /// algorithm::automatic: decides for `p` at logit scale `s` now (materializes) and keeps the decision for the next
  /// `prepare<automatic>`, so that a caller's `bytes_for` of the chosen algorithm and the prepare agree; returns it.
  template <class Problem>
  bool decide(const Problem& p, bool outputs_known, float s) noexcept
  {
    const bool m = materializes(p, outputs_known, s);
    decided_ = m ? 1 : 0;
    return m;
  }

  /// Bytes `prepare<Algorithm>(p)` holds, computed without wrapping (flagged when a product overflows size_t).
  /// In floats unless said otherwise, with dp = d rounded up to NR, nq_pad / nk_pad = n_q / n_k rounded up to the
  /// row block / key tile, W workers:
  ///   keys        builtin: nk_pad d (K packed for S = Q K^T; 16-bit on the bf16 dot kernel) except fused (no
  ///               copy: its tiles are packed into scratch); cblas: n_k d for 16-bit, 0 for float
  ///   statistics  5 n_q [+ 4 n_k symmetric]          row lse, loss, max, positive, log_sum; column lse, loss,
  ///                                                  shift, log_sum
  ///   grouped     softmax objectives with group ids (p.grouped()): 4 n_q [+ n_k symmetric], the rows' positives
  ///               and the columns' pos_log, [+ 4 nk_pad per worker symmetric, not chunked; + 4 n_k symmetric
  ///               chunked], the columns' positives
  ///   scratch     W (query block, G, G^T and key tiles [builtin block_m d + block_m dp + 2 block_m block_n,
  ///               fused + block_n dp + key_run d, halved for bfloat16 on the bf16 dot kernel (16-bit panels, d
  ///               rounded up to even), + MR dp; cblas 16-bit block_m d]
  ///               + block_m block_n [+ max(block_m, block_n) dp materialized] [+ 2 nk_pad symmetric])
  ///   fused       (n_q + nk_pad) dp                  dQ, dK accumulators, unless float dq/dk can accumulate in place
  ///                                                  (builtin: d % NR == 0; cblas: always; never for the sigmoid
  ///                                                  objective, whose forward accumulates them)
  ///   materialized  K and Q packed for dQ, dK (builtin (nk_pad + nq_pad) dp; cblas n_q d for 16-bit)
  ///                 + n_q n_k elements of T (the logits)
  ///   chunked     as materialized without the n_q n_k logits and the per-worker column statistics, plus the chunk
  ///               B nk_pad, the dK accumulator nk_pad dp [+ 2 n_k running column statistics]
  /// `outputs_known`: the forward_backward case of `prepare` (its dq and dk given), where the sigmoid objective's
  /// fused accumulators can be the caller's float outputs. algorithm::automatic: the most a call on `p` can hold
  /// (materialized's where the element type runs it, float, and they fit the budget, else fused's); the bytes of one
  /// call's choice are those of the algorithm `decide` returns.
  template <class Algorithm, class Problem>
  detail::checked_size bytes_for(const Problem& p, bool outputs_known = false) const noexcept
  {
    if constexpr (std::is_same_v<Algorithm, algorithm::automatic>)
    {
      // The most a call on p can hold: materialized's bytes where the accuracy rule allows it and they fit.
      return materializes(p, outputs_known, 0.0f) ? bytes_for<algorithm::materialized>(p, outputs_known)
                                                  : bytes_for<algorithm::fused>(p, outputs_known);
    }
    else
    {
      return bytes_for_algorithm<Algorithm>(p, outputs_known);
    }
  }

  /// bytes_for of a concrete algorithm (fused, materialized, chunked).
  template <class Algorithm, class Problem>
  detail::checked_size bytes_for_algorithm(const Problem& p, bool outputs_known) const noexcept
  {
    return objectives::visit(p,
                             [&](auto o)
                             {
                               return bytes_for_objective<Algorithm, decltype(o)>(p, outputs_known);
                             });
  }
  /// bytes_for of a concrete algorithm and objective.
  template <class Algorithm, class O, class Problem>
  detail::checked_size bytes_for_objective(const Problem& p, bool outputs_known) const noexcept
  {
    using detail::checked_size;
    constexpr bool chunked = algorithm_traits<Algorithm>::chunks;
    constexpr bool materialized = algorithm_traits<Algorithm>::whole_products;
    gemm_shape sh;
    if (!shape_of(p, sh))
    {
      return {0, true};
    }
    const checked_size dp = detail::round_up(checked_size(p.dim), kernel_nr);
    const checked_size nk_pad = detail::round_up(checked_size(p.n_k), block_n);
    const checked_size f = sizeof(float);
    constexpr bool sym = O::columns;
    const bool grouped = O::softmax && p.grouped();
    const checked_size positives = checked_size(positive_floats);
    checked_size stats = checked_size(5) * checked_size(p.n_q) + checked_size(sym ? 4 : 0) * p.n_k;
    if (grouped)
    {
      stats = stats + positives * p.n_q + checked_size(sym ? 1 : 0) * p.n_k;
    }
    checked_size per_worker = backend::worker_floats(sh, materialized) + checked_size(block_m * block_n);
    if (materialized)
    {
      per_worker = per_worker + checked_size(std::max(block_m, block_n)) * dp; // the dQ / dK block accumulator
    }
    if (sym && !chunked)
    {
      per_worker = per_worker + checked_size(2) * nk_pad + (grouped ? positives * nk_pad : checked_size(0));
    }
    checked_size floats = backend::held_floats(sh, materialized) + stats + checked_size(workers_for(p)) * per_worker;
    if constexpr (chunked)
    {
      floats = floats + checked_size(chunk_rows_for(p)) * nk_pad + nk_pad * dp + checked_size(sym ? 2 : 0) * p.n_k;
      if (grouped && sym)
      {
        floats = floats + positives * p.n_k;
      }
      return floats * f;
    }
    else if constexpr (!materialized)
    {
      // The pairwise objective's one fused pass accumulates during the forward: in place only where the outputs are
      // known then.
      const bool forward_accumulates = !O::softmax;
      if (!backend::in_place_ok(p.n_k, p.dim) || (forward_accumulates && !outputs_known))
      {
        floats = floats + (checked_size(p.n_q) + nk_pad) * dp;
      }
      return floats * f;
    }
    else
    {
      return floats * f + checked_size(p.n_q) * checked_size(p.n_k) * checked_size(sizeof(T));
    }
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
  /// caller's q and k are read again by forward and backward: keep them alive until backward. `dq`, `dk`: the
  /// outputs the following backward writes, when known now (forward_backward): the sigmoid objective's fused pass
  /// then accumulates in them where the element type is float and the GEMM allows it (as the softmax backward does).
  template <class Algorithm, class Problem>
  void prepare(const Problem& p, T* dq = nullptr, T* dk = nullptr)
  {
    if constexpr (std::is_same_v<Algorithm, algorithm::automatic>)
    {
      // Without a `decide` the logit scale is unknown (the rule does not weigh it: 16-bit elements run fused).
      const bool m = decided_ >= 0
                         ? decided_ == 1
                         : materializes(p, dq != nullptr && dk != nullptr, std::numeric_limits<float>::infinity());
      decided_ = -1;
      if (m)
      {
        prepare<algorithm::materialized>(p, dq, dk);
      }
      else
      {
        prepare<algorithm::fused>(p, dq, dk);
      }
      return;
    }
    else
    {
      used_ = "none"; // until this prepare has succeeded (it may throw std::bad_alloc)
      prepare_algorithm<Algorithm>(p, dq, dk);
      used_ = Algorithm::name;
      materialized_ = std::is_same_v<Algorithm, algorithm::materialized>;
    }
  }

  /// prepare of a concrete algorithm (fused, materialized, chunked).
  template <class Algorithm, class Problem>
  void prepare_algorithm(const Problem& p, T* dq, T* dk)
  {
    objectives::visit(p,
                      [&](auto o)
                      {
                        prepare_objective<Algorithm, decltype(o)>(p, dq, dk);
                      });
  }
  /// prepare of a concrete algorithm and objective.
  template <class Algorithm, class O, class Problem>
  void prepare_objective(const Problem& p, T* dq, T* dk)
  {
    engine_state<T, Gemm>& s = st_;
    s.q = p.q;
    s.k = p.k;
    s.n_q = p.n_q;
    s.n_k = p.n_k;
    s.d = p.dim;
    s.dp = round_up(s.d, kernel_nr);
    s.nq_pad = round_up(s.n_q, block_m);
    s.nk_pad = round_up(s.n_k, block_n);
    s.labels = p.labels;
    s.groups = group_view{}; // a grouped step's driver gives the view after prepare (set_groups)
    s.workers = workers_for(p);
    s.out_dq = s.out_dk = nullptr;
    constexpr bool chunked = algorithm_traits<Algorithm>::chunks;
    constexpr bool materialized = algorithm_traits<Algorithm>::whole_products;
    constexpr bool sym = O::columns;
    s.row_lse.resize(s.n_q);
    s.row_loss.resize(s.n_q);
    s.row_max.resize(s.n_q);
    s.pos.resize(s.n_q);
    s.row_log_sum.resize(s.n_q);
    s.col_lse.resize(sym ? s.n_k : 0);
    s.col_loss.resize(sym ? s.n_k : 0);
    s.col_shift.resize(sym ? s.n_k : 0);
    s.col_log_sum.resize(sym ? s.n_k : 0);
    const bool grouped = O::softmax && p.grouped();
    s.row_pos.resize(grouped ? s.n_q : 0);
    s.col_pos_log.resize(grouped && sym ? s.n_k : 0);
    s.chunk_cached = false;
    if constexpr (chunked)
    {
      std::vector<T>().swap(s.logits);
      free(s.dq_acc);
      s.dk_acc.resize(s.nk_pad * s.dp);
      s.chunk_rows = chunk_rows_for(p);
      s.chunk.resize(s.chunk_rows * s.nk_pad);
      s.col_run_max.resize(sym ? s.n_k : 0);
      s.col_run_sum.resize(sym ? s.n_k : 0);
      if (grouped && sym)
      {
        s.col_run_pos.resize(s.n_k);
      }
      else
      {
        free(s.col_run_pos);
      }
    }
    else if constexpr (materialized)
    {
      s.logits.resize(s.n_q * s.n_k);
      free(s.dq_acc);
      free(s.dk_acc);
    }
    else
    {
      std::vector<T>().swap(s.logits);
      // The sigmoid objective's one pass accumulates the gradients during the forward: in place only where the
      // outputs are known then.
      const bool sigmoid_out = !O::softmax && dq != nullptr && dk != nullptr && backend::in_place_ok(s.n_k, s.d);
      const bool in_place = backend::in_place_ok(s.n_k, s.d) && (O::softmax || sigmoid_out);
      if constexpr (std::is_same_v<T, float>)
      {
        s.out_dq = sigmoid_out ? dq : nullptr;
        s.out_dk = sigmoid_out ? dk : nullptr;
      }
      // In place: released, not only emptied (the sigmoid objective alternates between the two for one shape:
      // forward() needs the accumulators, step() does not).
      if (in_place)
      {
        free(s.dq_acc);
        free(s.dk_acc);
      }
      else
      {
        s.dq_acc.resize(s.n_q * s.dp);
        s.dk_acc.resize(s.nk_pad * s.dp);
      }
    }
    gemm_shape sh;
    shape_of(p, sh);
    s.scratch.resize(s.workers);
    for (auto& ws : s.scratch)
    {
      backend::size_worker(sh, ws, materialized);
      ws.tile.resize(block_m * block_n);
      if (materialized)
      {
        ws.acc.resize(std::max(block_m, block_n) * s.dp);
      }
      else
      {
        free(ws.acc); // released, not only emptied (algorithm::automatic may have run materialized before)
      }
      ws.col_max.resize(sym && !chunked ? s.nk_pad : 0);
      ws.col_sum.resize(sym && !chunked ? s.nk_pad : 0);
      if (grouped && sym && !chunked)
      {
        ws.col_pos.resize(s.nk_pad);
      }
      else
      {
        free(ws.col_pos); // released: a grouped step may have sized it
      }
    }
    if constexpr (!chunked)
    {
      free(s.chunk);
      free(s.col_run_max);
      free(s.col_run_sum);
      free(s.col_run_pos);
    }
    if (!grouped)
    {
      free(s.row_pos);
    }
    if (!grouped || !sym)
    {
      free(s.col_pos_log);
    }
    s.mm.prepare(s.pool, s.workers, sh, s.q, s.k, materialized);
  }

  // The phases of a step (the step driver, step/driver.hpp, runs them; between them it combines across ranks):
  //   forward_rows  S = s Q K^T row block by row block: every row's statistics finished, and (symmetric) each
  //                 column's negatives over these rows left as a partial (`column_partial`);
  //   set_column    column j's finished statistics (its negatives over *every* row of the batch and its positive);
  //   backward      G and the gradients with the batch's coefficients.
  // One process finishes the columns from its own partials; a rank of a distributed step combines every rank's first.

  /// Forward rows of objective O (the one `prepare` was given) with logits S = scale * Q K^T (an objective with a
  /// bias: z = S + bias; the others ignore `bias`); saves the row statistics for `backward`.
  template <class Algorithm, class O>
  row_pass forward_rows(float scale, float bias = 0.0f)
  {
    static_assert(objectives::is_objective_v<O>, "O must be an objective type (objectives/objectives.hpp)");
    if constexpr (std::is_same_v<Algorithm, algorithm::automatic>)
    {
      return materialized_ ? forward_rows<algorithm::materialized, O>(scale, bias)
                           : forward_rows<algorithm::fused, O>(scale, bias);
    }
    else
    {
      st_.bias = O::has_bias ? bias : 0.0f;
      return algorithm_impl<Algorithm>::template forward_rows<O>(st_, scale);
    }
  }

  /// Symmetric objective, after `forward_rows`: column j's negatives over this engine's rows.
  template <class Algorithm>
  online_lse column_partial(std::size_t j) const noexcept
  {
    return ran<Algorithm>(
        [&](auto a)
        {
          return st_.template column_partial<decltype(a)>(j);
        });
  }
  /// Grouped symmetric, after `forward_rows`: column j's positives over this engine's rows.
  template <class Algorithm>
  positive_stats column_positives(std::size_t j) const noexcept
  {
    return ran<Algorithm>(
        [&](auto a)
        {
          return st_.template column_positives<decltype(a)>(j);
        });
  }
  /// Row i's positive logit (after `forward_rows`): column i's positive, for the symmetric objective.
  float positive(std::size_t i) const noexcept
  {
    return st_.pos[i];
  }
  /// A grouped step (numeric/groups.hpp), after `prepare` and before `forward_rows`: its rows' and keys' ids and
  /// weights, kept (not copied) until the backward. An empty view: one positive per row (labels or the diagonal).
  void set_groups(const group_view& g) noexcept
  {
    st_.groups = g;
  }
  /// Column j's finished statistics, before `backward`.
  void set_column(std::size_t j, const contrastive::row_loss& rl) noexcept
  {
    st_.set_column(j, rl);
  }
  /// Grouped symmetric: column j's finished statistics (numeric/groups.hpp's finish_grouped), before `backward`.
  void set_column(std::size_t j, const grouped_stats& g) noexcept
  {
    st_.set_column(j, g);
  }

  /// Backward of `loss_scale * loss` after `forward_rows` and (symmetric) every `set_column`, with the batch's
  /// gradient coefficients `gc` (O::coefficients of the whole batch's sizes). Writes dq (n_q x dim) and dk
  /// (n_k x dim) in T, or in float (Out = float: unrounded partial gradients, for callers that add several before
  /// rounding once, as a rank of the distributed step does).
  template <class Algorithm, class O, class Out>
  backward_result backward(float loss_scale, const grad_coefficients& gc, Out* dq, Out* dk)
  {
    static_assert(std::is_same_v<Out, T> || std::is_same_v<Out, float>, "gradients are written in T or in float");
    if constexpr (std::is_same_v<Algorithm, algorithm::automatic>)
    {
      return materialized_ ? algorithm_impl<algorithm::materialized>::template backward<O>(st_, loss_scale, gc, dq, dk)
                           : algorithm_impl<algorithm::fused>::template backward<O>(st_, loss_scale, gc, dq, dk);
    }
    else
    {
      return algorithm_impl<Algorithm>::template backward<O>(st_, loss_scale, gc, dq, dk);
    }
  }

  /// The finished row (and column) log-sum-exps of the last forward.
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
    const engine_state<T, Gemm>& s = st_;
    std::size_t b = (s.row_lse.capacity() + s.row_loss.capacity() + s.row_max.capacity() + s.pos.capacity() +
                     s.row_log_sum.capacity() + s.col_lse.capacity() + s.col_loss.capacity() + s.col_shift.capacity() +
                     s.col_log_sum.capacity() + s.dq_acc.capacity() + s.dk_acc.capacity() + s.chunk.capacity() +
                     s.col_run_max.capacity() + s.col_run_sum.capacity() + s.col_pos_log.capacity()) *
                        sizeof(float) +
                    (s.row_pos.capacity() + s.col_run_pos.capacity()) * sizeof(positive_stats) +
                    s.logits.capacity() * sizeof(T) + s.mm.bytes();
    for (const auto& ws : s.scratch)
    {
      b += ws.capacity_bytes();
    }
    return b;
  }

  /// Frees every buffer (after a failed `prepare`, so that a half-sized engine holds no memory).
  void release() noexcept
  {
    engine_state<T, Gemm>& s = st_;
    for (auto* v : {&s.row_lse,
                    &s.row_loss,
                    &s.row_max,
                    &s.pos,
                    &s.row_log_sum,
                    &s.col_lse,
                    &s.col_loss,
                    &s.col_shift,
                    &s.col_log_sum,
                    &s.dq_acc,
                    &s.dk_acc,
                    &s.chunk,
                    &s.col_run_max,
                    &s.col_run_sum,
                    &s.col_pos_log})
    {
      free(*v);
    }
    free(s.row_pos);
    free(s.col_run_pos);
    s.mm.release();
    std::vector<T>().swap(s.logits);
    std::vector<worker_scratch>().swap(s.scratch);
  }

private:
  /// f(A{}) for the concrete algorithm A the last prepare ran: Algorithm, or for automatic the one it chose.
  template <class Algorithm, class F>
  decltype(auto) ran(F&& f) const noexcept
  {
    if constexpr (std::is_same_v<Algorithm, algorithm::automatic>)
    {
      return materialized_ ? f(algorithm::materialized{}) : f(algorithm::fused{});
    }
    else
    {
      return f(Algorithm{});
    }
  }

  /// The padded shape of p; false when a padded size does not fit size_t.
  template <class Problem>
  static bool shape_of(const Problem& p, gemm_shape& sh) noexcept
  {
    if (p.dim > backend::max_dim)
    {
      return false; // not representable by the GEMM backend (loss::validate names it first)
    }
    const detail::checked_size dp = detail::round_up(detail::checked_size(p.dim), kernel_nr);
    const detail::checked_size nq_pad = detail::round_up(detail::checked_size(p.n_q), block_m);
    const detail::checked_size nk_pad = detail::round_up(detail::checked_size(p.n_k), block_n);
    sh.n_q = p.n_q;
    sh.n_k = p.n_k;
    sh.d = p.dim;
    sh.dp = dp.value;
    sh.nq_pad = nq_pad.value;
    sh.nk_pad = nk_pad.value;
    return dp.ok() && nq_pad.ok() && nk_pad.ok();
  }

  template <class V>
  static void free(std::vector<V>& v) noexcept
  {
    std::vector<V>().swap(v);
  }

  engine_state<T, Gemm> st_;
  std::size_t memory_budget_ = 0; // algorithm::automatic's budget; 0: default_memory_budget() at each call
  bool materialized_ = false;     // algorithm::automatic: the last prepare chose materialized
  const char* used_ = "none";     // the algorithm the last prepare ran
  int decided_ = -1;              // algorithm::automatic: `decide`'s choice for the next prepare (1 materialized)
};
} // namespace host
} // namespace contrastive
