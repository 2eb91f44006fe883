// Compiles device::loss (device/loss.cuh) for every architecture in CMAKE_CUDA_ARCHITECTURES, so CI (no GPU) still
// proves these build: element types float, __half, __nv_bfloat16 x temperature policies fixed, learnable, clamped,
// scheduled, range_guard x scaler policies static_scale, dynamic x algorithms fused, materialized. Not instantiated
// here: temperature::freeze_then_learn (scheduled derives from it) and algorithm::chunked (device/chunked.cuh).

#include <contrastive/device/loss.cuh>

namespace cl = contrastive;

#define CONTRASTIVE_INSTANTIATE(T, TEMP, SCALER, ALGO)                                                                 \
  template struct cl::device::loss<T, cl::temperature::TEMP, cl::scaler::SCALER, cl::algorithm::ALGO>;

#define CONTRASTIVE_INSTANTIATE_ALGOS(T, TEMP, SCALER)                                                                 \
  CONTRASTIVE_INSTANTIATE(T, TEMP, SCALER, fused)                                                                      \
  CONTRASTIVE_INSTANTIATE(T, TEMP, SCALER, materialized)

#define CONTRASTIVE_INSTANTIATE_SCALERS(T, TEMP)                                                                       \
  CONTRASTIVE_INSTANTIATE_ALGOS(T, TEMP, static_scale)                                                                 \
  CONTRASTIVE_INSTANTIATE_ALGOS(T, TEMP, dynamic)

#define CONTRASTIVE_INSTANTIATE_TEMPERATURES(T)                                                                        \
  CONTRASTIVE_INSTANTIATE_SCALERS(T, fixed)                                                                            \
  CONTRASTIVE_INSTANTIATE_SCALERS(T, learnable)                                                                        \
  CONTRASTIVE_INSTANTIATE_SCALERS(T, clamped)                                                                          \
  CONTRASTIVE_INSTANTIATE_SCALERS(T, scheduled)                                                                        \
  CONTRASTIVE_INSTANTIATE_SCALERS(T, range_guard)

CONTRASTIVE_INSTANTIATE_TEMPERATURES(float)
CONTRASTIVE_INSTANTIATE_TEMPERATURES(__half)
CONTRASTIVE_INSTANTIATE_TEMPERATURES(__nv_bfloat16)
