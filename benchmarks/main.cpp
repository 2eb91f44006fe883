// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// The benchmark binary: measures this machine's roofline first (FMA peak, memcpy bandwidth), then runs the suites.
//
//   contrastive_bench [--contrastive_max_n=N] [--contrastive_max_d=D] [--contrastive_mem_cap_gib=G]
//                     [--contrastive_threads=T] [Google Benchmark flags...]
//
// The roofline is also registered as benchmarks (roofline/...), so it appears in every report beside the results and
// in the JSON context (fma_peak_gflops, copy_peak_gbytes_per_s, bf16_dot_peak_gflops). The device suite is its own
// binary, contrastive_device_bench (device_loss.cu; see docs/performance.md).

#include "support.hpp"

#include <contrastive/host/gemm.hpp>
#include <contrastive/host/thread_pool.hpp>
#if defined(CONTRASTIVE_BENCH_CBLAS)
#include <contrastive/host/cblas_gemm.hpp>
#endif

#include <benchmark/benchmark.h>

#include <cstdio>
#include <string>

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
  register_host_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
