// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// algorithm::chunked on the device: the three large products by cuBLAS (16-bit or float inputs, float
/// accumulation), everything element-wise in small kernels built from the shared tile math. Include this header (it
/// includes device/loss.cuh) and link cuBLAS (CMake: `contrastive::cublas`); the fused and materialized device
/// algorithms need neither.
///
///   using L = contrastive::device::loss<__nv_bfloat16, temperature::learnable, scaler::dynamic, algorithm::chunked>;
///   cublasHandle_t h;  cublasCreate(&h);           // the caller's handle (one per thread, as cuBLAS asks)
///   L::step(nullptr, bytes, problem, dq, dk, d_state, h, stream, {0, budget});   // size query
///   L::step(d_temp, bytes, problem, dq, dk, d_state, h, stream, {0, budget});    // the step
///
/// Per chunk of B query rows (B from `chunk_options`; default, neither rows nor budget_bytes given: 4096 rows, fewer
/// where their chunk buffers do not fit in 1/4 of the device memory free after the step's other workspace buffers,
/// never fewer than S_c and G_c in 384 MiB or 256 rows, at most every row. The size query reads cudaMemGetInfo; the
/// step takes the rows its workspace holds, so a step given the bytes its query wrote uses the query's rows. The
/// chunk size changes the order of float sums (dK's over chunks; cuBLAS may pick other kernels for other shapes),
/// not the math: give `rows` where steps must not depend on free memory):
///   forward   S_c = Q_c K^T (cuBLAS, float out); one block per row: the row's negatives (online_lse::absorb) and
///             positive, finish_row; symmetric: per-column partials of the chunk merged into a running state.
///   backward  S_c again unless one chunk holds every row (info_nce always runs forward and backward in one pass:
///             its rows are complete within a chunk); G_c element-wise (logit_gradient, exact positive term),
///             stored as T (fp16: times 2^k so that P ~ 1/n stays in the normal range, k folded back through the
///             products' alpha); dQ_c = G_c K (cuBLAS, float out) scaled and rounded per row with <dQ_i, q_i> for
///             d loss / d log s; dK += G_c^T Q_c (cuBLAS, float accumulator); dK rounded once at the end.
/// Workspace: B x ld (float S_c, G_c in place for float; + B x ld of T for 16-bit), n_k x dim floats (dK),
/// B x dim floats (dQ_c), O(n_q + n_k) statistics. Work: 6 n_q n_k d flops (one chunk or info_nce), else 8.
///
/// The sigmoid objective (SigLIP; z = s S + b with the bias from the device state, make_state(t, s, b, out)) runs
/// forward and backward in one pass per chunk (no normaliser): S_c, then one kernel for the loss terms and G_c
/// (numeric/sigmoid_math.hpp), then the same products; 6 n_q n_k d flops, one more float per row (the rows' sums of
/// G, d loss / d b). finish_step moves a learnable bias after a finite step. fused_tiles does not apply to it.
///
/// chunk_options::fused_tiles (16-bit types, sm_80+; device/logits_tile.cuh): S_c tiles on tensor cores in the
/// library's kernel, reduced (forward) or turned into G_c (backward) in registers; no float S_c (workspace B x ld of T
/// plus small tile partials); always 8 n_q n_k d flops (S_c computed in both passes, also for info_nce).
///
/// The call sets the handle's stream to `stream` and its pointer mode to host for the duration of the call and
/// restores both before returning. cuBLAS failures come back as cudaError_t (allocation: cudaErrorMemoryAllocation,
/// invalid value: cudaErrorInvalidValue, unsupported or wrong architecture: cudaErrorNotSupported, anything else
/// cudaErrorUnknown). Float products follow the handle's math mode
/// (CUBLAS_DEFAULT_MATH: exact float; CUBLAS_TF32_TENSOR_OP_MATH if you want TF32).
///
/// Layers: this header is the public loss (arguments, workspace, the order of the phases); device/chunked/runner.cuh
/// runs the phases and device/chunked/kernels.cuh holds their kernels.

