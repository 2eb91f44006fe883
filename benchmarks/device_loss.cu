// Device benchmarks (Google Benchmark, manual time from CUDA events). Registered only when a GPU is present.
//
//   ./build/benchmarks/contrastive_device_bench [--benchmark_filter=...]
//
// Counters: useful FLOP/s (6 N^2 D for symmetric forward+backward, whatever the algorithm recomputes), bytes/s of
// the inputs and outputs, the workspace bytes, `mem_bytes` (every device byte the step holds: operands, gradients,
// workspace; the library allocates nothing else; cuBLAS's own workspace is not counted), and the fraction of this
// GPU's measured bf16 matmul rate and copy bandwidth (the roofline benchmarks in this file measure both with cuBLAS
// and cudaMemcpy, warmed up until the clocks settle, at the median of event-timed calls; their counters
// median_FLOP/s and median_bytes/s are the ceilings, warmup_rounds/warmup_s/settled say how the warm-up went).

#include <contrastive/device/chunked.cuh>
#include <contrastive/device/loss.cuh>

#include <benchmark/benchmark.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace cl = contrastive;

namespace
{
double g_matmul_peak = 0.0; // FLOP/s, measured by roofline_matmul
double g_copy_peak = 0.0;   // bytes/s, measured by roofline_copy

struct events
{
  cudaEvent_t start{}, stop{};
  events()
  {
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
  }
  ~events()
  {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  double seconds()
  {
    float ms = 0.0f;
    cudaEventSynchronize(stop);
    cudaEventElapsedTime(&ms, start, stop);
    return ms * 1e-3;
  }
};

/// A standard normal draw from a counter (seed, element index): splitmix64 of the index, two 24-bit uniforms,
/// Box-Muller. The same numbers for the same arguments, with no state: every thread draws its own elements.
__device__ inline float counter_normal(unsigned seed, unsigned long long index)
{
  unsigned long long z = index + 0x9e3779b97f4a7c15ull * (static_cast<unsigned long long>(seed) + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  const float u1 = (static_cast<float>(z >> 40) + 1.0f) * (1.0f / 16777216.0f); // (0, 1]
  const float u2 = static_cast<float>((z >> 16) & 0xffffffu) * (1.0f / 16777216.0f);
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

/// rows x dim random L2-normalised rows in T, one block per row (grid-stride over rows for grids beyond the limit).
template <class T>
__global__ void random_rows_kernel(T* out, std::size_t rows, std::size_t dim, unsigned seed)
{
  __shared__ float partial[256];
  for (std::size_t r = blockIdx.x; r < rows; r += gridDim.x)
  {
    float ss = 0.0f;
    for (std::size_t c = threadIdx.x; c < dim; c += blockDim.x)
    {
      const float x = counter_normal(seed, r * dim + c);
      ss += x * x;
    }
    partial[threadIdx.x] = ss;
    __syncthreads();
    for (unsigned w = blockDim.x / 2; w > 0; w /= 2)
    {
      if (threadIdx.x < w)
      {
        partial[threadIdx.x] += partial[threadIdx.x + w];
      }
      __syncthreads();
    }
    const float inv = rsqrtf(fmaxf(partial[0], 1e-30f));
    __syncthreads(); // partial[0] read by every thread before the next row overwrites it
    for (std::size_t c = threadIdx.x; c < dim; c += blockDim.x)
    {
      out[r * dim + c] = contrastive::element_traits<T>::from_float(counter_normal(seed, r * dim + c) * inv);
    }
  }
}

/// Benchmark inputs drawn on the device (random L2-normalised rows, as the tests' random_rows draws on the host):
/// the host generator took ~1 s per 65536 x 512 matrix and ~30 s at N = 2^20, out of a GPU run's few minutes.
template <class T>
T* random_device_rows(std::size_t rows, std::size_t dim, unsigned seed)
{
  T* d = nullptr;
  if (cudaMalloc(&d, rows * dim * sizeof(T)) != cudaSuccess)
  {
    return nullptr;
  }
  const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>(rows, 65535u * 32u));
  random_rows_kernel<T><<<blocks, 256>>>(d, rows, dim, seed);
  if (cudaDeviceSynchronize() != cudaSuccess)
  {
    cudaFree(d);
    return nullptr;
  }
  return d;
}

/// Seconds of one `op()` (work enqueued on the legacy default stream), timed with CUDA events.
template <class Op>
double event_seconds(events& ev, Op& op)
{
  cudaEventRecord(ev.start);
  op();
  cudaEventRecord(ev.stop);
  return ev.seconds();
}

double median_of(std::vector<double> v)
{
  if (v.empty())
  {
    return 0.0;
  }
  std::sort(v.begin(), v.end());
  const std::size_t h = v.size() / 2;
  return v.size() % 2 == 1 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

/// The median of `count` timed calls of `op`.
template <class Op>
double median_seconds(events& ev, Op& op, int count)
{
  std::vector<double> t(static_cast<std::size_t>(count));
  for (double& x : t)
  {
    x = event_seconds(ev, op);
  }
  return median_of(t);
}

/// What the warm-up of a ceiling did: rounds of timed calls until two consecutive rounds' medians agreed.
struct warmup
{
  int rounds = 0;
  double seconds = 0.0; ///< the warm-up's own timed seconds (the GPU's time, not the host's)
  bool settled = false; ///< two consecutive medians agreed within the tolerance before the time bound
};

/// Warm-up of a ceiling until the clocks settle: rounds of `count` calls, until the medians of two consecutive rounds
/// agree within `tolerance` (relative), at most `max_seconds` of GPU time. A ceiling measured cold is wrong twice
/// over: the first cuBLAS call loads its kernel (lazy module loading, tens to hundreds of ms inside the timed call)
/// and an idle GPU starts at low clocks. (20 timed iterations with the first one cold made the H200's 8192^3 bf16
/// matmul read 171 TFLOP/s against PyTorch's 770-800.)
template <class Op>
warmup settle(events& ev, Op& op, int count, double tolerance, double max_seconds)
{
  warmup w;
  double previous = 0.0;
  while (w.seconds < max_seconds)
  {
    std::vector<double> t(static_cast<std::size_t>(count));
    for (double& x : t)
    {
      x = event_seconds(ev, op);
      w.seconds += x;
    }
    const double m = median_of(t);
    ++w.rounds;
    if (previous > 0.0 && m > 0.0 && std::fabs(m - previous) <= tolerance * std::max(m, previous))
    {
      w.settled = true;
      break;
    }
    previous = m;
  }
  return w;
}

/// A ceiling's measurement: `settle`, then each benchmark iteration the median of `count` calls (its manual time);
/// returns the median over the iterations and records the warm-up's counters (rounds, seconds, settled).
template <class Op>
double ceiling_median(benchmark::State& state, Op& op, int count, double max_warmup_seconds)
{
  events ev;
  const warmup w = settle(ev, op, count, 0.02, max_warmup_seconds);
  std::vector<double> times;
  for (auto _ : state)
  {
    const double t = median_seconds(ev, op, count);
    state.SetIterationTime(t);
    times.push_back(t);
  }
  state.counters["warmup_rounds"] = w.rounds;
  state.counters["warmup_s"] = w.seconds;
  state.counters["settled"] = w.settled ? 1.0 : 0.0;
  return median_of(times);
}

/// C = op(A) op(B), bf16 in and out, fp32 accumulation (column-major, cuBLAS conventions).
cublasStatus_t bf16_gemm(cublasHandle_t h,
                         cublasOperation_t op_a,
                         cublasOperation_t op_b,
                         int m,
                         int n,
                         int k,
                         const __nv_bfloat16* a,
                         int lda,
                         const __nv_bfloat16* b,
                         int ldb,
                         __nv_bfloat16* c,
                         int ldc)
{
  const float one = 1.0f, zero = 0.0f;
  return cublasGemmEx(h,
                      op_a,
                      op_b,
                      m,
                      n,
                      k,
                      &one,
                      a,
                      CUDA_R_16BF,
                      lda,
                      b,
                      CUDA_R_16BF,
                      ldb,
                      &zero,
                      c,
                      CUDA_R_16BF,
                      ldc,
                      CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
}

/// The step call of each algorithm (chunked takes a cuBLAS handle and chunk options: the default chunk, sized from
/// the free memory at the size query (device/chunked.cuh), with or without fused_tiles).
template <class L, class Algorithm, bool Tiles, class T>
cudaError_t call_step(void* temp,
                      std::size_t& bytes,
                      const cl::problem<T>& p,
                      T* dq,
                      T* dk,
                      typename L::state_type* d_state,
                      cublasHandle_t h)
{
  if constexpr (std::is_same_v<Algorithm, cl::algorithm::chunked>)
  {
    return L::step(temp, bytes, p, dq, dk, d_state, h, 0, cl::chunk_options{0, 0, Tiles});
  }
  else
  {
    (void)h;
    return L::step(temp, bytes, p, dq, dk, d_state);
  }
}

/// One training step (forward, backward, policies) at N x N, D: symmetric, or (Sigmoid) SigLIP's sigmoid loss with
/// open_clip's initial t = 10 and a learnable b = -10.
template <class T, class Algorithm, bool Tiles = false, bool Sigmoid = false>
void step_benchmark(benchmark::State& state)
{
  using L = cl::device::loss<T, cl::temperature::learnable, cl::scaler::dynamic, Algorithm>;
  cublasHandle_t h{};
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  const std::size_t dim = static_cast<std::size_t>(state.range(1));
  T* q = random_device_rows<T>(n, dim, 1);
  T* k = random_device_rows<T>(n, dim, 2);
  T *dq = nullptr, *dk = nullptr;
  typename L::state_type host_state{}, *d_state = nullptr;
  void* temp = nullptr;
  std::size_t bytes = 0;
  cl::problem<T> p{q, k, n, n, dim, nullptr, Sigmoid ? cl::objective::sigmoid : cl::objective::symmetric};
  const cl::logit_bias bias = Sigmoid ? cl::logit_bias::learnable(-10.0f) : cl::logit_bias{};
  const bool ok =
      q && k && cublasCreate(&h) == CUBLAS_STATUS_SUCCESS && cudaMalloc(&dq, n * dim * sizeof(T)) == cudaSuccess &&
      cudaMalloc(&dk, n * dim * sizeof(T)) == cudaSuccess && cudaMalloc(&d_state, sizeof(host_state)) == cudaSuccess &&
      L::make_state(cl::temperature::learnable(Sigmoid ? 0.1f : 0.07f), cl::scaler::dynamic::torch(), bias, host_state)
          .ok() &&
      cudaMemcpy(d_state, &host_state, sizeof(host_state), cudaMemcpyHostToDevice) == cudaSuccess &&
      call_step<L, Algorithm, Tiles>(nullptr, bytes, p, dq, dk, d_state, h) == cudaSuccess &&
      cudaMalloc(&temp, bytes) == cudaSuccess;
  if (!ok)
  {
    state.SkipWithError("allocation or setup failed (size too large for this GPU?)");
  }
  else
  {
    events ev;
    double total = 0.0;
    for (auto _ : state)
    {
      cudaEventRecord(ev.start);
      const cudaError_t err = call_step<L, Algorithm, Tiles>(temp, bytes, p, dq, dk, d_state, h);
      cudaEventRecord(ev.stop);
      if (err != cudaSuccess)
      {
        state.SkipWithError(cudaGetErrorString(err));
        break;
      }
      const double t = ev.seconds();
      total += t;
      state.SetIterationTime(t);
    }
    const double flops = 6.0 * double(n) * double(n) * double(dim);
    const double io = 4.0 * double(n) * double(dim) * sizeof(T);
    state.counters["FLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["bytes/s"] = benchmark::Counter(io, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["workspace_bytes"] = double(bytes);
    if constexpr (std::is_same_v<Algorithm, cl::algorithm::chunked>)
    {
      // The rows per chunk the step ran with (the default's: 4096 where free memory allows).
      cl::device::chunked_phases::layout w{};
      if (L::layout_to_fit(p, cl::chunk_options{0, 0, Tiles}, bytes, w) == cudaSuccess)
      {
        state.counters["chunk_rows"] = double(w.chunk_rows);
      }
    }
    state.counters["mem_bytes"] = double(bytes) + io;
    if (state.iterations() > 0 && total > 0.0)
    {
      const double mean = total / double(state.iterations());
      if (g_matmul_peak > 0.0)
      {
        state.counters["frac_matmul_peak"] = flops / mean / g_matmul_peak;
      }
      if (g_copy_peak > 0.0)
      {
        state.counters["frac_copy_peak"] = io / mean / g_copy_peak;
      }
    }
  }
  if (h != nullptr)
  {
    cublasDestroy(h);
  }
  cudaFree(q);
  cudaFree(k);
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(d_state);
  cudaFree(temp);
}

// The open_clip pattern as a baseline: cuBLAS logits (bf16 in, bf16 out), then softmax/cross-entropy work
// approximated by the two GEMMs of the backward; measured here as the three GEMMs alone (a lower bound on the
// baseline's time), which makes any ratio against it conservative.
void cublas_baseline(benchmark::State& state)
{
  const int n = static_cast<int>(state.range(0)), dim = static_cast<int>(state.range(1));
  cublasHandle_t h{};
  __nv_bfloat16 *q = random_device_rows<__nv_bfloat16>(n, dim, 3), *k = random_device_rows<__nv_bfloat16>(n, dim, 4);
  __nv_bfloat16 *s = nullptr, *dq = nullptr;
  const bool ok = q && k && cublasCreate(&h) == CUBLAS_STATUS_SUCCESS &&
                  cudaMalloc(&s, std::size_t(n) * n * sizeof(__nv_bfloat16)) == cudaSuccess &&
                  cudaMalloc(&dq, std::size_t(n) * dim * sizeof(__nv_bfloat16)) == cudaSuccess;
  if (!ok)
  {
    state.SkipWithError("setup failed (N^2 logits too large for this GPU?)");
  }
  else
  {
    events ev;
    for (auto _ : state)
    {
      cudaEventRecord(ev.start);
      // S = K^T-major product: column-major view, S(n x n) = K Q^T.
      bf16_gemm(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, dim, k, dim, q, dim, s, n);
      bf16_gemm(h, CUBLAS_OP_N, CUBLAS_OP_N, dim, n, n, k, dim, s, n, dq, dim);
      bf16_gemm(h, CUBLAS_OP_N, CUBLAS_OP_T, dim, n, n, q, dim, s, n, dq, dim);
      cudaEventRecord(ev.stop);
      state.SetIterationTime(ev.seconds());
    }
    state.counters["FLOP/s"] =
        benchmark::Counter(6.0 * double(n) * n * dim, benchmark::Counter::kIsIterationInvariantRate);
    // The N x N bf16 logits plus Q, K and one gradient (a lower bound on a framework's footprint, which also keeps
    // the float softmax and its gradient).
    state.counters["mem_bytes"] = (double(n) * n + 3.0 * double(n) * dim) * sizeof(__nv_bfloat16);
  }
  cublasDestroy(h);
  cudaFree(q);
  cudaFree(k);
  cudaFree(s);
  cudaFree(dq);
}

/// The bf16 GEMM ceiling: one 8192^3 product, bf16 in and out, float accumulation (CUBLAS_COMPUTE_32F, the tensor
/// cores' full rate on sm_80 and later, as torch.matmul runs it), random L2-normalised rows (not zeros: an all-zero
/// operand draws less power and so clocks higher than real data). Warmed up until the clocks settle (`settle`), then
/// each iteration is the median of 5 event-timed GEMMs; the ceiling (`g_matmul_peak`, counter `median_FLOP/s`) is the
/// rate at the median of those iterations.
void roofline_matmul(benchmark::State& state)
{
  const int n = 8192;
  const double flop = 2.0 * n * double(n) * n;
  cublasHandle_t h{};
  __nv_bfloat16 *a = random_device_rows<__nv_bfloat16>(n, n, 5), *b = random_device_rows<__nv_bfloat16>(n, n, 6);
  __nv_bfloat16* c = nullptr;
  if (!a || !b || cublasCreate(&h) != CUBLAS_STATUS_SUCCESS ||
      cublasSetMathMode(h, CUBLAS_DEFAULT_MATH) != CUBLAS_STATUS_SUCCESS ||
      cudaMalloc(&c, std::size_t(n) * n * sizeof(__nv_bfloat16)) != cudaSuccess)
  {
    state.SkipWithError("setup failed");
  }
  else
  {
    cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
    auto gemm = [&]
    {
      const cublasStatus_t st = bf16_gemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, a, n, b, n, c, n);
      status = status == CUBLAS_STATUS_SUCCESS ? st : status;
    };
    const double med = ceiling_median(state, gemm, 5, 3.0);
    if (status != CUBLAS_STATUS_SUCCESS || cudaGetLastError() != cudaSuccess)
    {
      state.SkipWithError("cublasGemmEx failed");
    }
    else
    {
      g_matmul_peak = med > 0.0 ? flop / med : 0.0;
      state.counters["FLOP/s"] = benchmark::Counter(flop, benchmark::Counter::kIsIterationInvariantRate);
      state.counters["median_FLOP/s"] = g_matmul_peak;
    }
  }
  if (h != nullptr)
  {
    cublasDestroy(h);
  }
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
}

/// The copy ceiling: a 2 GiB device-to-device copy (it reads and writes every byte), warmed up and taken at the
/// median as the matmul's.
void roofline_copy(benchmark::State& state)
{
  const std::size_t bytes = std::size_t(2) << 30;
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess ||
      cudaMemset(a, 0x3c, bytes) != cudaSuccess)
  {
    state.SkipWithError("setup failed");
    cudaFree(a);
    cudaFree(b);
    return;
  }
  auto copy = [&]
  {
    cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
  };
  const double med = ceiling_median(state, copy, 3, 2.0);
  g_copy_peak = med > 0.0 ? 2.0 * double(bytes) / med : 0.0;
  state.counters["bytes/s"] = benchmark::Counter(2.0 * bytes, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["median_bytes/s"] = g_copy_peak;
  cudaFree(a);
  cudaFree(b);
}
} // namespace

int main(int argc, char** argv)
{
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
  {
    std::printf("no CUDA device: device benchmarks not registered\n");
    return 0;
  }
  benchmark::RegisterBenchmark("roofline/cublas_bf16_matmul_8192", roofline_matmul)
      ->UseManualTime()
      ->Iterations(20)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("roofline/d2d_copy_2GiB", roofline_copy)
      ->UseManualTime()
      ->Iterations(10)
      ->Unit(benchmark::kMillisecond);
  // The table of scripts/gpu_check.sh: bf16 symmetric forward+backward, D = 512, each algorithm beside the cuBLAS
  // three-GEMM baseline; then chunked at N = 2^20, where no N x N matrix fits on one GPU.
  auto reg = [](const char* name, void (*fn)(benchmark::State&), long n)
  {
    benchmark::RegisterBenchmark(name, fn)->Args({n, 512})->UseManualTime()->Unit(benchmark::kMillisecond);
  };
  for (long n : {4096L, 16384L, 65536L})
  {
    reg("step/bf16/chunked", step_benchmark<__nv_bfloat16, cl::algorithm::chunked>, n);
    reg("step/bf16/chunked_tiles", step_benchmark<__nv_bfloat16, cl::algorithm::chunked, true>, n);
    reg("step/bf16/fused", step_benchmark<__nv_bfloat16, cl::algorithm::fused>, n);
    reg("step/bf16/materialized", step_benchmark<__nv_bfloat16, cl::algorithm::materialized>, n);
    reg("baseline/cublas_bf16_3gemm", cublas_baseline, n);
    reg("step/half/chunked", step_benchmark<__half, cl::algorithm::chunked>, n);
    reg("step/float/chunked", step_benchmark<float, cl::algorithm::chunked>, n);
    reg("step/bf16/sigmoid_chunked", step_benchmark<__nv_bfloat16, cl::algorithm::chunked, false, true>, n);
  }
  benchmark::RegisterBenchmark("step/bf16/chunked", step_benchmark<__nv_bfloat16, cl::algorithm::chunked>)
      ->Args({1L << 20, 512})
      ->UseManualTime()
      ->Iterations(1)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("step/bf16/chunked_tiles", step_benchmark<__nv_bfloat16, cl::algorithm::chunked, true>)
      ->Args({1L << 20, 512})
      ->UseManualTime()
      ->Iterations(1)
      ->Unit(benchmark::kMillisecond);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (g_matmul_peak > 0.0)
  {
    std::printf("measured bf16 matmul peak: %.1f TFLOP/s (median, after warm-up)\n", g_matmul_peak * 1e-12);
  }
  return 0;
}
