// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The demo's model: two towers, each f = normalize(W x) with W (dim x input_dim), float master weights and Adam in
/// float (PyTorch's form, as a framework's fused Adam computes it). It is not the library's `contrastive::optimizer`:
/// that one trains the scalar theta with its moments and update in double, and on the encoders' weights the double
/// arithmetic changes every number of the demo's chaotic runs (measured: the same story, other numbers, e.g. half +
/// learnable collapsing at step 384 instead of 477 and the fused run ending at tau 0.0071 instead of 0.035), so the
/// tables in README.md and docs/demo.md would no longer be what the demo prints.
/// Compute in the element type T, as framework autocast does: x and W are rounded to T, h = round_T(W x) with float
/// accumulation, f = round_T(h / |h|) with the norm in float; backward: dF (T, scaled by the loss scale, from the
/// library's loss), dh = round_T((dF - f <f, dF>) / |h|), dW = round_T(dh^T x) (the fp16 GEMM's output), then
/// `unscale_and_check` on the float copy. A skipped step skips the optimiser too.
/// Instantiated for float, __half and __nv_bfloat16 (model.cpp).

#include "collapse/data.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace collapse_demo
{
template <class T>
class tower
{
public:
  /// Weights drawn from N(0, 1/in) by `r`.
  tower(std::size_t dim, std::size_t in, rng& r);

  /// Features of n inputs (n x in) into `f` (n x dim, element type); keeps what backward needs.
  void forward(const std::vector<float>& x, std::size_t n, std::vector<T>& f);

  /// From dF (n x dim, T, scaled) to the scaled float weight gradient `grad()`.
  void backward(const std::vector<T>& df);

  /// The weight gradient of the last backward (the caller unscales it in place).
  std::vector<float>& grad()
  {
    return grad_;
  }

  /// One Adam step (beta1 0.9, eps 1e-8, step count t >= 1) on every weight with `grad()`.
  void adam_step(float lr, double beta2, std::int64_t t);

private:
  std::size_t dim_, in_, n_ = 0;
  std::vector<float> w_, m_, v_, grad_;
  std::vector<float> xr_, wr_, ff_, norm_;
};

/// Top-1 retrieval accuracy among n pairs (mean of a->b and b->a); a tie counts as a miss.
template <class T>
float retrieval_top1(const std::vector<T>& fa, const std::vector<T>& fb, std::size_t n, std::size_t dim);
} // namespace collapse_demo
