// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
// Helpers of the device tests: the skip without a device, checked CUDA calls, an owning device buffer.
#pragma once

#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace contrastive_test
{
inline std::string device_unavailable()
{
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess)
  {
    return std::string("no CUDA device (") + cudaGetErrorString(err) + "): device tests skipped";
  }
  return count == 0 ? "no CUDA device: device tests skipped" : "";
}

template <class T>
struct device_buffer
{
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit device_buffer(std::size_t count) : n(count)
  {
    if (cudaMalloc(&ptr, (count == 0 ? 1 : count) * sizeof(T)) != cudaSuccess)
    {
      ptr = nullptr;
    }
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer()
  {
    cudaFree(ptr);
  }
  cudaError_t upload(const std::vector<T>& v)
  {
    return cudaMemcpy(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  cudaError_t poison(unsigned char byte)
  {
    return cudaMemset(ptr, byte, n * sizeof(T));
  }
  std::vector<T> download() const
  {
    std::vector<T> v(n);
    cudaMemcpy(v.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
};
} // namespace contrastive_test

#define CONTRASTIVE_SKIP_WITHOUT_DEVICE()                                                                              \
  do                                                                                                                   \
  {                                                                                                                    \
    const std::string why = ::contrastive_test::device_unavailable();                                                  \
    if (!why.empty())                                                                                                  \
      GTEST_SKIP() << why;                                                                                             \
  } while (0)
