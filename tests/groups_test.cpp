// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// Several positives per row from group ids (numeric/groups.hpp): every objective x element type x host algorithm
// against a float64 reference written from the definition (itself checked by central differences), the library's
// gradients against central differences of its own loss, batches with duplicates, rectangular batches and rows
// without a positive, ids that give one positive per row bit for bit equal to labels (or the diagonal), the
// refusals (nothing written), and 2-3 thread ranks, whose positives lie on other ranks, against the reference.

#include "test_util.hpp"
#include "thread_comm.hpp"

#include <contrastive/core.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace cl = contrastive;
namespace ct = contrastive_test;

namespace
{
constexpr float poison = 1234.5f;

/// Float64 loss and gradients of a grouped step, from the definition in numeric/groups.hpp.
struct grouped_ref
{
  double loss = 0.0, dlogs = 0.0, dbias = 0.0, max_abs_logit = 0.0;
  std::vector<double> dq, dk;
};

grouped_ref grouped_reference(const std::vector<double>& q,
                              const std::vector<double>& k,
                              std::size_t n_q,
                              std::size_t n_k,
                              std::size_t dim,
                              const std::vector<std::int64_t>& qid,
                              const std::vector<std::int64_t>& kid,
                              cl::objective obj,
                              double s,
                              double b)
{
  grouped_ref r;
  std::vector<double> S(n_q * n_k), G(n_q * n_k, 0.0);
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
      r.max_abs_logit = std::max(r.max_abs_logit, std::fabs(s * acc + (obj == cl::objective::sigmoid ? b : 0.0)));
    }
  }
  const auto pos = [&](std::size_t i, std::size_t j)
  {
    return qid[i] == kid[j];
  };
  if (obj == cl::objective::sigmoid)
  {
    for (std::size_t i = 0; i < n_q; ++i)
    {
      for (std::size_t j = 0; j < n_k; ++j)
      {
        const double z = S[i * n_k + j] + b, l = pos(i, j) ? 1.0 : -1.0, u = -l * z;
        r.loss += (std::max(u, 0.0) + std::log1p(std::exp(-std::fabs(u)))) / static_cast<double>(n_q);
        G[i * n_k + j] = -l / (1.0 + std::exp(l * z)) / static_cast<double>(n_q);
      }
    }
  }
  else
  {
    // One direction's term: the mean over the rows (of `rows` x `cols`, element (a, c) at S[at(a, c)]) that have a
    // positive of lse - mean positive logit, with its gradient added to G times `weight`.
    const auto direction = [&](std::size_t rows, std::size_t cols, auto at, auto positive, double weight)
    {
      std::size_t with = 0;
      for (std::size_t a = 0; a < rows; ++a)
      {
        for (std::size_t c = 0; c < cols; ++c)
        {
          if (positive(a, c))
          {
            ++with;
            break;
          }
        }
      }
      if (with == 0)
      {
        return;
      }
      for (std::size_t a = 0; a < rows; ++a)
      {
        double m = -INFINITY, sum = 0.0, pos_sum = 0.0;
        std::size_t count = 0;
        for (std::size_t c = 0; c < cols; ++c)
        {
          m = std::max(m, S[at(a, c)]);
        }
        for (std::size_t c = 0; c < cols; ++c)
        {
          sum += std::exp(S[at(a, c)] - m);
          if (positive(a, c))
          {
            pos_sum += S[at(a, c)];
            ++count;
          }
        }
        if (count == 0)
        {
          continue;
        }
        const double lse = m + std::log(sum);
        r.loss += weight * (lse - pos_sum / static_cast<double>(count)) / static_cast<double>(with);
        for (std::size_t c = 0; c < cols; ++c)
        {
          const double p = std::exp(S[at(a, c)] - lse) - (positive(a, c) ? 1.0 / static_cast<double>(count) : 0.0);
          G[at(a, c)] += weight * p / static_cast<double>(with);
        }
      }
    };
    const bool sym = obj == cl::objective::symmetric;
    direction(
        n_q,
        n_k,
        [&](std::size_t i, std::size_t j)
        {
          return i * n_k + j;
        },
        pos,
        sym ? 0.5 : 1.0);
    if (sym)
    {
      direction(
          n_k,
          n_q,
          [&](std::size_t j, std::size_t i)
          {
            return i * n_k + j;
          },
          [&](std::size_t j, std::size_t i)
          {
            return pos(i, j);
          },
          0.5);
    }
  }
  r.dq.assign(n_q * dim, 0.0);
  r.dk.assign(n_k * dim, 0.0);
  for (std::size_t i = 0; i < n_q; ++i)
  {
    for (std::size_t j = 0; j < n_k; ++j)
    {
      const double g = G[i * n_k + j];
      r.dlogs += g * S[i * n_k + j];
      r.dbias += g;
      for (std::size_t c = 0; c < dim; ++c)
      {
        r.dq[i * dim + c] += s * g * k[j * dim + c];
        r.dk[j * dim + c] += s * g * q[i * dim + c];
      }
    }
  }
  return r;
}

