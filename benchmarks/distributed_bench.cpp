// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
// The distributed loss over MPI, per rank: step time, heap high-water, bytes held, bytes sent (Google Benchmark,
// manual time = the slowest rank's wall time of a step, fixed iteration counts so that every rank runs the same
// collectives; rank 0 reports, the other ranks run silently).
//
//   mpirun -np 4 --oversubscribe ./build/benchmarks/contrastive_distributed_bench [--benchmark_filter=...]
//
// Names: distributed/<symmetric|info_nce>/<float|bfloat16>/<fused|materialized|chunked>/N_local:<n>/D:<d>/manual_time
// Counters (per rank, rank 0's values; every rank holds the same shapes here):
//   heap_peak    live-heap high-water above the baseline during the step (operator new tracking, support.cpp):
//                includes the gathered K, the engine, the float partials and transient buffers
//   bytes_held   the loss's own buffers between steps (`bytes_held()`)
//   sent_bytes   a model of what this rank puts on the wire per step: its K rows once (element type), the dK
//                partials of every other rank's rows ((N - n_local) D floats, reduce-scatter) and 3 N floats of
//                column statistics (symmetric); a ring implementation forwards more, a tree less
//   nn_bytes     what one process's N x N float logits would take, for scale
#include "random_rows.hpp"
#include "support.hpp"

#include <contrastive/comm/mpi.hpp>
#include <contrastive/contrastive.hpp>
#include <contrastive/distributed/loss.hpp>

#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace cl = contrastive;

namespace
{
template <class T, class Algorithm>
void step_benchmark(benchmark::State& state, cl::objective obj)
{
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const std::size_t n = static_cast<std::size_t>(state.range(0)), d = static_cast<std::size_t>(state.range(1));
  const std::size_t n_total = n * static_cast<std::size_t>(ranks);
  const auto q = contrastive_test::random_rows<T>(n, d, 11u + 2u * static_cast<unsigned>(rank));
  const auto k = contrastive_test::random_rows<T>(n, d, 12u + 2u * static_cast<unsigned>(rank));
  std::vector<T> dq(n * d), dk(n * d);
  contrastive_bench::heap::reset_peak();
  const std::size_t base = contrastive_bench::heap::live();
  std::size_t peak = 0;
  {
    cl::distributed::loss<T, cl::temperature::fixed, cl::scaler::static_scale, Algorithm, cl::distributed::comm::mpi>
        dist(cl::distributed::comm::mpi(MPI_COMM_WORLD), cl::temperature::fixed(0.07f));
    const cl::problem<T> p{q.data(), k.data(), n, n, d, nullptr, obj};
    cl::step_record rec;
    for (auto _ : state)
    {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto t0 = std::chrono::steady_clock::now();
      const cl::status st = dist.step(p, dq.data(), dk.data(), rec);
      double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      MPI_Allreduce(MPI_IN_PLACE, &secs, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (!st)
      {
        state.SkipWithError(st.message().c_str());
        break;
      }
      state.SetIterationTime(secs);
    }
    peak = contrastive_bench::heap::peak() - base;
    state.counters["bytes_held"] = double(dist.bytes_held());
  }
  const bool sym = obj == cl::objective::symmetric;
  state.counters["heap_peak"] = double(peak);
  state.counters["sent_bytes"] = double(n * d * sizeof(T)) + double(n_total - n) * d * sizeof(float) +
                                 (sym ? 3.0 * double(n_total) * sizeof(float) : 0.0);
  state.counters["nn_bytes"] = double(n_total) * double(n_total) * sizeof(float);
  state.counters["ranks"] = ranks;
  state.counters["FLOP/s"] = benchmark::Counter(6.0 * double(n_total) * double(n_total) * double(d) / ranks,
                                                benchmark::Counter::kIsIterationInvariantRate);
}

class null_reporter : public benchmark::BenchmarkReporter
{
public:
  bool ReportContext(const Context&) override
  {
    return true;
  }
  void ReportRuns(const std::vector<Run>&) override {}
};
} // namespace

int main(int argc, char** argv)
{
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  for (cl::objective obj : {cl::objective::symmetric, cl::objective::info_nce})
  {
    const std::string o = std::string("distributed/") + cl::to_string(obj);
    auto reg = [&](const std::string& name, void (*fn)(benchmark::State&, cl::objective))
    {
      benchmark::RegisterBenchmark((o + name).c_str(), fn, obj)
          ->Args({2048, 512})
          ->Iterations(3)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    };
    reg("/float/fused", step_benchmark<float, cl::algorithm::fused>);
    reg("/float/materialized", step_benchmark<float, cl::algorithm::materialized>);
    reg("/float/chunked", step_benchmark<float, cl::algorithm::chunked>);
    reg("/bfloat16/fused", step_benchmark<__nv_bfloat16, cl::algorithm::fused>);
  }
  benchmark::Initialize(&argc, argv);
  if (rank == 0)
  {
    benchmark::RunSpecifiedBenchmarks();
  }
  else
  {
    null_reporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
