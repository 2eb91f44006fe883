// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What the host engine's passes return: the forward's result, the row phase's, the backward's, and the backward's
/// per-worker partials, combined in worker order.

#include <contrastive/detail/config.hpp>
#include <contrastive/host/thread_pool.hpp>

namespace contrastive
{
namespace host
{
/// Result of a forward pass.
struct forward_result
{
  float loss = 0.0f;
  float max_logit = 0.0f; ///< largest logit S_ij (materialized: its element-type value)
  bool logits_nonfinite = false;
};

/// Result of the row phase of a forward pass (`engine::forward_rows`): the column statistics of the symmetric loss
/// are finished after it, by whoever holds every row's partials (the step driver).
struct row_pass
{
  double row_loss_sum = 0.0; ///< sum of the row losses of this engine's rows
  float max_logit = 0.0f;    ///< largest logit S_ij (materialized: its element-type value)
  bool logits_nonfinite = false;
};

/// Result of a backward pass. `grad_logit_scale` is d(loss_scale * loss)/d(log s); `grad_logit_bias` is
/// d(loss_scale * loss)/d b (the sigmoid objective's logit bias; 0 for the softmax objectives).
struct backward_result
{
  float grad_logit_scale = 0.0f;
  bool dq_nonfinite = false;
  bool dk_nonfinite = false;
  float grad_logit_bias = 0.0f;
};

/// Per-worker partials of a backward pass (d loss / d log s, non-finite dQ / dK), combined in worker order so the
/// result does not depend on scheduling.
struct backward_partials
{
  double dlogs[max_threads] = {};
  double dbias[max_threads] = {}; ///< sigmoid: sums of G (or of its scaled element-type values, materialized)
  unsigned char bad_q[max_threads] = {};
  unsigned char bad_k[max_threads] = {};

  /// The pass's result; `factor` turns the summed partials into d(loss_scale * loss)/d(log s), `bias_factor` the
  /// bias partials into d(loss_scale * loss)/d b (unless `bias_total` gives that sum already).
  /// Always inlined: GCC 12 at -O3 turned `return parts.combine(...)` on a local `parts` into a sibling call (a jmp
  /// after the caller's frame, realigned for its AVX arrays, was released), so combine read freed stack and returned
  /// garbage (seen with gemm::cblas, float, fused; valgrind: invalid read in combine). Inlined, there is no call.
  CONTRASTIVE_FORCEINLINE backward_result combine(unsigned workers,
                                                  double factor,
                                                  double bias_factor = 0.0) const noexcept
  {
    backward_result r;
    double total = 0.0, bias_total = 0.0;
    for (unsigned w = 0; w < workers; ++w)
    {
      total += dlogs[w];
      bias_total += dbias[w];
      r.dq_nonfinite |= bad_q[w] != 0;
      r.dk_nonfinite |= bad_k[w] != 0;
    }
    r.grad_logit_scale = static_cast<float>(factor * total);
    r.grad_logit_bias = static_cast<float>(bias_factor * bias_total);
    return r;
  }
};
} // namespace host
} // namespace contrastive
