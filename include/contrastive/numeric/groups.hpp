// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Several positives per row, from group ids (problem::query_groups, key_groups): the pair (i, j) is positive when
/// the ids are equal. With K(g) and Q(g) the keys and queries of group g, P(i) = K(g(i)) the positives of query i
/// and R, C the numbers of queries and keys that have at least one positive:
///   info_nce:  L = (1/R) sum_{i: P(i) nonempty} [lse_i - (1/|P(i)|) sum_{j in P(i)} S_ij]
///   symmetric: L = (row term as info_nce over the queries + the same term over the keys' columns, each a mean over
///              its rows with a positive) / 2; n_q may differ from n_k
///   sigmoid:   L = -(1/n_q) sum_ij log sigmoid(l_ij z_ij), l_ij = +1 for a positive pair and -1 otherwise
/// A softmax objective whose batch has no positive pair has loss 0 and zero gradients. The gradient of a softmax
/// objective w.r.t. S_ij is
///   G_ij = a_i P_ij + b_j C_ij - [i ~ j] (a_i / |K(g)| + b_j / |Q(g)|),
/// a_i = [P(i) nonempty] row_coef, b_j = [column j has a positive] col_coef (row_coef 1/R, or 1/(2R) symmetric;
/// col_coef 1/(2C)). This header counts the groups once per step (`group_weights`) and keeps a row's positives apart
/// from its negatives (`positive_stats`, `finish_grouped`: the loss and the positives' G without cancellation);
/// each objective gives its coefficients and mean (grouped_coefficients, grouped_mean in objectives/), and the
/// engines apply them tile by tile (host/engine_state.hpp).

#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/numeric/online_lse.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

namespace contrastive
{
/// The positive logits of one row (or column) of a grouped softmax step, kept apart from its negatives: their
/// largest value and, measured from it, their count, `deficit` = sum expm1(S - max) (<= 0, and 0 when every positive
/// equals the max) and `gap` = sum (max - S) (>= 0). From these `finish_grouped` forms the loss and the positives'
/// gradient without the cancellations of lse - mean S and P - 1/|P| after training (a positive at the row's max with
/// negatives far below it). Merging is associative up to rounding: chunks, workers and ranks combine their parts.
struct positive_stats
{
  float max = -detail::infinity_f; ///< largest positive logit (-inf when empty)
  float deficit = 0.0f;            ///< sum over the positives of expm1(S - max)
  float gap = 0.0f;                ///< sum over the positives of max - S
  float count = 0.0f;              ///< number of positives (exact in float below 2^24)

