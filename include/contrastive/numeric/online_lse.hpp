// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Running log-sum-exp state and the per-row loss it yields.
///
/// The state keeps the *negatives* (every logit but the positive one) apart from the positive logit. The loss of a row
/// is log(1 + sum_{j != p} exp(S_j - S_p)) = log1p(rest) when the positive is the largest logit, and the small
/// `rest` is then never added to 1 before the logarithm: that is what keeps all digits of a loss like 2.51e-05 (the
/// second row of tests/worked_example_test.cpp at tau = 0.05), where `lse - S_p` computed naively loses most of them.

#include <contrastive/detail/config.hpp>
#include <contrastive/numeric/math.hpp>

#include <cmath>

namespace contrastive
{
/// (max, sum) of exp over a stream of logits; merge is associative, so tiles can be combined in any order.
struct online_lse
{
  float max = -detail::infinity_f; ///< largest value seen, -inf when empty
  float sum = 0.0f;                ///< sum of exp(x - max)

  /// Adds one value.
  CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE void push(float x) noexcept
  {
    merge(online_lse{x, 1.0f});
  }

  /// Combines two states. Guards: an empty side contributes nothing; max = +inf keeps +inf (the sum becomes NaN, as
  /// an overflowed logit must poison the loss); NaN propagates through `max`.
  CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE void merge(online_lse o) noexcept
  {
    if (o.max == -detail::infinity_f)
    {
      return;
    }
    if (max == -detail::infinity_f)
    {
      *this = o;
      return;
    }
    const float m = max > o.max ? max : o.max;
    sum = sum * detail::exp_approx(max - m) + o.sum * detail::exp_approx(o.max - m);
    max = (max != max || o.max != o.max) ? max + o.max : m;
  }

  /// Adds one value with one exponential in the common case (x not above the running max): the per-element update
  /// of the chunked algorithm's row and column statistics. -inf adds nothing; NaN poisons the state as in `merge`.
  CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE void absorb(float x) noexcept
  {
    if (x > max)
    {
      sum = (max == -detail::infinity_f ? 0.0f : sum * detail::exp_approx(max - x)) + 1.0f;
      max = x;
    }
    else if (x != x)
    {
      max = x;
      sum = x;
    }
    else if (x != -detail::infinity_f)
    {
      sum += detail::exp_approx(x - max);
    }
  }

  /// Moves the state to `new_max` (>= max, finite or -inf for an empty block): sum *= exp(max - new_max). A block of
  /// values is absorbed as `rebase(max(max, block_max)); sum += sum_j exp(x_j - max)`; host and device tiles use this
  /// one update. An empty state (and an empty block) keeps sum = 0.
  CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE void rebase(float new_max) noexcept
  {
    if (new_max == -detail::infinity_f)
    {
      sum = 0.0f;
    }
    else if (max != -detail::infinity_f)
    {
      sum *= detail::exp_approx(max - new_max);
    }
    max = new_max;
  }

  /// The shift a block's exponentials use after `rebase`: the max, or 0 for an empty state (whose values are all
  /// -inf and contribute exp(-inf) = 0).
  CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE float shift() const noexcept
  {
    return max == -detail::infinity_f ? 0.0f : max;
  }

  /// log(sum exp(x)); -inf when empty.
  CONTRASTIVE_HOST_DEVICE float value() const noexcept
  {
    return max == -detail::infinity_f ? max : max + ::logf(sum);
  }
};

/// Log-sum-exp and cross-entropy of one row from its negatives' state and its positive logit.
struct row_loss
{
  float lse;  ///< log sum_j exp(S_j), the positive included
  float loss; ///< lse - S_p, computed without cancellation
  /// lse as shift + log_sum, both exact inputs of a softmax: shift is the row's largest logit (a logit value, so
  /// S_j - shift is exact when S_j is within a factor 2 of it) and log_sum = log sum_j exp(S_j - shift) is small
  /// (<= log n). P_j = exp((S_j - shift) - log_sum) then carries a few float eps of error, where exp(S_j - lse)
  /// carries lse's own rounding, about eps |lse| absolute: ~100 eps at logits of 100 (open_clip's clamp).
  float shift;
  float log_sum;
};

CONTRASTIVE_HOST_DEVICE inline row_loss finish_row(online_lse negatives, float positive) noexcept
{
  if (positive != positive || negatives.max != negatives.max)
  {
    const float nan = positive + negatives.max + detail::infinity_f * 0.0f;
    return {nan, nan, nan, nan};
  }
  if (negatives.max == -detail::infinity_f) // only the positive: loss 0
  {
    return {positive, 0.0f, positive, 0.0f};
  }
  if (positive >= negatives.max)
  {
    // rest = sum_{j != p} exp(S_j - S_p) <= number of negatives; the loss is log1p(rest) exactly.
    const float rest = negatives.sum * detail::exp_approx(negatives.max - positive);
    const float l = ::log1pf(rest);
    return {positive + l, l, positive, l};
  }
  // The positive is not the largest logit, so the loss is at least log 2 and the plain difference keeps its digits.
  const float m = negatives.max;
  const float log_sum = ::logf(negatives.sum + detail::exp_approx(positive - m));
  const float lse = m + log_sum;
  return {lse, lse - positive, m, log_sum};
}
} // namespace contrastive