/// Group ids of a batch: `kind` 0: images with five captions each (query i is image i / 5's caption when the queries
/// are texts; here queries are images, keys their captions: n_k = 5 n_q), 1: random ids in [0, n / 3) on both
/// sides (duplicates, rows without a positive), 2: no positive pair at all.
struct batch_ids
{
  std::vector<std::int64_t> q, k;
};

batch_ids make_ids(int kind, std::size_t n_q, std::size_t n_k, std::uint32_t seed)
{
  batch_ids ids;
  ids.q.resize(n_q);
  ids.k.resize(n_k);
  std::mt19937 rng(seed);
  for (std::size_t i = 0; i < n_q; ++i)
  {
    ids.q[i] = kind == 0 ? static_cast<std::int64_t>(i) * 7 - 3 : static_cast<std::int64_t>(rng() % (n_q / 3 + 1));
  }
  for (std::size_t j = 0; j < n_k; ++j)
  {
    ids.k[j] = kind == 0   ? static_cast<std::int64_t>(j % n_q) * 7 - 3
               : kind == 1 ? static_cast<std::int64_t>(rng() % (n_q / 3 + 1))
                           : static_cast<std::int64_t>(j) + 1000000;
  }
  return ids;
}

template <class T>
std::vector<T> poisoned(std::size_t n)
{
  return std::vector<T>(n, cl::element_traits<T>::from_float(poison));
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b)
{
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// The normwise tolerance of a grouped dQ or dK: the algorithm's own (tolerance::grad), and a few float ulps of each
/// G_ij's coefficient, summed over a row's n_k terms, times s max|other side| (the rounding of each term).
template <class T, class A>
double grad_tolerance(double max_logit, double s, double coef, std::size_t terms, double ref_max)
{
  using tol = ct::tolerance<T, A>;
  const double subtraction = s * 8.0 * tol::u_f * coef * static_cast<double>(terms);
  return tol::grad(max_logit) + (ref_max > 0.0 ? subtraction / ref_max : subtraction);
}

double max_abs(const std::vector<double>& v)
{
  double m = 0.0;
  for (double x : v)
  {
    m = std::max(m, std::fabs(x));
  }
  return m;
}

/// The step of core<T, A> with group ids against float64, at the tolerances of E, the algorithm A runs.
template <class T, class A, class E>
void matches_reference_as(cl::objective obj, int kind, std::size_t n_q, std::size_t n_k, std::uint32_t seed)
{
  SCOPED_TRACE(std::string(cl::element_traits<T>::name) + " " + A::name + " " + cl::to_string(obj) + " ids " +
               std::to_string(kind) + " " + std::to_string(n_q) + "x" + std::to_string(n_k));
  const std::size_t dim = 40;
  const auto q = ct::random_rows<T>(n_q, dim, seed), k = ct::random_rows<T>(n_k, dim, seed + 1);
  const batch_ids ids = make_ids(kind, n_q, n_k, seed + 2);
  cl::problem<T> p{q.data(), k.data(), n_q, n_k, dim, nullptr, obj};
  p.query_groups = ids.q.data();
  p.key_groups = ids.k.data();
  const float s = 14.0f, bias = obj == cl::objective::sigmoid ? -3.0f : 0.0f;
  const float loss_scale = std::is_same_v<T, float> ? 1.0f : 256.0f;
  cl::core<T, A> core(3);
  auto dq = poisoned<T>(n_q * dim), dk = poisoned<T>(n_k * dim);
  cl::core_values v;
  const cl::status st = core.step(p, s, bias, loss_scale, dq.data(), dk.data(), v);
  ASSERT_TRUE(st.ok()) << st.message();
  const grouped_ref ref =
      grouped_reference(ct::to_double(q), ct::to_double(k), n_q, n_k, dim, ids.q, ids.k, obj, s, bias);
  EXPECT_EQ(core.algorithm_used(), std::string(E::name));
  using tol = ct::tolerance<T, E>;
  EXPECT_NEAR(v.loss, ref.loss, tol::loss(ref.max_abs_logit) * (1.0 + ref.loss));
  // The positives' coefficient a_i / |P(i)| + b_j / |Q(g)| is at most 1 / min(R, C) (sigmoid: 1 / n_q).
  std::size_t rows_with = 0, cols_with = 0;
  for (std::size_t i = 0; i < n_q; ++i)
  {
    rows_with += std::find(ids.k.begin(), ids.k.end(), ids.q[i]) != ids.k.end() ? 1 : 0;
  }
  for (std::size_t j = 0; j < n_k; ++j)
  {
    cols_with += std::find(ids.q.begin(), ids.q.end(), ids.k[j]) != ids.q.end() ? 1 : 0;
  }
  const double coef = obj == cl::objective::sigmoid
                          ? 1.0 / static_cast<double>(n_q)
                          : 1.0 / static_cast<double>(std::max<std::size_t>(1, std::min(rows_with, cols_with)));
  if (kind == 2 && obj != cl::objective::sigmoid)
  {
    EXPECT_EQ(v.loss, 0.0f);
    EXPECT_EQ(v.grad_logit_scale, 0.0f);
    for (std::size_t x = 0; x < dq.size(); ++x)
    {
      ASSERT_EQ(cl::element_traits<T>::to_float(dq[x]), 0.0f);
    }
    for (std::size_t x = 0; x < dk.size(); ++x)
    {
      ASSERT_EQ(cl::element_traits<T>::to_float(dk[x]), 0.0f);
    }
    return;
  }
  EXPECT_LE(ct::max_rel_error(dq, ref.dq, 1.0 / loss_scale),
            (grad_tolerance<T, E>(ref.max_abs_logit, s, coef, n_k, max_abs(ref.dq))));
  EXPECT_LE(ct::max_rel_error(dk, ref.dk, 1.0 / loss_scale),
            (grad_tolerance<T, E>(ref.max_abs_logit, s, coef, n_q, max_abs(ref.dk))));
  EXPECT_NEAR(v.grad_logit_scale, ref.dlogs, 64 * tol::grad(ref.max_abs_logit) * (1 + std::fabs(ref.dlogs)));
  if (obj == cl::objective::sigmoid)
  {
    EXPECT_NEAR(v.grad_logit_bias, ref.dbias, 64 * tol::grad(ref.max_abs_logit) * (1 + std::fabs(ref.dbias)));
  }
  EXPECT_EQ(v.first_nonfinite, cl::nonfinite_site::none);
}

/// The step against float64 at the tolerances of the algorithm A runs: automatic runs materialized for float softmax
/// objectives at this test's sizes (its buffers fit), fused for the 16-bit types and the sigmoid objective
/// (host/engine.hpp's choice).
template <class T, class A>
void matches_reference(cl::objective obj, int kind, std::size_t n_q, std::size_t n_k, std::uint32_t seed)
{
  if (!std::is_same_v<A, cl::algorithm::automatic>)
  {
    matches_reference_as<T, A, A>(obj, kind, n_q, n_k, seed);
  }
  else if (std::is_same_v<T, float> && obj != cl::objective::sigmoid)
  {
    matches_reference_as<T, A, cl::algorithm::materialized>(obj, kind, n_q, n_k, seed);
  }
  else
  {
    matches_reference_as<T, A, cl::algorithm::fused>(obj, kind, n_q, n_k, seed);
  }
}

template <class T, class A>
void every_objective_and_batch(std::uint32_t seed)
{
  for (cl::objective obj : {cl::objective::symmetric, cl::objective::info_nce, cl::objective::sigmoid})
  {
    matches_reference<T, A>(obj, 0, 19, 95, seed += 10);   // five captions per image, rectangular
    matches_reference<T, A>(obj, 1, 70, 53, seed += 10);   // duplicates and rows without a positive
    matches_reference<T, A>(obj, 1, 150, 150, seed += 10); // several row blocks and key tiles
    matches_reference<T, A>(obj, 2, 30, 41, seed += 10);   // no positive pair
  }
}
} // namespace

