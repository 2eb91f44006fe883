// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// algorithm::chunked on the device: the three large products by cuBLAS (16-bit or float inputs, float
/// accumulation), everything element-wise in small kernels built from the shared tile math. Include this header (it
/// includes device/loss.cuh) and link cuBLAS (CMake: `contrastive::cublas`); the fused and materialized device
/// algorithms need neither.
///
///   using L = contrastive::device::loss<__nv_bfloat16, temperature::learnable, scaler::dynamic, algorithm::chunked>;
///   cublasHandle_t h;  cublasCreate(&h);           // the caller's handle (one per thread, as cuBLAS asks)
///   L::step(nullptr, bytes, problem, dq, dk, d_state, h, stream, {0, budget});   // size query
///   L::step(d_temp, bytes, problem, dq, dk, d_state, h, stream, {0, budget});    // the step
///
/// Per chunk of B query rows (B from `chunk_options`; default, neither rows nor budget_bytes given: 4096 rows, fewer
/// where their chunk buffers do not fit in 1/4 of the device memory free after the step's other workspace buffers,
/// never fewer than S_c and G_c in 384 MiB or 256 rows, at most every row. The size query reads cudaMemGetInfo; the
/// step takes the rows its workspace holds, so a step given the bytes its query wrote uses the query's rows. The
/// chunk size changes the order of float sums (dK's over chunks; cuBLAS may pick other kernels for other shapes),
/// not the math: give `rows` where steps must not depend on free memory):
///   forward   S_c = Q_c K^T (cuBLAS, float out); one block per row: the row's negatives (online_lse::absorb) and
///             positive, finish_row; symmetric: per-column partials of the chunk merged into a running state.
///   backward  S_c again unless one chunk holds every row (info_nce always runs forward and backward in one pass:
///             its rows are complete within a chunk); G_c element-wise (logit_gradient, exact positive term),
///             stored as T (fp16: times 2^k so that P ~ 1/n stays in the normal range, k folded back through the
///             products' alpha); dQ_c = G_c K (cuBLAS, float out) scaled and rounded per row with <dQ_i, q_i> for
///             d loss / d log s; dK += G_c^T Q_c (cuBLAS, float accumulator); dK rounded once at the end.
/// Workspace: B x ld (float S_c, G_c in place for float; + B x ld of T for 16-bit), n_k x dim floats (dK),
/// B x dim floats (dQ_c), O(n_q + n_k) statistics. Work: 6 n_q n_k d flops (one chunk or info_nce), else 8.
///
/// chunk_options::fused_tiles (16-bit types, sm_80+; device/logits_tile.cuh): S_c tiles on tensor cores in the
/// library's kernel, reduced (forward) or turned into G_c (backward) in registers; no float S_c (workspace B x ld of T
/// plus small tile partials); always 8 n_q n_k d flops (S_c computed in both passes, also for info_nce).
///
/// The call sets the handle's stream to `stream` and its pointer mode to host for the duration of the call and
/// restores both before returning. cuBLAS failures come back as cudaError_t (allocation: cudaErrorMemoryAllocation,
/// invalid value: cudaErrorInvalidValue, unsupported or wrong architecture: cudaErrorNotSupported, anything else
/// cudaErrorUnknown). Float products follow the handle's math mode
/// (CUBLAS_DEFAULT_MATH: exact float; CUBLAS_TF32_TENSOR_OP_MATH if you want TF32).

#include <contrastive/device/logits_tile.cuh>
#include <contrastive/device/loss.cuh>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/numeric/online_lse.hpp>

