// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Test only: `thread_comm`, a communicator policy (distributed::is_communicator) whose N ranks are N threads of one
/// process, so the distributed loss's multi-rank paths (out-of-step ranks, one rank's bad input, equality with one
/// process) are tested without MPI, under every sanitizer, TSan included.
///
/// Every collective is two meetings of all ranks in a `thread_world`: at the first each rank publishes what it
/// brings (a pointer to its data and its sizes); between the two each rank reads the others' data into its own
/// output (reductions into a private buffer first, in rank order, so every rank computes the same bits); the second
/// keeps every rank's data alive until all have read it. Each rank's outputs are written by that rank only.
///
/// Where MPI would hang or be undefined, a thread_world reports errc::communication_error on every rank instead, and
/// stays broken afterwards: ranks in different collectives or with different sizes at one meeting, a meeting that a
/// rank has left (its thread returned: `run_ranks` marks it), and a meeting that waits longer than `patience` (a
/// watchdog against a hang, not a timed assertion: a correct program never waits that long).

#include <contrastive/comm/communicator.hpp>
#include <contrastive/status.hpp>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace contrastive_test
{
/// The shared state of N thread ranks.
class thread_world
{
public:
  /// What a rank brings to a collective.
  struct slot
  {
    int op = 0; ///< which collective (thread_comm::op)
    const void* data = nullptr;
    std::size_t bytes = 0; ///< element or row size in bytes
    std::size_t count = 0; ///< elements or rows
    int root = 0;          ///< broadcast
  };

  explicit thread_world(int ranks, std::chrono::seconds patience = std::chrono::seconds(120))
      : ranks_(ranks), patience_(patience), slots_(static_cast<std::size_t>(ranks)),
        left_(static_cast<std::size_t>(ranks), false)
  {
  }

  int size() const noexcept
  {
    return ranks_;
  }

  /// First meeting: publishes `mine` and waits for every rank. After it, `at(r)` is rank r's slot.
  contrastive::status meet(int rank, const slot& mine, const char* what)
  {
    std::unique_lock<std::mutex> lock(m_);
    slots_[static_cast<std::size_t>(rank)] = mine;
    return wait_for_all(lock, what);
  }

  /// Second meeting: every rank has read what it needed from the others.
  contrastive::status part(const char* what)
  {
    std::unique_lock<std::mutex> lock(m_);
    return wait_for_all(lock, what);
  }

  /// Rank r's slot (between meet and part; read without the lock: written before the meeting, not changed until
  /// after the next part).
  const slot& at(int r) const noexcept
  {
    return slots_[static_cast<std::size_t>(r)];
  }

  /// Marks the world broken (every rank's next or current wait returns `why`); the first reason is kept.
  void fail(const std::string& why)
  {
    std::lock_guard<std::mutex> lock(m_);
    if (broken_.empty())
    {
      broken_ = why;
    }
    cv_.notify_all();
  }

  /// Rank r's thread is done: a meeting it has not reached will never complete.
  void leave(int rank)
  {
    std::lock_guard<std::mutex> lock(m_);
    left_[static_cast<std::size_t>(rank)] = true;
    cv_.notify_all();
  }

private:
  contrastive::status wait_for_all(std::unique_lock<std::mutex>& lock, const char* what)
  {
    if (broken_.empty() && ++arrived_ == ranks_)
    {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return {};
    }
    const std::size_t gen = generation_;
    const auto deadline = std::chrono::steady_clock::now() + patience_;
    while (generation_ == gen)
    {
      if (broken_.empty())
      {
        for (int r = 0; r < ranks_; ++r)
        {
          if (left_[static_cast<std::size_t>(r)])
          {
            broken_ = "rank " + std::to_string(r) + " has returned while the others wait in " + what;
          }
        }
      }
      if (!broken_.empty())
      {
        cv_.notify_all();
        return {contrastive::errc::communication_error, what, "thread_comm: " + broken_};
      }
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == gen)
      {
        broken_ = std::string("no meeting in ") + what + " for " + std::to_string(patience_.count()) +
                  " s (a rank never came: a hang)";
      }
    }
    return {};
  }

  const int ranks_;
  const std::chrono::seconds patience_;
  std::mutex m_;
  std::condition_variable cv_;
  std::vector<slot> slots_;
  std::vector<bool> left_;
  int arrived_ = 0;
  std::size_t generation_ = 0;
  std::string broken_; ///< empty while healthy
};

