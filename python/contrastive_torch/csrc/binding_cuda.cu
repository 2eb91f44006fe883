// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// PyTorch binding of the device path: one call runs the library's policy-free device call (device::core: forward and
// backward at the given logit scale and bias, loss scale 1) on CUDA tensors, on PyTorch's current stream, with
// PyTorch's cuBLAS handle and caching allocator (the workspace and the results are uint8 CUDA tensors). The logit
// scale and bias come as one-element float32 CUDA tensors; chunked and automatic read them on the device
// (device::device_scalars), fused and materialized read them once on the host. Otherwise nothing synchronizes: the
// loss, d loss / d log s (and, for SigLIP's sigmoid objective, d loss / d b), the max logit and the first non-finite
// site come back as 0-dim CUDA tensors viewing the step record in device memory.
#include <torch/extension.h>

#include "errors.hpp"
#include "problem_of.hpp"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <contrastive/device/chunked.cuh>
#include <contrastive/device/core.cuh>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
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

/// What one call runs: objective, logit scale s and logit bias b (sigmoid; undefined: 0) as one-element float32
/// tensors on the features' device, loss scale, and the chunked options.
struct call
{
  cl::objective obj;
  torch::Tensor scale;
  torch::Tensor bias;
  double loss_scale;
  std::int64_t chunk_rows;
  bool fused_tiles;
  std::int64_t memory_budget = 0; ///< automatic: the one chunk's budget in bytes (0: a quarter of free memory)
};

/// A one-element float32 tensor on `device` (the Python side prepares it so; checked here all the same).
void check_scalar(const torch::Tensor& t, const char* name, const torch::Device& device)
{
  if (!t.defined() || t.numel() != 1 || t.scalar_type() != torch::kFloat32 || t.device() != device)
  {
    throw std::invalid_argument(std::string("contrastive: ") + name +
                                ": expected a one-element float32 tensor on the features' device");
  }
}

/// {loss, dq, dk, d loss / d log s, max logit, first non-finite site (code), d loss / d b} of one device pass: the
/// library's policy-free device call (device::core), whose results stay in a uint8 CUDA tensor the returned scalars
/// view. dq and dk carry the loss scale; the record's derivatives do not.
template <class T, class Algorithm>
std::vector<torch::Tensor>
run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& labels, const call& c)
{
  using C = cl::device::core<T, Algorithm>;
  using values_type = typename C::values_type;
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  const auto bytes_u8 = torch::TensorOptions().dtype(torch::kUInt8).device(q.device());
  torch::Tensor values = torch::empty({static_cast<std::int64_t>(sizeof(values_type))}, bytes_u8);
  auto* d_values = static_cast<values_type*>(values.data_ptr());
  const cl::problem<T> p = contrastive_torch::problem_of<T>(q, k, labels, c.obj);
  torch::Tensor dq = torch::empty_like(q), dk = torch::empty_like(k);
  T* dq_p = reinterpret_cast<T*>(dq.data_ptr());
  T* dk_p = reinterpret_cast<T*>(dk.data_ptr());
  const float ls = static_cast<float>(c.loss_scale);
  check_scalar(c.scale, "logit_scale", q.device());
  if (c.bias.defined())
  {
    check_scalar(c.bias, "logit_bias", q.device());
  }

  std::size_t bytes = 0;
  const auto pass = [&](void* temp) -> cl::status
  {
    if constexpr (C::needs_handle)
    {
      // chunked and automatic read s and b on the device (no synchronisation; a refused value is reported by the
      // step's record).
      const std::size_t budget =
          std::is_same_v<Algorithm, cl::algorithm::automatic> ? static_cast<std::size_t>(c.memory_budget) : 0;
      const cl::chunk_options o{static_cast<std::size_t>(c.chunk_rows), budget, c.fused_tiles};
      const cl::device::device_scalars from{c.scale.data_ptr<float>(),
                                            c.bias.defined() ? c.bias.data_ptr<float>() : nullptr};
      return C::step(temp, bytes, p, from, ls, dq_p, dk_p, d_values, at::cuda::getCurrentCUDABlasHandle(), stream, o);
    }
    else
    {
      // fused and materialized take host numbers: one read of each (a synchronisation).
      const float s = c.scale.item<float>();
      const float b = c.bias.defined() ? c.bias.item<float>() : 0.0f;
      return C::step(temp, bytes, p, s, b, ls, dq_p, dk_p, d_values, stream);
    }
  };
  check(pass(nullptr));
  torch::Tensor work = torch::empty({static_cast<std::int64_t>(bytes)}, bytes_u8);
  check(pass(work.data_ptr()));

  // The record's fields, as views (the caching allocator keeps `values` alive while a view lives).
  const values_type layout{};
  const char* base = reinterpret_cast<const char*>(&layout);
  const cl::step_record& r = layout.record;
  auto at = [&](const void* member)
  {
    return static_cast<std::ptrdiff_t>(reinterpret_cast<const char*>(member) - base);
  };
  return {field(values, at(&r.loss), 4, torch::kFloat32),
          dq,
          dk,
          field(values, at(&r.grad_logit_scale), 4, torch::kFloat32),
          field(values, at(&r.max_logit), 4, torch::kFloat32),
          field(values, at(&r.first_nonfinite), 4, torch::kInt32),
          field(values, at(&r.grad_logit_bias), 4, torch::kFloat32)};
}

