// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A persistent fork-join worker pool on std::thread, with a static task assignment so that results do not depend on
/// scheduling. Threads are started on first use and kept until the pool is destroyed; every `run` wakes them, runs
/// one function per worker and waits for all. No dependency beyond the standard library.

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/resource.h>
#include <unistd.h>
#endif

namespace contrastive
{
namespace host
{
/// The most threads a loss may be configured with; a larger request is refused at its first call
/// (errc::invalid_argument).
inline constexpr unsigned max_threads = 4096;

/// Number of worker threads used when the caller asks for 0 ("all cores").
inline unsigned default_threads() noexcept
{
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1u : n;
}

/// The first unsigned number in the file at `path` (false when it is missing, unreadable or holds none, e.g. "max").
inline bool read_file_number(const char* path, unsigned long long& value) noexcept
{
  std::FILE* f = std::fopen(path, "r");
  if (f == nullptr)
  {
    return false;
  }
  const bool ok = std::fscanf(f, "%llu", &value) == 1;
  std::fclose(f);
  return ok;
}

/// Bytes of memory the operating system reports available to a new allocation now: Linux's MemAvailable (free memory
/// plus what the page cache would give back), lowered to what the process's control group still allows (cgroup v2
/// memory.max - memory.current, v1 memory.limit_in_bytes - memory.usage_in_bytes: a container's limit) and to the
/// address-space limit's room (RLIMIT_AS, `ulimit -v`, less what the process maps), else free physical pages
/// (sysconf), else 0 (unknown). A known amount is at least 1: no room at all (a cgroup at its limit, a process that
/// maps its whole address-space limit) is 1 byte, not "unknown".
inline std::size_t available_memory_bytes() noexcept
{
#if defined(__linux__)
  // The process's control group (/proc/self/cgroup: "0::<path>" for v2, "<n>:memory:<path>" for v1), its limit and
  // usage, else those at the hierarchy's root (a container's own view).
  std::string v2 = "/sys/fs/cgroup", v1 = "/sys/fs/cgroup/memory";
  if (std::FILE* f = std::fopen("/proc/self/cgroup", "r"))
  {
    char line[512];
    while (std::fgets(line, sizeof line, f) != nullptr)
    {
      std::string l(line);
      while (!l.empty() && (l.back() == '\n' || l.back() == '\r'))
      {
        l.pop_back();
      }
      if (l.rfind("0::", 0) == 0 && l.size() > 4)
      {
        v2 += l.substr(3);
      }
      const std::size_t at = l.find(":memory:");
      if (at != std::string::npos && l.size() > at + 9)
      {
        v1 += l.substr(at + 8);
      }
    }
    std::fclose(f);
  }
  std::size_t room = static_cast<std::size_t>(-1);
  for (const std::string& dir : {v2, std::string("/sys/fs/cgroup"), v1, std::string("/sys/fs/cgroup/memory")})
  {
    const bool is_v1 = dir.compare(0, 21, "/sys/fs/cgroup/memory") == 0;
    unsigned long long limit = 0, used = 0;
    if (read_file_number((dir + (is_v1 ? "/memory.limit_in_bytes" : "/memory.max")).c_str(), limit) &&
        read_file_number((dir + (is_v1 ? "/memory.usage_in_bytes" : "/memory.current")).c_str(), used))
    {
      // v1's "no limit" is a huge number, v2's the word "max" (not read): either leaves the room unbounded.
      room = std::min(room, static_cast<std::size_t>(limit > used ? limit - used : 0));
    }
  }
  // The process's address-space limit (ulimit -v, RLIMIT_AS) less the address space it maps now (/proc/self/statm).
  struct rlimit as_limit;
  if (getrlimit(RLIMIT_AS, &as_limit) == 0 && as_limit.rlim_cur != RLIM_INFINITY)
  {
    unsigned long long mapped_pages = 0;
    const long page = sysconf(_SC_PAGESIZE);
    if (read_file_number("/proc/self/statm", mapped_pages) && page > 0)
    {
      const unsigned long long mapped = mapped_pages * static_cast<unsigned long long>(page);
      const unsigned long long cap = static_cast<unsigned long long>(as_limit.rlim_cur);
      room = std::min(room, static_cast<std::size_t>(cap > mapped ? cap - mapped : 0));
    }
  }
  if (std::FILE* f = std::fopen("/proc/meminfo", "r"))
  {
    char line[256];
    unsigned long long kib = 0;
    bool found = false;
    while (!found && std::fgets(line, sizeof line, f) != nullptr)
    {
      found = std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1;
    }
    std::fclose(f);
    if (found)
    {
      return std::max<std::size_t>(1, std::min(static_cast<std::size_t>(kib) * 1024u, room));
    }
  }
#endif
#if defined(_SC_AVPHYS_PAGES) && defined(_SC_PAGESIZE)
  const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0)
  {
#if defined(__linux__)
    return std::max<std::size_t>(1, std::min(static_cast<std::size_t>(pages) * static_cast<std::size_t>(page), room));
#else
    return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
#endif
  }
#endif
  return 0;
}

/// algorithm::automatic's default budget: a quarter of available_memory_bytes() plus `held`, the bytes the caller's
/// engine holds already (no longer available, but its to reuse: without them a choice that fits would not fit on the
/// next call, and the algorithm would alternate), or 1 GiB when the system does not say. The rest stays for the
/// model's activations and the framework.
inline std::size_t default_memory_budget(std::size_t held = 0) noexcept
{
  const std::size_t a = available_memory_bytes();
  return a == 0 ? (std::size_t(1) << 30) : a / 4 + held / 4;
}

/// Fork-join pool. `run(workers, fn)` calls fn(w) for w in [0, workers) concurrently, worker 0 on the calling thread,
/// and returns when all have finished. If the system refuses a thread (or the pool's own memory), the calling thread
/// runs the missing workers' shares after its own: the assignment of work to worker indices (and so every result) is
/// unchanged, only slower, and no exception leaves the pool. Not reentrant; one caller at a time. Copying gives a new,
/// empty pool (threads are started again on its first run); moving moves the threads.
class thread_pool
{
  struct impl
  {
    std::vector<std::thread> threads;
    std::mutex mutex;
    std::condition_variable wake;
    std::condition_variable done;
    const std::function<void(unsigned)>* job = nullptr;
    std::size_t generation = 0;
    unsigned active = 0;
    unsigned pending = 0;
    bool stop = false;

