// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The dispatch layer of the device path, between the public call and the kernels (as in CUB: device/ -> dispatch/
/// -> kernels):
///
///   device/loss.cuh      `device::loss<...>::forward_backward`: checks the caller's arguments, then calls
///   device/dispatch.cuh  `dispatch::loss_dispatch<Element, Materialized>`: sizes and carves the workspace, turns the
///                        problem's runtime flags (objective, labels) into compile-time ones (`util::static_switch`)
///                        and enqueues the kernels and reductions of forward, backward and the record;
///   device/kernels.cuh   the kernels (one tiled row pass for forward and backward, the materialized algorithm's
///                        matrix kernels, the single-thread prologue and record kernels).
///
/// The helpers every device algorithm shares (`CONTRASTIVE_CUDA_TRY`, the workspace protocol, `util::align256`, the
/// CUB reductions) are device/util.cuh's.

#include <contrastive/detail/checked.hpp>
#include <contrastive/device/kernels.cuh>
#include <contrastive/device/util.cuh>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/objectives/objectives.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>

#include <cub/device/device_reduce.cuh>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <cuda_runtime.h>

namespace contrastive
{
namespace device
{
namespace dispatch
{
/// Forward and backward of the fused (`Materialized` false) and materialized algorithms: the workspace, the
/// compile-time configuration and the launches. The arguments are checked by the caller (device::loss).
template <class Element, bool Materialized>
struct loss_dispatch
{
  using traits = kernel_traits<Element>;
  /// Blocks of the materialized elementwise gradient (and so its number of <dS, A> partials).
  static constexpr int elementwise_blocks = 1024;

  /// Sub-buffers of the workspace: byte offsets, 256-byte aligned, and the sizes they were computed from.
  struct layout
  {
    std::size_t row_lse, row_loss, row_max, row_log_sum, col_lse, col_loss, col_max, col_log_sum, acc_q, acc_k,
        partials, sums, flags, scalars, cub, matrix, total;
    std::size_t n_partials, cub_bytes, ld_acc, nq_pad, nk_pad;
  };

  /// The layout for a problem (`total` is the size query's answer). Every size is computed without wrapping: a problem
  /// whose workspace does not fit in size_t bytes is refused with cudaErrorInvalidValue before any CUDA call.
  static cudaError_t make_layout(const problem<Element>& p, layout& w)
  {
    {
      using detail::checked_size;
      const checked_size nq_pad = detail::round_up(checked_size(p.n_q), traits::block_m);
      const checked_size nk_pad = detail::round_up(checked_size(p.n_k), traits::block_m);
      const checked_size ld = detail::round_up(checked_size(p.dim), traits::d_chunk);
      const checked_size f = sizeof(float);
      // Generous bound on the sum of the aligned sub-buffers: 18 x 256 bytes of alignment slack, the statistics, the
      // accumulators and the materialized matrix.
      checked_size bound = checked_size(18 * 256) + checked_size(4) * (checked_size(p.n_q) + p.n_k) * f +
                           (nq_pad + nk_pad) * ld * f + checked_size(elementwise_blocks) * f;
      if (Materialized)
      {
        bound = bound + checked_size(p.n_q) * checked_size(p.n_k) * sizeof(Element);
      }
      if (!bound.ok())
      {
        return cudaErrorInvalidValue;
      }
    }
    const std::size_t bm = traits::block_m;
    w.nq_pad = (p.n_q + bm - 1) / bm * bm;
    w.nk_pad = (p.n_k + bm - 1) / bm * bm;
    w.ld_acc = (p.dim + traits::d_chunk - 1) / traits::d_chunk * traits::d_chunk;
    // One <dA, A> partial per block: of the elementwise gradient (materialized) or of the dQ pass (fused).
    w.n_partials = Materialized ? static_cast<std::size_t>(elementwise_blocks) : w.nq_pad / bm;
    // The calls' own counts are ints (n <= 2^30 is checked before any layout is used for a launch); query with the
    // largest of them through the same functions the calls use.
    const int n_max = static_cast<int>(std::min<std::size_t>(std::max(std::max(p.n_q, p.n_k), w.n_partials), 1u << 30));
    CONTRASTIVE_CUDA_TRY(util::reduction_bytes(n_max, w.cub_bytes));
    util::carver c;
    w.row_lse = c.take(p.n_q * sizeof(float));
    w.row_loss = c.take(p.n_q * sizeof(float));
    w.row_max = c.take(p.n_q * sizeof(float));
    // The materialized gradient's softmax inputs: each log-sum-exp split as shift (= the max logit) + log_sum.
    w.row_log_sum = c.take(Materialized ? p.n_q * sizeof(float) : 0);
    w.col_lse = c.take(p.n_k * sizeof(float));
    w.col_loss = c.take(p.n_k * sizeof(float));
    w.col_max = c.take(p.n_k * sizeof(float));
    w.col_log_sum = c.take(Materialized ? p.n_k * sizeof(float) : 0);
    w.acc_q = c.take(w.nq_pad * w.ld_acc * sizeof(float));
    w.acc_k = c.take(w.nk_pad * w.ld_acc * sizeof(float));
    w.partials = c.take(w.n_partials * sizeof(float));
    w.sums = c.take(sizeof(kernels::step_sums));
    w.flags = c.take(3 * sizeof(int)); // logits, dQ, dK non-finite
    w.scalars = c.take(sizeof(kernels::step_scalars));
    w.cub = c.take(w.cub_bytes);
    w.matrix = c.take(Materialized ? p.n_q * p.n_k * sizeof(Element) : 0);
    w.total = c.offset;
    return cudaSuccess;
  }

