// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// A CUDA runtime result as a status (errc::cuda_error naming the call, with CUDA's name, text and code): for the
/// status-returning device calls and the NCCL communicator. Only CUDA translation units include this file.

#include <contrastive/status.hpp>

#include <string>

#include <cuda_runtime.h>

namespace contrastive
{
namespace detail
{
/// cudaSuccess: an ok status; otherwise errc::cuda_error with argument `what` (the call that failed), the reason
/// "<cudaErrorName>: <text>" (message(): "<what>: <cudaErrorName>: <text>") and native() = {cuda, e}.
inline status cuda_status(cudaError_t e, const char* what)
{
  if (e == cudaSuccess)
  {
    return {};
  }
  return {errc::cuda_error,
          what,
          std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e),
          {native_api::cuda, static_cast<int>(e)}};
}
} // namespace detail
} // namespace contrastive
