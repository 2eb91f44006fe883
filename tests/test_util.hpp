// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

// Shared test helpers: random inputs, the float64 host reference, and tolerances derived from the element type.

#include "random_rows.hpp"

#include <contrastive/contrastive.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace contrastive_test
{
using contrastive::element_traits;

/// One test shape. The list below covers sizes that are not multiples of the host or device tiles, n_q != n_k, dim
/// not a multiple of 8, N = 1, and a key queue (n_k > n_q) with random labels.
struct shape
{
  std::size_t n_q, n_k, dim;
  contrastive::objective obj;
  bool labels;
};

inline const shape shapes[] = {
    {70, 70, 37, contrastive::objective::symmetric, false},
    {130, 130, 65, contrastive::objective::symmetric, false},
    {50, 300, 24, contrastive::objective::info_nce, true},
    {40, 90, 16, contrastive::objective::info_nce, false},
    {1, 1, 5, contrastive::objective::symmetric, false},
    {1, 7, 3, contrastive::objective::info_nce, true},
};

/// A typed-test configuration: element type x temperature x scaler x algorithm.
template <class T, class Temp, class Scale, class Algo>
struct config
{
  using element = T;
  using temperature = Temp;
  using scaler = Scale;
  using algorithm = Algo;
};

/// Readable typed-test names, e.g. half_clamped_dynamic_fused.
class config_names
{
public:
  template <class C>
  static std::string GetName(int)
  {
    return std::string(contrastive::element_traits<typename C::element>::name) + "_" + C::temperature::name + "_" +
           C::scaler::name + "_" + C::algorithm::name;
  }
};

/// n random positive-key indices in [0, n_k).
inline std::vector<std::int32_t> random_labels(std::size_t n, std::size_t n_k, std::uint32_t seed)
{
  std::mt19937 rng(seed);
  std::vector<std::int32_t> labels(n);
  for (auto& l : labels)
  {
    l = static_cast<std::int32_t>(rng() % n_k);
  }
  return labels;
}

/// Largest |got - want| over the largest |want|, both read as the element type's values (0 when want is all zero).
template <class T>
double rel_diff(const std::vector<T>& got, const std::vector<T>& want)
{
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i)
  {
    const double g = element_traits<T>::to_float(got[i]), w = element_traits<T>::to_float(want[i]);
    num = std::max(num, std::fabs(g - w));
    den = std::max(den, std::fabs(w));
  }
  return den == 0.0 ? num : num / den;
}

template <class T>
std::vector<double> to_double(const std::vector<T>& v)
{
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i)
  {
    out[i] = element_traits<T>::to_float(v[i]);
  }
  return out;
}

/// Float64 reference of the loss and its gradients.
struct reference
{
  double loss = 0.0;
  std::vector<double> row_lse, col_lse;
  std::vector<double> dq, dk; // d loss / d q, d loss / d k (unscaled)
  double grad_logit_scale = 0.0;
  double max_abs_logit = 0.0;
  // Sigmoid objective: d loss / d b, and sum_ij |d loss / d z_ij| |z_ij|, the loss's first-order change when every
  // logit carries a relative error of 1 (a rounding of the logits to unit roundoff u moves the loss by about u times
  // it); row_lse holds each row's loss sum.
  double grad_logit_bias = 0.0;
  double loss_sensitivity = 0.0;
  double max_logit = -INFINITY; // sigmoid: the largest z
};

