// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `distributed::comm::mpi`: the communicator policy over MPI (any MPI-3 implementation; Open MPI is the documented
/// one). Include this header and link MPI (CMake: `contrastive::mpi`, which finds it with FindMPI). Users of the
/// single-process loss need neither.
///
/// The constructor duplicates the caller's communicator (a collective: call it on every rank of `c`), so the loss's
/// collectives never match the caller's own messages, and sets MPI_ERRORS_RETURN on the duplicate, so an MPI failure
/// comes back as errc::communication_error with MPI's message instead of aborting. Copies share the duplicate; the
/// last one frees it (also a collective, at destruction: destroy the loss on every rank, before MPI_Finalize).

#include <contrastive/comm/communicator.hpp>
#include <contrastive/status.hpp>

#include <climits>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <mpi.h>

namespace contrastive
{
namespace distributed
{
namespace comm
{
/// The communicator policy over MPI (see the file comment): a copyable handle on a duplicate of the caller's
/// communicator. Collectives return errc::communication_error with MPI's message when MPI fails or the handle is
/// invalid, and errc::size_overflow when a count exceeds MPI's int.
class mpi
{
public:
  static constexpr const char* name = "mpi"; ///< the communicator's name, for messages

  /// Duplicates `c` (collective). A failed duplication leaves the handle invalid: every call then returns
  /// errc::communication_error.
  explicit mpi(MPI_Comm c = MPI_COMM_WORLD)
  {
    auto owned = std::make_shared<handle>();
    if (MPI_Comm_dup(c, &owned->comm) == MPI_SUCCESS)
    {
      MPI_Comm_set_errhandler(owned->comm, MPI_ERRORS_RETURN);
      MPI_Comm_rank(owned->comm, &owned->rank);
      MPI_Comm_size(owned->comm, &owned->size);
      h_ = std::move(owned);
    }
  }

  /// This process's rank in the duplicate; 0 when the duplication failed.
  int rank() const noexcept
  {
    return h_ ? h_->rank : 0;
  }
  /// The number of ranks in the duplicate; 1 when the duplication failed.
  int size() const noexcept
  {
    return h_ ? h_->size : 1;
  }
  /// The duplicated MPI communicator; MPI_COMM_NULL when the duplication failed.
  MPI_Comm native() const noexcept
  {
    return h_ ? h_->comm : MPI_COMM_NULL;
  }

  /// Gathers `bytes` bytes from every rank into `all` (size() blocks, rank order); at most INT_MAX bytes.
  status allgather(const void* mine, std::size_t bytes, void* all) const
  {
    if (bytes > static_cast<std::size_t>(INT_MAX))
    {
      return too_large("allgather", bytes);
    }
    return check(
        "MPI_Allgather",
        h_ ? MPI_Allgather(mine, static_cast<int>(bytes), MPI_BYTE, all, static_cast<int>(bytes), MPI_BYTE, h_->comm)
           : MPI_ERR_COMM);
  }

  /// Gathers rows[r] rows of `row_bytes` bytes from every rank r into `all`, concatenated in rank order; one row and
  /// each rank's row offset at most INT_MAX.
  status allgatherv_rows(const void* mine, const int* rows, std::size_t row_bytes, void* all) const
  {
    if (!h_)
    {
      return check("MPI_Allgatherv", MPI_ERR_COMM);
    }
    if (row_bytes > static_cast<std::size_t>(INT_MAX))
    {
      return too_large("allgatherv (one row)", row_bytes);
    }
    // Rows as one derived datatype: counts stay in rows, so a rank may send up to INT_MAX rows.
    MPI_Datatype row;
    if (const int e = MPI_Type_contiguous(static_cast<int>(row_bytes), MPI_BYTE, &row); e != MPI_SUCCESS)
    {
      return check("MPI_Type_contiguous", e);
    }
    MPI_Type_commit(&row);
    std::vector<int> displs(static_cast<std::size_t>(h_->size));
    long long at = 0;
    for (int r = 0; r < h_->size; ++r)
    {
      if (at > INT_MAX)
      {
        MPI_Type_free(&row);
        return too_large("allgatherv (row offset)", static_cast<std::size_t>(at));
      }
      displs[static_cast<std::size_t>(r)] = static_cast<int>(at);
      at += rows[r];
    }
    const int e = MPI_Allgatherv(mine, rows[h_->rank], row, all, rows, displs.data(), row, h_->comm);
    MPI_Type_free(&row);
    return check("MPI_Allgatherv", e);
  }

  /// Sums `all` (the sum of counts floats) over the ranks; rank r receives its counts[r] floats of the sum in `mine`.
  status reduce_scatter_sum(const float* all, const int* counts, float* mine) const
  {
    return check("MPI_Reduce_scatter",
                 h_ ? MPI_Reduce_scatter(all, mine, counts, MPI_FLOAT, MPI_SUM, h_->comm) : MPI_ERR_COMM);
  }

  /// Copies `bytes` bytes of `buf` from rank `root` to every rank; at most INT_MAX bytes.
  status broadcast(void* buf, std::size_t bytes, int root) const
  {
    if (bytes > static_cast<std::size_t>(INT_MAX))
    {
      return too_large("broadcast", bytes);
    }
    return check("MPI_Bcast", h_ ? MPI_Bcast(buf, static_cast<int>(bytes), MPI_BYTE, root, h_->comm) : MPI_ERR_COMM);
  }

  /// Reduces `n` floats of `data` over the ranks in place (sum or max); at most INT_MAX floats.
  status allreduce(float* data, std::size_t n, reduce_op op) const
  {
    if (n > static_cast<std::size_t>(INT_MAX))
    {
      return too_large("allreduce", n * sizeof(float));
    }
    return check(
        "MPI_Allreduce",
        h_ ? MPI_Allreduce(
                 MPI_IN_PLACE, data, static_cast<int>(n), MPI_FLOAT, op == reduce_op::sum ? MPI_SUM : MPI_MAX, h_->comm)
           : MPI_ERR_COMM);
  }

private:
  struct handle
  {
    MPI_Comm comm = MPI_COMM_NULL;
    int rank = 0;
    int size = 1;
    handle() = default;
    handle(const handle&) = delete;
    handle& operator=(const handle&) = delete;
    ~handle()
    {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (comm != MPI_COMM_NULL && !finalized)
      {
        MPI_Comm_free(&comm);
      }
    }
  };

  static status check(const char* what, int code)
  {
    if (code == MPI_SUCCESS)
    {
      return {};
    }
    char text[MPI_MAX_ERROR_STRING] = {};
    int len = 0;
    MPI_Error_string(code, text, &len);
    return {errc::communication_error,
            what,
            std::string(what) + " failed: " + std::string(text, text + len),
            {native_api::mpi, code}};
  }

  static status too_large(const char* what, std::size_t bytes)
  {
    return {errc::size_overflow,
            what,
            std::string(what) + ": " + std::to_string(bytes) + " bytes exceed MPI's int count (" +
                std::to_string(INT_MAX) + ")"};
  }

  std::shared_ptr<handle> h_;
};
} // namespace comm
} // namespace distributed
} // namespace contrastive
