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

#include <cmath>
#include <cstring>
#include <limits>
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

namespace
{
// A loss scale near float's largest value, as a dynamic scaler reaches while the gradients are tiny (a trained batch:
// each key near its query): loss_scale * s (6e38) is past float's range, the gradients of loss_scale * loss and
// d(loss_scale * loss)/d log s are not. Each algorithm gives them finite and as at loss scale 1.
template <class Algorithm>
void huge_loss_scale_keeps_gradients_that_fit(cl::objective obj, std::uint32_t seed)
{
  SCOPED_TRACE(std::string(Algorithm::name) + " " + cl::to_string(obj));
  const std::size_t n = 24, dim = 16;
  const auto q = ct::random_rows<float>(n, dim, seed), noise = ct::random_rows<float>(n, dim, seed + 1);
  std::vector<float> k(n * dim);
  for (std::size_t i = 0; i < k.size(); ++i)
  {
    k[i] = q[i] + 0.3f * noise[i];
  }
  const cl::problem<float> p{q.data(), k.data(), n, n, dim, nullptr, obj};
  const float s = 20.0f, b = obj == cl::objective::sigmoid ? -14.0f : 0.0f, big = 3e37f;
  ASSERT_FALSE(std::isfinite(big * s));
  cl::core<float, Algorithm> core(2);
  if constexpr (std::is_same_v<Algorithm, cl::algorithm::chunked>)
  {
    ASSERT_TRUE(core.set_chunk({8, 0}).ok());
  }
  auto dq = poisoned<float>(n * dim), dk = poisoned<float>(n * dim);
  auto dq1 = poisoned<float>(n * dim), dk1 = poisoned<float>(n * dim);
  cl::core_values v, v1;
  ASSERT_TRUE(core.step(p, s, b, big, dq.data(), dk.data(), v).ok());
  ASSERT_TRUE(core.step(p, s, b, 1.0f, dq1.data(), dk1.data(), v1).ok());
  ASSERT_LT(std::fabs(v1.grad_logit_scale) * big, 1e38f); // the test's premise: the scaled values fit in float
  ASSERT_LT(std::fabs(v1.grad_logit_bias) * big, 1e38f);
  EXPECT_EQ(v.first_nonfinite, cl::nonfinite_site::none);
  const auto near = [&](const std::vector<float>& scaled, const std::vector<float>& one)
  {
    double worst = 0.0, top = 0.0;
    for (std::size_t i = 0; i < one.size(); ++i)
    {
      top = std::max(top, std::fabs(double(one[i])));
      worst = std::max(worst, std::fabs(double(scaled[i]) / double(big) - double(one[i])));
    }
    return worst / top;
  };
  EXPECT_LE(near(dq, dq1), 1e-6);
  EXPECT_LE(near(dk, dk1), 1e-6);
  EXPECT_NEAR(v.grad_logit_scale, v1.grad_logit_scale, 1e-5 * (1.0 + std::fabs(v1.grad_logit_scale)));
  EXPECT_NEAR(v.grad_logit_bias, v1.grad_logit_bias, 1e-5 * (1.0 + std::fabs(v1.grad_logit_bias)));
}
} // namespace

