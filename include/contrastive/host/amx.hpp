// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// AMX tiles for the bfloat16 products (`tdpbf16ps`), chosen at run time where the CPU has AMX-BF16 and the
/// operating system grants the tile state; otherwise the AVX512-BF16 micro-kernel of gemm.hpp runs.
///
/// The tiles consume the pair layouts of gemm.hpp unchanged (so every caller, scratch size and byte count stays as it
/// is): a b_pairs panel [kc/2][32][2] is two B tiles side by side (16 pair-rows x 16 columns each, row stride 128
/// bytes); the A operand, a_pairs [rows/8][kc/2][8][2], holds a row's pairs 32 bytes apart, so each 32-row block is
/// copied once per 256 pairs into rows of contiguous pairs (the A tiles' layout) and reused across every column block.
///
///   tmm0..tmm3  C, 16 x 16 float: the 32 x 32 block (rows 0-15 | 16-31) x (columns 0-15 | 16-31)
///   tmm4, tmm5  A, 16 rows x 16 pairs: rows 0-15 and 16-31 of the block
///   tmm6, tmm7  B, 16 pairs x 16 columns: columns 0-15 and 16-31
///
/// Numerics (Intel SDM, TDPBF16PS): each instruction accumulates the even and the odd products of its 16 pairs in two
/// float FMA chains from zero (round to nearest even, denormal inputs and results flushed to zero) and adds their sum
/// to C. Every product of two bfloat16 values is exact in float, so as with vdpbf16ps only the summation order
/// changes; the longest rounding chain is 16 products plus one addition per 16 pairs. An element's order depends only
/// on kc and on whether C is accumulated, never on where its row or column sits, so a partial block (staged through
/// a zero-padded copy) sums exactly like a whole one.
///
/// `emulated_tiles` executes the same driver in plain C++ following the SDM's operation, so the layout logic is tested
/// on every AVX-512 build; `hardware_tiles` runs only where `active()` (CPUID, XCR0, and Linux's arch_prctl
/// permission for XTILEDATA) says so. CONTRASTIVE_HOST_AMX=0 in the environment (or any value but 1 or emulate) turns
/// the tiles off for the process (read once); CONTRASTIVE_HOST_AMX=emulate runs every bfloat16 product of the process
/// through the driver on `emulated_tiles` (slow: for tests of the whole loss where no AMX exists); defining
/// CONTRASTIVE_NO_AMX removes the tiles at compile time.
///
/// A process-wide effect: asking Linux for the tile state enlarges the process's signal frames, and from then on a
/// sigaltstack() smaller than the AMX signal frame fails with ENOMEM (where a too-small alternate stack already
/// exists, Linux refuses the request and the AVX512-BF16 kernel runs). Programs that install small alternate signal
/// stacks after the first bfloat16 product should set CONTRASTIVE_HOST_AMX=0.

#include <contrastive/detail/config.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__linux__) && defined(__AVX512F__) && !defined(CONTRASTIVE_NO_AMX) &&               \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define CONTRASTIVE_AMX_COMPILED 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define CONTRASTIVE_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#else
#define CONTRASTIVE_AMX_COMPILED 0
#define CONTRASTIVE_AMX_TARGET
#endif