  /// Measures the state from `new_max` (>= max; the state not empty).
  void rebase(float new_max) noexcept
  {
    const float shift = max - new_max; // <= 0
    deficit = count * ::expm1f(shift) + ::expf(shift) * deficit;
    gap += count * (new_max - max);
    max = new_max;
  }
  /// Adds one positive logit; NaN poisons the state (its max and sums).
  void absorb(float x) noexcept
  {
    if (count == 0.0f || x != x || max != max)
    {
      const bool poisoned = x != x || max != max;
      max = poisoned ? x + max : x;
      deficit = gap = poisoned ? max : 0.0f;
      count += 1.0f;
      return;
    }
    if (x > max)
    {
      rebase(x);
    }
    const float below = x == max ? 0.0f : max - x; // a tie with an infinite max is 0 below it, not NaN
    deficit += ::expm1f(-below);
    gap += below;
    count += 1.0f;
  }
  /// Combines the positives of two disjoint parts of a row (or column).
  void merge(positive_stats o) noexcept
  {
    if (o.count == 0.0f)
    {
      return;
    }
    if (count == 0.0f)
    {
      *this = o;
      return;
    }
    if (max != max || o.max != o.max)
    {
      max = deficit = gap = max + o.max;
      count += o.count;
      return;
    }
    if (o.max > max)
    {
      rebase(o.max);
    }
    else if (o.max < max)
    {
      o.rebase(max);
    }
    deficit += o.deficit;
    gap += o.gap;
    count += o.count;
  }
};

/// Floats one positive_stats holds (the engines' memory accounting).
inline constexpr std::size_t positive_floats = sizeof(positive_stats) / sizeof(float);

/// A grouped softmax row's (or column's) finished statistics: `shift` is its largest logit, log_sum = log sum_j
/// exp(S_j - shift) over every logit, `pos_log` = log_sum - log |P| formed without cancellation (the positives'
/// G is a (|P| P_j - 1) / |P| = (a / |P|) expm1((S_j - shift) - pos_log)), and loss = lse - mean of the positives
/// (0 without a positive: the row takes no part).
struct grouped_stats
{
  float lse, loss, shift, log_sum, pos_log;
};

/// The statistics of a row (or column) from its negatives' state and its positives'. Where a positive is the largest
/// logit, log_sum = log |P| + log1p((deficit + rest) / |P|) with `rest` the negatives' sum measured from it: one
/// positive at the max gives log1p(rest) exactly, as the one-positive loss (numeric/online_lse.hpp's finish_row).
inline grouped_stats finish_grouped(online_lse negatives, const positive_stats& positives) noexcept
{
  if (positives.count == 0.0f) // no positive: the negatives' statistics (its G has coefficient 0), loss 0
  {
    const float log_sum = negatives.max == -detail::infinity_f ? 0.0f : ::logf(negatives.sum);
    return {negatives.max + log_sum, 0.0f, negatives.max, log_sum, log_sum};
  }
  if (positives.max != positives.max || negatives.max != negatives.max)
  {
    const float nan = positives.max + negatives.max + detail::infinity_f * 0.0f;
    return {nan, nan, nan, nan, nan};
  }
  const float k = positives.count;
  const float log_k = ::logf(k);
  if (positives.max >= negatives.max)
  {
    const float m = positives.max;
    const float rest =
        negatives.max == -detail::infinity_f ? 0.0f : negatives.sum * detail::exp_approx(negatives.max - m);
    const float pos_log = ::log1pf((positives.deficit + rest) / k);
    const float log_sum = log_k + pos_log;
    return {m + log_sum, log_sum + positives.gap / k, m, log_sum, pos_log};
  }
  const float m = negatives.max; // a negative is the largest logit: every sum below adds positive terms
  const float log_sum = ::logf(negatives.sum + (k + positives.deficit) * detail::exp_approx(positives.max - m));
  return {m + log_sum, log_sum + ((m - positives.max) + positives.gap / k), m, log_sum, log_sum - log_k};
}

/// What a grouped step's engine reads besides the logits: the ids of its rows and keys and, per row and key, the
/// reciprocal group sizes (0 where there is no positive). Non-owning; null q_ids: not grouped.
struct group_view
{
  const std::int64_t* q_ids = nullptr; ///< this engine's rows
  const std::int64_t* k_ids = nullptr; ///< this engine's keys (a rank: every rank's keys)
  const float* row_inv = nullptr;      ///< per row: 1 / |P(i)|, or 0
  const float* col_inv = nullptr;      ///< symmetric, per key: 1 / |Q(g(j))|, or 0
  /// Every key's index, grouped by id and increasing within a group; row i's positive keys are
  /// key_order[row_keys[2 i], row_keys[2 i + 1]) (an empty range without a positive).
  const std::size_t* key_order = nullptr;
  const std::size_t* row_keys = nullptr;

  /// Row i's positive keys in [j0, j1), in increasing order: [first, last) of key_order.
  void positives_in(
      std::size_t i, std::size_t j0, std::size_t j1, const std::size_t*& first, const std::size_t*& last) const noexcept
  {
    const std::size_t* b = key_order + row_keys[2 * i];
    const std::size_t* e = key_order + row_keys[2 * i + 1];
    first = std::lower_bound(b, e, j0);
    last = std::lower_bound(first, e, j1);
  }
};

/// The counts of one grouped step over the whole batch (every rank's ids), and this engine's per-row and per-key
/// weights. `single_positive`: every query has exactly one positive key (symmetric: query i's is key i, with no other
/// query); the step then runs as the labelled single-positive loss (`labels`: each of this engine's rows' positive,
/// a global key index), which computes the same loss with the single-positive paths' exact positive term.
struct group_weights
{
  std::vector<float> row_inv, col_inv;
  std::vector<std::size_t> key_order, row_keys; ///< group_view's

