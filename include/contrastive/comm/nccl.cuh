// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `distributed::comm::nccl`: the communicator policy (comm/communicator.hpp) over NCCL, with collectives on
/// device buffers and a stream; the host-memory collectives of the agreement go through a device staging buffer.
/// The device loss over it is distributed/nccl.cuh. Include it in a .cu file and link NCCL (CMake:
/// `contrastive::nccl`).

#include <contrastive/comm/communicator.hpp>
#include <contrastive/detail/cuda_status.cuh>
#include <contrastive/status.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <cuda_runtime.h>
#include <nccl.h>

namespace contrastive
{
namespace distributed
{
namespace comm
{
/// NCCL communicator policy. Wraps a caller-owned ncclComm_t (not destroyed here) and the stream the collectives are
/// enqueued on (`set_stream`; the device loss sets it to each call's stream). Host-memory collectives (the
/// agreement) go through a small device staging buffer and synchronize the stream.
class nccl
{
public:
  static constexpr const char* name = "nccl";

  explicit nccl(ncclComm_t c, cudaStream_t s = nullptr) : comm_(c), stream_(s), staging_(std::make_shared<buffer>())
  {
    if (c != nullptr)
    {
      ncclCommCount(c, &size_);
      ncclCommUserRank(c, &rank_);
    }
  }

  int rank() const noexcept
  {
    return rank_;
  }
  int size() const noexcept
  {
    return size_;
  }
  ncclComm_t native() const noexcept
  {
    return comm_;
  }
  void set_stream(cudaStream_t s) noexcept
  {
    stream_ = s;
  }
  cudaStream_t stream() const noexcept
  {
    return stream_;
  }

