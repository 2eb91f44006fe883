// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// `contrastive_torch::torch_comm`: the library's communicator policy (contrastive/comm/communicator.hpp) over a
// torch.distributed process group (c10d::ProcessGroup, e.g. gloo), so that contrastive::core computes the loss of the
// global batch with PyTorch's own collectives. Host buffers are wrapped as CPU tensors (from_blob: no copy) and each
// collective is waited for before it returns (call it with the GIL released). A failing collective (a c10 exception:
// a rank that left, the group's timeout) comes back as errc::communication_error naming the collective and the
// backend, never as an exception through the library.
//
// Gloo's allgather needs equal sizes: allgatherv_rows with unequal row counts pads every rank's rows to the largest
// count (one staging copy of the gathered rows); reduce_scatter takes unequal counts as they are.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/extension.h>

#include <contrastive/comm/communicator.hpp>
#include <contrastive/status.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace contrastive_torch
{
class torch_comm
{
  struct binding
  {
    c10d::ProcessGroup* group = nullptr; // bound for the duration of a call (scope), else null
    int rank = 0;
    int size = 1;
  };

public:
  static constexpr const char* name = "torch.distributed";

  /// For this process's rank in a group of `size` ranks; the group itself is bound per call (`bind`), so an engine
  /// kept between steps never keeps a process group alive (a ProcessGroupGloo destroyed at interpreter exit, after
  /// destroy_process_group, can abort the process). Copies share the binding.
  torch_comm(int rank, int size) : b_(std::make_shared<binding>())
  {
    b_->rank = rank;
    b_->size = size;
  }
  /// Bound to `group` for this object's whole life (the caller keeps the group alive meanwhile).
  explicit torch_comm(c10d::ProcessGroup& group) : torch_comm(group.getRank(), group.getSize())
  {
    b_->group = &group;
  }

  /// Binds `group` until the scope ends (it must have the rank and size this communicator was made for).
  class scope
  {
  public:
    scope(const torch_comm& c, c10d::ProcessGroup& group) : b_(c.b_)
    {
      if (group.getRank() != b_->rank || group.getSize() != b_->size)
      {
        throw std::invalid_argument("contrastive: group: rank " + std::to_string(group.getRank()) + " of " +
                                    std::to_string(group.getSize()) + ", but this engine was made for rank " +
                                    std::to_string(b_->rank) + " of " + std::to_string(b_->size));
      }
      b_->group = &group;
    }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;
    ~scope()
    {
      b_->group = nullptr;
    }

  private:
    std::shared_ptr<binding> b_;
  };

  int rank() const noexcept
  {
    return b_->rank;
  }
  int size() const noexcept
  {
    return b_->size;
  }

  /// gloo stages a collective's whole input or output in temporaries of its own (measured on torch 2.15, 2 ranks:
  /// an all-gather into a 16 MiB tensor raised the peak resident memory 18 MiB above its output, a reduce-scatter
  /// of 16 MiB by 18 MiB above its output), as large as the gathered K or the dK partial the loss holds. The
  /// collectives of whole-batch size therefore run in pieces of at most piece_bytes per rank, which bounds those
  /// temporaries at a few MiB for a few more calls (16 per 16 MiB per rank of 1 MiB).
  static constexpr std::size_t piece_bytes = std::size_t(1) << 20;

  contrastive::status allgather(const void* mine, std::size_t bytes, void* all) const
  {
    if (bytes == 0)
    {
      return {};
    }
    return run("allgather",
               [&]
               {
                 for (std::size_t off = 0; off < bytes; off += piece_bytes)
                 {
                   const std::size_t len = std::min(piece_bytes, bytes - off);
                   std::vector<at::Tensor> in{bytes_of(static_cast<char*>(const_cast<void*>(mine)) + off, len)};
                   std::vector<std::vector<at::Tensor>> out(1);
                   for (int r = 0; r < size(); ++r)
                   {
                     out[0].push_back(
                         bytes_of(static_cast<char*>(all) + static_cast<std::size_t>(r) * bytes + off, len));
                   }
                   group()->allgather(out, in)->wait();
                 }
               });
  }

  contrastive::status allgatherv_rows(const void* mine, const int* rows, std::size_t row_bytes, void* all) const
  {
    const int most = *std::max_element(rows, rows + size());
    const bool equal = std::all_of(rows,
                                   rows + size(),
                                   [&](int r)
                                   {
                                     return r == most;
                                   });
    if (most == 0 || row_bytes == 0)
    {
      return {};
    }
    if (equal)
    {
      return allgather(mine, static_cast<std::size_t>(most) * row_bytes, all);
    }
    return run("allgatherv_rows (padded allgather)",
               [&]
               {
                 const std::size_t block = static_cast<std::size_t>(most) * row_bytes;
                 at::Tensor staging = at::empty({static_cast<std::int64_t>(block * (size() + 1))}, at::kByte);
                 char* base = static_cast<char*>(staging.data_ptr());
                 char* in = base + static_cast<std::size_t>(size()) * block; // this rank's rows, padded
                 std::memcpy(in, mine, static_cast<std::size_t>(rows[rank()]) * row_bytes);
                 std::vector<at::Tensor> input{bytes_of(in, block)};
                 std::vector<std::vector<at::Tensor>> out(1);
                 for (int r = 0; r < size(); ++r)
                 {
                   out[0].push_back(bytes_of(base + static_cast<std::size_t>(r) * block, block));
                 }
                 group()->allgather(out, input)->wait();
                 char* to = static_cast<char*>(all);
                 for (int r = 0; r < size(); ++r)
                 {
                   const std::size_t n = static_cast<std::size_t>(rows[r]) * row_bytes;
                   std::memcpy(to, base + static_cast<std::size_t>(r) * block, n);
                   to += n;
                 }
               });
  }

  contrastive::status reduce_scatter_sum(const float* all, const int* counts, float* mine) const
  {
    if (std::all_of(counts,
                    counts + size(),
                    [](int c)
                    {
                      return c == 0;
                    }))
    {
      return {};
    }
    const bool equal = std::all_of(counts,
                                   counts + size(),
                                   [&](int c)
                                   {
                                     return c == counts[0];
                                   });
    if (equal) // in pieces (piece_bytes above); unequal counts in one call (a piece of one rank's part may be empty)
    {
      return run("reduce_scatter",
                 [&]
                 {
                   const std::size_t count = static_cast<std::size_t>(counts[0]), piece = piece_bytes / sizeof(float);
                   for (std::size_t off = 0; off < count; off += piece)
                   {
                     const auto len = static_cast<std::int64_t>(std::min(piece, count - off));
                     std::vector<at::Tensor> out{floats_of(mine + off, len)};
                     std::vector<std::vector<at::Tensor>> in(1);
                     for (int r = 0; r < size(); ++r)
                     {
                       in[0].push_back(
                           floats_of(const_cast<float*>(all) + static_cast<std::size_t>(r) * count + off, len));
                     }
                     group()->reduce_scatter(out, in)->wait();
                   }
                 });
    }
    return run("reduce_scatter",
               [&]
               {
                 std::vector<at::Tensor> out{floats_of(mine, counts[rank()])};
                 std::vector<std::vector<at::Tensor>> in(1);
                 std::size_t at = 0;
                 for (int r = 0; r < size(); ++r)
                 {
                   in[0].push_back(floats_of(const_cast<float*>(all) + at, counts[r]));
                   at += static_cast<std::size_t>(counts[r]);
                 }
                 group()->reduce_scatter(out, in)->wait();
               });
  }

  contrastive::status broadcast(void* buf, std::size_t bytes, int root) const
  {
    if (bytes == 0)
    {
      return {};
    }
    return run("broadcast",
               [&]
               {
                 std::vector<at::Tensor> t{bytes_of(buf, bytes)};
                 c10d::BroadcastOptions opts;
                 opts.rootRank = root;
                 group()->broadcast(t, opts)->wait();
               });
  }

  contrastive::status allreduce(float* data, std::size_t n, contrastive::distributed::reduce_op op) const
  {
    if (n == 0)
    {
      return {};
    }
    return run(op == contrastive::distributed::reduce_op::sum ? "allreduce (sum)" : "allreduce (max)",
               [&]
               {
                 std::vector<at::Tensor> t{floats_of(data, static_cast<std::int64_t>(n))};
                 c10d::AllreduceOptions opts;
                 opts.reduceOp =
                     op == contrastive::distributed::reduce_op::sum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
                 group()->allreduce(t, opts)->wait();
               });
  }

private:
  static at::Tensor bytes_of(void* p, std::size_t bytes)
  {
    return at::from_blob(p, {static_cast<std::int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
  }
  static at::Tensor floats_of(float* p, std::int64_t n)
  {
    return at::from_blob(p, {n}, at::TensorOptions().dtype(at::kFloat));
  }

  c10d::ProcessGroup* group() const noexcept
  {
    return b_->group;
  }

  /// Runs one collective; a c10 (or other) exception becomes communication_error naming the collective and backend.
  template <class F>
  contrastive::status run(const char* what, F&& f) const
  {
    std::string why;
    if (group() == nullptr)
    {
      why = "no process group is bound to the call (an internal error of contrastive_torch)";
    }
    else
    {
      try
      {
        f();
        return {};
      }
      catch (const c10::Error& e)
      {
        why = e.what_without_backtrace();
      }
      catch (const std::exception& e)
      {
        why = e.what();
      }
      catch (...)
      {
        why = "an unknown exception";
      }
    }
    const std::string where = std::string("torch.distributed ") + what +
                              (group() != nullptr ? " (" + group()->getBackendName() + ")" : std::string());
    return {contrastive::errc::communication_error, where, "failed on rank " + std::to_string(rank()) + ": " + why};
  }

  std::shared_ptr<binding> b_;
};

static_assert(contrastive::distributed::is_communicator_v<torch_comm>,
              "torch_comm must offer the collectives of contrastive/comm/communicator.hpp");
} // namespace contrastive_torch
