// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Per-tile loss math shared by the host engine and the CUDA kernels.
///
/// With S = s Q K^T, P the row softmax and C the column softmax of S, the gradient of the loss w.r.t. the logits is
///   symmetric: G = (P + C - 2 I) / (2 n)      info_nce: G_ij = (P_ij - [j == p_i]) / n_q
/// and dQ = s G K, dK = s G^T Q, d loss / d log s = sum_ij G_ij S_ij = <dQ, Q> (the last form costs O(n d)).

#include <contrastive/detail/config.hpp>
#include <contrastive/problem.hpp>

#include <cstddef>

namespace contrastive
{
/// Per-row coefficients of G = dL/dS: G_ij = row_coef P_ij + col_coef C_ij - pos_coef [j == p_i], where P is the
/// row softmax and C the column softmax of S.
struct grad_coefficients
{
  float row_coef;
  float col_coef;
  float pos_coef;
};

CONTRASTIVE_HOST_DEVICE inline grad_coefficients
make_grad_coefficients(objective obj, std::size_t n_q, std::size_t n_k) noexcept
{
  if (obj == objective::symmetric)
  {
    const float c = static_cast<float>(0.5 / static_cast<double>(n_q));
    return {c, static_cast<float>(0.5 / static_cast<double>(n_k)), 2.0f * c};
  }
  const float c = static_cast<float>(1.0 / static_cast<double>(n_q));
  return {c, 0.0f, c};
}

} // namespace contrastive
