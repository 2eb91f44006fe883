// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The scalar optimiser that trains a learnable temperature's logit scale theta = log(1/tau).
///
/// - SGD with optional momentum (PyTorch's form): b = mu b + g; theta -= lr b.
/// - Adam (Kingma & Ba, PyTorch's form): m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
///   theta -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
/// The moments and the update are computed in double and theta is stored in float, as an fp32 master weight.

#include <contrastive/detail/config.hpp>

#include <cmath>
#include <cstdint>

namespace contrastive
{
namespace detail
{
/// `c + 1`, or `c` when that would overflow: the policies' step and event counters saturate at their maximum (a
/// restored checkpoint may hold it) instead of overflowing.
CONTRASTIVE_HOST_DEVICE inline std::int64_t saturating_increment(std::int64_t c) noexcept
{
  return c < INT64_MAX ? c + 1 : c;
}
CONTRASTIVE_HOST_DEVICE inline std::int32_t saturating_increment(std::int32_t c) noexcept
{
  return c < INT32_MAX ? c + 1 : c;
}
} // namespace detail

/// The update rule of an `optimizer` (see the file comment).
enum class optimizer_kind : std::int32_t
{
  sgd = 0,  ///< SGD with optional momentum
  adam = 1, ///< Adam with bias correction
};

/// Runtime settings of the temperature optimiser. Build one with `optimizer::sgd(...)` or `optimizer::adam(...)`.
struct optimizer
{
  optimizer_kind kind = optimizer_kind::adam; ///< the update rule
  float lr = 1e-3f;                           ///< learning rate, in [0, 1e30)
  float momentum = 0.0f;                      ///< SGD only
  float beta1 = 0.9f;                         ///< Adam only
  float beta2 = 0.999f;                       ///< Adam only
  float eps = 1e-8f;                          ///< Adam only, in (0, 1e30)

  /// SGD with learning rate `lr` and momentum `momentum` in [0, 1) (0: plain SGD).
  static constexpr optimizer sgd(float lr, float momentum = 0.0f) noexcept
  {
    return optimizer{optimizer_kind::sgd, lr, momentum, 0.9f, 0.999f, 1e-8f};
  }
  /// Adam with learning rate `lr`, betas in [0, 1) and `eps` > 0 (PyTorch's defaults).
  static constexpr optimizer
  adam(float lr = 1e-3f, float beta1 = 0.9f, float beta2 = 0.999f, float eps = 1e-8f) noexcept
  {
    return optimizer{optimizer_kind::adam, lr, 0.0f, beta1, beta2, eps};
  }

  /// True when every setting is inside its domain.
  CONTRASTIVE_HOST_DEVICE bool valid() const noexcept
  {
    const bool lr_ok = lr >= 0.0f && lr < 1e30f;
    if (kind == optimizer_kind::sgd)
    {
      return lr_ok && momentum >= 0.0f && momentum < 1.0f;
    }
    return kind == optimizer_kind::adam && lr_ok && beta1 >= 0.0f && beta1 < 1.0f && beta2 >= 0.0f && beta2 < 1.0f &&
           eps > 0.0f && eps < 1e30f;
  }
};

// No implicit padding, so that copying a policy that holds these copies every byte (checkpoints compare with memcmp).
static_assert(sizeof(optimizer) == sizeof(optimizer_kind) + 5 * sizeof(float), "optimizer must have no padding");

/// Optimiser state: momentum buffer / first moment, second moment, and the number of updates applied (saturating at
/// INT64_MAX, where Adam's bias corrections are 1).
struct optimizer_state
{
  double m = 0.0;     ///< SGD's momentum buffer or Adam's first moment; finite
  double v = 0.0;     ///< Adam's second moment, >= 0 (unused by SGD)
  std::int64_t t = 0; ///< updates applied, >= 0

  /// A state some sequence of finite updates could have produced (checked by `restore`).
  CONTRASTIVE_HOST_DEVICE bool valid() const noexcept
  {
    return m - m == 0.0 && v >= 0.0 && v < 1.0e300 && t >= 0;
  }
};
static_assert(sizeof(optimizer_state) == 2 * sizeof(double) + sizeof(std::int64_t),
              "optimizer_state must have no padding");

/// Applies one update to `theta` with gradient `g`; returns the new theta.
CONTRASTIVE_HOST_DEVICE inline float
apply_update(const optimizer& opt, optimizer_state& st, float theta, float g) noexcept
{
  const double gd = static_cast<double>(g);
  st.t = detail::saturating_increment(st.t);
  if (opt.kind == optimizer_kind::sgd)
  {
    st.m = st.t == 1 ? gd : static_cast<double>(opt.momentum) * st.m + gd;
    const double dir = opt.momentum > 0.0f ? st.m : gd;
    return static_cast<float>(static_cast<double>(theta) - static_cast<double>(opt.lr) * dir);
  }
  const double b1 = opt.beta1;
  const double b2 = opt.beta2;
  st.m = b1 * st.m + (1.0 - b1) * gd;
  st.v = b2 * st.v + (1.0 - b2) * gd * gd;
  const double bc1 = 1.0 - ::pow(b1, static_cast<double>(st.t));
  const double bc2 = 1.0 - ::pow(b2, static_cast<double>(st.t));
  const double denom = ::sqrt(st.v) / ::sqrt(bc2) + static_cast<double>(opt.eps);
  return static_cast<float>(static_cast<double>(theta) - (static_cast<double>(opt.lr) / bc1) * st.m / denom);
}
} // namespace contrastive
