// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What a training step reports: the record of one step and the site of its first non-finite value.

#include <cstdint>

namespace contrastive
{
/// Where a step's first non-finite value appeared, in the order the step computes them.
enum class nonfinite_site : std::int32_t
{
  none = 0,
  logits,           ///< a logit S_ij (materialized: its element-type value) is +-inf or NaN
  loss,             ///< the loss value
  grad_q,           ///< dQ after scaling and rounding to the element type
  grad_k,           ///< dK after scaling and rounding to the element type
  grad_logit_scale, ///< d(loss)/d(log s), only when the temperature policy uses it
  parameters,       ///< a caller-supplied gradient passed to `unscale_and_check`
  grad_logit_bias,  ///< d(loss)/d b, the sigmoid objective's logit bias, only when it is learnable
};

/// Short name of a non-finite site, as its enumerator is spelled; "unknown" for a value outside the enumeration.
inline const char* to_string(nonfinite_site s) noexcept
{
  switch (s)
  {
  case nonfinite_site::none:
    return "none";
  case nonfinite_site::logits:
    return "logits";
  case nonfinite_site::loss:
    return "loss";
  case nonfinite_site::grad_q:
    return "grad_q";
  case nonfinite_site::grad_k:
    return "grad_k";
  case nonfinite_site::grad_logit_scale:
    return "grad_logit_scale";
  case nonfinite_site::parameters:
    return "parameters";
  case nonfinite_site::grad_logit_bias:
    return "grad_logit_bias";
  }
  return "unknown";
}

/// Outcome of one training step.
struct step_record
{
  std::int64_t step = 0;         ///< index of this step (counts every call, skipped or not)
  float loss = 0.0f;             ///< unscaled loss
  float tau = 0.0f;              ///< temperature used by this step
  float loss_scale = 0.0f;       ///< loss scale used by this step's backward
  float next_loss_scale = 0.0f;  ///< loss scale after the scaler's update
  float grad_logit_scale = 0.0f; ///< unscaled d(loss)/d(log s)
  float max_logit = 0.0f;        ///< largest logit S_ij of the step (materialized: its element-type value; sigmoid:
                                 ///< of z = S + b)
  bool skipped = false;          ///< a non-finite value was found: the temperature (and a learnable bias) did not move
  /// Where the step's first non-finite value appeared (none: the step was finite); after `finish_step` over ranks,
  /// the earliest site over all ranks.
  nonfinite_site first_nonfinite = nonfinite_site::none;
  bool pending = false;         ///< forward/backward done, `finish_step` not yet called
  float grad_logit_bias = 0.0f; ///< unscaled d(loss)/d b (sigmoid objective; 0 otherwise)
  float logit_bias = 0.0f;      ///< the logit bias used by this step (sigmoid objective; 0 otherwise)
};
} // namespace contrastive
