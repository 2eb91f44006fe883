// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
// The tensor-core logits tile's index arithmetic (device/tile_layout.hpp, used by device/logits_tile.cuh) against
// the PTX ISA's definitions of ldmatrix and mma.m16n8k16, emulated lane by lane on the host: the products land where
// the epilogue reads them, the shuffle partners share rows / columns, every element is owned and every stage chunk
// loaded exactly once, and the ldmatrix phases are free of bank conflicts. Runs without a GPU.
#include <contrastive/device/tile_layout.hpp>

#include <gtest/gtest.h>

#include <array>
#include <random>
#include <set>
#include <vector>

namespace td = contrastive::device::logits_tile;
using td::config;
using td::lane_map;

namespace
{
/// One 32-bit register of a fragment: two 16-bit elements (here floats holding small integers, so sums are exact).
struct reg
{
  float v[2];
};

/// ldmatrix.sync.aligned.m8n8.x4 (PTX ISA): the 8 rows of matrix i are at the addresses supplied by threads
/// 8 i .. 8 i + 7; thread t receives in register i the elements 2 (t % 4) and 2 (t % 4) + 1 of row t / 4 of matrix i.
void ldmatrix_x4(const float* const (&addr)[32], reg (&out)[32][4])
{
  for (int t = 0; t < 32; ++t)
  {
    for (int i = 0; i < 4; ++i)
    {
      const float* row = addr[8 * i + t / 4];
      out[t][i] = {{row[2 * (t % 4)], row[2 * (t % 4) + 1]}};
    }
  }
}

/// mma.sync.aligned.m16n8k16.row.col (PTX ISA fragment tables; g = t / 4, c = t % 4):
///   A: a0,a1 (g, 2c + 0/1)  a2,a3 (g + 8, 2c + 0/1)  a4,a5 (g, 2c + 8 + 0/1)  a6,a7 (g + 8, 2c + 8 + 0/1)
///   B: b0,b1 (k = 2c + 0/1, n = g)  b2,b3 (k = 2c + 8 + 0/1, n = g)
///   C: c0,c1 (g, 2c + 0/1)  c2,c3 (g + 8, 2c + 0/1)
void mma_16816(float (&acc)[32][4], const reg (&a)[32][4], const reg (&b)[32][2])
{
  float A[16][16] = {};
  float B[16][8] = {};
  for (int t = 0; t < 32; ++t)
  {
    const int g = t / 4, c = t % 4;
    for (int e = 0; e < 2; ++e)
    {
      A[g][2 * c + e] = a[t][0].v[e];
      A[g + 8][2 * c + e] = a[t][1].v[e];
      A[g][2 * c + 8 + e] = a[t][2].v[e];
      A[g + 8][2 * c + 8 + e] = a[t][3].v[e];
      B[2 * c + e][g] = b[t][0].v[e];
      B[2 * c + 8 + e][g] = b[t][1].v[e];
    }
  }
  for (int t = 0; t < 32; ++t)
  {
    const int g = t / 4, c = t % 4;
    for (int e = 0; e < 2; ++e)
    {
      for (int h = 0; h < 2; ++h)
      {
        float s = 0.0f;
        for (int k = 0; k < 16; ++k)
        {
          s += A[g + 8 * h][k] * B[k][2 * c + e];
        }
        acc[t][2 * h + e] += s;
      }
    }
  }
}
} // namespace

