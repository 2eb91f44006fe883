// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
// algorithm::chunked on the host: several chunks against float64, chunk-size independence, the options' rules and
// the memory it holds.
#include "test_util.hpp"

#include <contrastive/contrastive.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace cl = contrastive;
namespace ct = contrastive_test;

namespace
{
/// The documented memory formula for a chunked loss with these settings.
template <class T>
std::size_t formula_bytes(const cl::problem<T>& p, unsigned threads, cl::chunk_options o)
{
  cl::host::engine<T> e(threads);
  e.set_chunk(o);
  return e.template bytes_for<cl::algorithm::chunked>(p).value;
}

struct case_t
{
  std::size_t n_q, n_k, dim;
  cl::objective obj;
  bool labels;
};

const case_t cases[] = {
    {300, 300, 40, cl::objective::symmetric, false}, // several chunks of one row block each, the last partial
    {200, 450, 33, cl::objective::info_nce, true},   // a queue of keys, random labels
    {129, 129, 17, cl::objective::info_nce, false},
};

template <class T>
void check_against_reference(std::size_t chunk_rows, unsigned threads)
{
  using tol = ct::tolerance<T, cl::algorithm::chunked>;
  std::uint32_t seed = 7000 + static_cast<std::uint32_t>(chunk_rows) * 3 + threads;
  for (const case_t& c : cases)
  {
    SCOPED_TRACE(std::string(cl::element_traits<T>::name) + " n_q " + std::to_string(c.n_q) + " n_k " +
                 std::to_string(c.n_k) + " chunk " + std::to_string(chunk_rows) + " threads " +
                 std::to_string(threads) + " " + cl::to_string(c.obj));
    const auto q = ct::random_rows<T>(c.n_q, c.dim, ++seed);
    const auto k = ct::random_rows<T>(c.n_k, c.dim, ++seed);
    const auto labels = ct::random_labels(c.n_q, c.n_k, ++seed);
    cl::problem<T> p{q.data(), k.data(), c.n_q, c.n_k, c.dim, c.labels ? labels.data() : nullptr, c.obj};
    cl::loss<T, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::chunked> l(
        cl::temperature::fixed(0.05f), cl::scaler::static_scale(256.0f), threads);
    ASSERT_TRUE(l.set_chunk({chunk_rows, 0}).ok());
    // Rows are rounded up to the host's row block (the ISA's: host::block_m), at most all rows padded.
    const std::size_t bm = cl::host::block_m;
    EXPECT_EQ(l.chunk_rows_for(p), std::min((chunk_rows + bm - 1) / bm * bm, (c.n_q + bm - 1) / bm * bm));
    const ct::reference ref = ct::compute_reference(
        ct::to_double(q), ct::to_double(k), c.n_q, c.n_k, c.dim, p.labels, c.obj, 1.0 / double(0.05f));
    std::vector<T> dq(c.n_q * c.dim), dk(c.n_k * c.dim);
    cl::step_record rec;
    ASSERT_TRUE(l.step(p, dq.data(), dk.data(), rec).ok());
    ASSERT_EQ(rec.first_nonfinite, cl::nonfinite_site::none);
    EXPECT_NEAR(rec.loss, ref.loss, tol::loss(ref.max_abs_logit));
    EXPECT_LE(ct::max_rel_error(dq, ref.dq, 1.0 / 256.0), tol::grad(ref.max_abs_logit));
    EXPECT_LE(ct::max_rel_error(dk, ref.dk, 1.0 / 256.0), tol::grad(ref.max_abs_logit));
    EXPECT_NEAR(
        rec.grad_logit_scale, ref.grad_logit_scale, tol::grad(ref.max_abs_logit) * (1.0 + ref.max_abs_logit) + 1e-6);
    EXPECT_EQ(l.bytes_held(), formula_bytes(p, threads, {chunk_rows, 0}));
  }
}
} // namespace