TEST(Core, ALossScaleNearFloatsLargestKeepsGradientsThatFit)
{
  std::uint32_t seed = 40;
  for (cl::objective obj : {cl::objective::symmetric, cl::objective::info_nce, cl::objective::sigmoid})
  {
    huge_loss_scale_keeps_gradients_that_fit<cl::algorithm::fused>(obj, seed += 2);
    huge_loss_scale_keeps_gradients_that_fit<cl::algorithm::chunked>(obj, seed += 2);
    huge_loss_scale_keeps_gradients_that_fit<cl::algorithm::materialized>(obj, seed += 2);
  }
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

// ---------------------------------------------------------------------------------------------------------------------
// The sigmoid objective (SigLIP): every element type x algorithm x label mode against the float64 reference, the
// library's gradients against central differences of its own loss, ranks against one process, the bias's refusals,
// a learnable bias's update and checkpoint, tiny losses to float accuracy, and the fp16 overflow path.

namespace
{
enum class labels_mode
{
  diagonal,
  labels,
  rectangular, // n_k > n_q, diagonal positives
};

/// Shapes of the reference cases: small (one key tile per row block), and large enough for several row blocks, key
/// tiles and (3 workers) rounds of the fused pass, from the code's own block sizes.
struct sigmoid_shape
{
  std::size_t n_q, n_k, dim;
  unsigned threads;
};

template <class T, class Algorithm>
void sigmoid_matches_reference(labels_mode mode, float s, float b, std::uint32_t seed, sigmoid_shape shape = {})
{
  if (shape.n_q == 0)
  {
    shape = {70, mode == labels_mode::diagonal ? std::size_t(70) : std::size_t(93), 40, 2};
  }
  const std::size_t n_q = shape.n_q, n_k = shape.n_k, dim = shape.dim;
  SCOPED_TRACE(std::string(cl::element_traits<T>::name) + " " + Algorithm::name + " mode " +
               std::to_string(static_cast<int>(mode)) + " s " + std::to_string(s) + " b " + std::to_string(b));
  const auto q = ct::random_rows<T>(n_q, dim, seed), k = ct::random_rows<T>(n_k, dim, seed + 1);
  const auto lab = ct::random_labels(n_q, n_k, seed + 2);
  const cl::problem<T> p{
      q.data(), k.data(), n_q, n_k, dim, mode == labels_mode::labels ? lab.data() : nullptr, cl::objective::sigmoid};
  const float loss_scale = std::is_same_v<T, float> ? 1.0f : 1024.0f;

  cl::core<T, Algorithm> core(shape.threads);
  if constexpr (std::is_same_v<Algorithm, cl::algorithm::chunked>)
  {
    ASSERT_TRUE(core.set_chunk({16, 0}).ok()); // several chunks: the backward recomputes z
  }
  auto dq = poisoned<T>(n_q * dim), dk = poisoned<T>(n_k * dim);
  cl::core_values v;
  const cl::status st = core.step(p, s, b, loss_scale, dq.data(), dk.data(), v);
  ASSERT_TRUE(st.ok()) << st.message();

  const ct::reference ref =
      ct::compute_sigmoid_reference(ct::to_double(q), ct::to_double(k), n_q, n_k, dim, p.labels, double(s), double(b));
  // Tolerances from the element type: the materialized path rounds S and z to T (each logit moves by u_T |z|, the
  // loss by u_T times its sensitivity sum |G| |z|) and the gradient chain (as the softmax tolerance); the float paths
  // round once at the output.
  using tol = ct::tolerance<T, Algorithm>;
  const double loss_tol = tol::materialized ? 4.0 * tol::u_t * (1.0 + ref.loss_sensitivity) + 64 * tol::u_f
                                            : 64 * tol::u_f * (1.0 + ref.loss + ref.loss_sensitivity);
  EXPECT_NEAR(v.loss, ref.loss, loss_tol);
  EXPECT_LE(ct::max_rel_error(dq, ref.dq, 1.0 / loss_scale), tol::grad(ref.max_abs_logit));
  EXPECT_LE(ct::max_rel_error(dk, ref.dk, 1.0 / loss_scale), tol::grad(ref.max_abs_logit));
  const double gtol = 64 * tol::grad(ref.max_abs_logit) * (1.0 + ref.loss_sensitivity);
  EXPECT_NEAR(v.grad_logit_scale, ref.grad_logit_scale, gtol);
  EXPECT_NEAR(v.grad_logit_bias, ref.grad_logit_bias, gtol);
  EXPECT_EQ(v.first_nonfinite, cl::nonfinite_site::none);
  EXPECT_NEAR(v.max_logit, ref.max_logit, 8 * tol::u_t * (1.0 + ref.max_abs_logit));

  // forward, then backward: the same bits as step; row_lse receives each row's loss.
  auto dq2 = poisoned<T>(n_q * dim), dk2 = poisoned<T>(n_k * dim);
  cl::step::forward_values f;
  cl::step::backward_values bv;
  std::vector<float> rows(n_q, poison);
  ASSERT_TRUE(core.forward(p, s, b, f, rows.data()).ok());
  ASSERT_TRUE(core.backward(loss_scale, dq2.data(), dk2.data(), bv).ok());
  EXPECT_EQ(f.loss, v.loss);
  EXPECT_EQ(bv.grad_logit_bias / loss_scale, v.grad_logit_bias);
  EXPECT_TRUE(same_bits(dq2, dq));
  EXPECT_TRUE(same_bits(dk2, dk));
  for (std::size_t i = 0; i < n_q; i += 7)
  {
    EXPECT_NEAR(rows[i], ref.row_lse[i], n_q * loss_tol) << "row " << i;
  }

  // The stateful loss with a fixed temperature, a fixed bias and a static scale: the same driver, the same bits.
  cl::loss<T, cl::temperature::fixed, cl::scaler::static_scale, Algorithm> l(
      cl::temperature::fixed(1.0f / s), cl::scaler::static_scale(loss_scale), shape.threads);
  if constexpr (std::is_same_v<Algorithm, cl::algorithm::chunked>)
  {
    ASSERT_TRUE(l.set_chunk({16, 0}).ok());
  }
  ASSERT_TRUE(l.set_logit_bias(cl::logit_bias::fixed(b)).ok());
  auto dq1 = poisoned<T>(n_q * dim), dk1 = poisoned<T>(n_k * dim);
  cl::step_record rec;
  ASSERT_TRUE(l.step(p, dq1.data(), dk1.data(), rec).ok());
  if (l.temperature().scale() == s)
  {
    EXPECT_EQ(rec.loss, v.loss);
    EXPECT_EQ(rec.grad_logit_bias, v.grad_logit_bias);
    EXPECT_EQ(rec.logit_bias, b);
    EXPECT_TRUE(same_bits(dq1, dq));
  }
}

template <class T, class Algorithm>
float sigmoid_loss_of(const std::vector<T>& q,
                      const std::vector<T>& k,
                      std::size_t n_q,
                      std::size_t n_k,
                      std::size_t dim,
                      float s,
                      float b)
{
  cl::core<T, Algorithm> core(1);
  cl::step::forward_values f;
  const cl::problem<T> p{q.data(), k.data(), n_q, n_k, dim, nullptr, cl::objective::sigmoid};
  EXPECT_TRUE(core.forward(p, s, b, f).ok());
  return f.loss;
}
} // namespace

TEST(Sigmoid, MatchesTheFloat64Reference)
{
  std::uint32_t seed = 300;
  for (labels_mode mode : {labels_mode::diagonal, labels_mode::labels, labels_mode::rectangular})
  {
    for (const auto& sb : {std::pair<float, float>{10.0f, -10.0f}, std::pair<float, float>{25.0f, -3.0f}})
    {
      const float s = sb.first, b = sb.second;
      sigmoid_matches_reference<float, cl::algorithm::fused>(mode, s, b, seed += 3);
      sigmoid_matches_reference<float, cl::algorithm::materialized>(mode, s, b, seed += 3);
      sigmoid_matches_reference<float, cl::algorithm::chunked>(mode, s, b, seed += 3);
      sigmoid_matches_reference<__half, cl::algorithm::fused>(mode, s, b, seed += 3);
      sigmoid_matches_reference<__half, cl::algorithm::materialized>(mode, s, b, seed += 3);
      sigmoid_matches_reference<__half, cl::algorithm::chunked>(mode, s, b, seed += 3);
      sigmoid_matches_reference<__nv_bfloat16, cl::algorithm::fused>(mode, s, b, seed += 3);
      sigmoid_matches_reference<__nv_bfloat16, cl::algorithm::materialized>(mode, s, b, seed += 3);
      sigmoid_matches_reference<__nv_bfloat16, cl::algorithm::chunked>(mode, s, b, seed += 3);
    }
  }
}

// Several row blocks, key tiles and fused rounds (3 workers): the rows' losses summed over key tiles and rounds,
// positives in tiles a later round reaches, the in-place accumulation (dim = 2 NR, float) and the engine's (dim odd).
TEST(Sigmoid, ManyTilesMatchTheFloat64Reference)
{
  const std::size_t n_q = 2 * cl::host::block_m + 3, n_k = 2 * cl::host::block_n + 5;
  std::uint32_t seed = 900;
  for (std::size_t dim : {std::size_t(2 * cl::host::kernel_nr), std::size_t(33)})
  {
    const sigmoid_shape shape{n_q, n_k, dim, 3};
    sigmoid_matches_reference<float, cl::algorithm::fused>(labels_mode::labels, 20.0f, -8.0f, seed += 3, shape);
    sigmoid_matches_reference<float, cl::algorithm::fused>(labels_mode::rectangular, 10.0f, -10.0f, seed += 3, shape);
    sigmoid_matches_reference<float, cl::algorithm::chunked>(labels_mode::labels, 20.0f, -8.0f, seed += 3, shape);
    sigmoid_matches_reference<__nv_bfloat16, cl::algorithm::materialized>(
        labels_mode::rectangular, 10.0f, -10.0f, seed += 3, shape);
  }
}

// The reference's analytic gradients match its own central differences (q, k, log s, b), and the library's float
// gradients (every algorithm) match central differences of the library's float loss.
TEST(Sigmoid, FiniteDifferences)
{
  const std::size_t n_q = 9, n_k = 11, dim = 6;
  const auto qf = ct::random_rows<float>(n_q, dim, 41), kf = ct::random_rows<float>(n_k, dim, 42);
  const auto q = ct::to_double(qf), k = ct::to_double(kf);
  const double s = 6.0, b = -2.0, h = 1e-6;
  const auto ref_loss = [&](const std::vector<double>& qq, const std::vector<double>& kk, double ss, double bb)
  {
    return ct::compute_sigmoid_reference(qq, kk, n_q, n_k, dim, nullptr, ss, bb).loss;
  };
  const ct::reference ref = ct::compute_sigmoid_reference(q, k, n_q, n_k, dim, nullptr, s, b);
  for (std::size_t idx = 0; idx < n_q * dim; idx += 5)
  {
    auto qp = q, qm = q;
    qp[idx] += h;
    qm[idx] -= h;
    EXPECT_NEAR(ref.dq[idx], (ref_loss(qp, k, s, b) - ref_loss(qm, k, s, b)) / (2 * h), 1e-7);
  }
  for (std::size_t idx = 0; idx < n_k * dim; idx += 5)
  {
    auto kp = k, km = k;
    kp[idx] += h;
    km[idx] -= h;
    EXPECT_NEAR(ref.dk[idx], (ref_loss(q, kp, s, b) - ref_loss(q, km, s, b)) / (2 * h), 1e-7);
  }
  EXPECT_NEAR(
      ref.grad_logit_scale, (ref_loss(q, k, s * std::exp(h), b) - ref_loss(q, k, s * std::exp(-h), b)) / (2 * h), 1e-7);
  EXPECT_NEAR(ref.grad_logit_bias, (ref_loss(q, k, s, b + h) - ref_loss(q, k, s, b - h)) / (2 * h), 1e-7);

  const auto check = [&](auto algo)
  {
    using A = decltype(algo);
    SCOPED_TRACE(A::name);
    cl::core<float, A> core(2);
    std::vector<float> dq(n_q * dim), dk(n_k * dim);
    cl::core_values v;
    const cl::problem<float> p{qf.data(), kf.data(), n_q, n_k, dim, nullptr, cl::objective::sigmoid};
    ASSERT_TRUE(core.step(p, float(s), float(b), 1.0f, dq.data(), dk.data(), v).ok());
    double gmax = 0.0;
    for (float g : dq)
    {
      gmax = std::max(gmax, double(std::fabs(g)));
    }
    const float hf = 2e-3f;
    for (std::size_t idx = 0; idx < n_q * dim; idx += 3)
    {
      auto qp = qf, qm = qf;
      qp[idx] += hf;
      qm[idx] -= hf;
      const double fd = (double(sigmoid_loss_of<float, A>(qp, kf, n_q, n_k, dim, float(s), float(b))) -
                         sigmoid_loss_of<float, A>(qm, kf, n_q, n_k, dim, float(s), float(b))) /
                        (double(qp[idx]) - double(qm[idx]));
      EXPECT_NEAR(dq[idx], fd, 2e-3 * gmax + 1e-4) << "dq " << idx;
    }
    for (std::size_t idx = 0; idx < n_k * dim; idx += 3)
    {
      auto kp = kf, km = kf;
      kp[idx] += hf;
      km[idx] -= hf;
      const double fd = (double(sigmoid_loss_of<float, A>(qf, kp, n_q, n_k, dim, float(s), float(b))) -
                         sigmoid_loss_of<float, A>(qf, km, n_q, n_k, dim, float(s), float(b))) /
                        (double(kp[idx]) - double(km[idx]));
      EXPECT_NEAR(dk[idx], fd, 2e-3 * gmax + 1e-4) << "dk " << idx;
    }
    const float hb = 1e-2f;
    const double fdb = (double(sigmoid_loss_of<float, A>(qf, kf, n_q, n_k, dim, float(s), float(b) + hb)) -
                        sigmoid_loss_of<float, A>(qf, kf, n_q, n_k, dim, float(s), float(b) - hb)) /
                       (2.0 * hb);
    EXPECT_NEAR(v.grad_logit_bias, fdb, 1e-3 * std::fabs(fdb) + 1e-4);
    const double fds = (double(sigmoid_loss_of<float, A>(qf, kf, n_q, n_k, dim, float(s * std::exp(1e-2)), float(b))) -
                        sigmoid_loss_of<float, A>(qf, kf, n_q, n_k, dim, float(s * std::exp(-1e-2)), float(b))) /
                       2e-2;
    EXPECT_NEAR(v.grad_logit_scale, fds, 1e-3 * std::fabs(fds) + 1e-4);
  };
  check(cl::algorithm::fused{});
  check(cl::algorithm::materialized{});
  check(cl::algorithm::chunked{});
}

// Well-separated pairs: every term is tiny (softplus(-|z|) ~ e^-|z|) and the loss keeps its float digits, where
// log(1 + e) computed as a plain log would round it away.
TEST(Sigmoid, TinyLossesKeepTheirDigits)
{
  const std::size_t n = 8, dim = 8;
  std::vector<float> q(n * dim, 0.0f), k(n * dim, 0.0f);
  for (std::size_t i = 0; i < n; ++i)
  {
    q[i * dim + i] = 1.0f; // orthonormal rows: <q_i, k_j> = [i == j]
    k[i * dim + i] = 1.0f;
  }
  // z = s [i == j] + b with s = 60, b = -30: positives z = 30, negatives z = -30; every term is about e^-30.
  const ct::reference ref =
      ct::compute_sigmoid_reference(ct::to_double(q), ct::to_double(k), n, n, dim, nullptr, 60, -30);
  ASSERT_LT(ref.loss, 1e-11);
  for (float got : {sigmoid_loss_of<float, cl::algorithm::fused>(q, k, n, n, dim, 60.0f, -30.0f),
                    sigmoid_loss_of<float, cl::algorithm::materialized>(q, k, n, n, dim, 60.0f, -30.0f),
                    sigmoid_loss_of<float, cl::algorithm::chunked>(q, k, n, n, dim, 60.0f, -30.0f)})
  {
    EXPECT_NEAR(got, ref.loss, 8 * 5.96e-8 * ref.loss);
  }
}

// The bias: finite, and 0 for the softmax objectives (which are invariant to it); a learnable bias is refused with a
// softmax objective; nothing is written by a refused call.
TEST(Sigmoid, BiasRefusals)
{
  const std::size_t n = 16, dim = 8;
  const auto q = ct::random_rows<float>(n, dim, 5), k = ct::random_rows<float>(n, dim, 6);
  cl::core<float> core(1);
  auto dq = poisoned<float>(n * dim), dk = poisoned<float>(n * dim);
  cl::core_values v;
  for (cl::objective obj : {cl::objective::symmetric, cl::objective::info_nce})
  {
    const cl::problem<float> p{q.data(), k.data(), n, n, dim, nullptr, obj};
    const cl::status st = core.step(p, 10.0f, -10.0f, 1.0f, dq.data(), dk.data(), v);
    EXPECT_EQ(st.code(), cl::errc::invalid_argument);
    EXPECT_EQ(st.argument(), "logit_bias");
    EXPECT_NE(st.message().find("sigmoid"), std::string::npos) << st.message();
    EXPECT_TRUE(core.step(p, 10.0f, 0.0f, 1.0f, dq.data(), dk.data(), v).ok()); // 0 is the softmax's bias
  }
  std::fill(dq.begin(), dq.end(), poison);
  std::fill(dk.begin(), dk.end(), poison);
  const cl::problem<float> sp{q.data(), k.data(), n, n, dim, nullptr, cl::objective::sigmoid};
  for (float b : {NAN, INFINITY, -INFINITY})
  {
    const cl::status st = core.step(sp, 10.0f, b, 1.0f, dq.data(), dk.data(), v);
    EXPECT_EQ(st.argument(), "logit_bias") << b;
  }
  EXPECT_TRUE(untouched(dq));
  EXPECT_TRUE(untouched(dk));

  cl::loss<float> l(cl::temperature::learnable(0.1f), cl::scaler::static_scale(1.0f), 1);
  EXPECT_EQ(l.set_logit_bias(cl::logit_bias::fixed(NAN)).argument(), "logit_bias");
  EXPECT_EQ(l.set_logit_bias(cl::logit_bias::learnable(-10.0f, cl::optimizer::sgd(-1.0f))).argument(), "logit_bias");
  ASSERT_TRUE(l.set_logit_bias(cl::logit_bias::learnable(-10.0f)).ok());
  cl::step_record rec;
  const cl::problem<float> soft{q.data(), k.data(), n, n, dim};
  const cl::status st = l.step(soft, dq.data(), dk.data(), rec);
  EXPECT_EQ(st.argument(), "logit_bias");
  EXPECT_TRUE(untouched(dq));
  EXPECT_EQ(l.steps(), 0);
}

// A learnable bias moves by its optimiser on d loss / d b (SGD: b - lr g exactly), after the temperature's update
// and only on a finite step; the checkpoint carries it, bit for bit.
TEST(Sigmoid, LearnableBiasTrainsAndIsCheckpointed)
{
  const std::size_t n = 24, dim = 16;
  const auto q = ct::random_rows<float>(n, dim, 7), k = ct::random_rows<float>(n, dim, 8);
  const cl::problem<float> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::sigmoid};
  cl::loss<float, cl::temperature::learnable> l(cl::temperature::learnable(0.1f), cl::scaler::static_scale(1.0f), 2);
  const float lr = 0.5f;
  ASSERT_TRUE(l.set_logit_bias(cl::logit_bias::learnable(-10.0f, cl::optimizer::sgd(lr))).ok());
  std::vector<float> dq(n * dim), dk(n * dim);
  cl::step_record rec;
  ASSERT_TRUE(l.step(p, dq.data(), dk.data(), rec).ok());
  EXPECT_FALSE(rec.skipped);
  EXPECT_EQ(rec.logit_bias, -10.0f);
  // At b = -10 nearly every pair's loss pushes b: the positives (1/n of them) up, the negatives down.
  const ct::reference ref =
      ct::compute_sigmoid_reference(ct::to_double(q), ct::to_double(k), n, n, dim, nullptr, 10.0, -10.0);
  EXPECT_NEAR(rec.grad_logit_bias, ref.grad_logit_bias, 1e-5 * (1.0 + std::fabs(ref.grad_logit_bias)));
  EXPECT_EQ(l.bias().value, static_cast<float>(-10.0 - double(lr) * double(rec.grad_logit_bias)));

  const auto saved = l.save();
  ASSERT_TRUE(l.step(p, dq.data(), dk.data(), rec).ok());
  const float after_two = l.bias().value;
  cl::loss<float, cl::temperature::learnable> r(cl::temperature::learnable(0.3f), cl::scaler::static_scale(1.0f), 2);
  ASSERT_TRUE(r.restore(saved).ok());
  EXPECT_EQ(r.bias().value, saved.bias.value);
  std::vector<float> dq2(n * dim), dk2(n * dim);
  ASSERT_TRUE(r.step(p, dq2.data(), dk2.data(), rec).ok());
  EXPECT_EQ(r.bias().value, after_two);
  EXPECT_EQ(dq2, dq);
  // A corrupt bias in a checkpoint is refused, changing nothing.
  auto bad = saved;
  bad.bias.value = NAN;
  EXPECT_EQ(r.restore(bad).argument(), "checkpoint.bias");
  EXPECT_EQ(r.bias().value, after_two);
}

