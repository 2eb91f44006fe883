// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// CLIP's symmetric loss as a type: 0.5 * (mean_i CE(S_i., i) + mean_j CE(S_.j, j)), positives on the diagonal
/// (or, with group ids, the pairs of equal ids; numeric/groups.hpp).

#include <contrastive/objectives/softmax.hpp>
#include <contrastive/status.hpp>
#include <contrastive/tags.hpp>

#include <cstddef>
#include <string>

namespace contrastive
{
namespace objectives
{
/// CLIP's symmetric loss (objective::symmetric): the rows' and the columns' cross-entropies, averaged.
struct symmetric : softmax_objective<true>
{
  static constexpr objective code = objective::symmetric; ///< its value in problem<T>
  static constexpr const char* name = "symmetric";        ///< as to_string(code)
  static constexpr bool takes_labels = false;             ///< positives from the diagonal (or group ids) only

  /// Shape of a one-positive-per-row batch: square, no labels (group ids lift both; checks.hpp).
  static status check_shape(std::size_t n_q, std::size_t n_k, bool has_labels)
  {
    if (n_q != n_k)
    {
      return {errc::shape_mismatch,
              "n_k",
              "the symmetric loss needs n_q == n_k (got n_q = " + std::to_string(n_q) +
                  ", n_k = " + std::to_string(n_k) + "); towers of different sizes need group ids"};
    }
    if (has_labels)
    {
      return {errc::invalid_argument, "labels", "the symmetric loss takes its positives from the diagonal; pass null"};
    }
    return {};
  }
};
} // namespace objectives
} // namespace contrastive