  /// The workspace carved into typed pointers.
  struct workspace
  {
    float *row_lse, *row_loss, *row_max, *row_log_sum, *col_lse, *col_loss, *col_max, *col_log_sum, *acc_q, *acc_k,
        *partials;
    kernels::step_sums* sums;
    int* flags; ///< [0] logits, [1] dQ, [2] dK non-finite
    kernels::step_scalars* scalars;
    void* cub;
    void* matrix;

    workspace(void* d_temp, const layout& w)
    {
      char* base = static_cast<char*>(d_temp);
      auto f = [&](std::size_t off)
      {
        return reinterpret_cast<float*>(base + off);
      };
      row_lse = f(w.row_lse);
      row_loss = f(w.row_loss);
      row_max = f(w.row_max);
      row_log_sum = f(w.row_log_sum);
      col_lse = f(w.col_lse);
      col_loss = f(w.col_loss);
      col_max = f(w.col_max);
      col_log_sum = f(w.col_log_sum);
      acc_q = f(w.acc_q);
      acc_k = f(w.acc_k);
      partials = f(w.partials);
      sums = reinterpret_cast<kernels::step_sums*>(base + w.sums);
      flags = reinterpret_cast<int*>(base + w.flags);
      scalars = reinterpret_cast<kernels::step_scalars*>(base + w.scalars);
      cub = base + w.cub;
      matrix = base + w.matrix;
    }
  };

  /// Forward and backward at the state's tau and loss scale; fills `d_state->record` (pending). A null `d_temp` writes
  /// the workspace size to `temp_bytes` and returns; a workspace that is too small or not 256-byte aligned is refused
  /// with cudaErrorInvalidValue.
  template <class State>
  static cudaError_t dispatch(void* d_temp,
                              std::size_t& temp_bytes,
                              const problem<Element>& p,
                              Element* dq,
                              Element* dk,
                              State* d_state,
                              cudaStream_t stream)
  {
    layout w{};
    CONTRASTIVE_CUDA_TRY(make_layout(p, w));
    bool query = false;
    CONTRASTIVE_CUDA_TRY(util::workspace_phase(d_temp, temp_bytes, w.total, query));
    if (query)
    {
      return cudaSuccess;
    }
    const workspace ws(d_temp, w);
    return objectives::visit(
        p,
        [&](auto o) -> cudaError_t
        {
          using O = decltype(o);
          if constexpr (!O::softmax)
          {
            return cudaErrorInvalidValue; // refused by row_pass_objective before any work (util.cuh)
          }
          else
          {
            return util::static_switch(
                [&](auto labels)
                {
                  return run<O, decltype(labels)::value>(p, dq, dk, d_state, w, ws, stream);
                },
                p.labels != nullptr);
          }
        });
  }

private:
  /// Values every stage of one call reads.
  struct plan
  {
    kernels::pass_args rows; ///< (A, B) = (Q, K)
    kernels::pass_args cols; ///< (A, B) = (K, Q)
    grad_coefficients gc;
    dim3 row_grid, col_grid;
    int n_q, n_k;
  };

