// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Storage types and their float accumulator.
///
/// `element_traits<T>` is the one place that knows how an element type converts to and from `float`, its range and its
/// precision. Storage is `T`; arithmetic accumulates in `float`; `from_float` rounds to nearest-even, which is what the
/// GPU's `cvt.rn` instructions do, so host and device round identically.

#include <contrastive/detail/config.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace contrastive
{
namespace detail
{
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE std::uint32_t float_bits(float x) noexcept
{
#if CONTRASTIVE_IN_DEVICE_CODE
  return __float_as_uint(x);
#else
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE float bits_float(std::uint32_t u) noexcept
{
#if CONTRASTIVE_IN_DEVICE_CODE
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

/// IEEE binary16 -> binary32, exact (every half is a float). Branch-free so that loops over it vectorise, and free of
/// float subnormals: arithmetic on one takes a microcode assist on Intel cores, and the gradients a materialized half
/// step stores are often half subnormals. (Measured on a Xeon, family 6 model 207, AVX-512: a conversion
/// that multiplies the subnormal float by 2^112, takes 5-9x as long over half subnormals as over normal halves; this
/// one takes about the same time for both.)
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE float half_bits_to_float(std::uint16_t h) noexcept
{
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t em = h & 0x7fffu;
  // Normal halves: shift the exponent and mantissa into place and rebias the exponent (15 -> 127) in the bits.
  const std::uint32_t normal = (em << 13) + 0x38000000u; // + (127 - 15) << 23
  // Zero and subnormal halves, m * 2^-24: the float 2^-14 (1 + m/1024), a normal, less 2^-14 (exact). The sign bit is
  // cleared: rounding toward -inf would make the zero half's difference -0.
  const std::uint32_t subnormal = float_bits(bits_float((em << 13) + 0x38800000u) - 6.103515625e-05f) & 0x7fffffffu;
  // Inf/NaN: exponent all ones; keep the payload.
  const std::uint32_t infnan = 0x7f800000u | (em & 0x3ffu) << 13;
  const std::uint32_t mag = em >= 0x7c00u ? infnan : (em < 0x400u ? subnormal : normal);
  return bits_float(sign | mag);
}

/// binary32 -> binary16 with round-to-nearest-even, overflow to +-inf, NaN preserved (quieted).
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE std::uint16_t float_to_half_bits(float f) noexcept
{
  const std::uint32_t x = float_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u)
  {
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  }
  if (ax >= 0x477ff000u) // >= 65520: rounds to inf (65504 is the largest finite half)
  {
    return static_cast<std::uint16_t>(sign | 0x7c00u);
  }
  if (ax < 0x38800000u) // below the smallest normal half (2^-14): subnormal or zero
  {
    // Adding 0.5 (2^-1) aligns the value so that the FPU's own round-to-nearest-even lands on the 2^-24 grid.
    const float r = bits_float(ax) + 0.5f;
    return static_cast<std::uint16_t>(sign | (float_bits(r) - 0x3f000000u));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest-even.
  const std::uint32_t odd = (ax >> 13) & 1u;
  const std::uint32_t rounded = ax + 0xc8000fffu + odd; // -(112 << 23) + 0xfff
  return static_cast<std::uint16_t>(sign | (rounded >> 13));
}

CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE float bf16_bits_to_float(std::uint16_t b) noexcept
{
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

/// binary32 -> bfloat16 with round-to-nearest-even; NaN stays NaN.
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE std::uint16_t float_to_bf16_bits(float f) noexcept
{
  const std::uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u)
  {
    return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  }
  const std::uint32_t rounding_bias = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>((x + rounding_bias) >> 16);
}
} // namespace detail

/// Numeric facts about a storage type. Specialised for `float`, `__half` and `__nv_bfloat16`.
template <class T>
struct element_traits;

/// IEEE binary32: storage and accumulator are one type, so the conversions are exact (the identity).
template <>
struct element_traits<float>
{
  /// The storage type.
  using value_type = float;
  /// The type's name, for messages.
  static constexpr const char* name = "float";
  /// The largest finite value (3.40282347e38), as a float.
  CONTRASTIVE_HOST_DEVICE static constexpr float max_finite() noexcept
  {
    return 3.40282347e+38f;
  }
  /// The smallest positive normal value (2^-126), as a float.
  CONTRASTIVE_HOST_DEVICE static constexpr float min_normal() noexcept
  {
    return 1.17549435e-38f;
  }
  /// The gap between 1 and the next larger value (2^-23), as a float.
  CONTRASTIVE_HOST_DEVICE static constexpr float epsilon() noexcept
  {
    return 1.19209290e-07f;
  }
  /// `x` itself: float is its own accumulator.
  CONTRASTIVE_HOST_DEVICE static CONTRASTIVE_FORCEINLINE float to_float(float x) noexcept
  {
    return x;
  }
  /// `x` itself: no rounding.
  CONTRASTIVE_HOST_DEVICE static CONTRASTIVE_FORCEINLINE float from_float(float x) noexcept
  {
    return x;
  }
  /// The binary32 bit pattern of `x`.
  CONTRASTIVE_HOST_DEVICE static CONTRASTIVE_FORCEINLINE std::uint32_t bits(float x) noexcept
  {
    return detail::float_bits(x);
  }
  /// Whether `x` is neither infinite nor NaN.
  CONTRASTIVE_HOST_DEVICE static CONTRASTIVE_FORCEINLINE bool is_finite(float x) noexcept
  {
    return (detail::float_bits(x) & 0x7f800000u) != 0x7f800000u;
  }
};

/// IEEE binary16 (`__half`): 11-bit significand, largest finite 65504; converts to float exactly, from float with
/// round-to-nearest-even.
template <>
struct element_traits<__half>
{
  /// The storage type.
  using value_type = __half;
  /// The type's name, for messages.
  static constexpr const char* name = "half";
  /// The largest finite value (65504), as a float.
  CONTRASTIVE_HOST_DEVICE static constexpr float max_finite() noexcept
  {
    return 65504.0f;
  }
  /// The smallest positive normal value (2^-14), as a float.
  CONTRASTIVE_HOST_DEVICE static constexpr float min_normal() noexcept
  {
    return 6.103515625e-05f; // 2^-14
  }
  /// The gap between 1 and the next larger value (2^-10), as a float.
  CONTRASTIVE_HOST_DEVICE static constexpr float epsilon() noexcept
  {
    return 9.765625e-04f; // 2^-10
  }
  /// The binary16 bit pattern of `x`.
  CONTRASTIVE_HOST_DEVICE static CONTRASTIVE_FORCEINLINE std::uint16_t bits(__half x) noexcept
  {
    return static_cast<__half_raw>(x).x;
  }
  /// The value whose binary16 bit pattern is `b` (bits' inverse).
  CONTRASTIVE_HOST_DEVICE static CONTRASTIVE_FORCEINLINE __half from_bits(std::uint16_t b) noexcept
  {
    __half_raw r;
    r.x = b;
    return __half(r);
  }
  /// `x` as a float, exactly.
  CONTRASTIVE_HOST_DEVICE static CONTRASTIVE_FORCEINLINE float to_float(__half x) noexcept
  {
#if CONTRASTIVE_IN_DEVICE_CODE
    return __half2float(x);
#else
    return detail::half_bits_to_float(bits(x));
#endif
  }
  /// `x` rounded to nearest-even (overflow to +-inf, NaN kept), bit-identical on host and device.
  CONTRASTIVE_HOST_DEVICE static CONTRASTIVE_FORCEINLINE __half from_float(float x) noexcept
  {
#if CONTRASTIVE_IN_DEVICE_CODE
    return __float2half_rn(x);
#else
    return from_bits(detail::float_to_half_bits(x));
#endif
  }
  /// Whether `x` is neither infinite nor NaN.
  CONTRASTIVE_HOST_DEVICE static CONTRASTIVE_FORCEINLINE bool is_finite(__half x) noexcept
  {
    return (bits(x) & 0x7c00u) != 0x7c00u;
  }
};

/// bfloat16 (`__nv_bfloat16`): float's exponent range with an 8-bit significand; converts to float exactly, from
/// float with round-to-nearest-even.
template <>
struct element_traits<__nv_bfloat16>
{
  /// The storage type.
  using value_type = __nv_bfloat16;
  /// The type's name, for messages.
  static constexpr const char* name = "bfloat16";
  /// The largest finite value (3.38953139e38), as a float.
  CONTRASTIVE_HOST_DEVICE static constexpr float max_finite() noexcept
  {
    return 3.38953139e+38f;
  }
  /// The smallest positive normal value (2^-126), as a float.
  CONTRASTIVE_HOST_DEVICE static constexpr float min_normal() noexcept
  {
    return 1.17549435e-38f;
  }
  /// The gap between 1 and the next larger value (2^-7), as a float.
  CONTRASTIVE_HOST_DEVICE static constexpr float epsilon() noexcept
  {
    return 7.8125e-03f; // 2^-7
  }
  /// The bfloat16 bit pattern of `x`.
  CONTRASTIVE_HOST_DEVICE static CONTRASTIVE_FORCEINLINE std::uint16_t bits(__nv_bfloat16 x) noexcept
  {
    return static_cast<__nv_bfloat16_raw>(x).x;
  }
  /// The value whose bfloat16 bit pattern is `b` (bits' inverse).
  CONTRASTIVE_HOST_DEVICE static CONTRASTIVE_FORCEINLINE __nv_bfloat16 from_bits(std::uint16_t b) noexcept
  {
    __nv_bfloat16_raw r;
    r.x = b;
    return __nv_bfloat16(r);
  }
  /// `x` as a float, exactly.
  CONTRASTIVE_HOST_DEVICE static CONTRASTIVE_FORCEINLINE float to_float(__nv_bfloat16 x) noexcept
  {
#if CONTRASTIVE_IN_DEVICE_CODE
    return __bfloat162float(x);
#else
    return detail::bf16_bits_to_float(bits(x));
#endif
  }
  /// `x` rounded to nearest-even (overflow to +-inf, NaN kept), bit-identical on host and device.
  CONTRASTIVE_HOST_DEVICE static CONTRASTIVE_FORCEINLINE __nv_bfloat16 from_float(float x) noexcept
  {
#if CONTRASTIVE_IN_DEVICE_CODE
    return __float2bfloat16_rn(x);
#else
    return from_bits(detail::float_to_bf16_bits(x));
#endif
  }
  /// Whether `x` is neither infinite nor NaN.
  CONTRASTIVE_HOST_DEVICE static CONTRASTIVE_FORCEINLINE bool is_finite(__nv_bfloat16 x) noexcept
  {
    return (bits(x) & 0x7f80u) != 0x7f80u;
  }
};

/// True for the element types the library supports.
template <class T>
inline constexpr bool is_element_type_v =
    std::is_same_v<T, float> || std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

/// Round a float through `T` and back: the value a GPU would hold after storing `x` as `T`.
template <class T>
CONTRASTIVE_HOST_DEVICE CONTRASTIVE_FORCEINLINE float round_to(float x) noexcept
{
  return element_traits<T>::to_float(element_traits<T>::from_float(x));
}
} // namespace contrastive
