// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// Host suite: one benchmark per (objective, pass, element type, algorithm) over the size axes N x D.
//
//   host/<symmetric|info_nce|sigmoid>/<fwd|fwd_bwd>/<float|half|bfloat16>/<fused|materialized|chunked>/N:<n>/D:<d>/manual_time
//
// The softmax objectives run at tau = 0.07 (CLIP's initial temperature); the sigmoid objective at SigLIP's
// initialisation, t = 1/tau = 10 and bias -10.
//
// The materialized algorithm is the naive baseline: it builds the N x N logits in the element type, as a framework's
// autocast does. Counters (see docs/performance.md for the method):
//   useful_flops     FLOP/s counting the products the math needs: 2 N_q N_k D forward, 6 N_q N_k D forward+backward
//   exec_flops       FLOP/s counting the products the algorithm executes (fused forward+backward recomputes the
//                    logits: 8 N_q N_k D; sigmoid fused runs forward and backward in one pass: 6 N_q N_k D for either)
//   fma_peak_frac    exec_flops / the FMA peak measured by this binary at startup
//   cpu_busy         process CPU time / (wall time x threads) during the calls (1: every thread busy throughout)
//   bf16_peak_frac   bfloat16 rows on the bf16 kernel (vdpbf16ps, or AMX tiles where active: the context's
//                    host_kernel says which): exec_flops / that instruction's peak (roofline/bf16_dot_peak), and
//                    bf16_peak_frac_cpu its per-CPU-second form
//   fma_peak_frac_cpu executed FLOPs / (process CPU seconds x the FMA loop's FLOPs per CPU second): efficiency per
//                    CPU-second the process got, robust to other processes taking cores on a shared machine
//   bytes_per_second compulsory memory traffic of the algorithm (inputs read once, outputs written once, and for the
//                    materialized path every pass over the N x N matrix) per second
//   bw_peak_frac     bytes_per_second / the memcpy bandwidth measured at startup
//   mem_call         peak heap bytes the call allocates (high-water of live heap minus the caller's buffers)
//   mem_total        mem_call + the caller's inputs and outputs (q, k, dq, dk)
//   bytes_held       what the loss object reports holding after the call (loss::bytes_held())
//   rss_hwm          process resident-set high-water during the benchmark (cross-check; process-wide)

#include "random_rows.hpp"
#include "support.hpp"

