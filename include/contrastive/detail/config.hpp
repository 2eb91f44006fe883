// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Execution-space annotations shared by every header that runs "anywhere".
///
/// Under a CUDA compiler `CONTRASTIVE_HOST_DEVICE` expands to `__host__ __device__`, under a plain C++ compiler to
/// nothing, so the same numeric code (element traits, online log-sum-exp, policies, per-tile math) serves g++ and nvcc.

#if defined(__CUDACC__)
#define CONTRASTIVE_HOST_DEVICE __host__ __device__
#else
#define CONTRASTIVE_HOST_DEVICE
#endif

#if defined(__CUDA_ARCH__)
#define CONTRASTIVE_IN_DEVICE_CODE 1
#else
#define CONTRASTIVE_IN_DEVICE_CODE 0
#endif

#if defined(_MSC_VER) && !defined(__CUDACC__)
#define CONTRASTIVE_FORCEINLINE __forceinline
#elif defined(__CUDACC__)
#define CONTRASTIVE_FORCEINLINE __forceinline__
#else
#define CONTRASTIVE_FORCEINLINE inline __attribute__((always_inline))
#endif

// Keeps a function out of line: the host GEMM's entry points (host/gemm.hpp, host/builtin_gemm.hpp) are called from
// every objective's passes, and inlined they would compile their micro-kernel once per caller.
#if defined(_MSC_VER) && !defined(__CUDACC__)
#define CONTRASTIVE_NOINLINE __declspec(noinline)
#elif defined(__CUDACC__)
#define CONTRASTIVE_NOINLINE __noinline__
#else
#define CONTRASTIVE_NOINLINE __attribute__((noinline))
#endif

#if __cplusplus < 201703L && !defined(_MSVC_LANG)
#error "contrastive requires C++17 or newer"
#endif

#define CONTRASTIVE_VERSION_MAJOR 0
#define CONTRASTIVE_VERSION_MINOR 1
#define CONTRASTIVE_VERSION_PATCH 0
