// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The register-blocked float micro-kernel every host product goes through:
///   C[MR x NR] (+)= sum_p a[p][0..MR) (outer) b[p][0..NR)
/// with `a` and `b` packed so that each step p reads MR broadcast scalars and NR contiguous floats. MR x NR is chosen
/// from the compiler target so that the accumulators fill the vector register file without spilling:
/// AVX-512: 8 x 32 (16 zmm), AVX2/AVX: 4 x 16 (8 ymm), otherwise 4 x 16 on 128-bit vectors.

#include <contrastive/detail/config.hpp>

#include <cstddef>
#include <cstring>

namespace contrastive
{
namespace host
{
#if defined(__AVX512F__)
inline constexpr int vector_floats = 16;
inline constexpr int kernel_mr = 8;
#elif defined(__AVX__)
inline constexpr int vector_floats = 8;
inline constexpr int kernel_mr = 4;
#else
inline constexpr int vector_floats = 4;
inline constexpr int kernel_mr = 4;
#endif
inline constexpr int kernel_nr = vector_floats == 16 ? 32 : 16;

namespace kernel
{
#if defined(__GNUC__) || defined(__clang__)
typedef float vfloat __attribute__((vector_size(vector_floats * sizeof(float)), aligned(4), may_alias));
inline constexpr int nr_vectors = kernel_nr / vector_floats;

/// Generic-vector micro-kernel (GCC/Clang vector extensions map it to the target's widest registers).
CONTRASTIVE_FORCEINLINE void micro_kernel(std::size_t kc,
                                          const float* __restrict a,
                                          std::size_t a_stride,
                                          const float* __restrict b,
                                          std::size_t b_stride,
                                          float* __restrict c,
                                          std::size_t ldc,
                                          bool accumulate) noexcept
{
  vfloat acc[kernel_mr][nr_vectors];
  for (int i = 0; i < kernel_mr; ++i)
  {
    for (int v = 0; v < nr_vectors; ++v)
    {
      if (accumulate)
      {
        std::memcpy(&acc[i][v], c + i * ldc + v * vector_floats, sizeof(vfloat));
      }
      else
      {
        acc[i][v] = vfloat{} - vfloat{};
      }
    }
  }
  for (std::size_t p = 0; p < kc; ++p)
  {
    vfloat bv[nr_vectors];
    for (int v = 0; v < nr_vectors; ++v)
    {
      std::memcpy(&bv[v], b + v * vector_floats, sizeof(vfloat));
    }
    for (int i = 0; i < kernel_mr; ++i)
    {
      const float ai = a[i];
      for (int v = 0; v < nr_vectors; ++v)
      {
        acc[i][v] += ai * bv[v];
      }
    }
    a += a_stride;
    b += b_stride;
  }
  for (int i = 0; i < kernel_mr; ++i)
  {
    for (int v = 0; v < nr_vectors; ++v)
    {
      std::memcpy(c + i * ldc + v * vector_floats, &acc[i][v], sizeof(vfloat));
    }
  }
}
#else
inline void micro_kernel(std::size_t kc,
                         const float* a,
                         std::size_t a_stride,
                         const float* b,
                         std::size_t b_stride,
                         float* c,
                         std::size_t ldc,
                         bool accumulate) noexcept
{
  float acc[kernel_mr][kernel_nr];
  for (int i = 0; i < kernel_mr; ++i)
    for (int j = 0; j < kernel_nr; ++j)
      acc[i][j] = accumulate ? c[i * ldc + j] : 0.0f;
  for (std::size_t p = 0; p < kc; ++p, a += a_stride, b += b_stride)
    for (int i = 0; i < kernel_mr; ++i)
      for (int j = 0; j < kernel_nr; ++j)
        acc[i][j] += a[i] * b[j];
  for (int i = 0; i < kernel_mr; ++i)
    for (int j = 0; j < kernel_nr; ++j)
      c[i * ldc + j] = acc[i][j];
}
#endif
} // namespace kernel
} // namespace host
} // namespace contrastive
