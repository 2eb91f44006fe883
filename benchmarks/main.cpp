// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// The benchmark binary: measures this machine's roofline first (FMA peak, memcpy bandwidth), then runs the suites.
//
//   contrastive_bench [--contrastive_max_n=N] [--contrastive_max_d=D] [--contrastive_mem_cap_gib=G]
//                     [--contrastive_threads=T] [Google Benchmark flags...]
//
// The roofline is also registered as benchmarks (roofline/...), so it appears in every report beside the results and
// in the JSON context (fma_peak_gflops, copy_peak_gbytes_per_s, bf16_dot_peak_gflops). On builds with the bfloat16
// kernel, kernel/bf16_product/... times one thread's packed bfloat16 product on whichever kernel runs (vdpbf16ps or
// AMX tiles: host_kernel in the context) and the AMX driver's own copies with no-op tiles. The device suite is its own
// binary, contrastive_device_bench (device_loss.cu; see docs/performance.md).

#include "support.hpp"

#include <contrastive/host/gemm.hpp>
#include <contrastive/host/thread_pool.hpp>
#if defined(CONTRASTIVE_BENCH_CBLAS)
#include <contrastive/host/cblas_gemm.hpp>
#endif

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace contrastive_bench
{
void register_host_benchmarks();

namespace
{
void register_roofline(unsigned threads)
{
  benchmark::RegisterBenchmark("roofline/fma_peak",
                               [threads](benchmark::State& state)
                               {
                                 fma_rate r{};
                                 for (auto _ : state)
                                 {
                                   r = measure_fma_flops(threads, 0.1);
                                 }
                                 state.counters["flops"] = r.flops;
                                 state.counters["flops_per_cpu"] = r.flops_per_cpu;
                                 state.counters["threads"] = threads;
                               })
      ->Iterations(1);
  benchmark::RegisterBenchmark("roofline/fma_peak_1thread",
                               [](benchmark::State& state)
                               {
                                 double flops = 0.0;
                                 for (auto _ : state)
                                 {
                                   flops = measure_fma_flops(1, 0.1).flops;
                                 }
                                 state.counters["flops"] = flops;
                               })
      ->Iterations(1);
  if (contrastive::host::bf16_dot)
  {
    benchmark::RegisterBenchmark("roofline/bf16_dot_peak",
                                 [threads](benchmark::State& state)
                                 {
                                   fma_rate r{};
                                   for (auto _ : state)
                                   {
                                     r = measure_bf16_dot_flops(threads, 0.1);
                                   }
                                   state.counters["flops"] = r.flops;
                                   state.counters["flops_per_cpu"] = r.flops_per_cpu;
                                   state.counters["threads"] = threads;
                                 })
        ->Iterations(1);
  }
  const std::size_t copy_bytes = run_config().copy_mib << 20;
  benchmark::RegisterBenchmark("roofline/memcpy",
                               [threads, copy_bytes](benchmark::State& state)
                               {
                                 double bytes = 0.0;
                                 for (auto _ : state)
                                 {
                                   bytes = measure_copy_bytes(threads, copy_bytes, 0.2);
                                 }
                                 state.counters["bytes_per_second"] = bytes;
                                 state.counters["buffer_bytes"] = benchmark::Counter(static_cast<double>(copy_bytes),
                                                                                     benchmark::Counter::kDefaults,
                                                                                     benchmark::Counter::kIs1024);
                                 state.counters["threads"] = threads;
                               })
      ->Iterations(1);
}

#if CONTRASTIVE_AMX_COMPILED
/// Tiles that do nothing but touch what they are given: the tile driver's own work (A copied into tile rows, partial
/// blocks staged), so that kernel/bf16_product's tile rows can be read against it.
struct no_op_tiles
{
  float sink = 0.0f;
  void configure() noexcept {}
  void release() noexcept {}
  void zero_c(int) noexcept {}
  void load_c(int, const float* p, std::size_t) noexcept
  {
    sink += p[0];
  }
  void store_c(int, float* p, std::size_t) noexcept
  {
    p[0] = sink;
  }
  void load_a(int, const std::uint32_t* p, std::size_t) noexcept
  {
    sink += static_cast<float>(p[0] & 1u);
  }
  void load_b(int, const std::uint32_t* p, std::size_t) noexcept
  {
    sink += static_cast<float>(p[0] & 1u);
  }
  void dot() noexcept {}
};
#endif

/// One thread's bfloat16 product C (M x N) = A (M x K) B on packed operands (host/gemm.hpp's gemm_packed: the shapes of
/// the loss's logit tile, dQ and dK products), on whichever kernel this process runs (host_kernel in the context), and
/// where the build carries the AMX driver, the driver with no-op tiles (`tile_driver_copies`: its overhead).
void register_bf16_products()
{
#if CONTRASTIVE_HOST_BF16_DOT
  namespace h = contrastive::host;
  struct shape
  {
    std::int64_t m, n, k;
  };
  for (const shape s : {shape{64, 256, 512}, shape{64, 512, 256}, shape{256, 512, 64}})
  {
    for (const bool copies_only : {false, true})
    {
      if (copies_only && !h::amx::compiled)
      {
        continue;
      }
      const std::string name = std::string("kernel/bf16_product/") + (copies_only ? "tile_driver_copies" : "kernel");
      benchmark::RegisterBenchmark(
          name.c_str(),
          [s, copies_only](benchmark::State& state)
          {
            const auto m = static_cast<std::size_t>(s.m), n = static_cast<std::size_t>(s.n),
                       k = static_cast<std::size_t>(s.k);
            std::vector<std::uint16_t> a(m * k, 0x3f80), b(n * k, 0x3f80); // ones: finite, exact sums
            std::vector<float> c(m * n);
            for (auto _ : state)
            {
#if CONTRASTIVE_AMX_COMPILED
              if (copies_only)
              {
                no_op_tiles t;
                h::amx::gemm_pairs(t, m, n, k, a.data(), b.data(), k * h::kernel_nr, c.data(), n, false);
                benchmark::DoNotOptimize(t.sink);
                continue;
              }
#endif
              h::gemm_packed(m, n, k, a.data(), b.data(), k * h::kernel_nr, c.data(), n, false);
              benchmark::DoNotOptimize(c.data());
              benchmark::ClobberMemory();
            }
            const double flops = 2.0 * static_cast<double>(m * n * k);
            state.counters["flops"] =
                benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
            const double peak_1thread = machine_roofline().bf16_flops_per_cpu; // one core's rate
            if (!copies_only && peak_1thread > 0.0)
            {
              state.counters["bf16_peak_frac_1thread"] = benchmark::Counter(
                  flops / peak_1thread, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
            }
          })
          ->ArgNames({"M", "N", "K"})
          ->Args({s.m, s.n, s.k})
          ->Unit(benchmark::kMicrosecond);
    }
  }
#endif // a build without the bf16 kernel has no such rows (the pair layouts' product does not compile there)
}
} // namespace
} // namespace contrastive_bench

int main(int argc, char** argv)
{
  using namespace contrastive_bench;
  config& cfg = mutable_run_config();
  const std::string err = cfg.parse(argc, argv);
  if (!err.empty())
  {
    std::fprintf(stderr, "contrastive_bench: %s\n", err.c_str());
    return 2;
  }
  const unsigned threads = cfg.threads == 0 ? contrastive::host::default_threads() : cfg.threads;
#if defined(CONTRASTIVE_BENCH_CBLAS)
  // The loss's own workers call the BLAS: keep OpenBLAS single-threaded (gemm::cblas's documented setting).
  contrastive::host::cblas_single_threaded();
#endif

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv))
  {
    return 2;
  }

  // The peak every result is compared with: best of 6 trials (a peak is a maximum; noise only lowers a trial).
  const roofline roof = measure_roofline(threads, cfg.roofline_seconds, 6, cfg.copy_mib << 20);
  set_machine_roofline(roof);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f", roof.fma_flops * 1e-9);
  benchmark::AddCustomContext("fma_peak_gflops", buf);
  std::snprintf(buf, sizeof buf, "%.1f", roof.fma_flops_1thread * 1e-9);
  benchmark::AddCustomContext("fma_peak_gflops_1thread", buf);
  std::snprintf(buf, sizeof buf, "%.1f", roof.fma_flops_per_cpu * 1e-9);
  benchmark::AddCustomContext("fma_peak_gflops_per_cpu_second", buf);
  std::snprintf(buf, sizeof buf, "%.2f", roof.copy_bytes * 1e-9);
  benchmark::AddCustomContext("copy_peak_gbytes_per_s", buf);
  std::snprintf(buf, sizeof buf, "%.1f", roof.bf16_flops * 1e-9);
  benchmark::AddCustomContext("bf16_dot_peak_gflops", contrastive::host::bf16_dot ? buf : "none (no AVX512-BF16)");
  benchmark::AddCustomContext("host_kernel",
                              std::string(contrastive::host::kernel_isa) +
                                  ", bfloat16 dot products: " + contrastive::host::bf16_kernel());
  benchmark::AddCustomContext("contrastive_threads", std::to_string(threads));
  benchmark::AddCustomContext("contrastive_config", cfg.describe());

  register_roofline(threads);
  register_bf16_products();
  register_host_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
