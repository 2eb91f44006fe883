// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The demo's training loop: one configuration (element type x temperature policy x algorithm) trained from the
/// seed's initial weights on the seed's data stream, with a record of every step and a summary of the run.

#include "collapse/config.hpp"

#include <contrastive/problem.hpp>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace collapse_demo
{
/// One training step, as written to the CSV.
struct step_row
{
  std::int64_t step = 0;
  float loss = 0.0f;
  float tau = 0.0f;
  float loss_scale = 0.0f;
  float max_logit = 0.0f;
  bool skipped = false;
  contrastive::nonfinite_site site = contrastive::nonfinite_site::none;
  float accuracy = std::numeric_limits<float>::quiet_NaN(); ///< held-out top-1, only on evaluation steps
  float bias = 0.0f;                                        ///< sigmoid: the logit bias of this step
};

struct run_result
{
  run_config config;
  std::vector<step_row> rows;
  float final_loss = 0.0f;     ///< loss of the last step (NaN if that step was skipped)
  float final_accuracy = 0.0f; ///< held-out top-1 (mean of a->b and b->a) after the last step
  float best_accuracy = 0.0f;
  float final_tau = 0.0f;
  float min_loss_scale = 0.0f;
  float final_loss_scale = 0.0f;
  std::int64_t skipped = 0;
  std::int64_t collapse_step = -1; ///< first step of the terminal run of >= collapse_window skipped steps
  std::int64_t first_nonfinite_step = -1;
  contrastive::nonfinite_site first_nonfinite_site = contrastive::nonfinite_site::none;
  contrastive::nonfinite_site collapse_site = contrastive::nonfinite_site::none; ///< the site at collapse_step
  std::int64_t guard_events = 0;                                                 ///< range_guard only
  bool sigmoid = false;                                                          ///< SigLIP's loss (--objective)
  float final_bias = 0.0f;                                                       ///< sigmoid: the logit bias
  /// sigmoid, materialized: the largest share (over the evaluation steps) of the batch's gradient mass sum |dL/dz|
  /// whose scaled value round_T(loss_scale dL/dz) is 0 in the element type (lost to underflow); NaN otherwise
  float lost_gradient = std::numeric_limits<float>::quiet_NaN();
  double seconds = 0.0;
  std::string error; ///< non-empty if the library refused a call

  bool collapsed() const
  {
    return collapse_step >= 0;
  }
};

/// Called every max(1, steps / 10) steps with (step, steps).
using progress_fn = std::function<void(std::int64_t, std::int64_t)>;

/// Trains one configuration from the seed's initial weights on the seed's data stream (the same for every run).
run_result train(const settings& s, const run_config& cfg, const progress_fn& progress = {});
} // namespace collapse_demo
