// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Operands of the host engine: the finiteness scan of the caller's arrays, their conversion from the element type to
/// float straight into the packed layouts of host/gemm.hpp, and the 16-lane reductions the tile loops use.

#include <contrastive/host/element_rows.hpp>
#include <contrastive/host/gemm.hpp>
#include <contrastive/host/thread_pool.hpp>
#include <contrastive/numeric/element_traits.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace contrastive
{
namespace host
{
/// Sum of f(0..n) in 16 lanes (vectorisable: the compiler may not reorder a scalar float reduction).
template <class F>
CONTRASTIVE_FORCEINLINE float lane_sum(std::size_t n, F&& f) noexcept
{
  float acc[16] = {};
  std::size_t j = 0;
  for (; j + 16 <= n; j += 16)
  {
    for (int l = 0; l < 16; ++l)
    {
      acc[l] += f(j + l);
    }
  }
  float t = 0.0f;
  for (; j < n; ++j)
  {
    t += f(j);
  }
  for (int l = 0; l < 16; ++l)
  {
    t += acc[l];
  }
  return t;
}

/// Max of init and f(0..n) in 16 lanes.
template <class F>
CONTRASTIVE_FORCEINLINE float lane_max(std::size_t n, float init, F&& f) noexcept
{
  float acc[16];
  for (int l = 0; l < 16; ++l)
  {
    acc[l] = init;
  }
  std::size_t j = 0;
  for (; j + 16 <= n; j += 16)
  {
    for (int l = 0; l < 16; ++l)
    {
      const float x = f(j + l);
      acc[l] = acc[l] > x ? acc[l] : x;
    }
  }
  float t = init;
  for (; j < n; ++j)
  {
    const float x = f(j);
    t = t > x ? t : x;
  }
  for (int l = 0; l < 16; ++l)
  {
    t = t > acc[l] ? t : acc[l];
  }
  return t;
}

/// Index (row * d + col) + 1 of the first non-finite element of src (rows x d), or 0. Reads only src.
template <class T>
std::ptrdiff_t scan_nonfinite(thread_pool& pool, const T* src, std::size_t rows, std::size_t d, unsigned workers)
{
  using traits = element_traits<T>;
  constexpr std::size_t chunk = 256;
  constexpr unsigned most = 64;
  const std::size_t tasks = (rows + chunk - 1) / chunk;
  const unsigned used = static_cast<unsigned>(std::min<std::size_t>(std::min<std::size_t>(workers, tasks), most));
  std::ptrdiff_t first_bad[most] = {};
  parallel_for(pool,
               tasks,
               used,
               [&](std::size_t t, unsigned w)
               {
                 if (first_bad[w] != 0)
                 {
                   return; // this worker's tasks only grow: its first bad index is already its smallest
                 }
                 const std::size_t end = std::min(rows, (t + 1) * chunk);
                 for (std::size_t i = t * chunk; i < end; ++i)
                 {
                   const T* row = src + i * d;
                   const float poison = lane_sum(d,
                                                 [&](std::size_t c)
                                                 {
                                                   return traits::to_float(row[c]) * 0.0f;
                                                 });
                   if (poison == 0.0f)
                   {
                     continue;
                   }
                   for (std::size_t c = 0; c < d; ++c)
                   {
                     if (!traits::is_finite(row[c]))
                     {
                       first_bad[w] = static_cast<std::ptrdiff_t>(i * d + c) + 1;
                       return;
                     }
                   }
                 }
               });
  std::ptrdiff_t bad = 0;
  for (unsigned w = 0; w < used; ++w)
  {
    if (first_bad[w] != 0 && (bad == 0 || first_bad[w] < bad))
    {
      bad = first_bad[w];
    }
  }
  return bad;
}

/// Elements converted per segment by the packing functions: a 16-bit row is converted into a contiguous float buffer
/// first (a vectorisable loop, F16C for half where the compiler targets it), then scattered into its panel as a float
/// row is, so the packed layouts cost 16-bit types what they cost float, one conversion per element.
inline constexpr std::size_t pack_segment = 256;
static_assert(pack_segment % 32 == 0, "segments hold whole NR-wide column panels");

/// n elements of src as float: src itself for float, else converted into buf (n <= pack_segment).
template <class T>
CONTRASTIVE_FORCEINLINE const float* float_row(const T* src, std::size_t n, float* buf) noexcept
{
  if constexpr (std::is_same_v<T, float>)
  {
    (void)n;
    (void)buf;
    return src;
  }
  else
  {
    to_float_row(src, n, buf);
    return buf;
  }
}

/// out[0, d) = round_Out(factor * acc[c]); returns whether any stored value is not finite. For half with F16C, eight
/// at a time with vcvtps2ph (round to nearest even: IEEE's rounding, the same bits as the scalar conversion for every
/// non-NaN float, numeric_test checks it); a block holding a NaN goes through the scalar conversion, which keeps
/// cuda_fp16.h's NaN bits.
template <class Out>
bool store_scaled_row(const float* acc, float factor, Out* out, std::size_t d) noexcept
{
  using out_traits = element_traits<Out>;
  float poison = 0.0f;
  std::size_t c = 0;
#if defined(__F16C__)
  if constexpr (std::is_same_v<Out, __half>)
  {
    const __m256 f = _mm256_set1_ps(factor);
    __m256 bad = _mm256_setzero_ps();
    for (; c + 8 <= d; c += 8)
    {
      const __m256 x = _mm256_mul_ps(f, _mm256_loadu_ps(acc + c));
      if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0)
      {
        break;
      }
      const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), h);
      bad = _mm256_add_ps(bad, _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_setzero_ps()));
    }
    poison = _mm256_movemask_ps(_mm256_cmp_ps(bad, bad, _CMP_UNORD_Q)) != 0 ? 1.0f : 0.0f;
  }
