// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Scalar math that runs anywhere and vectorises on the host.
///
/// `exp_approx` is the one fast exp of the loss: on the device `__expf`, on the host the polynomial below, which
/// replaces `std::exp` in the O(N^2) loops: a call to libm inside those loops stops the compiler from
/// vectorising them, and with D = 512 the exponentials would then cost as much as the matrix products. It is
/// accurate to 2 ulp over the float range (tested against float64 in tests/numeric_test.cpp).

#include <contrastive/detail/config.hpp>
#include <contrastive/numeric/element_traits.hpp>

#include <cmath>

namespace contrastive
{
namespace detail
{
inline constexpr float infinity_f = __builtin_huge_valf();

/// e^x for float x: Cody-Waite range reduction x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial for e^r, then the
/// exponent is added in two halves so that results in the subnormal range are correct. Returns 0 for x < -104,
/// +inf for x > 88.73, NaN for NaN (x itself).
///
/// Written so that GCC vectorises the loops that call it under its default -ftrapping-math: no float operation
/// depends on a `?:` (GCC does not speculate one out of a branch, so a select such as `x != x ? x : f(x)` left those
/// loops scalar). n's integer comes from n + 1.5 * 2^23, clamped as an integer (no float-to-int conversion of a huge
/// or NaN n), and the special cases are merged as bit masks at the end. The same bits as the clamped form it replaced
/// for every one of the 2^32 floats (checked exhaustively; numeric_test checks it against float64).
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE float exp_approx(float x) noexcept
{
#if CONTRASTIVE_IN_DEVICE_CODE
  return __expf(x); // the hardware ex2 path: the device's fast exp, as the kernels always used
#else
  const float n = __builtin_rintf(x * 1.44269504088896341f);
  float r = __builtin_fmaf(n, -0.693145751953125f, x);
  r = __builtin_fmaf(n, -1.428606765330187045e-06f, r);
  // Taylor-like minimax coefficients for e^r on [-ln2/2, ln2/2].
  float p = 1.9875691500e-4f;
  p = __builtin_fmaf(p, r, 1.3981999507e-3f);
  p = __builtin_fmaf(p, r, 8.3334519073e-3f);
  p = __builtin_fmaf(p, r, 4.1665795894e-2f);
  p = __builtin_fmaf(p, r, 1.6666665459e-1f);
  p = __builtin_fmaf(p, r, 5.0000001201e-1f);
  p = __builtin_fmaf(p, r * r, r);
  p = p + 1.0f;
  // n as an integer: n + 1.5 * 2^23 holds it in its low mantissa bits (exactly, for |n| < 2^22; outside, and for NaN,
  // the clamp keeps the bits below harmless and the masks replace the result). Clamped to [-150, 128], the range of
  // x in [-104, 89].
  std::int32_t ni = static_cast<std::int32_t>(float_bits(n + 12582912.0f) - 0x4B400000u);
  ni = ni < -150 ? -150 : (ni > 128 ? 128 : ni);
  // 2^n split as 2^(n/2) * 2^(n - n/2) keeps both factors normal for n in [-150, 128].
  const std::int32_t n1 = ni / 2;
  const std::int32_t n2 = ni - n1;
  const float s1 = bits_float(static_cast<std::uint32_t>(n1 + 127) << 23);
  const float s2 = bits_float(static_cast<std::uint32_t>(n2 + 127) << 23);
  std::uint32_t y = float_bits(p * s1 * s2);
  const std::uint32_t over = 0u - static_cast<std::uint32_t>(x > 88.7228394f);   // +inf
  const std::uint32_t under = 0u - static_cast<std::uint32_t>(x < -103.972084f); // 0
  const std::uint32_t nan = 0u - static_cast<std::uint32_t>(x != x);             // x
  y = (y & ~over) | (0x7f800000u & over);
  y &= ~under;
  y = (y & ~nan) | (float_bits(x) & nan);
  return bits_float(y);
#endif
}

CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE float max_f(float a, float b) noexcept
{
  return a > b ? a : b;
}

/// Whether x is finite (x - x is 0 for finite x and NaN for inf and NaN), as every check of the library tests it.
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE bool finite(float x) noexcept
{
  return x - x == 0.0f;
}

/// max(a, b) that returns a NaN operand (std::max and fmaxf do not): for reported values such as the max logit.
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE float max_nan(float a, float b) noexcept
{
  return a != a ? a : (b != b ? b : (a > b ? a : b));
}
} // namespace detail
} // namespace contrastive
