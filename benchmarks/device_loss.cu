// Device benchmarks (Google Benchmark, manual time from CUDA events). Registered only when a GPU is present.
//
//   ./build/benchmarks/contrastive_device_bench [--benchmark_filter=...]
//
// Counters: useful FLOP/s (6 N^2 D for symmetric forward+backward, whatever the algorithm recomputes), bytes/s of
// the inputs and outputs, the workspace bytes, `mem_bytes` (every device byte the step holds: operands, gradients,
// workspace; the library allocates nothing else; cuBLAS's own workspace is not counted), and the fraction of this
// GPU's measured bf16 matmul rate and copy bandwidth (the roofline benchmarks in this file measure both with cuBLAS
// and cudaMemcpy).

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

/// C = op(A) op(B), bf16 in and out, fp32 accumulation (column-major, cuBLAS conventions).
void bf16_gemm(cublasHandle_t h,
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
  cublasGemmEx(h,
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

void roofline_matmul(benchmark::State& state)
{
  const int n = 8192;
  cublasHandle_t h{};
  __nv_bfloat16 *a = random_device_rows<__nv_bfloat16>(n, n, 5), *b = random_device_rows<__nv_bfloat16>(n, n, 6);
  __nv_bfloat16* c = nullptr;
  if (!a || !b || cublasCreate(&h) != CUBLAS_STATUS_SUCCESS ||
      cudaMalloc(&c, std::size_t(n) * n * sizeof(__nv_bfloat16)) != cudaSuccess)
  {
    state.SkipWithError("setup failed");
    return;
  }
  events ev;
  double best = 0.0;
  for (auto _ : state)
  {
    cudaEventRecord(ev.start);
    bf16_gemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, a, n, b, n, c, n);
    cudaEventRecord(ev.stop);
    const double t = ev.seconds();
    state.SetIterationTime(t);
    best = std::max(best, 2.0 * n * double(n) * n / t);
  }
  g_matmul_peak = best;
  state.counters["FLOP/s"] = benchmark::Counter(2.0 * n * double(n) * n, benchmark::Counter::kIsIterationInvariantRate);
  cublasDestroy(h);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
}

void roofline_copy(benchmark::State& state)
{
  const std::size_t bytes = std::size_t(2) << 30;
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess)
  {
    state.SkipWithError("setup failed");
    return;
  }
  events ev;
  for (auto _ : state)
  {
    cudaEventRecord(ev.start);
    cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(ev.stop);
    const double t = ev.seconds();
    state.SetIterationTime(t);
    g_copy_peak = std::max(g_copy_peak, 2.0 * double(bytes) / t);
  }
  // A device-to-device copy reads and writes every byte.
  state.counters["bytes/s"] = benchmark::Counter(2.0 * bytes, benchmark::Counter::kIsIterationInvariantRate);
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
    std::printf("measured bf16 matmul peak: %.1f TFLOP/s\n", g_matmul_peak * 1e-12);
  }
  return 0;
}