inline reference compute_reference(const std::vector<double>& q,
                                   const std::vector<double>& k,
                                   std::size_t n_q,
                                   std::size_t n_k,
                                   std::size_t dim,
                                   const std::int32_t* labels,
                                   contrastive::objective obj,
                                   double s)
{
  reference r;
  std::vector<double> S(n_q * n_k);
  for (std::size_t i = 0; i < n_q; ++i)
  {
    for (std::size_t j = 0; j < n_k; ++j)
    {
      double acc = 0.0;
      for (std::size_t c = 0; c < dim; ++c)
      {
        acc += q[i * dim + c] * k[j * dim + c];
      }
      S[i * n_k + j] = s * acc;
      r.max_abs_logit = std::max(r.max_abs_logit, std::fabs(s * acc));
    }
  }
  auto pos = [&](std::size_t i)
  {
    return labels ? static_cast<std::size_t>(labels[i]) : i;
  };
  const bool sym = obj == contrastive::objective::symmetric;
  r.row_lse.resize(n_q);
  double row_total = 0.0;
  for (std::size_t i = 0; i < n_q; ++i)
  {
    double m = -INFINITY;
    for (std::size_t j = 0; j < n_k; ++j)
    {
      m = std::max(m, S[i * n_k + j]);
    }
    double sum = 0.0;
    for (std::size_t j = 0; j < n_k; ++j)
    {
      sum += std::exp(S[i * n_k + j] - m);
    }
    r.row_lse[i] = m + std::log(sum);
    // log1p form keeps the digits of tiny losses.
    double rest = 0.0;
    for (std::size_t j = 0; j < n_k; ++j)
    {
      if (j != pos(i))
      {
        rest += std::exp(S[i * n_k + j] - S[i * n_k + pos(i)]);
      }
    }
    row_total += std::log1p(rest);
  }
  double col_total = 0.0;
  if (sym)
  {
    r.col_lse.resize(n_k);
    for (std::size_t j = 0; j < n_k; ++j)
    {
      double m = -INFINITY;
      for (std::size_t i = 0; i < n_q; ++i)
      {
        m = std::max(m, S[i * n_k + j]);
      }
      double sum = 0.0, rest = 0.0;
      for (std::size_t i = 0; i < n_q; ++i)
      {
        sum += std::exp(S[i * n_k + j] - m);
        if (i != j)
        {
          rest += std::exp(S[i * n_k + j] - S[j * n_k + j]);
        }
      }
      r.col_lse[j] = m + std::log(sum);
      col_total += std::log1p(rest);
    }
    r.loss = 0.5 * (row_total / n_q + col_total / n_k);
  }
  else
  {
    r.loss = row_total / n_q;
  }
  r.dq.assign(n_q * dim, 0.0);
  r.dk.assign(n_k * dim, 0.0);
  for (std::size_t i = 0; i < n_q; ++i)
  {
    for (std::size_t j = 0; j < n_k; ++j)
    {
      const double x = S[i * n_k + j];
      double g = sym ? 0.5 / n_q * std::exp(x - r.row_lse[i]) + 0.5 / n_k * std::exp(x - r.col_lse[j])
                     : std::exp(x - r.row_lse[i]) / n_q;
      if (j == pos(i))
      {
        g -= sym ? 1.0 / n_q : 1.0 / n_q;
      }
      r.grad_logit_scale += g * x;
      for (std::size_t c = 0; c < dim; ++c)
      {
        r.dq[i * dim + c] += s * g * k[j * dim + c];
        r.dk[j * dim + c] += s * g * q[i * dim + c];
      }
    }
  }
  return r;
}

