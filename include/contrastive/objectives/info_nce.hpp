// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// One-directional InfoNCE as a type: mean_i CE(S_i., p_i), p_i = labels[i] (default i); n_k may exceed n_q (a MoCo
/// queue). With group ids: each row's cross-entropy against the uniform distribution over its positives.

#include <contrastive/objectives/softmax.hpp>
#include <contrastive/status.hpp>
#include <contrastive/tags.hpp>

#include <cstddef>

namespace contrastive
{
namespace objectives
{
/// One-directional InfoNCE (objective::info_nce): the rows' cross-entropies only.
struct info_nce : softmax_objective<false>
{
  static constexpr objective code = objective::info_nce; ///< its value in problem<T>
  static constexpr const char* name = "info_nce";        ///< as to_string(code)
  static constexpr bool takes_labels = true;             ///< one label per row, null meaning the diagonal

  /// Null labels mean the diagonal, which needs n_q <= n_k (shape_mismatch "labels").
  static status check_shape(std::size_t n_q, std::size_t n_k, bool has_labels)
  {
    return check_labelled_shape(n_q, n_k, has_labels);
  }
};
} // namespace objectives
} // namespace contrastive
