// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `temperature::range_guard`: a learnable temperature that keeps its logits inside the element type's range and backs
/// off when the loss scaler is in distress, with no hand-picked bound or unfreeze step.
///
/// Why: with L2-normalised features |<q, k>| <= 1, so every logit satisfies |S_ij| <= s = 1/tau. A learnable tau keeps
/// falling once the training batches are separated (lowering tau is the cheapest way to lower the loss), and in fp16
/// the logits overflow once s > 65504 (theta = log s > 11.09). From then on every step is non-finite whatever the loss
/// scale, every step is skipped, a skipped step freezes theta, and the dynamic scaler halves its scale each step until
/// it underflows to 0: the fp16 temperature collapse. Frameworks freeze *all* parameters on a skipped step, including
/// the one that caused the overflow.
///
/// The rule, applied in `observe` after every finished step (skipped ones included):
///   1. range bound: theta <= log(max_finite / headroom), from the element type's largest finite value (fp16 with the
///      default headroom 16: s <= 4094, tau >= 2.44e-4; bfloat16 and float: no practical bound);
///   2. retreat: a skipped step whose first non-finite value is a logit or the loss, or whose back-off left the loss
///      scale below `scale_floor` (the unscaled gradients themselves no longer fit the type), lowers the ceiling to
///      theta - retreat and moves theta there, and drops the optimiser's first moment (it points the way that
///      overflowed). The ceiling never rises again: it is learnt from the run's own overflow events.
/// Between those events theta is learnt exactly as `learnable` with the given optimiser (and never below
/// log(1/tau_max)).
///
/// What it does not do: rule 1 assumes |<q, k>| <= 1 (normalised features); without that, rule 2 still catches an
/// overflow, one skipped step late. It cannot give the loss a sharper softmax than the type can hold (the fused
/// algorithm, whose logits stay in float, can). It does not touch overflows elsewhere in a model unless they drive the
/// scale below `scale_floor`.

#include <contrastive/detail/config.hpp>
#include <contrastive/policy/optimizer.hpp>
#include <contrastive/policy/temperature.hpp>
#include <contrastive/problem.hpp>

#include <cmath>
#include <cstdint>

namespace contrastive
{
namespace temperature
{
/// Learnable temperature bounded by the element type's range and the scaler's back-offs (see the file comment).
/// State: that of `learnable` (theta, optimiser, steps) plus `min_theta` (the fixed floor from tau_max), `ceiling`
/// (the current, learnt upper bound on theta) and `events`.
struct range_guard : learnable
{
  static constexpr const char* name = "range_guard"; ///< the policy's name, for messages

  float headroom = 16.0f;   ///< keep s <= max_finite / headroom (room for the backward's loss_scale * s * G)
  float retreat = 0.5f;     ///< theta retreat on an overflow event, in natural-log units (s shrinks by e^-0.5)
  float scale_floor = 1.0f; ///< a back-off that leaves the loss scale below this is an overflow event
  float min_theta = 0.0f;   ///< log(1/tau_max): theta never goes below it (tau <= tau_max)
  float ceiling = __builtin_huge_valf(); ///< theta's upper bound now: the range bound, lowered by each retreat
  std::int32_t events = 0;               ///< overflow events seen (each one retreated; saturates at INT32_MAX)

  range_guard() noexcept : range_guard(0.07f) {}

  /// `tau_max` bounds tau from above as in `clamped` (open_clip keeps tau <= 1); there is no user lower bound: it
  /// comes from the element type.
  explicit range_guard(float initial_tau,
                       contrastive::optimizer o = contrastive::optimizer::adam(1e-3f),
                       float headroom_factor = 16.0f,
                       float retreat_step = 0.5f,
                       float loss_scale_floor = 1.0f,
                       float tau_max = 1.0f) noexcept
      : learnable(initial_tau, o), headroom(headroom_factor), retreat(retreat_step), scale_floor(loss_scale_floor),
        min_theta(tau_max == __builtin_huge_valf() ? -__builtin_huge_valf() : logit_scale_of(tau_max))
  {
  }

  /// theta bound from the element type's range: log(max_finite / headroom).
  CONTRASTIVE_HOST_DEVICE float range_bound(float element_max_finite) const noexcept
  {
    return static_cast<float>(::log(static_cast<double>(element_max_finite) / static_cast<double>(headroom)));
  }

  /// theta kept in [min_theta, ceiling].
  CONTRASTIVE_HOST_DEVICE float clamp(float t) const noexcept
  {
    return t < min_theta ? min_theta : (t > ceiling ? ceiling : t);
  }
  /// learnable's optimiser step, then theta kept in [min_theta, ceiling].
  CONTRASTIVE_HOST_DEVICE void advance(float grad_theta) noexcept
  {
    learnable::advance(grad_theta);
    theta = clamp(theta);
  }

  /// Called after every finished step, skipped ones included: applies the range bound for `element_max_finite` and,
  /// when `rec` is an overflow event, the retreat (see the file comment); theta ends in [min_theta, ceiling].
  CONTRASTIVE_HOST_DEVICE void observe(const step_record& rec, float element_max_finite) noexcept
  {
    lower_ceiling(range_bound(element_max_finite));
    const bool range_site =
        rec.first_nonfinite == nonfinite_site::logits || rec.first_nonfinite == nonfinite_site::loss;
    const bool backed_off = rec.next_loss_scale < rec.loss_scale;
    const bool scale_distress = backed_off && rec.next_loss_scale < scale_floor;
    if (rec.skipped && (range_site || scale_distress))
    {
      lower_ceiling(theta - retreat);
      opt_state.m = 0.0;
      events = detail::saturating_increment(events);
    }
    theta = clamp(theta);
  }

  /// Besides learnable's checks: headroom, retreat, scale_floor, events, the tau_max bound and the ceiling are each in
  /// their domain.
  CONTRASTIVE_HOST_DEVICE const char* validate() const noexcept
  {
    if (!(headroom >= 1.0f && headroom < 3.0e38f))
    {
      return "headroom must be finite and >= 1";
    }
    if (!(retreat > 0.0f && retreat < 80.0f))
    {
      return "retreat must be in (0, 80)";
    }
    if (!(scale_floor >= 0.0f && scale_floor < 3.0e38f))
    {
      return "scale_floor must be finite and >= 0";
    }
    if (events < 0)
    {
      return "events must be >= 0";
    }
    if (!valid_theta_bound(min_theta, -__builtin_huge_valf()))
    {
      return "tau_max must be a tau with |log(1/tau)| <= 80, or inf for no bound";
    }
    if (!(min_theta <= ceiling) || !(ceiling >= -theta_limit))
    {
      return "the ceiling must not be below log(1/tau_max) nor below -80";
    }
    return learnable::validate();
  }

private:
  /// The ceiling only ever comes down, and never below min_theta nor below the domain's edge (with tau_max = inf,
  /// retreats would otherwise take it, and theta, below -theta_limit).
  CONTRASTIVE_HOST_DEVICE void lower_ceiling(float bound) noexcept
  {
    const float floor = min_theta > -theta_limit ? min_theta : -theta_limit;
    if (bound < ceiling)
    {
      ceiling = bound < floor ? floor : bound;
    }
  }
};
static_assert(sizeof(range_guard) == sizeof(learnable) + 5 * sizeof(float) + sizeof(std::int32_t),
              "range_guard must have no padding");
} // namespace temperature
} // namespace contrastive