#endif
  for (; c < d; ++c)
  {
    const Out v = out_traits::from_float(factor * acc[c]);
    poison += out_traits::to_float(v) * 0.0f;
    out[c] = v;
  }
  return poison != 0.0f;
}

/// out[0, d) = round_Out(factor * acc[c]) formed in double, for a factor past float's range (a loss scale near
/// float's largest value times the logit scale) whose products may still fit; returns whether any stored value is not
/// finite.
template <class Out>
bool store_wide_scaled_row(const float* acc, double factor, Out* out, std::size_t d) noexcept
{
  using out_traits = element_traits<Out>;
  float poison = 0.0f;
  for (std::size_t c = 0; c < d; ++c)
  {
    const Out v = out_traits::from_float(static_cast<float>(factor * static_cast<double>(acc[c])));
    poison += out_traits::to_float(v) * 0.0f;
    out[c] = v;
  }
  return poison != 0.0f;
}

/// The factor a fused backward scales its float accumulators by, loss_scale * s * coef: the float product as it has
/// always been formed, or, where that overflows float, the double product (stored by `store_wide_scaled_row`), so
/// that a gradient that fits is not turned into inf by its factor alone.
inline double backward_output_factor(float loss_scale, float s, float coef = 1.0f) noexcept
{
  const float f = loss_scale * s * coef;
  if (f - f == 0.0f)
  {
    return static_cast<double>(f);
  }
  return static_cast<double>(loss_scale) * static_cast<double>(s) * static_cast<double>(coef);
}

/// Rows [r0, r0 + rows) of src (row-major, d columns, element T) in panels of Width rows over the dimension,
/// [rows_pad / Width][d][Width], zero beyond `rows`: an operand of the logits product, "columns" being rows.
template <int Width, class T>
void pack_row_panels(const T* src, std::size_t d, std::size_t r0, std::size_t rows, std::size_t rows_pad, float* dst)
{
  float buf[pack_segment];
  for (std::size_t c = 0; c < rows_pad; c += Width)
  {
    float* panel = dst + c * d;
    for (int jj = 0; jj < Width; ++jj)
    {
      const std::size_t r = c + static_cast<std::size_t>(jj);
      if (r < rows)
      {
        const T* row = src + (r0 + r) * d;
        for (std::size_t p0 = 0; p0 < d; p0 += pack_segment)
        {
          const std::size_t len = std::min(pack_segment, d - p0);
          const float* x = float_row(row + p0, len, buf);
          for (std::size_t p = 0; p < len; ++p)
          {
            panel[(p0 + p) * Width + jj] = x[p];
          }
        }
      }
      else
      {
        for (std::size_t p = 0; p < d; ++p)
        {
          panel[p * Width + jj] = 0.0f;
        }
      }
    }
  }
}

/// Rows [r0, r0 + rows) of src as the B operand of the logits product (b_panels [rows_pad / NR][d][NR]): K for
/// S = Q K^T.
template <class T>
void pack_rows_over_dim(const T* src, std::size_t d, std::size_t r0, std::size_t rows, std::size_t rows_pad, float* dst)
{
  pack_row_panels<kernel_nr>(src, d, r0, rows, rows_pad, dst);
}

/// Rows [r0, r0 + rows) of src as the A operand of the logits product: a_panels [rows_pad / MR][d][MR].
template <class T>
void pack_rows_as_a(const T* src, std::size_t d, std::size_t r0, std::size_t rows, std::size_t rows_pad, float* dst)
{
  pack_row_panels<kernel_mr>(src, d, r0, rows, rows_pad, dst);
}

