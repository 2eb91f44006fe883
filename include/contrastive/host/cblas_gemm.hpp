// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The host GEMM backend on a CBLAS `cblas_sgemm` (gemm::cblas). Optional: include this header only if you link a
/// CBLAS (OpenBLAS is the documented one: Debian's libopenblas-dev; CMake: `contrastive::cblas`).
///
/// Operands stay row-major float: float inputs are used in place (no copy at all), 16-bit inputs are converted once
/// per call (keys) or per row block (queries). Each product is one sgemm on a tile; the loss calls them from its own
/// workers, so run the BLAS single-threaded (OPENBLAS_NUM_THREADS=1 or `cblas_single_threaded()`), or give the loss
/// one thread and let the BLAS parallelise.

#include <contrastive/host/builtin_gemm.hpp>

#include <cblas.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <thread>
#include <type_traits>
#include <vector>

/// OpenBLAS's thread-count setter, declared weak: null unless the linked CBLAS is OpenBLAS (cblas_single_threaded).
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace contrastive
{
namespace host
{
/// Makes OpenBLAS single-threaded when it is the linked CBLAS (a no-op for other libraries). Affects the whole
/// process: call it when the loss's own threads should do the parallel work.
inline void cblas_single_threaded() noexcept
{
  if (openblas_set_num_threads != nullptr)
  {
    openblas_set_num_threads(1);
  }
}

template <>
struct gemm_backend_available<gemm::cblas> : std::true_type
{
};

/// The CBLAS backend: each product one cblas_sgemm on row-major float operands (see the file comment).
template <class T>
struct gemm_backend<gemm::cblas, T>
{
  static constexpr bool is_float = std::is_same_v<T, float>; ///< float operands are used in place, never copied

  gemm_shape sh;             ///< the shape `prepare` was given
  const float* qf = nullptr; ///< row-major float queries (float: the caller's q; 16-bit materialized: q_copy)
  const float* kf = nullptr; ///< row-major float keys (float: the caller's k; 16-bit: k_copy)
  const T* q = nullptr;      ///< the caller's queries, in the element type

  /// 16-bit: K converted to float by `prepare` (the row-major keys kf points to); empty for float.
  std::vector<float> k_copy, q_copy; ///< q_copy: 16-bit materialized, Q converted to float by `prepare`; else empty

  /// The largest dim the backend can represent: cblas_sgemm takes int dimensions and leading dimensions, and dim is
  /// one of them (and, rounded up to the kernel's NR, the accumulators' leading dimension). Rows and columns of one
  /// product are at most a row block or key tile. Larger problems are refused (size_overflow "dim") before any call,
  /// instead of an sgemm that rejects its arguments and leaves the tile as it was.
  static constexpr std::size_t max_dim =
      static_cast<std::size_t>(std::numeric_limits<int>::max()) / kernel_nr * kernel_nr;

  /// Workers that may call cblas_sgemm at once: the cores. A CBLAS keeps per-thread work buffers (OpenBLAS: a table
  /// of 2 x its build's thread count, tens of MiB each), and a caller that finds none free waits for one; a loss
  /// with thousands of threads made ~60 callers retry forever when memory was short. More callers than cores are no
  /// faster, so the loss runs min(threads, cores) workers with this backend.
  static unsigned max_workers() noexcept
  {
    const unsigned cores = std::thread::hardware_concurrency();
    return cores == 0 ? 1 : cores;
  }

  /// Floats held for the operands: none for float, else K (and, materialized, Q) converted to float.
  static detail::checked_size held_floats(const gemm_shape& s, bool materialized) noexcept
  {
    if (is_float)
    {
      return detail::checked_size(0);
    }
    const detail::checked_size keys = detail::checked_size(s.n_k) * s.d;
    return materialized ? keys + detail::checked_size(s.n_q) * s.d : keys;
  }
  /// Floats per worker: none for float, else one query block (block_m x d) converted to float.
  static detail::checked_size worker_floats(const gemm_shape& s, bool) noexcept
  {
    return is_float ? detail::checked_size(0) : detail::checked_size(block_m) * s.d;
  }
  /// Sizes a worker's scratch: ws.qa holds the converted query block (16-bit only); ws.qb is not used.
  static void size_worker(const gemm_shape& s, worker_scratch& ws, bool)
  {
    ws.qa.resize(is_float ? 0 : block_m * s.d);
    std::vector<float>().swap(ws.qb);
    std::vector<float>().swap(ws.ga); // G goes to the BLAS from ws.tile: no packed copies
    std::vector<float>().swap(ws.gt);
  }
  /// Whether the fused backward may accumulate in the caller's dq/dk: for float, at any dim.
  static constexpr bool in_place_ok(std::size_t, std::size_t) noexcept
  {
    return is_float;
  }

  /// Takes this call's operands: float uses q and k in place; 16-bit converts K (and, materialized, Q) to float on
  /// `workers` workers of `pool`.
  void prepare(thread_pool& pool, unsigned workers, const gemm_shape& s, const T* q_in, const T* k, bool materialized)
  {
    sh = s;
    q = q_in;
    if constexpr (is_float)
    {
      qf = q_in;
      kf = k;
    }
    else
    {
      k_copy.resize(s.n_k * s.d);
      convert(pool, workers, k, s.n_k * s.d, k_copy.data());
      kf = k_copy.data();
      if (materialized)
      {
        q_copy.resize(s.n_q * s.d);
        convert(pool, workers, q_in, s.n_q * s.d, q_copy.data());
        qf = q_copy.data();
      }
      else
      {
        std::vector<float>().swap(q_copy);
        qf = nullptr;
      }
    }
  }

  /// Frees the float copies, memory included.
  void release() noexcept
  {
    std::vector<float>().swap(k_copy);
    std::vector<float>().swap(q_copy);
  }

  /// Bytes held by the float copies (their capacity).
  std::size_t bytes() const noexcept
  {
    return (k_copy.capacity() + q_copy.capacity()) * sizeof(float);
  }

  /// Row-major float rows [i0, i0 + rows) of Q: the caller's (float) or converted into ws.qa.
  void query_block(std::size_t i0, std::size_t rows, worker_scratch& ws, bool) const
  {
    if constexpr (!is_float)
    {
      const T* src = q + i0 * sh.d;
      for (std::size_t e = 0; e < rows * sh.d; ++e)
      {
        ws.qa[e] = element_traits<T>::to_float(src[e]);
      }
    }
    (void)i0;
    (void)rows; // engine_state::query_block records them in ws.block_i0 / ws.block_rows
  }

  /// ws.tile (rows x cols, ld block_n) = Q_blk K[j0 : j0 + cols]^T: the logits, unscaled.
  void dot_tile(std::size_t j0, std::size_t rows, std::size_t cols, worker_scratch& ws) const noexcept
  {
    cblas_sgemm(CblasRowMajor,
                CblasNoTrans,
                CblasTrans,
                static_cast<int>(rows),
                static_cast<int>(cols),
                static_cast<int>(sh.d),
                1.0f,
                block(ws),
                static_cast<int>(sh.d),
                kf + j0 * sh.d,
                static_cast<int>(sh.d),
                0.0f,
                ws.tile.data(),
                static_cast<int>(block_n));
  }

  /// Nothing to pack: the products read the float keys in place.
  void key_tiles(std::size_t, std::size_t, worker_scratch&, bool) const noexcept {}

  /// acc (rows x d, leading dimension ld) += G K[j0 : j0 + cols], G in ws.tile.
  void dq_product(std::size_t j0,
                  std::size_t rows,
                  std::size_t cols,
                  worker_scratch& ws,
                  float* acc,
                  std::size_t ld,
                  std::size_t) const noexcept
  {
    cblas_sgemm(CblasRowMajor,
                CblasNoTrans,
                CblasNoTrans,
                static_cast<int>(rows),
                static_cast<int>(sh.d),
                static_cast<int>(cols),
                1.0f,
                ws.tile.data(),
                static_cast<int>(block_n),
                kf + j0 * sh.d,
                static_cast<int>(sh.d),
                1.0f,
                acc,
                static_cast<int>(ld));
  }

  /// acc (cols x d, leading dimension ld) += G^T Q_blk over the block's ws.block_rows rows, G in ws.tile (fused).
  void dk_block(std::size_t cols, worker_scratch& ws, float* acc, std::size_t ld, std::size_t, bool) const noexcept
  {
    cblas_sgemm(CblasRowMajor,
                CblasTrans,
                CblasNoTrans,
                static_cast<int>(cols),
                static_cast<int>(sh.d),
                static_cast<int>(ws.block_rows),
                1.0f,
                ws.tile.data(),
                static_cast<int>(block_n),
                block(ws),
                static_cast<int>(sh.d),
                1.0f,
                acc,
                static_cast<int>(ld));
  }

  /// acc (cols x d, leading dimension dp) += dA^T Q[i0 : i0 + rows], rows the block at i0, dA in ws.tile
  /// (materialized).
  void dk_queries(std::size_t i0, std::size_t cols, worker_scratch& ws, float* acc, bool) const noexcept
  {
    const std::size_t rows = std::min(block_m, sh.n_q - i0);
    cblas_sgemm(CblasRowMajor,
                CblasTrans,
                CblasNoTrans,
                static_cast<int>(cols),
                static_cast<int>(sh.d),
                static_cast<int>(rows),
                1.0f,
                ws.tile.data(),
                static_cast<int>(block_n),
                qf + i0 * sh.d,
                static_cast<int>(sh.d),
                1.0f,
                acc,
                static_cast<int>(sh.dp));
  }

private:
  static void convert(thread_pool& pool, unsigned workers, const T* src, std::size_t n, float* dst)
  {
    constexpr std::size_t chunk = 1 << 16;
    parallel_for(pool,
                 (n + chunk - 1) / chunk,
                 workers,
                 [&](std::size_t t, unsigned)
                 {
                   const std::size_t end = std::min(n, (t + 1) * chunk);
                   for (std::size_t e = t * chunk; e < end; ++e)
                   {
                     dst[e] = element_traits<T>::to_float(src[e]);
                   }
                 });
  }

  const float* block(const worker_scratch& ws) const noexcept
  {
    if constexpr (is_float)
    {
      return q + ws.block_i0 * sh.d;
    }
    else
    {
      return ws.qa.data();
    }
  }
};
} // namespace host
} // namespace contrastive