  template <class O, bool Labels, class State>
  static cudaError_t run(const problem<Element>& p,
                         Element* dq,
                         Element* dk,
                         State* d_state,
                         const layout& w,
                         const workspace& ws,
                         cudaStream_t stream)
  {
    constexpr bool Symmetric = O::columns; // the column pass and statistics run
    plan pl{};
    pl.n_q = static_cast<int>(p.n_q);
    pl.n_k = static_cast<int>(p.n_k);
    pl.rows.a = p.q;
    pl.rows.b = p.k;
    pl.rows.n_a = pl.n_q;
    pl.rows.n_b = pl.n_k;
    pl.rows.dim = static_cast<int>(p.dim);
    pl.rows.ld_acc = static_cast<int>(w.ld_acc);
    pl.rows.labels = p.labels;
    pl.rows.pos = Labels ? kernels::positive_mode::row_label : kernels::positive_mode::diagonal;
    pl.rows.matrix = ws.matrix;
    pl.rows.matrix_ld = pl.n_k;
    pl.rows.scalars = ws.scalars;
    pl.rows.flags = ws.flags;
    pl.cols = pl.rows;
    pl.cols.a = p.k;
    pl.cols.b = p.q;
    pl.cols.n_a = pl.n_k;
    pl.cols.n_b = pl.n_q;
    pl.cols.pos = Labels ? kernels::positive_mode::col_label : kernels::positive_mode::diagonal;
    pl.gc = O::coefficients(p.n_q, p.n_k);
    pl.row_grid = dim3(static_cast<unsigned>(w.nq_pad / traits::block_m));
    pl.col_grid = dim3(static_cast<unsigned>(w.nk_pad / traits::block_m));

    CONTRASTIVE_CUDA_TRY(cudaMemsetAsync(ws.flags, 0, 3 * sizeof(int), stream));
    CONTRASTIVE_CUDA_TRY(cudaMemsetAsync(ws.sums, 0, sizeof(kernels::step_sums), stream));
    CONTRASTIVE_CUDA_TRY(cudaMemsetAsync(ws.acc_q, 0, w.nq_pad * w.ld_acc * sizeof(float), stream));
    CONTRASTIVE_CUDA_TRY(cudaMemsetAsync(ws.acc_k, 0, w.nk_pad * w.ld_acc * sizeof(float), stream));
    kernels::prologue<State><<<1, 1, 0, stream>>>(d_state, ws.scalars);
    CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    CONTRASTIVE_CUDA_TRY(forward<Symmetric>(pl, w, ws, stream));
    CONTRASTIVE_CUDA_TRY(backward<Symmetric>(pl, ws, dq, dk, stream));
    return record<Symmetric>(pl, w, ws, d_state, stream);
  }

  static constexpr kernels::source rows_source = Materialized ? kernels::source::matrix : kernels::source::compute;
  static constexpr kernels::source cols_source =
      Materialized ? kernels::source::matrix_transposed : kernels::source::compute;

  /// Per row and (symmetric) per column: log-sum-exp, loss, largest logit. The materialized algorithm first writes
  /// its logit matrix.
  template <bool Symmetric>
  static cudaError_t forward(const plan& pl, const layout& w, const workspace& ws, cudaStream_t stream)
  {
    const dim3 block(traits::threads);
    if constexpr (Materialized)
    {
      const long long tiles = static_cast<long long>(w.nq_pad / traits::block_m) * (w.nk_pad / traits::block_n);
      const dim3 grid(static_cast<unsigned>(std::min<long long>(tiles, 1 << 20)));
      kernels::materialize_logits<Element><<<grid, block, 0, stream>>>(pl.rows);
      CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    }
    kernels::pass_args rows = pl.rows;
    rows.lse = ws.row_lse;
    rows.loss = ws.row_loss;
    rows.max_logit = ws.row_max;
    rows.log_sum = Materialized ? ws.row_log_sum : nullptr;
    kernels::forward_pass<Element, rows_source><<<pl.row_grid, block, 0, stream>>>(rows);
    CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    if constexpr (Symmetric)
    {
      kernels::pass_args cols = pl.cols;
      cols.lse = ws.col_lse;
      cols.loss = ws.col_loss;
      cols.max_logit = ws.col_max;
      cols.log_sum = Materialized ? ws.col_log_sum : nullptr;
      kernels::forward_pass<Element, cols_source><<<pl.col_grid, block, 0, stream>>>(cols);
      CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    }
    return cudaSuccess;
  }

