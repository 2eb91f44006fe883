// Typed tests over element type x temperature policy x scaler policy x algorithm against the float64 reference.

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>

#if defined(__linux__)
#include <sys/resource.h>
#include <unistd.h>
#endif

namespace ct = contrastive_test;
namespace cl = contrastive;
using ct::config;
using ct::config_names;
using ct::shape;
using ct::shapes;

namespace
{
template <class P>
P make_temperature();
template <>
cl::temperature::fixed make_temperature()
{
  return cl::temperature::fixed(0.1f);
}
template <>
cl::temperature::learnable make_temperature()
{
  return cl::temperature::learnable(0.1f, cl::optimizer::adam(1e-2f));
}
template <>
cl::temperature::clamped make_temperature()
{
  return cl::temperature::clamped(0.1f, 0.05f, 1.0f, cl::optimizer::adam(1e-2f));
}
template <>
cl::temperature::freeze_then_learn make_temperature()
{
  return cl::temperature::freeze_then_learn(0.1f, 1, cl::optimizer::adam(1e-2f));
}
template <>
cl::temperature::schedule make_temperature()
{
  return cl::temperature::schedule(cl::temperature::schedule_kind::cosine, 0.1f, 0.05f, 3);
}

template <class T, class S>
S make_scaler();
template <>
cl::scaler::static_scale make_scaler<float, cl::scaler::static_scale>()
{
  return cl::scaler::static_scale(1.0f);
}
template <>
cl::scaler::static_scale make_scaler<__half, cl::scaler::static_scale>()
{
  return cl::scaler::static_scale(512.0f);
}
template <>
cl::scaler::static_scale make_scaler<__nv_bfloat16, cl::scaler::static_scale>()
{
  return cl::scaler::static_scale(8.0f);
}
template <>
cl::scaler::dynamic make_scaler<float, cl::scaler::dynamic>()
{
  return cl::scaler::dynamic::torch();
}
template <>
cl::scaler::dynamic make_scaler<__half, cl::scaler::dynamic>()
{
  return cl::scaler::dynamic::paddle_static(1024.0f); // 2^15 overflows fp16 dQ at n_q = 1: a real, tested back-off
}
template <>
cl::scaler::dynamic make_scaler<__nv_bfloat16, cl::scaler::dynamic>()
{
  return cl::scaler::dynamic::paddle_dygraph();
}

template <class T>
void poison(std::vector<T>& v)
{
  for (auto& x : v)
  {
    x = cl::element_traits<T>::from_float(-12345.0f);
  }
}

} // namespace

template <class Config>
class LossTyped : public ::testing::Test
{
};

using all_configs = ::testing::Types<
#define CONTRASTIVE_CONFIGS_FOR(T)                                                                                     \
  config<T, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::fused>,                                   \
      config<T, cl::temperature::fixed, cl::scaler::dynamic, cl::algorithm::materialized>,                             \
      config<T, cl::temperature::learnable, cl::scaler::static_scale, cl::algorithm::materialized>,                    \
      config<T, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::fused>,                                \
      config<T, cl::temperature::clamped, cl::scaler::static_scale, cl::algorithm::fused>,                             \
      config<T, cl::temperature::clamped, cl::scaler::dynamic, cl::algorithm::materialized>,                           \
      config<T, cl::temperature::schedule, cl::scaler::static_scale, cl::algorithm::materialized>,                     \
      config<T, cl::temperature::freeze_then_learn, cl::scaler::dynamic, cl::algorithm::fused>,                        \
      config<T, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::materialized>,                        \
      config<T, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::materialized>,                         \
      config<T, cl::temperature::clamped, cl::scaler::dynamic, cl::algorithm::fused>,                                  \
      config<T, cl::temperature::freeze_then_learn, cl::scaler::dynamic, cl::algorithm::materialized>,                 \
      config<T, cl::temperature::fixed, cl::scaler::dynamic, cl::algorithm::chunked>,                                  \
      config<T, cl::temperature::learnable, cl::scaler::static_scale, cl::algorithm::chunked>,                         \
      config<T, cl::temperature::clamped, cl::scaler::dynamic, cl::algorithm::chunked>,                                \
      config<T, cl::temperature::schedule, cl::scaler::static_scale, cl::algorithm::chunked>
    CONTRASTIVE_CONFIGS_FOR(float),
    CONTRASTIVE_CONFIGS_FOR(__half),
    CONTRASTIVE_CONFIGS_FOR(__nv_bfloat16)
#undef CONTRASTIVE_CONFIGS_FOR
    >;

TYPED_TEST_SUITE(LossTyped, all_configs, config_names);

