// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
// The one generator of test and benchmark inputs: random L2-normalised rows (as CLIP's features are), stored in T.
// Tests, the host, device and distributed benchmarks include it (benchmarks add tests/ to their include path).
#pragma once

#include <contrastive/numeric/element_traits.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace contrastive_test
{
/// rows x dim values: each row a standard normal draw scaled to length `norm` (never zero). Deterministic per seed.
template <class T>
std::vector<T> random_rows(std::size_t rows, std::size_t dim, std::uint32_t seed, float norm = 1.0f)
{
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<T> out(rows * dim);
  std::vector<float> row(dim);
  for (std::size_t i = 0; i < rows; ++i)
  {
    double ss = 0.0;
    for (auto& x : row)
    {
      x = normal(rng);
      ss += double(x) * x;
    }
    const float inv = norm / static_cast<float>(std::sqrt(ss));
    for (std::size_t c = 0; c < dim; ++c)
    {
      out[i * dim + c] = contrastive::element_traits<T>::from_float(row[c] * inv);
    }
  }
  return out;
}
} // namespace contrastive_test
