// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// SigLIP's pairwise sigmoid loss as a type: (1/n_q) sum_ij softplus(-l_ij z_ij) over z = S + b, l_ij = +1 for a
/// positive pair and -1 otherwise (numeric/sigmoid_math.hpp has the per-logit term and gradient).

#include <contrastive/detail/config.hpp>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/numeric/sigmoid_math.hpp>
#include <contrastive/objectives/softmax.hpp>
#include <contrastive/status.hpp>
#include <contrastive/tags.hpp>

#include <cstddef>

namespace contrastive
{
namespace objectives
{
/// SigLIP's pairwise sigmoid loss (objective::sigmoid): an independent term per logit, z = S + b.
struct sigmoid
{
  static constexpr objective code = objective::sigmoid; ///< its value in problem<T>
  static constexpr const char* name = "sigmoid";        ///< as to_string(code)
  static constexpr bool softmax = false;                ///< no normaliser: each logit's term needs its own z only
  static constexpr bool columns = false;                ///< no column statistics
  static constexpr bool has_bias = true;                ///< z = S + b, b a parameter of the call
  static constexpr bool takes_labels = true;            ///< one label per row, null meaning the diagonal

  /// Null labels mean the diagonal, which needs n_q <= n_k (shape_mismatch "labels").
  static status check_shape(std::size_t n_q, std::size_t n_k, bool has_labels)
  {
    return check_labelled_shape(n_q, n_k, has_labels);
  }
  /// G_ij = row_coef * (-l_ij sigmoid(-l_ij z_ij)), row_coef = 1/n_q; the other two unused.
  CONTRASTIVE_HOST_DEVICE static grad_coefficients coefficients(std::size_t n_q, std::size_t n_k) noexcept
  {
    (void)n_k;
    const float c = static_cast<float>(1.0 / static_cast<double>(n_q));
    return {c, 0.0f, c};
  }
  /// The batch's loss: the summed row terms over n_q (col_loss_sum unused).
  CONTRASTIVE_HOST_DEVICE static float
  mean(std::size_t n_q, std::size_t n_k, double row_loss_sum, double col_loss_sum) noexcept
  {
    (void)n_k;
    (void)col_loss_sum;
    return static_cast<float>(row_loss_sum / static_cast<double>(n_q));
  }
  /// Group ids change the labels only: the coefficients stay over every query.
  static grad_coefficients grouped_coefficients(std::size_t n_q, std::size_t r, std::size_t c) noexcept
  {
    (void)r;
    (void)c;
    return coefficients(n_q, n_q);
  }
  /// Group ids: the same mean over every query.
  static float grouped_mean(std::size_t n_q, std::size_t r, std::size_t c, double row_sum, double col_sum) noexcept
  {
    (void)r;
    (void)c;
    return mean(n_q, n_q, row_sum, col_sum);
  }

  /// One logit's loss term and gradient factor (numeric/sigmoid_math.hpp).
  CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE static sigmoid_term term(float z, bool positive) noexcept
  {
    return positive ? sigmoid_positive(z) : sigmoid_negative(z);
  }
};
} // namespace objectives
} // namespace contrastive
