// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// The library's problem viewing PyTorch tensors, shared by the host and the CUDA binding. The Python side has checked
// shapes, dtypes, devices and contiguity; labels are int32 (or undefined: the diagonal); group ids int64 CPU tensors
// (or undefined: none). The view checks again what it reads through raw pointers (the tensors' layout and device, no
// value): the operators (torch.ops.contrastive_torch.*) can be called without the Python checks, and a short or
// strided tensor would otherwise be read past its end or in the wrong order, one on another device at an address
// that is not there.
#pragma once

#include <torch/extension.h>

#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>

#include "errors.hpp"

#include <cstddef>
#include <cstdint>
#include <string>

namespace contrastive_torch
{
namespace detail
{
inline std::string shape_of(const torch::Tensor& t)
{
  std::string s = "(";
  for (std::int64_t d = 0; d < t.dim(); ++d)
  {
    s += (d ? ", " : "") + std::to_string(t.size(d)) + (t.dim() == 1 ? "," : "");
  }
  return s + ")";
}

/// invalid_argument naming `name`, raised as every refusal of the bindings is (errors.hpp).
[[noreturn]] inline void refuse(const char* name, const std::string& what)
{
  raise(contrastive::status{contrastive::errc::invalid_argument, name, what});
}

/// A 1-D contiguous tensor of `n` entries of `dtype` (labels: int32; group ids: int64).
inline void check_ids(const char* name, const torch::Tensor& t, std::int64_t n, c10::ScalarType dtype, const char* kind)
{
  if (t.scalar_type() != dtype)
  {
    refuse(name, std::string("expected ") + kind + ", got " + std::string(c10::toString(t.scalar_type())));
  }
  if (t.dim() != 1 || t.size(0) != n)
  {
    refuse(name, "expected shape (" + std::to_string(n) + ",), one per row, got " + shape_of(t));
  }
  if (!t.is_contiguous())
  {
    refuse(name, "not contiguous");
  }
}
} // namespace detail

template <class T>
contrastive::problem<T> problem_of(const torch::Tensor& q,
                                   const torch::Tensor& k,
                                   const torch::Tensor& labels,
                                   contrastive::objective obj,
                                   const torch::Tensor& query_groups = torch::Tensor(),
                                   const torch::Tensor& key_groups = torch::Tensor())
{
  if (q.dim() != 2 || k.dim() != 2)
  {
    detail::refuse(q.dim() != 2 ? "q" : "k",
                   "expected a 2-D tensor (batch x dim), got shape " + detail::shape_of(q.dim() != 2 ? q : k));
  }
  if (!q.is_contiguous() || !k.is_contiguous())
  {
    detail::refuse(!q.is_contiguous() ? "q" : "k", "not contiguous");
  }
  if (k.scalar_type() != q.scalar_type() || k.size(1) != q.size(1))
  {
    detail::refuse("k", "dtype or embedding size differs from q's");
  }
  // Every tensor read through a raw pointer lives on q's device: a CUDA kernel given a host pointer (or the host one
  // a device pointer) would read an address that is not there.
  const auto on_q_device = [&](const char* name, const torch::Tensor& t)
  {
    if (t.defined() && t.device() != q.device())
    {
      detail::refuse(name, "on " + t.device().str() + ", expected q's device " + q.device().str());
    }
  };
  on_q_device("k", k);
  on_q_device("labels", labels);
  on_q_device("query_groups", query_groups);
  on_q_device("key_groups", key_groups);
  if (labels.defined())
  {
    detail::check_ids("labels", labels, q.size(0), torch::kInt32, "int32 labels");
  }
  if (query_groups.defined() != key_groups.defined())
  {
    detail::refuse(query_groups.defined() ? "key_groups" : "query_groups", "missing while the other side's is given");
  }
  if (query_groups.defined())
  {
    detail::check_ids("query_groups", query_groups, q.size(0), torch::kInt64, "int64 group ids");
    detail::check_ids("key_groups", key_groups, k.size(0), torch::kInt64, "int64 group ids");
  }
  contrastive::problem<T> p;
  p.q = reinterpret_cast<const T*>(q.data_ptr());
  p.k = reinterpret_cast<const T*>(k.data_ptr());
  p.n_q = static_cast<std::size_t>(q.size(0));
  p.n_k = static_cast<std::size_t>(k.size(0));
  p.dim = static_cast<std::size_t>(q.size(1));
  p.labels = labels.defined() ? labels.data_ptr<std::int32_t>() : nullptr;
  p.obj = obj;
  p.query_groups = query_groups.defined() ? query_groups.data_ptr<std::int64_t>() : nullptr;
  p.key_groups = key_groups.defined() ? key_groups.data_ptr<std::int64_t>() : nullptr;
  return p;
}
template <class T>
contrastive::problem<T>
problem_of(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& labels, bool symmetric)
{
  return problem_of<T>(q, k, labels, symmetric ? contrastive::objective::symmetric : contrastive::objective::info_nce);
}
} // namespace contrastive_torch
