// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The chunked algorithm on the host, the same sequence of steps the device runs with cuBLAS (device/chunked.cuh):
/// for each chunk of B = chunk_rows queries,
///   forward:  S_c = s Q_c K^T (one product into the chunk buffer); row statistics from whole rows; the column
///             statistics of the symmetric loss merged from the chunk's partials (online_lse);
///   backward: S_c again unless one chunk holds every row; G_c in place (logit_gradient, exact positive term);
///             dQ_c = s G_c K; dK += s G_c^T Q_c.
/// Products go through the engine's GEMM policy one (block, tile) at a time; every task owns its output rows (row
/// blocks for S_c and dQ_c, key tiles for the column statistics and dK), so results are bit-reproducible for a given
/// thread count.

#include <contrastive/host/engine_state.hpp>

#include <algorithm>
#include <cstddef>

namespace contrastive
{
namespace host
{
/// Bytes of chunk buffer one row of a chunk costs.
inline std::size_t chunk_row_bytes(std::size_t nk_pad) noexcept
{
  return nk_pad * sizeof(float);
}

inline constexpr std::size_t default_host_chunk_budget = std::size_t(16) << 20;

/// Computes S = s Q K^T for rows [c0, c0 + rows) into the chunk buffer (row stride nk_pad). Returns whether a logit
/// is non-finite.
template <class O, class T, class Gemm>
bool chunk_logits(engine_state<T, Gemm>& st, std::size_t c0, std::size_t rows)
{
  unsigned char bad[max_threads] = {};
  parallel_for(st.pool,
               (rows + block_m - 1) / block_m,
               st.workers,
               [&](std::size_t t, unsigned w)
               {
                 worker_scratch& ws = st.scratch[w];
                 const std::size_t i0 = c0 + t * block_m;
                 const std::size_t r = std::min(block_m, st.n_q - i0);
                 st.query_block(i0, ws, false);
                 for (std::size_t j0 = 0; j0 < st.n_k; j0 += block_n)
                 {
                   const std::size_t cols = std::min(block_n, st.n_k - j0);
                   bad[w] |= st.template scaled_tile<algorithm::fused, O>(i0, j0, r, cols, ws) ? 1 : 0;
                   for (std::size_t ii = 0; ii < r; ++ii)
                   {
                     std::copy_n(&ws.tile[ii * block_n], cols, &st.chunk[(i0 - c0 + ii) * st.nk_pad + j0]);
                   }
                 }
               });
  bool any = false;
  for (unsigned w = 0; w < st.workers; ++w)
  {
    any |= bad[w] != 0;
  }
  return any;
}

/// An online_lse without terms, measured from the largest of x[0, n) (-inf: empty): a chunk row's, whose sum the caller
/// adds.
inline online_lse measured_from_max(const float* x, std::size_t n) noexcept
{
  online_lse st{};
  st.rebase(lane_max(n,
                     -detail::infinity_f,
                     [&](std::size_t j)
                     {
                       return x[j];
                     }));
  return st;
}

/// Row i's statistics from its chunk row x of a grouped step (numeric/groups.hpp): the ids tell the positives, which
/// a softmax objective keeps apart from the negatives without masking them (the buffer's logits serve the backward).
template <class O, class T, class Gemm>
void grouped_chunk_row(engine_state<T, Gemm>& st, std::size_t i, const float* x)
{
  if constexpr (!O::softmax)
  {
    const float m = lane_max(st.n_k,
                             -detail::infinity_f,
                             [&](std::size_t j)
                             {
                               return x[j];
                             });
    float loss = 0.0f;
    for (std::size_t j0 = 0; j0 < st.n_k; j0 += block_n)
    {
      loss += grouped_pairwise_terms<O>(st, i, j0, std::min(block_n, st.n_k - j0), x + j0, nullptr);
    }
    set_pairwise_row<O>(st, i, loss, m, false);
  }
  else
  {
    // The negatives' state measured from the row's largest logit, a positive's or not (a valid online_lse: sum is
    // relative to max), so the max runs without a select.
    online_lse neg = measured_from_max(x, st.n_k);
    const float shift = neg.shift();
    // The exponentials over a copy with the positives masked, a key tile at a time (a select inside the loop would
    // keep it scalar), and the positives into the row's.
    positive_stats& mine = st.row_pos[i];
    mine = positive_stats{};
    float masked[block_n];
    neg.sum = 0.0f;
    for (std::size_t j0 = 0; j0 < st.n_k; j0 += block_n)
    {
      const std::size_t cols = std::min(block_n, st.n_k - j0);
      std::copy_n(x + j0, cols, masked);
      const std::size_t *at, *end;
      st.groups.positives_in(i, j0, j0 + cols, at, end);
      for (; at != end; ++at)
      {
        mine.absorb(x[*at]);
        masked[*at - j0] = -detail::infinity_f;
      }
      neg.sum += lane_sum(cols,
                          [&](std::size_t jj)
                          {
                            return detail::exp_approx(masked[jj] - shift);
                          });
    }
    st.set_grouped_row(i, neg);
  }
}

/// Symmetric: the column partials of key tile [j0, j0 + cols) over the chunk's rows (from c0), merged into the
/// running state. Grouped: the positives go to the running positives (col_run_pos) and out of the negatives' sums,
/// which are measured from every logit's max (as grouped_chunk_row's).
template <class T, class Gemm>
void column_partials(engine_state<T, Gemm>& st,
                     std::size_t c0,
                     std::size_t rows,
                     std::size_t j0,
                     std::size_t cols,
                     float* part_max,
                     float* part_sum)
{
  for (std::size_t r = 0; r < rows; ++r)
  {
    const float* x = &st.chunk[r * st.nk_pad + j0];
    for (std::size_t jj = 0; jj < cols; ++jj)
    {
      part_max[jj] = detail::max_f(part_max[jj], x[jj]);
    }
  }
  float shift[block_n];
  for (std::size_t jj = 0; jj < cols; ++jj)
  {
    online_lse part{};
    part.rebase(part_max[jj]);
    shift[jj] = part.shift();
  }
  float masked[block_n]; // grouped: the exponentials over a masked copy, as grouped_chunk_row's
  for (std::size_t r = 0; r < rows; ++r)
  {
    const float* x = &st.chunk[r * st.nk_pad + j0];
    if (st.grouped())
    {
      std::copy_n(x, cols, masked);
      const std::size_t *at, *end;
      st.groups.positives_in(c0 + r, j0, j0 + cols, at, end);
      for (; at != end; ++at)
      {
        st.col_run_pos[*at].absorb(x[*at - j0]);
        masked[*at - j0] = -detail::infinity_f;
      }
      x = masked;
    }
    for (std::size_t jj = 0; jj < cols; ++jj)
    {
      part_sum[jj] += detail::exp_approx(x[jj] - shift[jj]);
    }
  }
  for (std::size_t jj = 0; jj < cols; ++jj) // merged into the running column state
  {
    online_lse run{st.col_run_max[j0 + jj], st.col_run_sum[j0 + jj]};
    run.merge(online_lse{part_max[jj], part_sum[jj]});
    st.col_run_max[j0 + jj] = run.max;
    st.col_run_sum[j0 + jj] = run.sum;
  }
}

/// Forward statistics of the chunk in the buffer: each row's negatives and positive (the positive's slot is set to
/// -inf, as the fused tiles do), and, symmetric, the chunk's column partials merged into the running state.
template <class O, class T, class Gemm>
void chunk_statistics(engine_state<T, Gemm>& st, std::size_t c0, std::size_t rows)
{
  parallel_for(st.pool,
               (rows + block_m - 1) / block_m,
               st.workers,
               [&](std::size_t t, unsigned)
               {
                 const std::size_t end = std::min(rows, (t + 1) * block_m);
                 for (std::size_t r = t * block_m; r < end; ++r)
                 {
                   const std::size_t i = c0 + r;
                   float* x = &st.chunk[r * st.nk_pad];
                   if (st.grouped())
                   {
                     grouped_chunk_row<O>(st, i, x);
                     continue;
                   }
                   const std::size_t p = st.positive_of(i);
                   st.pos[i] = x[p];
                   x[p] = -detail::infinity_f;
                   if constexpr (!O::softmax)
                   {
                     const float neg_max = lane_max(st.n_k,
                                                    -detail::infinity_f,
                                                    [&](std::size_t j)
                                                    {
                                                      return x[j];
                                                    });
                     const float neg_loss = lane_sum(st.n_k,
                                                     [&](std::size_t j)
                                                     {
                                                       return O::term(x[j], false).loss;
                                                     });
                     set_pairwise_row<O>(st, i, neg_loss, neg_max, true);
                   }
                   else
                   {
                     online_lse neg = measured_from_max(x, st.n_k);
                     const float shift = neg.shift();
                     neg.sum = lane_sum(st.n_k,
                                        [&](std::size_t j)
                                        {
                                          return detail::exp_approx(x[j] - shift);
                                        });
                     st.set_row(i, finish_row(neg, st.pos[i]), neg.max);
                   }
                 }
               });
  if constexpr (O::columns)
  {
    st.for_key_tiles(
        [&](std::size_t j0, std::size_t cols, worker_scratch&, unsigned)
        {
          float part_max[block_n];
          float part_sum[block_n];
          std::fill(part_max, part_max + cols, -detail::infinity_f);
          std::fill(part_sum, part_sum + cols, 0.0f);
          column_partials(st, c0, rows, j0, cols, part_max, part_sum);
        });
  }
}

/// Row phase of the chunked algorithm's forward: row statistics, the columns' running partials (`column_partial`),
/// the rows' loss sum, max logit and non-finite flag.
template <class O, class T, class Gemm>
row_pass chunked_forward_rows(engine_state<T, Gemm>& st, float s)
{
  st.scale = s;
  st.begin_forward(); // grouped: no row's positive sum left from an earlier step (the sigmoid rows set none)
  std::fill(st.col_run_max.begin(), st.col_run_max.end(), -detail::infinity_f);
  std::fill(st.col_run_sum.begin(), st.col_run_sum.end(), 0.0f);
  std::fill(st.col_run_pos.begin(), st.col_run_pos.end(), positive_stats{});
  bool bad = false;
  for (std::size_t c0 = 0; c0 < st.n_q; c0 += st.chunk_rows)
  {
    const std::size_t rows = std::min(st.chunk_rows, st.n_q - c0);
    bad |= chunk_logits<O>(st, c0, rows);
    chunk_statistics<O>(st, c0, rows);
  }
  st.chunk_cached = st.chunk_rows >= st.n_q;
  return st.template finish_rows<O>(bad);
}

/// dK += G_c^T Q_c for the chunk of `rows` queries from c0 whose G is in the chunk buffer, one key tile per task (the
/// same for every objective: compiled once per element type and GEMM).
template <class T, class Gemm>
void chunk_dk(engine_state<T, Gemm>& st, std::size_t c0, std::size_t rows, float* dk_acc)
{
  st.for_key_tiles(
      [&](std::size_t j0, std::size_t cols, worker_scratch& ws, unsigned)
      {
        const std::size_t m_pad = round_up(cols, kernel_mr);
        for (std::size_t r0 = 0; r0 < rows; r0 += block_m)
        {
          load_tile(&st.chunk[r0 * st.nk_pad + j0], st.nk_pad, std::min(block_m, rows - r0), cols, m_pad, ws);
          st.mm.dk_queries(c0 + r0, cols, ws, dk_acc + j0 * st.dp, r0 + block_m >= rows);
        }
      });
}

/// dK = out_scale * dk_acc stored in the output type, the non-finite flags into `parts`.
template <class T, class Gemm, class Out>
void store_dk(engine_state<T, Gemm>& st, backward_partials& parts, double out_scale, const float* dk_acc, Out* dk)
{
  parallel_for(st.pool,
               (st.n_k + 63) / 64,
               st.workers,
               [&](std::size_t t, unsigned w)
               {
                 const std::size_t end = std::min(st.n_k, (t + 1) * 64);
                 for (std::size_t j = t * 64; j < end; ++j)
                 {
                   parts.bad_k[w] |= st.store_row(dk_acc + j * st.dp, out_scale, dk + j * st.d) ? 1 : 0;
                 }
               });
}

/// Backward of `loss_scale * loss` for the chunked algorithm after `chunked_forward`.
template <class O, class T, class Gemm, class Out>
backward_result
chunked_backward(engine_state<T, Gemm>& st, float loss_scale, const grad_coefficients& gc, Out* dq, Out* dk)
{
  const double out_scale = backward_output_factor(loss_scale, st.scale);
  backward_partials parts;
  float* dk_acc = st.dk_acc.data();
  std::fill(st.dk_acc.begin(), st.dk_acc.end(), 0.0f);

  for (std::size_t c0 = 0; c0 < st.n_q; c0 += st.chunk_rows)
  {
    const std::size_t rows = std::min(st.chunk_rows, st.n_q - c0);
    if (!st.chunk_cached)
    {
      chunk_logits<O>(st, c0, rows);
    }
    // G_c in place of S_c, and dQ_c = G_c K: one row block per task.
    parallel_for(st.pool,
                 (rows + block_m - 1) / block_m,
                 st.workers,
                 [&](std::size_t t, unsigned w)
                 {
                   worker_scratch& ws = st.scratch[w];
                   const std::size_t r0 = t * block_m;
                   const std::size_t i0 = c0 + r0;
                   const std::size_t r = std::min(block_m, rows - r0);
                   float* acc = ws.acc.data();
                   std::fill(acc, acc + block_m * st.dp, 0.0f);
                   for (std::size_t j0 = 0; j0 < st.n_k; j0 += block_n)
                   {
                     const std::size_t cols = std::min(block_n, st.n_k - j0);
                     load_tile(&st.chunk[r0 * st.nk_pad + j0], st.nk_pad, r, cols, cols, ws);
                     st.template gradient_tile<O>(true, i0, j0, r, cols, gc, ws);
                     if constexpr (O::has_bias)
                     {
                       parts.dbias[w] += tile_sum(r, cols, ws);
                     }
                     for (std::size_t ii = 0; ii < r; ++ii)
                     {
                       std::copy_n(&ws.tile[ii * block_n], cols, &st.chunk[(r0 + ii) * st.nk_pad + j0]);
                     }
                     st.mm.dq_product(j0, r, cols, ws, acc, st.dp, st.dp);
                   }
                   bool bad = false;
                   for (std::size_t ii = 0; ii < r; ++ii)
                   {
                     parts.dlogs[w] += static_cast<double>(st.dot_query(acc + ii * st.dp, i0 + ii));
                     bad |= st.store_row(acc + ii * st.dp, out_scale, dq + (i0 + ii) * st.d);
                   }
                   parts.bad_q[w] |= bad ? 1 : 0;
                 });
    // dK += G_c^T Q_c: one key tile per task.
    chunk_dk(st, c0, rows, dk_acc);
  }
  st.chunk_cached = false; // the buffer now holds G

  store_dk(st, parts, out_scale, dk_acc, dk);
  return parts.combine(st.workers, out_scale, static_cast<double>(loss_scale));
}
} // namespace host
} // namespace contrastive