// The reference's gradients are its loss's: central differences in float64.
TEST(Groups, ReferenceGradientsAreItsLossDerivatives)
{
  const std::size_t n_q = 9, n_k = 14, dim = 5;
  const auto qf = ct::random_rows<float>(n_q, dim, 5), kf = ct::random_rows<float>(n_k, dim, 6);
  std::vector<double> q = ct::to_double(qf), k = ct::to_double(kf);
  const batch_ids ids = make_ids(1, n_q, n_k, 7);
  for (cl::objective obj : {cl::objective::symmetric, cl::objective::info_nce, cl::objective::sigmoid})
  {
    const grouped_ref r = grouped_reference(q, k, n_q, n_k, dim, ids.q, ids.k, obj, 3.0, -1.0);
    const double h = 1e-6;
    for (std::size_t x = 0; x < q.size(); x += 3)
    {
      const double keep = q[x];
      q[x] = keep + h;
      const double up = grouped_reference(q, k, n_q, n_k, dim, ids.q, ids.k, obj, 3.0, -1.0).loss;
      q[x] = keep - h;
      const double down = grouped_reference(q, k, n_q, n_k, dim, ids.q, ids.k, obj, 3.0, -1.0).loss;
      q[x] = keep;
      EXPECT_NEAR(r.dq[x], (up - down) / (2 * h), 1e-7) << cl::to_string(obj) << " dq " << x;
    }
    for (std::size_t x = 0; x < k.size(); x += 3)
    {
      const double keep = k[x];
      k[x] = keep + h;
      const double up = grouped_reference(q, k, n_q, n_k, dim, ids.q, ids.k, obj, 3.0, -1.0).loss;
      k[x] = keep - h;
      const double down = grouped_reference(q, k, n_q, n_k, dim, ids.q, ids.k, obj, 3.0, -1.0).loss;
      k[x] = keep;
      EXPECT_NEAR(r.dk[x], (up - down) / (2 * h), 1e-7) << cl::to_string(obj) << " dk " << x;
    }
    const double up = grouped_reference(q, k, n_q, n_k, dim, ids.q, ids.k, obj, 3.0 * std::exp(h), -1.0).loss;
    const double down = grouped_reference(q, k, n_q, n_k, dim, ids.q, ids.k, obj, 3.0 * std::exp(-h), -1.0).loss;
    EXPECT_NEAR(r.dlogs, (up - down) / (2 * h), 1e-7) << cl::to_string(obj);
  }
}