namespace contrastive
{
namespace host
{
namespace amx
{
/// Whether this build carries the tile path (x86-64 Linux, an AVX-512 target, GCC >= 11 or clang >= 12).
inline constexpr bool compiled = CONTRASTIVE_AMX_COMPILED != 0;

inline constexpr std::size_t tile_rows = 16;      ///< rows of every tile
inline constexpr std::size_t tile_pairs = 16;     ///< pairs in an A row, pair-rows in a B tile (64 bytes)
inline constexpr std::size_t tile_cols = 16;      ///< floats in a C row, columns in a B tile (64 bytes)
inline constexpr std::size_t block_rows = 32;     ///< C rows per block: A tiles tmm4, tmm5
inline constexpr std::size_t block_cols = 32;     ///< C columns per block: B tiles tmm6, tmm7 (the b_pairs width)
inline constexpr std::size_t a_block_pairs = 256; ///< pairs of A copied at once: 32 KiB on the stack
inline constexpr std::size_t a_panel_rows = 8;    ///< rows of an a_pairs panel (the AVX-512 kernel_mr)

/// Why the tiles run or not, for logs and test skips.
enum class state
{
  active,
  emulated,
  not_compiled,
  disabled_by_environment,
  cpu_lacks_amx_bf16,
  os_lacks_tile_state,
  permission_refused
};

inline const char* describe(state s) noexcept
{
  switch (s)
  {
  case state::active:
    return "AMX-BF16 tiles active";
  case state::emulated:
    return "CONTRASTIVE_HOST_AMX=emulate: the tile driver on a plain C++ model of the instruction (slow; for tests)";
  case state::not_compiled:
    return "this build carries no AMX path (needs x86-64 Linux, an AVX-512 target and GCC >= 11 or clang >= 12)";
  case state::disabled_by_environment:
    return "CONTRASTIVE_HOST_AMX is set to turn the tiles off (any value but 1 or emulate)";
  case state::cpu_lacks_amx_bf16:
    return "the CPU has no AMX-TILE/AMX-BF16 (CPUID leaf 7)";
  case state::os_lacks_tile_state:
    return "the OS does not enable the tile state in XCR0";
  case state::permission_refused:
    return "Linux refused ARCH_REQ_XCOMP_PERM for XTILEDATA (kernel older than 5.16?)";
  }
  return "unknown";
}

#if CONTRASTIVE_AMX_COMPILED
inline state probe() noexcept
{
  // Unset, empty or "1": the tiles where the machine has them; "emulate": the model; anything else ("0", "off", ...)
  // turns them off, so that a misspelt request to disable them is never read as consent.
  const char* env = std::getenv("CONTRASTIVE_HOST_AMX");
  if (env != nullptr && std::strcmp(env, "emulate") == 0)
  {
    return state::emulated;
  }
  if (env != nullptr && env[0] != '\0' && std::strcmp(env, "1") != 0)
  {
    return state::disabled_by_environment;
  }
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0)
  {
    return state::cpu_lacks_amx_bf16;
  }
  const bool amx_bf16 = (edx >> 22) & 1u, amx_tile = (edx >> 24) & 1u;
  if (!amx_bf16 || !amx_tile)
  {
    return state::cpu_lacks_amx_bf16;
  }
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0 || ((ecx >> 27) & 1u) == 0) // OSXSAVE: xgetbv is allowed
  {
    return state::os_lacks_tile_state;
  }
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0u));
  (void)hi; // XCR0 bits 17 and 18 are in the low half
  constexpr unsigned xtilecfg = 1u << 17, xtiledata = 1u << 18;
  if ((lo & (xtilecfg | xtiledata)) != (xtilecfg | xtiledata))
  {
    return state::os_lacks_tile_state;
  }
  constexpr long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18; // asm/prctl.h, Linux >= 5.16
  if (syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) != 0)
  {
    return state::permission_refused;
  }
  return state::active;
}
#else
inline state probe() noexcept
{
  return state::not_compiled;
}
#endif

/// The process's answer, probed once (the permission request is per process, so every thread may use the tiles).
inline state status() noexcept
{
  static const state s = probe();
  return s;
}

/// Whether the hardware tiles run (not the emulation).
inline bool active() noexcept
{
  return status() == state::active;
}

