// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The host GEMM core: a register-blocked float micro-kernel over packed operands, and the packed layouts every host
/// product uses.
///
///   micro_kernel:  C[MR x NR] (+)= sum_p a[p][0..MR) (outer) b[p][0..NR)
///
/// Both operands are packed so that each step p reads MR broadcast scalars and NR contiguous floats, and consecutive
/// steps are consecutive in memory: no strided reads (a 2 KiB stride maps every row of a D = 512 operand to the same
/// few L1 sets). MR x NR fills the vector register file without spilling, as BLIS does per ISA:
///   AVX-512 (32 zmm):  8 x 32, 16 accumulators + 2 B vectors
///   AVX2/AVX (16 ymm): 6 x 16, 12 accumulators + 2 B vectors + 1 broadcast
///   SSE/other (16 xmm): 4 x 8, 8 accumulators
/// The block shapes of the algorithms (rows per task, keys per tile) are multiples of MR and NR for every ISA.
///
/// Packed layouts (float):
///   a_panels  [rows_pad / MR][k][MR]   rows of a row-major matrix, the A operand of row-times-matrix products
///   b_panels  [cols_pad / NR][k][NR]   columns of the B operand; for B = X^T (logits) the "columns" are rows of X
///   The loss keeps K as b_panels over D (for S = Q K^T) and as b_panels over keys (for dQ = G K), and packs each
///   task's block of Q both ways.