TEST(Chunked, ManyChunksMatchFloat64)
{
  // One row block per chunk, a request that rounds up to two, and one chunk of every row.
  for (std::size_t rows : {cl::host::block_m, cl::host::block_m + 1, std::size_t(4096)})
  {
    for (unsigned threads : {1u, 3u})
    {
      check_against_reference<float>(rows, threads);
      check_against_reference<__half>(rows, threads);
      check_against_reference<__nv_bfloat16>(rows, threads);
    }
  }
}

// The chunk size changes only the order of float additions: one chunk and many agree to float accuracy, and each is
// bit-reproducible run to run.
TEST(Chunked, ChunkSizeDoesNotChangeTheResult)
{
  const std::size_t n = 333, dim = 48;
  const auto q = ct::random_rows<float>(n, dim, 91);
  const auto k = ct::random_rows<float>(n, dim, 92);
  cl::problem<float> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  auto run = [&](std::size_t rows)
  {
    cl::loss<float, cl::temperature::learnable, cl::scaler::static_scale, cl::algorithm::chunked> l(
        cl::temperature::learnable(0.03f), {}, 2);
    EXPECT_TRUE(l.set_chunk({rows, 0}).ok());
    std::vector<float> dq(n * dim), dk(n * dim);
    cl::step_record r;
    EXPECT_TRUE(l.forward_backward(p, dq.data(), dk.data(), r).ok());
    return std::make_tuple(r, dq, dk);
  };
  const auto [r1, dq1, dk1] = run(64);
  const auto [r2, dq2, dk2] = run(0);
  const auto [r3, dq3, dk3] = run(64);
  EXPECT_NEAR(r1.loss, r2.loss, 2e-6 * r2.loss);
  EXPECT_NEAR(r1.grad_logit_scale, r2.grad_logit_scale, 1e-5 * (1.0 + std::fabs(r2.grad_logit_scale)));
  double err = 0.0, mag = 0.0;
  for (std::size_t i = 0; i < n * dim; ++i)
  {
    err = std::max(err, double(std::fabs(dq1[i] - dq2[i])) + double(std::fabs(dk1[i] - dk2[i])));
    mag = std::max(mag, double(std::fabs(dq2[i])));
  }
  EXPECT_LE(err / mag, 1e-5);
  EXPECT_EQ(r1.loss, r3.loss);
  EXPECT_EQ(dq1, dq3);
  EXPECT_EQ(dk1, dk3);
}

// Chunked agrees with fused (both keep float logits and form the positive's gradient exactly).
TEST(Chunked, AgreesWithFused)
{
  const std::size_t n = 257, dim = 64;
  const auto q = ct::random_rows<float>(n, dim, 93);
  const auto k = ct::random_rows<float>(n, dim, 94);
  cl::problem<float> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  cl::loss<float, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::chunked> a(
      cl::temperature::fixed(0.02f));
  cl::loss<float, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::fused> b(
      cl::temperature::fixed(0.02f));
  ASSERT_TRUE(a.set_chunk({128, 0}).ok());
  std::vector<float> dq1(n * dim), dk1(n * dim), dq2(n * dim), dk2(n * dim);
  cl::step_record r1, r2;
  ASSERT_TRUE(a.step(p, dq1.data(), dk1.data(), r1).ok());
  ASSERT_TRUE(b.step(p, dq2.data(), dk2.data(), r2).ok());
  EXPECT_NEAR(r1.loss, r2.loss, 2e-6 * r2.loss);
  EXPECT_EQ(r1.max_logit, r2.max_logit);
  double err = 0.0, mag = 0.0;
  for (std::size_t i = 0; i < n * dim; ++i)
  {
    err = std::max(err, double(std::fabs(dk1[i] - dk2[i])));
    mag = std::max(mag, double(std::fabs(dk2[i])));
  }
  EXPECT_LE(err / mag, 1e-5);
}

