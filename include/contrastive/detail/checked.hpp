// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Size arithmetic that cannot wrap. Every buffer the library sizes from caller-supplied dimensions goes through
/// these, so a problem whose element or byte counts do not fit in `std::size_t` is refused before anything is
/// allocated or touched.

#include <contrastive/detail/config.hpp>

#include <cstddef>

namespace contrastive
{
namespace detail
{
/// A size that remembers whether any step of its computation overflowed. Arithmetic on an overflowed value stays
/// overflowed, so a whole formula can be written plainly and tested once.
struct checked_size
{
  std::size_t value = 0;
  bool overflow = false;

  constexpr checked_size() noexcept = default; // defaulted: host and device alike (nvcc ignores annotations here)
  CONTRASTIVE_HOST_DEVICE constexpr checked_size(std::size_t v) noexcept : value(v) {}
  CONTRASTIVE_HOST_DEVICE constexpr checked_size(std::size_t v, bool o) noexcept : value(v), overflow(o) {}

  CONTRASTIVE_HOST_DEVICE constexpr bool ok() const noexcept
  {
    return !overflow;
  }
};

CONTRASTIVE_HOST_DEVICE constexpr checked_size operator*(checked_size a, checked_size b) noexcept
{
  if (a.overflow || b.overflow)
  {
    return {0, true};
  }
  if (a.value != 0 && b.value > static_cast<std::size_t>(-1) / a.value)
  {
    return {0, true};
  }
  return {a.value * b.value, false};
}

CONTRASTIVE_HOST_DEVICE constexpr checked_size operator+(checked_size a, checked_size b) noexcept
{
  if (a.overflow || b.overflow || b.value > static_cast<std::size_t>(-1) - a.value)
  {
    return {0, true};
  }
  return {a.value + b.value, false};
}

/// x rounded up to a multiple of m (m > 0).
CONTRASTIVE_HOST_DEVICE constexpr checked_size round_up(checked_size x, std::size_t m) noexcept
{
  if (x.overflow)
  {
    return x;
  }
  const std::size_t r = x.value % m;
  return r == 0 ? x : x + checked_size(m - r);
}
} // namespace detail
} // namespace contrastive