  std::vector<std::int32_t> labels;
  std::size_t rows_with_positive = 0; ///< R, over the batch
  std::size_t cols_with_positive = 0; ///< C, over the batch (symmetric; else 0)
  bool single_positive = false;

  /// From every query id (q_all, n_q_total) and every key id (k_all, n_k_total); this engine's rows are queries
  /// [q_off, q_off + n_q). Objective O (objectives/): its `columns` trait says whether the columns are counted. May
  /// throw std::bad_alloc.
  template <class O>
  void compute(const std::int64_t* q_all,
               std::size_t n_q_total,
               const std::int64_t* k_all,
               std::size_t n_k_total,
               std::size_t q_off,
               std::size_t n_q)
  {
    struct group
    {
      std::size_t queries = 0, keys = 0, first_key = 0, offset = 0, filled = 0;
    };
    std::unordered_map<std::int64_t, group> groups;
    groups.reserve(n_k_total + n_q_total);
    for (std::size_t j = 0; j < n_k_total; ++j)
    {
      group& g = groups[k_all[j]];
      if (g.keys++ == 0)
      {
        g.first_key = j;
      }
    }
    for (std::size_t i = 0; i < n_q_total; ++i)
    {
      auto it = groups.find(q_all[i]);
      if (it != groups.end())
      {
        ++it->second.queries;
      }
    }
    constexpr bool sym = O::columns;
    // The labelled path takes int32 key indices: beyond them the step stays grouped.
    single_positive = (!sym || n_q_total == n_k_total) &&
                      n_k_total <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max());
    rows_with_positive = 0;
    for (std::size_t i = 0; i < n_q_total; ++i)
    {
      auto it = groups.find(q_all[i]);
      const std::size_t keys = it == groups.end() ? 0 : it->second.keys;
      rows_with_positive += keys != 0 ? 1 : 0;
      single_positive = single_positive && keys == 1 && (!sym || it->second.first_key == i);
    }
    cols_with_positive = 0;
    if (sym)
    {
      for (std::size_t j = 0; j < n_k_total; ++j)
      {
        cols_with_positive += groups.find(k_all[j])->second.queries != 0 ? 1 : 0;
      }
    }
    // Every key's index grouped by id (a group's keys in increasing order), and each of this engine's rows' range.
    std::size_t next = 0;
    for (auto& entry : groups)
    {
      entry.second.offset = next;
      next += entry.second.keys;
    }
    key_order.resize(n_k_total);
    for (std::size_t j = 0; j < n_k_total; ++j)
    {
      group& g = groups.find(k_all[j])->second;
      key_order[g.offset + g.filled++] = j;
    }
    row_keys.assign(2 * n_q, 0);
    row_inv.assign(n_q, 0.0f);
    col_inv.assign(sym ? n_k_total : 0, 0.0f);
    labels.assign(single_positive ? n_q : 0, 0);
    for (std::size_t i = 0; i < n_q; ++i)
    {
      auto it = groups.find(q_all[q_off + i]);
      if (it == groups.end() || it->second.keys == 0)
      {
        continue;
      }
      row_inv[i] = static_cast<float>(1.0 / static_cast<double>(it->second.keys));
      row_keys[2 * i] = it->second.offset;
      row_keys[2 * i + 1] = it->second.offset + it->second.keys;
      if (single_positive)
      {
        labels[i] = static_cast<std::int32_t>(it->second.first_key);
      }
    }
    for (std::size_t j = 0; sym && j < n_k_total; ++j)
    {
      const std::size_t queries = groups.find(k_all[j])->second.queries;
      col_inv[j] = queries == 0 ? 0.0f : static_cast<float>(1.0 / static_cast<double>(queries));
    }
  }

  /// The engine's view, with its rows' and keys' ids.
  group_view view(const std::int64_t* q_ids, const std::int64_t* k_ids) const noexcept
  {
    return {
        q_ids, k_ids, row_inv.data(), col_inv.empty() ? nullptr : col_inv.data(), key_order.data(), row_keys.data()};
  }

  std::size_t bytes_held() const noexcept
  {
    return (row_inv.capacity() + col_inv.capacity()) * sizeof(float) +
           (key_order.capacity() + row_keys.capacity()) * sizeof(std::size_t) +
           labels.capacity() * sizeof(std::int32_t);
  }
};

} // namespace contrastive