// The forward's separate entry points: row/column log-sum-exps; backward twice needs a new forward; a cached single
// chunk is not reused after the backward overwrote it with G.
TEST(Chunked, ForwardThenBackwardAndAgain)
{
  const std::size_t n = 100, dim = 24;
  const auto q = ct::random_rows<float>(n, dim, 95);
  const auto k = ct::random_rows<float>(n, dim, 96);
  cl::problem<float> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  const auto ref = ct::compute_reference(ct::to_double(q), ct::to_double(k), n, n, dim, nullptr, p.obj, 1.0 / 0.07f);
  for (std::size_t rows : {64u, 0u})
  {
    cl::loss<float, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::chunked> l(
        cl::temperature::fixed(0.07f));
    ASSERT_TRUE(l.set_chunk({rows, 0}).ok());
    for (int round = 0; round < 2; ++round)
    {
      float value = 0.0f, g = 0.0f;
      std::vector<float> row(n), col(n), dq(n * dim), dk(n * dim);
      ASSERT_TRUE(l.forward(p, value, row.data(), col.data()).ok());
      EXPECT_NEAR(value, ref.loss, 2e-6 * ref.loss);
      for (std::size_t i = 0; i < n; ++i)
      {
        EXPECT_NEAR(row[i], ref.row_lse[i], 2e-6 * std::fabs(ref.row_lse[i]) + 1e-6);
        EXPECT_NEAR(col[i], ref.col_lse[i], 2e-6 * std::fabs(ref.col_lse[i]) + 1e-6);
      }
      ASSERT_TRUE(l.backward(dq.data(), dk.data(), g).ok());
      EXPECT_LE(ct::max_rel_error(dq, ref.dq), 1e-5);
      EXPECT_LE(ct::max_rel_error(dk, ref.dk), 1e-5);
      EXPECT_NEAR(g, ref.grad_logit_scale, 1e-5);
      EXPECT_EQ(l.backward(dq.data(), dk.data(), g).code(), cl::errc::invalid_argument);
    }
  }
}

// Options: rounding and clamping of rows, the budget, and a refusal on other algorithms.
TEST(Chunked, OptionsAndMemory)
{
  const std::size_t n = 1000, dim = 32;
  const auto q = ct::random_rows<float>(n, dim, 97);
  const auto k = ct::random_rows<float>(n, dim, 98);
  cl::problem<float> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  cl::loss<float, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::chunked> l(
      cl::temperature::fixed(0.07f), {}, 2);
  // The row block and key tile are the ISA's (host/gemm.hpp), so the expectations are derived from them.
  const std::size_t bm = cl::host::block_m, bn = cl::host::block_n;
  const std::size_t all_rows = (n + bm - 1) / bm * bm;
  ASSERT_TRUE(l.set_chunk({1, 0}).ok());
  EXPECT_EQ(l.chunk_rows_for(p), bm); // at least one row block
  ASSERT_TRUE(l.set_chunk({bm + 1, 0}).ok());
  EXPECT_EQ(l.chunk_rows_for(p), 2 * bm); // rounded up to the row block
  ASSERT_TRUE(l.set_chunk({1u << 30, 0}).ok());
  EXPECT_EQ(l.chunk_rows_for(p), all_rows);                             // every row, padded
  const std::size_t row_bytes = (n + bn - 1) / bn * bn * sizeof(float); // n_k padded to the key tile
  ASSERT_TRUE(l.set_chunk({0, 300 * row_bytes}).ok());
  const std::size_t budget_rows = 300 / bm * bm;
  ASSERT_GE(budget_rows, bm);
  ASSERT_LT(budget_rows, all_rows);
  EXPECT_EQ(l.chunk_rows_for(p), budget_rows); // what fits in the budget, whole row blocks
  std::vector<float> dq(n * dim), dk(n * dim);
  cl::step_record r;
  ASSERT_TRUE(l.step(p, dq.data(), dk.data(), r).ok());
  const std::size_t small = l.bytes_held();
  EXPECT_EQ(small, formula_bytes(p, 2, {0, 300 * row_bytes}));
  ASSERT_TRUE(l.set_chunk({all_rows, 0}).ok());
  ASSERT_TRUE(l.step(p, dq.data(), dk.data(), r).ok());
  EXPECT_EQ(l.bytes_held(), small + (all_rows - budget_rows) * row_bytes);

  cl::loss<float> fused;
  const cl::status s = fused.set_chunk({128, 0});
  EXPECT_EQ(s.code(), cl::errc::invalid_argument);
  EXPECT_EQ(s.argument(), "chunk");
}
