// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What a call computes: the inputs, the objective, the algorithm tags, and the per-step record.

#include <contrastive/detail/config.hpp>

#include <cstddef>
#include <cstdint>

namespace contrastive
{
/// Which cross-entropy is taken over the logits S_ij = s <q_i, k_j>.
enum class objective : std::int32_t
{
  /// CLIP's loss: 0.5 * (mean_i CE(S_i., i) + mean_j CE(S_.j, j)); needs n_q == n_k, positives on the diagonal.
  symmetric = 0,
  /// One-directional InfoNCE: mean_i CE(S_i., p_i) with p_i = labels[i] (default i); n_k may exceed n_q (MoCo queue).
  info_nce = 1,
};

inline const char* to_string(objective o) noexcept
{
  return o == objective::symmetric ? "symmetric" : "info_nce";
}

namespace algorithm
{
/// Builds the n_q x n_k logits in the element type, as frameworks' autocast does: A = round_T(Q K^T) (float
/// accumulation), S = round_T(s * A), cross-entropy in float; backward forms dS = round_T(loss_scale * dL/dS) and
/// dA = round_T(s * dS) in the element type, then dQ = round_T(dA K), dK = round_T(dA^T Q). Memory O(n_q n_k).
/// On this path a large s overflows fp16 logits exactly as in the seed.
struct materialized
{
  static constexpr const char* name = "materialized";
};

/// Tiled, online log-sum-exp (flash-attention style): logits live only in float tiles, never in memory; backward
/// recomputes them from the saved row/column log-sum-exps. The only rounding to the element type is the final
/// dQ = round_T(loss_scale * s * sum_j G_ij k_j) and dK likewise. Memory O((n_q + n_k) d).
struct fused
{
  static constexpr const char* name = "fused";
};

/// Row chunks of B queries against all keys: S_c = s Q_c K^T is stored for one chunk at a time (float), its row
/// statistics are complete within the chunk and the column statistics of the symmetric loss are merged from
/// per-chunk partials; the backward forms G_c, then dQ_c = s G_c K and dK += s G_c^T Q_c. Each step is one large
/// matrix product (cuBLAS on the device, the host GEMM policy on the host) plus element-wise passes built from the
/// shared tile math. Work: 6 n_q n_k d flops when one chunk holds every row, else 8 (the backward recomputes S_c);
/// memory O(B n_k + (n_q + n_k) d), B chosen by `chunk_options`. Numerics as `fused` (float logits, the positive's
/// gradient formed exactly); on the device G_c is rounded to the element type for the tensor-core products.
struct chunked
{
  static constexpr const char* name = "chunked";
};
} // namespace algorithm

/// How many query rows one chunk of algorithm::chunked holds. `rows` > 0 asks for that many (rounded up to the
/// implementation's row block, at most all rows); otherwise as many as fit in `budget_bytes` of chunk buffers, or in
/// the implementation's default budget (host 16 MiB; device 384 MiB and at least 256 rows) when that is 0 too. At least
/// one row block.
struct chunk_options
{
  std::size_t rows = 0;
  std::size_t budget_bytes = 0;
  /// Device, 16-bit element types: compute each logits tile on tensor cores with the library's kernel and consume it
  /// in registers (forward: row and column statistics; backward: G_c) instead of a cuBLAS product written to and read
  /// back from a float chunk: 6 bytes of memory traffic per logit instead of 26, and no float chunk (about 2.1 bytes
  /// per chunk logit instead of 6, so a budget holds ~3x the rows). Used where the device is sm_80 or later, dim is a
  /// multiple of 8 and q, k are 16-byte aligned; otherwise (and on the host, and for float) the cuBLAS path runs.
  /// Off by default until it has been measured on a GPU (scripts/gpu_check.sh runs both).
  bool fused_tiles = false;
};

namespace detail
{
/// Rows per chunk for `o`: a multiple of `align` (> 0) in [align, round_up(n_q, align)], from a per-row cost of
/// `bytes_per_row` (> 0) buffer bytes when `o.rows` is 0.
inline std::size_t chunk_rows_for(const chunk_options& o,
                                  std::size_t n_q,
                                  std::size_t bytes_per_row,
                                  std::size_t align,
                                  std::size_t default_budget) noexcept
{
  const std::size_t all = (n_q + align - 1) / align * align;
  std::size_t rows = o.rows;
  if (rows == 0)
  {
    const std::size_t budget = o.budget_bytes != 0 ? o.budget_bytes : default_budget;
    rows = budget / (bytes_per_row == 0 ? 1 : bytes_per_row) / align * align;
  }
  else
  {
    rows = rows >= all ? all : (rows + align - 1) / align * align;
  }
  return rows < align ? align : (rows > all ? all : rows);
}
} // namespace detail

/// The host GEMM core, chosen at compile time (the last template argument of `contrastive::loss`; the device path
/// uses cuBLAS-free kernels of its own and ignores it).
namespace gemm
{
/// The library's own packed, register-blocked micro-kernel (host/gemm.hpp): no dependency.
struct builtin
{
  static constexpr const char* name = "builtin";
};

/// A CBLAS `cblas_sgemm` (OpenBLAS, BLIS, MKL, ...) for users who already link one: include
/// <contrastive/host/cblas_gemm.hpp> and link a CBLAS (CMake: the `contrastive::cblas` target, which finds one with
/// FindBLAS). Run the BLAS single-threaded (OPENBLAS_NUM_THREADS=1, or `host::cblas_single_threaded()`): the loss
/// parallelises over its own workers and calls the BLAS from each of them.
struct cblas
{
  static constexpr const char* name = "cblas";
};
} // namespace gemm

/// Inputs of one call. Row-major, contiguous rows: q is n_q x dim, k is n_k x dim.
template <class T>
struct problem
{
  const T* q = nullptr;
  const T* k = nullptr;
  std::size_t n_q = 0;
  std::size_t n_k = 0;
  std::size_t dim = 0;
  /// info_nce only: positive key of each query (n_q entries in [0, n_k)); null means the diagonal p_i = i.
  const std::int32_t* labels = nullptr;
  objective obj = objective::symmetric;
};

/// Where a step's first non-finite value appeared, in the order the step computes them.
enum class nonfinite_site : std::int32_t
{
  none = 0,
  logits,           ///< a logit S_ij (materialized: its element-type value) is +-inf or NaN
  loss,             ///< the loss value
  grad_q,           ///< dQ after scaling and rounding to the element type
  grad_k,           ///< dK after scaling and rounding to the element type
  grad_logit_scale, ///< d(loss)/d(log s), only when the temperature policy uses it
  parameters,       ///< a caller-supplied gradient passed to `unscale_and_check`
};

inline const char* to_string(nonfinite_site s) noexcept
{
  switch (s)
  {
  case nonfinite_site::none:
    return "none";
  case nonfinite_site::logits:
    return "logits";
  case nonfinite_site::loss:
    return "loss";
  case nonfinite_site::grad_q:
    return "grad_q";
  case nonfinite_site::grad_k:
    return "grad_k";
  case nonfinite_site::grad_logit_scale:
    return "grad_logit_scale";
  case nonfinite_site::parameters:
    return "parameters";
  }
  return "unknown";
}

/// Outcome of one training step.
struct step_record
{
  std::int64_t step = 0;         ///< index of this step (counts every call, skipped or not)
  float loss = 0.0f;             ///< unscaled loss
  float tau = 0.0f;              ///< temperature used by this step
  float loss_scale = 0.0f;       ///< loss scale used by this step's backward
  float next_loss_scale = 0.0f;  ///< loss scale after the scaler's update
  float grad_logit_scale = 0.0f; ///< unscaled d(loss)/d(log s)
  float max_logit = 0.0f;        ///< largest logit S_ij of the step (materialized: its element-type value)
  bool skipped = false;          ///< a non-finite value was found: the temperature did not move
  nonfinite_site first_nonfinite = nonfinite_site::none;
  bool pending = false; ///< forward/backward done, `finish_step` not yet called
};
} // namespace contrastive
