// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The order of a training step's decisions, shared by the host `loss` and the device step kernel so that both
/// diagnose and update identically.

#include <contrastive/detail/config.hpp>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/policy/temperature.hpp>
#include <contrastive/problem.hpp>

#include <cstdint>

namespace contrastive
{
namespace detail
{
/// The first non-finite value, in the order the step produces them: logits, loss, dQ, dK, then d loss / d log s
/// (only when the temperature policy uses it this step).
CONTRASTIVE_HOST_DEVICE inline nonfinite_site
first_nonfinite(bool logits_bad, float loss, bool dq_bad, bool dk_bad, bool wants_gradient, float grad) noexcept
{
  if (logits_bad)
  {
    return nonfinite_site::logits;
  }
  if (!finite(loss))
  {
    return nonfinite_site::loss;
  }
  if (dq_bad)
  {
    return nonfinite_site::grad_q;
  }
  if (dk_bad)
  {
    return nonfinite_site::grad_k;
  }
  if (wants_gradient && !finite(grad))
  {
    return nonfinite_site::grad_logit_scale;
  }
  return nonfinite_site::none;
}

/// What the forward and backward passes report, from which `make_record` fills a pending step record.
struct pass_outcome
{
  float loss;
  float max_logit;
  float grad_logit_scale_scaled; ///< d(loss_scale * loss)/d(log s)
  bool logits_bad;
  bool dq_bad;
  bool dk_bad;
  float grad_logit_bias_scaled = 0.0f; ///< d(loss_scale * loss)/d b (sigmoid objective)
};

/// The pending record of steps 1-3 (host `loss::forward_backward` and the device's finish kernel).
CONTRASTIVE_HOST_DEVICE inline step_record
make_record(std::int64_t step, float tau, float loss_scale, bool wants_gradient, const pass_outcome& o) noexcept
{
  step_record rec{};
  rec.step = step;
  rec.loss = o.loss;
  rec.tau = tau;
  rec.loss_scale = loss_scale;
  rec.grad_logit_scale = o.grad_logit_scale_scaled / loss_scale;
  rec.grad_logit_bias = o.grad_logit_bias_scaled / loss_scale;
  rec.max_logit = o.max_logit;
  rec.pending = true;
  // A loss scale of 0 (where a dynamic scaler without a floor ends) or +inf (unchecked growth) leaves no unscaled
  // gradient: dQ / 0 is 0/0 whatever the policies, as PyTorch's unscale (x 1/0) finds. Such a step is non-finite at
  // dQ for every temperature policy, not only for those whose d loss / d log s (0/0) shows it.
  const bool no_unscaled_gradient = !(loss_scale > 0.0f) || !finite(loss_scale);
  rec.first_nonfinite = first_nonfinite(
      o.logits_bad, o.loss, o.dq_bad || no_unscaled_gradient, o.dk_bad, wants_gradient, rec.grad_logit_scale);
  return rec;
}

/// The factor `unscale_and_check` multiplies caller gradients by: 1 / loss_scale rounded once to float.
CONTRASTIVE_HOST_DEVICE inline float unscale_factor(float loss_scale) noexcept
{
  return static_cast<float>(1.0 / static_cast<double>(loss_scale));
}

/// Scaler update; temperature update only for a finite step; then the temperature's optional observe hook.
template <class Element, class Temperature, class Scaler>
CONTRASTIVE_HOST_DEVICE void finish_step(Temperature& temperature, Scaler& scaler, step_record& rec) noexcept
{
  const bool found_inf = rec.first_nonfinite != nonfinite_site::none;
  scaler.update(found_inf);
  if (!found_inf)
  {
    temperature.advance(rec.grad_logit_scale);
  }
  rec.skipped = found_inf;
  rec.next_loss_scale = scaler.loss_scale();
  if constexpr (temperature::has_observe_v<Temperature>)
  {
    temperature.observe(rec, element_traits<Element>::max_finite());
  }
  rec.pending = false;
}
} // namespace detail
} // namespace contrastive
