// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Tile shapes of the device kernels: one traits type per element type (and, when it matters, architecture).
///
/// Every kernel is a 256-thread block owning `block_m` rows of its A operand and walking the B operand in tiles of
/// `block_n` rows; `block_k` is the reduction depth staged through shared memory per step and `d_chunk` the width of
/// the dA accumulator chunk in the backward product. `use_tensor_cores` selects WMMA (16x16x16, fp32 accumulate)
/// for the 16-bit types and FP32 FMA on CUDA cores for float.

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
  static_assert(block_m == 64 && block_n == 64 && threads == 256, "the thread mappings below assume 64x64 tiles");
};
} // namespace device
} // namespace contrastive