// Loss, dQ, dK and d loss / d log s against float64, on every shape; then the policy updates exactly as documented.
TYPED_TEST(LossTyped, MatchesFloat64ReferenceAndUpdatesPoliciesAsDocumented)
{
  using T = typename TypeParam::element;
  using Temp = typename TypeParam::temperature;
  using Scale = typename TypeParam::scaler;
  using Algo = typename TypeParam::algorithm;
  using tol = ct::tolerance<T, Algo>;
  std::uint32_t seed = 1000;
  for (const shape& sh : shapes)
  {
    SCOPED_TRACE("n_q " + std::to_string(sh.n_q) + " n_k " + std::to_string(sh.n_k) + " dim " + std::to_string(sh.dim) +
                 " " + cl::to_string(sh.obj));
    const auto q = ct::random_rows<T>(sh.n_q, sh.dim, ++seed);
    const auto k = ct::random_rows<T>(sh.n_k, sh.dim, ++seed);
    std::vector<std::int32_t> labels(sh.n_q);
    std::mt19937 rng(++seed);
    for (auto& l : labels)
    {
      l = static_cast<std::int32_t>(rng() % sh.n_k);
    }
    cl::problem<T> p;
    p.q = q.data();
    p.k = k.data();
    p.n_q = sh.n_q;
    p.n_k = sh.n_k;
    p.dim = sh.dim;
    p.labels = sh.labels ? labels.data() : nullptr;
    p.obj = sh.obj;

    cl::loss<T, Temp, Scale, Algo> l(make_temperature<Temp>(), make_scaler<T, Scale>());
    for (int step = 0; step < 2; ++step)
    {
      SCOPED_TRACE("step " + std::to_string(step));
      const double s = l.temperature().scale();
      const ct::reference ref =
          ct::compute_reference(ct::to_double(q), ct::to_double(k), sh.n_q, sh.n_k, sh.dim, p.labels, sh.obj, s);
      std::vector<T> dq(sh.n_q * sh.dim), dk(sh.n_k * sh.dim);
      poison(dq);
      poison(dk);
      const Temp temp_before = l.temperature();
      Scale scaler_expected = l.scaler();
      cl::step_record rec;
      ASSERT_TRUE(l.forward_backward(p, dq.data(), dk.data(), rec).ok());
      ASSERT_EQ(rec.first_nonfinite, cl::nonfinite_site::none);
      const double ls = rec.loss_scale;
      EXPECT_NEAR(rec.loss, ref.loss, tol::loss(ref.max_abs_logit));
      EXPECT_LE(ct::max_rel_error(dq, ref.dq, 1.0 / ls), tol::grad(ref.max_abs_logit));
      EXPECT_LE(ct::max_rel_error(dk, ref.dk, 1.0 / ls), tol::grad(ref.max_abs_logit));
      EXPECT_NEAR(
          rec.grad_logit_scale, ref.grad_logit_scale, tol::grad(ref.max_abs_logit) * (1.0 + ref.max_abs_logit) + 1e-6);
      ASSERT_TRUE(l.finish_step(rec).ok());
      EXPECT_FALSE(rec.skipped);
      // The scaler saw a finite step; the temperature advanced with exactly the recorded gradient.
      scaler_expected.update(false);
      EXPECT_EQ(std::memcmp(&scaler_expected, &l.scaler(), sizeof(Scale)), 0);
      Temp temp_expected = temp_before;
      temp_expected.advance(rec.grad_logit_scale);
      EXPECT_EQ(l.temperature().tau(), temp_expected.tau());
      if constexpr (std::is_same_v<Temp, cl::temperature::fixed>)
      {
        EXPECT_EQ(l.temperature().tau(), temp_before.tau());
      }
      EXPECT_EQ(rec.next_loss_scale, l.scaler().loss_scale());
    }
  }
}

// Fused and materialized agree with each other (float; both against the same reference already, this is direct).
TEST(LossAgreement, FusedAndMaterializedAgreeInFloat)
{
  const std::size_t n = 300, dim = 48;
  const auto q = ct::random_rows<float>(n, dim, 5);
  const auto k = ct::random_rows<float>(n, dim, 6);
  cl::problem<float> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  std::vector<float> dq1(n * dim), dk1(n * dim), dq2(n * dim), dk2(n * dim);
  cl::loss<float, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::fused> a(
      cl::temperature::fixed(0.05f));
  cl::loss<float, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::materialized> b(
      cl::temperature::fixed(0.05f));
  cl::step_record r1, r2;
  ASSERT_TRUE(a.step(p, dq1.data(), dk1.data(), r1).ok());
  ASSERT_TRUE(b.step(p, dq2.data(), dk2.data(), r2).ok());
  EXPECT_NEAR(r1.loss, r2.loss, 2e-6 * r1.loss);
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n * dim; ++i)
  {
    num = std::max(num, double(std::fabs(dq1[i] - dq2[i])));
    den = std::max(den, double(std::fabs(dq1[i])));
  }
  EXPECT_LE(num / den, 1e-5);
}

// Forward also hands back the per-row (and per-column) log-sum-exps.
TEST(LossForward, ReturnsRowAndColumnLogSumExps)
{
  const std::size_t n = 77, dim = 20;
  const auto q = ct::random_rows<float>(n, dim, 8);
  const auto k = ct::random_rows<float>(n, dim, 9);
  cl::problem<float> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  cl::loss<float, cl::temperature::fixed> l(cl::temperature::fixed(0.07f));
  float value = 0.0f;
  std::vector<float> row(n), col(n);
  ASSERT_TRUE(l.forward(p, value, row.data(), col.data()).ok());
  const auto ref = ct::compute_reference(ct::to_double(q), ct::to_double(k), n, n, dim, nullptr, p.obj, 1.0 / 0.07f);
  for (std::size_t i = 0; i < n; ++i)
  {
    EXPECT_NEAR(row[i], ref.row_lse[i], 2e-6 * std::fabs(ref.row_lse[i]) + 1e-6);
    EXPECT_NEAR(col[i], ref.col_lse[i], 2e-6 * std::fabs(ref.col_lse[i]) + 1e-6);
  }
  std::vector<float> dq(n * dim), dk(n * dim);
  float g = 0.0f;
  ASSERT_TRUE(l.backward(dq.data(), dk.data(), g).ok());
  EXPECT_LE(ct::max_rel_error(dq, ref.dq), 1e-5);
  EXPECT_NEAR(g, ref.grad_logit_scale, 1e-5);
  // A second backward without a new forward is refused.
  EXPECT_EQ(l.backward(dq.data(), dk.data(), g).code(), cl::errc::invalid_argument);
}