TEST(Groups, FloatMatchesTheReference)
{
  every_objective_and_batch<float, cl::algorithm::fused>(100);
  every_objective_and_batch<float, cl::algorithm::materialized>(200);
  every_objective_and_batch<float, cl::algorithm::chunked>(300);
  every_objective_and_batch<float, cl::algorithm::automatic>(400);
}

TEST(Groups, HalfMatchesTheReference)
{
  every_objective_and_batch<__half, cl::algorithm::fused>(500);
  every_objective_and_batch<__half, cl::algorithm::materialized>(600);
  every_objective_and_batch<__half, cl::algorithm::chunked>(700);
}

TEST(Groups, Bfloat16MatchesTheReference)
{
  every_objective_and_batch<__nv_bfloat16, cl::algorithm::fused>(800);
  every_objective_and_batch<__nv_bfloat16, cl::algorithm::materialized>(900);
  every_objective_and_batch<__nv_bfloat16, cl::algorithm::chunked>(1000);
  every_objective_and_batch<__nv_bfloat16, cl::algorithm::automatic>(1100);
}

// The library's own float gradients against central differences of its own float loss.
TEST(Groups, GradientsAreTheLossDerivatives)
{
  const std::size_t n_q = 12, n_k = 30, dim = 8;
  auto q = ct::random_rows<float>(n_q, dim, 31), k = ct::random_rows<float>(n_k, dim, 32);
  const batch_ids ids = make_ids(1, n_q, n_k, 33);
  for (cl::objective obj : {cl::objective::symmetric, cl::objective::info_nce, cl::objective::sigmoid})
  {
    cl::core<float, cl::algorithm::fused> core(2);
    const auto loss_at = [&]
    {
      cl::problem<float> p{q.data(), k.data(), n_q, n_k, dim, nullptr, obj};
      p.query_groups = ids.q.data();
      p.key_groups = ids.k.data();
      cl::step::forward_values f;
      EXPECT_TRUE(core.forward(p, 4.0f, obj == cl::objective::sigmoid ? -2.0f : 0.0f, f).ok());
      return static_cast<double>(f.loss);
    };
    cl::problem<float> p{q.data(), k.data(), n_q, n_k, dim, nullptr, obj};
    p.query_groups = ids.q.data();
    p.key_groups = ids.k.data();
    std::vector<float> dq(n_q * dim), dk(n_k * dim);
    cl::core_values v;
    ASSERT_TRUE(core.step(p, 4.0f, obj == cl::objective::sigmoid ? -2.0f : 0.0f, 1.0f, dq.data(), dk.data(), v).ok());
    const float h = 1e-2f;
    for (auto* side : {&q, &k})
    {
      const std::vector<float>& grad = side == &q ? dq : dk;
      for (std::size_t x = 0; x < side->size(); x += 5)
      {
        const float keep = (*side)[x];
        (*side)[x] = keep + h;
        const double up = loss_at();
        (*side)[x] = keep - h;
        const double down = loss_at();
        (*side)[x] = keep;
        EXPECT_NEAR(grad[x], (up - down) / (2.0 * h), 2e-4)
            << cl::to_string(obj) << (side == &q ? " dq " : " dk ") << x;
      }
    }
  }
}