#include <contrastive/contrastive.hpp>
#if defined(CONTRASTIVE_BENCH_CBLAS)
#include <contrastive/host/cblas_gemm.hpp>
#endif

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace contrastive_bench
{
namespace
{
enum class pass
{
  forward,
  forward_backward,
};

const char* to_string(pass p)
{
  return p == pass::forward ? "fwd" : "fwd_bwd";
}

/// The size axes; N values above `config::max_n` and D above `config::max_d` are not registered.
const std::size_t n_axis[] = {1024, 4096, 8192, 16384, 65536, 131072};
const std::size_t d_axis[] = {128, 512, 1024};

/// What one call executes and moves (see the file comment).
struct work_model
{
  double useful_flops;
  double exec_flops;
  double bytes;
};

template <class T, class Algorithm>
work_model model(std::size_t n_q, std::size_t n_k, std::size_t d, pass p, contrastive::objective obj)
{
  const double nn = static_cast<double>(n_q) * static_cast<double>(n_k);
  const double product = 2.0 * nn * static_cast<double>(d);
  const double es = sizeof(T);
  const double operands = static_cast<double>(n_q + n_k) * static_cast<double>(d) * es;
  constexpr bool fused = std::is_same_v<Algorithm, contrastive::algorithm::fused>;
  if (fused && obj == contrastive::objective::sigmoid)
  {
    // One pass: Q K^T, G K and G^T Q whether or not a backward follows.
    return {(p == pass::forward ? 1.0 : 3.0) * product, 3.0 * product, (p == pass::forward ? 1.0 : 2.0) * operands};
  }
  if constexpr (std::is_same_v<Algorithm, contrastive::algorithm::chunked>)
  {
    // Float chunk buffer: forward writes S_c and reads it for the row and column statistics; backward (one chunk
    // cached or S_c recomputed) writes G_c and reads it for dQ_c and dK. Default budget: several chunks from
    // N = 4096 on, so the backward recomputes (4 products).
    const bool one_chunk = n_q * ((n_k + 255) / 256 * 256) * sizeof(float) <= (std::size_t(16) << 20);
    if (p == pass::forward)
    {
      return {product, product, operands + 3.0 * nn * 4.0};
    }
    return {3.0 * product, (one_chunk ? 3.0 : 4.0) * product, 2.0 * operands + 7.0 * nn * 4.0};
  }
  if (p == pass::forward)
  {
    // Materialized forward: writes the matrix, then reads it for the log-sum-exps.
    return {product, product, operands + (fused ? 0.0 : 2.0 * nn * es)};
  }
  // Backward: G K and G^T Q; fused also recomputes Q K^T. Materialized backward reads and rewrites the matrix (dS, dA)
  // and reads it once more for each of dQ and dK.
  return {3.0 * product, (fused ? 4.0 : 3.0) * product, 2.0 * operands + (fused ? 0.0 : 6.0 * nn * es)};
}

/// Footprint estimate used only to skip configurations above the memory cap (the measured value is `mem_total`).
template <class T, class Algorithm>
std::size_t estimated_bytes(std::size_t n, std::size_t d, pass p, unsigned threads)
{
  const std::size_t dp = (d + 31) / 32 * 32;
  std::size_t b = 2 * n * d * sizeof(T) * (p == pass::forward ? 1 : 2); // caller's buffers
  b += 3 * (n + 256) * dp * sizeof(float);                              // packed keys (and queries)
  b += threads * (4 * 256 * 256 + 2 * n) * sizeof(float);               // per-worker tiles and column statistics
  if constexpr (std::is_same_v<Algorithm, contrastive::algorithm::materialized>)
  {
    b += n * n * sizeof(T);
  }
  else if constexpr (std::is_same_v<Algorithm, contrastive::algorithm::chunked>)
  {
    b += (std::size_t(16) << 20) + (n + 256) * dp * sizeof(float); // default chunk budget, dK accumulator
  }
  else if (p == pass::forward_backward)
  {
    b += 2 * (n + 256) * dp * sizeof(float); // dQ, dK accumulators (none for aligned float)
  }
  return b;
}

/// Inputs (L2-normalised random rows, as CLIP's features are), outputs, and a loss object reused across calls as a
/// training loop reuses it. One fixture lives at a time: the next configuration frees the previous one first.
struct fixture_base
{
  virtual ~fixture_base() = default;
  std::string key;
  std::size_t caller_bytes = 0;
  std::size_t heap_baseline = 0; ///< live heap before the loss object first ran
  std::size_t mem_call = 0;      ///< largest heap high-water above the baseline seen so far
  bool warm = false;
};

template <class T, class Algorithm, class Gemm>
struct fixture : fixture_base
{
  using loss_type =
      contrastive::loss<T, contrastive::temperature::fixed, contrastive::scaler::static_scale, Algorithm, Gemm>;

  fixture(std::size_t n, std::size_t d, contrastive::objective obj, pass ps, unsigned threads)
      : q(n * d), k(n * d), dq(ps == pass::forward ? 0 : n * d), dk(ps == pass::forward ? 0 : n * d),
        loss(contrastive::temperature::fixed(obj == contrastive::objective::sigmoid ? 0.1f : 0.07f),
             contrastive::scaler::static_scale(1.0f),
             threads)
  {
    if (obj == contrastive::objective::sigmoid)
    {
      (void)loss.set_logit_bias(contrastive::logit_bias::fixed(-10.0f));
    }
    if constexpr (std::is_same_v<Algorithm, contrastive::algorithm::automatic>)
    {
      (void)loss.set_memory_budget(run_config().budget_mib << 20);
    }
    const auto seed = static_cast<std::uint32_t>(0x5eed0000u + n * 7 + d);
    q = contrastive_test::random_rows<T>(n, d, seed);
    k = contrastive_test::random_rows<T>(n, d, seed + 1);
    p.q = q.data();
    p.k = k.data();
    p.n_q = p.n_k = n;
    p.dim = d;
    p.obj = obj;
    caller_bytes = (q.size() + k.size() + dq.size() + dk.size()) * sizeof(T);
  }

  /// One call of the benchmarked pass; returns false (and the status message) on failure.
  bool call(pass ps, std::string& error)
  {
    contrastive::status st;
    if (ps == pass::forward)
    {
      float value = 0.0f;
      st = loss.forward(p, value);
      benchmark::DoNotOptimize(value);
    }
    else
    {
      contrastive::step_record rec;
      st = loss.step(p, dq.data(), dk.data(), rec);
      benchmark::DoNotOptimize(rec.loss);
    }
    if (!st)
    {
      error = st.message();
      return false;
    }
    benchmark::ClobberMemory();
    return true;
  }

  std::vector<T> q, k, dq, dk;
  contrastive::problem<T> p;
  loss_type loss;
};

std::unique_ptr<fixture_base> g_fixture;

template <class T, class Algorithm, class Gemm>
void run(benchmark::State& state, const std::string& key, contrastive::objective obj, pass ps)
{
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  const std::size_t d = static_cast<std::size_t>(state.range(1));
  const config& cfg = run_config();
  const roofline& roof = machine_roofline();
  const unsigned threads = cfg.threads == 0 ? contrastive::host::default_threads() : cfg.threads;

  const std::size_t need = estimated_bytes<T, Algorithm>(n, d, ps, threads);
  if (need > cfg.mem_cap_bytes())
  {
    const std::string msg = "skipped: needs about " + format_bytes(static_cast<double>(need)) + " > memory cap " +
                            format_bytes(static_cast<double>(cfg.mem_cap_bytes())) +
                            " (--contrastive_mem_cap_gib / CONTRASTIVE_BENCH_MEM_CAP_GIB)";
    state.SkipWithError(msg.c_str());
    return;
  }

  if (!g_fixture || g_fixture->key != key)
  {
    g_fixture.reset(); // free the previous configuration before allocating this one
    g_fixture = std::make_unique<fixture<T, Algorithm, Gemm>>(n, d, obj, ps, threads);
    g_fixture->key = key;
  }
  auto& fx = static_cast<fixture<T, Algorithm, Gemm>&>(*g_fixture);
  std::string error;

  reset_rss_peak();
  if (!fx.warm)
  {
    fx.heap_baseline = heap::live();
  }
  heap::reset_peak();
  if (!fx.warm && n <= cfg.warmup_max_n)
  {
    if (!fx.call(ps, error))
    {
      state.SkipWithError(error.c_str());
      return;
    }
  }
  fx.warm = true;

  // Manual time: the wall-clock of each call alone (the library's threads are all busy inside it; CPU time of the
  // calling thread would undercount).
  double seconds = 0.0;
  double cpu_seconds = 0.0;
  for (auto _ : state)
  {
    const double c0 = process_cpu_seconds();
    const auto t0 = std::chrono::steady_clock::now();
    const bool ok = fx.call(ps, error);
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cpu_seconds += process_cpu_seconds() - c0;
    if (!ok)
    {
      state.SkipWithError(error.c_str());
      return;
    }
    state.SetIterationTime(t);
    seconds += t;
  }

  fx.mem_call = std::max(fx.mem_call, heap::peak() > fx.heap_baseline ? heap::peak() - fx.heap_baseline : 0);
  work_model w = model<T, Algorithm>(n, n, d, ps, obj);
  if constexpr (std::is_same_v<Algorithm, contrastive::algorithm::automatic>)
  {
    // The work of the algorithm it chose (the label names it; "materialized" 1 or 0 as a counter).
    const bool m = std::string(fx.loss.algorithm_used()) == "materialized";
    w = m ? model<T, contrastive::algorithm::materialized>(n, n, d, ps, obj)
          : model<T, contrastive::algorithm::fused>(n, n, d, ps, obj);
    state.SetLabel(fx.loss.algorithm_used());
    state.counters["materialized"] = m ? 1.0 : 0.0;
    state.counters["budget"] = benchmark::Counter(
        static_cast<double>(fx.loss.memory_budget()), benchmark::Counter::kDefaults, benchmark::Counter::kIs1024);
  }
  using benchmark::Counter;
  const double calls = static_cast<double>(state.iterations());
  const double exec_rate = w.exec_flops * calls / seconds;
  const double bytes_rate = w.bytes * calls / seconds;
  state.counters["useful_flops"] = w.useful_flops * calls / seconds;
  state.counters["exec_flops"] = exec_rate;
  state.counters["fma_peak_frac"] = exec_rate / roof.fma_flops;
  // Contention check: the share of the call's wall-clock x threads that the process's threads actually ran. Below 1:
  // serial parts of the call, load imbalance, or (on a shared machine) other processes taking the cores.
  state.counters["cpu_busy"] = cpu_seconds / (seconds * threads);
  // The same efficiency per CPU-second the process got: exec FLOPs / (CPU seconds x the FMA loop's FLOPs per CPU
  // second). Robust to other processes taking cores away (not to them sharing caches and memory bandwidth).
  state.counters["fma_peak_frac_cpu"] = w.exec_flops * calls / (cpu_seconds * roof.fma_flops_per_cpu);
  // bfloat16 on the vdpbf16ps kernel (every product of the built-in backend): the same against the bf16 peak.
  if constexpr (std::is_same_v<T, __nv_bfloat16> && std::is_same_v<Gemm, contrastive::gemm::builtin> &&
                contrastive::host::bf16_dot)
  {
    state.counters["bf16_peak_frac"] = exec_rate / roof.bf16_flops;
    state.counters["bf16_peak_frac_cpu"] = w.exec_flops * calls / (cpu_seconds * roof.bf16_flops_per_cpu);
  }
  state.counters["bytes_per_second"] = bytes_rate;
  state.counters["bw_peak_frac"] = bytes_rate / roof.copy_bytes;
  state.counters["mem_call"] = Counter(static_cast<double>(fx.mem_call), Counter::kDefaults, Counter::kIs1024);
  state.counters["mem_total"] =
      Counter(static_cast<double>(fx.mem_call + fx.caller_bytes), Counter::kDefaults, Counter::kIs1024);
  state.counters["bytes_held"] =
      Counter(static_cast<double>(fx.loss.bytes_held()), Counter::kDefaults, Counter::kIs1024);
  state.counters["rss_hwm"] = Counter(static_cast<double>(rss_peak()), Counter::kDefaults, Counter::kIs1024);
  state.counters["threads"] = static_cast<double>(fx.loss.threads());
}

template <class T, class Algorithm, class Gemm = contrastive::gemm::builtin>
void register_one(contrastive::objective obj, pass ps, std::size_t n, std::size_t d)
{
  const config& cfg = run_config();
  // The built-in GEMM core is the default and unnamed; another backend appends "+<name>" to the algorithm.
  const std::string gemm =
      std::is_same_v<Gemm, contrastive::gemm::builtin> ? std::string() : std::string("+") + Gemm::name;
  const std::string name = std::string("host/") + contrastive::to_string(obj) + "/" + to_string(ps) + "/" +
                           contrastive::element_traits<T>::name + "/" + Algorithm::name + gemm;
  benchmark::internal::Benchmark* b = benchmark::RegisterBenchmark(
      name.c_str(),
      [key = name + "/" + std::to_string(n) + "/" + std::to_string(d), obj, ps](benchmark::State& s)
      {
        run<T, Algorithm, Gemm>(s, key, obj, ps);
      });
  b->ArgNames({"N", "D"})
      ->Args({static_cast<std::int64_t>(n), static_cast<std::int64_t>(d)})
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  if (n >= cfg.single_shot_n)
  {
    b->Iterations(1);
  }
  if (n >= cfg.single_rep_n)
  {
    b->Repetitions(1);
  }
}

template <class T>
void register_type(contrastive::objective obj, pass ps, std::size_t n, std::size_t d)
{
  // The baseline first, so that side-by-side pairs run back to back.
  register_one<T, contrastive::algorithm::materialized>(obj, ps, n, d);
  register_one<T, contrastive::algorithm::fused>(obj, ps, n, d);
  register_one<T, contrastive::algorithm::chunked>(obj, ps, n, d);
  // Materialized where it fits the budget (--contrastive_budget_mib, default the library's) for float, else fused; the
  // sigmoid objective too (what siglip_loss runs by default).
  register_one<T, contrastive::algorithm::automatic>(obj, ps, n, d);
}
} // namespace

void register_host_benchmarks()
{
  const config& cfg = run_config();
  for (std::size_t n : n_axis)
  {
    for (std::size_t d : d_axis)
    {
      if (n > cfg.max_n || d > cfg.max_d)
      {
        continue;
      }
      for (contrastive::objective obj :
           {contrastive::objective::symmetric, contrastive::objective::info_nce, contrastive::objective::sigmoid})
      {
        for (pass ps : {pass::forward_backward, pass::forward})
        {
          register_type<float>(obj, ps, n, d);
          register_type<__nv_bfloat16>(obj, ps, n, d);
          register_type<__half>(obj, ps, n, d);
#if defined(CONTRASTIVE_BENCH_CBLAS)
          if (obj == contrastive::objective::symmetric && ps == pass::forward_backward)
          {
            // The CBLAS backend beside the built-in core (float and half; OpenBLAS single-threaded, see main.cpp).
            register_one<float, contrastive::algorithm::materialized, contrastive::gemm::cblas>(obj, ps, n, d);
            register_one<float, contrastive::algorithm::fused, contrastive::gemm::cblas>(obj, ps, n, d);
            register_one<float, contrastive::algorithm::chunked, contrastive::gemm::cblas>(obj, ps, n, d);
            register_one<__half, contrastive::algorithm::fused, contrastive::gemm::cblas>(obj, ps, n, d);
          }
#endif
        }
      }
    }
  }
}
} // namespace contrastive_bench
