// Compiles the device API for every element type x temperature policy x scaler policy x algorithm the host path
// supports, for every architecture in CMAKE_CUDA_ARCHITECTURES, so CI (no GPU) still proves the whole product builds.

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
