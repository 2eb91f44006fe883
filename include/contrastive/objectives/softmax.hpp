// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What the two softmax objectives (objectives/symmetric.hpp, objectives/info_nce.hpp) share: the rows' (and, for the
/// symmetric loss, the columns') cross-entropy against their positives, and its gradient per logit. The objective
/// headers give their traits and coefficients; the engines (host/engine_state.hpp, the device passes) form the
/// statistics and call these per-logit functions.

#include <contrastive/detail/config.hpp>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/status.hpp>

#include <cstddef>
#include <string>

namespace contrastive
{
namespace objectives
{
/// The shape rule of the objectives that take a label per row (info_nce, sigmoid): null labels mean the diagonal,
/// which needs n_q <= n_k.
inline status check_labelled_shape(std::size_t n_q, std::size_t n_k, bool has_labels)
{
  if (!has_labels && n_q > n_k)
  {
    return {errc::shape_mismatch,
            "labels",
            "null labels mean the diagonal, which needs n_q <= n_k (got n_q = " + std::to_string(n_q) +
                ", n_k = " + std::to_string(n_k) + ")"};
  }
  return {};
}

/// A softmax cross-entropy over the rows of S = s Q K^T (`Columns`: and over its columns, the two means averaged).
template <bool Columns>
struct softmax_objective
{
  static constexpr bool softmax = true;    ///< each row's loss is lse(row) - its positive (log-sum-exp statistics)
  static constexpr bool columns = Columns; ///< the columns are cross-entropies too: column statistics are formed
  static constexpr bool has_bias = false;  ///< takes no logit bias (a softmax is invariant to it)

  /// Coefficients of G = dL/dS for a batch of n_q queries and n_k keys, one positive per row (numeric/loss_math.hpp):
  /// rows: 1/n_q (1/(2 n_q) with columns), columns: 1/(2 n_k) or 0.
  CONTRASTIVE_HOST_DEVICE static grad_coefficients coefficients(std::size_t n_q, std::size_t n_k) noexcept
  {
    const double half = Columns ? 0.5 : 1.0;
    const float c = static_cast<float>(half / static_cast<double>(n_q));
    return {c, Columns ? static_cast<float>(0.5 / static_cast<double>(n_k)) : 0.0f, Columns ? 2.0f * c : c};
  }
  /// The batch's loss from the sums of its row losses (and column losses): their mean (with columns, the mean of both
  /// means).
  CONTRASTIVE_HOST_DEVICE static float
  mean(std::size_t n_q, std::size_t n_k, double row_loss_sum, double col_loss_sum) noexcept
  {
    double total = row_loss_sum / static_cast<double>(n_q);
    if (Columns)
    {
      total = 0.5 * (total + col_loss_sum / static_cast<double>(n_k));
    }
    return static_cast<float>(total);
  }
  /// Group ids (numeric/groups.hpp): row_coef 1/R (1/(2R) with columns) and col_coef 1/(2C) over the R rows and C
  /// columns that have a positive; 0 where there are none.
  static grad_coefficients grouped_coefficients(std::size_t n_q, std::size_t r, std::size_t c) noexcept
  {
    (void)n_q;
    const double half = Columns ? 0.5 : 1.0;
    return {r == 0 ? 0.0f : static_cast<float>(half / static_cast<double>(r)),
            c == 0 || !Columns ? 0.0f : static_cast<float>(0.5 / static_cast<double>(c)),
            0.0f};
  }
  /// Group ids: the means over the R rows and C columns that have a positive, an empty mean counting 0.
  static float grouped_mean(std::size_t n_q, std::size_t r, std::size_t c, double row_sum, double col_sum) noexcept
  {
    (void)n_q;
    const double rows = r == 0 ? 0.0 : row_sum / static_cast<double>(r);
    if (!Columns)
    {
      return static_cast<float>(rows);
    }
    const double cols = c == 0 ? 0.0 : col_sum / static_cast<double>(c);
    return static_cast<float>(0.5 * (rows + cols));
  }

  /// G_ij of one logit x from its row's (and column's) log-sum-exp split as shift + log_sum, without the positive's
  /// term (numeric/loss_math.hpp's logit_gradient).
  CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE static float gradient(float x,
                                                                        float row_shift,
                                                                        float row_log_sum,
                                                                        float col_shift,
                                                                        float col_log_sum,
                                                                        const grad_coefficients& gc) noexcept
  {
    return logit_gradient(x, row_shift, row_log_sum, col_shift, col_log_sum, gc, Columns);
  }
  /// The positive's G_pp without cancellation, from its row's (and column's) loss.
  CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE static float
  positive_gradient(float row_loss, float col_loss, const grad_coefficients& gc) noexcept
  {
    return exact_positive_gradient(row_loss, col_loss, gc, Columns);
  }
};
} // namespace objectives
} // namespace contrastive
