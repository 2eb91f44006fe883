// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The demo's command line: one table of options, each row {name, value placeholder, help, setter}, from which both
/// the parser and `--help` are made, so an option's name is written once.

#include "collapse/config.hpp"

#include <functional>
#include <string>
#include <vector>

namespace collapse_demo
{
/// Everything the command line sets.
struct cli_options
{
  settings s;
  std::vector<run_config> runs = default_runs();
  std::vector<std::string> types;    ///< keep only runs of these element types (to_string names); empty: all
  std::vector<std::string> policies; ///< keep only runs with these policies (to_string names); empty: all
  std::string out_dir = "out";
  bool write_csv = true;
  bool quiet = false;
  bool help = false;

  /// The runs that --types and --policies keep, in --runs order.
  std::vector<run_config> selected_runs() const;
};

/// One row of the option table. A row with an empty `name` is a heading of `--help` (its text in `help`).
struct option
{
  std::string name;                                          ///< "--steps"
  std::string value;                                         ///< "N", "X", "LIST", ...; empty for a flag
  std::string help;                                          ///< may hold '\n' for continuation lines
  std::function<void(cli_options&, const std::string&)> set; ///< throws std::invalid_argument with the reason
};

/// The table, in --help order; help texts quote the defaults of `settings`.
const std::vector<option>& option_table();

/// The --help text.
std::string help_text();

/// Parses argv[1..argc) into `out` (starting from its current values). On failure returns false and says why.
bool parse_args(int argc, const char* const* argv, cli_options& out, std::string& why);
} // namespace collapse_demo