// Ids that give every row exactly one positive run the single-positive loss: the same bits as its labels (or, for
// the symmetric loss, the diagonal), on every algorithm.
template <class T, class A>
void one_positive_is_the_labelled_loss(cl::objective obj, std::uint32_t seed)
{
  SCOPED_TRACE(std::string(cl::element_traits<T>::name) + " " + A::name + " " + cl::to_string(obj));
  const std::size_t n = 75, n_k = obj == cl::objective::symmetric ? 75 : 90, dim = 24;
  const auto q = ct::random_rows<T>(n, dim, seed), k = ct::random_rows<T>(n_k, dim, seed + 1);
  std::vector<std::int32_t> labels(n);
  std::vector<std::int64_t> qid(n), kid(n_k);
  std::mt19937 rng(seed);
  for (std::size_t j = 0; j < n_k; ++j)
  {
    kid[j] = static_cast<std::int64_t>(j) * 3 + 11; // distinct
  }
  for (std::size_t i = 0; i < n; ++i)
  {
    labels[i] = obj == cl::objective::symmetric ? static_cast<std::int32_t>(i) : static_cast<std::int32_t>(rng() % n_k);
    qid[i] = kid[static_cast<std::size_t>(labels[i])];
  }
  const float bias = obj == cl::objective::sigmoid ? -2.0f : 0.0f;
  cl::problem<T> grouped{q.data(), k.data(), n, n_k, dim, nullptr, obj};
  grouped.query_groups = qid.data();
  grouped.key_groups = kid.data();
  const cl::problem<T> labelled{
      q.data(), k.data(), n, n_k, dim, obj == cl::objective::symmetric ? nullptr : labels.data(), obj};
  cl::core<T, A> a(2), b(2);
  std::vector<T> dq1(n * dim), dk1(n_k * dim), dq2(n * dim), dk2(n_k * dim);
  cl::core_values v1, v2;
  ASSERT_TRUE(a.step(grouped, 20.0f, bias, 1.0f, dq1.data(), dk1.data(), v1).ok());
  ASSERT_TRUE(b.step(labelled, 20.0f, bias, 1.0f, dq2.data(), dk2.data(), v2).ok());
  EXPECT_EQ(v1.loss, v2.loss);
  EXPECT_EQ(v1.grad_logit_scale, v2.grad_logit_scale);
  EXPECT_EQ(v1.grad_logit_bias, v2.grad_logit_bias);
  EXPECT_EQ(v1.max_logit, v2.max_logit);
  EXPECT_TRUE(same_bits(dq1, dq2));
  EXPECT_TRUE(same_bits(dk1, dk2));
}

TEST(Groups, OnePositivePerRowIsTheLabelledLossBitForBit)
{
  std::uint32_t seed = 50;
  for (cl::objective obj : {cl::objective::symmetric, cl::objective::info_nce, cl::objective::sigmoid})
  {
    one_positive_is_the_labelled_loss<float, cl::algorithm::fused>(obj, seed += 3);
    one_positive_is_the_labelled_loss<float, cl::algorithm::chunked>(obj, seed += 3);
    one_positive_is_the_labelled_loss<__half, cl::algorithm::materialized>(obj, seed += 3);
    one_positive_is_the_labelled_loss<__nv_bfloat16, cl::algorithm::automatic>(obj, seed += 3);
  }
}

// A step whose logits overflow leaves non-finite positives in the engine; the next grouped step on the same engine,
// whose logits are finite, reports no non-finite logit (every algorithm, every objective after every objective).
template <class A>
void overflow_then_grouped_is_finite()
{
  const std::size_t n = 8, dim = 4;
  const auto q = ct::random_rows<float>(n, dim, 71, 4.0f), k = ct::random_rows<float>(n, dim, 71, 4.0f);
  const std::vector<std::int64_t> ids{1, 2, 3, 4, 1, 2, 3, 4};
  for (cl::objective before : {cl::objective::symmetric, cl::objective::info_nce, cl::objective::sigmoid})
  {
    for (cl::objective obj : {cl::objective::symmetric, cl::objective::info_nce, cl::objective::sigmoid})
    {
      SCOPED_TRACE(std::string(A::name) + " " + cl::to_string(before) + " then grouped " + cl::to_string(obj));
      cl::core<float, A> core(1);
      std::vector<float> dq(n * dim), dk(n * dim);
      cl::core_values v;
      cl::problem<float> p{q.data(), k.data(), n, n, dim, nullptr, before};
      ASSERT_TRUE(core.step(p, 3e38f, 0.0f, 1.0f, dq.data(), dk.data(), v).ok());
      ASSERT_EQ(v.first_nonfinite, cl::nonfinite_site::logits); // the diagonal's logits overflow
      p.obj = obj;
      p.query_groups = ids.data();
      p.key_groups = ids.data();
      ASSERT_TRUE(core.step(p, 3.0f, obj == cl::objective::sigmoid ? -1.0f : 0.0f, 1.0f, dq.data(), dk.data(), v).ok());
      EXPECT_FALSE(v.logits_nonfinite);
      EXPECT_EQ(v.first_nonfinite, cl::nonfinite_site::none);
      EXPECT_TRUE(std::isfinite(v.loss));
    }
  }
}

TEST(Groups, OverflowedStepLeavesNoNonFiniteFlagBehind)
{
  overflow_then_grouped_is_finite<cl::algorithm::fused>();
  overflow_then_grouped_is_finite<cl::algorithm::materialized>();
  overflow_then_grouped_is_finite<cl::algorithm::chunked>();
  overflow_then_grouped_is_finite<cl::algorithm::automatic>();
}

