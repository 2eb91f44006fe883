// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The demo's output: the side-by-side table (stdout) and the per-step CSVs with their index (for
/// scripts/plot_demo.gp).

#include "collapse/train.hpp"

#include <string>
#include <vector>

namespace collapse_demo
{
/// `fmt` applied to x, or nan / inf / -inf.
std::string format_number(float x, const char* fmt);

/// The side-by-side table, one line per run.
std::string format_table(const std::vector<run_result>& results);

/// Per-step CSV: step,loss,tau,loss_scale,skipped,accuracy,max_logit,first_nonfinite (accuracy empty between
/// evaluations). Returns false if the file cannot be written.
bool write_csv(const std::string& path, const run_result& r);

/// The runs' ids in the table's order, one a line (scripts/plot_demo.gp draws its panels in this order).
bool write_index(const std::string& path, const std::vector<run_result>& results);

/// Creates `dir` and its parents if missing; true when it is a directory afterwards.
bool make_dir(const std::string& dir);
} // namespace collapse_demo