#include <contrastive/device/chunked/runner.cuh>
#include <contrastive/device/loss.cuh>

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace contrastive
{
namespace device
{
namespace chunked_phases
{
/// The chunked device loss (see the file comment); `KeepLogits`: algorithm::automatic's default sizing, which holds
/// every row in one chunk (the logits kept between the passes: 6 n_q n_k d flops) where that workspace fits the
/// memory budget.
template <class Element, class Temperature, class Scaler, bool KeepLogits>
struct chunked_loss
{
  /// The fused device loss, whose state, upload_state, unscale_and_check and finish_step this one forwards to.
  using common = loss<Element, Temperature, Scaler, algorithm::fused>;
  /// The same device state as the other algorithms' (device::state).
  using state_type = typename common::state_type;
  /// The workspace's sub-buffers for one problem (make_layout, layout_to_fit).
  using layout_type = chunked_phases::layout;
  /// Element is a 16-bit type: G_c is also stored as Element for the tensor-core products.
  static constexpr bool sixteen_bit = !std::is_same_v<Element, float>;

  /// A validated initial state, with a logit bias fixed at 0 (see device::loss::make_state).
  static status make_state(const Temperature& t, const Scaler& s, state_type& out)
  {
    return common::make_state(t, s, out);
  }

  /// With the sigmoid objective's logit bias (see device::loss::make_state).
  static status make_state(const Temperature& t, const Scaler& s, const logit_bias& b, state_type& out)
  {
    return common::make_state(t, s, b, out);
  }

  /// The state to device memory in stream order, as a kernel argument (see device/loss.cuh).
  [[nodiscard]] static cudaError_t upload_state(const state_type& st, state_type* d_state, cudaStream_t stream = 0)
  {
    return common::upload_state(st, d_state, stream);
  }

  /// Bytes per chunk row of the chunk's buffers (S_c and G_c, or the tile path's G_c and partials), without dQ_c.
  static std::size_t chunk_bytes_per_row(const problem<Element>& p, bool tiles) noexcept
  {
    const std::size_t ld = (p.n_k + 31) / 32 * 32;
    // cuBLAS path: S_c and G_c (the statistics pass's partials, ~0.1 byte per chunk logit, are left out of this
    // estimate; the layout counts them).
    return tiles ? chunked_phases::tile_bytes_per_row<Element>(ld)
                 : ld * (sizeof(float) + (sixteen_bit ? sizeof(Element) : 0));
  }

  /// The floor of the default chunk: S_c and G_c fill at most 384 MiB, and at
  /// least 256 rows (a multiple of 64, at most n_q rounded up).
  static std::size_t floor_rows_for(const problem<Element>& p, bool tiles) noexcept
  {
    constexpr std::size_t align = chunked_phases::row_align;
    const std::size_t rows = detail::chunk_rows_for(
        chunk_options{}, p.n_q, chunk_bytes_per_row(p, tiles), align, chunked_phases::default_budget);
    const std::size_t all = (p.n_q + align - 1) / align * align;
    return std::max(rows, std::min(chunked_phases::default_min_rows, all));
  }

  /// Default rows per chunk (no chunk option) for `free_bytes` of free device memory: 4096 rows, fewer if their
  /// chunk buffers do not fit in 1/4 of what is free after the step's other workspace buffers, never fewer than
  /// floor_rows_for (free_bytes = 0, unknown, gives that floor), at most every row. A multiple of 64, at most n_q
  /// rounded up. See docs/performance.md ("Chunk size on the device").
  /// automatic (KeepLogits): every row where that whole workspace fits `keep_budget` bytes (0: a quarter of
  /// `free_bytes`), else the above.
  static std::size_t
  default_rows_for(const problem<Element>& p, bool tiles, std::size_t free_bytes, std::size_t keep_budget = 0) noexcept
  {
    namespace cd = chunked_phases;
    constexpr std::size_t align = cd::row_align;
    const std::size_t all = (p.n_q + align - 1) / align * align;
    const std::size_t floor = floor_rows_for(p, tiles);
    std::size_t cub = 1; // CUB's few KiB do not matter to the budget (and asking CUB would need a device)
    if constexpr (KeepLogits)
    {
      const std::size_t budget = keep_budget != 0 ? keep_budget : free_bytes / cd::free_divisor;
      cd::layout every{};
      if (budget != 0 && layout_for_rows(p, tiles, all, cub, every) == cudaSuccess && every.total <= budget)
      {
        return all; // one chunk: S is computed once
      }
    }
    else
    {
      (void)keep_budget;
    }
    cd::layout fixed{};
    if (free_bytes == 0 || layout_for_rows(p, tiles, 0, cub, fixed) != cudaSuccess || free_bytes <= fixed.total)
    {
      return floor; // <= all
    }
    const std::size_t per_row = chunk_bytes_per_row(p, tiles) + p.dim * sizeof(float); // + the row's dQ_c
    const std::size_t fit = (free_bytes - fixed.total) / cd::free_divisor / per_row / align * align;
    return std::min(all, std::max(floor, std::min(fit, cd::default_max_rows)));
  }

  /// Rows per chunk for a problem and options (a multiple of 64, at most n_q rounded up). `rows` or `budget_bytes`
  /// set: from them (chunk_options); neither: default_rows_for at the device's free memory now (what a size query
  /// uses; no device or a failed query: the floor).
  static std::size_t chunk_rows_for(const problem<Element>& p, const chunk_options& o) noexcept
  {
    return chunk_rows_for(p, o, chunked_phases::use_tiles(p, o));
  }

  /// The same with `tiles` (chunk_options::fused_tiles in effect) given instead of decided for the problem.
  static std::size_t chunk_rows_for(const problem<Element>& p, const chunk_options& o, bool tiles) noexcept
  {
    return chunk_rows_for(p, o, tiles, is_default(o) ? chunked_phases::device_free_bytes() : 0);
  }

  /// The same at `free_bytes` of free device memory instead of the device's free memory now (read only when `o` sets
  /// neither rows nor budget_bytes; 0, unknown: the floor).
  static std::size_t
  chunk_rows_for(const problem<Element>& p, const chunk_options& o, bool tiles, std::size_t free_bytes) noexcept
  {
    if (is_default(o))
    {
      return default_rows_for(p, tiles, free_bytes, KeepLogits ? o.budget_bytes : 0);
    }
    return detail::chunk_rows_for(
        o, p.n_q, chunk_bytes_per_row(p, tiles), chunked_phases::row_align, chunked_phases::default_budget);
  }

  /// No chunk size given: the default sizing applies (automatic: budget_bytes is the memory budget of its one-chunk
  /// choice, not a chunk size, so only `rows` leaves the default).
  static constexpr bool is_default(const chunk_options& o) noexcept
  {
    return o.rows == 0 && (KeepLogits || o.budget_bytes == 0);
  }

  /// The workspace layout for `rows` per chunk (clamped to n_q and, on the tile path, to the tile grid's limit;
  /// 0 lays out everything but the chunk buffers). `cub_bytes`: the CUB size query's answer, 0 to ask it here.
  /// Refused with cudaErrorInvalidValue when a size overflows.
  static cudaError_t layout_for_rows(
      const problem<Element>& p, bool tiles, std::size_t rows, std::size_t& cub_bytes, chunked_phases::layout& w)
  {
    return objectives::visit(p,
                             [&](auto o)
                             {
                               return layout_for_objective<decltype(o)>(p, tiles, rows, cub_bytes, w);
                             });
  }
  /// layout_for_rows for objective O.
  template <class O>
  static cudaError_t layout_for_objective(
      const problem<Element>& p, bool tiles, std::size_t rows, std::size_t& cub_bytes, chunked_phases::layout& w)
  {
    using detail::checked_size;
    w.tiles = tiles && O::softmax; // the tile epilogues are the softmax's
    w.chunk_rows = std::min(rows, p.n_q);
    // The grids' y dimension (at most 65535 blocks) runs over the chunk's rows: one row of blocks per 128 rows for
    // the tile kernels, per chunked_phases::stat_rows for the cuBLAS path's statistics pass.
    w.chunk_rows = std::min(w.chunk_rows,
                            std::size_t(65535) * (w.tiles ? std::size_t(logits_tile::config::bm)
                                                          : static_cast<std::size_t>(chunked_phases::stat_rows)));
    w.ld = (p.n_k + 31) / 32 * 32;
    constexpr std::size_t bm = logits_tile::config::bm;
    constexpr std::size_t bn = logits_tile::config::bn;
    // The statistics partials: the tile kernels' (row tiles of bm, column tiles of bn), or the cuBLAS path's
    // statistics pass (chunked_phases::chunk_statistics: row tiles of stat_rows, column tiles of stat_cols).
    const std::size_t row_tiles =
        w.tiles ? (w.chunk_rows + bm - 1) / bm
                : static_cast<std::size_t>(chunked_phases::stat_row_tiles(static_cast<long long>(w.chunk_rows)));
    const std::size_t col_tiles =
        w.tiles ? (p.n_k + bn - 1) / bn
                : static_cast<std::size_t>(chunked_phases::stat_col_tiles(static_cast<long long>(p.n_k)));
    const checked_size f = sizeof(float);
    const checked_size bound =
        checked_size(64 * 256) + checked_size(6) * p.n_q * f + checked_size(4) * p.n_k * f +
        checked_size(w.chunk_rows) * w.ld * (f + checked_size(sixteen_bit ? sizeof(Element) : 0)) +
        (checked_size(w.chunk_rows) + p.n_k) * checked_size(p.dim) * f +
        (checked_size(w.chunk_rows) * col_tiles + checked_size(row_tiles) * p.n_k) * checked_size(sizeof(float2));
    if (!bound.ok())
    {
      return cudaErrorInvalidValue;
    }
    if (cub_bytes == 0)
    {
      const int n_max = static_cast<int>(std::max(p.n_q, p.n_k));
      CONTRASTIVE_CUDA_TRY(util::reduction_bytes(n_max, cub_bytes));
    }
    w.cub_bytes = cub_bytes;
    constexpr bool sym = O::columns;
    util::carver c;
    w.row_lse = c.take(p.n_q * sizeof(float));
    w.row_loss = c.take(p.n_q * sizeof(float));
    w.row_max = c.take(p.n_q * sizeof(float));
    w.pos = c.take(p.n_q * sizeof(float));
    w.row_dot = c.take(p.n_q * sizeof(float));
    w.row_bias = c.take(O::has_bias ? p.n_q * sizeof(float) : 0);
    w.col_max = c.take(sym ? p.n_k * sizeof(float) : 0);
    w.col_sum = c.take(sym ? p.n_k * sizeof(float) : 0);
    w.col_lse = c.take(sym ? p.n_k * sizeof(float) : 0);
    w.col_loss = c.take(sym ? p.n_k * sizeof(float) : 0);
    w.logits = c.take(w.tiles ? 0 : w.chunk_rows * w.ld * sizeof(float));
    w.grad = c.take(sixteen_bit ? w.chunk_rows * w.ld * sizeof(Element) : 0);
    w.dq = c.take(w.chunk_rows * p.dim * sizeof(float));
    w.dk = c.take(p.n_k * p.dim * sizeof(float));
    w.sums = c.take(sizeof(kernels::step_sums));
    w.flags = c.take(3 * sizeof(int));
    w.scalars = c.take(sizeof(kernels::step_scalars));
    w.cub = c.take(w.cub_bytes);
    w.row_part = c.take(O::softmax ? w.chunk_rows * col_tiles * sizeof(float2) : 0);
    w.col_part = c.take(sym ? row_tiles * p.n_k * sizeof(float2) : 0);
    w.total = c.offset;
    return cudaSuccess;
  }

  /// The workspace layout of a size query (chunk_rows_for; the default reads the device's free memory).
  static cudaError_t make_layout(const problem<Element>& p, const chunk_options& o, chunked_phases::layout& w)
  {
    const bool tiles = chunked_phases::use_tiles(p, o);
    std::size_t cub = 0;
    return layout_for_rows(p, tiles, chunk_rows_for(p, o, tiles), cub, w);
  }

  /// The same with the default sized for `free_bytes` of free memory (the distributed loss's sizing; tests).
  static cudaError_t
  make_layout(const problem<Element>& p, const chunk_options& o, std::size_t free_bytes, chunked_phases::layout& w)
  {
    const bool tiles = chunked_phases::use_tiles(p, o);
    std::size_t cub = 0;
    return layout_for_rows(p, tiles, chunk_rows_for(p, o, tiles, free_bytes), cub, w);
  }

  /// The layout of a step given `temp_bytes` of workspace. Options with a chunk size: make_layout's. The default:
  /// the most rows the default can choose (floor_rows_for to max(floor, 4096) in steps of 64, at most every row)
  /// whose layout fits in temp_bytes, so a step run with the bytes its size query wrote gets exactly the query's rows,
  /// whatever the free memory is now (the workspace itself is allocated in between). None fits: the floor's layout
  /// (which workspace_phase then refuses).
  static cudaError_t
  layout_to_fit(const problem<Element>& p, const chunk_options& o, std::size_t temp_bytes, chunked_phases::layout& w)
  {
    if (!is_default(o))
    {
      return make_layout(p, o, w);
    }
    const int n_max = static_cast<int>(std::max(p.n_q, p.n_k));
    std::size_t cub = 0;
    CONTRASTIVE_CUDA_TRY(util::reduction_bytes(n_max, cub));
    return layout_to_fit(p, chunked_phases::use_tiles(p, o), temp_bytes, cub, w);
  }

  /// layout_to_fit's search for the default, given the tile decision and CUB's temporary bytes (no CUDA call).
  static cudaError_t layout_to_fit(
      const problem<Element>& p, bool tiles, std::size_t temp_bytes, std::size_t cub, chunked_phases::layout& w)
  {
    namespace cd = chunked_phases;
    constexpr std::size_t align = cd::row_align;
    const std::size_t all = (p.n_q + align - 1) / align * align;
    const std::size_t floor = floor_rows_for(p, tiles);
    if constexpr (KeepLogits) // automatic's one chunk, where the query chose it
    {
      if (layout_for_rows(p, tiles, all, cub, w) == cudaSuccess && w.total <= temp_bytes)
      {
        return cudaSuccess;
      }
    }
    // Every value default_rows_for can return, largest first: min(all, r) for r = max(floor, 4096) down to floor.
    for (std::size_t rows = std::max(floor, cd::default_max_rows); rows > floor; rows -= align)
    {
      if (layout_for_rows(p, tiles, std::min(rows, all), cub, w) == cudaSuccess && w.total <= temp_bytes)
      {
        return cudaSuccess;
      }
    }
    return layout_for_rows(p, tiles, floor, cub, w);
  }

  /// A status as the cudaError_t of the CUB-style calls: util::cuda_error_of, cuBLAS's codes mapped by from_cublas.
  static cudaError_t cuda_error_of(const status& st) noexcept
  {
    return st.native().api == native_api::cublas
               ? chunked_phases::from_cublas(static_cast<cublasStatus_t>(st.native().code))
               : util::cuda_error_of(st);
  }

  /// Why forward_backward and step refuse these arguments (cudaErrorInvalidValue), as a status naming the argument
  /// (host code, no CUDA call): device::loss::check's verdict, then the cuBLAS handle.
  static status check(
      const problem<Element>& p, const Element* dq, const Element* dk, const state_type* d_state, cublasHandle_t handle)
  {
    CONTRASTIVE_RETURN_IF_ERROR(check_problem(p, dq, dk, true, /*check_labels=*/false));
    CONTRASTIVE_RETURN_IF_ERROR(check_device_problem(p));
    if (d_state == nullptr || handle == nullptr)
    {
      return {errc::null_pointer,
              d_state == nullptr ? "d_state" : "handle",
              d_state == nullptr ? "null device state (make_state, then upload_state)" : "null cuBLAS handle"};
    }
    return util::device_limits(p);
  }

  /// Steps 1-3 (forward, backward, record) at the state's tau and loss scale. A null d_temp writes the bytes needed.
  [[nodiscard]] static cudaError_t forward_backward(void* d_temp,
                                                    std::size_t& temp_bytes,
                                                    const problem<Element>& p,
                                                    Element* dq,
                                                    Element* dk,
                                                    state_type* d_state,
                                                    cublasHandle_t handle,
                                                    cudaStream_t stream = 0,
                                                    const chunk_options& opts = {})
  {
    return cuda_error_of(forward_backward_status(d_temp, temp_bytes, p, dq, dk, d_state, handle, stream, opts));
  }

  /// forward_backward with a status instead of a cudaError_t (as device::loss::forward_backward_status): an argument
  /// the call refuses is named, and a CUDA or cuBLAS failure names the call with that library's own code in
  /// status::native().
  static status forward_backward_status(void* d_temp,
                                        std::size_t& temp_bytes,
                                        const problem<Element>& p,
                                        Element* dq,
                                        Element* dk,
                                        state_type* d_state,
                                        cublasHandle_t handle,
                                        cudaStream_t stream = 0,
                                        const chunk_options& opts = {})
  {
    namespace cd = chunked_phases;
    CONTRASTIVE_RETURN_IF_ERROR(check(p, dq, dk, d_state, handle));
    // The size query sizes a default chunk from free memory; the step takes the rows its workspace holds (the same).
    cd::layout w{};
    CONTRASTIVE_RETURN_IF_ERROR(detail::cuda_status(
        d_temp == nullptr ? make_layout(p, opts, w) : layout_to_fit(p, opts, temp_bytes, w), "the workspace layout"));
    if (d_temp == nullptr)
    {
      temp_bytes = w.total;
      return {};
    }
    CONTRASTIVE_RETURN_IF_ERROR(util::workspace_status(d_temp, temp_bytes, w.total));
    cd::handle_guard guard{handle};
    CONTRASTIVE_RETURN_IF_ERROR(cd::cublas_status(guard.enter(stream), "handle (cublasSetStream)"));
    return objectives::visit(p,
                             [&](auto o)
                             {
                               return run_step<decltype(o)>(p, w, d_temp, dq, dk, d_state, handle, stream);
                             });
  }

private:
  /// The pass of forward_backward_status for objective O, its workspace laid out and the handle entered.
  template <class O>
  static status run_step(const problem<Element>& p,
                         const chunked_phases::layout& w,
                         void* d_temp,
                         Element* dq,
                         Element* dk,
                         state_type* d_state,
                         cublasHandle_t handle,
                         cudaStream_t stream)
  {
    namespace cd = chunked_phases;
    cd::runner<Element, O> run(p, w, d_temp, handle, stream, O::coefficients(p.n_q, p.n_k));
    const cudaError_t e = [&]() -> cudaError_t
    {
      CONTRASTIVE_CUDA_TRY(run.begin(d_state));
      if constexpr (O::columns)
      {
        CONTRASTIVE_CUDA_TRY(run.forward_all());
        CONTRASTIVE_CUDA_TRY(run.finish_columns_local());
      }
      CONTRASTIVE_CUDA_TRY(run.backward_all(dq));
      CONTRASTIVE_CUDA_TRY(run.store_dk(run.dk_accumulator(), dk, p.n_k));
      CONTRASTIVE_CUDA_TRY(run.reduce_local());
      return run.finish(d_state, p.n_q, p.n_k);
    }();
    if (run.cublas_failure() != CUBLAS_STATUS_SUCCESS)
    {
      return cd::cublas_status(run.cublas_failure(), "cublasGemmEx");
    }
    return detail::cuda_status(e, "forward_backward");
  }

public:
  /// step with a status (see forward_backward_status).
  static status step_status(void* d_temp,
                            std::size_t& temp_bytes,
                            const problem<Element>& p,
                            Element* dq,
                            Element* dk,
                            state_type* d_state,
                            cublasHandle_t handle,
                            cudaStream_t stream = 0,
                            const chunk_options& opts = {})
  {
    CONTRASTIVE_RETURN_IF_ERROR(forward_backward_status(d_temp, temp_bytes, p, dq, dk, d_state, handle, stream, opts));
    if (d_temp == nullptr)
    {
      return {};
    }
    return detail::cuda_status(finish_step(d_state, stream), "finish_step");
  }

  /// One pass over a caller gradient buffer: unscale in place and flag non-finite values (site `parameters`).
  [[nodiscard]] static cudaError_t
  unscale_and_check(float* grads, std::size_t n, state_type* d_state, cudaStream_t stream = 0)
  {
    return common::unscale_and_check(grads, n, d_state, stream);
  }

  /// Step 4: scaler update, then the temperature (and a learnable logit bias) update if the step was finite;
  /// increments the step counter.
  [[nodiscard]] static cudaError_t finish_step(state_type* d_state, cudaStream_t stream = 0)
  {
    return common::finish_step(d_state, stream);
  }

  /// A whole step: forward_backward then finish_step.
  [[nodiscard]] static cudaError_t step(void* d_temp,
                                        std::size_t& temp_bytes,
                                        const problem<Element>& p,
                                        Element* dq,
                                        Element* dk,
                                        state_type* d_state,
                                        cublasHandle_t handle,
                                        cudaStream_t stream = 0,
                                        const chunk_options& opts = {})
  {
    return cuda_error_of(step_status(d_temp, temp_bytes, p, dq, dk, d_state, handle, stream, opts));
  }
};
} // namespace chunked_phases

/// The device loss with algorithm::chunked (see the file comment). make_state, unscale_and_check and finish_step are
/// those of the other algorithms; forward_backward and step take a cuBLAS handle and chunk options.
template <class Element, class Temperature, class Scaler>
struct loss<Element, Temperature, Scaler, algorithm::chunked>
    : chunked_phases::chunked_loss<Element, Temperature, Scaler, /*KeepLogits=*/false>
{
};

/// The device loss with algorithm::automatic: the chunked loss (same calls, cuBLAS handle and chunk options) whose
/// default chunk (options with neither rows nor budget_bytes) holds every row where that workspace fits a quarter of
/// the device memory free at the size query, so the logits are computed once and kept between the passes
/// (6 n_q n_k d flops, the materialized algorithm's count, with chunked's float logits and exact positive term);
/// else the chunked default (4096-row chunks, the logits recomputed in the backward: 8 n_q n_k d). `budget_bytes`
/// replaces the quarter of free memory as the one chunk's budget (the whole workspace must fit it); `rows` runs the
/// chunked loss with that many rows per chunk. The accuracy is chunked's either way (float logits), unlike
/// the host's automatic, whose materialized choice rounds the logits to the element type.
template <class Element, class Temperature, class Scaler>
struct loss<Element, Temperature, Scaler, algorithm::automatic>
    : chunked_phases::chunked_loss<Element, Temperature, Scaler, /*KeepLogits=*/true>
{
};
} // namespace device
} // namespace contrastive
