// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The host GEMM backends' interface, and the built-in backend on the packed micro-kernel of host/gemm.hpp.
///
/// A backend `gemm_backend<Tag, T>` owns the prepared keys (and, materialized, queries) and runs the four products
/// of the loss on per-worker scratch:
///   query_block   pack rows [i0, i0 + rows) of Q for the next products          (per row block)
///   key_tiles     fused: pack keys [j0, j0 + cols) into worker scratch           (per key tile or run of tiles)
///   dot_tile      tile (rows x cols, ld block_n) = Q_blk K[j0 : j0 + cols]^T    (logits, unscaled)
///   dq_product    acc (rows x dp) += G K[j0 : j0 + cols], G in the tile
///   dk_block      acc (cols x ·) += G^T Q_blk                                   (fused)
///   dk_queries    acc (cols x dp) += dA^T Q[i0 : i0 + rows], dA in the tile     (materialized)
/// Each product is deterministic: the same call on the same data gives the same bits (the backward's recomputed
/// logits equal the forward's).

#include <contrastive/detail/checked.hpp>
#include <contrastive/host/gemm.hpp>
#include <contrastive/host/operands.hpp>
#include <contrastive/host/thread_pool.hpp>
#include <contrastive/numeric/groups.hpp>
#include <contrastive/problem.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace contrastive
{
namespace host
{
/// Per-worker scratch: one row block's prepared queries, one tile, its packed gradient, one block accumulator, and
/// (symmetric forward) the worker's running column statistics.
struct worker_scratch
{
  std::vector<float> qa;      // query block, first form (builtin: a_panels; cblas: row-major float)
  std::vector<float> qb;      // query block, second form (builtin: b_panels over rows, for dK = G^T Q_blk)
  std::vector<float> tile;    // block_m x block_n logits / gradients
  std::vector<float> ga;      // G as a_panels [block_m / MR][block_n][MR]
  std::vector<float> gt;      // G^T as a_panels [block_n / MR][block_m][MR]
  std::vector<float> acc;     // materialized: max(block_m, block_n) x dp block accumulator
  std::vector<float> panel;   // MR x dp: a partial last row panel of an in-place product
  std::vector<float> kt;      // fused: one key tile as b_panels over keys [dp / NR][block_n][NR] (dQ = G K_tile)
  std::vector<float> kl;      // fused: up to key_run tiles as b_panels over d [cols / NR][d][NR]  (S = Q K^T)
  std::vector<float> col_max; // nk_pad column running max (symmetric forward)
  std::vector<float> col_sum; // nk_pad column running sum
  std::vector<positive_stats> col_pos; // nk_pad columns' positives (grouped symmetric forward)
  // The same operands in the bfloat16 pair layouts of host/gemm.hpp (builtin backend, bfloat16, where bf16_dot):
  std::vector<std::uint16_t> qa16, qb16, ga16, gt16, kt16, kl16;
  std::size_t block_i0 = 0; // the row block prepared by the last query_block
  std::size_t block_rows = 0;
  // dK over several row blocks per product (builtin backend, gemm_backend::dk_depth): the blocks whose G^T and Q
  // wait in gt16 / qb16, and (materialized, chunked) the first one's row.
  std::size_t dk_fill = 0;
  std::size_t dk_i0 = 0;
  std::size_t keys_j0 = 0; // fused: the first key in kl (kl holds keys [keys_j0, keys_j0 + keys_cols))
  std::size_t keys_cols = 0;

  std::size_t capacity_bytes() const noexcept
  {
    return (qa.capacity() + qb.capacity() + tile.capacity() + ga.capacity() + gt.capacity() + acc.capacity() +
            panel.capacity() + kt.capacity() + kl.capacity() + col_max.capacity() + col_sum.capacity()) *
               sizeof(float) +
           col_pos.capacity() * sizeof(positive_stats) +
           (qa16.capacity() + qb16.capacity() + ga16.capacity() + gt16.capacity() + kt16.capacity() + kl16.capacity()) *
               sizeof(std::uint16_t);
  }
};

/// Shapes a backend needs, set by the engine before `prepare`.
struct gemm_shape
{
  std::size_t n_q = 0, n_k = 0, d = 0, dp = 0, nq_pad = 0, nk_pad = 0;
};

template <class Tag, class T>
struct gemm_backend; // specialised by builtin_gemm.hpp and cblas_gemm.hpp

/// Whether `gemm_backend<Tag, T>` is defined (its header included).
template <class Tag>
struct gemm_backend_available : std::false_type
{
};
template <>
struct gemm_backend_available<gemm::builtin> : std::true_type
{
};

template <class T>
struct gemm_backend<gemm::builtin, T>
{
  gemm_shape sh;
  const T* q = nullptr;
  const T* k_src = nullptr;
  std::vector<float> k_logit; // materialized, chunked: K as b_panels over d [nk_pad / NR][d][NR]  (S = Q K^T)
  std::vector<float> k_rows;  // materialized: K as b_panels over keys [dp / NR][nk_pad][NR]     (dQ = dA K)
  std::vector<float> q_rows;  // materialized: Q as b_panels over queries [dp / NR][nq_pad][NR]  (dK = dA^T Q)
  // bfloat16 where bf16_dot: the same three in the pair layouts (16-bit), and every product on the bf16 kernel.
  std::vector<std::uint16_t> k_logit16, k_rows16, q_rows16;

  /// Whether this backend runs its products on the bfloat16 dot-product kernel: T is bfloat16 and the code targets
  /// AVX512-BF16. The logits' product then has the float kernel's numerics (exact products, another summation order,
  /// subnormals flushed); the backward's G is rounded to bfloat16 before its two products (the materialized
  /// algorithm's dA already is; the fused and chunked ones' is float: docs/algorithms.md gives the measured effect).
  static constexpr bool pairs = bf16_dot && std::is_same_v<T, __nv_bfloat16>;
  /// The reduction length of the logits' product: d, or d rounded up to whole pairs.
  static constexpr std::size_t logit_k(std::size_t d) noexcept
  {
    return pairs ? round_up(d, 2) : d;
  }
  /// Floats' worth of n 16-bit values (n even).
  static detail::checked_size halves(detail::checked_size n) noexcept
  {
    return detail::checked_size(n.value / 2 + n.value % 2, n.overflow);
  }

  /// The largest dim the backend can represent (the packed kernel indexes with size_t: no limit of its own).
  static constexpr std::size_t max_dim = static_cast<std::size_t>(-1) / 2;

  /// Workers that may run its products at once: as many as the loss has (its scratch is the engine's).
  static unsigned max_workers() noexcept
  {
    return max_threads;
  }

  /// Floats held for the keys (and queries): fused none (its key tiles are packed into worker scratch as they are
  /// used: no whole copy of K), the others one packed copy of K for the logits, materialized and chunked also K and
  /// Q for their two whole-matrix products.
  static detail::checked_size held_floats(const gemm_shape& s, bool materialized) noexcept
  {
    if (!materialized)
    {
      return detail::checked_size(0);
    }
    const detail::checked_size n =
        detail::checked_size(s.nk_pad) * logit_k(s.d) + (detail::checked_size(s.nk_pad) + s.nq_pad) * s.dp;
    return pairs ? halves(n) : n;
  }
  /// Row blocks per dK product: their G^T Q products are summed in one call with a reduction of dk_depth() * block_m.
  /// 4 on the AMX tiles, whose product over one block (K = 64) is bound by loading and storing its C tiles; there a
  /// deeper call sums bit for bit as the separate ones (each tdpbf16ps adds its own sum to C), so only the time
  /// changes. 1 elsewhere: the micro-kernel of gemm.hpp sums each call from zero and adds it to C once.
  static std::size_t dk_depth() noexcept
  {
    if constexpr (pairs)
    {
      const amx::state st = amx::status();
      return st == amx::state::active || st == amx::state::emulated ? 4 : 1;
    }
    return 1;
  }

  /// Floats per worker: the query block in two layouts (the dK one for dk_depth() blocks), the packed G and G^T (for
  /// dk_depth() blocks), a partial-panel buffer and (fused) the packed key tiles: key_run tiles for the logits, one for
  /// dQ. (16-bit where `pairs`, the partial panel float.)
  static detail::checked_size worker_floats(const gemm_shape& s, bool materialized) noexcept
  {
    const std::size_t dk = logit_k(s.d);
    const std::size_t depth = dk_depth();
    detail::checked_size n = detail::checked_size(block_m) * dk + detail::checked_size(depth * block_m) * s.dp +
                             detail::checked_size((1 + depth) * block_m * block_n);
    if (!materialized)
    {
      n = n + detail::checked_size(block_n) * s.dp + detail::checked_size(key_run) * dk;
    }
    return (pairs ? halves(n) : n) + detail::checked_size(kernel_mr) * s.dp;
  }
  static void size_worker(const gemm_shape& s, worker_scratch& ws, bool materialized)
  {
    const std::size_t dk = logit_k(s.d);
    auto fit = [](auto& v, std::size_t n)
    {
      if (n == 0)
      {
        std::remove_reference_t<decltype(v)>().swap(v); // released, not only emptied (another algorithm ran before)
      }
      else
      {
        v.resize(n);
      }
    };
    auto size = [&](auto& as_float, auto& as_pairs, std::size_t n)
    {
      fit(as_float, pairs ? 0 : n);
      fit(as_pairs, pairs ? n : 0);
    };
    size(ws.qa, ws.qa16, block_m * dk);
    size(ws.qb, ws.qb16, dk_depth() * block_m * s.dp);
    size(ws.ga, ws.ga16, block_m * block_n);
    size(ws.gt, ws.gt16, dk_depth() * block_m * block_n);
    size(ws.kt, ws.kt16, materialized ? 0 : block_n * s.dp);
    size(ws.kl, ws.kl16, materialized ? 0 : key_run * dk);
    ws.panel.resize(kernel_mr * s.dp);
    ws.keys_j0 = ws.keys_cols = 0;
    ws.dk_fill = ws.dk_i0 = 0;
  }
  /// Whether the fused backward may accumulate in the caller's float dq/dk: the products write NR-wide column
  /// panels, so rows must be d wide with d % NR == 0 (a partial last row panel goes through ws.panel).
  static constexpr bool in_place_ok(std::size_t, std::size_t d) noexcept
  {
    return std::is_same_v<T, float> && d % kernel_nr == 0;
  }

  void prepare(thread_pool& pool, unsigned workers, const gemm_shape& s, const T* q_in, const T* k, bool materialized)
  {
    sh = s;
    q = q_in;
    k_src = k;
    if (!materialized)
    {
      release(); // fused packs its key tiles when it uses them
      return;
    }
    if constexpr (pairs)
    {
      const std::size_t dk = logit_k(s.d);
      k_logit16.resize(s.nk_pad * dk);
      k_rows16.resize(s.nk_pad * s.dp);
      q_rows16.resize(s.nq_pad * s.dp);
      for_each_panel(pool,
                     workers,
                     s.nk_pad,
                     s.n_k,
                     [&](std::size_t r0, std::size_t rows)
                     {
                       pack_row_pairs<kernel_nr>(k, s.d, r0, rows, kernel_nr, k_logit16.data() + r0 * dk);
                       pack_rows_over_rows_pairs(
                           k, s.d, s.dp, r0, rows, kernel_nr, s.nk_pad, k_rows16.data() + r0 * kernel_nr);
                     });
      for_each_panel(pool,
                     workers,
                     s.nq_pad,
                     s.n_q,
                     [&](std::size_t r0, std::size_t rows)
                     {
                       pack_rows_over_rows_pairs(
                           q, s.d, s.dp, r0, rows, kernel_nr, s.nq_pad, q_rows16.data() + r0 * kernel_nr);
                     });
      return;
    }
    else
    {
      k_logit.resize(s.nk_pad * s.d);
      k_rows.resize(s.nk_pad * s.dp);
      q_rows.resize(s.nq_pad * s.dp);
      for_each_panel(pool,
                     workers,
                     s.nk_pad,
                     s.n_k,
                     [&](std::size_t r0, std::size_t rows)
                     {
                       pack_rows_over_dim(k, s.d, r0, rows, kernel_nr, k_logit.data() + r0 * s.d);
                       pack_rows_over_rows(k, s.d, s.dp, r0, rows, kernel_nr, s.nk_pad, k_rows.data() + r0 * kernel_nr);
                     });
      for_each_panel(pool,
                     workers,
                     s.nq_pad,
                     s.n_q,
                     [&](std::size_t r0, std::size_t rows)
                     {
                       pack_rows_over_rows(q, s.d, s.dp, r0, rows, kernel_nr, s.nq_pad, q_rows.data() + r0 * kernel_nr);
                     });
    }
  }

  /// f(r0, rows) for each kernel_nr-row panel of n_pad rows, over the pool: the panel's first row and how many of
  /// its rows are among the n real ones (0 for a panel of padding only).
  template <class F>
  static void for_each_panel(thread_pool& pool, unsigned workers, std::size_t n_pad, std::size_t n, const F& f)
  {
    parallel_for(pool,
                 n_pad / kernel_nr,
                 workers,
                 [&](std::size_t c, unsigned)
                 {
                   const std::size_t r0 = c * kernel_nr;
                   f(r0, r0 < n ? std::min<std::size_t>(kernel_nr, n - r0) : 0);
                 });
  }

  void release() noexcept
  {
    std::vector<float>().swap(k_logit);
    std::vector<float>().swap(k_rows);
    std::vector<float>().swap(q_rows);
    std::vector<std::uint16_t>().swap(k_logit16);
    std::vector<std::uint16_t>().swap(k_rows16);
    std::vector<std::uint16_t>().swap(q_rows16);
  }

  std::size_t bytes() const noexcept
  {
    return (k_logit.capacity() + k_rows.capacity() + q_rows.capacity()) * sizeof(float) +
           (k_logit16.capacity() + k_rows16.capacity() + q_rows16.capacity()) * sizeof(std::uint16_t);
  }

  CONTRASTIVE_NOINLINE void query_block(std::size_t i0, std::size_t rows, worker_scratch& ws, bool for_dk) const
  {
    if constexpr (pairs)
    {
      pack_row_pairs<kernel_mr>(q, sh.d, i0, rows, block_m, ws.qa16.data());
      if (for_dk) // into the dK operand's next free block (dk_block)
      {
        const std::size_t depth = dk_depth();
        pack_rows_over_rows_pairs(
            q, sh.d, sh.dp, i0, rows, block_m, depth * block_m, ws.qb16.data() + ws.dk_fill * block_m * kernel_nr);
      }
      return;
    }
    pack_rows_as_a(q, sh.d, i0, rows, block_m, ws.qa.data());
    if (for_dk)
    {
      pack_rows_over_rows(q, sh.d, sh.dp, i0, rows, block_m, block_m, ws.qb.data());
    }
  }

  /// The logits' operand of keys [j0, j0 + cols): the whole packed copy, or (fused) the tiles `key_tiles` packed.
  const float* logit_keys(std::size_t j0, std::size_t cols, const worker_scratch& ws) const noexcept
  {
    if (!k_logit.empty())
    {
      return k_logit.data() + j0 * sh.d;
    }
    (void)cols; // within [ws.keys_j0, ws.keys_j0 + ws.keys_cols): the fused loops pack before they use
    return ws.kl.data() + (j0 - ws.keys_j0) * sh.d;
  }

  CONTRASTIVE_NOINLINE void
  dot_tile(std::size_t j0, std::size_t rows, std::size_t cols, worker_scratch& ws) const noexcept
  {
    if constexpr (pairs)
    {
      const std::size_t dk = logit_k(sh.d);
      const std::uint16_t* b =
          !k_logit16.empty() ? k_logit16.data() + j0 * dk : ws.kl16.data() + (j0 - ws.keys_j0) * dk;
      gemm_packed(round_up(rows, kernel_mr),
                  round_up(cols, kernel_nr),
                  dk,
                  ws.qa16.data(),
                  b,
                  dk * kernel_nr,
                  ws.tile.data(),
                  block_n,
                  false);
      return;
    }
    gemm_packed(round_up(rows, kernel_mr),
                round_up(cols, kernel_nr),
                sh.d,
                ws.qa.data(),
                logit_keys(j0, cols, ws),
                sh.d * kernel_nr,
                ws.tile.data(),
                block_n,
                false);
  }

  /// Fused: packs keys [j0, j0 + cols) (cols <= key_run, j0 a multiple of block_n) as the logits' operand into
  /// ws.kl and, `for_dq` (cols <= block_n), as the B operand of dQ = G K_tile into ws.kt.
  CONTRASTIVE_NOINLINE void key_tiles(std::size_t j0, std::size_t cols, worker_scratch& ws, bool for_dq) const
  {
    if constexpr (pairs)
    {
      pack_row_pairs<kernel_nr>(k_src, sh.d, j0, cols, round_up(cols, kernel_nr), ws.kl16.data());
      ws.keys_j0 = j0;
      ws.keys_cols = cols;
      if (for_dq)
      {
        pack_rows_over_rows_pairs(k_src, sh.d, sh.dp, j0, cols, block_n, block_n, ws.kt16.data());
      }
      return;
    }
    pack_rows_over_dim(k_src, sh.d, j0, cols, round_up(cols, kernel_nr), ws.kl.data());
    ws.keys_j0 = j0;
    ws.keys_cols = cols;
    if (for_dq)
    {
      pack_rows_over_rows(k_src, sh.d, sh.dp, j0, cols, block_n, block_n, ws.kt.data());
    }
  }

  /// acc rows [0, rows), columns [0, width) += G(ws.tile) K[j0 : j0 + cols]; only those rows are written. K comes
  /// from the whole packed copy (materialized) or from the tile `key_tile` packed (fused).
  CONTRASTIVE_NOINLINE void dq_product(std::size_t j0,
                                       std::size_t rows,
                                       std::size_t cols,
                                       worker_scratch& ws,
                                       float* acc,
                                       std::size_t ld,
                                       std::size_t width) const noexcept
  {
    const std::size_t m_pad = round_up(rows, kernel_mr);
    if constexpr (pairs)
    {
      const std::size_t kc = pack_a_pairs(ws.tile.data(), block_n, m_pad, m_pad, cols, ws.ga16.data());
      const bool whole = !k_rows16.empty();
      const std::uint16_t* b = whole ? k_rows16.data() + j0 * kernel_nr : ws.kt16.data();
      const std::size_t stride = (whole ? sh.nk_pad : block_n) * kernel_nr;
      exact_rows(rows, width, kc, ws.ga16.data(), b, stride, acc, ld, ws);
      return;
    }
    pack_a(ws.tile.data(), block_n, m_pad, m_pad, cols, ws.ga.data());
    const bool whole = !k_rows.empty();
    const float* b = whole ? k_rows.data() + j0 * kernel_nr : ws.kt.data();
    const std::size_t stride = (whole ? sh.nk_pad : block_n) * kernel_nr;
    exact_rows(rows, width, cols, ws.ga.data(), b, stride, acc, ld, ws);
  }

  /// Packs the tile's G^T (m_pad rows) as the next block of the deep dK operand (dk_depth blocks of block_m steps);
  /// returns the reduction length to multiply now (every block staged, or `last`), else 0 (more blocks to come).
  static std::size_t stage_dk(std::size_t m_pad, worker_scratch& ws, bool last) noexcept
  {
    const std::size_t depth = dk_depth();
    pack_a_transposed_pairs(ws.tile.data(),
                            block_n,
                            m_pad,
                            m_pad,
                            block_m,
                            ws.gt16.data() + ws.dk_fill * block_m * kernel_mr,
                            depth * block_m);
    if (++ws.dk_fill < depth && !last)
    {
      return 0;
    }
    const std::size_t kc = ws.dk_fill * block_m;
    ws.dk_fill = 0;
    return kc;
  }

  /// acc rows [0, cols), columns [0, width) (width = d when in place, else dp) += G^T Q_blk; only those rows are
  /// written. With dk_depth() > 1 the block's G^T (and its Q, packed by query_block) wait in the worker's scratch
  /// until dk_depth() blocks of the same keys (cols, acc) are there or `last` says no more follow; one product then
  /// adds them all.
  CONTRASTIVE_NOINLINE void dk_block(
      std::size_t cols, worker_scratch& ws, float* acc, std::size_t ld, std::size_t width, bool last) const noexcept
  {
    const std::size_t m_pad = round_up(cols, kernel_mr);
    if constexpr (pairs)
    {
      const std::size_t depth = dk_depth();
      const std::size_t kc = stage_dk(m_pad, ws, last);
      if (kc == 0)
      {
        return;
      }
      exact_rows(
          cols, width, kc, ws.gt16.data(), ws.qb16.data(), depth * block_m * kernel_nr, acc, ld, ws, depth * block_m);
      return;
    }
    (void)last;
    pack_a_transposed(ws.tile.data(), block_n, m_pad, m_pad, block_m, ws.gt.data());
    exact_rows(cols, width, block_m, ws.gt.data(), ws.qb.data(), block_m * kernel_nr, acc, ld, ws);
  }

  /// C rows [0, rows) (ld ldc, `width` columns) += A B, A as a_panels with kc steps: whole MR panels straight into
  /// C, a partial last panel through ws.panel (loaded from C first, so each element's summation order is the same).
  template <class E>
  static void exact_rows(std::size_t rows,
                         std::size_t width,
                         std::size_t kc,
                         const E* a,
                         const E* b,
                         std::size_t b_stride,
                         float* c,
                         std::size_t ldc,
                         worker_scratch& ws,
                         std::size_t a_kc = 0) noexcept
  {
    a_kc = a_kc == 0 ? kc : a_kc;
    const std::size_t m_full = rows / kernel_mr * kernel_mr;
    gemm_packed(m_full, width, kc, a, b, b_stride, c, ldc, true, a_kc);
    if (m_full == rows)
    {
      return;
    }
    float* panel = ws.panel.data();
    const std::size_t tail = rows - m_full;
    for (std::size_t r = 0; r < static_cast<std::size_t>(kernel_mr); ++r)
    {
      for (std::size_t col = 0; col < width; ++col)
      {
        panel[r * width + col] = r < tail ? c[(m_full + r) * ldc + col] : 0.0f;
      }
    }
    gemm_packed(kernel_mr, width, kc, a + m_full * a_kc, b, b_stride, panel, width, true, a_kc);
    for (std::size_t r = 0; r < tail; ++r)
    {
      for (std::size_t col = 0; col < width; ++col)
      {
        c[(m_full + r) * ldc + col] = panel[r * width + col];
      }
    }
  }

  /// acc (cols x dp) += dA^T Q[i0 : i0 + block_m], dA in the tile (materialized, chunked). With dk_depth() > 1 the
  /// tile's dA^T waits in the worker's scratch until dk_depth() consecutive row blocks of the same keys are there or
  /// `last` says no more follow; one product over their rows then adds them all.
  CONTRASTIVE_NOINLINE void
  dk_queries(std::size_t i0, std::size_t cols, worker_scratch& ws, float* acc, bool last) const noexcept
  {
    const std::size_t m_pad = round_up(cols, kernel_mr);
    if constexpr (pairs)
    {
      const std::size_t depth = dk_depth();
      if (ws.dk_fill == 0)
      {
        ws.dk_i0 = i0;
      }
      const std::size_t kc = stage_dk(m_pad, ws, last);
      if (kc == 0)
      {
        return;
      }
      gemm_packed(m_pad,
                  sh.dp,
                  kc,
                  ws.gt16.data(),
                  q_rows16.data() + ws.dk_i0 * kernel_nr,
                  sh.nq_pad * kernel_nr,
                  acc,
                  sh.dp,
                  true,
                  depth * block_m);
      return;
    }
    (void)last;
    pack_a_transposed(ws.tile.data(), block_n, m_pad, m_pad, block_m, ws.gt.data());
    gemm_packed(
        m_pad, sh.dp, block_m, ws.gt.data(), q_rows.data() + i0 * kernel_nr, sh.nq_pad * kernel_nr, acc, sh.dp, true);
  }
};
} // namespace host
} // namespace contrastive
