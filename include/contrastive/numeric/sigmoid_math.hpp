// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Per-logit math of the sigmoid objective (SigLIP, Zhai et al. 2023), shared by every algorithm and by host and
/// device.
///
/// With z_ij = s <q_i, k_j> + b and l_ij = +1 for the positive pair of row i and -1 otherwise,
///   L = -(1/n_q) sum_ij log sigmoid(l_ij z_ij) = (1/n_q) sum_ij softplus(-l_ij z_ij),
///   dL/dz_ij = -(l_ij / n_q) sigmoid(-l_ij z_ij),
/// and with S = z - b: dQ = s G K, dK = s G^T Q, d L / d log s = sum_ij G_ij S_ij = <dQ, Q>, d L / d b = sum_ij G_ij.
/// No normaliser couples the logits: each term needs its own z only.
///
/// Both the term and its gradient come from one exponential, e = exp(-|l z|), in forms that never cancel:
///   softplus(-v) = max(-v, 0) + log1p(e),   sigmoid(-v) = e / (1 + e) for v >= 0, 1 / (1 + e) for v < 0,
/// so a well-separated pair's loss, about e, keeps its float digits (as the softmax path keeps log1p of the rest).
/// A masked slot z = -inf (a negative) contributes exactly 0 to both.

#include <contrastive/detail/config.hpp>
#include <contrastive/numeric/math.hpp>

namespace contrastive
{
namespace detail
{
/// log(1 + e) for e in [0, 1], to 3 float ulp (tests/numeric_test.cpp), without a libm call (it vectorises in the
/// O(n^2) loops): log1p(e) = 2 atanh(t) with t = e / (2 + e) in [0, 1/3], summed as 2 (t + t^3/3 + ... + t^15/15); the
/// first omitted term is below 2^-27 of the sum. Exact 0 for e = 0; NaN propagates.
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE float log1p_unit(float e) noexcept
{
  const float t = e / (2.0f + e);
  const float t2 = t * t;
  float p = 2.0f / 15.0f;
  p = p * t2 + 2.0f / 13.0f;
  p = p * t2 + 2.0f / 11.0f;
  p = p * t2 + 2.0f / 9.0f;
  p = p * t2 + 2.0f / 7.0f;
  p = p * t2 + 2.0f / 5.0f;
  p = p * t2 + 2.0f / 3.0f;
  p = p * t2 + 2.0f;
  return t * p;
}
} // namespace detail

/// One logit's loss term softplus(-l z) and the factor of its gradient, dL/dz = coefficient * `grad` with
/// grad = -l sigmoid(-l z) (before the 1/n_q of the batch).
struct sigmoid_term
{
  float loss;
  float grad;
};

/// The term of logit z of a negative pair (l = -1): softplus(z), sigmoid(z).
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE sigmoid_term sigmoid_negative(float z) noexcept
{
  // |z| by its sign bit (NaN stays NaN through e), and sigmoid(z)'s two forms merged as bit masks: a `?:` with a float
  // operation in an arm keeps GCC from vectorising the loops under its default -ftrapping-math (exp_approx).
  const float a = detail::bits_float(detail::float_bits(z) & 0x7fffffffu);
  const float e = detail::exp_approx(-a);
  const float inv = 1.0f / (1.0f + e);
  const std::uint32_t nonnegative = 0u - static_cast<std::uint32_t>(z >= 0.0f);
  const float grad =
      detail::bits_float((detail::float_bits(inv) & nonnegative) | (detail::float_bits(e * inv) & ~nonnegative));
  return {(z > 0.0f ? z : 0.0f) + detail::log1p_unit(e), grad};
}

/// The term of logit z of the positive pair (l = +1): softplus(-z), -sigmoid(-z).
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE sigmoid_term sigmoid_positive(float z) noexcept
{
  const sigmoid_term t = sigmoid_negative(-z);
  return {t.loss, -t.grad};
}
} // namespace contrastive