/// Float64 reference of the sigmoid objective (SigLIP): z_ij = s <q_i, k_j> + b, l_ij = +1 for j = p_i (labels, or
/// the diagonal) and -1 otherwise, loss (1/n_q) sum_ij softplus(-l_ij z_ij), written independently of the library
/// (softplus(u) = max(u, 0) + log1p(exp(-|u|)), sigmoid from std::exp).
inline reference compute_sigmoid_reference(const std::vector<double>& q,
                                           const std::vector<double>& k,
                                           std::size_t n_q,
                                           std::size_t n_k,
                                           std::size_t dim,
                                           const std::int32_t* labels,
                                           double s,
                                           double b)
{
  reference r;
  r.row_lse.assign(n_q, 0.0);
  r.dq.assign(n_q * dim, 0.0);
  r.dk.assign(n_k * dim, 0.0);
  const auto softplus = [](double u)
  {
    return std::max(u, 0.0) + std::log1p(std::exp(-std::fabs(u)));
  };
  double total = 0.0;
  for (std::size_t i = 0; i < n_q; ++i)
  {
    const std::size_t p = labels ? static_cast<std::size_t>(labels[i]) : i;
    for (std::size_t j = 0; j < n_k; ++j)
    {
      double acc = 0.0;
      for (std::size_t c = 0; c < dim; ++c)
      {
        acc += q[i * dim + c] * k[j * dim + c];
      }
      const double S = s * acc, z = S + b, l = j == p ? 1.0 : -1.0;
      r.max_abs_logit = std::max(r.max_abs_logit, std::fabs(z));
      r.max_logit = std::max(r.max_logit, z);
      const double term = softplus(-l * z);
      r.row_lse[i] += term;
      total += term;
      const double g = -l / (1.0 + std::exp(l * z)) / static_cast<double>(n_q); // -l sigmoid(-l z) / n_q
      r.grad_logit_scale += g * S;
      r.grad_logit_bias += g;
      r.loss_sensitivity += std::fabs(g) * std::fabs(z);
      for (std::size_t c = 0; c < dim; ++c)
      {
        r.dq[i * dim + c] += s * g * k[j * dim + c];
        r.dk[j * dim + c] += s * g * q[i * dim + c];
      }
    }
  }
  r.loss = total / static_cast<double>(n_q);
  return r;
}

/// Largest |a_i - b_i| / max_i |b_i| (a normwise relative error that does not explode on near-zero elements).
template <class A>
double max_rel_error(const std::vector<A>& got, const std::vector<double>& want, double factor = 1.0)
{
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i)
  {
    const double g = double(element_traits<A>::to_float(got[i])) * factor;
    num = std::max(num, std::fabs(g - want[i]));
    den = std::max(den, std::fabs(want[i]));
    if (!std::isfinite(g))
    {
      return INFINITY;
    }
  }
  return den > 0 ? num / den : num;
}

/// Tolerances derived from the element type: u_T = epsilon/2 is the unit roundoff of the storage type, u_f that of the
/// float accumulator. Fused rounds once at the output; materialized also rounds every logit (error u_T |S|) and
/// every logit gradient, so its error grows with the largest logit.
template <class T, class Algorithm>
struct tolerance
{
  static constexpr double u_t = element_traits<T>::epsilon() / 2.0;
  static constexpr double u_f = 5.96e-8;
  static constexpr bool materialized = std::is_same_v<Algorithm, contrastive::algorithm::materialized>;

