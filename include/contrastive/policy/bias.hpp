// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The logit bias b of the sigmoid objective (z = s <q, k> + b, objective::sigmoid): fixed, or learnable with its own
/// scalar optimiser, as SigLIP learns it (initialised at -10 in the paper and in open_clip, with t = s = 10; the bias
/// keeps the initial loss small when almost every pair is a negative). The softmax objectives are invariant to a
/// bias and refuse a nonzero or learnable one. A setting of `loss::set_logit_bias`, saved in its checkpoint.

#include <contrastive/detail/config.hpp>
#include <contrastive/policy/optimizer.hpp>

#include <cstdint>

namespace contrastive
{
/// The logit bias b, fixed or learnable, with the optimiser that trains it; trivially copyable, saved byte for byte.
struct logit_bias
{
  float value = 0.0f;       ///< b, added to every logit; finite
  std::int32_t trained = 0; ///< 1: `advance` applies the optimiser to the bias's gradient; 0: fixed
  optimizer opt{};          ///< settings of the optimiser that trains b (used only when `trained` is 1)
  optimizer_state state{};  ///< that optimiser's moments and update count

  /// A bias that stays at `b`.
  static constexpr logit_bias fixed(float b) noexcept
  {
    return logit_bias{b, 0, optimizer{}, optimizer_state{}};
  }
  /// A bias trained from `b` by `o` (default Adam, lr 1e-3).
  static constexpr logit_bias learnable(float b, optimizer o = optimizer::adam()) noexcept
  {
    return logit_bias{b, 1, o, optimizer_state{}};
  }
  /// Whether `advance` trains the bias (`trained` is nonzero).
  CONTRASTIVE_HOST_DEVICE bool is_learnable() const noexcept
  {
    return trained != 0;
  }

  /// "" when every setting is in its domain, else why not.
  const char* validate() const noexcept
  {
    if (!(value - value == 0.0f))
    {
      return "the logit bias is not finite";
    }
    if (trained != 0 && trained != 1)
    {
      return "trained must be 0 or 1";
    }
    if (!opt.valid())
    {
      return "bias optimizer settings out of range (0 <= lr < 1e30, 0 <= betas/momentum < 1, 0 < eps < 1e30)";
    }
    if (!state.valid())
    {
      return "bias optimizer state is not one a run could reach";
    }
    return "";
  }

  /// One optimiser step on d(loss)/d b, for a learnable bias (a finite step only: the caller skips otherwise). Host and
  /// device (the device loss's finish_step). The bias stays finite, as the temperature stays in its domain: an update
  /// past float's range (a huge gradient or learning rate) stops at +-FLT_MAX, and one that is not a number leaves the
  /// bias where it was, so the policy stays usable instead of refusing every later call (and its checkpoint).
  CONTRASTIVE_HOST_DEVICE void advance(float grad) noexcept
  {
    if (trained != 0)
    {
      constexpr float largest = 3.40282347e38f; // FLT_MAX
      const float next = apply_update(opt, state, value, grad);
      value = next != next ? value : (next > largest ? largest : (next < -largest ? -largest : next));
    }
  }
};
static_assert(sizeof(logit_bias) == 2 * sizeof(float) + sizeof(optimizer) + sizeof(optimizer_state),
              "logit_bias must have no padding (it is saved byte for byte in a checkpoint)");
} // namespace contrastive
