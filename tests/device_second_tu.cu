// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
// A second translation unit that includes the same device headers as the test beside it and instantiates the same
// kernels: the executable links only if every kernel defined in a header has one definition across translation units
// (a non-template __global__ function in a header would be defined twice).
#include <contrastive/device/chunked.cuh>
#if defined(CONTRASTIVE_TEST_NCCL)
#include <contrastive/distributed/nccl.cuh>
#endif

#include <cstddef>

namespace contrastive_test
{
std::size_t second_tu_workspace(cublasHandle_t h)
{
  namespace cl = contrastive;
  using L =
      cl::device::loss<__nv_bfloat16, cl::temperature::learnable, cl::scaler::static_scale, cl::algorithm::chunked>;
  cl::problem<__nv_bfloat16> p{};
  std::size_t bytes = 0;
  // Never called with a GPU here; instantiating the call instantiates every chunked kernel in this unit too.
  (void)L::step(nullptr, bytes, p, nullptr, nullptr, nullptr, h);
#if defined(CONTRASTIVE_TEST_NCCL)
  cl::distributed::device_loss<__nv_bfloat16, cl::temperature::learnable, cl::scaler::static_scale> d(
      cl::distributed::comm::nccl(nullptr), h);
  (void)d.step(p, nullptr, nullptr, nullptr);
#endif
  return bytes;
}
} // namespace contrastive_test
