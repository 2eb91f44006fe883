// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The demo's data: latent factors z ~ N(0, I_latent); two views x_a = M_a z + noise, x_b = M_b z + noise (fixed
/// random mixing matrices), so a pair shares its z and retrieval of b from a (and back) is learnable but not trivial.
/// Deterministic given the seed: the random numbers come from splitmix64 with our own Box-Muller, not from <random>'s
/// distributions (whose output differs between standard libraries).

#include "collapse/config.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace collapse_demo
{
/// splitmix64 and Box-Muller, identical on every platform.
class rng
{
public:
  explicit rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next();
  /// Uniform in (0, 1).
  double uniform();
  /// Standard normal (pairs from one Box-Muller transform).
  float normal();

private:
  std::uint64_t state_;
  float spare_ = 0.0f;
  bool has_spare_ = false;
};

/// Two views of shared latent factors. Signal per view coordinate has unit variance.
class paired_views
{
public:
  explicit paired_views(const settings& s);

  /// n pairs into xa, xb (n x input_dim each).
  void sample(rng& r, std::size_t n, std::vector<float>& xa, std::vector<float>& xb) const;

private:
  std::size_t in_, latent_;
  float noise_;
  std::vector<float> mix_a_, mix_b_;
};
} // namespace collapse_demo
