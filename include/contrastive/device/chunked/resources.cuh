// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What the chunked device step runs on (device/chunked.cuh describes the algorithm): its workspace layout, the
/// free-memory and tile-path probes that size and choose it, and the cuBLAS handle guard. Internal to the chunked
/// loss and the NCCL loss (distributed/nccl.cuh), beside device/chunked/runner.cuh.

#include <contrastive/device/logits_tile.cuh>
#include <contrastive/objectives/objectives.hpp>
#include <contrastive/problem.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace contrastive
{
namespace device
{
namespace chunked_phases
{
/// Sub-buffers of the chunked workspace (byte offsets, 256-byte aligned).
struct layout
{
  std::size_t row_lse, row_loss, row_max, pos, row_dot, row_bias, col_max, col_sum, col_lse, col_loss, logits, grad, dq,
      dk, sums, flags, scalars, cub, row_part, col_part, total;
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
      cudaFuncGetAttributes(&fa, logits_tile::tile_kernel<__nv_bfloat16, logits_tile::statistics_epilogue>) !=
          cudaSuccess)
  {
    (void)cudaGetLastError();
    return false;
  }
  return major >= 8 && fa.ptxVersion >= 80 && fa.binaryVersion >= 80;
}

/// chunk_options::fused_tiles in effect for this problem (see there; the sigmoid objective runs on cuBLAS only).
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
    return o.fused_tiles && objectives::traits_of(p).softmax && p.dim % 8 == 0 && aligned(p.q) && aligned(p.k) &&
           device_runs_tiles();
  }
}

/// Bytes per chunk row of the tile path's buffers: G_c in T, one row partial per column tile, and (amortised over a
/// row tile) one column partial per column.
template <class Element>
constexpr std::size_t tile_bytes_per_row(std::size_t ld) noexcept
{
  const std::size_t col_tiles = (ld + logits_tile::config::bn - 1) / logits_tile::config::bn;
  return ld * sizeof(Element) + col_tiles * sizeof(float2) +
         (ld * sizeof(float2) + logits_tile::config::bm - 1) / logits_tile::config::bm;
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
} // namespace chunked_phases
} // namespace device
} // namespace contrastive
