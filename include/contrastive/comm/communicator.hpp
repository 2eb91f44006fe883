// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The communicator policy of `distributed::loss`: the few collectives the global-batch loss needs, on host
/// buffers. `comm::local` (one process, no library) is here; `comm::mpi` is in <contrastive/comm/mpi.hpp>
/// (include it and link MPI, CMake `contrastive::mpi`). A communicator is a small copyable handle; every rank must
/// call every collective in the same order (the distributed loss does so on every path, errors included).
///
/// Interface (all return a status; `what` names the collective in errors):
///   int rank() const; int size() const;
///   status allgather(const void* mine, std::size_t bytes, void* all)            equal-size blocks, rank order
///   status allgatherv_rows(const void* mine, const int* rows, std::size_t row_bytes, void* all)
///                                                  rows[r] rows of row_bytes bytes from rank r, concatenated
///   status reduce_scatter_sum(const float* all, const int* counts, float* mine) sum over ranks of `all`
///                                                  (sum of counts floats), rank r keeps its counts[r] floats
///   status broadcast(void* buf, std::size_t bytes, int root)
///   status allreduce(float* data, std::size_t n, reduce_op op)                 in place, op: sum or max

#include <contrastive/status.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace contrastive
{
namespace distributed
{
/// The distributed losses' `iteration` argument when the caller gives none (it must then be omitted on every rank).
inline constexpr std::int64_t no_iteration = -1;

/// Reductions `allreduce` offers.
enum class reduce_op
{
  sum,
  max,
};

namespace comm
{
/// One process: every collective is a copy. The distributed loss over `local` equals the single-process loss, which
/// lets its code path be tested without MPI.
struct local
{
  /// The communicator's name, for messages.
  static constexpr const char* name = "local";
  /// This process's rank: always 0.
  int rank() const noexcept
  {
    return 0;
  }
  /// The number of ranks: always 1.
  int size() const noexcept
  {
    return 1;
  }
  /// Copies `bytes` bytes from `mine` to `all` (they may overlap); never fails.
  status allgather(const void* mine, std::size_t bytes, void* all) const
  {
    copy(all, mine, bytes);
    return {};
  }
  /// Copies rows[0] rows of `row_bytes` bytes from `mine` to `all` (they may overlap); never fails.
  status allgatherv_rows(const void* mine, const int* rows, std::size_t row_bytes, void* all) const
  {
    copy(all, mine, static_cast<std::size_t>(rows[0]) * row_bytes);
    return {};
  }
  /// Copies counts[0] floats from `all` to `mine` (they may overlap): the sum over one rank; never fails.
  status reduce_scatter_sum(const float* all, const int* counts, float* mine) const
  {
    copy(mine, all, static_cast<std::size_t>(counts[0]) * sizeof(float));
    return {};
  }
  /// Nothing to send: the one rank is the root. Never fails.
  status broadcast(void*, std::size_t, int) const
  {
    return {};
  }
  /// Nothing to reduce: the data is already the result over one rank. Never fails.
  status allreduce(float*, std::size_t, reduce_op) const
  {
    return {};
  }

private:
  static void copy(void* to, const void* from, std::size_t bytes) noexcept
  {
    if (bytes != 0 && to != from)
    {
      std::memmove(to, from, bytes);
    }
  }
};

/// One process and no communication: the single-process `contrastive::loss`. The step driver (step/driver.hpp) elides
/// every collective at compile time for it (K read in place, gradients written directly, no agreement); `local` runs
/// the distributed algorithm's copies instead.
struct self : local
{
  static constexpr const char* name = "self"; ///< the communicator's name, for messages
};
} // namespace comm

/// Whether a communicator is `comm::self`: one process whose steps need no collective at all.
template <class C>
inline constexpr bool is_single_process_v = std::is_same_v<C, comm::self>;

/// A type with rank(), size() and the collectives above; checked by the distributed loss.
template <class C, class = void>
struct is_communicator : std::false_type
{
};
template <class C>
struct is_communicator<C,
                       std::void_t<decltype(std::declval<const C&>().rank()),
                                   decltype(std::declval<const C&>().size()),
                                   decltype(std::declval<const C&>().allgather(nullptr, 0, nullptr)),
                                   decltype(std::declval<const C&>().allgatherv_rows(nullptr, nullptr, 0, nullptr)),
                                   decltype(std::declval<const C&>().reduce_scatter_sum(nullptr, nullptr, nullptr)),
                                   decltype(std::declval<const C&>().broadcast(nullptr, 0, 0)),
                                   decltype(std::declval<const C&>().allreduce(nullptr, 0, reduce_op::sum))>>
    : std::true_type
{
};
/// Whether `C` is a communicator (`is_communicator`).
template <class C>
inline constexpr bool is_communicator_v = is_communicator<C>::value;
} // namespace distributed
} // namespace contrastive