#if CONTRASTIVE_AMX_COMPILED
/// The 64-byte LDTILECFG operand, palette 1: every tile 16 rows x 64 bytes.
struct alignas(64) tile_config
{
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved0[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};
static_assert(sizeof(tile_config) == 64, "LDTILECFG reads 64 bytes");

inline constexpr tile_config block_config() noexcept
{
  tile_config cfg;
  for (int t = 0; t < 8; ++t)
  {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<std::uint8_t>(tile_rows);
  }
  return cfg;
}

/// LDTILECFG with the whole 64-byte operand visible to the compiler. (GCC's _tile_loadconfig declares a read of only 8
/// bytes, so the optimiser may drop the stores of the rows and column widths: tiles of 0 rows.) A static object, so its
/// bytes are never stores that could be dropped at all.
CONTRASTIVE_AMX_TARGET inline void load_config(const tile_config& cfg) noexcept
{
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
}

/// STTILECFG: the configuration in force (all zeros where none is), for tests.
CONTRASTIVE_AMX_TARGET inline tile_config stored_config() noexcept
{
  tile_config cfg;
  __asm__ volatile("sttilecfg %0" : "=m"(cfg) : : "memory");
  return cfg;
}

inline constexpr tile_config block_tile_config = block_config();

/// The tiles themselves. Tile numbers are immediates of the instructions, hence the switches.
struct hardware_tiles
{
  CONTRASTIVE_AMX_TARGET void configure() noexcept
  {
    load_config(block_tile_config);
  }
  CONTRASTIVE_AMX_TARGET void release() noexcept
  {
    _tile_release();
  }
  CONTRASTIVE_AMX_TARGET void zero_c(int t) noexcept
  {
    switch (t)
    {
    case 0:
      _tile_zero(0);
      break;
    case 1:
      _tile_zero(1);
      break;
    case 2:
      _tile_zero(2);
      break;
    default:
      _tile_zero(3);
      break;
    }
  }
  /// C tile t from 16 rows of 16 floats, ld floats apart.
  CONTRASTIVE_AMX_TARGET void load_c(int t, const float* p, std::size_t ld) noexcept
  {
    __asm__ volatile("" : : : "memory"); // GCC's _tile_loadd declares no memory read: order the stores before it
    const long stride = static_cast<long>(ld * sizeof(float));
    switch (t)
    {
    case 0:
      _tile_loadd(0, p, stride);
      break;
    case 1:
      _tile_loadd(1, p, stride);
      break;
    case 2:
      _tile_loadd(2, p, stride);
      break;
    default:
      _tile_loadd(3, p, stride);
      break;
    }
  }
  CONTRASTIVE_AMX_TARGET void store_c(int t, float* p, std::size_t ld) noexcept
  {
    const long stride = static_cast<long>(ld * sizeof(float));
    switch (t)
    {
    case 0:
      _tile_stored(0, p, stride);
      break;
    case 1:
      _tile_stored(1, p, stride);
      break;
    case 2:
      _tile_stored(2, p, stride);
      break;
    default:
      _tile_stored(3, p, stride);
      break;
    }
  }
  /// A tile t (0, 1) from 16 rows of 16 pairs, ld 32-bit words apart.
  CONTRASTIVE_AMX_TARGET void load_a(int t, const std::uint32_t* p, std::size_t ld) noexcept
  {
    __asm__ volatile("" : : : "memory");
    const long stride = static_cast<long>(ld * sizeof(std::uint32_t));
    if (t == 0)
    {
      _tile_loadd(4, p, stride);
    }
    else
    {
      _tile_loadd(5, p, stride);
    }
  }
  /// B tile t (0, 1) from 16 pair-rows of 16 columns, ld 32-bit words apart.
  CONTRASTIVE_AMX_TARGET void load_b(int t, const std::uint32_t* p, std::size_t ld) noexcept
  {
    __asm__ volatile("" : : : "memory");
    const long stride = static_cast<long>(ld * sizeof(std::uint32_t));
    if (t == 0)
    {
      _tile_loadd(6, p, stride);
    }
    else
    {
      _tile_loadd(7, p, stride);
    }
  }
  /// C(i, j) += A_i B_j for the four tiles of the block.
  CONTRASTIVE_AMX_TARGET void dot() noexcept
  {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
};
#endif

/// The same operations in plain C++, following the SDM's operation of TDPBF16PS (per row: even and odd products in
/// two FMA chains from zero, DAZ and FTZ, then their sum added to C): the layouts are tested where no AMX exists.
struct emulated_tiles
{
  float c[4][tile_rows][tile_cols];
  std::uint32_t a[2][tile_rows][tile_pairs];
  std::uint32_t b[2][tile_pairs][tile_cols];

