// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Per-tile loss math shared by the host engine and the CUDA kernels.
///
/// With S = s Q K^T, P the row softmax and C the column softmax of S, the gradient of the loss w.r.t. the logits is
///   symmetric: G = (P + C - 2 I) / (2 n)      info_nce: G_ij = (P_ij - [j == p_i]) / n_q
/// and dQ = s G K, dK = s G^T Q, d loss / d log s = sum_ij G_ij S_ij = <dQ, Q> (the last form costs O(n d)).

#include <contrastive/detail/config.hpp>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/tags.hpp>

#include <cstddef>

namespace contrastive
{
/// Per-row coefficients of G = dL/dS: G_ij = row_coef P_ij + col_coef C_ij - pos_coef [j == p_i], where P is the
/// row softmax and C the column softmax of S. Each objective gives its own (`coefficients` in objectives/).
struct grad_coefficients
{
  float row_coef;
  float col_coef;
  float pos_coef;
};

/// G_ij = dL/dS_ij of one logit, from its scaled value x and the log-sum-exp of its row (and, symmetric, of its
/// column), without the positive's -pos_coef (see `positive_gradient`). Host and device call this one formula.
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE float
logit_gradient(float x, float row_lse, float col_lse, const grad_coefficients& gc, bool symmetric) noexcept
{
  const float row = gc.row_coef * detail::exp_approx(x - row_lse);
  return symmetric ? row + gc.col_coef * detail::exp_approx(x - col_lse) : row;
}

/// The same G_ij from each log-sum-exp split as shift + log_sum (`row_loss`): exp((x - shift) - log_sum) keeps the
/// softmax to a few float eps at any logit magnitude, where exp(x - lse) inherits lse's absolute rounding (~eps |lse|).
/// The host engine uses this form.
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE float logit_gradient(float x,
                                                                     float row_shift,
                                                                     float row_log_sum,
                                                                     float col_shift,
                                                                     float col_log_sum,
                                                                     const grad_coefficients& gc,
                                                                     bool symmetric) noexcept
{
  const float row = gc.row_coef * detail::exp_approx((x - row_shift) - row_log_sum);
  return symmetric ? row + gc.col_coef * detail::exp_approx((x - col_shift) - col_log_sum) : row;
}

/// The positive's term: G_pp = logit_gradient(S_pp, ...) - pos_coef.
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE float positive_gradient(float g, const grad_coefficients& gc) noexcept
{
  return g - gc.pos_coef;
}

/// The positive's G_pp without cancellation, for the fused algorithm: with P_pp = exp(-row loss) and C_pp =
/// exp(-column loss), G_pp = row_coef (P_pp - 1) + col_coef (C_pp - 1) = row_coef expm1(-row loss) + col_coef
/// expm1(-column loss). `positive_gradient` forms P_pp - 1 by subtraction, as frameworks' softmax-minus-one-hot does
/// (and the materialized algorithm, which reproduces them, keeps doing); when the positive dominates its row that
/// difference keeps few digits (~1e-7 absolute against values of ~1e-4), and Adam turns the noise in d loss / d log s
/// into full-size steps of the temperature.
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE float
exact_positive_gradient(float row_loss, float col_loss, const grad_coefficients& gc, bool symmetric) noexcept
{
  const float row = gc.row_coef * ::expm1f(-row_loss);
  return symmetric ? row + gc.col_coef * ::expm1f(-col_loss) : row;
}

/// The materialized algorithm's rounding chain, as a framework's autocast rounds (see algorithm::materialized):
///   A = round_T(q . k)  ->  S = round_T(s A)  ->  G in float  ->  dS = round_T(loss_scale G)  ->  dA = round_T(s dS)
/// with d loss / d log s accumulated as sum dS * A. The device applies it per element; the host engine takes the same
/// steps a row at a time (host/element_rows.hpp, for its vectorised conversions).
template <class T>
struct materialized_chain
{
  /// S = round_T(s * A) from the stored element-type A (as float).
  CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE static float logit(float a, float s) noexcept
  {
    return round_to<T>(s * a);
  }
  /// dS = round_T(loss_scale * G).
  CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE static float scaled_gradient(float g, float loss_scale) noexcept
  {
    return round_to<T>(loss_scale * g);
  }
  /// dA = s * dS, to be rounded to T where it is stored.
  CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE static float product_gradient(float ds, float s) noexcept
  {
    return s * ds;
  }
};

} // namespace contrastive
