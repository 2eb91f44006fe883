// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// PyTorch binding of the device path: one call runs the library's device step (forward and backward at loss scale 1)
// on CUDA tensors, on PyTorch's current stream, with PyTorch's cuBLAS handle and caching allocator (the workspace
// and the policy state are uint8 CUDA tensors). Nothing synchronizes: the loss, d loss / d log s (and, for SigLIP's
// sigmoid objective, d loss / d b), the max logit and the first non-finite site come back as 0-dim CUDA tensors
// viewing the step record in device memory.
#include <torch/extension.h>

#include "errors.hpp"
#include "problem_of.hpp"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <contrastive/device/chunked.cuh>
#include <contrastive/device/loss.cuh>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace cl = contrastive;

namespace
{
/// Raises a failed status of the library (the argument it names, or the CUDA/cuBLAS call with its own code).
void check(const cl::status& st)
{
  if (!st.ok())
  {
    contrastive_torch::raise(st);
  }
}

/// A 0-dim tensor of `dtype` viewing `bytes` bytes of `state` at `offset`.
torch::Tensor field(const torch::Tensor& state, std::ptrdiff_t offset, std::int64_t bytes, torch::Dtype dtype)
{
  return state.narrow(0, offset, bytes).view(dtype).reshape({});
}

/// {loss, dq, dk, d loss / d log s, max logit, first non-finite site (code), d loss / d b} of one device step of
/// objective `obj` at logit scale `scale` (and, sigmoid, logit bias `bias`), loss scale 1.
template <class T, class Algorithm>
std::vector<torch::Tensor> run(const torch::Tensor& q,
                               const torch::Tensor& k,
                               double scale,
                               double bias,
                               const torch::Tensor& labels,
                               cl::objective obj,
                               std::int64_t chunk_rows,
                               bool fused_tiles)
{
  using L = cl::device::loss<T, cl::temperature::fixed, cl::scaler::static_scale, Algorithm>;
  using state_type = typename L::state_type;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  state_type st;
  const cl::status made = L::make_state(cl::temperature::fixed(static_cast<float>(1.0 / scale)),
                                        cl::scaler::static_scale(1.0f),
                                        cl::logit_bias::fixed(static_cast<float>(bias)),
                                        st);
  if (!made.ok())
  {
    contrastive_torch::raise(made);
  }
  const auto bytes_u8 = torch::TensorOptions().dtype(torch::kUInt8).device(q.device());
  torch::Tensor state = torch::empty({static_cast<std::int64_t>(sizeof(state_type))}, bytes_u8);
  auto* d_state = static_cast<state_type*>(state.data_ptr());
  // The state travels as a kernel argument: no pageable copy (which the driver may stage by waiting on the stream),
  // and capturable in a graph; `st` may go out of scope once the call returns.
  check(cl::detail::cuda_status(L::upload_state(st, d_state, stream), "upload_state"));

  const cl::problem<T> p = contrastive_torch::problem_of<T>(q, k, labels, obj);
  torch::Tensor dq = torch::empty_like(q), dk = torch::empty_like(k);
  T* dq_p = reinterpret_cast<T*>(dq.data_ptr());
  T* dk_p = reinterpret_cast<T*>(dk.data_ptr());

  std::size_t bytes = 0;
  torch::Tensor work;
  if constexpr (std::is_same_v<Algorithm, cl::algorithm::chunked>)
  {
    const cl::chunk_options o{static_cast<std::size_t>(chunk_rows), 0, fused_tiles};
    const cublasHandle_t h = at::cuda::getCurrentCUDABlasHandle();
    check(L::forward_backward_status(nullptr, bytes, p, dq_p, dk_p, d_state, h, stream, o));
    work = torch::empty({static_cast<std::int64_t>(bytes)}, bytes_u8);
    check(L::forward_backward_status(work.data_ptr(), bytes, p, dq_p, dk_p, d_state, h, stream, o));
  }
  else
  {
    check(L::forward_backward_status(nullptr, bytes, p, dq_p, dk_p, d_state, stream));
    work = torch::empty({static_cast<std::int64_t>(bytes)}, bytes_u8);
    check(L::forward_backward_status(work.data_ptr(), bytes, p, dq_p, dk_p, d_state, stream));
  }

  // The record's fields, as views (the caching allocator keeps `state` alive while a view lives).
  const char* base = reinterpret_cast<const char*>(&st);
  const std::ptrdiff_t rec = reinterpret_cast<const char*>(&st.record) - base;
  const cl::step_record& r = st.record;
  auto at = [&](const void* member)
  {
    return rec + (reinterpret_cast<const char*>(member) - reinterpret_cast<const char*>(&r));
  };
  return {field(state, at(&r.loss), 4, torch::kFloat32),
          dq,
          dk,
          field(state, at(&r.grad_logit_scale), 4, torch::kFloat32),
          field(state, at(&r.max_logit), 4, torch::kFloat32),
          field(state, at(&r.first_nonfinite), 4, torch::kInt32),
          field(state, at(&r.grad_logit_bias), 4, torch::kFloat32)};
}

template <class T>
std::vector<torch::Tensor> by_algorithm(const std::string& algorithm,
                                        const torch::Tensor& q,
                                        const torch::Tensor& k,
                                        double scale,
                                        double bias,
                                        const torch::Tensor& labels,
                                        cl::objective obj,
                                        std::int64_t chunk_rows,
                                        bool fused_tiles)
{
  if (algorithm == "chunked")
  {
    return run<T, cl::algorithm::chunked>(q, k, scale, bias, labels, obj, chunk_rows, fused_tiles);
  }
  if (algorithm == "fused")
  {
    return run<T, cl::algorithm::fused>(q, k, scale, bias, labels, obj, chunk_rows, fused_tiles);
  }
  if (algorithm == "materialized")
  {
    return run<T, cl::algorithm::materialized>(q, k, scale, bias, labels, obj, chunk_rows, fused_tiles);
  }
  throw std::invalid_argument("contrastive: algorithm: '" + algorithm +
                              "' is not one of 'fused', 'materialized', 'chunked'");
}

std::vector<torch::Tensor> by_dtype(const std::string& algorithm,
                                    const torch::Tensor& q,
                                    const torch::Tensor& k,
                                    double scale,
                                    double bias,
                                    const c10::optional<torch::Tensor>& labels,
                                    cl::objective obj,
                                    std::int64_t chunk_rows,
                                    bool fused_tiles)
{
  const torch::Tensor lab = labels.has_value() ? *labels : torch::Tensor();
  switch (q.scalar_type())
  {
  case torch::kFloat32:
    return by_algorithm<float>(algorithm, q, k, scale, bias, lab, obj, chunk_rows, fused_tiles);
  case torch::kBFloat16:
    return by_algorithm<__nv_bfloat16>(algorithm, q, k, scale, bias, lab, obj, chunk_rows, fused_tiles);
  case torch::kFloat16:
    return by_algorithm<__half>(algorithm, q, k, scale, bias, lab, obj, chunk_rows, fused_tiles);
  default:
    throw std::invalid_argument("contrastive: features: dtype is not float32, bfloat16 or float16");
  }
}

/// {loss, dq, dk, d loss / d log s, max logit, first non-finite site (code)} at loss scale 1.
std::vector<torch::Tensor> step(const torch::Tensor& q,
                                const torch::Tensor& k,
                                double scale,
                                const c10::optional<torch::Tensor>& labels,
                                bool symmetric,
                                const std::string& algorithm,
                                std::int64_t chunk_rows,
                                bool fused_tiles)
{
  std::vector<torch::Tensor> out = by_dtype(algorithm,
                                            q,
                                            k,
                                            scale,
                                            0.0,
                                            labels,
                                            symmetric ? cl::objective::symmetric : cl::objective::info_nce,
                                            chunk_rows,
                                            fused_tiles);
  out.pop_back(); // d loss / d b: the softmax objectives have none
  return out;
}

/// SigLIP's sigmoid objective (z = scale <q, k> + bias; algorithm::chunked, the one device algorithm that runs it):
/// {loss, dq, dk, d loss / d log s, max logit (of z), first non-finite site (code), d loss / d b} at loss scale 1.
std::vector<torch::Tensor> sigmoid_step(const torch::Tensor& q,
                                        const torch::Tensor& k,
                                        double scale,
                                        double bias,
                                        const c10::optional<torch::Tensor>& labels,
                                        std::int64_t chunk_rows)
{
  return by_dtype("chunked", q, k, scale, bias, labels, cl::objective::sigmoid, chunk_rows, false);
}
} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
  contrastive_torch::register_errors();
  m.def("step", &step, "One device step (forward and backward at loss scale 1) on CUDA tensors");
  m.def("sigmoid_step",
        &sigmoid_step,
        "One device step of SigLIP's sigmoid loss (algorithm::chunked; forward and backward at loss scale 1) on CUDA "
        "tensors");
}