  void configure() noexcept {}
  void release() noexcept {}
  void zero_c(int t) noexcept
  {
    std::memset(c[t], 0, sizeof c[t]);
  }
  void load_c(int t, const float* p, std::size_t ld) noexcept
  {
    for (std::size_t r = 0; r < tile_rows; ++r)
    {
      std::memcpy(c[t][r], p + r * ld, sizeof c[t][r]);
    }
  }
  void store_c(int t, float* p, std::size_t ld) const noexcept
  {
    for (std::size_t r = 0; r < tile_rows; ++r)
    {
      std::memcpy(p + r * ld, c[t][r], sizeof c[t][r]);
    }
  }
  void load_a(int t, const std::uint32_t* p, std::size_t ld) noexcept
  {
    for (std::size_t r = 0; r < tile_rows; ++r)
    {
      std::memcpy(a[t][r], p + r * ld, sizeof a[t][r]);
    }
  }
  void load_b(int t, const std::uint32_t* p, std::size_t ld) noexcept
  {
    for (std::size_t r = 0; r < tile_pairs; ++r)
    {
      std::memcpy(b[t][r], p + r * ld, sizeof b[t][r]);
    }
  }
  static float flush(float x) noexcept
  {
    return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x;
  }
  static float widen(std::uint32_t word, int half) noexcept
  {
    const std::uint32_t bits = half == 0 ? (word << 16) : (word & 0xffff0000u);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return flush(f);
  }
  void dot() noexcept
  {
    for (int t = 0; t < 4; ++t)
    {
      const int ta = t / 2, tb = t % 2;
      for (std::size_t m = 0; m < tile_rows; ++m)
      {
        for (std::size_t n = 0; n < tile_cols; ++n)
        {
          float even = 0.0f, odd = 0.0f;
          for (std::size_t k = 0; k < tile_pairs; ++k)
          {
            even = flush(std::fma(widen(a[ta][m][k], 0), widen(b[tb][k][n], 0), even));
            odd = flush(std::fma(widen(a[ta][m][k], 1), widen(b[tb][k][n], 1), odd));
          }
          c[t][m][n] = flush(c[t][m][n] + flush(even + odd));
        }
      }
    }
  }
};

/// C (m_pad x n_pad, ld ldc) (+)= A B over the pair layouts of gemm.hpp (a_pairs panels of a_panel_rows rows and a_kc
/// steps, of which the first kc are used (a_kc 0: kc); b_pairs panels of block_cols columns b_panel_stride elements
/// apart; kc even), on the tiles `t`.
template <class Tiles>
CONTRASTIVE_AMX_TARGET void gemm_pairs(Tiles& t,
                                       std::size_t m_pad,
                                       std::size_t n_pad,
                                       std::size_t kc,
                                       const std::uint16_t* a,
                                       const std::uint16_t* b,
                                       std::size_t b_panel_stride,
                                       float* c,
                                       std::size_t ldc,
                                       bool accumulate,
                                       std::size_t a_kc = 0) noexcept
{
  a_kc = a_kc == 0 ? kc : a_kc;
  const std::size_t kp = kc / 2;
  alignas(64) std::uint32_t ar[block_rows * a_block_pairs]; // 32 rows of contiguous pairs
  alignas(64) std::uint32_t bt[tile_pairs * block_cols];    // a partial last pair step of B, zero-padded
  alignas(64) float ct[block_rows * block_cols];            // a partial last row block of C
  t.configure();
  for (std::size_t i0 = 0; i0 < m_pad; i0 += block_rows)
  {
    const std::size_t rows = std::min(block_rows, m_pad - i0);
    for (std::size_t p0 = 0; p0 < kp || p0 == 0; p0 += a_block_pairs)
    {
      const std::size_t pairs = std::min(a_block_pairs, kp - p0);
      const std::size_t steps = (pairs + tile_pairs - 1) / tile_pairs;
      const std::size_t width = std::max<std::size_t>(steps, 1) * tile_pairs; // words per row of ar
      for (std::size_t r = 0; r < block_rows; ++r)
      {
        std::uint32_t* out = ar + r * width;
        const std::size_t have = r < rows ? pairs : 0;
        const std::size_t row = i0 + r;
        const std::uint16_t* pair =
            a + (row / a_panel_rows) * a_panel_rows * a_kc + (p0 * a_panel_rows + row % a_panel_rows) * 2;
        for (std::size_t q = 0; q < have; ++q)
        {
          std::memcpy(out + q, pair + q * a_panel_rows * 2, sizeof(std::uint32_t));
        }
        std::memset(out + have, 0, (width - have) * sizeof(std::uint32_t));
      }
      // The pair-rows of a partial last step (the same count in every panel) come through bt, whose rows beyond them
      // stay zero.
      const std::size_t tail = pairs % tile_pairs;
      if (tail != 0)
      {
        std::memset(bt, 0, sizeof bt);
      }
      const bool from_zero = p0 == 0 && !accumulate;
      for (std::size_t j0 = 0; j0 < n_pad; j0 += block_cols)
      {
        const std::uint16_t* bp = b + (j0 / block_cols) * b_panel_stride + p0 * 2 * block_cols;
        float* cp = c + i0 * ldc + j0;
        std::size_t ld = ldc;
        const bool staged = rows < block_rows;
        if (staged)
        {
          for (std::size_t r = 0; r < block_rows; ++r)
          {
            for (std::size_t col = 0; col < block_cols; ++col)
            {
              ct[r * block_cols + col] = r < rows && !from_zero ? cp[r * ldc + col] : 0.0f;
            }
          }
          cp = ct;
          ld = block_cols;
        }
        auto c_tile = [&](int ti)
        {
          return cp + static_cast<std::size_t>(ti / 2) * tile_rows * ld + static_cast<std::size_t>(ti % 2) * tile_cols;
        };
        for (int ti = 0; ti < 4; ++ti)
        {
          if (from_zero && !staged)
          {
            t.zero_c(ti);
          }
          else
          {
            t.load_c(ti, c_tile(ti), ld);
          }
        }
        for (std::size_t s = 0; s < steps; ++s)
        {
          t.load_a(0, ar + s * tile_pairs, width);
          t.load_a(1, ar + tile_rows * width + s * tile_pairs, width);
          const std::uint16_t* bs = bp + s * tile_pairs * 2 * block_cols;
          const std::uint32_t* bw = reinterpret_cast<const std::uint32_t*>(bs);
          if (tail != 0 && s + 1 == steps)
          {
            std::memcpy(bt, bs, tail * block_cols * sizeof(std::uint32_t));
            bw = bt;
          }
          t.load_b(0, bw, block_cols);
          t.load_b(1, bw + tile_cols, block_cols);
          t.dot();
        }
        for (int ti = 0; ti < 4; ++ti)
        {
          t.store_c(ti, c_tile(ti), ld);
        }
        if (staged)
        {
          for (std::size_t r = 0; r < rows; ++r)
          {
            std::memcpy(c + (i0 + r) * ldc + j0, ct + r * block_cols, block_cols * sizeof(float));
          }
        }
      }
    }
  }
  t.release();
}
} // namespace amx
} // namespace host
} // namespace contrastive