#include <contrastive/detail/config.hpp>
#include <contrastive/host/amx.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace contrastive
{
namespace host
{
#if defined(__AVX512F__)
inline constexpr int vector_floats = 16;
inline constexpr int kernel_mr = 8;
inline constexpr int kernel_nr = 32;
inline constexpr const char* kernel_isa = "avx512";
#elif defined(__AVX__)
inline constexpr int vector_floats = 8;
inline constexpr int kernel_mr = 6;
inline constexpr int kernel_nr = 16;
#if defined(__AVX2__) && defined(__FMA__)
inline constexpr const char* kernel_isa = "avx2+fma";
#else
inline constexpr const char* kernel_isa = "avx";
#endif
#else
inline constexpr int vector_floats = 4;
inline constexpr int kernel_mr = 4;
inline constexpr int kernel_nr = 8;
inline constexpr const char* kernel_isa = "generic";
#endif

/// Rows per task and keys per tile: multiples of MR and NR (and of each other's MR, since the dK product runs over
/// key tiles as its rows).
inline constexpr std::size_t block_m = kernel_mr == 6 ? 96 : 64;
inline constexpr std::size_t block_n = kernel_mr == 6 ? 192 : 256;
static_assert(block_m % kernel_mr == 0 && block_n % kernel_nr == 0 && block_n % kernel_mr == 0, "tile shapes");
/// Keys the fused forward packs at once (key_run / block_n tiles): each query block is packed once per run of tiles,
/// and the run, key_run x D floats per worker, is all of K the fused algorithm holds packed.
inline constexpr std::size_t key_run = 4 * block_n;

CONTRASTIVE_HOST_DEVICE constexpr std::size_t round_up(std::size_t x, std::size_t m) noexcept
{
  return (x + m - 1) / m * m;
}

namespace kernel
{
#if defined(__GNUC__) || defined(__clang__)
typedef float vfloat __attribute__((vector_size(vector_floats * sizeof(float))));
/// The same vector, as an unaligned, aliasing view of float memory: loads and stores through it are plain
/// (unaligned) vector moves, so the accumulators and B stay in registers (a memcpy into a vector variable made GCC
/// keep both on the stack on AVX2).
typedef float vfloat_u __attribute__((vector_size(vector_floats * sizeof(float)), aligned(4), may_alias));
inline constexpr int nr_vectors = kernel_nr / vector_floats;

CONTRASTIVE_FORCEINLINE vfloat load(const float* p) noexcept
{
  return *reinterpret_cast<const vfloat_u*>(p);
}
CONTRASTIVE_FORCEINLINE void store(float* p, vfloat v) noexcept
{
  *reinterpret_cast<vfloat_u*>(p) = v;
}

/// C[MR x NR] (ld ldc) = or += sum over kc steps of a[p][0..MR) times b[p][0..NR), both packed contiguously.
CONTRASTIVE_FORCEINLINE void micro_kernel(std::size_t kc,
                                          const float* __restrict a,
                                          const float* __restrict b,
                                          float* __restrict c,
                                          std::size_t ldc,
                                          bool accumulate) noexcept
{
  // The registers sum this call's kc products from zero and C is added once at the end (accumulating calls): a
  // reduction split over calls (key tiles, row blocks, gemm_packed's kernel_kc slices) is a two-level sum, a chain of
  // at most kernel_kc products per call and one addition per call, instead of one sequential chain over the whole
  // reduction; its rounding error grows with kernel_kc + calls rather than with their product (the float32
  // gradients at logits of ~100 were 2x further from float64 than a BLAS's with one chain).
  vfloat acc[kernel_mr][nr_vectors];
  for (int i = 0; i < kernel_mr; ++i)
  {
    for (int v = 0; v < nr_vectors; ++v)
    {
      acc[i][v] = vfloat{} - vfloat{};
    }
  }
  for (std::size_t p = 0; p < kc; ++p)
  {
    vfloat bv[nr_vectors];
    for (int v = 0; v < nr_vectors; ++v)
    {
      bv[v] = load(b + v * vector_floats);
    }
    for (int i = 0; i < kernel_mr; ++i)
    {
      const float ai = a[i];
      for (int v = 0; v < nr_vectors; ++v)
      {
        acc[i][v] += ai * bv[v];
      }
    }
    a += kernel_mr;
    b += kernel_nr;
  }
  for (int i = 0; i < kernel_mr; ++i)
  {
    for (int v = 0; v < nr_vectors; ++v)
    {
      float* ci = c + i * ldc + v * vector_floats;
      store(ci, accumulate ? load(ci) + acc[i][v] : acc[i][v]);
    }
  }
}
#else
inline void
micro_kernel(std::size_t kc, const float* a, const float* b, float* c, std::size_t ldc, bool accumulate) noexcept
{
  float acc[kernel_mr][kernel_nr] = {};
  for (std::size_t p = 0; p < kc; ++p, a += kernel_mr, b += kernel_nr)
    for (int i = 0; i < kernel_mr; ++i)
      for (int j = 0; j < kernel_nr; ++j)
        acc[i][j] += a[i] * b[j];
  for (int i = 0; i < kernel_mr; ++i)
    for (int j = 0; j < kernel_nr; ++j)
      c[i * ldc + j] = accumulate ? c[i * ldc + j] + acc[i][j] : acc[i][j];
}
#endif
} // namespace kernel

/// The bfloat16 dot-product kernel (AVX512-BF16, `vdpbf16ps`): where the compiler targets it (`-march` on a CPU
/// with avx512_bf16, or CONTRASTIVE_HOST_ISA=avx512bf16), every product whose operands are both bfloat16 runs on
/// it. One instruction multiplies 16 pairs of bfloat16 and adds both products into 16 float lanes: twice the
/// multiply-adds of a float FMA. A product of two bfloat16 values is exact in float, so only the summation order
/// differs from the float kernel on converted operands (and subnormal inputs and results are flushed to zero, as the
/// instruction does).
///
/// Pair layouts (16-bit, K interleaved in pairs; kc even, an odd K padded with a zero step):
///   a_pairs  [rows_pad / MR][kc / 2][MR][2]   step p of row i: the 32-bit word (x[i][2p], x[i][2p + 1])
///   b_pairs  [cols_pad / NR][kc / 2][NR][2]
/// Offsets in elements are those of the float layouts (panel ic starts at ic * kc, slice p0 at p0 * MR), so
/// gemm_packed works on either.
#if defined(__AVX512BF16__) && defined(__AVX512F__) && (defined(__GNUC__) || defined(__clang__))
/// 1 where this build has the bfloat16 dot-product kernel (bf16_dot), for code that must not even name its pair-layout
/// products elsewhere (gemm_packed<std::uint16_t> does not compile without it).
#define CONTRASTIVE_HOST_BF16_DOT 1
inline constexpr bool bf16_dot = true;
inline constexpr const char* bf16_kernel_isa = "avx512_bf16";
#else
#define CONTRASTIVE_HOST_BF16_DOT 0
inline constexpr bool bf16_dot = false;
inline constexpr const char* bf16_kernel_isa = "none";
#endif

/// The kernel the bfloat16 products run on in this process: "amx_bf16" where the build has the bf16 kernel and
/// amx::active() (AMX-BF16 tiles, checked at run time), "amx_bf16 (emulated)" under CONTRASTIVE_HOST_AMX=emulate,
/// else bf16_kernel_isa.
inline const char* bf16_kernel() noexcept
{
  if (!bf16_dot)
  {
    return bf16_kernel_isa;
  }
  switch (amx::status())
  {
  case amx::state::active:
    return "amx_bf16";
  case amx::state::emulated:
    return "amx_bf16 (emulated)";
  default:
    return bf16_kernel_isa;
  }
}

/// The bfloat16 bits of a float, rounded to nearest even (a NaN stays a NaN); branch-free so that loops over it
/// vectorise.
CONTRASTIVE_FORCEINLINE std::uint16_t bf16_round_bits(float f) noexcept
{
  std::uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const std::uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const std::uint32_t quiet = (x >> 16) | 0x40u;
  return static_cast<std::uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

#if CONTRASTIVE_HOST_BF16_DOT
namespace kernel
{
/// C[MR x NR] (ld ldc) = or += sum over kc / 2 pair steps of a[p][0..MR) (pairs) times b[p][0..NR) (pairs); the same
/// two-level summation as the float micro_kernel (registers from zero, C added once).
CONTRASTIVE_FORCEINLINE void micro_kernel(std::size_t kc,
                                          const std::uint16_t* __restrict a,
                                          const std::uint16_t* __restrict b,
                                          float* __restrict c,
                                          std::size_t ldc,
                                          bool accumulate) noexcept
{
  static_assert(kernel_nr == 2 * vector_floats, "two B vectors of 16 pairs per step");
  __m512 acc[kernel_mr][2];
  for (int i = 0; i < kernel_mr; ++i)
  {
    acc[i][0] = _mm512_setzero_ps();
    acc[i][1] = _mm512_setzero_ps();
  }
  for (std::size_t p = 0; p < kc; p += 2)
  {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + 2 * vector_floats);
    for (int i = 0; i < kernel_mr; ++i)
    {
      std::int32_t word;
      std::memcpy(&word, a + 2 * i, sizeof word);
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(word);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
    }
    a += 2 * kernel_mr;
    b += 2 * kernel_nr;
  }
  for (int i = 0; i < kernel_mr; ++i)
  {
    for (int v = 0; v < 2; ++v)
    {
      float* ci = c + i * ldc + v * vector_floats;
      _mm512_storeu_ps(ci, accumulate ? _mm512_add_ps(_mm512_loadu_ps(ci), acc[i][v]) : acc[i][v]);
    }
  }
}
} // namespace kernel
#endif

/// Products per micro-kernel call: a longer reduction is summed in slices of kernel_kc, each added to C once (see
/// micro_kernel), so no rounding chain is longer than kernel_kc + the number of slices. Loading and storing C once
/// per slice costs ~MR NR / (kernel_kc (MR + NR)) of the products' memory traffic (~2% on AVX-512).
inline constexpr std::size_t kernel_kc = 128;
static_assert(kernel_kc % 2 == 0, "slices of the pair layouts hold whole pairs");

/// C (m_pad x n_pad, ld ldc; m_pad, n_pad multiples of MR, NR) (+)= A B with A as a_panels [m_pad/MR][a_kc][MR] of
/// which the first kc steps are used (a_kc 0: kc) and B as b_panels whose panel c starts at b + c * b_panel_stride and
/// holds [kc][NR] (E = float), or the pair layouts (E = std::uint16_t, bfloat16 bits, kc even; only where bf16_dot).
/// Strides and offsets count elements.
template <class E>
CONTRASTIVE_NOINLINE void gemm_packed(std::size_t m_pad,
                                      std::size_t n_pad,
                                      std::size_t kc,
                                      const E* a,
                                      const E* b,
                                      std::size_t b_panel_stride,
                                      float* c,
                                      std::size_t ldc,
                                      bool accumulate,
                                      std::size_t a_kc = 0) noexcept
{
  static_assert(std::is_same_v<E, float> || (std::is_same_v<E, std::uint16_t> && bf16_dot),
                "gemm_packed: float operands, or bfloat16 pairs where this build has the bf16 kernel (bf16_dot)");
  a_kc = a_kc == 0 ? kc : a_kc;
#if CONTRASTIVE_AMX_COMPILED
  if constexpr (std::is_same_v<E, std::uint16_t>)
  {
    static_assert(kernel_mr == static_cast<int>(amx::a_panel_rows) && kernel_nr == static_cast<int>(amx::block_cols),
                  "the tiles read the AVX-512 pair layouts");
    const amx::state tiles_state = amx::status();
    if (tiles_state == amx::state::active)
    {
      amx::hardware_tiles tiles;
      amx::gemm_pairs(tiles, m_pad, n_pad, kc, a, b, b_panel_stride, c, ldc, accumulate, a_kc);
      return;
    }
    if (tiles_state == amx::state::emulated)
    {
      amx::emulated_tiles tiles;
      amx::gemm_pairs(tiles, m_pad, n_pad, kc, a, b, b_panel_stride, c, ldc, accumulate, a_kc);
      return;
    }
  }
#endif
  for (std::size_t jc = 0; jc < n_pad; jc += kernel_nr)
  {
    const E* bp = b + (jc / kernel_nr) * b_panel_stride;
    for (std::size_t ic = 0; ic < m_pad; ic += kernel_mr)
    {
      const E* ap = a + ic * a_kc;
      float* cp = c + ic * ldc + jc;
      for (std::size_t p0 = 0; p0 < kc || p0 == 0; p0 += kernel_kc)
      {
        const std::size_t len = std::min(kernel_kc, kc - p0);
        kernel::micro_kernel(len, ap + p0 * kernel_mr, bp + p0 * kernel_nr, cp, ldc, accumulate || p0 != 0);
      }
    }
  }
}

/// Packs rows [0, rows) of a float row-major matrix (ld ld, k columns used) as a_panels [rows_pad/MR][k][MR], padding
/// rows with zeros up to rows_pad.
inline void pack_a(const float* src, std::size_t ld, std::size_t rows, std::size_t rows_pad, std::size_t k, float* dst)
{
  for (std::size_t r0 = 0; r0 < rows_pad; r0 += kernel_mr)
  {
    float* panel = dst + r0 * k;
    for (std::size_t p = 0; p < k; ++p)
    {
      for (int i = 0; i < kernel_mr; ++i)
      {
        const std::size_t r = r0 + static_cast<std::size_t>(i);
        panel[p * kernel_mr + i] = r < rows ? src[r * ld + p] : 0.0f;
      }
    }
  }
}

/// Packs the transpose: columns [0, cols) of a float row-major matrix (ld ld, k rows used) as a_panels of its transpose
/// [cols_pad/MR][k][MR], padding with zeros.
inline void
pack_a_transposed(const float* src, std::size_t ld, std::size_t cols, std::size_t cols_pad, std::size_t k, float* dst)
{
  for (std::size_t c0 = 0; c0 < cols_pad; c0 += kernel_mr)
  {
    float* panel = dst + c0 * k;
    if (c0 + kernel_mr <= cols)
    {
      for (std::size_t p = 0; p < k; ++p)
      {
        std::memcpy(panel + p * kernel_mr, src + p * ld + c0, kernel_mr * sizeof(float));
      }
      continue;
    }
    for (std::size_t p = 0; p < k; ++p)
    {
      for (int j = 0; j < kernel_mr; ++j)
      {
        const std::size_t c = c0 + static_cast<std::size_t>(j);
        panel[p * kernel_mr + j] = c < cols ? src[p * ld + c] : 0.0f;
      }
    }
  }
}

/// pack_a into the pair layout: rows [0, rows) of a float row-major matrix (ld ld, k columns used) rounded to
/// bfloat16 as a_pairs [rows_pad/MR][kc/2][MR][2], kc = round_up(k, 2), zero beyond rows and k. Returns kc.
inline std::size_t pack_a_pairs(
    const float* src, std::size_t ld, std::size_t rows, std::size_t rows_pad, std::size_t k, std::uint16_t* dst)
{
  const std::size_t kc = round_up(k, 2);
  for (std::size_t r0 = 0; r0 < rows_pad; r0 += kernel_mr)
  {
    std::uint16_t* panel = dst + r0 * kc;
    for (int i = 0; i < kernel_mr; ++i)
    {
      const std::size_t r = r0 + static_cast<std::size_t>(i);
      std::uint16_t* out = panel + 2 * i;
      if (r >= rows)
      {
        for (std::size_t p = 0; p < kc; p += 2)
        {
          out[p * kernel_mr] = 0;
          out[p * kernel_mr + 1] = 0;
        }
        continue;
      }
      const float* x = src + r * ld;
      std::size_t p = 0;
      for (; p + 2 <= k; p += 2)
      {
        out[p * kernel_mr] = bf16_round_bits(x[p]);
        out[p * kernel_mr + 1] = bf16_round_bits(x[p + 1]);
      }
      if (p < k)
      {
        out[p * kernel_mr] = bf16_round_bits(x[p]);
        out[p * kernel_mr + 1] = 0;
      }
    }
  }
  return kc;
}

/// pack_a_transposed into the pair layout: columns [0, cols) of a float row-major matrix (ld ld, k rows used, k
/// even) rounded to bfloat16 as a_pairs of its transpose [cols_pad/MR][k/2][MR][2], zero beyond cols; panels
/// panel_k steps apart (0: k), so that several matrices may fill consecutive steps of one deeper operand.
inline void pack_a_transposed_pairs(const float* src,
                                    std::size_t ld,
                                    std::size_t cols,
                                    std::size_t cols_pad,
                                    std::size_t k,
                                    std::uint16_t* dst,
                                    std::size_t panel_k = 0)
{
  panel_k = panel_k == 0 ? k : panel_k;
  for (std::size_t c0 = 0; c0 < cols_pad; c0 += kernel_mr)
  {
    std::uint16_t* panel = dst + c0 * panel_k;
    const std::size_t have = c0 < cols ? std::min<std::size_t>(kernel_mr, cols - c0) : 0;
    for (std::size_t p = 0; p < k; p += 2)
    {
      const float* x0 = src + p * ld + c0;
      const float* x1 = x0 + ld;
      std::uint16_t* out = panel + p * kernel_mr;
      for (std::size_t j = 0; j < static_cast<std::size_t>(kernel_mr); ++j)
      {
        out[2 * j] = j < have ? bf16_round_bits(x0[j]) : std::uint16_t(0);
        out[2 * j + 1] = j < have ? bf16_round_bits(x1[j]) : std::uint16_t(0);
      }
    }
  }
}
} // namespace host
} // namespace contrastive