#include <cub/block/block_reduce.cuh>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace contrastive
{
namespace device
{
namespace chunked_detail
{
/// The default chunk's floor: S_c and G_c in at most this (and default_min_rows), what earlier versions always used.
inline constexpr std::size_t default_budget = std::size_t(384) << 20;
/// Default chunks hold at least this many rows: below about dim / 2 rows per chunk, re-reading K for every chunk's
/// products costs more memory traffic than the chunk itself (matters from N ~ 500k at dim = 512).
inline constexpr std::size_t default_min_rows = 256;
/// Default chunks take at most 1/free_divisor of the device memory free after the step's other workspace buffers.
inline constexpr std::size_t free_divisor = 4;
/// The default chunk's rows where free memory allows (and the floor is lower): each chunk reads and writes the
/// n_k x dim float dK accumulator and reads K about three times, ~14 n_k dim bytes (16-bit K), beside 8 rows n_k dim
/// flops: 1.75 / rows bytes per flop, at 4096 rows 6-9% of an H200's bf16 GEMM time (at 256 rows 100-140%; the
/// accumulator alone is 8 of the 14 bytes; docs/performance.md).
inline constexpr std::size_t default_max_rows = 4096;
inline constexpr std::size_t row_align = 64;
inline constexpr int threads = 256;

template <class T>
constexpr cudaDataType_t cuda_type() noexcept
{
  if constexpr (std::is_same_v<T, float>)
  {
    return CUDA_R_32F;
  }
  else if constexpr (std::is_same_v<T, __half>)
  {
    return CUDA_R_16F;
  }
  else
  {
    return CUDA_R_16BF;
  }
}

inline cudaError_t from_cublas(cublasStatus_t s) noexcept
{
  switch (s)
  {
  case CUBLAS_STATUS_SUCCESS:
    return cudaSuccess;
  case CUBLAS_STATUS_ALLOC_FAILED:
    return cudaErrorMemoryAllocation;
  case CUBLAS_STATUS_INVALID_VALUE:
    return cudaErrorInvalidValue;
  case CUBLAS_STATUS_NOT_SUPPORTED:
  case CUBLAS_STATUS_ARCH_MISMATCH:
    return cudaErrorNotSupported;
  default:
    return cudaErrorUnknown;
  }
}

struct lse_merge
{
  __device__ online_lse operator()(online_lse a, const online_lse& b) const noexcept
  {
    a.merge(b);
    return a;
  }
};

/// fp16 only: G_c is stored times 2^k. |G| <= 2 max(coef) (the positive's term), and the softmax entries P ~ 1/n
/// carry a further max(coef); k lifts max(coef) to [0.5, 1) and then by 2^min(ceil(log2 n), 12), which keeps |G 2^k|
/// below 2^15 and P ~ 1/n near 2^-4 .. 2^0. bf16 (float's exponent range) and float keep k = 0.
template <class T>
int gradient_shift(const grad_coefficients& gc, std::size_t n) noexcept
{
  if constexpr (!std::is_same_v<T, __half>)
  {
    (void)gc;
    (void)n;
    return 0;
  }
  else
  {
    const float c = std::max(gc.row_coef, gc.col_coef);
    int k = 0;
    while (k < 62 && c * static_cast<float>(std::uint64_t(1) << k) < 0.5f)
    {
      ++k;
    }
    int log_n = 0;
    while (log_n < 12 && (std::size_t(1) << log_n) < n)
    {
      ++log_n;
    }
    return std::min(k + log_n, 100);
  }
}

/// Plain arguments of the element-wise kernels.
struct chunk_args
{
  const float* logits = nullptr; ///< S_c without the scale: q_i . k_j, row-major rows x ld
  long long ld = 0;
  int n_k = 0;
  const std::int32_t* labels = nullptr; ///< info_nce labels (device), null: the diagonal
  const kernels::step_scalars* scalars = nullptr;
  float* row_lse = nullptr;
  float* row_loss = nullptr;
  float* row_max = nullptr; ///< reported max logit per row (positive included)
  float* pos = nullptr;     ///< the positive logit of each row
  float* col_max = nullptr; ///< symmetric: running column state of the negatives
  float* col_sum = nullptr;
  float* col_lse = nullptr;
  float* col_loss = nullptr;
  int* flags = nullptr; ///< [0] logits, [1] dQ, [2] dK non-finite
};

__device__ CONTRASTIVE_FORCEINLINE long long positive_of(const chunk_args& a, long long i) noexcept
{
  return a.labels != nullptr ? static_cast<long long>(a.labels[i]) : i;
}

/// One block per chunk row: the row's negatives, its positive, its loss and reported max.
template <int = 0> // a template, like every kernel in a header: one definition across translation units
__global__ void __launch_bounds__(threads) row_statistics(chunk_args a, long long c0)
{
  const long long r = blockIdx.x;
  const long long i = c0 + r;
  const float s = a.scalars->scale;
  const float* x = a.logits + r * a.ld;
  const long long p = positive_of(a, i);
  online_lse neg{};
  bool bad = false;
  for (int j = threadIdx.x; j < a.n_k; j += threads)
  {
    const float v = s * x[j];
    bad |= !contrastive::detail::finite(v);
    if (j != p)
    {
      neg.absorb(v);
    }
  }
  using reduce_t = cub::BlockReduce<online_lse, threads>;
  __shared__ typename reduce_t::TempStorage tmp;
  const online_lse all = reduce_t(tmp).Reduce(neg, lse_merge{});
  if (__syncthreads_or(bad) && threadIdx.x == 0)
  {
    a.flags[0] = 1;
  }
  if (threadIdx.x == 0)
  {
    // An out-of-range label (not checked on the device) has no positive: -inf makes the row's loss +inf.
    const float positive = p >= 0 && p < a.n_k ? s * x[p] : -contrastive::detail::infinity_f;
    const row_loss rl = finish_row(all, positive);
    a.row_lse[i] = rl.lse;
    a.row_loss[i] = rl.loss;
    a.row_max[i] = kernels::nan_max{}(all.max, positive);
    a.pos[i] = positive;
  }
}

/// Symmetric: 32 columns x 8 row slices per block; the chunk's negatives of each column merged into the running
/// state (`first`: the state starts here). Each row's positive (its label, or the diagonal) is left out.
template <int = 0> // a template, like every kernel in a header: one definition across translation units
__global__ void __launch_bounds__(threads) column_partials(chunk_args a, long long c0, int rows, int first)
{
  const int j = blockIdx.x * 32 + threadIdx.x;
  const float s = a.scalars->scale;
  online_lse st{};
  if (j < a.n_k)
  {
    for (int r = threadIdx.y; r < rows; r += 8)
    {
      if (positive_of(a, c0 + r) != j) // the diagonal, or (a block of a distributed batch) the row's label
      {
        st.absorb(s * a.logits[r * a.ld + j]);
      }
    }
  }
  __shared__ float smax[8][32];
  __shared__ float ssum[8][32];
  smax[threadIdx.y][threadIdx.x] = st.max;
  ssum[threadIdx.y][threadIdx.x] = st.sum;
  __syncthreads();
  if (threadIdx.y == 0 && j < a.n_k)
  {
    online_lse run = first ? online_lse{} : online_lse{a.col_max[j], a.col_sum[j]};
    for (int y = 0; y < 8; ++y)
    {
      run.merge(online_lse{smax[y][threadIdx.x], ssum[y][threadIdx.x]});
    }
    a.col_max[j] = run.max;
    a.col_sum[j] = run.sum;
  }
}

/// Symmetric: each column's log-sum-exp and loss from its negatives and positive (row j's positive logit).
template <int = 0> // a template, like every kernel in a header: one definition across translation units
__global__ void __launch_bounds__(threads) finish_columns(chunk_args a)
{
  for (int j = blockIdx.x * threads + threadIdx.x; j < a.n_k; j += gridDim.x * threads)
  {
    const row_loss rl = finish_row(online_lse{a.col_max[j], a.col_sum[j]}, a.pos[j]);
    a.col_lse[j] = rl.lse;
    a.col_loss[j] = rl.loss;
  }
}

/// G_c = dL/dS for the chunk's rows, times 2^k, rounded to T into g (row stride ld; may be the logits themselves
/// when T is float: each element is read before it is written, by the same thread).
template <class T>
__global__ void __launch_bounds__(threads)
    chunk_gradient(chunk_args a, long long c0, int rows, grad_coefficients gc, int symmetric, float factor, T* g)
{
  const float s = a.scalars->scale;
  for (int r = blockIdx.y; r < rows; r += gridDim.y)
  {
    const long long i = c0 + r;
    const long long p = positive_of(a, i);
    const float lr = a.row_lse[i];
    const float pos_g = exact_positive_gradient(
        a.row_loss[i], symmetric && p >= 0 && p < a.n_k ? a.col_loss[p] : 0.0f, gc, symmetric != 0);
    const float* x = a.logits + r * a.ld;
    T* out = g + r * a.ld;
    for (int j = blockIdx.x * threads + threadIdx.x; j < a.n_k; j += gridDim.x * threads)
    {
      const float v = s * x[j];
      float gv = logit_gradient(v, lr, symmetric ? a.col_lse[j] : 0.0f, gc, symmetric != 0);
      gv = j == p ? pos_g : gv;
      out[j] = element_traits<T>::from_float(gv * factor);
    }
  }
}

/// Rows of a float product (row-major, `dim` per row) scaled by loss_scale * s, rounded to T; optionally the dot of
/// each unscaled row with the matching row of `rows_in` (d loss / d log s). One block per row.
template <class T>
__global__ void __launch_bounds__(threads) store_rows(const float* acc,
                                                      int dim,
                                                      const T* rows_in,
                                                      T* out,
                                                      const kernels::step_scalars* scalars,
                                                      float* row_dot,
                                                      int* flag)
{
  const long long r = blockIdx.x;
  const float f = scalars->loss_scale * scalars->scale;
  const float* in = acc + r * dim;
  T* o = out + r * dim;
  float dot = 0.0f;
  bool bad = false;
  for (int c = threadIdx.x; c < dim; c += threads)
  {
    const float v = in[c];
    const T t = element_traits<T>::from_float(f * v);
    o[c] = t;
    bad |= !contrastive::detail::finite(element_traits<T>::to_float(t));
    if (row_dot != nullptr)
    {
      dot += v * element_traits<T>::to_float(rows_in[r * dim + c]);
    }
  }
  if (row_dot != nullptr)
  {
    using reduce_t = cub::BlockReduce<float, threads>;
    __shared__ typename reduce_t::TempStorage tmp;
    const float total = reduce_t(tmp).Sum(dot);
    if (threadIdx.x == 0)
    {
      row_dot[r] = total;
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0)
  {
    *flag = 1;
  }
}

/// Sub-buffers of the chunked workspace (byte offsets, 256-byte aligned).
struct layout
{
  std::size_t row_lse, row_loss, row_max, pos, row_dot, col_max, col_sum, col_lse, col_loss, logits, grad, dq, dk, sums,
      flags, scalars, cub, row_part, col_part, total;
  std::size_t chunk_rows, ld, cub_bytes;
  bool tiles; ///< chunk_options::fused_tiles in effect (no float S_c; row_part / col_part hold the tile partials)
};

/// The current device's free memory (cudaMemGetInfo), 0 when that fails (no device; the error is cleared). A size
/// query may run while this thread captures a graph: the call is made in relaxed capture mode, which allows calls
/// that global mode prohibits, and the thread's mode is restored.
inline std::size_t device_free_bytes() noexcept
{
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  const bool exchanged = cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
  std::size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t e = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (exchanged)
  {
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
  }
  if (e != cudaSuccess || !exchanged)
  {
    (void)cudaGetLastError();
  }
  return e == cudaSuccess ? free_bytes : 0;
}

/// Whether the current device runs the tile kernels: compute capability 8.0 or later, and the code this program
/// loads for them built for sm_80 or later (a build for sm_70/75 alone would run compute_7x PTX, where mma.sync
/// m16n8k16 is missing and the kernels trap). A CUDA error (no device) answers no; that error is cleared.
inline bool device_runs_tiles() noexcept
{
  int dev = 0;
  int major = 0;
  cudaFuncAttributes fa{};
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaFuncGetAttributes(&fa, tile_detail::tile_kernel<__nv_bfloat16, tile_detail::statistics_epilogue>) !=
          cudaSuccess)
  {
    (void)cudaGetLastError();
    return false;
  }
  return major >= 8 && fa.ptxVersion >= 80 && fa.binaryVersion >= 80;
}

/// chunk_options::fused_tiles in effect for this problem (see there).
template <class Element>
bool use_tiles(const problem<Element>& p, const chunk_options& o) noexcept
{
  if constexpr (std::is_same_v<Element, float>)
  {
    (void)p;
    (void)o;
    return false;
  }
  else
  {
    const auto aligned = [](const void* ptr)
    {
      return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0;
    };
    return o.fused_tiles && p.dim % 8 == 0 && aligned(p.q) && aligned(p.k) && device_runs_tiles();
  }
}

/// Bytes per chunk row of the tile path's buffers: G_c in T, one row partial per column tile, and (amortised over a
/// row tile) one column partial per column.
template <class Element>
constexpr std::size_t tile_bytes_per_row(std::size_t ld) noexcept
{
  const std::size_t col_tiles = (ld + tile_detail::config::bn - 1) / tile_detail::config::bn;
  return ld * sizeof(Element) + col_tiles * sizeof(float2) +
         (ld * sizeof(float2) + tile_detail::config::bm - 1) / tile_detail::config::bm;
}

/// Restores the handle's stream and pointer mode when the call ends.
struct handle_guard
{
  cublasHandle_t h;
  cudaStream_t old_stream = nullptr;
  cublasPointerMode_t old_mode = CUBLAS_POINTER_MODE_HOST;
  bool set_stream = false; // changed by enter, so restored on exit
  bool set_mode = false;

  /// Sets the stream and host pointer mode only where the handle differs: cublasSetStream also resets the handle's
  /// workspace to the default pool, which would drop a workspace the caller attached (PyTorch attaches its own to
  /// the handle it hands out, already on its current stream).
  cublasStatus_t enter(cudaStream_t stream) noexcept
  {
    cublasStatus_t st = cublasGetStream(h, &old_stream);
    if (st == CUBLAS_STATUS_SUCCESS)
    {
      st = cublasGetPointerMode(h, &old_mode);
    }
    if (st == CUBLAS_STATUS_SUCCESS && old_stream != stream)
    {
      st = cublasSetStream(h, stream);
      set_stream = st == CUBLAS_STATUS_SUCCESS;
    }
    if (st == CUBLAS_STATUS_SUCCESS && old_mode != CUBLAS_POINTER_MODE_HOST)
    {
      st = cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST);
      set_mode = st == CUBLAS_STATUS_SUCCESS;
    }
    return st;
  }
  ~handle_guard()
  {
    if (set_mode)
    {
      cublasSetPointerMode(h, old_mode);
    }
    if (set_stream)
    {
      cublasSetStream(h, old_stream);
    }
  }
};

/// One chunked step's work on a problem whose workspace is laid out by `layout`, phase by phase, so that the
/// single-process loss and the distributed one (distributed/nccl.cuh) share it. `p.labels` (device) give each row's
/// positive column (null: the diagonal); `gc` the gradient coefficients (the problem's own, or the global batch's).
/// The caller has entered the handle (handle_guard) and orders the phases:
///   begin -> [symmetric: forward_all -> column statistics (finish_columns_local, or combined across ranks)]
///         -> backward_all -> store_dk -> reduce_local -> a finish kernel.
template <class Element>
struct runner
{
  static constexpr bool sixteen_bit = !std::is_same_v<Element, float>;

  problem<Element> p;
  layout w;
  char* base;
  cublasHandle_t handle;
  cudaStream_t stream;
  grad_coefficients gc;
  bool sym;
  float up, down; // 2^k and 2^-k around the element-type G (fp16 only; else 1)
  chunk_args a;

  runner(const problem<Element>& prob,
         const layout& lay,
         void* d_temp,
         cublasHandle_t h,
         cudaStream_t s,
         const grad_coefficients& coef)
      : p(prob), w(lay), base(static_cast<char*>(d_temp)), handle(h), stream(s), gc(coef),
        sym(prob.obj == objective::symmetric)
  {
    const int shift = gradient_shift<Element>(gc, std::max(p.n_q, p.n_k));
    up = std::ldexp(1.0f, shift);
    down = std::ldexp(1.0f, -shift);
    a.logits = f(w.logits);
    a.ld = static_cast<long long>(w.ld);
    a.n_k = static_cast<int>(p.n_k);
    a.labels = p.labels;
    a.scalars = scalars();
    a.row_lse = f(w.row_lse);
    a.row_loss = f(w.row_loss);
    a.row_max = f(w.row_max);
    a.pos = f(w.pos);
    a.col_max = f(w.col_max);
    a.col_sum = f(w.col_sum);
    a.col_lse = f(w.col_lse);
    a.col_loss = f(w.col_loss);
    a.flags = flags();
  }

  float* f(std::size_t off) const noexcept
  {
    return reinterpret_cast<float*>(base + off);
  }
  kernels::step_scalars* scalars() const noexcept
  {
    return reinterpret_cast<kernels::step_scalars*>(base + w.scalars);
  }
  kernels::step_sums* sums() const noexcept
  {
    return reinterpret_cast<kernels::step_sums*>(base + w.sums);
  }
  int* flags() const noexcept
  {
    return reinterpret_cast<int*>(base + w.flags);
  }
  float* dk_accumulator() const noexcept
  {
    return f(w.dk);
  }
  int dim() const noexcept
  {
    return static_cast<int>(p.dim);
  }
  void* grad() const noexcept
  {
    return sixteen_bit ? static_cast<void*>(base + w.grad) : static_cast<void*>(f(w.logits));
  }

  /// Clears the flags and reads tau and the loss scale from the state (prologue kernel).
  template <class State>
  cudaError_t begin(State* d_state)
  {
    CONTRASTIVE_CUDA_TRY(cudaMemsetAsync(flags(), 0, 3 * sizeof(int), stream));
    kernels::prologue<State><<<1, 1, 0, stream>>>(d_state, scalars());
    return cudaPeekAtLastError();
  }

  /// S_c^T (column-major n_k x rows) = K (d x n_k)^T Q_c (d x rows).
  cudaError_t logits_product(std::size_t c0, int rows)
  {
    const float one = 1.0f, zero = 0.0f;
    const cudaDataType_t et = cuda_type<Element>();
    return from_cublas(cublasGemmEx(handle,
                                    CUBLAS_OP_T,
                                    CUBLAS_OP_N,
                                    a.n_k,
                                    rows,
                                    dim(),
                                    &one,
                                    p.k,
                                    et,
                                    dim(),
                                    p.q + c0 * p.dim,
                                    et,
                                    dim(),
                                    &zero,
                                    f(w.logits),
                                    CUDA_R_32F,
                                    static_cast<int>(w.ld),
                                    CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
  }

  /// Arguments of the tile kernels for the chunk at row c0.
  tile_detail::tile_args tile_args_for(std::size_t c0, int rows) const noexcept
  {
    tile_detail::tile_args t;
    t.q = p.q + c0 * p.dim;
    t.k = p.k;
    t.rows = rows;
    t.n_k = a.n_k;
    t.dim = dim();
    t.c0 = static_cast<long long>(c0);
    t.labels = p.labels;
    t.scalars = a.scalars;
    t.row_part = reinterpret_cast<float2*>(base + w.row_part);
    t.col_part = reinterpret_cast<float2*>(base + w.col_part);
    t.pos = a.pos;
    t.flag = a.flags;
    t.row_lse = a.row_lse;
    t.row_loss = a.row_loss;
    t.col_lse = a.col_lse;
    t.col_loss = a.col_loss;
    t.gc = gc;
    t.symmetric = sym ? 1 : 0;
    t.factor = up;
    t.g = grad();
    t.ld = static_cast<long long>(w.ld);
    return t;
  }

  static dim3 tile_grid(int rows, int n_k) noexcept
  {
    return dim3(static_cast<unsigned>((n_k + tile_detail::config::bn - 1) / tile_detail::config::bn),
                static_cast<unsigned>((rows + tile_detail::config::bm - 1) / tile_detail::config::bm));
  }

  /// The tile path's forward of one chunk: statistics tiles, then the rows' and (symmetric) the columns' merges.
  cudaError_t forward_chunk_tiles(std::size_t c0, int rows)
  {
    if constexpr (sixteen_bit)
    {
      const tile_detail::tile_args t = tile_args_for(c0, rows);
      const dim3 grid = tile_grid(rows, a.n_k);
      tile_detail::tile_kernel<Element, tile_detail::statistics_epilogue>
          <<<grid, tile_detail::config::threads, 0, stream>>>(t);
      CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
      tile_detail::finish_tile_rows<><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(
          t.row_part, static_cast<int>(grid.x), rows, t.c0, a.n_k, p.labels, a.row_lse, a.row_loss, a.row_max, a.pos);
      CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
      if (sym)
      {
        tile_detail::merge_tile_columns<>
            <<<static_cast<unsigned>(std::min(1024, (a.n_k + 255) / 256)), 256, 0, stream>>>(
                t.col_part, static_cast<int>(grid.y), a.n_k, c0 == 0 ? 1 : 0, a.col_max, a.col_sum);
      }
      return cudaPeekAtLastError();
    }
    else
    {
      (void)c0;
      (void)rows;
      return cudaErrorNotSupported;
    }
  }

  /// The tile path's G_c of one chunk (S_c recomputed on tensor cores, never stored).
  cudaError_t gradient_tiles(std::size_t c0, int rows)
  {
    if constexpr (sixteen_bit)
    {
      tile_detail::tile_kernel<Element, tile_detail::gradient_epilogue>
          <<<tile_grid(rows, a.n_k), tile_detail::config::threads, 0, stream>>>(tile_args_for(c0, rows));
      return cudaPeekAtLastError();
    }
    else
    {
      (void)c0;
      (void)rows;
      return cudaErrorNotSupported;
    }
  }

  cudaError_t forward_chunk(std::size_t c0, int rows)
  {
    if (w.tiles)
    {
      return forward_chunk_tiles(c0, rows);
    }
    CONTRASTIVE_CUDA_TRY(logits_product(c0, rows));
    row_statistics<><<<static_cast<unsigned>(rows), threads, 0, stream>>>(a, static_cast<long long>(c0));
    CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    if (sym)
    {
      column_partials<><<<static_cast<unsigned>((a.n_k + 31) / 32), dim3(32, 8), 0, stream>>>(
          a, static_cast<long long>(c0), rows, c0 == 0 ? 1 : 0);
      CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    }
    return cudaSuccess;
  }

  /// G_c, dQ_c (scaled, rounded into dq's rows, <dQ_i, q_i> kept), dK += G_c^T Q_c (float accumulator).
  cudaError_t backward_chunk(std::size_t c0, int rows, Element* dq)
  {
    const float one = 1.0f, zero = 0.0f;
    const cudaDataType_t et = cuda_type<Element>();
    const cudaDataType_t gt = sixteen_bit ? et : CUDA_R_32F;
    const dim3 grid(static_cast<unsigned>(std::min(1024, (a.n_k + threads - 1) / threads)),
                    static_cast<unsigned>(std::min(rows, 65535)));
    if (w.tiles)
    {
      CONTRASTIVE_CUDA_TRY(gradient_tiles(c0, rows));
    }
    else
    {
      chunk_gradient<Element><<<grid, threads, 0, stream>>>(
          a, static_cast<long long>(c0), rows, gc, sym ? 1 : 0, up, static_cast<Element*>(grad()));
      CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    }
    // dQ_c^T (d x rows) = K^T (d x n_k) G_c^T (n_k x rows), times 2^-k.
    CONTRASTIVE_CUDA_TRY(from_cublas(cublasGemmEx(handle,
                                                  CUBLAS_OP_N,
                                                  CUBLAS_OP_N,
                                                  dim(),
                                                  rows,
                                                  a.n_k,
                                                  &down,
                                                  p.k,
                                                  et,
                                                  dim(),
                                                  grad(),
                                                  gt,
                                                  static_cast<int>(w.ld),
                                                  &zero,
                                                  f(w.dq),
                                                  CUDA_R_32F,
                                                  dim(),
                                                  CUBLAS_COMPUTE_32F,
                                                  CUBLAS_GEMM_DEFAULT)));
    store_rows<Element><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        f(w.dq), dim(), p.q + c0 * p.dim, dq + c0 * p.dim, scalars(), f(w.row_dot) + c0, flags() + 1);
    CONTRASTIVE_CUDA_TRY(cudaPeekAtLastError());
    // dK^T (d x n_k) += Q_c^T (d x rows) G_c (rows x n_k), times 2^-k; the first chunk starts the accumulator.
    const float* beta = c0 == 0 ? &zero : &one;
    return from_cublas(cublasGemmEx(handle,
                                    CUBLAS_OP_N,
                                    CUBLAS_OP_T,
                                    dim(),
                                    a.n_k,
                                    rows,
                                    &down,
                                    p.q + c0 * p.dim,
                                    et,
                                    dim(),
                                    grad(),
                                    gt,
                                    static_cast<int>(w.ld),
                                    beta,
                                    f(w.dk),
                                    CUDA_R_32F,
                                    dim(),
                                    CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
  }

  /// Symmetric, pass 1: every chunk's row statistics and column partials (col_max / col_sum: each column's
  /// negatives over this problem's rows).
  cudaError_t forward_all()
  {
    for (std::size_t c0 = 0; c0 < p.n_q; c0 += w.chunk_rows)
    {
      CONTRASTIVE_CUDA_TRY(forward_chunk(c0, static_cast<int>(std::min(w.chunk_rows, p.n_q - c0))));
    }
    return cudaSuccess;
  }

  /// One process: each column's log-sum-exp and loss from its negatives and its positive (row j's).
  cudaError_t finish_columns_local()
  {
    finish_columns<><<<static_cast<unsigned>(std::min(1024, (a.n_k + threads - 1) / threads)), threads, 0, stream>>>(a);
    return cudaPeekAtLastError();
  }

  /// Symmetric, pass 2 (S_c recomputed unless one chunk holds every row); info_nce: forward and backward per chunk.
  cudaError_t backward_all(Element* dq)
  {
    const bool one_chunk = w.chunk_rows >= p.n_q;
    for (std::size_t c0 = 0; c0 < p.n_q; c0 += w.chunk_rows)
    {
      const int rows = static_cast<int>(std::min(w.chunk_rows, p.n_q - c0));
      if (!sym)
      {
        CONTRASTIVE_CUDA_TRY(forward_chunk(c0, rows));
      }
      else if (!one_chunk && !w.tiles) // the tile path recomputes S_c inside gradient_tiles
      {
        CONTRASTIVE_CUDA_TRY(logits_product(c0, rows));
      }
      CONTRASTIVE_CUDA_TRY(backward_chunk(c0, rows, dq));
    }
    return cudaSuccess;
  }

  /// dK rows (`rows` x dim float, unscaled) times loss_scale * s, rounded into dk; flags a non-finite value.
  cudaError_t store_dk(const float* acc, Element* dk, std::size_t rows)
  {
    store_rows<Element><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        acc, dim(), static_cast<const Element*>(nullptr), dk, scalars(), nullptr, flags() + 2);
    return cudaPeekAtLastError();
  }

  /// This problem's sums (row losses, column losses when symmetric, <dQ, Q>) and max logit, into sums().
  cudaError_t reduce_local()
  {
    void* tmp = base + w.cub;
    std::size_t bytes = w.cub_bytes;
    const int n_q = static_cast<int>(p.n_q);
    CONTRASTIVE_CUDA_TRY(detail::reduce_sum(tmp, bytes, a.row_loss, &sums()->row_loss, n_q, stream));
    if (sym)
    {
      bytes = w.cub_bytes;
      CONTRASTIVE_CUDA_TRY(detail::reduce_sum(tmp, bytes, a.col_loss, &sums()->col_loss, a.n_k, stream));
    }
    bytes = w.cub_bytes;
    CONTRASTIVE_CUDA_TRY(detail::reduce_sum(tmp, bytes, f(w.row_dot), &sums()->dlogs, n_q, stream));
    bytes = w.cub_bytes;
    return detail::reduce_max(tmp, bytes, a.row_max, &sums()->max_logit, n_q, stream);
  }
};
} // namespace chunked_detail

/// The device loss with algorithm::chunked (see the file comment). make_state, unscale_and_check and finish_step are
/// those of the other algorithms; forward_backward and step take a cuBLAS handle and chunk options.
template <class Element, class Temperature, class Scaler>
struct loss<Element, Temperature, Scaler, algorithm::chunked>
{
  using common = loss<Element, Temperature, Scaler, algorithm::fused>;
  using state_type = typename common::state_type;
  static constexpr bool sixteen_bit = !std::is_same_v<Element, float>;

  static status make_state(const Temperature& t, const Scaler& s, state_type& out)
  {
    return common::make_state(t, s, out);
  }

  /// The state to device memory in stream order, as a kernel argument (see device/loss.cuh).
  [[nodiscard]] static cudaError_t upload_state(const state_type& st, state_type* d_state, cudaStream_t stream = 0)
  {
    return common::upload_state(st, d_state, stream);
  }

  /// Bytes per chunk row of the chunk's buffers (S_c and G_c, or the tile path's G_c and partials), without dQ_c.
  static std::size_t chunk_bytes_per_row(const problem<Element>& p, bool tiles) noexcept
  {
    const std::size_t ld = (p.n_k + 31) / 32 * 32;
    return tiles ? chunked_detail::tile_bytes_per_row<Element>(ld)
                 : ld * (sizeof(float) + (sixteen_bit ? sizeof(Element) : 0));
  }

  /// The fixed default of earlier versions, now the floor of the default: S_c and G_c fill at most 384 MiB, and at
  /// least 256 rows (a multiple of 64, at most n_q rounded up).
  static std::size_t floor_rows_for(const problem<Element>& p, bool tiles) noexcept
  {
    constexpr std::size_t align = chunked_detail::row_align;
    const std::size_t rows = contrastive::detail::chunk_rows_for(
        chunk_options{}, p.n_q, chunk_bytes_per_row(p, tiles), align, chunked_detail::default_budget);
    const std::size_t all = (p.n_q + align - 1) / align * align;
    return std::max(rows, std::min(chunked_detail::default_min_rows, all));
  }

  /// Default rows per chunk (no chunk option) for `free_bytes` of free device memory: 4096 rows, fewer if their
  /// chunk buffers do not fit in 1/4 of what is free after the step's other workspace buffers, never fewer than
  /// floor_rows_for (free_bytes = 0, unknown, gives that floor), at most every row. A multiple of 64, at most n_q
  /// rounded up. See docs/performance.md ("Chunk size on the device").
  static std::size_t default_rows_for(const problem<Element>& p, bool tiles, std::size_t free_bytes) noexcept
  {
    namespace cd = chunked_detail;
    constexpr std::size_t align = cd::row_align;
    const std::size_t all = (p.n_q + align - 1) / align * align;
    const std::size_t floor = floor_rows_for(p, tiles);
    cd::layout fixed{};
    std::size_t cub = 1; // CUB's few KiB do not matter to the budget (and asking CUB would need a device)
    if (free_bytes == 0 || layout_for_rows(p, tiles, 0, cub, fixed) != cudaSuccess || free_bytes <= fixed.total)
    {
      return floor; // <= all
    }
    const std::size_t per_row = chunk_bytes_per_row(p, tiles) + p.dim * sizeof(float); // + the row's dQ_c
    const std::size_t fit = (free_bytes - fixed.total) / cd::free_divisor / per_row / align * align;
    return std::min(all, std::max(floor, std::min(fit, cd::default_max_rows)));
  }

  /// Rows per chunk for a problem and options (a multiple of 64, at most n_q rounded up). `rows` or `budget_bytes`
  /// set: from them (chunk_options); neither: default_rows_for at the device's free memory now (what a size query
  /// uses; no device or a failed query: the floor).
  static std::size_t chunk_rows_for(const problem<Element>& p, const chunk_options& o) noexcept
  {
    return chunk_rows_for(p, o, chunked_detail::use_tiles(p, o));
  }

  static std::size_t chunk_rows_for(const problem<Element>& p, const chunk_options& o, bool tiles) noexcept
  {
    return chunk_rows_for(p, o, tiles, is_default(o) ? chunked_detail::device_free_bytes() : 0);
  }

  static std::size_t
  chunk_rows_for(const problem<Element>& p, const chunk_options& o, bool tiles, std::size_t free_bytes) noexcept
  {
    if (is_default(o))
    {
      return default_rows_for(p, tiles, free_bytes);
    }
    return contrastive::detail::chunk_rows_for(
        o, p.n_q, chunk_bytes_per_row(p, tiles), chunked_detail::row_align, chunked_detail::default_budget);
  }

  /// No chunk size given: the default sizing applies.
  static constexpr bool is_default(const chunk_options& o) noexcept
  {
    return o.rows == 0 && o.budget_bytes == 0;
  }

  /// The workspace layout for `rows` per chunk (clamped to n_q and, on the tile path, to the tile grid's limit;
  /// 0 lays out everything but the chunk buffers). `cub_bytes`: the CUB size query's answer, 0 to ask it here.
  /// Refused with cudaErrorInvalidValue when a size overflows.
  static cudaError_t layout_for_rows(
      const problem<Element>& p, bool tiles, std::size_t rows, std::size_t& cub_bytes, chunked_detail::layout& w)
  {
    using contrastive::detail::checked_size;
    w.tiles = tiles;
    w.chunk_rows = std::min(rows, p.n_q);
    if (w.tiles) // the tile kernels' grid has one row of blocks per 128 chunk rows, at most 65535 rows
    {
      w.chunk_rows = std::min(w.chunk_rows, std::size_t(65535) * tile_detail::config::bm);
    }
    w.ld = (p.n_k + 31) / 32 * 32;
    constexpr std::size_t bm = tile_detail::config::bm;
    constexpr std::size_t bn = tile_detail::config::bn;
    const std::size_t row_tiles = w.tiles ? (w.chunk_rows + bm - 1) / bm : 0;
    const std::size_t col_tiles = w.tiles ? (p.n_k + bn - 1) / bn : 0;
    const checked_size f = sizeof(float);
    const checked_size bound =
        checked_size(64 * 256) + checked_size(5) * p.n_q * f + checked_size(4) * p.n_k * f +
        checked_size(w.chunk_rows) * w.ld * (f + checked_size(sixteen_bit ? sizeof(Element) : 0)) +
        (checked_size(w.chunk_rows) + p.n_k) * checked_size(p.dim) * f +
        (checked_size(w.chunk_rows) * col_tiles + checked_size(row_tiles) * p.n_k) * checked_size(sizeof(float2));
    if (!bound.ok())
    {
      return cudaErrorInvalidValue;
    }
    if (cub_bytes == 0)
    {
      const int n_max = static_cast<int>(std::max(p.n_q, p.n_k));
      CONTRASTIVE_CUDA_TRY(detail::reduction_bytes(n_max, cub_bytes));
    }
    w.cub_bytes = cub_bytes;
    const bool sym = p.obj == objective::symmetric;
    detail::carver c;
    w.row_lse = c.take(p.n_q * sizeof(float));
    w.row_loss = c.take(p.n_q * sizeof(float));
    w.row_max = c.take(p.n_q * sizeof(float));
    w.pos = c.take(p.n_q * sizeof(float));
    w.row_dot = c.take(p.n_q * sizeof(float));
    w.col_max = c.take(sym ? p.n_k * sizeof(float) : 0);
    w.col_sum = c.take(sym ? p.n_k * sizeof(float) : 0);
    w.col_lse = c.take(sym ? p.n_k * sizeof(float) : 0);
    w.col_loss = c.take(sym ? p.n_k * sizeof(float) : 0);
    w.logits = c.take(w.tiles ? 0 : w.chunk_rows * w.ld * sizeof(float));
    w.grad = c.take(sixteen_bit ? w.chunk_rows * w.ld * sizeof(Element) : 0);
    w.dq = c.take(w.chunk_rows * p.dim * sizeof(float));
    w.dk = c.take(p.n_k * p.dim * sizeof(float));
    w.sums = c.take(sizeof(kernels::step_sums));
    w.flags = c.take(3 * sizeof(int));
    w.scalars = c.take(sizeof(kernels::step_scalars));
    w.cub = c.take(w.cub_bytes);
    w.row_part = c.take(w.chunk_rows * col_tiles * sizeof(float2));
    w.col_part = c.take(sym ? row_tiles * p.n_k * sizeof(float2) : 0);
    w.total = c.offset;
    return cudaSuccess;
  }

  /// The workspace layout of a size query (chunk_rows_for; the default reads the device's free memory).
  static cudaError_t make_layout(const problem<Element>& p, const chunk_options& o, chunked_detail::layout& w)
  {
    const bool tiles = chunked_detail::use_tiles(p, o);
    std::size_t cub = 0;
    return layout_for_rows(p, tiles, chunk_rows_for(p, o, tiles), cub, w);
  }

  /// The same with the default sized for `free_bytes` of free memory (the distributed loss's sizing; tests).
  static cudaError_t
  make_layout(const problem<Element>& p, const chunk_options& o, std::size_t free_bytes, chunked_detail::layout& w)
  {
    const bool tiles = chunked_detail::use_tiles(p, o);
    std::size_t cub = 0;
    return layout_for_rows(p, tiles, chunk_rows_for(p, o, tiles, free_bytes), cub, w);
  }

  /// The layout of a step given `temp_bytes` of workspace. Options with a chunk size: make_layout's. The default:
  /// the most rows the default can choose (floor_rows_for to max(floor, 4096) in steps of 64, at most every row)
  /// whose layout fits in temp_bytes, so a step run with the bytes its size query wrote gets exactly the query's rows,
  /// whatever the free memory is now (the workspace itself is allocated in between). None fits: the floor's layout
  /// (which workspace_phase then refuses).
  static cudaError_t
  layout_to_fit(const problem<Element>& p, const chunk_options& o, std::size_t temp_bytes, chunked_detail::layout& w)
  {
    if (!is_default(o))
    {
      return make_layout(p, o, w);
    }
    const int n_max = static_cast<int>(std::max(p.n_q, p.n_k));
    std::size_t cub = 0;
    CONTRASTIVE_CUDA_TRY(detail::reduction_bytes(n_max, cub));
    return layout_to_fit(p, chunked_detail::use_tiles(p, o), temp_bytes, cub, w);
  }

  /// layout_to_fit's search for the default, given the tile decision and CUB's temporary bytes (no CUDA call).
  static cudaError_t layout_to_fit(
      const problem<Element>& p, bool tiles, std::size_t temp_bytes, std::size_t cub, chunked_detail::layout& w)
  {
    namespace cd = chunked_detail;
    constexpr std::size_t align = cd::row_align;
    const std::size_t all = (p.n_q + align - 1) / align * align;
    const std::size_t floor = floor_rows_for(p, tiles);
    // Every value default_rows_for can return, largest first: min(all, r) for r = max(floor, 4096) down to floor.
    for (std::size_t rows = std::max(floor, cd::default_max_rows); rows > floor; rows -= align)
    {
      if (layout_for_rows(p, tiles, std::min(rows, all), cub, w) == cudaSuccess && w.total <= temp_bytes)
      {
        return cudaSuccess;
      }
    }
    return layout_for_rows(p, tiles, floor, cub, w);
  }

  /// Why forward_backward and step refuse these arguments (cudaErrorInvalidValue), as a status naming the argument
  /// (host code, no CUDA call): device::loss::check's verdict, then the cuBLAS handle.
  static status check(
      const problem<Element>& p, const Element* dq, const Element* dk, const state_type* d_state, cublasHandle_t handle)
  {
    CONTRASTIVE_RETURN_IF_ERROR(check_problem(p, dq, dk, true, /*check_labels=*/false));
    if (d_state == nullptr || handle == nullptr)
    {
      return {errc::null_pointer,
              d_state == nullptr ? "d_state" : "handle",
              d_state == nullptr ? "null device state (make_state, then upload_state)" : "null cuBLAS handle"};
    }
    return detail::device_limits(p);
  }

  /// Steps 1-3 (forward, backward, record) at the state's tau and loss scale. A null d_temp writes the bytes needed.
  [[nodiscard]] static cudaError_t forward_backward(void* d_temp,
                                                    std::size_t& temp_bytes,
                                                    const problem<Element>& p,
                                                    Element* dq,
                                                    Element* dk,
                                                    state_type* d_state,
                                                    cublasHandle_t handle,
                                                    cudaStream_t stream = 0,
                                                    const chunk_options& opts = {})
  {
    namespace cd = chunked_detail;
    if (!check(p, dq, dk, d_state, handle).ok())
    {
      return cudaErrorInvalidValue;
    }
    // The size query sizes a default chunk from free memory; the step takes the rows its workspace holds (the same).
    cd::layout w{};
    CONTRASTIVE_CUDA_TRY(d_temp == nullptr ? make_layout(p, opts, w) : layout_to_fit(p, opts, temp_bytes, w));
    bool query = false;
    CONTRASTIVE_CUDA_TRY(detail::workspace_phase(d_temp, temp_bytes, w.total, query));
    if (query)
    {
      return cudaSuccess;
    }
    cd::handle_guard guard{handle};
    CONTRASTIVE_CUDA_TRY(cd::from_cublas(guard.enter(stream)));
    cd::runner<Element> run(p, w, d_temp, handle, stream, make_grad_coefficients(p.obj, p.n_q, p.n_k));
    CONTRASTIVE_CUDA_TRY(run.begin(d_state));
    if (run.sym)
    {
      CONTRASTIVE_CUDA_TRY(run.forward_all());
      CONTRASTIVE_CUDA_TRY(run.finish_columns_local());
    }
    CONTRASTIVE_CUDA_TRY(run.backward_all(dq));
    CONTRASTIVE_CUDA_TRY(run.store_dk(run.dk_accumulator(), dk, p.n_k));
    CONTRASTIVE_CUDA_TRY(run.reduce_local());
    kernels::finish_forward_backward<state_type><<<1, 1, 0, stream>>>(d_state,
                                                                      run.scalars(),
                                                                      run.sums(),
                                                                      run.flags(),
                                                                      static_cast<int>(p.n_q),
                                                                      static_cast<int>(p.n_k),
                                                                      run.sym ? 1 : 0,
                                                                      /*materialized=*/0);
    return cudaPeekAtLastError();
  }

  [[nodiscard]] static cudaError_t
  unscale_and_check(float* grads, std::size_t n, state_type* d_state, cudaStream_t stream = 0)
  {
    return common::unscale_and_check(grads, n, d_state, stream);
  }

  [[nodiscard]] static cudaError_t finish_step(state_type* d_state, cudaStream_t stream = 0)
  {
    return common::finish_step(d_state, stream);
  }

  /// A whole step: forward_backward then finish_step.
  [[nodiscard]] static cudaError_t step(void* d_temp,
                                        std::size_t& temp_bytes,
                                        const problem<Element>& p,
                                        Element* dq,
                                        Element* dk,
                                        state_type* d_state,
                                        cublasHandle_t handle,
                                        cudaStream_t stream = 0,
                                        const chunk_options& opts = {})
  {
    CONTRASTIVE_CUDA_TRY(forward_backward(d_temp, temp_bytes, p, dq, dk, d_state, handle, stream, opts));
    if (d_temp == nullptr)
    {
      return cudaSuccess;
    }
    return finish_step(d_state, stream);
  }
};
} // namespace device
} // namespace contrastive
