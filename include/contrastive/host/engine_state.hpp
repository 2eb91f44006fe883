// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The host engine's state and the work both algorithms share: the logits tile S = s Q_blk K_tile^T of a row block
/// against a key tile, the forward pass over it (row and column log-sum-exps with the positive kept apart), and the
/// gradient tile G. fused.hpp and materialized.hpp build their backward passes from these.

#include <contrastive/host/algorithm_traits.hpp>
#include <contrastive/host/builtin_gemm.hpp>
#include <contrastive/host/gemm.hpp>
#include <contrastive/host/operands.hpp>
#include <contrastive/host/pass_results.hpp>
#include <contrastive/host/thread_pool.hpp>
#include <contrastive/host/tile_math.hpp>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/groups.hpp>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/numeric/online_lse.hpp>
#include <contrastive/numeric/sigmoid_math.hpp>
#include <contrastive/objectives/objectives.hpp>
#include <contrastive/problem.hpp>

#include <algorithm>
#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace contrastive
{
namespace host
{
/// Everything the algorithms read and write. The caller's q and k are read in place (packed per row block or once
/// per call); keep them alive from `forward` to `backward`. The passes that depend on the objective take it as a
/// template argument O (objectives/objectives.hpp); the engine keeps no objective of its own.
template <class T, class Gemm>
struct engine_state
{
  using traits = element_traits<T>;

  thread_pool pool;
  unsigned threads = 1; ///< configured
  unsigned workers = 1; ///< used for the current problem (<= threads, <= its rows)

  const T* q = nullptr;
  const T* k = nullptr;
  std::size_t n_q = 0, n_k = 0, d = 0, dp = 0, nq_pad = 0, nk_pad = 0;
  const std::int32_t* labels = nullptr;
  /// Several positives per row (numeric/groups.hpp). Softmax objectives find each row's positives in a tile from the
  /// keys sorted by id (group_view::positives_in) and keep them apart from the negatives' statistics, in row_pos (and,
  /// symmetric, the workers' col_pos or col_run_pos); pos[i] then holds row i's pos_log (grouped_stats). The sigmoid
  /// objective's tiles test each pair's ids.
  group_view groups;
  float scale = 1.0f;
  float bias = 0.0f;          ///< sigmoid: the logit bias b of z = S + b (0 otherwise)
  double sigmoid_g_sum = 0.0; ///< sigmoid, fused: sum of the unnormalised G the forward formed (d loss / d b)
  /// sigmoid, fused: the caller's float dq / dk of the backward that follows, where the forward accumulates G K and
  /// G^T Q in place (row stride d; engine::prepare with known outputs); null: st.dq_acc / st.dk_acc
  float* out_dq = nullptr;
  float* out_dk = nullptr;

  gemm_backend<Gemm, T> mm; // the prepared keys (and queries) and the products
  std::vector<float> row_lse, row_loss, row_max, pos, col_lse, col_loss;
  // Each log-sum-exp as shift + log_sum (row_loss::shift, log_sum), which the backward's softmax reads. A row's shift
  // is its largest logit, max(row_max, pos), so only the columns store theirs.
  std::vector<float> row_log_sum, col_shift, col_log_sum;
  // Grouped softmax: each row's positives (the forward's running state), and each column's finished pos_log.
  std::vector<positive_stats> row_pos;
  std::vector<float> col_pos_log;
  std::vector<T> logits;             // materialized: n_q x n_k
  std::vector<float> dq_acc, dk_acc; // fused: float accumulators unless dq/dk serve in place; chunked: dk_acc
  std::vector<worker_scratch> scratch;

  // chunked: the logits / gradients of one chunk of rows (chunk_rows x nk_pad), the running column statistics, and
  // whether the chunk still holds the forward's logits (one chunk covers every row).
  chunk_options chunk_request;
  std::size_t chunk_rows = 0;
  std::vector<float> chunk, col_run_max, col_run_sum;
  std::vector<positive_stats> col_run_pos; // grouped symmetric: the columns' running positives
  bool chunk_cached = false;

  std::size_t positive_of(std::size_t i) const noexcept
  {
    return labels != nullptr ? static_cast<std::size_t>(labels[i]) : i;
  }
  bool grouped() const noexcept
  {
    return groups.q_ids != nullptr;
  }
  /// Called by every forward before its tiles: a grouped step's rows start without positives.
  void begin_forward() noexcept
  {
    std::fill(row_pos.begin(), row_pos.end(), positive_stats{});
    if (grouped()) // the sigmoid objective sets no pos[i]: none left from an earlier step
    {
      std::fill(pos.begin(), pos.end(), 0.0f);
    }
  }
  /// Grouped softmax forward: moves each positive of a tile's rows (rows x cols at (i0, j0), row stride block_n, at
  /// x) out of the logits into its row's positives and, `columns`, into `col_pos` (indexed by key), leaving -inf in
  /// its slot: the negatives' statistics then run as with one positive per row.
  void take_positives(
      std::size_t i0, std::size_t j0, std::size_t rows, std::size_t cols, float* x, positive_stats* col_pos) noexcept
  {
    for (std::size_t ii = 0; ii < rows; ++ii)
    {
      const std::size_t *at, *end;
      groups.positives_in(i0 + ii, j0, j0 + cols, at, end);
      float* row = x + ii * block_n;
      positive_stats& mine = row_pos[i0 + ii];
      for (; at != end; ++at)
      {
        float& v = row[*at - j0];
        mine.absorb(v);
        if (col_pos != nullptr)
        {
          col_pos[*at].absorb(v);
        }
        v = -detail::infinity_f;
      }
    }
  }
  /// Grouped softmax: row i's finished statistics from its negatives' state and its positives (row_pos[i]); pos[i]
  /// takes its pos_log.
  void set_grouped_row(std::size_t i, const online_lse& negatives) noexcept
  {
    const grouped_stats g = finish_grouped(negatives, row_pos[i]);
    row_lse[i] = g.lse;
    row_loss[i] = g.loss;
    row_log_sum[i] = g.log_sum;
    row_max[i] = g.shift;
    pos[i] = g.pos_log;
  }

  /// Runs f(i0, rows, ws, w) for every row block [i0, i0 + rows), one block per task, on worker w with its scratch ws
  /// (each task owns its rows: row statistics, dQ rows).
  template <class F>
  void for_row_blocks(F&& f)
  {
    for_blocks(nq_pad, block_m, n_q, f);
  }
  /// Runs f(j0, cols, ws, w) for every key tile [j0, j0 + cols), one tile per task (each task owns its keys: column
  /// statistics, dK rows).
  template <class F>
  void for_key_tiles(F&& f)
  {
    for_blocks(nk_pad, block_n, n_k, f);
  }
  template <class F>
  void for_blocks(std::size_t padded, std::size_t block, std::size_t n, F& f)
  {
    parallel_for(pool,
                 padded / block,
                 workers,
                 [&](std::size_t t, unsigned w)
                 {
                   const std::size_t x0 = t * block;
                   if (x0 < n)
                   {
                     f(x0, std::min(block, n - x0), scratch[w], w);
                   }
                 });
  }

  /// Prepares rows [i0, i0 + block_m) of Q for the logits (and, `for_dk`, the dK) products.
  void query_block(std::size_t i0, worker_scratch& ws, bool for_dk) const
  {
    ws.block_i0 = i0;
    ws.block_rows = std::min(block_m, n_q - i0);
    mm.query_block(i0, ws.block_rows, ws, for_dk);
  }

  /// The scaled logits of block (i0, j0) in ws.tile, computed as the forward computed them (fused: s * (q . k) in
  /// float; materialized: the chain from the stored element-type products), the sigmoid objective's bias added
  /// (z = S + b; materialized: rounded to T, as autocast adds it). Returns whether any is non-finite.
  template <class Algorithm, class O>
  CONTRASTIVE_NOINLINE bool
  scaled_tile(std::size_t i0, std::size_t j0, std::size_t rows, std::size_t cols, worker_scratch& ws) const
  {
    constexpr bool Biased = O::has_bias;
    float poison = 0.0f;
    const float s = scale, b = bias;
    if constexpr (algorithm_traits<Algorithm>::stores_logits)
    {
      // materialized_chain<T>::logit, then z = round_T(S + b), a row at a time (host/element_rows.hpp: vectorised
      // conversions).
      for (std::size_t ii = 0; ii < rows; ++ii)
      {
        float* out = &ws.tile[ii * block_n];
        to_float_row(&logits[(i0 + ii) * n_k + j0], cols, out);
        for (std::size_t jj = 0; jj < cols; ++jj)
        {
          out[jj] *= s;
        }
        round_row<T>(out, cols);
        if constexpr (Biased)
        {
          for (std::size_t jj = 0; jj < cols; ++jj)
          {
            out[jj] += b;
          }
          round_row<T>(out, cols);
        }
        poison += lane_sum(cols,
                           [&](std::size_t jj)
                           {
                             return out[jj] * 0.0f;
                           });
      }
    }
    else
    {
      mm.dot_tile(j0, rows, cols, ws);
      for (std::size_t ii = 0; ii < rows; ++ii)
      {
        float* row = &ws.tile[ii * block_n];
        poison += lane_sum(cols,
                           [&](std::size_t jj)
                           {
                             float x = s * row[jj];
                             if constexpr (Biased)
                             {
                               x += b;
                             }
                             row[jj] = x;
                             return x * 0.0f;
                           });
      }
    }
    return poison != 0.0f;
  }

  /// Sets each row's positive slot of a tile (rows x cols at (i0, j0)) to -inf, keeping its value in pos (`save`):
  /// the softmax statistics and the sigmoid negatives' sums then skip it, and the positive is treated apart.
  void mask_positives(std::size_t i0, std::size_t j0, std::size_t rows, std::size_t cols, worker_scratch& ws, bool save)
  {
    if (grouped()) // the ids tell the positives (sigmoid: the tile tests them; softmax: take_positives)
    {
      return;
    }
    for (std::size_t ii = 0; ii < rows; ++ii)
    {
      const std::size_t p = positive_of(i0 + ii);
      if (p >= j0 && p < j0 + cols)
      {
        float& x = ws.tile[ii * block_n + (p - j0)];
        if (save)
        {
          pos[i0 + ii] = x;
        }
        x = -detail::infinity_f;
      }
    }
  }

  /// Forward of tile (i0, j0) (rows x cols; the query block prepared, ws.tile holding the products where the
  /// algorithm stores logits): the rows' running statistics row_state[0, rows) (sigmoid: sig_loss, sig_max), the
  /// positives into pos, and (symmetric) the worker's column statistics. Returns whether a logit was non-finite.
  template <class Algorithm, class O>
  bool forward_tile(std::size_t i0,
                    std::size_t j0,
                    std::size_t rows,
                    std::size_t cols,
                    worker_scratch& ws,
                    online_lse* row_state,
                    float* sig_loss,
                    float* sig_max)
  {
    const float* tile = ws.tile.data();
    const bool bad = scaled_tile<Algorithm, O>(i0, j0, rows, cols, ws);
    // The positive is kept apart from the negatives' statistics (row and, symmetric, column: the same element).
    mask_positives(i0, j0, rows, cols, ws, true);
    if constexpr (O::softmax)
    {
      if (grouped())
      {
        take_positives(i0, j0, rows, cols, ws.tile.data(), O::columns ? ws.col_pos.data() : nullptr);
      }
    }
    if constexpr (!O::softmax)
    {
      pairwise_tile<O>(*this, i0, j0, rows, cols, ws, sig_loss, sig_max, false);
    }
    else
    {
      for (std::size_t ii = 0; ii < rows; ++ii)
      {
        const float* x = &tile[ii * block_n];
        const float m = lane_max(cols,
                                 -detail::infinity_f,
                                 [&](std::size_t jj)
                                 {
                                   return x[jj];
                                 });
        if (m == -detail::infinity_f)
        {
          continue;
        }
        online_lse& st = row_state[ii];
        st.rebase(detail::max_f(st.max, m));
        const float shift = st.shift();
        st.sum += lane_sum(cols,
                           [&](std::size_t jj)
                           {
                             return detail::exp_approx(x[jj] - shift);
                           });
      }
      if constexpr (O::columns)
      {
        float* cmax = &ws.col_max[j0];
        float* csum = &ws.col_sum[j0];
        float new_max[block_n];
        for (std::size_t jj = 0; jj < cols; ++jj)
        {
          new_max[jj] = cmax[jj];
        }
        for (std::size_t ii = 0; ii < rows; ++ii)
        {
          const float* x = &tile[ii * block_n];
          for (std::size_t jj = 0; jj < cols; ++jj)
          {
            new_max[jj] = detail::max_f(new_max[jj], x[jj]);
          }
        }
        float shift[block_n];
        for (std::size_t jj = 0; jj < cols; ++jj)
        {
          online_lse st{cmax[jj], csum[jj]};
          st.rebase(new_max[jj]);
          cmax[jj] = st.max;
          csum[jj] = st.sum;
          shift[jj] = st.shift();
        }
        for (std::size_t ii = 0; ii < rows; ++ii)
        {
          const float* x = &tile[ii * block_n];
          for (std::size_t jj = 0; jj < cols; ++jj)
          {
            csum[jj] += detail::exp_approx(x[jj] - shift[jj]);
          }
        }
      }
    }
    return bad;
  }

  /// Row i's finished statistics from its running state (sigmoid: its summed negatives' terms and largest z).
  template <class O>
  void finish_forward_row(std::size_t i, const online_lse& row_state, float sig_loss, float sig_max) noexcept
  {
    if constexpr (!O::softmax)
    {
      set_pairwise_row<O>(*this, i, sig_loss, sig_max, true);
    }
    else if (grouped())
    {
      set_grouped_row(i, row_state);
    }
    else
    {
      set_row(i, finish_row(row_state, pos[i]), row_state.max);
    }
  }

  /// Forward over one row block against every key tile (materialized: also stores A = round_T(Q K^T)). Returns
  /// whether a logit was non-finite.
  template <class Algorithm, class O>
  bool forward_block_row(std::size_t i0, unsigned w)
  {
    worker_scratch& ws = scratch[w];
    float* tile = ws.tile.data();
    const std::size_t rows = std::min(block_m, n_q - i0);
    query_block(i0, ws, false);
    online_lse row_state[block_m];
    float sig_loss[block_m] = {}, sig_max[block_m];
    std::fill(sig_max, sig_max + block_m, -detail::infinity_f);
    bool bad = false;
    for (std::size_t j0 = 0; j0 < n_k; j0 += block_n)
    {
      const std::size_t cols = std::min(block_n, n_k - j0);
      if constexpr (algorithm_traits<Algorithm>::stores_logits)
      {
        mm.dot_tile(j0, rows, cols, ws);
        for (std::size_t ii = 0; ii < rows; ++ii)
        {
          from_float_row(&tile[ii * block_n], cols, &logits[(i0 + ii) * n_k + j0]);
        }
      }
      bad |= forward_tile<Algorithm, O>(i0, j0, rows, cols, ws, row_state, sig_loss, sig_max);
    }
    for (std::size_t ii = 0; ii < rows; ++ii)
    {
      finish_forward_row<O>(i0 + ii, row_state[ii], sig_loss[ii], sig_max[ii]);
    }
    return bad;
  }

  /// G = dL/dS of block (i0, j0) into ws.tile; the positive's term exactly (fused) or by subtraction (materialized,
  /// as frameworks) (rows x cols valid, zero elsewhere up to block_m x block_n), from the
  /// scaled logits already there.
  template <class O>
  CONTRASTIVE_NOINLINE void gradient_tile(bool exact_positive,
                                          std::size_t i0,
                                          std::size_t j0,
                                          std::size_t rows,
                                          std::size_t cols,
                                          const grad_coefficients& gc,
                                          worker_scratch& ws) const noexcept
  {
    if constexpr (!O::softmax)
    {
      pairwise_gradient_tile<O>(*this, i0, j0, rows, cols, gc, ws);
    }
    else if (grouped())
    {
      grouped_gradient_tile<O>(i0, j0, rows, cols, gc, ws);
    }
    else
    {
      softmax_gradient_tile<O>(exact_positive, i0, j0, rows, cols, gc, ws);
    }
  }
  /// gradient_tile of a softmax objective with one positive per row.
  template <class O>
  void softmax_gradient_tile(bool exact_positive,
                             std::size_t i0,
                             std::size_t j0,
                             std::size_t rows,
                             std::size_t cols,
                             const grad_coefficients& gc,
                             worker_scratch& ws) const noexcept
  {
    for (std::size_t ii = 0; ii < block_m; ++ii)
    {
      float* g = &ws.tile[ii * block_n];
      if (ii >= rows)
      {
        std::fill(g, g + block_n, 0.0f);
        continue;
      }
      const float rs = detail::max_f(row_max[i0 + ii], pos[i0 + ii]), rl = row_log_sum[i0 + ii];
      if constexpr (O::columns)
      {
        const float* cs = &col_shift[j0];
        const float* cl = &col_log_sum[j0];
        for (std::size_t jj = 0; jj < cols; ++jj)
        {
          g[jj] = O::gradient(g[jj], rs, rl, cs[jj], cl[jj], gc);
        }
      }
      else
      {
        for (std::size_t jj = 0; jj < cols; ++jj)
        {
          g[jj] = O::gradient(g[jj], rs, rl, 0.0f, 0.0f, gc);
        }
      }
      std::fill(g + cols, g + block_n, 0.0f);
      const std::size_t p = positive_of(i0 + ii);
      if (p >= j0 && p < j0 + cols)
      {
        g[p - j0] = exact_positive ? O::positive_gradient(row_loss[i0 + ii], O::columns ? col_loss[p] : 0.0f, gc)
                                   : positive_gradient(g[p - j0], gc);
      }
    }
  }

  /// Grouped softmax, G of a tile: a_i P_ij + b_j C_ij off the positives and, on them, (a_i / |P(i)|) expm1((S_ij -
  /// shift_i) - pos_log_i) + (b_j / |Q(g(j))|) expm1((S_ij - shift_j) - pos_log_j) (numeric/groups.hpp's
  /// grouped_stats), with a_i = row_coef where row i has a positive (else 0) and b_j = col_coef where column j has one.
  template <class O>
  void grouped_gradient_tile(std::size_t i0,
                             std::size_t j0,
                             std::size_t rows,
                             std::size_t cols,
                             const grad_coefficients& gc,
                             worker_scratch& ws) const noexcept
  {
    constexpr bool sym = O::columns;
    float b[block_n], bp[block_n];
    for (std::size_t jj = 0; jj < cols && sym; ++jj)
    {
      const float inv = groups.col_inv[j0 + jj];
      b[jj] = inv > 0.0f ? gc.col_coef : 0.0f;
      bp[jj] = b[jj] * inv;
    }
    for (std::size_t ii = 0; ii < block_m; ++ii)
    {
      float* g = &ws.tile[ii * block_n];
      if (ii >= rows)
      {
        std::fill(g, g + block_n, 0.0f);
        continue;
      }
      const std::size_t i = i0 + ii;
      const float inv = groups.row_inv[i];
      const float a = inv > 0.0f ? gc.row_coef : 0.0f, ap = a * inv;
      const float rs = row_max[i], rl = row_log_sum[i], rp = pos[i];
      // The positives' logits, before the softmax overwrites them.
      const std::size_t *first, *last;
      groups.positives_in(i, j0, j0 + cols, first, last);
      std::size_t at[block_n];
      float xp[block_n];
      std::size_t n_pos = 0;
      for (; first != last; ++first)
      {
        at[n_pos] = *first - j0;
        xp[n_pos++] = g[*first - j0];
      }
      if constexpr (sym)
      {
        const float* cs = &col_shift[j0];
        const float* cl = &col_log_sum[j0];
        for (std::size_t jj = 0; jj < cols; ++jj)
        {
          const float x = g[jj];
          g[jj] = a * detail::exp_approx((x - rs) - rl) + b[jj] * detail::exp_approx((x - cs[jj]) - cl[jj]);
        }
        const float* cp = &col_pos_log[j0];
        for (std::size_t t = 0; t < n_pos; ++t)
        {
          const std::size_t jj = at[t];
          g[jj] = ap * ::expm1f((xp[t] - rs) - rp) + bp[jj] * ::expm1f((xp[t] - cs[jj]) - cp[jj]);
        }
      }
      else
      {
        for (std::size_t jj = 0; jj < cols; ++jj)
        {
          g[jj] = a * detail::exp_approx((g[jj] - rs) - rl);
        }
        for (std::size_t t = 0; t < n_pos; ++t)
        {
          g[at[t]] = ap * ::expm1f((xp[t] - rs) - rp);
        }
      }
      std::fill(g + cols, g + block_n, 0.0f);
    }
  }

  /// Row i's finished statistics (`negatives_max`: the largest negative logit, for the max-logit diagnosis).
  void set_row(std::size_t i, const contrastive::row_loss& rl, float negatives_max) noexcept
  {
    row_lse[i] = rl.lse;
    row_loss[i] = rl.loss;
    row_log_sum[i] = rl.log_sum;
    row_max[i] = negatives_max;
  }
  /// Column j's finished statistics.
  void set_column(std::size_t j, const contrastive::row_loss& rl) noexcept
  {
    col_lse[j] = rl.lse;
    col_loss[j] = rl.loss;
    col_shift[j] = rl.shift;
    col_log_sum[j] = rl.log_sum;
  }
  /// Grouped softmax: column j's finished statistics.
  void set_column(std::size_t j, const grouped_stats& g) noexcept
  {
    set_column(j, contrastive::row_loss{g.lse, g.loss, g.shift, g.log_sum});
    col_pos_log[j] = g.pos_log;
  }

  /// Empties every worker's column partials (symmetric forward; a no-op where they are not sized).
  void reset_column_partials() noexcept
  {
    for (auto& ws : scratch)
    {
      std::fill(ws.col_max.begin(), ws.col_max.end(), -detail::infinity_f);
      std::fill(ws.col_sum.begin(), ws.col_sum.end(), 0.0f);
      std::fill(ws.col_pos.begin(), ws.col_pos.end(), positive_stats{});
    }
  }

  /// Forward over all row blocks: the finished row statistics, and (symmetric) each worker's column partials, which
  /// `column_partial` merges.
  template <class Algorithm, class O>
  row_pass forward_rows(float s)
  {
    scale = s;
    sigmoid_g_sum = 0.0;
    begin_forward();
    reset_column_partials();
    unsigned char bad[max_threads] = {};
    parallel_for(pool,
                 nq_pad / block_m,
                 workers,
                 [&](std::size_t t, unsigned w)
                 {
                   bad[w] |= forward_block_row<Algorithm, O>(t * block_m, w) ? 1 : 0;
                 });
    bool any_bad = false;
    for (unsigned w = 0; w < workers; ++w)
    {
      any_bad |= bad[w] != 0;
    }
    return finish_rows<O>(any_bad);
  }

  /// Column j's negatives over every row of this engine's problem: the workers' partials merged in worker order
  /// (fused, materialized) or the chunks' running state (chunked).
  template <class Algorithm>
  online_lse column_partial(std::size_t j) const noexcept
  {
    if constexpr (algorithm_traits<Algorithm>::chunks)
    {
      return online_lse{col_run_max[j], col_run_sum[j]};
    }
    else
    {
      online_lse c{};
      for (unsigned w = 0; w < workers; ++w)
      {
        c.merge(online_lse{scratch[w].col_max[j], scratch[w].col_sum[j]});
      }
      return c;
    }
  }

  /// Grouped symmetric: column j's positives over this engine's rows, merged as `column_partial`.
  template <class Algorithm>
  positive_stats column_positives(std::size_t j) const noexcept
  {
    if constexpr (algorithm_traits<Algorithm>::chunks)
    {
      return col_run_pos[j];
    }
    else
    {
      positive_stats c{};
      for (unsigned w = 0; w < workers; ++w)
      {
        c.merge(scratch[w].col_pos[j]);
      }
      return c;
    }
  }

  /// The row phase's result from the finished row statistics: the rows' loss sum, the largest logit and whether a
  /// logit (a positive included) was non-finite.
  template <class O>
  row_pass finish_rows(bool logits_nonfinite) const noexcept
  {
    row_pass r;
    r.logits_nonfinite = logits_nonfinite;
    double row_sum = 0.0;
    float max_logit = -detail::infinity_f;
    const bool gr = grouped();
    for (std::size_t i = 0; i < n_q; ++i)
    {
      row_sum += row_loss[i];
      r.logits_nonfinite |= !(pos[i] - pos[i] == 0.0f);
      // Grouped: row_max covers every logit (softmax: the row's shift), and pos holds no logit.
      max_logit = detail::max_nan(max_logit, gr ? row_max[i] : detail::max_nan(row_max[i], pos[i]));
    }
    r.row_loss_sum = row_sum;
    r.max_logit = max_logit;
    return r;
  }

  /// Scales a float row by `factor` (`backward_output_factor`: a float, or past float's range a double), rounds to
  /// Out (T, or float for partial gradients a caller sums further) and writes d elements; returns whether any result
  /// is non-finite.
  template <class Out>
  bool store_row(const float* acc, double factor, Out* out) const noexcept
  {
    if (factor <= static_cast<double>(FLT_MAX) && factor >= -static_cast<double>(FLT_MAX))
    {
      return store_scaled_row(acc, static_cast<float>(factor), out, d);
    }
    return store_wide_scaled_row(acc, factor, out, d);
  }

  /// sum_c acc[c] * q_i[c] over d elements.
  float dot_query(const float* acc, std::size_t i) const noexcept
  {
    const T* row = q + i * d;
    return lane_sum(d,
                    [&](std::size_t c)
                    {
                      return acc[c] * traits::to_float(row[c]);
                    });
  }
};
} // namespace host
} // namespace contrastive