// Shared tiles as the kernel holds them (rows of `pitch` elements), one stage of depth bk; the warp loop of
// tile_product with lane_map's addresses; every accumulator compared with the row . column product it must hold.
TEST(TileLayout, WarpProductsLandWhereTheEpilogueReadsThem)
{
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> val(-4, 4);
  static float sa[config::bm][config::pitch];
  static float sb[config::bn][config::pitch];
  for (auto& row : sa)
  {
    for (float& x : row)
    {
      x = static_cast<float>(val(rng));
    }
  }
  for (auto& row : sb)
  {
    for (float& x : row)
    {
      x = static_cast<float>(val(rng));
    }
  }
  std::vector<int> owner(config::bm * config::bn, 0);
  for (int warp = 0; warp < config::threads / 32; ++warp)
  {
    static float acc[config::mt][config::nt][32][4];
    for (auto& m : acc)
    {
      for (auto& n : m)
      {
        for (auto& l : n)
        {
          for (float& x : l)
          {
            x = 0.0f;
          }
        }
      }
    }
    const int wrow = lane_map::warp_row(warp);
    const int wcol = lane_map::warp_col(warp);
    for (int ks = 0; ks < config::bk; ks += 16)
    {
      reg af[config::mt][32][4];
      for (int mi = 0; mi < config::mt; ++mi)
      {
        const float* addr[32];
        for (int l = 0; l < 32; ++l)
        {
          const int r = wrow + mi * 16 + lane_map::a_row(l);
          const int d = ks + lane_map::a_depth(l);
          ASSERT_LT(r, config::bm);
          ASSERT_LE(d + 8, config::bk); // a 16-byte row segment inside the stage's depth
          ASSERT_EQ(d % 8, 0);
          addr[l] = &sa[r][d];
        }
        ldmatrix_x4(addr, af[mi]);
      }
      for (int nj = 0; nj < config::nt / 2; ++nj)
      {
        const float* addr[32];
        for (int l = 0; l < 32; ++l)
        {
          const int r = wcol + nj * 16 + lane_map::b_row(l);
          const int d = ks + lane_map::b_depth(l);
          ASSERT_LT(r, config::bn);
          ASSERT_LE(d + 8, config::bk);
          ASSERT_EQ(d % 8, 0);
          addr[l] = &sb[r][d];
        }
        reg bf[32][4];
        ldmatrix_x4(addr, bf);
        reg b_lo[32][2], b_hi[32][2];
        for (int l = 0; l < 32; ++l)
        {
          b_lo[l][0] = bf[l][0];
          b_lo[l][1] = bf[l][1];
          b_hi[l][0] = bf[l][2];
          b_hi[l][1] = bf[l][3];
        }
        for (int mi = 0; mi < config::mt; ++mi)
        {
          mma_16816(acc[mi][2 * nj], af[mi], b_lo);
          mma_16816(acc[mi][2 * nj + 1], af[mi], b_hi);
        }
      }
    }
    for (int mi = 0; mi < config::mt; ++mi)
    {
      for (int ni = 0; ni < config::nt; ++ni)
      {
        for (int l = 0; l < 32; ++l)
        {
          for (int h = 0; h < 2; ++h)
          {
            for (int e = 0; e < 2; ++e)
            {
              const int r = wrow + mi * 16 + lane_map::c_row(l, h);
              const int c = wcol + ni * 8 + lane_map::c_col(l, e);
              ASSERT_LT(r, config::bm);
              ASSERT_LT(c, config::bn);
              float want = 0.0f;
              for (int k = 0; k < config::bk; ++k)
              {
                want += sa[r][k] * sb[c][k];
              }
              EXPECT_EQ(acc[mi][ni][l][2 * h + e], want)
                  << "warp " << warp << " lane " << l << " mi " << mi << " ni " << ni << " h " << h << " e " << e;
              ++owner[r * config::bn + c];
            }
          }
        }
      }
    }
  }
  for (int i = 0; i < config::bm * config::bn; ++i)
  {
    ASSERT_EQ(owner[i], 1) << "tile element " << i / config::bn << ", " << i % config::bn;
  }
}

