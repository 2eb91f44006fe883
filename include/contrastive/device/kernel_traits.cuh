// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Tile shapes of the device kernels: one traits type per element type (and, when it matters, architecture).
///
/// Every kernel is a 256-thread block owning `block_m` rows of its A operand and walking the B operand in tiles of
/// `block_n` rows; `block_k` is the reduction depth staged through shared memory per step and `d_chunk` the width of
/// the dA accumulator chunk in the backward product. `use_tensor_cores` selects WMMA (16x16x16, fp32 accumulate)
/// for the 16-bit types and FP32 FMA on CUDA cores for float.
///
/// `scale_gradient_tile` (fp16 only): the fused backward stores its G = dL/dS tile as `T` for the tensor-core
/// product. Divided by the larger coefficient, G sits in [-2, 1] with most entries near P ~ 1/n, which falls below
/// fp16's normal range (2^-14) from n ~ 16384 and then loses digits or flushes to zero. The tile is therefore
/// multiplied by 2^k, k = `gradient_tile_shift(n)` = ceil(log2 n) clamped to `max_gradient_shift`, before it is
/// rounded, and the float product is multiplied by 2^-k afterwards (both exact: powers of two). bf16 has float's
/// exponent range and float is not rounded, so both keep the unscaled tile.

#include <contrastive/detail/config.hpp>
#include <contrastive/numeric/element_traits.hpp>

#include <type_traits>

namespace contrastive
{
namespace device
{
template <class T>
struct kernel_traits
{
  static constexpr int threads = 256;
  static constexpr int block_m = 64;
  static constexpr int block_n = 64;
  static constexpr int d_chunk = 64;
  static constexpr bool use_tensor_cores = !std::is_same_v<T, float>;
  // fp32 tiles are twice the bytes: a shallower k step keeps the static shared memory under 48 KiB.
  static constexpr int block_k = use_tensor_cores ? 32 : 16;
  /// Padding (in elements) of shared-memory rows: breaks bank conflicts, keeps WMMA's 16-byte alignment.
  static constexpr int pad = use_tensor_cores ? 8 : 1;
  static constexpr int s_ld = block_n + 4; ///< float S/G tile leading dimension
  /// fp16 only: the backward G tile is scaled by 2^gradient_tile_shift(n) before it is rounded (see the file comment).
  static constexpr bool scale_gradient_tile = std::is_same_v<T, __half>;
  /// |G| <= 2 after the coefficient normalisation: 2 * 2^13 = 16384 is a quarter of fp16's largest, 65504.
  static constexpr int max_gradient_shift = 13;
  static_assert(block_m == 64 && block_n == 64 && threads == 256, "the thread mappings below assume 64x64 tiles");
};

/// ceil(log2 n) clamped to [0, max_shift]: the exponent k of the fp16 gradient tile's scale 2^k ~ n.
CONTRASTIVE_HOST_DEVICE constexpr int gradient_tile_shift(long long n, int max_shift) noexcept
{
  int k = 0;
  while (k < max_shift && (1LL << k) < n)
  {
    ++k;
  }
  return k;
}
} // namespace device
} // namespace contrastive