  /// dQ (rows pass) and dK (columns pass). The materialized algorithm first rewrites its matrix with the gradient
  /// products elementwise; the fused passes rebuild G from the saved statistics.
  template <bool Symmetric>
  static cudaError_t backward(const plan& pl, const workspace& ws, Element* dq, Element* dk, cudaStream_t stream)
  {
    kernels::pass_args rows = pl.rows;
    rows.acc = ws.acc_q;
    rows.out = dq;
    rows.flag_index = 1;
    kernels::pass_args cols = pl.cols;
    cols.acc = ws.acc_k;
    cols.out = dk;
    cols.flag_index = 2;
    if constexpr (Materialized)
    {
      kernels::pass_args e = pl.rows;
      e.dlogs_partial = ws.partials;
      // Each log-sum-exp as (shift, log_sum) = (the max logit, the forward's log_sum), as the host's materialized
      // backward forms P: exp(S - lse) would carry lse's rounding (~eps |lse|), which P_pp - 1 keeps.
      kernels::materialized_gradient<Element><<<elementwise_blocks, 256, 0, stream>>>(
          e,
          kernels::split_lse{ws.row_max, ws.row_log_sum},
          Symmetric ? kernels::split_lse{ws.col_max, ws.col_log_sum} : kernels::split_lse{},
          pl.gc);
      CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
      rows.out_is_final = cols.out_is_final = true;
    }
    else
    {
      rows.lse_a = ws.row_lse;
      rows.loss_a = ws.row_loss;
      rows.coef_a = pl.gc.row_coef;
      rows.lse_b = Symmetric ? ws.col_lse : nullptr;
      rows.loss_b = Symmetric ? ws.col_loss : nullptr;
      rows.coef_b = Symmetric ? pl.gc.col_coef : 0.0f;
      rows.coef_pos = pl.gc.pos_coef;
      rows.dlogs_partial = ws.partials;
      // dK: rows are keys, columns queries; G^T_ji = col_coef C_ij + row_coef P_ij - pos.
      cols.lse_a = Symmetric ? ws.col_lse : nullptr;
      cols.loss_a = Symmetric ? ws.col_loss : nullptr;
      cols.loss_b = ws.row_loss;
      cols.coef_a = Symmetric ? pl.gc.col_coef : 0.0f;
      cols.lse_b = ws.row_lse;
      cols.coef_b = pl.gc.row_coef;
      cols.coef_pos = pl.gc.pos_coef;
    }
    const dim3 block(traits::threads);
    kernels::backward_pass<Element, rows_source><<<pl.row_grid, block, 0, stream>>>(rows);
    CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    kernels::backward_pass<Element, cols_source><<<pl.col_grid, block, 0, stream>>>(cols);
    return cudaPeekAtLastError();
  }

  /// The CUB reductions (losses, <dA, A> partials, largest logit) and the step record.
  template <bool Symmetric, class State>
  static cudaError_t record(const plan& pl, const layout& w, const workspace& ws, State* d_state, cudaStream_t stream)
  {
    std::size_t cub_bytes = w.cub_bytes;
    CONTRASTIVE_CUDA_TRY(util::reduce_sum(ws.cub, cub_bytes, ws.row_loss, &ws.sums->row_loss, pl.n_q, stream));
    if constexpr (Symmetric)
    {
      cub_bytes = w.cub_bytes;
      CONTRASTIVE_CUDA_TRY(util::reduce_sum(ws.cub, cub_bytes, ws.col_loss, &ws.sums->col_loss, pl.n_k, stream));
    }
    cub_bytes = w.cub_bytes;
    CONTRASTIVE_CUDA_TRY(
        util::reduce_sum(ws.cub, cub_bytes, ws.partials, &ws.sums->dlogs, static_cast<int>(w.n_partials), stream));
    cub_bytes = w.cub_bytes;
    CONTRASTIVE_CUDA_TRY(util::reduce_max(ws.cub, cub_bytes, ws.row_max, &ws.sums->max_logit, pl.n_q, stream));
    kernels::finish_forward_backward<State><<<1, 1, 0, stream>>>(
        d_state, ws.scalars, ws.sums, ws.flags, pl.n_q, pl.n_k, Symmetric ? 1 : 0, Materialized ? 1 : 0);
    return cudaPeekAtLastError();
  }
};
} // namespace dispatch
} // namespace device
} // namespace contrastive
