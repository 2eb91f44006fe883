// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What the device kernels (device/kernels.cuh) are given: the row pass's arguments, where a row's positive is, where
/// the logits come from, the step's scalars on the device, and the NaN-propagating max of their reductions. Only
/// CUDA translation units include this file.

#include <contrastive/detail/config.hpp>

#include <cstdint>

namespace contrastive
{
namespace device
{
namespace kernels
{
/// Which element of a row is its positive.
enum class positive_mode : int
{
  diagonal = 0,  ///< row a's positive is column a
  row_label = 1, ///< row a's positive is column labels[a]
  col_label = 2, ///< row a is the positive of every column b with labels[b] == a (the key side of InfoNCE)
};

/// Where the pass gets its logits from.
enum class source : int
{
  compute = 0,           ///< S = s A B^T, recomputed in tiles (fused)
  matrix = 1,            ///< the n_a x n_b element-type matrix (materialized, rows)
  matrix_transposed = 2, ///< the n_b x n_a element-type matrix read transposed (materialized, columns)
};

/// Scalars of the current step, written on the device by the prologue so that a step needs no host round trip.
struct step_scalars
{
  float scale;      ///< s = 1/tau
  float loss_scale; ///< loss scale of this step
  int wants_gradient;
  float bias; ///< the sigmoid objective's logit bias b (z = s <q, k> + b); the softmax objectives do not read it
};

/// Arguments of a row pass (plain data, passed by value).
struct pass_args
{
  const void* a = nullptr; ///< A rows (n_a x dim, element type)
  const void* b = nullptr; ///< B rows (n_b x dim)
  int n_a = 0, n_b = 0, dim = 0;
  int ld_acc = 0; ///< leading dimension of the float accumulator (dim rounded up to d_chunk)
  const std::int32_t* labels = nullptr;
  positive_mode pos = positive_mode::diagonal;
  const void* matrix = nullptr; ///< materialized logits/gradients, row-major n_q x n_k
  int matrix_ld = 0;
  const step_scalars* scalars = nullptr;
  // forward outputs (per row of A)
  float* lse = nullptr;
  float* loss = nullptr;
  float* max_logit = nullptr; ///< the row's largest logit, its positive included: finish_row's `shift`
  float* log_sum = nullptr;   ///< finish_row's `log_sum` (lse = max_logit + log_sum), may be null (materialized only)
  // backward inputs/outputs
  const float* lse_a = nullptr;
  const float* lse_b = nullptr;
  const float* loss_a = nullptr; ///< fused: per-row losses of A and of B, for the positive's exact G_pp
  const float* loss_b = nullptr;
  float coef_a = 0.0f, coef_b = 0.0f, coef_pos = 0.0f;
  float* acc = nullptr;           ///< float accumulator rows (n_a rounded up to block_m) x ld_acc, zeroed
  void* out = nullptr;            ///< dA in the element type
  float* dlogs_partial = nullptr; ///< per-block partial of <dA, A> (dQ pass only), may be null
  bool out_is_final = false;      ///< materialized: accumulator already holds s * loss_scale * G products
  int* flags = nullptr;           ///< [0] logits non-finite, [1] dQ non-finite, [2] dK non-finite
  int flag_index = 0;
};

/// Per-row log-sum-exps split as finish_row splits them, lse = shift + log_sum (a null `shift`: no such term), from
/// which P = exp((S - shift) - log_sum) keeps a few float eps at any logit magnitude (see row_loss::shift).
struct split_lse
{
  const float* shift = nullptr;
  const float* log_sum = nullptr;
};

/// max(a, b) that propagates a NaN operand (fmaxf returns the other one): forms the reported loss and max logit,
/// on the device and in the CUB reduction of the per-row maxima.
struct nan_max
{
  CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE float operator()(float a, float b) const noexcept
  {
    return a != a ? a : (b != b ? b : fmaxf(a, b));
  }
};
} // namespace kernels
} // namespace device
} // namespace contrastive