// Group ids with labels, or on one side only, are refused naming the argument; nothing is written.
TEST(Groups, RefusalsNameTheArgumentAndWriteNothing)
{
  const std::size_t n = 10, dim = 6;
  const auto q = ct::random_rows<float>(n, dim, 1), k = ct::random_rows<float>(n, dim, 2);
  std::vector<std::int64_t> ids(n, 1);
  std::vector<std::int32_t> labels(n, 0);
  cl::core<float> core(1);
  auto dq = poisoned<float>(n * dim), dk = poisoned<float>(n * dim);
  cl::core_values v;
  cl::problem<float> p{q.data(), k.data(), n, n, dim, labels.data(), cl::objective::info_nce};
  p.query_groups = ids.data();
  p.key_groups = ids.data();
  cl::status st = core.step(p, 10.0f, 1.0f, dq.data(), dk.data(), v);
  EXPECT_EQ(st.code(), cl::errc::invalid_argument);
  EXPECT_EQ(st.argument(), "labels");
  p.labels = nullptr;
  p.key_groups = nullptr;
  st = core.step(p, 10.0f, 1.0f, dq.data(), dk.data(), v);
  EXPECT_EQ(st.code(), cl::errc::null_pointer);
  EXPECT_EQ(st.argument(), "key_groups");
  p.key_groups = ids.data();
  p.query_groups = nullptr;
  st = core.step(p, 10.0f, 1.0f, dq.data(), dk.data(), v);
  EXPECT_EQ(st.argument(), "query_groups");
  EXPECT_EQ(std::vector<float>(n * dim, poison), dq);
  EXPECT_EQ(std::vector<float>(n * dim, poison), dk);
  EXPECT_EQ(cl::check_device_problem(p).argument(), "key_groups");
  p.query_groups = ids.data();
  EXPECT_EQ(cl::check_device_problem(p).code(), cl::errc::invalid_argument);
  EXPECT_EQ(core.passes(), 0);
}

// Over 2 and 3 thread ranks, each with its own rows' ids (a rank's positives lie on other ranks), every objective
// matches the float64 reference of the concatenated batch; ranks whose ids disagree in kind are refused on every rank.
TEST(Groups, RanksMatchTheReference)
{
  const std::size_t n_q = 31, n_k = 62, dim = 16;
  const auto q = ct::random_rows<float>(n_q, dim, 61), k = ct::random_rows<float>(n_k, dim, 62);
  const batch_ids ids = make_ids(1, n_q, n_k, 63);
  for (cl::objective obj : {cl::objective::symmetric, cl::objective::info_nce, cl::objective::sigmoid})
  {
    const float bias = obj == cl::objective::sigmoid ? -2.0f : 0.0f;
    const grouped_ref ref =
        grouped_reference(ct::to_double(q), ct::to_double(k), n_q, n_k, dim, ids.q, ids.k, obj, 9.0, bias);
    for (int ranks = 2; ranks <= 3; ++ranks)
    {
      SCOPED_TRACE(std::string(cl::to_string(obj)) + " ranks " + std::to_string(ranks));
      ct::run_ranks(ranks,
                    [&](ct::thread_comm c)
                    {
                      const std::size_t r = static_cast<std::size_t>(c.rank()), w = static_cast<std::size_t>(c.size());
                      const std::size_t q0 = n_q * r / w, q1 = n_q * (r + 1) / w, k0 = n_k * r / w,
                                        k1 = n_k * (r + 1) / w;
                      const std::vector<float> qm(q.begin() + q0 * dim, q.begin() + q1 * dim);
                      const std::vector<float> km(k.begin() + k0 * dim, k.begin() + k1 * dim);
                      const std::vector<std::int64_t> qi(ids.q.begin() + q0, ids.q.begin() + q1);
                      const std::vector<std::int64_t> ki(ids.k.begin() + k0, ids.k.begin() + k1);
                      cl::core<float, cl::algorithm::chunked, cl::gemm::builtin, ct::thread_comm> dist(c, 1);
                      std::vector<float> dq((q1 - q0) * dim), dk((k1 - k0) * dim);
                      cl::problem<float> p{qm.data(), km.data(), q1 - q0, k1 - k0, dim, nullptr, obj};
                      p.query_groups = qi.data();
                      p.key_groups = ki.data();
                      cl::core_values v;
                      cl::status st = dist.step(p, 9.0f, bias, 1.0f, dq.data(), dk.data(), v);
                      ASSERT_TRUE(st.ok()) << st.message();
                      EXPECT_NEAR(v.loss, ref.loss, 1e-5 * (1 + ref.loss));
                      EXPECT_NEAR(v.grad_logit_scale, ref.dlogs, 1e-4 * (1 + std::fabs(ref.dlogs)));
                      const std::vector<double> want_q(ref.dq.begin() + q0 * dim, ref.dq.begin() + q1 * dim);
                      const std::vector<double> want_k(ref.dk.begin() + k0 * dim, ref.dk.begin() + k1 * dim);
                      EXPECT_LE(ct::max_rel_error(dq, want_q), 1e-5);
                      EXPECT_LE(ct::max_rel_error(dk, want_k), 1e-5);
                      // Rank 1 without ids: refused everywhere, naming the rank.
                      if (c.rank() == 1)
                      {
                        p.query_groups = p.key_groups = nullptr;
                      }
                      st = dist.step(p, 9.0f, bias, 1.0f, dq.data(), dk.data(), v);
                      EXPECT_FALSE(st.ok());
                      EXPECT_NE(st.message().find("rank 1"), std::string::npos) << st.message();
                      // Without ids a rectangular symmetric batch is refused by rank 1's own shape rule first;
                      // otherwise by the ranks' agreement, naming the ids.
                      if (st.argument() != "n_k")
                      {
                        EXPECT_EQ(st.argument(), "query_groups") << st.message();
                        EXPECT_NE(st.message().find("neither labels nor group ids where rank 0 passed group ids"),
                                  std::string::npos)
                            << st.message();
                      }
                    });
    }
  }
}