/// One rank's handle (a communicator policy).
class thread_comm
{
public:
  static constexpr const char* name = "thread";

  thread_comm(std::shared_ptr<thread_world> world, int rank) : world_(std::move(world)), rank_(rank) {}

  int rank() const noexcept
  {
    return rank_;
  }
  int size() const noexcept
  {
    return world_->size();
  }

  contrastive::status allgather(const void* mine, std::size_t bytes, void* all) const
  {
    return collective(op::allgather,
                      "allgather",
                      mine,
                      bytes,
                      1,
                      0,
                      [&]
                      {
                        for (int r = 0; r < size(); ++r)
                        {
                          copy(
                              static_cast<char*>(all) + static_cast<std::size_t>(r) * bytes, world_->at(r).data, bytes);
                        }
                      });
  }

  contrastive::status allgatherv_rows(const void* mine, const int* rows, std::size_t row_bytes, void* all) const
  {
    for (int r = 0; r < size(); ++r)
    {
      if (rows[r] < 0)
      {
        return {contrastive::errc::invalid_argument, "rows", "thread_comm: a negative row count"};
      }
    }
    return collective(
        op::allgatherv,
        "allgatherv_rows",
        mine,
        row_bytes,
        static_cast<std::size_t>(rows[rank_]),
        0,
        [&]
        {
          std::size_t at = 0;
          for (int r = 0; r < size(); ++r)
          {
            const std::size_t b = static_cast<std::size_t>(rows[r]) * row_bytes;
            copy(static_cast<char*>(all) + at, world_->at(r).data, b);
            at += b;
          }
        },
        rows);
  }

  contrastive::status reduce_scatter_sum(const float* all, const int* counts, float* mine) const
  {
    std::size_t total = 0, off = 0;
    for (int r = 0; r < size(); ++r)
    {
      off += r < rank_ ? static_cast<std::size_t>(counts[r]) : 0;
      total += static_cast<std::size_t>(counts[r]);
    }
    const std::size_t n = static_cast<std::size_t>(counts[rank_]);
    std::vector<float> out(n);
    CONTRASTIVE_RETURN_IF_ERROR(collective(op::reduce_scatter,
                                           "reduce_scatter_sum",
                                           all,
                                           sizeof(float),
                                           total,
                                           0,
                                           [&]
                                           {
                                             for (std::size_t i = 0; i < n; ++i)
                                             {
                                               float s = value(0, off + i);
                                               for (int r = 1; r < size(); ++r)
                                               {
                                                 s += value(r, off + i);
                                               }
                                               out[i] = s;
                                             }
                                           }));
    copy(mine, out.data(), n * sizeof(float));
    return {};
  }

  contrastive::status broadcast(void* buf, std::size_t bytes, int root) const
  {
    return collective(op::broadcast,
                      "broadcast",
                      buf,
                      bytes,
                      1,
                      root,
                      [&]
                      {
                        if (rank_ != root)
                        {
                          copy(buf, world_->at(root).data, bytes);
                        }
                      });
  }

