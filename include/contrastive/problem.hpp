// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What a call computes: the inputs (`problem`) and the chunking of algorithm::chunked; with the tags (tags.hpp) and
/// the per-step record (record.hpp), which this header includes.

#include <contrastive/detail/config.hpp>
#include <contrastive/record.hpp>
#include <contrastive/tags.hpp>

#include <cstddef>
#include <cstdint>

namespace contrastive
{
/// How many query rows one chunk of algorithm::chunked holds. `rows` > 0 asks for that many (rounded up to the
/// implementation's row block, at most all rows); otherwise as many as fit in `budget_bytes` of chunk buffers, or,
/// when that is 0 too, the implementation's default: host, 16 MiB of chunk buffer; device, 4096 rows, fewer where a
/// quarter of the free device memory does not hold their buffers, never fewer than 384 MiB's worth or 256 rows
/// (device/chunked.cuh; the default reads free memory, so give `rows` for bit-identical results across calls). At
/// least one row block.
struct chunk_options
{
  std::size_t rows = 0;         ///< query rows per chunk; 0: sized from budget_bytes
  std::size_t budget_bytes = 0; ///< bytes of chunk buffers when rows is 0; 0 too: the default
  /// Device, 16-bit element types: compute each logits tile on tensor cores with the library's kernel and consume it
  /// in registers (forward: row and column statistics; backward: G_c) instead of a cuBLAS product written to and read
  /// back from a float chunk: 6 bytes of memory traffic per logit instead of 26, and no float chunk (about 2.1 bytes
  /// per chunk logit instead of 6, so a budget holds ~3x the rows). Used where the device is sm_80 or later, dim is a
  /// multiple of 8 and q, k are 16-byte aligned; otherwise (and on the host, for float and for the sigmoid objective)
  /// the cuBLAS path runs.
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

/// Inputs of one call. Row-major, contiguous rows: q is n_q x dim, k is n_k x dim.
template <class T>
struct problem
{
  const T* q = nullptr; ///< queries, n_q x dim (device memory on the device path)
  const T* k = nullptr; ///< keys, n_k x dim (device memory on the device path)
  std::size_t n_q = 0;  ///< number of queries (rows of q), nonzero
  std::size_t n_k = 0;  ///< number of keys (rows of k), nonzero; symmetric without group ids: equal to n_q
  std::size_t dim = 0;  ///< embedding dimension (columns of q and k), nonzero
  /// info_nce and sigmoid: positive key of each query (n_q entries in [0, n_k)); null means the diagonal p_i = i.
  /// The symmetric objective takes the diagonal and refuses labels.
  const std::int32_t* labels = nullptr;
  objective obj = objective::symmetric; ///< the loss taken over the logits
  /// Several positives per row (give both or neither; not with `labels`): a group id per query (n_q entries) and per
  /// key (n_k entries); the pair (i, j) is positive when query_groups[i] == key_groups[j]. The softmax objectives then
  /// take each row's cross-entropy against the uniform distribution over its positives, averaged over the rows that
  /// have one (symmetric: likewise over the columns, and n_q may differ from n_k); the sigmoid objective labels every
  /// positive pair +1 and every other -1. docs/multi_positive.md gives the formulas. Host memory; host paths only.
  const std::int64_t* query_groups = nullptr;
  const std::int64_t* key_groups = nullptr; ///< the keys' group ids (n_k entries); see query_groups

  /// Whether the positives come from group ids.
  bool grouped() const noexcept
  {
    return query_groups != nullptr || key_groups != nullptr;
  }
};

} // namespace contrastive
