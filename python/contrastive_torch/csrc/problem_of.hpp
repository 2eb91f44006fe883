// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// The library's problem viewing PyTorch tensors, shared by the host and the CUDA binding. The Python side has checked
// shapes, dtypes, devices and contiguity; labels are int32 (or undefined: the diagonal); group ids int64 CPU tensors
// (or undefined: none).
#pragma once

#include <torch/extension.h>

#include <contrastive/problem.hpp>

#include <cstddef>
#include <cstdint>

namespace contrastive_torch
{
template <class T>
contrastive::problem<T> problem_of(const torch::Tensor& q,
                                   const torch::Tensor& k,
                                   const torch::Tensor& labels,
                                   contrastive::objective obj,
                                   const torch::Tensor& query_groups = torch::Tensor(),
                                   const torch::Tensor& key_groups = torch::Tensor())
{
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