// The butterfly over row_xor merges exactly the lanes that hold the same rows; over col_xor exactly those holding
// the same columns; one writer per group.
TEST(TileLayout, ShufflePartnersShareRowsAndColumns)
{
  for (int l = 0; l < 32; ++l)
  {
    std::set<int> rows{l}, cols{l};
    for (int x = 0; x < lane_map::row_shuffles; ++x)
    {
      std::set<int> next = rows;
      for (int m : rows)
      {
        next.insert(m ^ lane_map::row_xor(x));
      }
      rows = next;
    }
    for (int x = 0; x < lane_map::col_shuffles; ++x)
    {
      std::set<int> next = cols;
      for (int m : cols)
      {
        next.insert(m ^ lane_map::col_xor(x));
      }
      cols = next;
    }
    std::set<int> same_rows, same_cols;
    int row_writers = 0, col_writers = 0;
    for (int m = 0; m < 32; ++m)
    {
      if (lane_map::c_row(m, 0) == lane_map::c_row(l, 0) && lane_map::c_row(m, 1) == lane_map::c_row(l, 1))
      {
        same_rows.insert(m);
        row_writers += lane_map::row_writer(m) ? 1 : 0;
      }
      if (lane_map::c_col(m, 0) == lane_map::c_col(l, 0) && lane_map::c_col(m, 1) == lane_map::c_col(l, 1))
      {
        same_cols.insert(m);
        col_writers += lane_map::col_writer(m) ? 1 : 0;
      }
    }
    EXPECT_EQ(rows, same_rows) << "lane " << l;
    EXPECT_EQ(cols, same_cols) << "lane " << l;
    EXPECT_EQ(row_writers, 1);
    EXPECT_EQ(col_writers, 1);
  }
  // The cross-warp slots: every (warp_m, warp_n) pair once.
  std::set<std::pair<int, int>> slots;
  for (int w = 0; w < config::threads / 32; ++w)
  {
    EXPECT_EQ(lane_map::warp_row(w), lane_map::warp_m(w) * config::wm);
    EXPECT_EQ(lane_map::warp_col(w), lane_map::warp_n(w) * config::wn);
    slots.insert({lane_map::warp_m(w), lane_map::warp_n(w)});
  }
  EXPECT_EQ(slots.size(), std::size_t(config::warps_m * config::warps_n));
}

TEST(TileLayout, StageLoadsCoverEveryChunkOnce)
{
  for (const auto& [rows, loads] : {std::pair<int, int>{config::bm, config::a_loads}, {config::bn, config::b_loads}})
  {
    std::vector<int> seen(rows * config::chunks_per_row, 0);
    for (int tid = 0; tid < config::threads; ++tid)
    {
      for (int it = 0; it < loads; ++it)
      {
        const int r = lane_map::load_row(tid, it);
        const int d = lane_map::load_depth(tid, it);
        ASSERT_GE(r, 0);
        ASSERT_LT(r, rows);
        ASSERT_EQ(d % config::vec, 0);
        ASSERT_LT(d, config::bk);
        ++seen[r * config::chunks_per_row + d / config::vec];
      }
    }
    for (int s : seen)
    {
      EXPECT_EQ(s, 1);
    }
  }
  // 16-byte alignment of every shared row segment (cp.async and ldmatrix need it).
  EXPECT_EQ(config::pitch * 2 % 16, 0);
}

// Each 8-lane phase of an ldmatrix reads 8 x 16 bytes; with 32 four-byte banks it is conflict-free when the eight
// 16-byte segments fall into eight different groups of four banks.
TEST(TileLayout, LdmatrixPhasesAreBankConflictFree)
{
  constexpr int bytes = 2; // 16-bit elements
  for (int ks = 0; ks < config::bk; ks += 16)
  {
    for (int base = 0; base < config::wm; base += 16)
    {
      for (int phase = 0; phase < 4; ++phase)
      {
        std::set<int> a_groups, b_groups;
        for (int l = 8 * phase; l < 8 * phase + 8; ++l)
        {
          const int a_addr = ((base + lane_map::a_row(l)) * config::pitch + ks + lane_map::a_depth(l)) * bytes;
          const int b_addr = ((base + lane_map::b_row(l)) * config::pitch + ks + lane_map::b_depth(l)) * bytes;
          a_groups.insert((a_addr / 16) % 8);
          b_groups.insert((b_addr / 16) % 8);
        }
        EXPECT_EQ(a_groups.size(), 8u) << "A phase " << phase;
        EXPECT_EQ(b_groups.size(), 8u) << "B phase " << phase;
      }
    }
  }
}
