// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The index arithmetic of the tensor-core logits tile (device/logits_tile.cuh), apart from the kernels so that a
/// host test (tests/tile_layout_test.cpp) can check it against the PTX ISA's fragment tables without a GPU: which
/// shared-memory row each lane hands to ldmatrix, where each accumulator of mma.m16n8k16 sits in the tile, which lanes
/// share a row or a column (the shuffle partners), which warp owns which sub-tile and which thread loads which 16
/// bytes of a stage. Plain C++ (constexpr, host and device).

#include <contrastive/detail/config.hpp>

namespace contrastive
{
namespace device
{
namespace logits_tile
{
/// Block tile (rows x columns x depth per stage), warp layout, and the shared-memory row pitch.
struct config
{
  static constexpr int bm = 128;
  static constexpr int bn = 128;
  static constexpr int bk = 32;
  static constexpr int warps_m = 2;
  static constexpr int warps_n = 4;
  static constexpr int threads = 32 * warps_m * warps_n;
  static constexpr int wm = bm / warps_m; // 64 rows per warp
  static constexpr int wn = bn / warps_n; // 32 columns per warp
  static constexpr int mt = wm / 16;      // m16 tiles per warp
  static constexpr int nt = wn / 8;       // n8 tiles per warp
  /// 40 elements (80 bytes) per shared row: 16-byte aligned for cp.async and ldmatrix, and the 8 row addresses of
  /// one ldmatrix phase fall into 8 distinct 16-byte bank groups (80 / 16 = 5 is odd), so no bank conflicts.
  static constexpr int pitch = bk + 8;
  static constexpr int stages = 2;
  /// Chunk granularity of the global loads: 8 16-bit elements = 16 bytes.
  static constexpr int vec = 8;
  static constexpr int chunks_per_row = bk / vec;
  static constexpr int a_loads = bm * chunks_per_row / threads; // 16-byte loads per thread and stage
  static constexpr int b_loads = bn * chunks_per_row / threads;
};

static_assert(config::bk % 16 == 0 && config::wm % 16 == 0 && config::wn % 16 == 0, "tile shape");
static_assert((config::bm * config::chunks_per_row) % config::threads == 0, "A stage load");
static_assert((config::bn * config::chunks_per_row) % config::threads == 0, "B stage load");

/// Lane and thread arithmetic (g = lane / 4, t = lane % 4 in the PTX ISA's notation).
struct lane_map
{
  // ldmatrix.x4: lane l supplies the address of row l % 8 of matrix l / 8; register i of every lane receives row
  // lane / 4, elements 2 (lane % 4) and + 1, of matrix i.

  /// A operand (16 x 16, row-major, at depth ks): matrices = rows 0-7 and 8-15 at depth 0-7, then the same at depth
  /// 8-15, which are the registers a0..a3 of mma.m16n8k16 in order.
  CONTRASTIVE_HOST_DEVICE static constexpr int a_row(int lane) noexcept
  {
    return lane % 16;
  }
  CONTRASTIVE_HOST_DEVICE static constexpr int a_depth(int lane) noexcept
  {
    return (lane / 16) * 8;
  }
  /// B operand (two n8 tiles stored n-major with depth contiguous, the ".col" operand): matrices = n8 tile 0 at
  /// depth 0-7 and 8-15 (b0, b1 of the first mma), then n8 tile 1 likewise (b0, b1 of the second).
  CONTRASTIVE_HOST_DEVICE static constexpr int b_row(int lane) noexcept
  {
    return lane % 8 + (lane / 16) * 8;
  }
  CONTRASTIVE_HOST_DEVICE static constexpr int b_depth(int lane) noexcept
  {
    return ((lane / 8) % 2) * 8;
  }
  /// Accumulator c[2 h + e] of an m16n8 tile: row g + 8 h, column 2 t + e.
  CONTRASTIVE_HOST_DEVICE static constexpr int c_row(int lane, int h) noexcept
  {
    return lane / 4 + 8 * h;
  }
  CONTRASTIVE_HOST_DEVICE static constexpr int c_col(int lane, int e) noexcept
  {
    return 2 * (lane % 4) + e;
  }
  /// Shuffle partners: lanes holding the same rows differ in bits 0-1, the same columns in bits 2-4.
  static constexpr int row_shuffles = 2;
  static constexpr int col_shuffles = 3;
  CONTRASTIVE_HOST_DEVICE static constexpr int row_xor(int i) noexcept
  {
    return 1 << i;
  }
  CONTRASTIVE_HOST_DEVICE static constexpr int col_xor(int i) noexcept
  {
    return 4 << i;
  }
  /// One lane per row (t == 0) and one per column (g == 0) writes the warp's merged partial.
  CONTRASTIVE_HOST_DEVICE static constexpr bool row_writer(int lane) noexcept
  {
    return lane % 4 == 0;
  }
  CONTRASTIVE_HOST_DEVICE static constexpr bool col_writer(int lane) noexcept
  {
    return lane / 4 == 0;
  }
  /// The warp's sub-tile origin within the block tile.
  CONTRASTIVE_HOST_DEVICE static constexpr int warp_row(int warp) noexcept
  {
    return (warp / config::warps_n) * config::wm;
  }
  CONTRASTIVE_HOST_DEVICE static constexpr int warp_col(int warp) noexcept
  {
    return (warp % config::warps_n) * config::wn;
  }
  /// Index of the warp's slot in the cross-warp reductions: rows merge over warp_n, columns over warp_m.
  CONTRASTIVE_HOST_DEVICE static constexpr int warp_n(int warp) noexcept
  {
    return warp % config::warps_n;
  }
  CONTRASTIVE_HOST_DEVICE static constexpr int warp_m(int warp) noexcept
  {
    return warp / config::warps_n;
  }
  /// Stage loads: the it-th 16-byte load of thread `tid` goes to tile row load_row and depth load_depth.
  CONTRASTIVE_HOST_DEVICE static constexpr int load_row(int tid, int it) noexcept
  {
    return (tid + it * config::threads) / config::chunks_per_row;
  }
  CONTRASTIVE_HOST_DEVICE static constexpr int load_depth(int tid, int it) noexcept
  {
    return ((tid + it * config::threads) % config::chunks_per_row) * config::vec;
  }
};
/// A block's tile in the tile grid (row tile, column tile of the chunk).
struct tile_coord
{
  int row;
  int col;
};

/// Row tiles per group of the block order: blocks start roughly in order of their linear index (x fastest), and
/// grouped_tile walks a group of this many row tiles down each column tile before the next column, so the blocks
/// resident together share a few K tiles in L2 and each K tile comes from HBM once per group, not once per row tile.
inline constexpr int group_rows = 8;

/// The tile of the block with linear index `linear` (blockIdx.y * gridDim.x + blockIdx.x) in a grid of row_tiles x
/// col_tiles blocks: a bijection onto [0, row_tiles) x [0, col_tiles) (the last group may have fewer rows).
CONTRASTIVE_HOST_DEVICE constexpr tile_coord grouped_tile(long long linear, int row_tiles, int col_tiles) noexcept
{
  const long long per_group = static_cast<long long>(group_rows) * col_tiles;
  const long long group = linear / per_group;
  const int first = static_cast<int>(group) * group_rows;
  const int rows_here = row_tiles - first < group_rows ? row_tiles - first : group_rows;
  const long long in = linear - group * per_group;
  return {first + static_cast<int>(in % rows_here), static_cast<int>(in / rows_here)};
}
} // namespace logits_tile
} // namespace device
} // namespace contrastive
