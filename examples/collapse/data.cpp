// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0

#include "collapse/data.hpp"

#include <cmath>

namespace collapse_demo
{
std::uint64_t rng::next()
{
  std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double rng::uniform()
{
  return (static_cast<double>(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

float rng::normal()
{
  if (has_spare_)
  {
    has_spare_ = false;
    return spare_;
  }
  const double r = std::sqrt(-2.0 * std::log(uniform()));
  const double t = 6.283185307179586 * uniform();
  spare_ = static_cast<float>(r * std::sin(t));
  has_spare_ = true;
  return static_cast<float>(r * std::cos(t));
}

paired_views::paired_views(const settings& s) : in_(s.input_dim), latent_(s.latent), noise_(s.noise)
{
  rng r(s.seed ^ 0x5eed0000da7aull);
  mix_a_.resize(in_ * latent_);
  mix_b_.resize(in_ * latent_);
  const float g = 1.0f / std::sqrt(static_cast<float>(latent_));
  for (float& x : mix_a_)
  {
    x = g * r.normal();
  }
  for (float& x : mix_b_)
  {
    x = g * r.normal();
  }
}

void paired_views::sample(rng& r, std::size_t n, std::vector<float>& xa, std::vector<float>& xb) const
{
  xa.assign(n * in_, 0.0f);
  xb.assign(n * in_, 0.0f);
  std::vector<float> z(latent_);
  for (std::size_t i = 0; i < n; ++i)
  {
    for (float& v : z)
    {
      v = r.normal();
    }
    for (std::size_t c = 0; c < in_; ++c)
    {
      float a = 0.0f, b = 0.0f;
      for (std::size_t l = 0; l < latent_; ++l)
      {
        a += mix_a_[c * latent_ + l] * z[l];
        b += mix_b_[c * latent_ + l] * z[l];
      }
      xa[i * in_ + c] = a + noise_ * r.normal();
      xb[i * in_ + c] = b + noise_ * r.normal();
    }
  }
}
} // namespace collapse_demo