  /// Absolute tolerance of the loss value.
  static double loss(double max_logit)
  {
    return materialized ? 4.0 * u_t * (1.0 + max_logit) + 64 * u_f : 64 * u_f * (1.0 + max_logit);
  }
  /// Normwise relative tolerance of dQ, dK.
  static double grad(double max_logit)
  {
    return materialized ? 8.0 * u_t * (1.0 + max_logit) + 1e-5 : 4.0 * u_t + 1e-5;
  }
  /// The materialized algorithm's further share of the normwise relative error of dQ (or dK), which `grad` leaves
  /// out: it forms the positive's G_pp = row_coef P_pp + col_coef C_pp - pos_coef by subtraction, as a framework's
  /// softmax minus one-hot does (docs/design.md, "Positive's gradient"). P_pp carries a few float ulps even from exact
  /// inputs (the exponential's 2, the coefficient's product and the sum's 1 each: 4 u_f per coefficient), an
  /// absolute error the subtraction keeps while G_pp itself may be ~1e-3 or less (a dominant positive), so relative to
  /// the gradient it is unbounded. Its share of dQ_i = s sum_j G_ij k_j is s 4 u_f coef_sum max|k| (`operand`: the
  /// largest |element| of the other side), of dK_j the same times the rows whose positive is j (`positives`), over
  /// the reference's largest |element| (absolute where the reference is 0, as max_rel_error). 0 for fused, which
  /// forms G_pp exactly.
  static double positive_subtraction(double s, double coef_sum, double operand, double positives, double ref_max)
  {
    if (!materialized)
    {
      return 0.0;
    }
    const double bound = s * 4.0 * u_f * coef_sum * operand * positives;
    return ref_max > 0.0 ? bound / ref_max : bound;
  }
};
/// `backward` refuses outputs that overlap each other or the inputs, as `forward_backward` does, for loss type L
/// (any element type, algorithm and GEMM backend): each aliased call is invalid_argument naming the output, writes
/// nothing, and leaves the forward ready, so the correct call that follows equals a run that was never refused.
template <class L>
void check_backward_refuses_aliases()
{
  using T = typename L::element_type;
  const std::size_t n = 37, d = 19;
  std::vector<T> q = random_rows<T>(n, d, 4401), k = random_rows<T>(n, d, 4402);
  const contrastive::problem<T> p{q.data(), k.data(), n, n, d};
  const T sentinel = element_traits<T>::from_float(7.0f);
  std::vector<T> buf(3 * n * d, sentinel);
  std::vector<T> q_copy = q, k_copy = k;
  L l(typename L::temperature_type(0.1f), typename L::scaler_type(), 2);
  float value = 0.0f, g = 0.0f;
  ASSERT_TRUE(l.forward(p, value).ok());
  struct alias_case
  {
    T *dq, *dk;
    const char* argument;
  };
  const alias_case cases[] = {
      {buf.data(), buf.data(), "dk"},
      {buf.data(), buf.data() + 1, "dk"},         // dk starts inside dq
      {buf.data() + n * d - 1, buf.data(), "dk"}, // dq ends inside dk
      {q.data(), buf.data(), "dq"},               // dq over q
      {k.data() + 3, buf.data(), "dq"},           // dq inside k
      {buf.data(), q.data() + n * d - 1, "dk"},   // dk over q's last element
      {buf.data(), k.data(), "dk"},               // dk over k
  };
  for (const alias_case& c : cases)
  {
    const contrastive::status st = l.backward(c.dq, c.dk, g);
    EXPECT_EQ(st.code(), contrastive::errc::invalid_argument) << st.message();
    EXPECT_EQ(st.argument(), c.argument) << st.message();
  }
  for (const T& x : buf)
  {
    ASSERT_EQ(element_traits<T>::to_float(x), 7.0f) << "a refused backward wrote an output";
  }
  EXPECT_EQ(std::memcmp(q.data(), q_copy.data(), q.size() * sizeof(T)), 0) << "a refused backward wrote q";
  EXPECT_EQ(std::memcmp(k.data(), k_copy.data(), k.size() * sizeof(T)), 0) << "a refused backward wrote k";
  // Adjacent buffers are separate: accepted, and equal to a loss that never saw a refusal.
  float g_ok = 0.0f;
  ASSERT_TRUE(l.backward(buf.data(), buf.data() + n * d, g_ok).ok());
  L fresh(typename L::temperature_type(0.1f), typename L::scaler_type(), 2);
  std::vector<T> dq(n * d), dk(n * d);
  float v2 = 0.0f, g2 = 0.0f;
  ASSERT_TRUE(fresh.forward(p, v2).ok());
  ASSERT_TRUE(fresh.backward(dq.data(), dk.data(), g2).ok());
  EXPECT_EQ(g_ok, g2);
  EXPECT_EQ(std::memcmp(buf.data(), dq.data(), n * d * sizeof(T)), 0);
  EXPECT_EQ(std::memcmp(buf.data() + n * d, dk.data(), n * d * sizeof(T)), 0);
}
} // namespace contrastive_test