  contrastive::status allreduce(float* data, std::size_t n, contrastive::distributed::reduce_op o) const
  {
    const bool sum = o == contrastive::distributed::reduce_op::sum;
    std::vector<float> out(n);
    CONTRASTIVE_RETURN_IF_ERROR(collective(sum ? op::allreduce_sum : op::allreduce_max,
                                           "allreduce",
                                           data,
                                           sizeof(float),
                                           n,
                                           0,
                                           [&]
                                           {
                                             for (std::size_t i = 0; i < n; ++i)
                                             {
                                               float a = value(0, i);
                                               for (int r = 1; r < size(); ++r)
                                               {
                                                 const float v = value(r, i);
                                                 a = sum ? a + v : (v > a ? v : a);
                                               }
                                               out[i] = a;
                                             }
                                           }));
    copy(data, out.data(), n * sizeof(float));
    return {};
  }

private:
  enum class op : int
  {
    allgather = 1,
    allgatherv,
    reduce_scatter,
    broadcast,
    allreduce_sum,
    allreduce_max,
  };

  static void copy(void* to, const void* from, std::size_t bytes) noexcept
  {
    if (bytes != 0 && to != from)
    {
      std::memcpy(to, from, bytes);
    }
  }

  float value(int r, std::size_t i) const noexcept
  {
    return static_cast<const float*>(world_->at(r).data)[i];
  }

  /// Meets, checks that every rank is in the same collective with matching sizes, runs `read` (this rank reads the
  /// others' data), and parts. `rows`: allgatherv's per-rank row counts as this rank sees them.
  template <class Read>
  contrastive::status collective(op o,
                                 const char* what,
                                 const void* data,
                                 std::size_t bytes,
                                 std::size_t count,
                                 int root,
                                 Read&& read,
                                 const int* rows = nullptr) const
  {
    thread_world::slot mine;
    mine.op = static_cast<int>(o);
    mine.data = data;
    mine.bytes = bytes;
    mine.count = count;
    mine.root = root;
    CONTRASTIVE_RETURN_IF_ERROR(world_->meet(rank_, mine, what));
    std::string mismatch;
    for (int r = 0; r < size() && mismatch.empty(); ++r)
    {
      const thread_world::slot& s = world_->at(r);
      const bool same_count = rows != nullptr ? s.count == static_cast<std::size_t>(rows[r]) : s.count == count;
      if (s.op != static_cast<int>(o) || s.bytes != bytes || !same_count || s.root != root)
      {
        mismatch = "rank " + std::to_string(r) + " is in collective " + std::to_string(s.op) + " (" +
                   std::to_string(s.count) + " x " + std::to_string(s.bytes) + " bytes) where rank " +
                   std::to_string(rank_) + " is in " + what + " (" + std::to_string(count) + " x " +
                   std::to_string(bytes) + " bytes)";
      }
    }
    if (mismatch.empty())
    {
      read();
    }
    const contrastive::status parted = world_->part(what);
    if (!mismatch.empty())
    {
      world_->fail("mismatched collectives: " + mismatch);
      return {contrastive::errc::communication_error, what, "thread_comm: mismatched collectives: " + mismatch};
    }
    return parted;
  }

  std::shared_ptr<thread_world> world_;
  int rank_;
};

static_assert(contrastive::distributed::is_communicator_v<thread_comm>, "thread_comm must be a communicator");

/// Runs body(thread_comm) on `ranks` threads, one rank each, and joins them; a rank whose body returns (or throws)
/// leaves the world, so the others' later collectives fail instead of waiting. The first exception is rethrown.
template <class Body>
void run_ranks(int ranks, Body&& body, std::chrono::seconds patience = std::chrono::seconds(120))
{
  auto world = std::make_shared<thread_world>(ranks, patience);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
  {
    threads.emplace_back(
        [&, r]
        {
          try
          {
            body(thread_comm(world, r));
          }
          catch (...)
          {
            errors[static_cast<std::size_t>(r)] = std::current_exception();
          }
          world->leave(r);
        });
  }
  for (std::thread& t : threads)
  {
    t.join();
  }
  for (const std::exception_ptr& e : errors)
  {
    if (e)
    {
      std::rethrow_exception(e);
    }
  }
}
} // namespace contrastive_test