// The analytic gradients of the float64 reference match its own central differences (q, k and log s), and the
// library's float gradients match central differences of the library's float loss.
TEST(FiniteDifferences, ReferenceAndLibraryGradients)
{
  for (cl::objective obj : {cl::objective::symmetric, cl::objective::info_nce})
  {
    const std::size_t n = 9, dim = 6;
    const auto qf = ct::random_rows<float>(n, dim, 21);
    const auto kf = ct::random_rows<float>(n, dim, 22);
    const std::vector<std::int32_t> labels = {3, 1, 0, 8, 4, 5, 2, 7, 6};
    const std::int32_t* lab = obj == cl::objective::info_nce ? labels.data() : nullptr;
    auto q = ct::to_double(qf);
    auto k = ct::to_double(kf);
    const double s = 8.0;
    const ct::reference ref = ct::compute_reference(q, k, n, n, dim, lab, obj, s);
    const double h = 1e-6;
    for (std::size_t idx = 0; idx < n * dim; idx += 5)
    {
      auto qp = q, qm = q;
      qp[idx] += h;
      qm[idx] -= h;
      const double fd = (ct::compute_reference(qp, k, n, n, dim, lab, obj, s).loss -
                         ct::compute_reference(qm, k, n, n, dim, lab, obj, s).loss) /
                        (2 * h);
      EXPECT_NEAR(ref.dq[idx], fd, 1e-7);
      auto kp = k, km = k;
      kp[idx] += h;
      km[idx] -= h;
      const double fdk = (ct::compute_reference(q, kp, n, n, dim, lab, obj, s).loss -
                          ct::compute_reference(q, km, n, n, dim, lab, obj, s).loss) /
                         (2 * h);
      EXPECT_NEAR(ref.dk[idx], fdk, 1e-7);
    }
    const double fds = (ct::compute_reference(q, k, n, n, dim, lab, obj, s * std::exp(h)).loss -
                        ct::compute_reference(q, k, n, n, dim, lab, obj, s * std::exp(-h)).loss) /
                       (2 * h);
    EXPECT_NEAR(ref.grad_logit_scale, fds, 1e-7);

    // Library, float, both algorithms: central differences with a step large enough for float's resolution.
    auto lib_loss = [&](const std::vector<float>& qq, const std::vector<float>& kk, auto algo)
    {
      using A = decltype(algo);
      cl::loss<float, cl::temperature::fixed, cl::scaler::static_scale, A> l(cl::temperature::fixed(1.0f / 8.0f));
      cl::problem<float> p{qq.data(), kk.data(), n, n, dim, lab, obj};
      float v = 0.0f;
      EXPECT_TRUE(l.forward(p, v).ok());
      return static_cast<double>(v);
    };
    auto lib_grads = [&](auto algo)
    {
      using A = decltype(algo);
      cl::loss<float, cl::temperature::fixed, cl::scaler::static_scale, A> l(cl::temperature::fixed(1.0f / 8.0f));
      cl::problem<float> p{qf.data(), kf.data(), n, n, dim, lab, obj};
      std::vector<float> dq(n * dim), dk(n * dim);
      cl::step_record r;
      EXPECT_TRUE(l.step(p, dq.data(), dk.data(), r).ok());
      return std::make_pair(dq, dk);
    };
    auto check = [&](auto algo)
    {
      const auto [dq, dk] = lib_grads(algo);
      const float hf = 2e-3f;
      double gmax = 0.0;
      for (float g : dq)
      {
        gmax = std::max(gmax, double(std::fabs(g)));
      }
      for (std::size_t idx = 0; idx < n * dim; idx += 3)
      {
        auto qp = qf, qm = qf;
        qp[idx] += hf;
        qm[idx] -= hf;
        const double fd = (lib_loss(qp, kf, algo) - lib_loss(qm, kf, algo)) / (double(qp[idx]) - double(qm[idx]));
        EXPECT_NEAR(dq[idx], fd, 2e-3 * gmax + 1e-4) << "dq " << idx;
        auto kp = kf, km = kf;
        kp[idx] += hf;
        km[idx] -= hf;
        const double fdk = (lib_loss(qf, kp, algo) - lib_loss(qf, km, algo)) / (double(kp[idx]) - double(km[idx]));
        EXPECT_NEAR(dk[idx], fdk, 2e-3 * gmax + 1e-4) << "dk " << idx;
      }
    };
    check(cl::algorithm::fused{});
    check(cl::algorithm::materialized{});
    check(cl::algorithm::chunked{});
  }
}