  /// Host memory, equal blocks in rank order (synchronizes the stream).
  status allgather(const void* mine, std::size_t bytes, void* all) const
  {
    const std::size_t total = bytes * static_cast<std::size_t>(size_);
    CONTRASTIVE_RETURN_IF_ERROR(stage(total + bytes));
    char* dev = static_cast<char*>(staging_->ptr);
    CONTRASTIVE_RETURN_IF_ERROR(
        cuda("cudaMemcpyAsync", cudaMemcpyAsync(dev + total, mine, bytes, cudaMemcpyHostToDevice, stream_)));
    CONTRASTIVE_RETURN_IF_ERROR(
        check("ncclAllGather", ncclAllGather(dev + total, dev, bytes, ncclInt8, comm_, stream_)));
    CONTRASTIVE_RETURN_IF_ERROR(
        cuda("cudaMemcpyAsync", cudaMemcpyAsync(all, dev, total, cudaMemcpyDeviceToHost, stream_)));
    return cuda("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
  }

  /// Host memory, from `root` to every rank (synchronizes the stream).
  status broadcast(void* buf, std::size_t bytes, int root) const
  {
    CONTRASTIVE_RETURN_IF_ERROR(stage(bytes));
    CONTRASTIVE_RETURN_IF_ERROR(
        cuda("cudaMemcpyAsync", cudaMemcpyAsync(staging_->ptr, buf, bytes, cudaMemcpyHostToDevice, stream_)));
    CONTRASTIVE_RETURN_IF_ERROR(
        check("ncclBroadcast", ncclBroadcast(staging_->ptr, staging_->ptr, bytes, ncclInt8, root, comm_, stream_)));
    CONTRASTIVE_RETURN_IF_ERROR(
        cuda("cudaMemcpyAsync", cudaMemcpyAsync(buf, staging_->ptr, bytes, cudaMemcpyDeviceToHost, stream_)));
    return cuda("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
  }

  /// Device memory: rows[r] rows of row_bytes from rank r, concatenated in rank order (one broadcast per rank in
  /// one NCCL group, so the row counts may differ).
  status allgatherv_rows(const void* mine, const int* rows, std::size_t row_bytes, void* all) const
  {
    CONTRASTIVE_RETURN_IF_ERROR(check("ncclGroupStart", ncclGroupStart()));
    std::size_t at = 0;
    ncclResult_t err = ncclSuccess;
    for (int r = 0; r < size_; ++r) // every call is issued, so every rank's group holds the same operations
    {
      const std::size_t bytes = static_cast<std::size_t>(rows[r]) * row_bytes;
      const ncclResult_t e = ncclBroadcast(mine, static_cast<char*>(all) + at, bytes, ncclInt8, r, comm_, stream_);
      err = err == ncclSuccess ? e : err;
      at += bytes;
    }
    const ncclResult_t end = ncclGroupEnd();
    CONTRASTIVE_RETURN_IF_ERROR(check("ncclBroadcast", err));
    return check("ncclGroupEnd", end);
  }

  /// Device memory: the sum over ranks of `all`; rank r keeps its counts[r] floats (one reduce per rank in a group).
  status reduce_scatter_sum(const float* all, const int* counts, float* mine) const
  {
    CONTRASTIVE_RETURN_IF_ERROR(check("ncclGroupStart", ncclGroupStart()));
    std::size_t at = 0;
    ncclResult_t err = ncclSuccess;
    for (int r = 0; r < size_; ++r)
    {
      const std::size_t n = static_cast<std::size_t>(counts[r]);
      const ncclResult_t e = ncclReduce(all + at, mine, n, ncclFloat32, ncclSum, r, comm_, stream_);
      err = err == ncclSuccess ? e : err;
      at += n;
    }
    const ncclResult_t end = ncclGroupEnd();
    CONTRASTIVE_RETURN_IF_ERROR(check("ncclReduce", err));
    return check("ncclGroupEnd", end);
  }

  /// Device memory, from `send` into `recv` (not in place: the device loss sends a constant).
  status allreduce(const float* send, float* recv, std::size_t n, reduce_op op) const
  {
    return check("ncclAllReduce",
                 ncclAllReduce(send, recv, n, ncclFloat32, op == reduce_op::sum ? ncclSum : ncclMax, comm_, stream_));
  }

  /// Device memory, in place.
  status allreduce(float* data, std::size_t n, reduce_op op) const
  {
    return check("ncclAllReduce",
                 ncclAllReduce(data, data, n, ncclFloat32, op == reduce_op::sum ? ncclSum : ncclMax, comm_, stream_));
  }

  /// Device memory, in place: the minimum of n ints.
  status allreduce_min(std::int32_t* data, std::size_t n) const
  {
    return check("ncclAllReduce", ncclAllReduce(data, data, n, ncclInt32, ncclMin, comm_, stream_));
  }

private:
  struct buffer
  {
    void* ptr = nullptr;
    std::size_t bytes = 0;
    buffer() = default;
    buffer(const buffer&) = delete;
    buffer& operator=(const buffer&) = delete;
    ~buffer()
    {
      cudaFree(ptr);
    }
  };

  status stage(std::size_t bytes) const
  {
    if (staging_->bytes >= bytes)
    {
      return {};
    }
    cudaFree(staging_->ptr);
    staging_->ptr = nullptr;
    staging_->bytes = 0;
    CONTRASTIVE_RETURN_IF_ERROR(cuda("cudaMalloc", cudaMalloc(&staging_->ptr, bytes)));
    staging_->bytes = bytes;
    return {};
  }

  static status check(const char* what, ncclResult_t r)
  {
    if (r == ncclSuccess)
    {
      return {};
    }
    return {errc::communication_error,
            what,
            std::string(what) + " failed: " + ncclGetErrorString(r),
            {native_api::nccl, static_cast<int>(r)}};
  }

  static status cuda(const char* what, cudaError_t e)
  {
    return detail::cuda_status(e, what);
  }

  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int rank_ = 0, size_ = 1;
  std::shared_ptr<buffer> staging_;
};
} // namespace comm
} // namespace distributed
} // namespace contrastive