// A trained batch: each key next to its query at a large logit scale, a few images with a second caption (so the step
// stays grouped). Rows with one positive sit just above their floor: their loss is log1p of a tiny sum and G on the
// positive is minus that sum. Formed as lse - mean positive and P - 1 / |P|, they lost their digits (d loss / d log s
// was 6e-2 relative off at s = 30, 0.2 for CLIP); numeric/groups.hpp's forms keep them, on every algorithm and over
// ranks (whose columns' positives are combined across them).
TEST(Groups, TrainedBatchKeepsItsDigits)
{
  const std::size_t n = 64, extra = 8, dim = 32, n_k = n + extra;
  std::mt19937 rng(70);
  std::normal_distribution<float> normal;
  const auto unit = [&](std::vector<float>& rows, std::size_t row, const float* near, float noise)
  {
    double norm = 0.0;
    for (std::size_t c = 0; c < dim; ++c)
    {
      float& x = rows[row * dim + c];
      x = (near != nullptr ? near[c] : 0.0f) + noise * normal(rng);
      norm += static_cast<double>(x) * x;
    }
    for (std::size_t c = 0; c < dim; ++c)
    {
      rows[row * dim + c] = static_cast<float>(rows[row * dim + c] / std::sqrt(norm));
    }
  };
  std::vector<float> q(n * dim), k(n_k * dim);
  std::vector<std::int64_t> qid(n), kid(n_k);
  for (std::size_t i = 0; i < n; ++i)
  {
    unit(q, i, nullptr, 1.0f);
    qid[i] = static_cast<std::int64_t>(i);
  }
  for (std::size_t j = 0; j < n_k; ++j)
  {
    unit(k, j, &q[(j % n) * dim], 0.01f);
    kid[j] = static_cast<std::int64_t>(j % n);
  }
  for (cl::objective obj : {cl::objective::symmetric, cl::objective::info_nce})
  {
    for (float s : {30.0f, 100.0f})
    {
      const grouped_ref ref = grouped_reference(ct::to_double(q), ct::to_double(k), n, n_k, dim, qid, kid, obj, s, 0.0);
      const auto check = [&](const char* what, const cl::core_values& v, double dq_err, double dk_err)
      {
        SCOPED_TRACE(std::string(what) + " " + cl::to_string(obj) + " s " + std::to_string(s));
        EXPECT_NEAR(v.loss, ref.loss, 1e-6 * ref.loss);
        EXPECT_NEAR(v.grad_logit_scale, ref.dlogs, 2e-3 * std::fabs(ref.dlogs));
        // Two positives of one row differ by ~1e-4 of their logits, which float32 products give to ~1e-3.
        EXPECT_LE(dq_err, 2e-3);
        EXPECT_LE(dk_err, 2e-3);
      };
      const auto one = [&](auto algorithm)
      {
        using A = decltype(algorithm);
        cl::core<float, A> core(2);
        cl::problem<float> p{q.data(), k.data(), n, n_k, dim, nullptr, obj};
        p.query_groups = qid.data();
        p.key_groups = kid.data();
        std::vector<float> dq(q.size(), poison), dk(k.size(), poison);
        cl::core_values v;
        const cl::status st = core.step(p, s, 0.0f, 1.0f, dq.data(), dk.data(), v);
        ASSERT_TRUE(st.ok()) << st.message();
        check(A::name, v, ct::max_rel_error(dq, ref.dq), ct::max_rel_error(dk, ref.dk));
      };
      one(cl::algorithm::fused{});
      one(cl::algorithm::materialized{});
      one(cl::algorithm::chunked{});
      ct::run_ranks(3,
                    [&](ct::thread_comm c)
                    {
                      const std::size_t r = static_cast<std::size_t>(c.rank());
                      const std::size_t q0 = n * r / 3, q1 = n * (r + 1) / 3, k0 = n_k * r / 3, k1 = n_k * (r + 1) / 3;
                      cl::problem<float> p{&q[q0 * dim], &k[k0 * dim], q1 - q0, k1 - k0, dim, nullptr, obj};
                      p.query_groups = &qid[q0];
                      p.key_groups = &kid[k0];
                      cl::core<float, cl::algorithm::fused, cl::gemm::builtin, ct::thread_comm> dist(c, 1);
                      std::vector<float> dq((q1 - q0) * dim, poison), dk((k1 - k0) * dim, poison);
                      cl::core_values v;
                      const cl::status st = dist.step(p, s, 0.0f, 1.0f, dq.data(), dk.data(), v);
                      ASSERT_TRUE(st.ok()) << st.message();
                      // Relative to the whole batch's largest gradient, as in one process: a rank whose rows have
                      // no second caption holds gradients of ~1e-22 at s = 100, below what the float64 reference
                      // keeps (it forms P - 1 / |P| by subtraction, good to ~1e-17).
                      const auto err = [](const std::vector<float>& got, const double* want, double scale)
                      {
                        double e = 0.0;
                        for (std::size_t x = 0; x < got.size(); ++x)
                        {
                          e = std::max(e, std::fabs(static_cast<double>(got[x]) - want[x]));
                        }
                        return e / scale;
                      };
                      check("3 ranks",
                            v,
                            err(dq, &ref.dq[q0 * dim], max_abs(ref.dq)),
                            err(dk, &ref.dk[k0 * dim], max_abs(ref.dk)));
                    });
    }
  }
}