// With a fixed thread count, results are bit-identical from run to run (static task assignment).
TEST(LossDeterminism, BitIdenticalAcrossRunsWithSeveralThreads)
{
  const std::size_t n = 700, dim = 40;
  const auto q = ct::random_rows<float>(n, dim, 41);
  const auto k = ct::random_rows<float>(n, dim, 42);
  cl::problem<float> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  std::vector<float> dq1(n * dim), dk1(n * dim), dq2(n * dim), dk2(n * dim);
  cl::step_record r1, r2;
  for (int run = 0; run < 3; ++run)
  {
    cl::loss<float, cl::temperature::fixed> a(cl::temperature::fixed(0.05f), {}, 3);
    cl::loss<float, cl::temperature::fixed> b(cl::temperature::fixed(0.05f), {}, 3);
    ASSERT_TRUE(a.step(p, dq1.data(), dk1.data(), r1).ok());
    ASSERT_TRUE(b.step(p, dq2.data(), dk2.data(), r2).ok());
    EXPECT_EQ(r1.loss, r2.loss);
    EXPECT_EQ(r1.grad_logit_scale, r2.grad_logit_scale);
    EXPECT_EQ(std::memcmp(dq1.data(), dq2.data(), dq1.size() * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(dk1.data(), dk2.data(), dk1.size() * sizeof(float)), 0);
  }
}

// Float fused with d a multiple of every ISA's NR accumulates dQ and dK in the caller's buffers (no accumulator
// copies); n not a multiple of MR exercises the partial last row panel. Against float64, and bytes_held matches
// the documented formula (bytes_for) exactly.
TEST(LossInPlace, FloatFusedAccumulatesInTheOutputsAndMatchesFloat64)
{
  for (const auto& sh : {shape{70, 70, 64, cl::objective::symmetric, false},
                         shape{37, 101, 96, cl::objective::info_nce, true},
                         shape{300, 300, 128, cl::objective::symmetric, false}})
  {
    SCOPED_TRACE("n_q " + std::to_string(sh.n_q) + " n_k " + std::to_string(sh.n_k) + " dim " + std::to_string(sh.dim));
    const auto q = ct::random_rows<float>(sh.n_q, sh.dim, 71);
    const auto k = ct::random_rows<float>(sh.n_k, sh.dim, 72);
    std::vector<std::int32_t> labels(sh.n_q);
    for (std::size_t i = 0; i < sh.n_q; ++i)
    {
      labels[i] = static_cast<std::int32_t>((i * 7 + 3) % sh.n_k);
    }
    const cl::problem<float> p{q.data(), k.data(), sh.n_q, sh.n_k, sh.dim, sh.labels ? labels.data() : nullptr, sh.obj};
    for (unsigned threads : {1u, 2u, 3u})
    {
      cl::loss<float, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::fused> l(
          cl::temperature::fixed(0.1f), cl::scaler::static_scale(4.0f), threads);
      std::vector<float> dq(sh.n_q * sh.dim), dk(sh.n_k * sh.dim);
      poison(dq);
      poison(dk);
      cl::step_record rec;
      ASSERT_TRUE(l.step(p, dq.data(), dk.data(), rec).ok());
      const ct::reference ref =
          ct::compute_reference(ct::to_double(q), ct::to_double(k), sh.n_q, sh.n_k, sh.dim, p.labels, sh.obj, 10.0);
      using tol = ct::tolerance<float, cl::algorithm::fused>;
      EXPECT_NEAR(rec.loss, ref.loss, tol::loss(ref.max_abs_logit));
      EXPECT_LE(ct::max_rel_error(dq, ref.dq, 0.25), tol::grad(ref.max_abs_logit));
      EXPECT_LE(ct::max_rel_error(dk, ref.dk, 0.25), tol::grad(ref.max_abs_logit));
      EXPECT_EQ(l.bytes_held(), cl::host::engine<float>(threads).bytes_for<cl::algorithm::fused>(p).value)
          << "bytes_held and the documented formula disagree";
    }
  }
}

// When a row's positive dominates (loss ~1e-4 and below), P_pp - 1 formed by subtraction keeps few digits; the fused
// algorithm forms it as expm1(-row loss) and stays within float accuracy of the float64 reference on every draw.
// (The materialized algorithm keeps the frameworks' subtraction on purpose: it reproduces their numerics.)
TEST(LossAccuracy, FusedPositiveGradientIsExactWhenThePositiveDominates)
{
  using tol = ct::tolerance<float, cl::algorithm::fused>;
  for (std::uint32_t seed = 0; seed < 60; ++seed)
  {
    for (const auto& sh :
         {shape{1, 7, 3, cl::objective::info_nce, false}, shape{3, 3, 8, cl::objective::symmetric, false}})
    {
      const auto q = ct::random_rows<float>(sh.n_q, sh.dim, 2 * seed + 1);
      auto k = ct::random_rows<float>(sh.n_k, sh.dim, 2 * seed + 2);
      for (std::size_t i = 0; i < sh.n_q; ++i) // keys close to their queries: dominant positives
      {
        for (std::size_t c = 0; c < sh.dim; ++c)
        {
          k[i * sh.dim + c] = 0.9f * q[i * sh.dim + c] + 0.1f * k[i * sh.dim + c];
        }
      }
      const cl::problem<float> p{q.data(), k.data(), sh.n_q, sh.n_k, sh.dim, nullptr, sh.obj};
      cl::loss<float, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::fused> l(
          cl::temperature::fixed(0.1f));
      std::vector<float> dq(sh.n_q * sh.dim), dk(sh.n_k * sh.dim);
      cl::step_record rec;
      ASSERT_TRUE(l.forward_backward(p, dq.data(), dk.data(), rec).ok());
      const ct::reference ref =
          ct::compute_reference(ct::to_double(q), ct::to_double(k), sh.n_q, sh.n_k, sh.dim, nullptr, sh.obj, 10.0);
      EXPECT_LE(ct::max_rel_error(dq, ref.dq), tol::grad(ref.max_abs_logit)) << "seed " << seed;
      EXPECT_LE(ct::max_rel_error(dk, ref.dk), tol::grad(ref.max_abs_logit)) << "seed " << seed;
    }
  }
}

// backward checks its outputs against each other and against the forward's inputs, as forward_backward does: every
// element type and algorithm (the CBLAS backend: cblas_test).
TEST(LossAliasing, BackwardRefusesOverlappingOutputs)
{
  namespace tp = cl::temperature;
  namespace sc = cl::scaler;
  ct::check_backward_refuses_aliases<cl::loss<float, tp::fixed, sc::static_scale, cl::algorithm::fused>>();
  ct::check_backward_refuses_aliases<cl::loss<float, tp::fixed, sc::static_scale, cl::algorithm::materialized>>();
  ct::check_backward_refuses_aliases<cl::loss<float, tp::fixed, sc::static_scale, cl::algorithm::chunked>>();
  ct::check_backward_refuses_aliases<cl::loss<__half, tp::fixed, sc::static_scale, cl::algorithm::fused>>();
  ct::check_backward_refuses_aliases<cl::loss<__half, tp::fixed, sc::static_scale, cl::algorithm::materialized>>();
  ct::check_backward_refuses_aliases<cl::loss<__nv_bfloat16, tp::fixed, sc::static_scale, cl::algorithm::chunked>>();
}

// float32 at open_clip's clamp (logit scale 100, where its training spends most of its time), against float64 on the
// same float inputs. PyTorch's own float32 ClipLoss is 12-20 float32 eps from float64 on the D = 1 case and 10-12 on
// D = 512 (normwise, scripts/float_accuracy.py); the bounds are 1.5x the worst of those. Before the backward read each
// log-sum-exp as shift + log_sum and the micro-kernel summed in slices, fused and chunked were at ~47 and ~22 eps.
template <class Algo>
void check_float_accuracy_at_scale_100(std::size_t dim, double bound_eps)
{
  const std::size_t n = 1000;
  std::vector<float> q = ct::random_rows<float>(n, dim, 9100 + static_cast<std::uint32_t>(dim));
  std::vector<float> k = ct::random_rows<float>(n, dim, 9200 + static_cast<std::uint32_t>(dim));
  cl::loss<float, cl::temperature::fixed, cl::scaler::static_scale, Algo> l(cl::temperature::fixed(0.01f), {}, 2);
  const cl::problem<float> p{q.data(), k.data(), n, n, dim};
  std::vector<float> dq(n * dim), dk(n * dim);
  cl::step_record rec;
  ASSERT_TRUE(l.step(p, dq.data(), dk.data(), rec).ok());
  const ct::reference ref = ct::compute_reference(
      ct::to_double(q), ct::to_double(k), n, n, dim, nullptr, cl::objective::symmetric, l.temperature().scale());
  const double eps = std::numeric_limits<float>::epsilon();
  SCOPED_TRACE(std::string(Algo::name) + " dim " + std::to_string(dim));
  std::printf("%s dim %zu: dQ %.1f eps, dK %.1f eps (bound %.0f)\n",
              Algo::name,
              dim,
              ct::max_rel_error(dq, ref.dq) / eps,
              ct::max_rel_error(dk, ref.dk) / eps,
              bound_eps);
  EXPECT_LE(ct::max_rel_error(dq, ref.dq), bound_eps * eps) << ct::max_rel_error(dq, ref.dq) / eps << " eps";
  EXPECT_LE(ct::max_rel_error(dk, ref.dk), bound_eps * eps) << ct::max_rel_error(dk, ref.dk) / eps << " eps";
  EXPECT_NEAR(rec.loss, ref.loss, 4 * eps * ref.loss);
}

TEST(FloatAccuracy, GradientsAtLogitScale100AreAsCloseToFloat64AsPyTorchs)
{
  // dim 1: every feature is +-1, so every logit is exactly +-100 and half the keys tie with the positive.
  check_float_accuracy_at_scale_100<cl::algorithm::fused>(1, 30);
  check_float_accuracy_at_scale_100<cl::algorithm::chunked>(1, 30);
  check_float_accuracy_at_scale_100<cl::algorithm::fused>(512, 18);
  check_float_accuracy_at_scale_100<cl::algorithm::chunked>(512, 18);
}

namespace
{
// algorithm::automatic against the two algorithms it chooses between, for element type T, at logit scales 20 and
// 300: within the budget float is materialized at both, bit for bit (loss, gradients, bytes held); otherwise fused;
// the 16-bit types are fused at any budget and scale.
template <class T>
void check_automatic(std::uint32_t seed)
{
  using fixed = cl::temperature::fixed;
  using automatic = cl::loss<T, fixed, cl::scaler::static_scale, cl::algorithm::automatic>;
  const std::size_t n = 150, dim = 41;
  const auto q = ct::random_rows<T>(n, dim, seed), k = ct::random_rows<T>(n, dim, seed + 1);
  const cl::problem<T> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  auto run = [&](auto& l, std::vector<T>& dq, std::vector<T>& dk)
  {
    cl::step_record rec;
    const T poison = cl::element_traits<T>::from_float(std::numeric_limits<float>::quiet_NaN());
    dq.assign(n * dim, poison);
    dk.assign(n * dim, poison);
    EXPECT_TRUE(l.step(p, dq.data(), dk.data(), rec).ok());
    return rec.loss;
  };
  const bool element_logits = !std::is_same_v<T, float>; // materialized rounds the logits to T
  for (const float tau : {0.05f, 1.0f / 300.0f})
  {
    const fixed temperature(tau);
    const float s = temperature.scale();
    const bool accurate = !element_logits;
    SCOPED_TRACE("s " + std::to_string(s));
    automatic a(temperature, cl::scaler::static_scale(4.0f), 2);
    EXPECT_STREQ(a.algorithm_used(), "none");
    EXPECT_GT(a.memory_budget(), 0u);
    for (const bool fits : {true, false})
    {
      ASSERT_TRUE(a.set_memory_budget(fits ? std::size_t(1) << 40 : std::size_t(1)).ok());
      const bool materialized = fits && accurate;
      EXPECT_EQ(a.materializes(p), materialized); // at the temperature's scale
      EXPECT_EQ(a.materializes(p, s), materialized);
      std::vector<T> dq, dk, dq_ref, dk_ref;
      const double value = run(a, dq, dk);
      EXPECT_STREQ(a.algorithm_used(), materialized ? "materialized" : "fused");
      double ref = 0.0;
      std::size_t ref_bytes = 0;
      if (materialized)
      {
        cl::loss<T, fixed, cl::scaler::static_scale, cl::algorithm::materialized> m(
            temperature, cl::scaler::static_scale(4.0f), 2);
        ref = run(m, dq_ref, dk_ref);
        ref_bytes = m.bytes_held();
      }
      else
      {
        cl::loss<T, fixed, cl::scaler::static_scale, cl::algorithm::fused> f(
            temperature, cl::scaler::static_scale(4.0f), 2);
        ref = run(f, dq_ref, dk_ref);
        ref_bytes = f.bytes_held();
      }
      EXPECT_EQ(value, ref);
      EXPECT_EQ(0, std::memcmp(dq.data(), dq_ref.data(), dq.size() * sizeof(T)));
      EXPECT_EQ(0, std::memcmp(dk.data(), dk_ref.data(), dk.size() * sizeof(T)));
      EXPECT_EQ(a.bytes_held(), ref_bytes);
    }
    // The default budget (0) is a quarter of the available memory: a problem of a few hundred KiB fits it.
    ASSERT_TRUE(a.set_memory_budget(0).ok());
    EXPECT_EQ(a.materializes(p), accurate);
  }
}
} // namespace

TEST(AutomaticAlgorithm, MaterializedWithinTheBudgetFusedBeyondItHalfAlwaysFused)
{
  const std::uint32_t seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  check_automatic<float>(seed);
  check_automatic<__nv_bfloat16>(seed + 2);
  check_automatic<__half>(seed + 4);
}

#if defined(__linux__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
// The available memory heeds the process's address-space limit (ulimit -v): under a soft RLIMIT_AS 256 MiB above what
// the process maps, automatic's default budget is at most a quarter of that room (the limit restored after).
// (Not under AddressSanitizer, whose shadow memory is address space of its own.)
TEST(AutomaticAlgorithm, DefaultBudgetHeedsTheAddressSpaceLimit)
{
  struct rlimit saved;
  ASSERT_EQ(getrlimit(RLIMIT_AS, &saved), 0);
  const unsigned long long room = 256ull << 20;
  if (cl::host::available_memory_bytes() < 4 * room)
  {
    GTEST_SKIP() << "less than 1 GiB available: the limit's room would not be what lowers it";
  }
  unsigned long long pages = 0;
  ASSERT_TRUE(cl::host::read_file_number("/proc/self/statm", pages));
  const unsigned long long cap = pages * static_cast<unsigned long long>(sysconf(_SC_PAGESIZE)) + room;
  if (saved.rlim_max != RLIM_INFINITY && saved.rlim_max < cap)
  {
    GTEST_SKIP() << "the hard address-space limit is below what this test sets";
  }
  struct rlimit lowered = saved;
  lowered.rlim_cur = static_cast<rlim_t>(cap);
  ASSERT_EQ(setrlimit(RLIMIT_AS, &lowered), 0);
  const std::size_t available = cl::host::available_memory_bytes();
  const std::size_t budget = cl::host::default_memory_budget();
  ASSERT_EQ(setrlimit(RLIMIT_AS, &saved), 0);
  EXPECT_LE(available, room);
  EXPECT_GT(available, room / 2); // the room less what the calls above mapped, not "unknown"
  EXPECT_LE(budget, room / 4);
  // No room at all (the limit below what the process maps) is known to be none: the budget is what the engine holds,
  // not the 1 GiB of a system that does not say.
  lowered.rlim_cur = static_cast<rlim_t>(pages * static_cast<unsigned long long>(sysconf(_SC_PAGESIZE)) / 2);
  ASSERT_EQ(setrlimit(RLIMIT_AS, &lowered), 0);
  const std::size_t none = cl::host::available_memory_bytes();
  const std::size_t held_only = cl::host::default_memory_budget(std::size_t(64) << 20);
  ASSERT_EQ(setrlimit(RLIMIT_AS, &saved), 0);
  EXPECT_EQ(none, 1u);
  EXPECT_EQ(held_only, (std::size_t(64) << 20) / 4);
}
#endif

// bfloat16 runs fused at every logit scale, bit for bit, open_clip's clamped scale (PyTorch's float32 exp(ln 100) =
// 100.0000076) and NaN included; float materialized at any scale that fits; the engine's prepare and decide agree.
TEST(AutomaticAlgorithm, Bf16RunsFusedAtEveryLogitScale)
{
  using bf16 = __nv_bfloat16;
  const std::size_t n = 150, dim = 41;
  const std::uint32_t seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  const auto q = ct::random_rows<bf16>(n, dim, seed), k = ct::random_rows<bf16>(n, dim, seed + 1);
  const cl::problem<bf16> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  const std::size_t budget = std::size_t(1) << 40;
  cl::core<bf16, cl::algorithm::automatic> a(2);
  ASSERT_TRUE(a.set_memory_budget(budget).ok());
  cl::core<bf16, cl::algorithm::fused> f(2);
  const float open_clip = 100.00000762939453f; // torch.tensor(math.log(100)).exp() in float32
  for (const float s : {20.0f, 100.0f, open_clip, 128.0f, 2000.0f, 1.0f})
  {
    SCOPED_TRACE("s " + std::to_string(s));
    EXPECT_FALSE(a.materializes(p, s));
    std::vector<bf16> dq(n * dim), dk(n * dim), dq_ref(n * dim), dk_ref(n * dim);
    cl::core_values out, ref;
    ASSERT_TRUE(a.step(p, s, 2.0f, dq.data(), dk.data(), out).ok());
    EXPECT_STREQ(a.algorithm_used(), "fused");
    ASSERT_TRUE(f.step(p, s, 2.0f, dq_ref.data(), dk_ref.data(), ref).ok());
    EXPECT_EQ(out.loss, ref.loss);
    EXPECT_EQ(out.grad_logit_scale, ref.grad_logit_scale);
    EXPECT_EQ(0, std::memcmp(dq.data(), dq_ref.data(), dq.size() * sizeof(bf16)));
    EXPECT_EQ(0, std::memcmp(dk.data(), dk_ref.data(), dk.size() * sizeof(bf16)));
  }
  EXPECT_FALSE(a.materializes(p, std::numeric_limits<float>::quiet_NaN()));

  // float's logits are float: materialized at any scale that fits.
  const auto qf = ct::random_rows<float>(n, dim, seed), kf = ct::random_rows<float>(n, dim, seed + 1);
  const cl::problem<float> pf{qf.data(), kf.data(), n, n, dim, nullptr, cl::objective::symmetric};
  cl::core<float, cl::algorithm::automatic> af(2);
  ASSERT_TRUE(af.set_memory_budget(budget).ok());
  EXPECT_TRUE(af.materializes(pf, 2000.0f));
  std::vector<float> dqf(n * dim), dkf(n * dim);
  cl::core_values outf;
  ASSERT_TRUE(af.step(pf, 2000.0f, 1.0f, dqf.data(), dkf.data(), outf).ok());
  EXPECT_STREQ(af.algorithm_used(), "materialized");

  // The engine: bytes_for<automatic> is the most a call can hold (bfloat16: fused's; float: materialized's, where it
  // fits); prepare with and without a `decide` runs the same.
  cl::host::engine<bf16> e(1);
  e.set_memory_budget(budget);
  EXPECT_EQ(e.bytes_for<cl::algorithm::automatic>(p).value, e.bytes_for<cl::algorithm::fused>(p).value);
  e.prepare<cl::algorithm::automatic>(p);
  EXPECT_STREQ(e.algorithm_used(), "fused");
  EXPECT_FALSE(e.decide(p, false, 20.0f));
  e.prepare<cl::algorithm::automatic>(p);
  EXPECT_STREQ(e.algorithm_used(), "fused");
  cl::host::engine<float> ef(1);
  ef.set_memory_budget(budget);
  EXPECT_EQ(ef.bytes_for<cl::algorithm::automatic>(pf).value, ef.bytes_for<cl::algorithm::materialized>(pf).value);
  ef.prepare<cl::algorithm::automatic>(pf);
  EXPECT_STREQ(ef.algorithm_used(), "materialized");
}

// What each choice costs in accuracy (docs/algorithms.md, "Choosing an algorithm"): bfloat16, N = 1000, symmetric
// loss, dQ and dK normwise against float64 on the same bfloat16 inputs, on unit random features (D = 512, logit
// scales 10-2000) and on a learned batch (D = 128, each key the normalised sum of its query and noise of norm 1.6:
// cosine ~0.5 with its query; logit scales 10-100, where its loss falls from ~2 to ~3e-4). Materialized rounds the
// logits to bfloat16: its error grows with s on random features and, on the learned batch, where the gradient is the
// small softmax(S) - target, reaches 0.17 at s = 100; fused's stays at the output rounding (~0.004). Automatic must
// be fused, bit for bit, and within 0.01 everywhere: a rule running materialized at s <= 128 fails here.
TEST(AutomaticAccuracy, Bf16GradientsAgainstFloat64AcrossLogitScales)
{
  using bf16 = __nv_bfloat16;
  const std::size_t n = 1000;
  cl::core<bf16, cl::algorithm::automatic> a(2);
  ASSERT_TRUE(a.set_memory_budget(std::size_t(1) << 40).ok());
  cl::core<bf16, cl::algorithm::materialized> m(2);
  cl::core<bf16, cl::algorithm::fused> f(2);
  std::printf("| batch | s | max abs logit | materialized dQ | fused dQ | materialized dK | fused dK | automatic |\n"
              "|---|---|---|---|---|---|---|---|\n");
  for (const bool learned : {false, true})
  {
    const std::size_t dim = learned ? 128 : 512;
    const auto q = ct::random_rows<bf16>(n, dim, 4201);
    std::vector<bf16> k = ct::random_rows<bf16>(n, dim, 4202);
    if (learned) // k_i = normalise(q_i + 1.6 N(0, 1/D) per entry), q_i a unit row
    {
      std::mt19937 gen(4203);
      std::normal_distribution<double> noise(0.0, 1.6 / std::sqrt(static_cast<double>(dim)));
      for (std::size_t i = 0; i < n; ++i)
      {
        std::vector<double> row(dim);
        double norm = 0.0;
        for (std::size_t c = 0; c < dim; ++c)
        {
          row[c] = static_cast<double>(cl::element_traits<bf16>::to_float(q[i * dim + c])) + noise(gen);
          norm += row[c] * row[c];
        }
        for (std::size_t c = 0; c < dim; ++c)
        {
          k[i * dim + c] = cl::element_traits<bf16>::from_float(static_cast<float>(row[c] / std::sqrt(norm)));
        }
      }
    }
    const cl::problem<bf16> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
    const std::vector<double> qd = ct::to_double(q), kd = ct::to_double(k);
    for (const float s : {10.0f, 30.0f, 100.0f, 128.0f, 300.0f, 1000.0f, 2000.0f})
    {
      if (learned && s > 100.0f)
      {
        continue; // the learned batch's loss is ~0 there: its gradients vanish
      }
      SCOPED_TRACE(std::string(learned ? "learned" : "random") + " s " + std::to_string(s));
      const ct::reference ref = ct::compute_reference(qd, kd, n, n, dim, nullptr, p.obj, s);
      std::vector<bf16> dq_m(n * dim), dk_m(n * dim), dq_f(n * dim), dk_f(n * dim), dq_a(n * dim), dk_a(n * dim);
      cl::core_values out;
      ASSERT_TRUE(m.step(p, s, 1.0f, dq_m.data(), dk_m.data(), out).ok());
      ASSERT_TRUE(f.step(p, s, 1.0f, dq_f.data(), dk_f.data(), out).ok());
      ASSERT_TRUE(a.step(p, s, 1.0f, dq_a.data(), dk_a.data(), out).ok());
      EXPECT_STREQ(a.algorithm_used(), "fused");
      EXPECT_EQ(0, std::memcmp(dq_a.data(), dq_f.data(), dq_a.size() * sizeof(bf16)));
      EXPECT_EQ(0, std::memcmp(dk_a.data(), dk_f.data(), dk_a.size() * sizeof(bf16)));
      const double em_q = ct::max_rel_error(dq_m, ref.dq), ef_q = ct::max_rel_error(dq_f, ref.dq);
      const double em_k = ct::max_rel_error(dk_m, ref.dk), ef_k = ct::max_rel_error(dk_f, ref.dk);
      std::printf("| %s | %g | %.1f | %.4f | %.4f | %.4f | %.4f | %s |\n",
                  learned ? "learned" : "random",
                  s,
                  ref.max_abs_logit,
                  em_q,
                  ef_q,
                  em_k,
                  ef_k,
                  a.algorithm_used());
      EXPECT_LE(ef_q, 0.01);
      EXPECT_LE(ef_k, 0.01);
    }
  }
}

// The sigmoid objective's fused step is one pass (the flops of materialized, no n_q x n_k logits), so automatic runs
// it fused at any budget and scale, bit for bit (loss, bias gradient, dQ, dK, bytes held); the softmax objectives on
// the same loss and budget still run materialized.
TEST(AutomaticAlgorithm, SigmoidRunsFusedAtAnyBudget)
{
  const std::uint32_t seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  const std::size_t n = 150, dim = 41;
  const auto q = ct::random_rows<float>(n, dim, seed), k = ct::random_rows<float>(n, dim, seed + 1);
  const cl::problem<float> sig{q.data(), k.data(), n, n, dim, nullptr, cl::objective::sigmoid};
  const cl::problem<float> sym{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  using fixed = cl::temperature::fixed;
  auto run = [&](auto& l, const cl::problem<float>& p, std::vector<float>& dq, std::vector<float>& dk)
  {
    EXPECT_TRUE(l.set_logit_bias(cl::logit_bias::fixed(p.obj == cl::objective::sigmoid ? -4.0f : 0.0f)).ok());
    cl::step_record rec;
    dq.assign(n * dim, std::numeric_limits<float>::quiet_NaN());
    dk.assign(n * dim, std::numeric_limits<float>::quiet_NaN());
    EXPECT_TRUE(l.step(p, dq.data(), dk.data(), rec).ok());
    EXPECT_FALSE(rec.skipped);
    return rec;
  };
  for (const float tau : {0.1f, 1.0f / 300.0f})
  {
    SCOPED_TRACE("tau " + std::to_string(tau));
    for (const std::size_t budget : {std::size_t(1) << 40, std::size_t(1)})
    {
      SCOPED_TRACE("budget " + std::to_string(budget));
      // Fresh losses: one that ran the symmetric objective keeps its column statistics' buffers.
      cl::loss<float, fixed, cl::scaler::static_scale, cl::algorithm::automatic> a(
          fixed(tau), cl::scaler::static_scale(2.0f), 2);
      cl::loss<float, fixed, cl::scaler::static_scale, cl::algorithm::fused> f(
          fixed(tau), cl::scaler::static_scale(2.0f), 2);
      ASSERT_TRUE(a.set_memory_budget(budget).ok());
      EXPECT_FALSE(a.materializes(sig));
      std::vector<float> dq, dk, dq_ref, dk_ref;
      const cl::step_record got = run(a, sig, dq, dk);
      EXPECT_STREQ(a.algorithm_used(), "fused");
      const cl::step_record ref = run(f, sig, dq_ref, dk_ref);
      EXPECT_EQ(got.loss, ref.loss);
      EXPECT_EQ(got.grad_logit_scale, ref.grad_logit_scale);
      EXPECT_EQ(got.grad_logit_bias, ref.grad_logit_bias);
      EXPECT_EQ(0, std::memcmp(dq.data(), dq_ref.data(), dq.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(dk.data(), dk_ref.data(), dk.size() * sizeof(float)));
      EXPECT_EQ(a.bytes_held(), f.bytes_held());
      // The symmetric objective on the same loss: materialized where it fits.
      EXPECT_EQ(a.materializes(sym), budget > 1);
      run(a, sym, dq, dk);
      EXPECT_STREQ(a.algorithm_used(), budget > 1 ? "materialized" : "fused");
    }
  }
}

TEST(AutomaticAlgorithm, OtherAlgorithmsRefuseABudget)
{
  cl::loss<float, cl::temperature::fixed> fused(cl::temperature::fixed(0.1f));
  const cl::status st = fused.set_memory_budget(1 << 20);
  EXPECT_EQ(st.code(), cl::errc::invalid_argument);
  EXPECT_EQ(st.argument(), std::string("budget"));
  EXPECT_FALSE(fused.materializes(cl::problem<float>{}));
}

namespace
{
// Every algorithm at shapes whose products span several micro-kernel slices (dim > 2 kernel_kc, odd) and key tiles
// (n_k > block_n, not a multiple of it), row blocks with a partial last panel, and labels against a queue: the
// logits' reduction and both backward products run over more than one slice and tile, on whichever kernel this
// build has (for bfloat16 on an AVX512-BF16 build: the vdpbf16ps kernel, its pair panels and the odd-dim padding).
template <class T, class Algo>
void check_long_products(std::uint32_t seed)
{
  using tol = ct::tolerance<T, Algo>;
  namespace h = cl::host;
  struct case_t
  {
    std::size_t n_q, n_k, dim;
    cl::objective obj;
  };
  const case_t cases[] = {
      {h::block_n + 45, h::block_n + 45, 2 * h::kernel_kc + 3, cl::objective::symmetric},
      {h::kernel_mr + 1, 2 * h::block_n + 1, h::kernel_kc + 1, cl::objective::info_nce},
      {1, 3, 2 * h::kernel_kc + 1, cl::objective::info_nce},
  };
  for (const case_t& c : cases)
  {
    SCOPED_TRACE(std::string(cl::element_traits<T>::name) + " " + Algo::name + " n_q " + std::to_string(c.n_q) +
                 " n_k " + std::to_string(c.n_k) + " dim " + std::to_string(c.dim) + " seed " + std::to_string(seed));
    const auto q = ct::random_rows<T>(c.n_q, c.dim, seed++), k = ct::random_rows<T>(c.n_k, c.dim, seed++);
    const auto labels = ct::random_labels(c.n_q, c.n_k, seed++);
    const std::int32_t* lab = c.obj == cl::objective::info_nce ? labels.data() : nullptr;
    const cl::problem<T> p{q.data(), k.data(), c.n_q, c.n_k, c.dim, lab, c.obj};
    cl::loss<T, cl::temperature::fixed, cl::scaler::static_scale, Algo> l(cl::temperature::fixed(1.0f / 20.0f),
                                                                          cl::scaler::static_scale(8.0f));
    const auto ref = ct::compute_reference(ct::to_double(q), ct::to_double(k), c.n_q, c.n_k, c.dim, lab, c.obj, 20.0);
    const T poison = cl::element_traits<T>::from_float(std::numeric_limits<float>::quiet_NaN());
    std::vector<T> dq(c.n_q * c.dim, poison), dk(c.n_k * c.dim, poison);
    cl::step_record rec;
    const cl::status st = l.step(p, dq.data(), dk.data(), rec);
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_EQ(rec.first_nonfinite, cl::nonfinite_site::none);
    EXPECT_NEAR(rec.loss, ref.loss, tol::loss(ref.max_abs_logit));
    EXPECT_LE(ct::max_rel_error(dq, ref.dq, 1.0 / 8.0), tol::grad(ref.max_abs_logit));
    EXPECT_LE(ct::max_rel_error(dk, ref.dk, 1.0 / 8.0), tol::grad(ref.max_abs_logit));
  }
}
} // namespace

TEST(LongProducts, EveryAlgorithmAndElementTypeMatchesFloat64)
{
  const std::uint32_t seed = std::random_device{}();
  std::printf(
      "seed %u, host kernel %s, bfloat16 dot products %s\n", seed, cl::host::kernel_isa, cl::host::bf16_kernel());
  check_long_products<__nv_bfloat16, cl::algorithm::fused>(seed);
  check_long_products<__nv_bfloat16, cl::algorithm::materialized>(seed + 10);
  check_long_products<__nv_bfloat16, cl::algorithm::chunked>(seed + 20);
  check_long_products<__half, cl::algorithm::fused>(seed + 30);
  check_long_products<float, cl::algorithm::fused>(seed + 40);
  check_long_products<float, cl::algorithm::materialized>(seed + 50);
}

// The ctest entry loss.amx_emulated runs the bfloat16 tests of this file with CONTRASTIVE_HOST_AMX=emulate: every
// product then goes through the AMX tile driver (on its C++ model of the instruction), so the driver is tested inside
// the whole loss, at every call site's strides, on machines without AMX. This test makes sure the mode took effect.
TEST(AmxEmulation, EveryBfloat16ProductRunsOnTheTileDriverWhereAsked)
{
  namespace h = cl::host;
  const char* env = std::getenv("CONTRASTIVE_HOST_AMX");
  if (env == nullptr || std::string(env) != "emulate")
  {
    GTEST_SKIP() << "CONTRASTIVE_HOST_AMX=emulate is not set (ctest's loss.amx_emulated sets it)";
  }
  if (!h::bf16_dot || !h::amx::compiled)
  {
    GTEST_SKIP() << "this build has no bfloat16 kernel or no tile driver: " << h::amx::describe(h::amx::status());
  }
  EXPECT_EQ(h::amx::status(), h::amx::state::emulated);
  EXPECT_STREQ(h::bf16_kernel(), "amx_bf16 (emulated)");
}
