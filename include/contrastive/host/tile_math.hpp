// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Work on a worker's tile (ws.tile, block_m x block_n floats) that the host engine's passes share: a stored block
/// loaded as float, a block's sum, and the pairwise (sigmoid) objectives' tiles (loss terms and G from O::term,
/// G alone, and a row's finished statistics), over the engine's state (host/engine_state.hpp).

#include <contrastive/host/builtin_gemm.hpp>
#include <contrastive/host/operands.hpp>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/numeric/sigmoid_math.hpp>

#include <algorithm>
#include <cstddef>

namespace contrastive
{
namespace host
{
/// sum of a rows x cols block of ws.tile (row stride block_n), e.g. of a gradient tile for d loss / d b.
inline double tile_sum(std::size_t rows, std::size_t cols, const worker_scratch& ws) noexcept
{
  double total = 0.0;
  for (std::size_t ii = 0; ii < rows; ++ii)
  {
    const float* g = &ws.tile[ii * block_n];
    total += static_cast<double>(lane_sum(cols,
                                          [&](std::size_t jj)
                                          {
                                            return g[jj];
                                          }));
  }
  return total;
}

/// A rows x cols block of a stored matrix (row stride `ld`; float, or the element type of the materialized logits)
/// into ws.tile as float, zero up to block_m rows and `width` (>= cols) columns.
template <class S>
void load_tile(
    const S* src, std::size_t ld, std::size_t rows, std::size_t cols, std::size_t width, worker_scratch& ws) noexcept
{
  for (std::size_t ii = 0; ii < block_m; ++ii)
  {
    float* out = &ws.tile[ii * block_n];
    std::size_t jj = 0;
    if (ii < rows)
    {
      to_float_row(src + ii * ld, cols, out);
      jj = cols;
    }
    std::fill(out + jj, out + width, 0.0f);
  }
}

/// The pairwise objectives, a grouped step: the summed loss terms of row i's logits z[0, cols) (keys j0, ...), its
/// positives (group_view::positives_in) as positive pairs and the rest as negatives; `grad` (may be z, or null) gets
/// each logit's gradient factor. The negatives' terms run vectorised over a copy with the positives masked (-inf: a
/// term of 0), as the one-positive path masks its positive; the positives are added after from their own logits.
template <class O, class State>
float grouped_pairwise_terms(
    const State& st, std::size_t i, std::size_t j0, std::size_t cols, const float* z, float* grad) noexcept
{
  float masked[block_n];
  float pos_z[block_n];
  std::copy_n(z, cols, masked);
  const std::size_t *first, *last;
  st.groups.positives_in(i, j0, j0 + cols, first, last);
  std::size_t n_pos = 0;
  for (const std::size_t* at = first; at != last; ++at)
  {
    pos_z[n_pos++] = masked[*at - j0];
    masked[*at - j0] = -detail::infinity_f;
  }
  float loss = 0.0f;
  if (grad != nullptr)
  {
    loss = lane_sum(cols,
                    [&](std::size_t jj)
                    {
                      const auto t = O::term(masked[jj], false);
                      grad[jj] = t.grad;
                      return t.loss;
                    });
  }
  else
  {
    loss = lane_sum(cols,
                    [&](std::size_t jj)
                    {
                      return O::term(masked[jj], false).loss;
                    });
  }
  for (std::size_t k = 0; k < n_pos; ++k)
  {
    const auto t = O::term(pos_z[k], true);
    loss += t.loss;
    if (grad != nullptr)
    {
      grad[first[k] - j0] = t.grad;
    }
  }
  return loss;
}

/// The pairwise objectives (O::softmax false: the sigmoid objective; O::term gives one logit's loss term and gradient
/// factor). Forward: adds the negatives' terms softplus(z) of a masked tile of z (rows x cols at (i0,
/// j0)) to `loss_acc[ii]` and their largest z to `max_acc[ii]`; with `grads`, also turns the tile into the
/// unnormalised G (sigmoid(z) for the negatives, -sigmoid(-z_p) for the positive of each row whose positive is
/// in the tile, whose term is then added too) from the same exponential, zero outside rows x cols, and returns
/// sum G.
template <class O, class State>
double pairwise_tile(const State& st,
                     std::size_t i0,
                     std::size_t j0,
                     std::size_t rows,
                     std::size_t cols,
                     worker_scratch& ws,
                     float* loss_acc,
                     float* max_acc,
                     bool grads) noexcept
{
  double g_sum = 0.0;
  for (std::size_t ii = 0; ii < (grads ? block_m : rows); ++ii)
  {
    float* x = &ws.tile[ii * block_n];
    if (ii >= rows)
    {
      std::fill(x, x + block_n, 0.0f);
      continue;
    }
    max_acc[ii] = detail::max_f(max_acc[ii],
                                lane_max(cols,
                                         -detail::infinity_f,
                                         [&](std::size_t jj)
                                         {
                                           return x[jj];
                                         }));
    if (st.grouped()) // every positive pair is in the tile, told by its ids
    {
      loss_acc[ii] += grouped_pairwise_terms<O>(st, i0 + ii, j0, cols, x, grads ? x : nullptr);
      if (grads)
      {
        std::fill(x + cols, x + block_n, 0.0f);
        g_sum += static_cast<double>(lane_sum(cols,
                                              [&](std::size_t jj)
                                              {
                                                return x[jj];
                                              }));
      }
      continue;
    }
    if (grads)
    {
      loss_acc[ii] += lane_sum(cols,
                               [&](std::size_t jj)
                               {
                                 const auto t = O::term(x[jj], false);
                                 x[jj] = t.grad;
                                 return t.loss;
                               });
      std::fill(x + cols, x + block_n, 0.0f);
      const std::size_t p = st.positive_of(i0 + ii);
      if (p >= j0 && p < j0 + cols)
      {
        const auto t = O::term(st.pos[i0 + ii], true);
        x[p - j0] = t.grad;
        loss_acc[ii] += t.loss;
      }
      g_sum += static_cast<double>(lane_sum(cols,
                                            [&](std::size_t jj)
                                            {
                                              return x[jj];
                                            }));
    }
    else
    {
      loss_acc[ii] += lane_sum(cols,
                               [&](std::size_t jj)
                               {
                                 return O::term(x[jj], false).loss;
                               });
    }
  }
  return g_sum;
}

/// Sigmoid objective: row i's statistics from its negatives' summed terms and largest z (the positive's z is in
/// pos): row_lse and row_loss hold the row's loss sum_j softplus(-l_ij z_ij), `add_positive`: its term is added
/// here (it is not in `negatives_loss`).
template <class O, class State>
void set_pairwise_row(State& st, std::size_t i, float negatives_loss, float negatives_max, bool add_positive) noexcept
{
  add_positive = add_positive && !st.grouped(); // grouped: every pair's term is in negatives_loss already
  const float l = add_positive ? negatives_loss + O::term(st.pos[i], true).loss : negatives_loss;
  st.row_lse[i] = l;
  st.row_loss[i] = l;
  st.row_log_sum[i] = 0.0f;
  st.row_max[i] = negatives_max;
}

/// The sigmoid objective's G = dL/dz of a tile of z (rows x cols valid, zero elsewhere): gc.row_coef sigmoid(z)
/// for the negatives, -gc.row_coef sigmoid(-z_p) for the positive, whose z is read from pos (a cached chunk
/// holds -inf in its slot).
template <class O, class State>
void pairwise_gradient_tile(const State& st,
                            std::size_t i0,
                            std::size_t j0,
                            std::size_t rows,
                            std::size_t cols,
                            const grad_coefficients& gc,
                            worker_scratch& ws) noexcept
{
  const float c = gc.row_coef;
  for (std::size_t ii = 0; ii < block_m; ++ii)
  {
    float* g = &ws.tile[ii * block_n];
    if (ii >= rows)
    {
      std::fill(g, g + block_n, 0.0f);
      continue;
    }
    if (st.grouped())
    {
      grouped_pairwise_terms<O>(st, i0 + ii, j0, cols, g, g);
      for (std::size_t jj = 0; jj < cols; ++jj)
      {
        g[jj] *= c;
      }
      std::fill(g + cols, g + block_n, 0.0f);
      continue;
    }
    for (std::size_t jj = 0; jj < cols; ++jj)
    {
      g[jj] = c * O::term(g[jj], false).grad;
    }
    std::fill(g + cols, g + block_n, 0.0f);
    const std::size_t p = st.positive_of(i0 + ii);
    if (p >= j0 && p < j0 + cols)
    {
      g[p - j0] = c * O::term(st.pos[i0 + ii], true).grad;
    }
  }
}
} // namespace host
} // namespace contrastive
