// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What each algorithm means to the host engine, in one place: the buffers it needs (what `bytes_for` counts and
/// `prepare` sizes) and how its logits tile is formed. The phase functions that run it are `host::algorithm_impl`
/// (host/algorithms.hpp). A new algorithm is a tag (tags.hpp, added to `algorithm::all`), a specialization here and
/// one there.

#include <contrastive/tags.hpp>

namespace contrastive
{
namespace host
{
template <class Algorithm>
struct algorithm_traits;

template <>
struct algorithm_traits<algorithm::fused>
{
  /// Logits tiles are recomputed from the float products (not read back from a stored element-type matrix).
  static constexpr bool stores_logits = false;
  /// K and Q kept whole for dQ = G K and dK = G^T Q, and a per-worker block accumulator (else: per key tile).
  static constexpr bool whole_products = false;
  /// Rows in chunks with running column statistics (else: per-worker column partials, merged at the end).
  static constexpr bool chunks = false;
};

template <>
struct algorithm_traits<algorithm::materialized>
{
  static constexpr bool stores_logits = true;
  static constexpr bool whole_products = true;
  static constexpr bool chunks = false;
};

template <>
struct algorithm_traits<algorithm::chunked>
{
  static constexpr bool stores_logits = false;
  static constexpr bool whole_products = true;
  static constexpr bool chunks = true;
};
/// algorithm::automatic resolves to fused or materialized per call (host::engine); neither chunks.
template <>
struct algorithm_traits<algorithm::automatic>
{
  static constexpr bool chunks = false;
};
} // namespace host
} // namespace contrastive