    ~impl()
    {
      {
        std::lock_guard<std::mutex> lock(mutex);
        stop = true;
        ++generation;
      }
      wake.notify_all();
      for (auto& t : threads)
      {
        t.join();
      }
    }

    void grow(std::size_t wanted) noexcept
    {
      try
      {
        threads.reserve(wanted);
        while (threads.size() < wanted)
        {
          const unsigned index = static_cast<unsigned>(threads.size()) + 1;
          threads.emplace_back(
              [this, index]
              {
                loop(index);
              });
        }
      }
      catch (...)
      {
        // Fewer threads than asked: run() gives the missing workers' shares to the caller.
      }
    }

    void loop(unsigned index)
    {
      std::size_t seen = 0;
      for (;;)
      {
        const std::function<void(unsigned)>* current = nullptr;
        {
          std::unique_lock<std::mutex> lock(mutex);
          wake.wait(lock,
                    [&]
                    {
                      return generation != seen;
                    });
          seen = generation;
          if (stop)
          {
            return;
          }
          if (index > active)
          {
            continue; // not needed for this run
          }
          current = job;
        }
        (*current)(index);
        std::lock_guard<std::mutex> lock(mutex);
        if (--pending == 0)
        {
          done.notify_one();
        }
      }
    }
  };

public:
  thread_pool() = default;
  thread_pool(const thread_pool&) noexcept {}
  thread_pool& operator=(const thread_pool&) noexcept
  {
    return *this;
  }
  thread_pool(thread_pool&&) noexcept = default;
  thread_pool& operator=(thread_pool&&) noexcept = default;
  ~thread_pool() = default;

  template <class F>
  void run(unsigned workers, F&& fn)
  {
    if (workers <= 1)
    {
      fn(0u);
      return;
    }
    if (!impl_)
    {
      impl_.reset(new (std::nothrow) impl);
    }
    if (!impl_)
    {
      for (unsigned w = 0; w < workers; ++w)
      {
        fn(w);
      }
      return;
    }
    impl& p = *impl_;
    if (p.threads.size() < workers - 1)
    {
      p.grow(workers - 1);
    }
    const unsigned helpers = static_cast<unsigned>(std::min<std::size_t>(workers - 1, p.threads.size()));
    const std::function<void(unsigned)> job = [&fn](unsigned w)
    {
      fn(w);
    };
    {
      std::lock_guard<std::mutex> lock(p.mutex);
      p.job = &job;
      p.active = helpers;
      p.pending = helpers;
      ++p.generation;
    }
    p.wake.notify_all();
    fn(0u);
    for (unsigned w = helpers + 1; w < workers; ++w) // shares of threads the system refused
    {
      fn(w);
    }
    std::unique_lock<std::mutex> lock(p.mutex);
    p.done.wait(lock,
                [&]
                {
                  return p.pending == 0;
                });
    p.job = nullptr;
  }

private:
  std::unique_ptr<impl> impl_;
};

/// Runs fn(task, worker) for task in [0, n_tasks) on up to `threads` workers of `pool`. Static round-robin
/// assignment: worker w runs tasks w, w + workers, ... Tasks are equal-sized blocks, and a fixed assignment makes every
/// per-worker partial (column statistics, reductions) and so every result bit-reproducible for a given thread count.
template <class F>
unsigned parallel_for(thread_pool& pool, std::size_t n_tasks, unsigned threads, F&& fn)
{
  const unsigned workers = static_cast<unsigned>(std::max<std::size_t>(1, std::min<std::size_t>(threads, n_tasks)));
  pool.run(workers,
           [&](unsigned w)
           {
             for (std::size_t t = w; t < n_tasks; t += workers)
             {
               fn(t, w);
             }
           });
  return workers;
}
} // namespace host
} // namespace contrastive
