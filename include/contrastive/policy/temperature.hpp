// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Temperature policies: the *kind* is a compile-time choice, the values are runtime members.
///
/// Every policy stores theta = log(1/tau) (CLIP's `logit_scale`) and offers:
///   `scale()`            s = 1/tau used by this step's logits S_ij = s <q_i, k_j>;
///   `tau()`, `logit_scale()`;
///   `wants_gradient()`   whether this step's d(loss)/d(theta) is used (the loss skips no work for it: it is the
///                        O(N D) dot product <dQ, Q>);
///   `advance(g)`         called once per *finite* step with the unscaled gradient; updates theta and the step count;
///   `validate()`         empty string when the settings are in their domain, else what is wrong.
/// A skipped step never calls `advance`: theta, the optimiser state and the step count stay exactly as they were.
/// Policies are trivially copyable: copying one saves it, assigning a copy back restores it. They have no implicit
/// padding (where the ABI would put some, an explicit `padding` member, always 0, takes its place; `clear_padding()`
/// zeroes them), so `loss::save()` is byte-deterministic whatever memory a policy was built in.
/// Step counters saturate at INT64_MAX instead of overflowing.

#include <contrastive/detail/config.hpp>
#include <contrastive/policy/optimizer.hpp>
#include <contrastive/problem.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace contrastive
{
namespace temperature
{
/// theta = log(1/tau) computed in double and stored as float.
CONTRASTIVE_HOST_DEVICE inline float logit_scale_of(float tau) noexcept
{
  return static_cast<float>(-::log(static_cast<double>(tau)));
}

/// tau = exp(-theta), computed in double and rounded to float once (logit_scale_of's inverse).
CONTRASTIVE_HOST_DEVICE inline float tau_of(float theta) noexcept
{
  return static_cast<float>(::exp(-static_cast<double>(theta)));
}

/// The getters of a policy whose state is theta (learnable, clamped, schedule): logit_scale() = theta, scale() = s =
/// exp(theta) and tau() = exp(-theta), each computed in double and rounded to float once. An empty base: the policy's
/// bytes (its checkpoint) are its own members'.
template <class Policy>
struct theta_getters
{
  /// theta = log(1/tau), the policy's stored state.
  CONTRASTIVE_HOST_DEVICE float logit_scale() const noexcept
  {
    return static_cast<const Policy*>(this)->theta;
  }
  /// s = exp(theta) = 1/tau, the factor of this step's logits.
  CONTRASTIVE_HOST_DEVICE float scale() const noexcept
  {
    return static_cast<float>(::exp(static_cast<double>(logit_scale())));
  }
  /// tau = exp(-theta).
  CONTRASTIVE_HOST_DEVICE float tau() const noexcept
  {
    return tau_of(logit_scale());
  }
};

/// The domain of every temperature: |theta| = |log(1/tau)| <= theta_limit, i.e. tau in [1.8e-35, 5.5e34], where s =
/// 1/tau and tau are both normal floats. Every policy refuses a tau outside it, and a learnt theta is kept inside it.
inline constexpr float theta_limit = 80.0f;

/// Whether tau is a temperature every policy accepts (finite, > 0, log(1/tau) within +-theta_limit).
CONTRASTIVE_HOST_DEVICE inline bool valid_tau(float tau) noexcept
{
  if (!(tau > 0.0f && tau < 3.0e38f))
  {
    return false;
  }
  const float theta = logit_scale_of(tau);
  return theta >= -theta_limit && theta <= theta_limit;
}

/// Whether a learnt logit scale is inside the domain (NaN is not).
CONTRASTIVE_HOST_DEVICE inline bool valid_theta(float theta) noexcept
{
  return theta >= -theta_limit && theta <= theta_limit;
}

/// theta kept inside the domain (NaN is left as it is).
CONTRASTIVE_HOST_DEVICE inline float clamp_theta(float theta) noexcept
{
  return theta < -theta_limit ? -theta_limit : (theta > theta_limit ? theta_limit : theta);
}

/// Whether a clamp bound keeps every theta it clamps inside the domain: a theta inside it, or `none`, the infinity
/// that stands for no bound on that side (-inf for the lower bound, +inf for the upper one).
CONTRASTIVE_HOST_DEVICE inline bool valid_theta_bound(float bound, float none) noexcept
{
  return bound == none || valid_theta(bound);
}

/// tau never changes and no gradient is used. State: tau.
struct fixed
{
  static constexpr bool is_learnable = false;  ///< tau is never trained
  static constexpr const char* name = "fixed"; ///< the policy's name, for messages

  float tau_value = 0.07f; ///< the temperature tau, finite and > 0

  constexpr fixed() = default;
  /// A temperature that stays at `tau`.
  constexpr explicit fixed(float tau) noexcept : tau_value(tau) {}

  /// tau, as set.
  CONTRASTIVE_HOST_DEVICE float tau() const noexcept
  {
    return tau_value;
  }
  /// s = 1/tau, computed in double and rounded to float once.
  CONTRASTIVE_HOST_DEVICE float scale() const noexcept
  {
    return static_cast<float>(1.0 / static_cast<double>(tau_value));
  }
  /// theta = log(1/tau) (see `logit_scale_of`).
  CONTRASTIVE_HOST_DEVICE float logit_scale() const noexcept
  {
    return logit_scale_of(tau_value);
  }
  /// Always false: no step's d(loss)/d(theta) is used.
  CONTRASTIVE_HOST_DEVICE bool wants_gradient() const noexcept
  {
    return false;
  }
  /// Does nothing: tau never changes.
  CONTRASTIVE_HOST_DEVICE void advance(float) noexcept {}
  /// "" when tau is a temperature every policy accepts (see `valid_tau`), else what is wrong.
  CONTRASTIVE_HOST_DEVICE const char* validate() const noexcept
  {
    return valid_tau(tau_value) ? "" : "tau must be finite and > 0, with |log(1/tau)| <= 80";
  }
};

/// Trains theta = log(1/tau) with `optimizer` (CLIP's logit_scale; default init log(1/0.07), Adam lr 1e-3).
/// State: theta, the optimiser's moments and step count, and `steps` (finite steps applied).
struct learnable : theta_getters<learnable>
{
  static constexpr bool is_learnable = true;       ///< theta is trained from d(loss)/d(theta)
  static constexpr const char* name = "learnable"; ///< the policy's name, for messages

  float theta = 2.65926003693f; ///< log(1/0.07)
  /// Settings of the optimiser that trains theta (default Adam, lr 1e-3).
  contrastive::optimizer opt = contrastive::optimizer::adam(1e-3f);
  std::uint32_t padding = 0;   ///< explicit padding before opt_state, always 0 (see the file comment)
  optimizer_state opt_state{}; ///< the optimiser's moments and update count
  std::int64_t steps = 0;      ///< finite steps applied (saturates at INT64_MAX)

  constexpr learnable() = default;
  /// theta = log(1/initial_tau), trained by `o` (default Adam, lr 1e-3) from an empty optimiser state.
  CONTRASTIVE_HOST_DEVICE explicit learnable(float initial_tau,
                                             contrastive::optimizer o = contrastive::optimizer::adam(1e-3f)) noexcept
      : theta(logit_scale_of(initial_tau)), opt(o)
  {
  }

  /// Always true: every finite step's d(loss)/d(theta) trains theta.
  CONTRASTIVE_HOST_DEVICE bool wants_gradient() const noexcept
  {
    return true;
  }
  /// One optimiser step. The result never leaves the domain: an update that would (a huge learning rate, say)
  /// stops at +-theta_limit, so the policy stays usable instead of refusing every later call.
  CONTRASTIVE_HOST_DEVICE void advance(float grad_theta) noexcept
  {
    const float next = apply_update(opt, opt_state, theta, grad_theta);
    theta = next != next ? theta : clamp_theta(next);
    steps = detail::saturating_increment(steps);
  }
  /// Zeroes the explicit padding (`save()` calls it on the copy it returns).
  CONTRASTIVE_HOST_DEVICE void clear_padding() noexcept
  {
    padding = 0;
  }
  /// "" when theta, the optimiser's settings and state, and `steps` are each in their domain, else what is wrong.
  CONTRASTIVE_HOST_DEVICE const char* validate() const noexcept
  {
    if (!valid_theta(theta))
    {
      return "tau must be finite and > 0 (logit scale log(1/tau) outside [-80, 80])";
    }
    if (!opt.valid())
    {
      return "optimizer settings out of range (0 <= lr < 1e30, 0 <= betas/momentum < 1, 0 < eps < 1e30)";
    }
    if (!opt_state.valid())
    {
      return "optimizer state invalid (moments must be finite, the second moment and the step count >= 0)";
    }
    return steps >= 0 ? "" : "steps must be >= 0";
  }
};

/// Learnable, with theta kept in [log(1/tau_max), log(1/tau_min)] after every update and at construction
/// (open_clip's default: 0 <= theta <= ln 100, i.e. 0.01 <= tau <= 1).
struct clamped : learnable
{
  static constexpr const char* name = "clamped"; ///< the policy's name, for messages

  float min_theta = 0.0f;         ///< log(1/tau_max)
  float max_theta = 4.605170186f; ///< log(1/tau_min) = ln 100

  constexpr clamped() = default;
  /// theta = log(1/initial_tau) clamped to [log(1/tau_max), log(1/tau_min)], then trained by `o`.
  CONTRASTIVE_HOST_DEVICE clamped(float initial_tau,
                                  float tau_min,
                                  float tau_max,
                                  contrastive::optimizer o = contrastive::optimizer::adam(1e-3f)) noexcept
      : learnable(initial_tau, o), min_theta(logit_scale_of(tau_max)), max_theta(logit_scale_of(tau_min))
  {
    theta = clamp(theta);
  }

  /// `t` (a theta) kept in [min_theta, max_theta].
  CONTRASTIVE_HOST_DEVICE float clamp(float t) const noexcept
  {
    return t < min_theta ? min_theta : (t > max_theta ? max_theta : t);
  }
  /// The lower bound on tau, exp(-max_theta) (0 when there is none).
  CONTRASTIVE_HOST_DEVICE float tau_min() const noexcept
  {
    return tau_of(max_theta);
  }
  /// The upper bound on tau, exp(-min_theta) (inf when there is none).
  CONTRASTIVE_HOST_DEVICE float tau_max() const noexcept
  {
    return tau_of(min_theta);
  }
  /// learnable's optimiser step, then theta clamped to [min_theta, max_theta].
  CONTRASTIVE_HOST_DEVICE void advance(float grad_theta) noexcept
  {
    learnable::advance(grad_theta);
    theta = clamp(theta);
  }
  /// Besides learnable's checks: each bound is a tau inside the domain, or none (tau_min = 0: max_theta = +inf;
  /// tau_max = inf: min_theta = -inf), so that clamping can never move theta out of the domain; and theta within the
  /// bounds, where construction and every update keep it (a checkpoint or a hand-set theta outside them is refused,
  /// not run at a temperature the policy promises never to reach).
  CONTRASTIVE_HOST_DEVICE const char* validate() const noexcept
  {
    const char* why = validate_bounds();
    if (why[0] == '\0' && !(theta >= min_theta && theta <= max_theta))
    {
      return "tau outside [tau_min, tau_max] (clamped keeps it inside at construction and after every update)";
    }
    return why;
  }

protected:
  /// validate() but for theta within the bounds (freeze_then_learn's frozen start may lie outside them).
  CONTRASTIVE_HOST_DEVICE const char* validate_bounds() const noexcept
  {
    if (!(min_theta <= max_theta))
    {
      return "tau_min must be <= tau_max, both finite and > 0";
    }
    if (!valid_theta_bound(min_theta, -__builtin_huge_valf()) || !valid_theta_bound(max_theta, __builtin_huge_valf()))
    {
      return "tau_min and tau_max must each be a tau with |log(1/tau)| <= 80 (tau_min = 0, tau_max = inf: no bound)";
    }
    return learnable::validate();
  }
};

/// Learnable after a frozen start (the usual warm-up remedy): tau fixed at its initial value for `unfreeze_step`
/// finite steps, then learnt like `clamped`, within [tau_min, tau_max] (unbounded by default). `steps` counts finite
/// steps, so skipped steps do not bring the unfreezing closer. The optimiser's state starts at the unfreezing.
struct freeze_then_learn : clamped
{
  static constexpr const char* name = "freeze_then_learn"; ///< the policy's name, for messages

  std::int64_t unfreeze_step = 1000; ///< finite steps at the initial tau before it becomes learnable

  CONTRASTIVE_HOST_DEVICE freeze_then_learn() noexcept : freeze_then_learn(0.05f, 1000) {}

  /// `tau` for `unfreeze_step` finite steps, then learnt with `o`, clamped to [tau_min, tau_max] (the defaults, 0 and
  /// infinity, clamp nothing). The initial tau is not clamped: it is what the frozen phase uses.
  CONTRASTIVE_HOST_DEVICE freeze_then_learn(float tau,
                                            std::int64_t unfreeze,
                                            contrastive::optimizer o = contrastive::optimizer::adam(1e-3f),
                                            float tau_min = 0.0f,
                                            float tau_max = __builtin_huge_valf()) noexcept
      : clamped(tau, tau_min, tau_max, o), unfreeze_step(unfreeze)
  {
    min_theta = tau_max == __builtin_huge_valf() ? -__builtin_huge_valf() : logit_scale_of(tau_max);
    max_theta = tau_min == 0.0f ? __builtin_huge_valf() : logit_scale_of(tau_min);
    theta = logit_scale_of(tau);
  }

  /// Whether the frozen phase is over (`steps` >= `unfreeze_step`).
  CONTRASTIVE_HOST_DEVICE bool wants_gradient() const noexcept
  {
    return steps >= unfreeze_step;
  }

  /// In the frozen phase only counts the step; after it, the optimiser step of `clamped`.
  CONTRASTIVE_HOST_DEVICE void advance(float grad_theta) noexcept
  {
    if (wants_gradient())
    {
      clamped::advance(grad_theta);
      return;
    }
    steps = detail::saturating_increment(steps);
  }

  /// Besides clamped's checks of the bounds: `unfreeze_step` >= 0. theta may lie outside the bounds (the initial tau
  /// is not clamped; the first update after the frozen phase brings it inside).
  CONTRASTIVE_HOST_DEVICE const char* validate() const noexcept
  {
    if (unfreeze_step < 0)
    {
      return "unfreeze_step must be >= 0";
    }
    return validate_bounds();
  }
};

/// The former name of `freeze_then_learn`, kept for source compatibility: `scheduled::freeze_then_learn(...)` builds
/// one. For a temperature that follows a schedule with no gradient, see `schedule`.
struct scheduled : temperature::freeze_then_learn
{
  static constexpr const char* name = "scheduled"; ///< the policy's name, for messages

  scheduled() = default;
  /// The policy `f`, under the former name.
  CONTRASTIVE_HOST_DEVICE explicit scheduled(const temperature::freeze_then_learn& f) noexcept
      : temperature::freeze_then_learn(f)
  {
  }

  /// `temperature::freeze_then_learn(tau, unfreeze_step, o, tau_min, tau_max)`, as a `scheduled`.
  CONTRASTIVE_HOST_DEVICE static scheduled
  freeze_then_learn(float tau,
                    std::int64_t unfreeze_step,
                    contrastive::optimizer o = contrastive::optimizer::adam(1e-3f),
                    float tau_min = 0.0f,
                    float tau_max = __builtin_huge_valf()) noexcept
  {
    return scheduled(temperature::freeze_then_learn(tau, unfreeze_step, o, tau_min, tau_max));
  }
};

/// The shape of a `schedule`: how tau goes from tau_start to tau_end.
enum class schedule_kind : std::int32_t
{
  linear = 1, ///< tau moves linearly from tau_start to tau_end over `duration` steps, then stays
  cosine = 2, ///< tau follows half a cosine from tau_start to tau_end over `duration` steps, then stays
};

/// tau follows a schedule of the finite step count; no gradient is used and there is no optimiser state.
/// State: theta (of the current tau) and `steps` (finite steps applied; skipped steps do not advance the schedule).
struct schedule : theta_getters<schedule>
{
  static constexpr bool is_learnable = false;     ///< tau follows the step count; no gradient trains it
  static constexpr const char* name = "schedule"; ///< the policy's name, for messages

  schedule_kind kind = schedule_kind::cosine; ///< the schedule's shape
  float tau_start = 0.07f;                    ///< tau at step 0, a temperature every policy accepts
  float tau_end = 0.07f;                      ///< tau from step `duration` on, a temperature every policy accepts
  std::uint32_t padding0 = 0;                 ///< explicit padding before duration, always 0 (see the file comment)
  std::int64_t duration = 1000;               ///< finite steps from tau_start to tau_end, >= 0
  float theta = 2.65926003693f;               ///< log(1/tau) now: log(1/tau_start) at step 0
  std::uint32_t padding1 = 0;                 ///< explicit padding before steps, always 0
  std::int64_t steps = 0;                     ///< finite steps applied (saturates at INT64_MAX)

  constexpr schedule() = default;
  /// tau from `tau_start` to `tau_end` over `duration` finite steps, then `tau_end`.
  CONTRASTIVE_HOST_DEVICE schedule(schedule_kind k, float t_start, float t_end, std::int64_t steps_to_end) noexcept
      : kind(k), tau_start(t_start), tau_end(t_end), duration(steps_to_end),
        theta(logit_scale_of(steps_to_end > 0 ? t_start : t_end)) // tau_at(0): tau_end at once for duration 0
  {
  }

  /// Always false: tau depends on the step count only.
  CONTRASTIVE_HOST_DEVICE bool wants_gradient() const noexcept
  {
    return false;
  }
  /// The next step's theta. tau_at stays between tau_start and tau_end, both inside the domain; the clamp only
  /// guards against a log that rounds differently from the one `validate` used (the device's, say).
  CONTRASTIVE_HOST_DEVICE void advance(float) noexcept
  {
    steps = detail::saturating_increment(steps);
    theta = clamp_theta(logit_scale_of(tau_at(steps)));
  }
  /// Zeroes both explicit padding members (`save()` calls it on the copy it returns).
  CONTRASTIVE_HOST_DEVICE void clear_padding() noexcept
  {
    padding0 = 0;
    padding1 = 0;
  }

  /// tau after `step` finite steps: tau_start (1 - f) + tau_end f with f in [0, 1], a weighted mean of two positive
  /// values, so it stays between them (tau_start + (tau_end - tau_start) f cancels to 0 when tau_end << tau_start)
  /// and is exactly tau_end from `duration` on.
  CONTRASTIVE_HOST_DEVICE float tau_at(std::int64_t step) const noexcept
  {
    if (duration <= 0 || step >= duration)
    {
      return tau_end;
    }
    const double x = static_cast<double>(step) / static_cast<double>(duration);
    const double f = kind == schedule_kind::linear ? x : 0.5 * (1.0 - ::cos(3.14159265358979323846 * x));
    return static_cast<float>(static_cast<double>(tau_start) * (1.0 - f) + static_cast<double>(tau_end) * f);
  }

  /// "" when both taus, `kind`, `duration`, `steps` and theta are each in their domain, else what is wrong.
  CONTRASTIVE_HOST_DEVICE const char* validate() const noexcept
  {
    if (!valid_tau(tau_start) || !valid_tau(tau_end))
    {
      return "tau_start and tau_end must be finite and > 0, with |log(1/tau)| <= 80";
    }
    if (kind != schedule_kind::linear && kind != schedule_kind::cosine)
    {
      return "unknown schedule kind";
    }
    if (duration < 0 || steps < 0)
    {
      return "duration and steps must be >= 0";
    }
    return valid_theta(theta) ? "" : "tau must be finite and > 0 (logit scale log(1/tau) outside [-80, 80])";
  }
};

// No implicit padding in any policy (a member added where the ABI pads needs an explicit padding member next to it).
static_assert(sizeof(fixed) == sizeof(float), "fixed must have no padding");
static_assert(sizeof(learnable) == sizeof(float) + sizeof(contrastive::optimizer) + sizeof(std::uint32_t) +
                                       sizeof(optimizer_state) + sizeof(std::int64_t),
              "learnable must have no padding");
static_assert(sizeof(clamped) == sizeof(learnable) + 2 * sizeof(float), "clamped must have no padding");
static_assert(sizeof(freeze_then_learn) == sizeof(clamped) + sizeof(std::int64_t),
              "freeze_then_learn must have no padding");
static_assert(sizeof(scheduled) == sizeof(freeze_then_learn), "scheduled must have no padding");
static_assert(sizeof(schedule) ==
                  sizeof(schedule_kind) + 3 * sizeof(float) + 2 * sizeof(std::uint32_t) + 2 * sizeof(std::int64_t),
              "schedule must have no padding");

/// Requirements of a temperature policy, checked once by the owning template.
template <class P, class = void>
struct is_temperature_policy : std::false_type
{
};
template <class P>
struct is_temperature_policy<P,
                             std::void_t<decltype(P::is_learnable),
                                         decltype(std::declval<const P&>().scale()),
                                         decltype(std::declval<const P&>().tau()),
                                         decltype(std::declval<const P&>().wants_gradient()),
                                         decltype(std::declval<P&>().advance(0.0f)),
                                         decltype(std::declval<const P&>().validate())>>
    : std::bool_constant<std::is_trivially_copyable_v<P>>
{
};
/// Whether `P` meets the requirements of a temperature policy (see `is_temperature_policy`).
template <class P>
inline constexpr bool is_temperature_policy_v = is_temperature_policy<P>::value;

/// Whether a policy trains theta with a `contrastive::optimizer` member `opt` (learnable and every policy built on it),
/// whose settings `loss::set_temperature_optimizer` may change.
template <class P, class = void>
struct has_optimizer : std::false_type
{
};
template <class P>
struct has_optimizer<P, std::void_t<decltype(std::declval<P&>().opt = std::declval<const contrastive::optimizer&>())>>
    : std::true_type
{
};
/// Whether `P` trains theta with an `opt` member (see `has_optimizer`).
template <class P>
inline constexpr bool has_optimizer_v = has_optimizer<P>::value;

/// Optional hook `void observe(const step_record&, float element_max_finite)`, called after every finished step.
template <class P, class = void>
struct has_observe : std::false_type
{
};
template <class P>
struct has_observe<P, std::void_t<decltype(std::declval<P&>().observe(std::declval<const step_record&>(), 0.0f))>>
    : std::true_type
{
};
/// Whether `P` has the optional `observe` hook (see `has_observe`).
template <class P>
inline constexpr bool has_observe_v = has_observe<P>::value;
} // namespace temperature
} // namespace contrastive