// A learnable bias stays finite whatever finite gradient a caller's record carries: an update past float's range
// stops at -FLT_MAX (it reached -inf, and every later step and restore(save()) was refused), and the loss steps on.
TEST(Sigmoid, LearnableBiasStaysFiniteAndUsable)
{
  const std::size_t n = 12, dim = 8;
  const auto q = ct::random_rows<float>(n, dim, 17), k = ct::random_rows<float>(n, dim, 18);
  const cl::problem<float> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::sigmoid};
  cl::loss<float, cl::temperature::learnable> l(cl::temperature::learnable(0.1f), cl::scaler::static_scale(1.0f), 1);
  ASSERT_TRUE(l.set_logit_bias(cl::logit_bias::learnable(-10.0f, cl::optimizer::sgd(2.0f))).ok());
  std::vector<float> dq(n * dim), dk(n * dim);
  cl::step_record rec;
  ASSERT_TRUE(l.forward_backward(p, dq.data(), dk.data(), rec).ok());
  rec.grad_logit_bias = 3e38f; // finite: the step is not skipped
  ASSERT_TRUE(l.finish_step(rec).ok());
  EXPECT_FALSE(rec.skipped);
  EXPECT_EQ(l.bias().value, -std::numeric_limits<float>::max());
  EXPECT_TRUE(l.restore(l.save()).ok());
  EXPECT_TRUE(l.step(p, dq.data(), dk.data(), rec).ok());
  EXPECT_TRUE(std::isfinite(l.bias().value));
}