// The positives' buffers are held only by the steps that use them: after a grouped step, a step without ids holds
// what a fresh core's holds, and a grouped step after it what a fresh grouped one holds (every host algorithm).
template <class A>
void buffers_follow_the_step()
{
  const std::size_t n = 300, dim = 16;
  const auto q = ct::random_rows<float>(n, dim, 81), k = ct::random_rows<float>(n, dim, 82);
  const batch_ids ids = make_ids(1, n, n, 83);
  std::vector<float> dq(n * dim), dk(n * dim);
  for (cl::objective obj : {cl::objective::symmetric, cl::objective::info_nce, cl::objective::sigmoid})
  {
    SCOPED_TRACE(std::string(A::name) + " " + cl::to_string(obj));
    cl::problem<float> plain{q.data(), k.data(), n, n, dim, nullptr, obj};
    cl::problem<float> grouped = plain;
    grouped.query_groups = ids.q.data();
    grouped.key_groups = ids.k.data();
    const auto held = [&](cl::core<float, A>& c, const cl::problem<float>& p)
    {
      cl::core_values v;
      const cl::status st =
          c.step(p, 10.0f, obj == cl::objective::sigmoid ? -2.0f : 0.0f, 1.0f, dq.data(), dk.data(), v);
      EXPECT_TRUE(st.ok()) << st.message();
      return c.bytes_held();
    };
    cl::core<float, A> used(2), fresh_plain(2), fresh_grouped(2);
    const std::size_t with_ids = held(used, grouped);
    EXPECT_EQ(held(used, plain), held(fresh_plain, plain));
    EXPECT_EQ(held(used, grouped), held(fresh_grouped, grouped));
    EXPECT_EQ(with_ids, fresh_grouped.bytes_held());
  }
}

TEST(Groups, BuffersFollowTheStep)
{
  buffers_follow_the_step<cl::algorithm::fused>();
  buffers_follow_the_step<cl::algorithm::materialized>();
  buffers_follow_the_step<cl::algorithm::chunked>();
  buffers_follow_the_step<cl::algorithm::automatic>();
}

// positive_stats: absorbing a row's positives one by one or merging any split of them gives the same state (max and
// count exactly, deficit and gap to float rounding) as float64 from the definition; ties with an infinite max add 0.
TEST(Groups, PositiveStatsMergeLikeOneStream)
{
  std::mt19937 rng(91);
  std::uniform_real_distribution<float> logit(-60.0f, 60.0f);
  for (int trial = 0; trial < 500; ++trial)
  {
    const std::size_t n = 1 + rng() % 40;
    std::vector<float> x(n);
    for (float& v : x)
    {
      v = rng() % 4 == 0 ? 7.0f : logit(rng); // ties too
    }
    const std::size_t cut = rng() % (n + 1);
    cl::positive_stats one, left, right;
    for (std::size_t i = 0; i < n; ++i)
    {
      one.absorb(x[i]);
      (i < cut ? left : right).absorb(x[i]);
    }
    right.merge(left);
    const double m = *std::max_element(x.begin(), x.end());
    double deficit = 0.0, gap = 0.0;
    for (float v : x)
    {
      deficit += std::expm1(static_cast<double>(v) - m);
      gap += m - static_cast<double>(v);
    }
    for (const cl::positive_stats& s : {one, right})
    {
      ASSERT_EQ(s.max, static_cast<float>(m));
      ASSERT_EQ(s.count, static_cast<float>(n));
      ASSERT_NEAR(s.deficit, deficit, 1e-5 * (1.0 + std::fabs(deficit))) << "trial " << trial;
      ASSERT_NEAR(s.gap, gap, 1e-5 * (1.0 + gap)) << "trial " << trial;
    }
  }
  for (float inf : {cl::detail::infinity_f, -cl::detail::infinity_f})
  {
    cl::positive_stats s;
    s.absorb(inf);
    s.absorb(inf);
    EXPECT_EQ(s.max, inf);
    EXPECT_EQ(s.deficit, 0.0f);
    EXPECT_EQ(s.gap, 0.0f);
    EXPECT_EQ(s.count, 2.0f);
  }
}