/// Rows [r0, r0 + rows) of src as the B operand of a product over rows (dQ = G K, dK = G^T Q): b_panels over the
/// dimension, [dp / NR][ld_rows][NR] (panel stride ld_rows * NR floats), rows beyond `rows` and columns beyond d zero
/// up to rows_pad and dp.
template <class T>
void pack_rows_over_rows(const T* src,
                         std::size_t d,
                         std::size_t dp,
                         std::size_t r0,
                         std::size_t rows,
                         std::size_t rows_pad,
                         std::size_t ld_rows,
                         float* dst)
{
  float buf[pack_segment];
  for (std::size_t r = 0; r < rows_pad; ++r)
  {
    const T* row = r < rows ? src + (r0 + r) * d : src;
    for (std::size_t c0 = 0; c0 < dp; c0 += pack_segment)
    {
      const std::size_t width = std::min(pack_segment, dp - c0); // a multiple of NR
      const std::size_t have = r < rows && c0 < d ? std::min(width, d - c0) : 0;
      const float* x = have != 0 ? float_row(row + c0, have, buf) : buf;
      for (std::size_t c = 0; c < width; c += kernel_nr)
      {
        float* out = dst + (c0 + c) * ld_rows + r * kernel_nr;
        for (int jj = 0; jj < kernel_nr; ++jj)
        {
          const std::size_t col = c + static_cast<std::size_t>(jj);
          out[jj] = col < have ? x[col] : 0.0f;
        }
      }
    }
  }
}

/// The bfloat16 bits of element i of a bfloat16 array.
CONTRASTIVE_FORCEINLINE std::uint16_t bf16_bits_at(const __nv_bfloat16* src, std::size_t i) noexcept
{
  std::uint16_t b;
  std::memcpy(&b, src + i, sizeof b);
  return b;
}

/// pack_row_panels in the pair layout of host/gemm.hpp, straight from bfloat16 rows (no conversion): rows
/// [r0, r0 + rows) of src as [rows_pad / Width][kc / 2][Width][2], kc = round_up(d, 2), zero beyond rows and d.
template <int Width>
void pack_row_pairs(
    const __nv_bfloat16* src, std::size_t d, std::size_t r0, std::size_t rows, std::size_t rows_pad, std::uint16_t* dst)
{
  const std::size_t kc = round_up(d, 2);
  for (std::size_t c = 0; c < rows_pad; c += Width)
  {
    std::uint16_t* panel = dst + c * kc;
    for (int jj = 0; jj < Width; ++jj)
    {
      const std::size_t r = c + static_cast<std::size_t>(jj);
      std::uint16_t* out = panel + 2 * jj;
      if (r >= rows)
      {
        for (std::size_t p = 0; p < kc; p += 2)
        {
          out[p * Width] = 0;
          out[p * Width + 1] = 0;
        }
        continue;
      }
      const __nv_bfloat16* row = src + (r0 + r) * d;
      std::size_t p = 0;
      for (; p + 2 <= d; p += 2)
      {
        out[p * Width] = bf16_bits_at(row, p);
        out[p * Width + 1] = bf16_bits_at(row, p + 1);
      }
      if (p < d)
      {
        out[p * Width] = bf16_bits_at(row, p);
        out[p * Width + 1] = 0;
      }
    }
  }
}

/// pack_rows_over_rows in the pair layout, from bfloat16 rows: the B operand of a product over rows (dQ = G K,
/// dK = G^T Q) as [dp / NR][ld_rows / 2][NR][2] (panel stride ld_rows * NR elements; rows_pad and ld_rows even),
/// rows beyond `rows` and columns beyond d zero.
inline void pack_rows_over_rows_pairs(const __nv_bfloat16* src,
                                      std::size_t d,
                                      std::size_t dp,
                                      std::size_t r0,
                                      std::size_t rows,
                                      std::size_t rows_pad,
                                      std::size_t ld_rows,
                                      std::uint16_t* dst)
{
  for (std::size_t r = 0; r < rows_pad; ++r)
  {
    const std::size_t step = (r & ~std::size_t(1)) * kernel_nr + (r & 1);
    const __nv_bfloat16* row = r < rows ? src + (r0 + r) * d : src;
    for (std::size_t c0 = 0; c0 < dp; c0 += kernel_nr)
    {
      std::uint16_t* out = dst + c0 * ld_rows + step;
      const std::size_t have = r < rows && c0 < d ? std::min<std::size_t>(kernel_nr, d - c0) : 0;
      for (std::size_t jj = 0; jj < static_cast<std::size_t>(kernel_nr); ++jj)
      {
        out[2 * jj] = jj < have ? bf16_bits_at(row, c0 + jj) : std::uint16_t(0);
      }
    }
  }
}

} // namespace host
} // namespace contrastive