// Over 2-4 thread ranks each rank's slice equals one process on the concatenated batch (no cross-rank normaliser:
// the keys are gathered, dK reduce-scattered); d loss / d b is the same on every rank.
TEST(Sigmoid, RanksMatchOneProcess)
{
  const std::size_t n = 37, dim = 24;
  const auto q = ct::random_rows<float>(n, dim, 91), k = ct::random_rows<float>(n, dim, 92);
  const auto run = [&](auto algo)
  {
    using A = decltype(algo);
    SCOPED_TRACE(A::name);
    cl::core<float, A> one(1);
    std::vector<float> dq1(n * dim), dk1(n * dim);
    cl::core_values v1;
    ASSERT_TRUE(one.step({q.data(), k.data(), n, n, dim, nullptr, cl::objective::sigmoid},
                         10.0f,
                         -10.0f,
                         8.0f,
                         dq1.data(),
                         dk1.data(),
                         v1)
                    .ok());
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
                      cl::core<float, A, cl::gemm::builtin, ct::thread_comm> dist(c, 1);
                      std::vector<float> dq(m * dim), dk(m * dim);
                      cl::core_values v;
                      const cl::problem<float> p{qm.data(), km.data(), m, m, dim, nullptr, cl::objective::sigmoid};
                      const cl::status st = dist.step(p, 10.0f, -10.0f, 8.0f, dq.data(), dk.data(), v);
                      ASSERT_TRUE(st.ok()) << st.message();
                      EXPECT_NEAR(v.loss, v1.loss, 1e-6 * v1.loss);
                      EXPECT_NEAR(v.grad_logit_scale, v1.grad_logit_scale, 1e-5 * (1 + std::fabs(v1.grad_logit_scale)));
                      EXPECT_NEAR(v.grad_logit_bias, v1.grad_logit_bias, 1e-5 * (1 + std::fabs(v1.grad_logit_bias)));
                      const std::vector<float> want_q(dq1.begin() + b0 * dim, dq1.begin() + b1 * dim);
                      const std::vector<float> want_k(dk1.begin() + b0 * dim, dk1.begin() + b1 * dim);
                      EXPECT_LE(ct::rel_diff(dq, want_q), 1e-5);
                      EXPECT_LE(ct::rel_diff(dk, want_k), 1e-5);
                    });
    }
  };
  run(cl::algorithm::fused{});
  run(cl::algorithm::materialized{});
  run(cl::algorithm::chunked{});
}

