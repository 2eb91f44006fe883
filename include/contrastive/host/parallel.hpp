// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Minimal fork-join parallelism on std::thread, with a static task assignment so that results do not depend on
/// scheduling. No dependency beyond the standard library.

#include <algorithm>
#include <cstddef>
#include <thread>
#include <vector>

namespace contrastive
{
namespace host
{
/// Number of worker threads used when the caller asks for 0 ("all cores").
inline unsigned default_threads() noexcept
{
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1u : n;
}

/// Runs fn(task, worker) for task in [0, n_tasks) on up to `threads` workers (worker in [0, threads)).
/// The calling thread is worker 0. Returns the number of workers actually used.
template <class F>
unsigned parallel_for(std::size_t n_tasks, unsigned threads, F&& fn)
{
  const unsigned workers = static_cast<unsigned>(std::max<std::size_t>(1, std::min<std::size_t>(threads, n_tasks)));
  if (workers <= 1)
  {
    for (std::size_t t = 0; t < n_tasks; ++t)
    {
      fn(t, 0u);
    }
    return 1;
  }
  // Static round-robin assignment: worker w runs tasks w, w + workers, ... Tasks are equal-sized row blocks, and a
  // fixed assignment makes every per-worker partial (column statistics, dK accumulators) and so every result
  // bit-reproducible for a given thread count.
  auto body = [&](unsigned w)
  {
    for (std::size_t t = w; t < n_tasks; t += workers)
    {
      fn(t, w);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (unsigned w = 1; w < workers; ++w)
  {
    pool.emplace_back(body, w);
  }
  body(0);
  for (auto& th : pool)
  {
    th.join();
  }
  return workers;
}
} // namespace host
} // namespace contrastive
