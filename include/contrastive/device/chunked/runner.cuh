// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The chunked device step, phase by phase (device/chunked.cuh describes the algorithm): `runner`, which the
/// one-process chunked loss (device/chunked.cuh) and the NCCL loss (distributed/nccl.cuh) both drive, over the
/// workspace and handle of device/chunked/resources.cuh.

#include <contrastive/device/chunked/kernels.cuh>
#include <contrastive/device/chunked/resources.cuh>
#include <contrastive/device/dispatch.cuh>
#include <contrastive/device/logits_tile.cuh>
#include <contrastive/objectives/objectives.hpp>
#include <contrastive/problem.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace contrastive
{
namespace device
{
namespace chunked_phases
{
/// One chunked step's work on a problem whose workspace is laid out by `layout`, phase by phase, so that the
/// single-process loss and the distributed one (distributed/nccl.cuh) share it. `p.labels` (device) give each row's
/// positive column (null: the diagonal); `gc` the gradient coefficients (the problem's own, or the global batch's).
/// The caller has entered the handle (handle_guard) and orders the phases:
///   begin -> [symmetric: forward_all -> column statistics (finish_columns_local, or combined across ranks)]
///         -> backward_all -> store_dk -> reduce_local -> finish (the record kernel).
/// The sigmoid objective has no column statistics: backward_all runs its forward and backward in one pass per chunk.
/// O: the problem's objective (objectives/objectives.hpp; the caller dispatches on it once).
template <class Element, class O>
struct runner
{
  static_assert(objectives::is_objective_v<O>, "O must be an objective type (objectives/objectives.hpp)");
  static constexpr bool sixteen_bit = !std::is_same_v<Element, float>;
  static constexpr bool sym = O::columns;      ///< column statistics (forward_all, finish_columns) run
  static constexpr bool sigmoid = !O::softmax; ///< the pairwise terms: one pass per chunk (sigmoid_chunk_step)

  problem<Element> p;
  layout w;
  char* base;
  cublasHandle_t handle;
  cudaStream_t stream;
  grad_coefficients gc;
  float up, down; // 2^k and 2^-k around the element-type G (fp16 only; else 1)
  chunk_args a;

  runner(const problem<Element>& prob,
         const layout& lay,
         void* d_temp,
         cublasHandle_t h,
         cudaStream_t s,
         const grad_coefficients& coef)
      : p(prob), w(lay), base(static_cast<char*>(d_temp)), handle(h), stream(s), gc(coef)
  {
    const int shift = gradient_shift<Element>(gc, std::max(p.n_q, p.n_k));
    up = std::ldexp(1.0f, shift);
    down = std::ldexp(1.0f, -shift);
    a.logits = f(w.logits);
    a.ld = static_cast<long long>(w.ld);
    a.n_k = static_cast<int>(p.n_k);
    a.labels = p.labels;
    a.scalars = scalars();
    a.row_lse = f(w.row_lse);
    a.row_loss = f(w.row_loss);
    a.row_max = f(w.row_max);
    a.pos = f(w.pos);
    a.col_max = f(w.col_max);
    a.col_sum = f(w.col_sum);
    a.col_lse = f(w.col_lse);
    a.col_loss = f(w.col_loss);
    a.flags = flags();
  }

  float* f(std::size_t off) const noexcept
  {
    return reinterpret_cast<float*>(base + off);
  }
  kernels::step_scalars* scalars() const noexcept
  {
    return reinterpret_cast<kernels::step_scalars*>(base + w.scalars);
  }
  kernels::step_sums* sums() const noexcept
  {
    return reinterpret_cast<kernels::step_sums*>(base + w.sums);
  }
  int* flags() const noexcept
  {
    return reinterpret_cast<int*>(base + w.flags);
  }
  float* dk_accumulator() const noexcept
  {
    return f(w.dk);
  }
  int dim() const noexcept
  {
    return static_cast<int>(p.dim);
  }
  void* grad() const noexcept
  {
    return sixteen_bit ? static_cast<void*>(base + w.grad) : static_cast<void*>(f(w.logits));
  }

  /// The first cuBLAS failure of this runner's products (CUBLAS_STATUS_SUCCESS: none), whose code the
  /// status-returning calls report (the cudaError_t they return maps it: from_cublas).
  cublasStatus_t cublas_failure() const noexcept
  {
    return cublas_failure_;
  }

  /// Clears the flags and reads tau, the loss scale and the logit bias from the state (prologue kernel).
  template <class State>
  cudaError_t begin(State* d_state)
  {
    CONTRASTIVE_CUDA_TRY(cudaMemsetAsync(flags(), 0, 3 * sizeof(int), stream));
    kernels::prologue<State><<<1, 1, 0, stream>>>(d_state, scalars());
    return cudaPeekAtLastError();
  }

  /// S_c^T (column-major n_k x rows) = K (d x n_k)^T Q_c (d x rows).
  cudaError_t logits_product(std::size_t c0, int rows)
  {
    const float one = 1.0f, zero = 0.0f;
    const cudaDataType_t et = cuda_type<Element>();
    return blas(cublasGemmEx(handle,
                             CUBLAS_OP_T,
                             CUBLAS_OP_N,
                             a.n_k,
                             rows,
                             dim(),
                             &one,
                             p.k,
                             et,
                             dim(),
                             p.q + c0 * p.dim,
                             et,
                             dim(),
                             &zero,
                             f(w.logits),
                             CUDA_R_32F,
                             static_cast<int>(w.ld),
                             CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT));
  }

  /// Arguments of the tile kernels for the chunk at row c0.
  logits_tile::tile_args tile_args_for(std::size_t c0, int rows) const noexcept
  {
    logits_tile::tile_args t;
    t.q = p.q + c0 * p.dim;
    t.k = p.k;
    t.rows = rows;
    t.n_k = a.n_k;
    t.dim = dim();
    t.c0 = static_cast<long long>(c0);
    t.labels = p.labels;
    t.scalars = a.scalars;
    t.row_part = reinterpret_cast<float2*>(base + w.row_part);
    t.col_part = reinterpret_cast<float2*>(base + w.col_part);
    t.pos = a.pos;
    t.flag = a.flags;
    t.row_lse = a.row_lse;
    t.row_loss = a.row_loss;
    t.col_lse = a.col_lse;
    t.col_loss = a.col_loss;
    t.gc = gc;
    t.symmetric = sym ? 1 : 0;
    t.factor = up;
    t.g = grad();
    t.ld = static_cast<long long>(w.ld);
    return t;
  }

  static dim3 tile_grid(int rows, int n_k) noexcept
  {
    return dim3(static_cast<unsigned>((n_k + logits_tile::config::bn - 1) / logits_tile::config::bn),
                static_cast<unsigned>((rows + logits_tile::config::bm - 1) / logits_tile::config::bm));
  }

  /// The tile path's forward of one chunk: statistics tiles, then the rows' and (symmetric) the columns' merges.
  cudaError_t forward_chunk_tiles(std::size_t c0, int rows)
  {
    if constexpr (sixteen_bit)
    {
      const logits_tile::tile_args t = tile_args_for(c0, rows);
      const dim3 grid = tile_grid(rows, a.n_k);
      logits_tile::tile_kernel<Element, logits_tile::statistics_epilogue>
          <<<grid, logits_tile::config::threads, 0, stream>>>(t);
      CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
      logits_tile::finish_tile_rows<><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(
          t.row_part, static_cast<int>(grid.x), rows, t.c0, a.n_k, p.labels, a.row_lse, a.row_loss, a.row_max, a.pos);
      CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
      if (sym)
      {
        logits_tile::merge_tile_columns<>
            <<<static_cast<unsigned>(std::min(1024, (a.n_k + 255) / 256)), 256, 0, stream>>>(
                t.col_part, static_cast<int>(grid.y), a.n_k, c0 == 0 ? 1 : 0, a.col_max, a.col_sum);
      }
      return cudaPeekAtLastError();
    }
    else
    {
      (void)c0;
      (void)rows;
      return cudaErrorNotSupported;
    }
  }

  /// The tile path's G_c of one chunk (S_c recomputed on tensor cores, never stored).
  cudaError_t gradient_tiles(std::size_t c0, int rows)
  {
    if constexpr (sixteen_bit)
    {
      logits_tile::tile_kernel<Element, logits_tile::gradient_epilogue>
          <<<tile_grid(rows, a.n_k), logits_tile::config::threads, 0, stream>>>(tile_args_for(c0, rows));
      return cudaPeekAtLastError();
    }
    else
    {
      (void)c0;
      (void)rows;
      return cudaErrorNotSupported;
    }
  }

  /// The forward's statistics of the chunk's float S_c (already computed): one pass over S_c for the row partials
  /// and (symmetric) the column partials, then the rows' finish and the columns' merge into the running state.
  cudaError_t statistics(std::size_t c0, int rows)
  {
    auto* row_part = reinterpret_cast<float2*>(base + w.row_part);
    auto* col_part = reinterpret_cast<float2*>(base + w.col_part);
    const long long col_tiles = stat_col_tiles(a.n_k);
    const long long row_tiles = stat_row_tiles(rows);
    chunk_statistics<>
        <<<dim3(static_cast<unsigned>(col_tiles), static_cast<unsigned>(row_tiles)), threads, 0, stream>>>(
            a, static_cast<long long>(c0), rows, sym ? 1 : 0, row_part, col_part);
    CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    logits_tile::finish_tile_rows<>
        <<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(row_part,
                                                                    static_cast<int>(col_tiles),
                                                                    rows,
                                                                    static_cast<long long>(c0),
                                                                    a.n_k,
                                                                    p.labels,
                                                                    a.row_lse,
                                                                    a.row_loss,
                                                                    a.row_max,
                                                                    a.pos);
    CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    if (sym)
    {
      logits_tile::merge_tile_columns<><<<static_cast<unsigned>(std::min(1024, (a.n_k + 255) / 256)), 256, 0, stream>>>(
          col_part, static_cast<int>(row_tiles), a.n_k, c0 == 0 ? 1 : 0, a.col_max, a.col_sum);
    }
    return cudaPeekAtLastError();
  }

  cudaError_t forward_chunk(std::size_t c0, int rows)
  {
    if (w.tiles)
    {
      return forward_chunk_tiles(c0, rows);
    }
    CONTRASTIVE_CUDA_TRY(logits_product(c0, rows));
    return statistics(c0, rows);
  }

  /// G_c, dQ_c (scaled, rounded into dq's rows, <dQ_i, q_i> kept), dK += G_c^T Q_c (float accumulator).
  cudaError_t backward_chunk(std::size_t c0, int rows, Element* dq)
  {
    // Four columns per thread; each block loops over rows (the column log-sum-exps read once per block).
    const dim3 grid(static_cast<unsigned>((a.n_k + 4 * threads - 1) / (4 * threads)),
                    static_cast<unsigned>(std::min(rows, 2048)));
    if (w.tiles)
    {
      CONTRASTIVE_CUDA_TRY(gradient_tiles(c0, rows));
    }
    else
    {
      chunk_gradient<Element><<<grid, threads, 0, stream>>>(
          a, static_cast<long long>(c0), rows, gc, sym ? 1 : 0, up, static_cast<Element*>(grad()));
      CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    }
    return gradient_products(c0, rows, dq);
  }

  /// The sigmoid objective's chunk: S_c, then its loss terms and G_c in one kernel, then the products.
  cudaError_t sigmoid_chunk_step(std::size_t c0, int rows, Element* dq)
  {
    CONTRASTIVE_CUDA_TRY(logits_product(c0, rows));
    sigmoid_chunk<Element><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        a, static_cast<long long>(c0), gc.row_coef, up, static_cast<Element*>(grad()), f(w.row_bias));
    CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    return gradient_products(c0, rows, dq);
  }

  /// From the chunk's G_c: dQ_c (scaled, rounded into dq's rows, <dQ_i, q_i> kept) and dK += G_c^T Q_c.
  cudaError_t gradient_products(std::size_t c0, int rows, Element* dq)
  {
    const float one = 1.0f, zero = 0.0f;
    const cudaDataType_t et = cuda_type<Element>();
    const cudaDataType_t gt = sixteen_bit ? et : CUDA_R_32F;
    // dQ_c^T (d x rows) = K^T (d x n_k) G_c^T (n_k x rows), times 2^-k.
    CONTRASTIVE_CUDA_TRY(blas(cublasGemmEx(handle,
                                           CUBLAS_OP_N,
                                           CUBLAS_OP_N,
                                           dim(),
                                           rows,
                                           a.n_k,
                                           &down,
                                           p.k,
                                           et,
                                           dim(),
                                           grad(),
                                           gt,
                                           static_cast<int>(w.ld),
                                           &zero,
                                           f(w.dq),
                                           CUDA_R_32F,
                                           dim(),
                                           CUBLAS_COMPUTE_32F,
                                           CUBLAS_GEMM_DEFAULT)));
    store_rows<Element><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        f(w.dq), dim(), p.q + c0 * p.dim, dq + c0 * p.dim, scalars(), f(w.row_dot) + c0, flags() + 1);
    CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    // dK^T (d x n_k) += Q_c^T (d x rows) G_c (rows x n_k), times 2^-k; the first chunk starts the accumulator.
    const float* beta = c0 == 0 ? &zero : &one;
    return blas(cublasGemmEx(handle,
                             CUBLAS_OP_N,
                             CUBLAS_OP_T,
                             dim(),
                             a.n_k,
                             rows,
                             &down,
                             p.q + c0 * p.dim,
                             et,
                             dim(),
                             grad(),
                             gt,
                             static_cast<int>(w.ld),
                             beta,
                             f(w.dk),
                             CUDA_R_32F,
                             dim(),
                             CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT));
  }

  /// Symmetric, pass 1: every chunk's row statistics and column partials (col_max / col_sum: each column's
  /// negatives over this problem's rows).
  cudaError_t forward_all()
  {
    for (std::size_t c0 = 0; c0 < p.n_q; c0 += w.chunk_rows)
    {
      CONTRASTIVE_CUDA_TRY(forward_chunk(c0, static_cast<int>(std::min(w.chunk_rows, p.n_q - c0))));
    }
    return cudaSuccess;
  }

  /// One process: each column's log-sum-exp and loss from its negatives and its positive (row j's).
  cudaError_t finish_columns_local()
  {
    finish_columns<><<<static_cast<unsigned>(std::min(1024, (a.n_k + threads - 1) / threads)), threads, 0, stream>>>(a);
    return cudaPeekAtLastError();
  }

  /// Symmetric, pass 2 (S_c recomputed unless one chunk holds every row); info_nce and sigmoid: forward and backward
  /// per chunk.
  cudaError_t backward_all(Element* dq)
  {
    const bool one_chunk = w.chunk_rows >= p.n_q;
    for (std::size_t c0 = 0; c0 < p.n_q; c0 += w.chunk_rows)
    {
      const int rows = static_cast<int>(std::min(w.chunk_rows, p.n_q - c0));
      if (sigmoid)
      {
        CONTRASTIVE_CUDA_TRY(sigmoid_chunk_step(c0, rows, dq));
        continue;
      }
      if (!sym)
      {
        CONTRASTIVE_CUDA_TRY(forward_chunk(c0, rows));
      }
      else if (!one_chunk && !w.tiles) // the tile path recomputes S_c inside gradient_tiles
      {
        CONTRASTIVE_CUDA_TRY(logits_product(c0, rows));
      }
      CONTRASTIVE_CUDA_TRY(backward_chunk(c0, rows, dq));
    }
    return cudaSuccess;
  }

  /// dK rows (`rows` x dim float, unscaled) times loss_scale * s, rounded into dk; flags a non-finite value.
  cudaError_t store_dk(const float* acc, Element* dk, std::size_t rows)
  {
    store_rows<Element><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        acc, dim(), static_cast<const Element*>(nullptr), dk, scalars(), nullptr, flags() + 2);
    return cudaPeekAtLastError();
  }

  /// This problem's sums (row losses, column losses when symmetric, <dQ, Q>, sigmoid: G) and max logit, into sums().
  cudaError_t reduce_local()
  {
    void* tmp = base + w.cub;
    std::size_t bytes = w.cub_bytes;
    const int n_q = static_cast<int>(p.n_q);
    CONTRASTIVE_CUDA_TRY(util::reduce_sum(tmp, bytes, a.row_loss, &sums()->row_loss, n_q, stream));
    if (sym)
    {
      bytes = w.cub_bytes;
      CONTRASTIVE_CUDA_TRY(util::reduce_sum(tmp, bytes, a.col_loss, &sums()->col_loss, a.n_k, stream));
    }
    bytes = w.cub_bytes;
    CONTRASTIVE_CUDA_TRY(util::reduce_sum(tmp, bytes, f(w.row_dot), &sums()->dlogs, n_q, stream));
    if (sigmoid)
    {
      bytes = w.cub_bytes;
      CONTRASTIVE_CUDA_TRY(util::reduce_sum(tmp, bytes, f(w.row_bias), &sums()->dbias, n_q, stream));
    }
    bytes = w.cub_bytes;
    return util::reduce_max(tmp, bytes, a.row_max, &sums()->max_logit, n_q, stream);
  }

  /// The record kernel of this objective, from the sums and flags (a distributed caller's all-reduced ones): the
  /// batch has n_q_total rows and n_k_total keys.
  template <class State>
  cudaError_t finish(State* d_state, std::size_t n_q_total, std::size_t n_k_total)
  {
    if (sigmoid)
    {
      kernels::finish_sigmoid_forward_backward<State>
          <<<1, 1, 0, stream>>>(d_state, scalars(), sums(), flags(), static_cast<int>(n_q_total));
      return cudaPeekAtLastError();
    }
    kernels::finish_forward_backward<State><<<1, 1, 0, stream>>>(d_state,
                                                                 scalars(),
                                                                 sums(),
                                                                 flags(),
                                                                 static_cast<int>(n_q_total),
                                                                 static_cast<int>(n_k_total),
                                                                 sym ? 1 : 0,
                                                                 /*materialized=*/0);
    return cudaPeekAtLastError();
  }

private:
  /// A cuBLAS product's result as a cudaError_t (from_cublas), its first failure kept for cublas_failure().
  cudaError_t blas(cublasStatus_t st) noexcept
  {
    if (st != CUBLAS_STATUS_SUCCESS && cublas_failure_ == CUBLAS_STATUS_SUCCESS)
    {
      cublas_failure_ = st;
    }
    return from_cublas(st);
  }

  cublasStatus_t cublas_failure_ = CUBLAS_STATUS_SUCCESS;
};
} // namespace chunked_phases
} // namespace device
} // namespace contrastive
