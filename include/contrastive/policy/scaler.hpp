// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Loss-scaler policies. `loss_scale()` is the factor the backward pass multiplies gradients by; `update(found_inf)`
/// runs once per step, after the unscale-and-check pass, skipped steps included (that is how the scale backs off).
///
/// `dynamic` implements one parameterised rule that covers the three frameworks' rules exactly (see its presets):
///
///   found_inf:  good = 0; bad += 1;
///               if bad == backoff_interval: scale = max(float(scale * backoff_factor), min_scale); bad = 0
///   otherwise:  bad = 0; good += 1;
///               if good == growth_interval: s = float(scale * growth_factor);
///                                           if refuse_nonfinite_growth and s is not finite: s = scale;
///                                           scale = min(s, max_scale); good = 0
///
/// Products are formed in double and rounded once to float (the scale is an fp32 value in every framework); with
/// float factors this equals the float product bit for bit, with PyTorch's double factors it is what PyTorch does.

#include <contrastive/detail/config.hpp>

#include <cstdint>
#include <type_traits>

namespace contrastive
{
namespace scaler
{
/// One constant loss scale; 1 disables scaling. State: the scale. `update` changes nothing.
struct static_scale
{
  static constexpr bool is_dynamic = false;     ///< the scale never changes
  static constexpr const char* name = "static"; ///< the policy's name, for messages

  float scale = 1.0f; ///< the loss scale; finite and > 0

  constexpr static_scale() = default;
  /// A constant scale `s` (checked by `validate`, not here).
  constexpr explicit static_scale(float s) noexcept : scale(s) {}

  /// The factor the backward pass multiplies gradients by: `scale`.
  CONTRASTIVE_HOST_DEVICE float loss_scale() const noexcept
  {
    return scale;
  }
  /// Called once per step; changes nothing.
  CONTRASTIVE_HOST_DEVICE void update(bool) noexcept {}
  /// Empty string when 0 < `scale` < 3e38 (below float's largest value, so that scaled values have room), else what is
  /// wrong.
  CONTRASTIVE_HOST_DEVICE const char* validate() const noexcept
  {
    return (scale > 0.0f && scale < 3.0e38f) ? "" : "loss scale must be > 0 and < 3e38";
  }
};

/// Dynamic loss scaling. State: scale, good (consecutive finite steps), bad (consecutive non-finite steps).
///
/// Accepted states (`validate`) are those the rule can be in: min_scale <= scale <= max_scale (a back-off never goes
/// below min_scale, a growth never above max_scale), with 0 < max_scale and a finite min_scale; scale = 0 only
/// without a floor (min_scale = 0: where 166 back-offs from 2^16 end, as in PyTorch) and scale = +inf only when
/// growth is unchecked (refuse_nonfinite_growth false, max_scale = inf: Paddle dygraph). Both are dead ends the
/// frameworks reach and keep (0 * growth = 0, inf * backoff = inf: every step is skipped), accepted so that such a
/// run resumes bit-exactly; start a run from a finite scale > 0.
struct dynamic
{
  static constexpr bool is_dynamic = true;       ///< the scale changes with `update`
  static constexpr const char* name = "dynamic"; ///< the policy's name, for messages

  float scale = 65536.0f;      ///< the current loss scale (fp32, as in every framework)
  std::uint32_t padding0 = 0;  ///< explicit padding, always 0: no implicit padding, so save() is byte-deterministic
  double growth_factor = 2.0;  ///< scale multiplier after growth_interval finite steps; > 1
  double backoff_factor = 0.5; ///< scale multiplier after backoff_interval non-finite steps; in (0, 1)
  std::int32_t growth_interval = 2000;     ///< consecutive finite steps per growth; >= 1
  std::int32_t backoff_interval = 1;       ///< consecutive non-finite steps per back-off; >= 1
  float min_scale = 0.0f;                  ///< floor after a back-off; 0 = none
  float max_scale = __builtin_huge_valf(); ///< cap after a growth; inf = none
  bool refuse_nonfinite_growth = true;     ///< a growth that would overflow float is refused
  std::uint8_t padding1[3] = {0, 0, 0};    ///< explicit padding, always 0
  std::int32_t good = 0;                   ///< consecutive finite steps since the last growth or non-finite step
  std::int32_t bad = 0;                    ///< consecutive non-finite steps since the last back-off or finite step
  std::uint32_t padding2 = 0;              ///< explicit padding, always 0

  /// `torch.amp.GradScaler()` defaults: 2^16, x2 every 2000 finite steps, x0.5 on every non-finite step, no floor,
  /// growth to inf refused (aten `_amp_update_scale_`).
  static constexpr dynamic torch() noexcept
  {
    return dynamic{};
  }

  /// Paddle dynamic graph, `paddle.amp.GradScaler()` defaults (python `AmpScaler._update`): 2^16, x2 every 2000
  /// finite steps, x0.5 after every 1 non-finite step; no floor and no finiteness check on growth.
  static constexpr dynamic paddle_dygraph(float init = 65536.0f,
                                          float incr_ratio = 2.0f,
                                          float decr_ratio = 0.5f,
                                          std::int32_t incr_every_n_steps = 2000,
                                          std::int32_t decr_every_n_nan_or_inf = 1) noexcept
  {
    return paddle(init, incr_ratio, decr_ratio, incr_every_n_steps, decr_every_n_nan_or_inf, 0.0f, false);
  }

