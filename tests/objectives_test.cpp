// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// The objective types (objectives/): their traits, the one dispatch on problem::obj, their coefficients and means
// against the definitions in float64, their shape and bias rules through the public checks, and their per-logit
// functions against float64 (a softmax row's gradient sums to zero; the sigmoid term is softplus and its gradient
// the sigmoid). The losses themselves are tested per objective elsewhere (loss_test, chunked_test, groups_test,
// reliability_test) against float64 references.

#include <contrastive/checks.hpp>
#include <contrastive/core.hpp>
#include <contrastive/objectives/objectives.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace cl = contrastive;
namespace co = contrastive::objectives;

namespace
{
static_assert(co::is_objective_v<co::symmetric> && co::is_objective_v<co::info_nce> && co::is_objective_v<co::sigmoid>);
static_assert(!co::is_objective_v<int>);
static_assert(co::symmetric::softmax && co::symmetric::columns && !co::symmetric::has_bias &&
              !co::symmetric::takes_labels);
static_assert(co::info_nce::softmax && !co::info_nce::columns && !co::info_nce::has_bias && co::info_nce::takes_labels);
static_assert(!co::sigmoid::softmax && !co::sigmoid::columns && co::sigmoid::has_bias && co::sigmoid::takes_labels);

template <class O>
void visits_to(cl::objective code)
{
  cl::problem<float> p;
  p.obj = code;
  const cl::objective seen = co::visit(p,
                                       [](auto o)
                                       {
                                         return decltype(o)::code;
                                       });
  EXPECT_EQ(seen, O::code);
  const co::runtime_traits t = co::traits_of(p);
  EXPECT_EQ(std::string(t.name), O::name);
  EXPECT_EQ(std::string(t.name), cl::to_string(code));
  EXPECT_EQ(t.softmax, O::softmax);
  EXPECT_EQ(t.columns, O::columns);
  EXPECT_EQ(t.has_bias, O::has_bias);
  EXPECT_EQ(t.takes_labels, O::takes_labels);
  EXPECT_TRUE(co::known(code));
}

TEST(Objectives, VisitMapsEveryCodeToItsType)
{
  visits_to<co::symmetric>(cl::objective::symmetric);
  visits_to<co::info_nce>(cl::objective::info_nce);
  visits_to<co::sigmoid>(cl::objective::sigmoid);
  EXPECT_FALSE(co::known(static_cast<cl::objective>(7)));
  EXPECT_FALSE(co::known(static_cast<cl::objective>(-1)));
}

// `all` lists every objective once, in the order of their codes (the fuzzer draws a code below co::count), and the
// refusal of an unknown code names them all.
template <class... Os>
void codes_in_order(co::list<Os...>)
{
  const int codes[] = {static_cast<int>(Os::code)...};
  const char* names[] = {Os::name...};
  for (int i = 0; i < int(sizeof...(Os)); ++i)
  {
    EXPECT_EQ(codes[i], i) << names[i];
  }
}
TEST(Objectives, AllListsEveryObjectiveByCode)
{
  static_assert(co::count == 3);
  codes_in_order(co::all{});
  EXPECT_EQ(co::names(), "symmetric, info_nce or sigmoid");
  const cl::status st = co::check_known(static_cast<cl::objective>(9));
  EXPECT_EQ(st.code(), cl::errc::invalid_argument);
  EXPECT_EQ(st.argument(), "obj");
  EXPECT_NE(st.message().find("unknown objective 9 (symmetric, info_nce or sigmoid)"), std::string::npos)
      << st.message();
}

// The coefficients of G and the batch's mean, from the definitions in float64: symmetric L = (mean of the row CEs +
// mean of the column CEs) / 2, info_nce the row mean, sigmoid (1/n_q) sum of the pair terms; with group ids the means
// run over the rows (and columns) with a positive, the sigmoid's over every query.
TEST(Objectives, CoefficientsAndMeansAreTheDefinitions)
{
  for (const std::size_t n_q : {1u, 3u, 7u, 1000u, 65537u})
  {
    for (const std::size_t n_k : {1u, 5u, 1000u, 131071u})
    {
      const double rows = 3.25 * double(n_q), cols = 1.5 * double(n_k);
      const cl::grad_coefficients s = co::symmetric::coefficients(n_q, n_k);
      EXPECT_EQ(s.row_coef, float(0.5 / double(n_q)));
      EXPECT_EQ(s.col_coef, float(0.5 / double(n_k)));
      EXPECT_EQ(s.pos_coef, 2.0f * float(0.5 / double(n_q)));
      EXPECT_EQ(co::symmetric::mean(n_q, n_k, rows, cols), float(0.5 * (rows / double(n_q) + cols / double(n_k))));
      for (const cl::grad_coefficients c : {co::info_nce::coefficients(n_q, n_k), co::sigmoid::coefficients(n_q, n_k)})
      {
        EXPECT_EQ(c.row_coef, float(1.0 / double(n_q)));
        EXPECT_EQ(c.col_coef, 0.0f);
        EXPECT_EQ(c.pos_coef, float(1.0 / double(n_q)));
      }
      EXPECT_EQ(co::info_nce::mean(n_q, n_k, rows, cols), float(rows / double(n_q)));
      EXPECT_EQ(co::sigmoid::mean(n_q, n_k, rows, cols), float(rows / double(n_q)));

      const std::size_t r = (n_q + 1) / 2, c = (n_k + 2) / 3; // rows and columns with a positive
      const cl::grad_coefficients gs = co::symmetric::grouped_coefficients(n_q, r, c);
      EXPECT_EQ(gs.row_coef, float(0.5 / double(r)));
      EXPECT_EQ(gs.col_coef, float(0.5 / double(c)));
      EXPECT_EQ(co::symmetric::grouped_mean(n_q, r, c, rows, cols), float(0.5 * (rows / double(r) + cols / double(c))));
      const cl::grad_coefficients gi = co::info_nce::grouped_coefficients(n_q, r, c);
      EXPECT_EQ(gi.row_coef, float(1.0 / double(r)));
      EXPECT_EQ(gi.col_coef, 0.0f);
      EXPECT_EQ(co::info_nce::grouped_mean(n_q, r, c, rows, cols), float(rows / double(r)));
      const cl::grad_coefficients gg = co::sigmoid::grouped_coefficients(n_q, r, c);
      EXPECT_EQ(gg.row_coef, float(1.0 / double(n_q)));
      EXPECT_EQ(co::sigmoid::grouped_mean(n_q, r, c, rows, cols), float(rows / double(n_q)));
    }
  }
  // No row (column) with a positive: its mean counts 0 and its coefficient is 0, never a division by zero.
  EXPECT_EQ(co::symmetric::grouped_coefficients(10, 0, 0).row_coef, 0.0f);
  EXPECT_EQ(co::symmetric::grouped_coefficients(10, 0, 0).col_coef, 0.0f);
  EXPECT_EQ(co::symmetric::grouped_mean(10, 0, 0, 0.0, 0.0), 0.0f);
  EXPECT_EQ(co::info_nce::grouped_mean(10, 0, 0, 0.0, 0.0), 0.0f);
  EXPECT_EQ(co::symmetric::grouped_mean(10, 4, 0, 2.0, 0.0), 0.25f);
}

// The shape rules and the bias rule, as the public checks apply them: each objective's own, an unknown objective
// refused by name.
TEST(Objectives, ShapeAndBiasRulesThroughTheChecks)
{
  std::vector<float> x(6 * 4, 0.5f);
  const std::int32_t labels[3] = {0, 5, 2};
  cl::problem<float> p{x.data(), x.data(), 3, 6, 4};
  p.obj = cl::objective::symmetric;
  cl::status st = cl::check_problem(p);
  EXPECT_EQ(st.code(), cl::errc::shape_mismatch);
  EXPECT_EQ(st.argument(), "n_k");
  p.n_k = 3;
  EXPECT_TRUE(cl::check_problem(p).ok());
  p.labels = labels;
  EXPECT_EQ(cl::check_problem(p).argument(), "labels");
  for (const cl::objective o : {cl::objective::info_nce, cl::objective::sigmoid})
  {
    p.obj = o;
    p.n_q = 6;
    p.n_k = 3;
    p.labels = nullptr;
    st = cl::check_problem(p);
    EXPECT_EQ(st.code(), cl::errc::shape_mismatch) << cl::to_string(o);
    EXPECT_EQ(st.argument(), "labels");
    p.n_q = 3;
    p.n_k = 6;
    p.labels = labels;
    EXPECT_TRUE(cl::check_problem(p).ok()) << cl::to_string(o);
  }
  p.obj = static_cast<cl::objective>(9);
  st = cl::check_problem(p);
  EXPECT_EQ(st.code(), cl::errc::invalid_argument);
  EXPECT_EQ(st.argument(), "obj");
  EXPECT_NE(st.message().find("unknown objective 9"), std::string::npos) << st.message();

  EXPECT_TRUE(co::check_logit_bias<co::sigmoid>(-10.0f).ok());
  EXPECT_TRUE(co::check_logit_bias<co::symmetric>(0.0f).ok());
  EXPECT_EQ(co::check_logit_bias<co::symmetric>(1.0f).argument(), "logit_bias");
  EXPECT_EQ(co::check_logit_bias<co::info_nce>(-1.0f).argument(), "logit_bias");
  EXPECT_EQ(co::check_logit_bias<co::sigmoid>(NAN).argument(), "logit_bias");
  EXPECT_EQ(co::check_logit_bias<co::sigmoid>(INFINITY).argument(), "logit_bias");
  EXPECT_EQ(cl::check_logit_bias(cl::objective::info_nce, 2.0f).argument(), "logit_bias");
  EXPECT_TRUE(cl::check_logit_bias(cl::objective::sigmoid, 2.0f).ok());
}

// An unknown objective reaches no engine: contrastive::core refuses it and writes nothing.
TEST(Objectives, UnknownObjectiveWritesNothing)
{
  const std::size_t n = 5, d = 3;
  std::vector<float> q(n * d, 0.25f), k(n * d, -0.5f), dq(n * d, 1234.5f), dk(n * d, 1234.5f);
  cl::problem<float> p{q.data(), k.data(), n, n, d};
  p.obj = static_cast<cl::objective>(9);
  cl::core<float> c(1);
  cl::core_values out{};
  const cl::status st = c.step(p, 10.0f, 1.0f, dq.data(), dk.data(), out);
  EXPECT_EQ(st.argument(), "obj");
  for (std::size_t i = 0; i < n * d; ++i)
  {
    ASSERT_EQ(dq[i], 1234.5f);
    ASSERT_EQ(dk[i], 1234.5f);
  }
}

// Per-logit functions against float64. A softmax row's G sums to zero (sum_j P_ij = 1 against the positive's -1),
// and its entries are the float64 softmax; the sigmoid term is softplus(-l z) and its gradient factor -l sigmoid(-l z).
TEST(Objectives, PerLogitFunctionsMatchFloat64)
{
  std::mt19937 rng(20261205);
  std::normal_distribution<float> logit(0.0f, 6.0f);
  const std::size_t n = 257, positive = 91;
  for (int trial = 0; trial < 20; ++trial)
  {
    std::vector<float> x(n);
    for (float& v : x)
    {
      v = logit(rng);
    }
    double m = -INFINITY;
    for (const float v : x)
    {
      m = std::max(m, double(v));
    }
    double sum = 0.0;
    for (const float v : x)
    {
      sum += std::exp(double(v) - m);
    }
    const double lse = m + std::log(sum);
    // The library's split form: shift = the row's max, log_sum = log(sum exp(x - shift)), in float.
    const float shift = float(m), log_sum = float(std::log(sum));
    const cl::grad_coefficients gc = co::info_nce::coefficients(1, n); // row_coef 1
    const float row_loss = float(lse - double(x[positive]));
    double g_sum = 0.0, worst = 0.0;
    for (std::size_t j = 0; j < n; ++j)
    {
      const float g = j == positive ? co::info_nce::positive_gradient(row_loss, 0.0f, gc)
                                    : co::info_nce::gradient(x[j], shift, log_sum, 0.0f, 0.0f, gc);
      const double want = std::exp(double(x[j]) - lse) - (j == positive ? 1.0 : 0.0);
      worst = std::max(worst, std::abs(double(g) - want));
      g_sum += double(g);
    }
    EXPECT_LT(worst, 64 * 1.2e-7) << trial;
    EXPECT_LT(std::abs(g_sum), 64 * 1.2e-7) << trial;
    // The symmetric objective adds the column's term with its own coefficient (here the same row as a column).
    const cl::grad_coefficients gs{0.5f, 0.5f, 1.0f};
    const float gsym = co::symmetric::gradient(x[3], shift, log_sum, shift, log_sum, gs);
    EXPECT_NEAR(double(gsym), std::exp(double(x[3]) - lse), 64 * 1.2e-7);
  }
  for (const float z : {-80.0f, -20.0f, -3.5f, -0.25f, 0.0f, 0.25f, 3.5f, 20.0f, 80.0f})
  {
    for (const bool pos : {true, false})
    {
      const double l = pos ? 1.0 : -1.0;
      const double v = -l * double(z);
      const double softplus = std::max(v, 0.0) + std::log1p(std::exp(-std::abs(v)));
      const double sig = 1.0 / (1.0 + std::exp(-v)); // sigmoid(-l z)
      const cl::sigmoid_term t = co::sigmoid::term(z, pos);
      EXPECT_NEAR(double(t.loss), softplus, 4 * 1.2e-7 * std::max(1.0, softplus)) << z << " " << pos;
      EXPECT_NEAR(double(t.grad), -l * sig, 4 * 1.2e-7) << z << " " << pos;
    }
  }
}
} // namespace
