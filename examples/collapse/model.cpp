// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0

#include "collapse/model.hpp"

#include <contrastive/numeric/element_traits.hpp>

#include <algorithm>
#include <cmath>

namespace collapse_demo
{
namespace cl = contrastive;

template <class T>
tower<T>::tower(std::size_t dim, std::size_t in, rng& r)
    : dim_(dim), in_(in), w_(dim * in), m_(dim * in, 0.0f), v_(dim * in, 0.0f), grad_(dim * in, 0.0f)
{
  const float g = 1.0f / std::sqrt(static_cast<float>(in));
  for (float& x : w_)
  {
    x = g * r.normal();
  }
}

template <class T>
void tower<T>::forward(const std::vector<float>& x, std::size_t n, std::vector<T>& f)
{
  using traits = cl::element_traits<T>;
  n_ = n;
  xr_.resize(n * in_);
  for (std::size_t i = 0; i < n * in_; ++i)
  {
    xr_[i] = cl::round_to<T>(x[i]);
  }
  wr_.resize(dim_ * in_);
  for (std::size_t i = 0; i < dim_ * in_; ++i)
  {
    wr_[i] = cl::round_to<T>(w_[i]);
  }
  f.resize(n * dim_);
  ff_.resize(n * dim_);
  norm_.resize(n);
  std::vector<float> h(dim_);
  for (std::size_t i = 0; i < n; ++i)
  {
    const float* xi = &xr_[i * in_];
    double sq = 0.0;
    for (std::size_t r = 0; r < dim_; ++r)
    {
      const float* wr = &wr_[r * in_];
      float acc = 0.0f;
      for (std::size_t c = 0; c < in_; ++c)
      {
        acc += wr[c] * xi[c];
      }
      h[r] = cl::round_to<T>(acc);
      sq += static_cast<double>(h[r]) * h[r];
    }
    const float nrm = std::max(static_cast<float>(std::sqrt(sq)), 1e-12f);
    norm_[i] = nrm;
    for (std::size_t r = 0; r < dim_; ++r)
    {
      const T v = traits::from_float(h[r] / nrm);
      f[i * dim_ + r] = v;
      ff_[i * dim_ + r] = traits::to_float(v);
    }
  }
}

template <class T>
void tower<T>::backward(const std::vector<T>& df)
{
  using traits = cl::element_traits<T>;
  std::fill(grad_.begin(), grad_.end(), 0.0f);
  std::vector<float> dh(dim_);
  std::vector<float> acc(dim_ * in_, 0.0f);
  for (std::size_t i = 0; i < n_; ++i)
  {
    const float* fi = &ff_[i * dim_];
    float proj = 0.0f;
    for (std::size_t r = 0; r < dim_; ++r)
    {
      proj += fi[r] * traits::to_float(df[i * dim_ + r]);
    }
    const float inv = 1.0f / norm_[i];
    for (std::size_t r = 0; r < dim_; ++r)
    {
      dh[r] = cl::round_to<T>((traits::to_float(df[i * dim_ + r]) - fi[r] * proj) * inv);
    }
    const float* xi = &xr_[i * in_];
    for (std::size_t r = 0; r < dim_; ++r)
    {
      float* a = &acc[r * in_];
      const float d = dh[r];
      for (std::size_t c = 0; c < in_; ++c)
      {
        a[c] += d * xi[c];
      }
    }
  }
  for (std::size_t j = 0; j < dim_ * in_; ++j)
  {
    grad_[j] = cl::round_to<T>(acc[j]);
  }
}

template <class T>
void tower<T>::adam_step(float lr, double beta2, std::int64_t t)
{
  const float b1 = 0.9f, b2 = static_cast<float>(beta2), eps = 1e-8f;
  const float bc1 = 1.0f - static_cast<float>(std::pow(0.9, static_cast<double>(t)));
  const float bc2 = 1.0f - static_cast<float>(std::pow(beta2, static_cast<double>(t)));
  for (std::size_t j = 0; j < w_.size(); ++j)
  {
    const float g = grad_[j];
    m_[j] = b1 * m_[j] + (1.0f - b1) * g;
    v_[j] = b2 * v_[j] + (1.0f - b2) * g * g;
    w_[j] -= lr * (m_[j] / bc1) / (std::sqrt(v_[j] / bc2) + eps);
  }
}

template <class T>
float retrieval_top1(const std::vector<T>& fa, const std::vector<T>& fb, std::size_t n, std::size_t dim)
{
  using traits = cl::element_traits<T>;
  std::vector<float> a(n * dim), b(n * dim);
  for (std::size_t i = 0; i < n * dim; ++i)
  {
    a[i] = traits::to_float(fa[i]);
    b[i] = traits::to_float(fb[i]);
  }
  std::vector<float> sim(n * n);
  for (std::size_t i = 0; i < n; ++i)
  {
    for (std::size_t j = 0; j < n; ++j)
    {
      float s = 0.0f;
      for (std::size_t c = 0; c < dim; ++c)
      {
        s += a[i * dim + c] * b[j * dim + c];
      }
      sim[i * n + j] = s;
    }
  }
  std::size_t hits = 0;
  for (std::size_t i = 0; i < n; ++i)
  {
    bool row_ok = true, col_ok = true;
    for (std::size_t j = 0; j < n; ++j)
    {
      if (j != i && !(sim[i * n + j] < sim[i * n + i]))
      {
        row_ok = false;
      }
      if (j != i && !(sim[j * n + i] < sim[i * n + i]))
      {
        col_ok = false;
      }
    }
    hits += (row_ok ? 1 : 0) + (col_ok ? 1 : 0);
  }
  return static_cast<float>(hits) / static_cast<float>(2 * n);
}

template class tower<float>;
template class tower<__half>;
template class tower<__nv_bfloat16>;
template float retrieval_top1(const std::vector<float>&, const std::vector<float>&, std::size_t, std::size_t);
template float retrieval_top1(const std::vector<__half>&, const std::vector<__half>&, std::size_t, std::size_t);
template float
retrieval_top1(const std::vector<__nv_bfloat16>&, const std::vector<__nv_bfloat16>&, std::size_t, std::size_t);
} // namespace collapse_demo
