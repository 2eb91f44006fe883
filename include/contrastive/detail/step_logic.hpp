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
CONTRASTIVE_HOST_DEVICE inline bool finite(float x) noexcept
{
  return x - x == 0.0f;
}

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
