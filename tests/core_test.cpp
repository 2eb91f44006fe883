// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// contrastive::core, the policy-free call (problem, s, loss scale) -> loss, dQ, dK, d loss / d log s: against the
// float64 reference, bit for bit against contrastive::loss with a fixed temperature and a static scale (the same
// step driver), forward + backward against step, its refusals (nothing written), and over 2-4 thread ranks against
// one process on the concatenated batch.

#include "test_util.hpp"
#include "thread_comm.hpp"

#include <contrastive/core.hpp>
#include <contrastive/distributed/loss.hpp>

#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace cl = contrastive;
namespace ct = contrastive_test;

// The constructors of one process and of ranks do not overlap: `{}` arguments pick the only one there is, and a
// distributed loss is never built from a temperature alone (which would make a default communicator silently).
static_assert(std::is_constructible_v<cl::loss<float>, cl::temperature::learnable, cl::scaler::static_scale>);
static_assert(std::is_default_constructible_v<cl::loss<float>>);
static_assert(std::is_default_constructible_v<cl::distributed::loss<float>>);
static_assert(!std::is_constructible_v<cl::distributed::loss<float>, cl::temperature::learnable>);
static_assert(!std::is_constructible_v<cl::loss<float>, cl::distributed::comm::self>);
static_assert(std::is_constructible_v<cl::core<float>, unsigned>);