// fp16, s = 2000 (t grown far past SigLIP's 10): the materialized logits overflow fp16 (z = round_fp16(s A) + b is
// +-inf) and the step reports `logits`; fused keeps them in float and stays finite.
TEST(Sigmoid, Fp16MaterializedLogitsOverflowWhereFusedDoesNot)
{
  const std::size_t n = 32, dim = 16;
  const auto q = ct::random_rows<__half>(n, dim, 11), k = ct::random_rows<__half>(n, dim, 12);
  const cl::problem<__half> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::sigmoid};
  std::vector<__half> dq(n * dim), dk(n * dim);
  cl::core_values v;
  cl::core<__half, cl::algorithm::materialized> mat(1);
  ASSERT_TRUE(mat.step(p, 2.0e5f, -10.0f, 1.0f, dq.data(), dk.data(), v).ok());
  EXPECT_EQ(v.first_nonfinite, cl::nonfinite_site::logits);
  cl::core<__half, cl::algorithm::fused> fused(1);
  ASSERT_TRUE(fused.step(p, 2.0e5f, -10.0f, 1.0f, dq.data(), dk.data(), v).ok());
  EXPECT_TRUE(std::isfinite(v.loss));
  EXPECT_GT(v.max_logit, 65504.0f);
}

// forward_backward with float outputs whose rows the GEMM can write (dim a multiple of the kernel's NR, from the
// code's own constant): the sigmoid objective's fused pass accumulates in the caller's dq / dk instead of the engine's
// (n_q + nk_pad) dp floats, with the same bits as forward then backward, which cannot.
TEST(Sigmoid, FusedFloatStepAccumulatesInTheOutputs)
{
  const std::size_t n_q = 50, n_k = 77, dim = 2 * cl::host::kernel_nr;
  const auto q = ct::random_rows<float>(n_q, dim, 61), k = ct::random_rows<float>(n_k, dim, 62);
  const cl::problem<float> p{q.data(), k.data(), n_q, n_k, dim, nullptr, cl::objective::sigmoid};
  cl::core<float, cl::algorithm::fused> step_core(2), split_core(2);
  auto dq = poisoned<float>(n_q * dim), dk = poisoned<float>(n_k * dim);
  auto dq2 = poisoned<float>(n_q * dim), dk2 = poisoned<float>(n_k * dim);
  cl::core_values v;
  ASSERT_TRUE(step_core.step(p, 10.0f, -10.0f, 4.0f, dq.data(), dk.data(), v).ok());
  cl::step::forward_values f;
  cl::step::backward_values b;
  ASSERT_TRUE(split_core.forward(p, 10.0f, -10.0f, f).ok());
  ASSERT_TRUE(split_core.backward(4.0f, dq2.data(), dk2.data(), b).ok());
  EXPECT_TRUE(same_bits(dq, dq2));
  EXPECT_TRUE(same_bits(dk, dk2));
  EXPECT_EQ(v.loss, f.loss);
  EXPECT_EQ(v.grad_logit_bias, b.grad_logit_bias / 4.0f);
  const std::size_t nk_pad = (n_k + cl::host::block_n - 1) / cl::host::block_n * cl::host::block_n;
  EXPECT_EQ(split_core.bytes_held() - step_core.bytes_held(), (n_q + nk_pad) * dim * sizeof(float));
  // A step after the separate forward releases the accumulators it no longer needs (an evaluate-then-train loop).
  ASSERT_TRUE(split_core.step(p, 10.0f, -10.0f, 4.0f, dq2.data(), dk2.data(), v).ok());
  EXPECT_EQ(split_core.bytes_held(), step_core.bytes_held());
  EXPECT_TRUE(same_bits(dq, dq2));
  const ct::reference ref =
      ct::compute_sigmoid_reference(ct::to_double(q), ct::to_double(k), n_q, n_k, dim, nullptr, 10.0, -10.0);
  EXPECT_LE(ct::max_rel_error(dq, ref.dq, 0.25), 1e-5);
  EXPECT_LE(ct::max_rel_error(dk, ref.dk, 0.25), 1e-5);
}