/// run<T, Algorithm> for the algorithm named `algorithm` (the names come from cl::algorithm::all, as the host
/// binding's, and 'automatic': device::loss<..., algorithm::automatic>, what algorithm=None runs on CUDA tensors).
template <class T>
std::vector<torch::Tensor> by_algorithm(const std::string& algorithm,
                                        const torch::Tensor& q,
                                        const torch::Tensor& k,
                                        const torch::Tensor& labels,
                                        const call& c)
{
  std::vector<torch::Tensor> out;
  if (algorithm == cl::algorithm::automatic::name) // the device's automatic: chunked, the logits kept where they fit
  {
    return run<T, cl::algorithm::automatic>(q, k, labels, c);
  }
  const bool known = cl::algorithm::dispatch(algorithm.c_str(),
                                             [&](auto tag)
                                             {
                                               out = run<T, decltype(tag)>(q, k, labels, c);
                                             });
  if (!known)
  {
    throw std::invalid_argument("contrastive: algorithm: '" + algorithm + "' is not one of " + cl::algorithm::names());
  }
  return out;
}

std::vector<torch::Tensor> by_dtype(const std::string& algorithm,
                                    const torch::Tensor& q,
                                    const torch::Tensor& k,
                                    const c10::optional<torch::Tensor>& labels,
                                    const call& c)
{
  const torch::Tensor lab = labels.has_value() ? *labels : torch::Tensor();
  switch (q.scalar_type())
  {
  case torch::kFloat32:
    return by_algorithm<float>(algorithm, q, k, lab, c);
  case torch::kBFloat16:
    return by_algorithm<__nv_bfloat16>(algorithm, q, k, lab, c);
  case torch::kFloat16:
    return by_algorithm<__half>(algorithm, q, k, lab, c);
  default:
    throw std::invalid_argument("contrastive: features: dtype is not float32, bfloat16 or float16");
  }
}

/// {loss, dq, dk, d loss / d log s, max logit, first non-finite site (code)}; dq and dk at `loss_scale`.
std::vector<torch::Tensor> step(const torch::Tensor& q,
                                const torch::Tensor& k,
                                const torch::Tensor& scale,
                                const c10::optional<torch::Tensor>& labels,
                                bool symmetric,
                                const std::string& algorithm,
                                std::int64_t chunk_rows,
                                bool fused_tiles,
                                double loss_scale,
                                std::int64_t memory_budget)
{
  const cl::objective obj = symmetric ? cl::objective::symmetric : cl::objective::info_nce;
  std::vector<torch::Tensor> out = by_dtype(
      algorithm,
      q,
      k,
      labels,
      call{obj, scale, torch::Tensor(), loss_scale, chunk_rows, fused_tiles, memory_budget < 0 ? 0 : memory_budget});
  out.pop_back(); // d loss / d b: the softmax objectives have none
  return out;
}

/// SigLIP's sigmoid objective (z = scale <q, k> + bias; algorithm::chunked, the one device algorithm that runs it):
/// {loss, dq, dk, d loss / d log s, max logit (of z), first non-finite site (code), d loss / d b}; dq and dk at
/// `loss_scale`.
std::vector<torch::Tensor> sigmoid_step(const torch::Tensor& q,
                                        const torch::Tensor& k,
                                        const torch::Tensor& scale,
                                        const c10::optional<torch::Tensor>& bias,
                                        const c10::optional<torch::Tensor>& labels,
                                        std::int64_t chunk_rows,
                                        double loss_scale)
{
  const torch::Tensor b = bias.has_value() ? *bias : torch::Tensor();
  return by_dtype("chunked", q, k, labels, call{cl::objective::sigmoid, scale, b, loss_scale, chunk_rows, false});
}
} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
  contrastive_torch::register_errors();
  namespace py = pybind11;
  m.def("step",
        &step,
        "One device pass (forward and backward; dq, dk at loss_scale) on CUDA tensors",
        py::arg("q"),
        py::arg("k"),
        py::arg("scale"),
        py::arg("labels"),
        py::arg("symmetric"),
        py::arg("algorithm"),
        py::arg("chunk_rows"),
        py::arg("fused_tiles"),
        py::arg("loss_scale") = 1.0,
        py::arg("memory_budget") = 0);
  m.def("sigmoid_step",
        &sigmoid_step,
        "One device pass of SigLIP's sigmoid loss (algorithm::chunked; forward and backward, dq, dk at loss_scale) on "
        "CUDA tensors",
        py::arg("q"),
        py::arg("k"),
        py::arg("scale"),
        py::arg("bias"),
        py::arg("labels"),
        py::arg("chunk_rows"),
        py::arg("loss_scale") = 1.0);
}