namespace
{
constexpr float poison = 1234.5f;

template <class T>
std::vector<T> poisoned(std::size_t n)
{
  return std::vector<T>(n, cl::element_traits<T>::from_float(poison));
}

template <class T>
bool untouched(const std::vector<T>& v)
{
  for (const T& x : v)
  {
    if (cl::element_traits<T>::to_float(x) !=
        cl::element_traits<T>::to_float(cl::element_traits<T>::from_float(poison)))
    {
      return false;
    }
  }
  return true;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b)
{
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T, class Algorithm>
void matches_reference_and_loss(cl::objective obj, bool labels, std::uint32_t seed)
{
  const std::size_t n_q = 70, n_k = obj == cl::objective::symmetric ? 70 : 93, dim = 40;
  SCOPED_TRACE(std::string(cl::element_traits<T>::name) + " " + Algorithm::name + " " + cl::to_string(obj) +
               (labels ? " labels" : ""));
  const auto q = ct::random_rows<T>(n_q, dim, seed), k = ct::random_rows<T>(n_k, dim, seed + 1);
  const auto lab = ct::random_labels(n_q, n_k, seed + 2);
  const cl::problem<T> p{q.data(), k.data(), n_q, n_k, dim, labels ? lab.data() : nullptr, obj};
  const float tau = 0.05f, loss_scale = std::is_same_v<T, float> ? 1.0f : 512.0f;
  const float s = cl::temperature::fixed(tau).scale(); // the loss's s, so that both runs see the same bits

  cl::core<T, Algorithm> core(2);
  auto dq = poisoned<T>(n_q * dim), dk = poisoned<T>(n_k * dim);
  cl::core_values v;
  const cl::status st = core.step(p, s, loss_scale, dq.data(), dk.data(), v);
  ASSERT_TRUE(st.ok()) << st.message();

  // Float64 reference at the same s: loss, gradients (unscaled) and d loss / d log s.
  const ct::reference ref =
      ct::compute_reference(ct::to_double(q), ct::to_double(k), n_q, n_k, dim, p.labels, obj, double(s));
  using tol = ct::tolerance<T, Algorithm>;
  EXPECT_NEAR(v.loss, ref.loss, tol::loss(ref.max_abs_logit));
  EXPECT_LE(ct::max_rel_error(dq, ref.dq, 1.0 / loss_scale), tol::grad(ref.max_abs_logit));
  EXPECT_LE(ct::max_rel_error(dk, ref.dk, 1.0 / loss_scale), tol::grad(ref.max_abs_logit));
  EXPECT_NEAR(v.grad_logit_scale, ref.grad_logit_scale, 64 * tol::grad(ref.max_abs_logit) * (1 + ref.loss));
  EXPECT_EQ(v.first_nonfinite, cl::nonfinite_site::none);

  // The stateful loss with a fixed temperature and a static scale: the same driver, the same bits.
  cl::loss<T, cl::temperature::fixed, cl::scaler::static_scale, Algorithm> l(
      cl::temperature::fixed(tau), cl::scaler::static_scale(loss_scale), 2);
  auto dq1 = poisoned<T>(n_q * dim), dk1 = poisoned<T>(n_k * dim);
  cl::step_record rec;
  ASSERT_TRUE(l.step(p, dq1.data(), dk1.data(), rec).ok());
  EXPECT_EQ(v.loss, rec.loss);
  EXPECT_EQ(v.grad_logit_scale, rec.grad_logit_scale);
  EXPECT_EQ(v.max_logit, rec.max_logit);
  EXPECT_TRUE(same_bits(dq, dq1));
  EXPECT_TRUE(same_bits(dk, dk1));

  // forward, then backward: the same as step; the log-sum-exps come out as the loss's forward gives them.
  auto dq2 = poisoned<T>(n_q * dim), dk2 = poisoned<T>(n_k * dim);
  cl::step::forward_values f;
  cl::step::backward_values b;
  std::vector<float> row_lse(n_q), col_lse(n_k), row_lse1(n_q), col_lse1(n_k);
  ASSERT_TRUE(core.forward(p, s, f, row_lse.data(), col_lse.data()).ok());
  ASSERT_TRUE(core.backward(loss_scale, dq2.data(), dk2.data(), b).ok());
  EXPECT_EQ(f.loss, v.loss);
  EXPECT_EQ(b.grad_logit_scale / loss_scale, v.grad_logit_scale);
  EXPECT_TRUE(same_bits(dq2, dq));
  EXPECT_TRUE(same_bits(dk2, dk));
  float value = 0.0f;
  ASSERT_TRUE(l.forward(p, value, row_lse1.data(), col_lse1.data()).ok());
  EXPECT_EQ(row_lse, row_lse1);
  if (obj == cl::objective::symmetric)
  {
    EXPECT_EQ(col_lse, col_lse1);
  }
  EXPECT_EQ(core.passes(), 2);
}
} // namespace

TEST(Core, MatchesTheReferenceAndTheLossBitForBit)
{
  std::uint32_t seed = 10;
  for (cl::objective obj : {cl::objective::symmetric, cl::objective::info_nce})
  {
    const bool labels = obj == cl::objective::info_nce;
    matches_reference_and_loss<float, cl::algorithm::fused>(obj, labels, seed += 5);
    matches_reference_and_loss<float, cl::algorithm::materialized>(obj, labels, seed += 5);
    matches_reference_and_loss<float, cl::algorithm::chunked>(obj, labels, seed += 5);
    matches_reference_and_loss<__half, cl::algorithm::fused>(obj, labels, seed += 5);
    matches_reference_and_loss<__half, cl::algorithm::chunked>(obj, labels, seed += 5);
    matches_reference_and_loss<__nv_bfloat16, cl::algorithm::fused>(obj, labels, seed += 5);
    matches_reference_and_loss<__nv_bfloat16, cl::algorithm::materialized>(obj, labels, seed += 5);
  }
}

// Bad scales are refused naming the argument, with nothing written and a ready forward kept.
TEST(Core, BadScalesAreRefusedAndWriteNothing)
{
  const std::size_t n = 16, dim = 8;
  const auto q = ct::random_rows<float>(n, dim, 3), k = ct::random_rows<float>(n, dim, 4);
  const cl::problem<float> p{q.data(), k.data(), n, n, dim};
  cl::core<float> core(1);
  auto dq = poisoned<float>(n * dim), dk = poisoned<float>(n * dim);
  cl::core_values v;
  for (float s : {0.0f, -1.0f, INFINITY, NAN})
  {
    const cl::status st = core.step(p, s, 1.0f, dq.data(), dk.data(), v);
    EXPECT_EQ(st.code(), cl::errc::invalid_temperature) << s;
    EXPECT_EQ(st.argument(), "logit_scale");
    cl::step::forward_values f;
    EXPECT_EQ(core.forward(p, s, f).code(), cl::errc::invalid_temperature);
  }
  for (float ls : {0.0f, -2.0f, INFINITY, NAN})
  {
    const cl::status st = core.step(p, 10.0f, ls, dq.data(), dk.data(), v);
    EXPECT_EQ(st.code(), cl::errc::invalid_scaler) << ls;
    EXPECT_EQ(st.argument(), "loss_scale");
  }
  EXPECT_TRUE(untouched(dq));
  EXPECT_TRUE(untouched(dk));
  EXPECT_EQ(core.passes(), 0);

  cl::step::backward_values b;
  EXPECT_EQ(core.backward(1.0f, dq.data(), dk.data(), b).argument(), "forward");
  cl::step::forward_values f;
  ASSERT_TRUE(core.forward(p, 10.0f, f).ok());
  EXPECT_EQ(core.backward(NAN, dq.data(), dk.data(), b).argument(), "loss_scale");
  EXPECT_EQ(core.backward(1.0f, dq.data(), dq.data(), b).code(), cl::errc::invalid_argument);
  EXPECT_TRUE(untouched(dq));
  ASSERT_TRUE(core.backward(1.0f, dq.data(), dk.data(), b).ok()); // the forward stayed ready
  EXPECT_FALSE(untouched(dq));
  EXPECT_EQ(core.passes(), 1);
}

// Over 2-4 thread ranks (tests/thread_comm.hpp) each rank's slice equals one process on the concatenated batch, and
// a bad logit scale on one rank is refused on every rank, naming it.
TEST(Core, RanksMatchOneProcess)
{
  const std::size_t n = 37, dim = 24;
  const auto q = ct::random_rows<float>(n, dim, 81), k = ct::random_rows<float>(n, dim, 82);
  cl::core<float, cl::algorithm::fused> one(1);
  std::vector<float> dq1(n * dim), dk1(n * dim);
  cl::core_values v1;
  ASSERT_TRUE(one.step({q.data(), k.data(), n, n, dim}, 14.0f, 8.0f, dq1.data(), dk1.data(), v1).ok());
  for (int ranks = 2; ranks <= 4; ++ranks)
  {
    SCOPED_TRACE("ranks " + std::to_string(ranks));
    ct::run_ranks(ranks,
                  [&](ct::thread_comm c)
                  {
                    const std::size_t r = static_cast<std::size_t>(c.rank()), w = static_cast<std::size_t>(c.size());
                    const std::size_t b0 = n * r / w, b1 = n * (r + 1) / w, m = b1 - b0;
                    const std::vector<float> qm(q.begin() + b0 * dim, q.begin() + b1 * dim);
                    const std::vector<float> km(k.begin() + b0 * dim, k.begin() + b1 * dim);
                    cl::core<float, cl::algorithm::fused, cl::gemm::builtin, ct::thread_comm> dist(c, 1);
                    std::vector<float> dq(m * dim), dk(m * dim);
                    cl::core_values v;
                    const cl::problem<float> p{qm.data(), km.data(), m, m, dim};
                    cl::status st = dist.step(p, 14.0f, 8.0f, dq.data(), dk.data(), v);
                    ASSERT_TRUE(st.ok()) << st.message();
                    EXPECT_EQ(dist.global_queries(), n);
                    EXPECT_NEAR(v.loss, v1.loss, 1e-6 * v1.loss);
                    EXPECT_NEAR(v.grad_logit_scale, v1.grad_logit_scale, 1e-5 * (1 + std::fabs(v1.grad_logit_scale)));
                    const std::vector<float> want_q(dq1.begin() + b0 * dim, dq1.begin() + b1 * dim);
                    const std::vector<float> want_k(dk1.begin() + b0 * dim, dk1.begin() + b1 * dim);
                    EXPECT_LE(ct::rel_diff(dq, want_q), 1e-6);
                    EXPECT_LE(ct::rel_diff(dk, want_k), 1e-6);
                    st = dist.step(p, c.rank() == 1 ? -1.0f : 14.0f, 8.0f, dq.data(), dk.data(), v);
                    EXPECT_EQ(st.code(), cl::errc::invalid_temperature);
                    EXPECT_EQ(st.argument(), "logit_scale");
                    EXPECT_NE(st.message().find("rank 1:"), std::string::npos) << st.message();
                  });
  }
}