  /// Paddle static graph, `update_loss_scaling` operator with `fluid.contrib.mixed_precision.decorate` defaults:
  /// 2^15, x2 every 1000 finite steps, x0.8 after 2 consecutive non-finite steps, floored at 1, growth to a
  /// non-finite value refused.
  static constexpr dynamic paddle_static(float init = 32768.0f,
                                         float incr_ratio = 2.0f,
                                         float decr_ratio = 0.8f,
                                         std::int32_t incr_every_n_steps = 1000,
                                         std::int32_t decr_every_n_nan_or_inf = 2) noexcept
  {
    return paddle(init, incr_ratio, decr_ratio, incr_every_n_steps, decr_every_n_nan_or_inf, 1.0f, true);
  }

  /// Paddle's rules under Paddle's names (both presets above).
  static constexpr dynamic paddle(float init,
                                  float incr_ratio,
                                  float decr_ratio,
                                  std::int32_t incr_every_n_steps,
                                  std::int32_t decr_every_n_nan_or_inf,
                                  float min_scale,
                                  bool refuse_nonfinite_growth) noexcept
  {
    dynamic d{};
    d.scale = init;
    d.growth_factor = incr_ratio;
    d.backoff_factor = decr_ratio;
    d.growth_interval = incr_every_n_steps;
    d.backoff_interval = decr_every_n_nan_or_inf;
    d.min_scale = min_scale;
    d.refuse_nonfinite_growth = refuse_nonfinite_growth;
    return d;
  }

  /// The factor the backward pass multiplies gradients by: `scale`.
  CONTRASTIVE_HOST_DEVICE float loss_scale() const noexcept
  {
    return scale;
  }

  /// One step of the rule in the file comment, once per step (skipped ones included): `found_inf` is the
  /// unscale-and-check pass's verdict.
  CONTRASTIVE_HOST_DEVICE void update(bool found_inf) noexcept
  {
    if (found_inf)
    {
      good = 0;
      bad += 1;
      if (bad == backoff_interval)
      {
        float s = static_cast<float>(static_cast<double>(scale) * backoff_factor);
        scale = s < min_scale ? min_scale : s;
        bad = 0;
      }
      return;
    }
    bad = 0;
    good += 1;
    if (good == growth_interval)
    {
      float s = static_cast<float>(static_cast<double>(scale) * growth_factor);
      const bool finite = s - s == 0.0f;
      if (refuse_nonfinite_growth && !finite)
      {
        s = scale;
      }
      scale = s > max_scale ? max_scale : s;
      good = 0;
    }
  }

  /// Zeroes the explicit padding (`save()` calls it on the copy it returns).
  CONTRASTIVE_HOST_DEVICE void clear_padding() noexcept
  {
    padding0 = 0;
    padding1[0] = padding1[1] = padding1[2] = 0;
    padding2 = 0;
  }

  /// Empty string when the settings and state are ones the rule accepts (see the struct comment), else what is wrong.
  CONTRASTIVE_HOST_DEVICE const char* validate() const noexcept
  {
    if (!(scale >= 0.0f))
    {
      return "scale must be >= 0 (not NaN)";
    }
    if (!(min_scale >= 0.0f && min_scale - min_scale == 0.0f))
    {
      return "min_scale must be finite and >= 0";
    }
    if (!(max_scale > 0.0f) || !(max_scale >= min_scale))
    {
      return "max_scale must be > 0 and >= min_scale";
    }
    // 0 (no floor) and +inf (unchecked growth, no cap) are states the rule reaches and must keep stepping from; a
    // state the rule cannot reach is refused (see the struct comment).
    if (scale < min_scale || scale > max_scale)
    {
      return "scale must be within [min_scale, max_scale]";
    }
    if (refuse_nonfinite_growth && !(scale - scale == 0.0f))
    {
      return "scale must be finite (refuse_nonfinite_growth: no step grows it to inf)";
    }
    // As torch.amp.GradScaler: growth must grow and back-off must shrink (a constant scale is static_scale).
    if (!(growth_factor > 1.0 && growth_factor < 1e30) || !(backoff_factor > 0.0 && backoff_factor < 1.0))
    {
      return "growth_factor must be > 1 and backoff_factor in (0, 1)";
    }
    if (growth_interval < 1 || backoff_interval < 1)
    {
      return "growth_interval and backoff_interval must be >= 1";
    }
    if (good < 0 || good >= growth_interval || bad < 0 || bad >= backoff_interval)
    {
      return "counters out of range for the intervals";
    }
    return "";
  }
};

static_assert(sizeof(dynamic) == 3 * sizeof(float) + 2 * sizeof(double) + 4 * sizeof(std::int32_t) + sizeof(bool) +
                                     3 * sizeof(std::uint8_t) + 2 * sizeof(std::uint32_t),
              "dynamic must have no padding");

/// A trivially copyable type with is_dynamic, loss_scale(), update(bool) and validate(); checked by the loss.
template <class P, class = void>
struct is_scaler_policy : std::false_type
{
};
template <class P>
struct is_scaler_policy<P,
                        std::void_t<decltype(P::is_dynamic),
                                    decltype(std::declval<const P&>().loss_scale()),
                                    decltype(std::declval<P&>().update(true)),
                                    decltype(std::declval<const P&>().validate())>>
    : std::bool_constant<std::is_trivially_copyable_v<P>>
{
};
/// Whether `P` is a scaler policy (`is_scaler_policy`).
template <class P>
inline constexpr bool is_scaler_policy_v = is_scaler_policy<P>::value;
} // namespace scaler
} // namespace contrastive
