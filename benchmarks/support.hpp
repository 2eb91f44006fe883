// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What every suite in the benchmark binary shares: the run configuration (size caps, memory cap, threads), the
/// machine's measured roofline (FMA peak and memcpy bandwidth), and a heap high-water tracker for the peak memory of a
/// call.
///
/// The tracker replaces the global `operator new`/`operator delete` of the benchmark binary (support.cpp): every
/// `std::vector` the library allocates goes through them, so the live-byte high-water mark between `reset_peak()` and
/// `peak()` is the call's peak heap use, including transient buffers that `bytes_held()` does not see.

#include <cstddef>
#include <cstdint>
#include <string>

namespace contrastive_bench
{
/// Run configuration: command-line flags `--contrastive_<name>=<value>` (removed from argv before Google Benchmark
/// parses it) or environment variables `CONTRASTIVE_BENCH_<NAME>`; flags win.
struct config
{
  std::size_t max_n = 65536;         ///< register sizes N <= max_n only (131072 needs --contrastive_max_n=131072)
  std::size_t max_d = 1024;          ///< register dimensions D <= max_d only
  double mem_cap_gib = 0.0;          ///< skip a configuration whose estimated footprint exceeds this (0: half of RAM)
  unsigned threads = 0;              ///< library threads (0: all cores, the library's default)
  std::size_t warmup_max_n = 8192;   ///< one untimed warm-up call first when N <= this (larger: the timed call is cold)
  std::size_t single_shot_n = 16384; ///< N >= this: exactly one iteration per repetition
  std::size_t single_rep_n = 65536;  ///< N >= this: also exactly one repetition (ignores --benchmark_repetitions)
  double roofline_seconds = 0.15;    ///< duration of one trial of each startup roofline measurement
  std::size_t copy_mib = 512;        ///< size of each buffer of the memcpy measurement (beyond the caches)
  std::size_t budget_mib = 0;        ///< algorithm::automatic rows: its memory budget (0: the library's default)

  /// Reads the environment, then the flags, removing the latter from argv. Returns an error message or "".
  std::string parse(int& argc, char** argv);
  std::size_t mem_cap_bytes() const;
  std::string describe() const;
};

const config& run_config();
config& mutable_run_config();

/// The machine's measured ceilings, found once at startup (best of several trials: a peak is a maximum).
struct roofline
{
  unsigned threads = 1;
  double fma_flops = 0.0;          ///< FLOP/s of an FMA-bound loop on `threads` threads (2 flops per FMA lane)
  double fma_flops_1thread = 0.0;  ///< the same loop on one thread, alone
  double fma_flops_per_cpu = 0.0;  ///< FLOPs per second of thread CPU time in the `threads`-thread loop (per core)
  double copy_bytes = 0.0;         ///< bytes/s of a large multi-threaded memcpy, counting read + write (2x the size)
  double bf16_flops = 0.0;         ///< FLOP/s of the bf16 kernel's instruction: a vdpbf16ps-bound loop (4 flops per
                                   ///< lane), or a tdpbf16ps-bound one where AMX is active; 0 without AVX512-BF16
  double bf16_flops_per_cpu = 0.0; ///< its FLOPs per second of thread CPU time
};

/// Result of one FMA-bound run.
struct fma_rate
{
  double flops;         ///< total FLOPs / wall time
  double flops_per_cpu; ///< mean over threads of FLOPs / thread CPU time (unaffected by time other processes take)
};
/// FMA-bound loop: `threads` threads, each with 16 independent vector accumulators, for about `seconds`.
fma_rate measure_fma_flops(unsigned threads, double seconds);
/// The same loop on the instruction the bfloat16 products run on: AVX512-BF16 `vdpbf16ps` (16 lanes x 2 products and 2
/// adds), or AMX `tdpbf16ps` (16 x 16 results of 16 pairs) where amx::active(); zero where this binary has neither.
fma_rate measure_bf16_dot_flops(unsigned threads, double seconds);
/// memcpy of `bytes` split across `threads` threads, repeated for about `seconds`. Returns bytes/s (read + write).
double measure_copy_bytes(unsigned threads, std::size_t bytes, double seconds);
/// Measures the roofline with the best of `trials` trials.
roofline measure_roofline(unsigned threads, double seconds_per_trial, int trials, std::size_t copy_bytes);

const roofline& machine_roofline();
void set_machine_roofline(const roofline& r);

/// Heap live-byte tracking (see the file comment). Sizes are malloc_usable_size, so they round up slightly.
namespace heap
{
std::size_t live() noexcept;
std::size_t peak() noexcept;
/// Sets the high-water mark to the current live bytes.
void reset_peak() noexcept;
} // namespace heap

/// Resident-set high-water mark (VmHWM) of the process, in bytes, after resetting it with /proc/self/clear_refs at
/// `reset_rss_peak()`. Returns 0 where /proc is not available.
void reset_rss_peak() noexcept;
std::size_t rss_peak() noexcept;

/// CPU time (user + system) of all threads of the process, in seconds.
double process_cpu_seconds() noexcept;

/// Physical memory of the machine in bytes.
std::size_t physical_memory() noexcept;

/// Formats bytes as "12.3 GiB".
std::string format_bytes(double bytes);
} // namespace contrastive_bench
