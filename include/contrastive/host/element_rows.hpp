// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Rows of float values converted to and from the element type, or rounded to it, a row at a time: the packing of
/// 16-bit operands (host/operands.hpp) and the materialized algorithm's element-type logits and their backward chain
/// (host/engine_state.hpp, host/materialized.hpp). For half, where the compiler targets F16C, eight at a time with
/// vcvtph2ps (exact) and vcvtps2ph (round to nearest even): the values of element_traits<__half>'s conversions for
/// every half and every non-NaN float (numeric_test checks it), NaN for NaN. The scalar conversions keep
/// their `?:` arms as branches under GCC (a float operation in an arm is not speculated under -ftrapping-math), so
/// their loops do not vectorise; bfloat16 and float take them, and half without F16C.

#include <contrastive/numeric/element_traits.hpp>

#include <cstddef>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace contrastive
{
namespace host
{
#if defined(__F16C__)
/// Eight floats rounded to half (nearest even) and back.
CONTRASTIVE_FORCEINLINE __m256 round_half8(__m256 x) noexcept
{
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

/// out[0, n) = in[0, n) as float (exact).
template <class T>
CONTRASTIVE_FORCEINLINE void to_float_row(const T* in, std::size_t n, float* out) noexcept
{
  std::size_t j = 0;
#if defined(__F16C__)
  if constexpr (std::is_same_v<T, __half>)
  {
    for (; j + 8 <= n; j += 8)
    {
      _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + j))));
    }
  }
#endif
  for (; j < n; ++j)
  {
    out[j] = element_traits<T>::to_float(in[j]);
  }
}

/// out[0, n) = round_T(in[0, n)).
template <class T>
CONTRASTIVE_FORCEINLINE void from_float_row(const float* in, std::size_t n, T* out) noexcept
{
  std::size_t j = 0;
#if defined(__F16C__)
  if constexpr (std::is_same_v<T, __half>)
  {
    for (; j + 8 <= n; j += 8)
    {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j),
                       _mm256_cvtps_ph(_mm256_loadu_ps(in + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
#endif
  for (; j < n; ++j)
  {
    out[j] = element_traits<T>::from_float(in[j]);
  }
}

/// x[0, n) = round_to<T>(x[0, n)) in place (nothing for float).
template <class T>
CONTRASTIVE_FORCEINLINE void round_row(float* x, std::size_t n) noexcept
{
  if constexpr (!std::is_same_v<T, float>)
  {
    std::size_t j = 0;
#if defined(__F16C__)
    if constexpr (std::is_same_v<T, __half>)
    {
      for (; j + 8 <= n; j += 8)
      {
        _mm256_storeu_ps(x + j, round_half8(_mm256_loadu_ps(x + j)));
      }
    }
#endif
    for (; j < n; ++j)
    {
      x[j] = round_to<T>(x[j]);
    }
  }
  else
  {
    (void)x;
    (void)n;
  }
}
} // namespace host
} // namespace contrastive
