// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
// distributed::loss against the one-process loss on the concatenated batch. Built twice: with comm::local (always;
// one rank, no MPI) and, when MPI is found, with comm::mpi and run by ctest under mpiexec with 2 and 4 ranks
// (-DCONTRASTIVE_TEST_MPI). Every rank builds the same global batch from the same seed and checks its own slice.
// The multi-rank bodies are templates over the communicator: the local build also runs them over 2-4 thread ranks
// (tests/thread_comm.hpp), so out-of-step ranks and one rank's bad input are tested without MPI.
#include "test_util.hpp"
#include "thread_comm.hpp"

#include <contrastive/contrastive.hpp>
#include <contrastive/distributed/loss.hpp>

#if defined(CONTRASTIVE_TEST_MPI)
#include <contrastive/comm/mpi.hpp>
#include <mpi.h>
#endif

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace cl = contrastive;
namespace ct = contrastive_test;

namespace
{
#if defined(CONTRASTIVE_TEST_MPI)
using comm_t = cl::distributed::comm::mpi;
int world_rank()
{
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size()
{
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}
#else
using comm_t = cl::distributed::comm::local;
int world_rank()
{
  return 0;
}
int world_size()
{
  return 1;
}
#endif

/// Rank r's share of n rows: unequal on purpose (the first n % ranks ranks get one more).
struct split
{
  std::size_t offset, count;
};
split share(std::size_t n, int rank, int ranks)
{
  const std::size_t base = n / ranks, extra = n % ranks;
  const std::size_t r = static_cast<std::size_t>(rank);
  return {r * base + std::min(r, extra), base + (r < extra ? 1 : 0)};
}

template <class T>
std::vector<T> rows_of(const std::vector<T>& all, split s, std::size_t dim)
{
  return std::vector<T>(all.begin() + s.offset * dim, all.begin() + (s.offset + s.count) * dim);
}

cl::scaler::dynamic scaler_at(float scale)
{
  cl::scaler::dynamic d = cl::scaler::dynamic::torch();
  d.scale = scale;
  d.growth_interval = 3;
  return d;
}

template <class T, class Algorithm, class Comm = comm_t>
void matches_one_process(cl::objective obj, bool labels, std::uint32_t seed, Comm comm = Comm{})
{
  const int rank = comm.rank(), ranks = comm.size();
  const std::size_t n_q = 4 * static_cast<std::size_t>(ranks) + 3;
  const std::size_t n_k = obj == cl::objective::symmetric ? n_q : n_q + 5 * static_cast<std::size_t>(ranks) + 1;
  const std::size_t dim = 24;
  SCOPED_TRACE(std::string(cl::element_traits<T>::name) + " " + Algorithm::name + " " + cl::to_string(obj) +
               (labels ? " labels" : "") + " ranks " + std::to_string(ranks));
  const auto q = ct::random_rows<T>(n_q, dim, seed);
  const auto k = ct::random_rows<T>(n_k, dim, seed + 1);
  const auto all_labels = ct::random_labels(n_q, n_k, seed + 2);
  const split sq = share(n_q, rank, ranks), sk = share(n_k, rank, ranks);
  const auto q_mine = rows_of(q, sq, dim), k_mine = rows_of(k, sk, dim);
  const std::vector<std::int32_t> labels_mine(all_labels.begin() + sq.offset,
                                              all_labels.begin() + sq.offset + sq.count);
  const float scale = std::is_same_v<T, float> ? 1.0f : 256.0f;
  const bool sigmoid = obj == cl::objective::sigmoid;
  const auto temp = cl::temperature::learnable(sigmoid ? 0.1f : 0.05f, cl::optimizer::adam(1e-2f));

  cl::loss<T, cl::temperature::learnable, cl::scaler::dynamic, Algorithm> one(temp, scaler_at(scale), 1);
  cl::distributed::loss<T, cl::temperature::learnable, cl::scaler::dynamic, Algorithm, Comm> dist(
      comm, temp, scaler_at(scale), 1);
  if (sigmoid) // SigLIP: a learnable bias from -10, trained in lockstep on every rank
  {
    ASSERT_TRUE(one.set_logit_bias(cl::logit_bias::learnable(-10.0f, cl::optimizer::adam(1e-1f))).ok());
    ASSERT_TRUE(dist.set_logit_bias(cl::logit_bias::learnable(-10.0f, cl::optimizer::adam(1e-1f))).ok());
  }
  for (int step = 0; step < 2; ++step)
  {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<T> dq1(n_q * dim), dk1(n_k * dim), dq(sq.count * dim), dk(sk.count * dim);
    cl::step_record r1, r;
    ASSERT_TRUE(one.step({q.data(), k.data(), n_q, n_k, dim, labels ? all_labels.data() : nullptr, obj},
                         dq1.data(),
                         dk1.data(),
                         r1)
                    .ok());
    const cl::status st =
        dist.step({q_mine.data(), k_mine.data(), sq.count, sk.count, dim, labels ? labels_mine.data() : nullptr, obj},
                  dq.data(),
                  dk.data(),
                  r);
    ASSERT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(dist.global_queries(), n_q);
    EXPECT_EQ(dist.global_keys(), n_k);
    // Float: the 1e-6; 16-bit: the same float results rounded once more or less (one unit of T).
    const double tol = std::is_same_v<T, float> ? 1e-6 : 2.0 * ct::tolerance<T, Algorithm>::u_t;
    EXPECT_NEAR(r.loss, r1.loss, 1e-6 * std::fabs(r1.loss));
    EXPECT_LE(ct::rel_diff(dq, rows_of(dq1, sq, dim)), tol);
    EXPECT_LE(ct::rel_diff(dk, rows_of(dk1, sk, dim)), tol);
    EXPECT_NEAR(r.grad_logit_scale, r1.grad_logit_scale, 1e-5 * (1.0 + std::fabs(r1.grad_logit_scale)));
    EXPECT_EQ(r.max_logit, r1.max_logit);
    EXPECT_EQ(r.skipped, r1.skipped);
    EXPECT_EQ(r.first_nonfinite, r1.first_nonfinite);
    EXPECT_EQ(dist.tau(), one.tau());
    EXPECT_EQ(dist.loss_scale(), one.loss_scale());
    EXPECT_NEAR(r.grad_logit_bias, r1.grad_logit_bias, 1e-5 * (1.0 + std::fabs(r1.grad_logit_bias)));
    EXPECT_EQ(dist.bias().value, one.bias().value);
  }
}
} // namespace

TEST(Distributed, MatchesOneProcessOnTheConcatenatedBatch)
{
  std::uint32_t seed = 300;
  for (cl::objective obj : {cl::objective::symmetric, cl::objective::info_nce, cl::objective::sigmoid})
  {
    for (bool labels : {false, true})
    {
      if (obj == cl::objective::symmetric && labels)
      {
        continue;
      }
      matches_one_process<float, cl::algorithm::fused>(obj, labels, seed += 7);
      matches_one_process<float, cl::algorithm::materialized>(obj, labels, seed += 7);
      matches_one_process<float, cl::algorithm::chunked>(obj, labels, seed += 7);
      matches_one_process<__half, cl::algorithm::fused>(obj, labels, seed += 7);
      matches_one_process<__half, cl::algorithm::materialized>(obj, labels, seed += 7);
      matches_one_process<__nv_bfloat16, cl::algorithm::fused>(obj, labels, seed += 7);
      matches_one_process<__nv_bfloat16, cl::algorithm::chunked>(obj, labels, seed += 7);
    }
  }
}

// Random shapes (one row per rank up to a few hundred, feature widths 1 to 40, both objectives, labels, every
// algorithm, several chunks): every rank draws the same cases and checks its slice against the one-process loss.
TEST(Distributed, RandomShapesMatchOneProcess)
{
  const int rank = world_rank(), ranks = world_size();
  std::mt19937 rng(2024);
  for (int c = 0; c < 36; ++c)
  {
    const bool sym = rng() % 2 == 0;
    const bool labels = !sym && rng() % 2 == 0;
    const std::size_t n_q = static_cast<std::size_t>(ranks) + rng() % (c % 6 == 0 ? 300 : 40);
    const std::size_t n_k = sym ? n_q : n_q + rng() % 30;
    const std::size_t dim = 1 + rng() % 40;
    const unsigned algo = rng() % 3;
    const auto obj = sym ? cl::objective::symmetric : cl::objective::info_nce;
    SCOPED_TRACE("case " + std::to_string(c) + ": n_q " + std::to_string(n_q) + " n_k " + std::to_string(n_k) +
                 " dim " + std::to_string(dim) + " " + cl::to_string(obj) + (labels ? " labels" : "") + " algorithm " +
                 std::to_string(algo));
    const auto q = ct::random_rows<float>(n_q, dim, 5000u + 3u * c);
    const auto k = ct::random_rows<float>(n_k, dim, 5001u + 3u * c);
    const auto all_labels = ct::random_labels(n_q, n_k, 5002u + 3u * c);
    const split sq = share(n_q, rank, ranks), sk = share(n_k, rank, ranks);
    const auto qm = rows_of(q, sq, dim), km = rows_of(k, sk, dim);
    const std::vector<std::int32_t> lm(all_labels.begin() + sq.offset, all_labels.begin() + sq.offset + sq.count);
    std::vector<float> dq1(n_q * dim), dk1(n_k * dim), dq(sq.count * dim), dk(sk.count * dim);
    cl::step_record r1, r;
    auto run = [&](auto algorithm)
    {
      using A = decltype(algorithm);
      cl::loss<float, cl::temperature::fixed, cl::scaler::static_scale, A> one(cl::temperature::fixed(0.1f));
      cl::distributed::loss<float, cl::temperature::fixed, cl::scaler::static_scale, A, comm_t> dist(
          comm_t{}, cl::temperature::fixed(0.1f));
      if constexpr (std::is_same_v<A, cl::algorithm::chunked>)
      {
        EXPECT_TRUE(one.set_chunk({64, 0}).ok());
        EXPECT_TRUE(dist.set_chunk({64, 0}).ok());
      }
      ASSERT_TRUE(one.step({q.data(), k.data(), n_q, n_k, dim, labels ? all_labels.data() : nullptr, obj},
                           dq1.data(),
                           dk1.data(),
                           r1)
                      .ok());
      const cl::status st = dist.step(
          {qm.data(), km.data(), sq.count, sk.count, dim, labels ? lm.data() : nullptr, obj}, dq.data(), dk.data(), r);
      ASSERT_TRUE(st.ok()) << st.message();
    };
    if (algo == 0)
    {
      run(cl::algorithm::fused{});
    }
    else if (algo == 1)
    {
      run(cl::algorithm::materialized{});
    }
    else
    {
      run(cl::algorithm::chunked{});
    }
    EXPECT_NEAR(r.loss, r1.loss, 2e-6 * std::fabs(r1.loss) + 1e-7);
    EXPECT_LE(ct::rel_diff(dq, rows_of(dq1, sq, dim)), 2e-6);
    EXPECT_LE(ct::rel_diff(dk, rows_of(dk1, sk, dim)), 2e-6);
    EXPECT_NEAR(r.grad_logit_scale, r1.grad_logit_scale, 2e-5 * (1.0 + std::fabs(r1.grad_logit_scale)));
    EXPECT_EQ(r.first_nonfinite, r1.first_nonfinite);
  }
}

// A non-finite gradient found by one rank's unscale_and_check skips the step on every rank, and the policies stay in
// lockstep (tau unchanged, the scaler backed off everywhere).
TEST(Distributed, NonFiniteOnOneRankSkipsTheStepOnAll)
{
  const int rank = world_rank(), ranks = world_size();
  const std::size_t n = 8 * static_cast<std::size_t>(ranks), dim = 16;
  const auto q = ct::random_rows<float>(n, dim, 41), k = ct::random_rows<float>(n, dim, 42);
  const split s = share(n, rank, ranks);
  const auto qm = rows_of(q, s, dim), km = rows_of(k, s, dim);
  cl::distributed::loss<float, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::fused, comm_t> dist(
      comm_t{}, cl::temperature::learnable(0.07f), scaler_at(1024.0f));
  std::vector<float> dq(s.count * dim), dk(s.count * dim);
  cl::step_record rec;
  ASSERT_TRUE(dist.forward_backward({qm.data(), km.data(), s.count, s.count, dim, nullptr, cl::objective::symmetric},
                                    dq.data(),
                                    dk.data(),
                                    rec)
                  .ok());
  std::vector<float> own(5, 1.0f);
  if (rank == ranks - 1)
  {
    own[2] = NAN;
  }
  ASSERT_TRUE(dist.unscale_and_check(own.data(), own.size(), rec).ok());
  const float tau = dist.tau();
  ASSERT_TRUE(dist.finish_step(rec).ok());
  EXPECT_TRUE(rec.skipped);
  EXPECT_EQ(rec.first_nonfinite, cl::nonfinite_site::parameters);
  EXPECT_EQ(dist.tau(), tau);
  EXPECT_EQ(dist.loss_scale(), 512.0f);
  EXPECT_EQ(dist.steps(), 1);
}

namespace
{
// Bad input on one rank is reported on every rank, naming the rank once and the argument once, and changes nothing
// anywhere (no deadlock: the ctest timeout, and over thread ranks the thread_world's watchdog, bound this test).
template <class Comm>
void bad_input_on_one_rank(Comm comm)
{
  const int rank = comm.rank(), ranks = comm.size();
  const int culprit = ranks - 1;
  const std::size_t n = 6 * static_cast<std::size_t>(ranks), dim = 12;
  const auto q = ct::random_rows<float>(n, dim, 51), k = ct::random_rows<float>(n, dim, 52);
  const split s = share(n, rank, ranks);
  auto qm = rows_of(q, s, dim), km = rows_of(k, s, dim);
  cl::distributed::loss<float, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::fused, Comm> dist(
      comm, cl::temperature::learnable(0.07f), scaler_at(64.0f));
  const auto before = dist.save();
  std::vector<float> dq(s.count * dim, 7.0f), dk(s.count * dim, 7.0f);
  auto expect_refused = [&](const cl::problem<float>& p, cl::errc code, const char* argument)
  {
    cl::step_record rec;
    const cl::status st = dist.step(p, dq.data(), dk.data(), rec);
    EXPECT_EQ(st.code(), code) << st.message();
    EXPECT_EQ(st.argument(), argument);
    // "argument: rank r: what", the argument not repeated after the rank.
    const std::string head = std::string(argument) + ": rank " + std::to_string(culprit) + ": ";
    EXPECT_EQ(st.message().rfind(head, 0), 0u) << st.message();
    EXPECT_EQ(st.message().find(std::string(argument) + ": ", head.size()), std::string::npos) << st.message();
    const auto after = dist.save();
    EXPECT_EQ(std::memcmp(&before, &after, sizeof before), 0);
    for (float v : dq)
    {
      ASSERT_EQ(v, 7.0f);
    }
    for (float v : dk)
    {
      ASSERT_EQ(v, 7.0f);
    }
  };
  const cl::problem<float> good{qm.data(), km.data(), s.count, s.count, dim, nullptr, cl::objective::symmetric};

  // A non-finite key on the culprit (written in place: `good` points into km).
  const float kept = km[3];
  if (rank == culprit)
  {
    km[3] = INFINITY;
  }
  expect_refused(good, cl::errc::non_finite_input, "k");
  {
    cl::step_record rec;
    EXPECT_EQ(dist.step(good, dq.data(), dk.data(), rec).message(),
              "k: rank " + std::to_string(culprit) + ": k[0][3] is not finite");
  }
  km[3] = kept;

  // A different feature width on the culprit (with one rank there is nothing to differ from).
  cl::problem<float> p = good;
  if (ranks > 1)
  {
    if (rank == culprit)
    {
      p.dim = dim - 1;
    }
    expect_refused(p, cl::errc::shape_mismatch, "dim");
  }

  // A label outside the global key range on the culprit (info_nce).
  std::vector<std::int32_t> labels(s.count, 0);
  if (rank == culprit)
  {
    labels[0] = static_cast<std::int32_t>(n);
  }
  p = good;
  p.obj = cl::objective::info_nce;
  p.labels = labels.data();
  expect_refused(p, cl::errc::label_out_of_range, "labels");

  // A null output on the culprit.
  cl::step_record rec;
  const cl::status st = dist.step(good, rank == culprit ? nullptr : dq.data(), dk.data(), rec);
  EXPECT_EQ(st.code(), cl::errc::null_pointer);
  EXPECT_NE(st.message().find("rank " + std::to_string(culprit) + ":"), std::string::npos);

  // And the loss still works afterwards.
  EXPECT_TRUE(dist.step(good, dq.data(), dk.data(), rec).ok());
}
} // namespace

TEST(Distributed, BadInputOnOneRankIsReportedOnAll)
{
  bad_input_on_one_rank(comm_t{});
}

namespace
{
template <class Comm>
using out_of_step_loss =
    cl::distributed::loss<float, cl::temperature::learnable, cl::scaler::static_scale, cl::algorithm::fused, Comm>;

/// One rank's rows of a small symmetric batch, with sentinel-filled outputs.
struct rank_rows
{
  std::size_t n, dim, count;
  std::vector<float> q, k, dq, dk;
  rank_rows(int rank, int ranks) : n(3 * static_cast<std::size_t>(ranks) + 1), dim(8)
  {
    const split s = share(n, rank, ranks);
    count = s.count;
    q = rows_of(ct::random_rows<float>(n, dim, 81), s, dim);
    k = rows_of(ct::random_rows<float>(n, dim, 82), s, dim);
    reset();
  }
  cl::problem<float> problem() const
  {
    return {q.data(), k.data(), count, count, dim, nullptr, cl::objective::symmetric};
  }
  void reset()
  {
    dq.assign(count * dim, 7.0f);
    dk.assign(count * dim, 7.0f);
  }
  bool untouched() const
  {
    for (std::size_t i = 0; i < dq.size(); ++i)
    {
      if (dq[i] != 7.0f || dk[i] != 7.0f)
      {
        return false;
      }
    }
    return true;
  }
};

void expect_out_of_step(const cl::status& st, const std::vector<std::string>& where)
{
  EXPECT_EQ(st.code(), cl::errc::invalid_argument) << st.message();
  EXPECT_EQ(st.argument(), "step");
  EXPECT_EQ(st.message().rfind("step: ranks out of step: ", 0), 0u) << st.message();
  for (const std::string& w : where)
  {
    EXPECT_NE(st.message().find(w), std::string::npos) << "no \"" << w << "\" in: " << st.message();
  }
}

/// Rank 1 skips the whole step of iteration 2 (the others do not): with the caller's iteration, every rank is
/// refused at its first wrong call (rank 1 at iteration 3, the others at 2), nothing is written, no rank steps.
template <class Comm>
void rank_skipping_a_step(Comm comm)
{
  const int rank = comm.rank();
  rank_rows rows(rank, comm.size());
  out_of_step_loss<Comm> dist(comm, cl::temperature::learnable(0.07f), {}, 1);
  int refused_at = -1;
  cl::status refusal;
  for (int it = 0; it < 6; ++it)
  {
    if (rank == 1 && it == 2)
    {
      continue; // the caller's bug
    }
    rows.reset();
    cl::step_record rec;
    const cl::status st = dist.step(rows.problem(), rows.dq.data(), rows.dk.data(), rec, it);
    if (!st.ok())
    {
      refused_at = it;
      refusal = st;
      EXPECT_TRUE(rows.untouched());
      EXPECT_TRUE(rec.pending == false);
      break;
    }
    EXPECT_EQ(rec.step, it);
  }
  EXPECT_EQ(refused_at, rank == 1 ? 3 : 2);
  expect_out_of_step(
      refusal,
      {"rank 0 at step 2 (iteration 2) in forward_backward", "rank 1 at step 2 (iteration 3) in forward_backward"});
  EXPECT_EQ(dist.steps(), 2);
}

/// Rank 1 runs forward_backward but skips finish_step; the others call step(). The loss's own step count and call
/// kind catch it without an iteration: the others' finish_step meets rank 1's next forward_backward and both are
/// refused on every rank. Refused calls change nothing, so every rank then finishes the pending step and they go
/// on together, in lockstep with one process.
template <class Comm>
void rank_skipping_finish_step(Comm comm)
{
  const int rank = comm.rank(), ranks = comm.size();
  rank_rows rows(rank, ranks);
  const auto temp = cl::temperature::learnable(0.07f, cl::optimizer::adam(1e-2f));
  out_of_step_loss<Comm> dist(comm, temp, {}, 1);
  cl::loss<float, cl::temperature::learnable> one(temp, {}, 1);
  const auto q = ct::random_rows<float>(rows.n, rows.dim, 81), k = ct::random_rows<float>(rows.n, rows.dim, 82);
  std::vector<float> dq1(q.size()), dk1(k.size());
  cl::step_record rec, r1;
  ASSERT_TRUE(dist.step(rows.problem(), rows.dq.data(), rows.dk.data(), rec).ok());
  ASSERT_TRUE(one.step({q.data(), k.data(), rows.n, rows.n, rows.dim}, dq1.data(), dk1.data(), r1).ok());
  const std::vector<std::string> where = {"rank 0 at step 1 in finish_step", "rank 1 at step 1 in forward_backward"};
  if (rank != 1)
  {
    const cl::status st = dist.step(rows.problem(), rows.dq.data(), rows.dk.data(), rec);
    expect_out_of_step(st, where);
    EXPECT_TRUE(rec.pending); // its forward_backward went through; the refused finish_step left the record alone
  }
  else
  {
    ASSERT_TRUE(dist.forward_backward(rows.problem(), rows.dq.data(), rows.dk.data(), rec).ok());
    rank_rows again(rank, ranks);
    cl::step_record rec2;
    const cl::status st = dist.forward_backward(again.problem(), again.dq.data(), again.dk.data(), rec2);
    expect_out_of_step(st, where);
    EXPECT_TRUE(again.untouched());
  }
  EXPECT_EQ(dist.steps(), 1);
  ASSERT_TRUE(dist.finish_step(rec).ok());
  ASSERT_TRUE(one.step({q.data(), k.data(), rows.n, rows.n, rows.dim}, dq1.data(), dk1.data(), r1).ok());
  EXPECT_EQ(dist.steps(), 2);
  EXPECT_EQ(dist.tau(), one.tau());
  ASSERT_TRUE(dist.step(rows.problem(), rows.dq.data(), rows.dk.data(), rec).ok());
  EXPECT_EQ(rec.step, 2);
}

/// finish_step takes only each rank's step in progress: rank 1 hands in a copy of its already finished record while
/// the others hand in their live ones, and every rank is refused naming rank 1, nothing changes, and the live records
/// then finish together. A gradient of the temperature that rank 0's caller made non-finite skips the step on every
/// rank: no rank's temperature moves.
template <class Comm>
void rank_finishing_a_stale_record(Comm comm)
{
  const int rank = comm.rank();
  rank_rows rows(rank, comm.size());
  out_of_step_loss<Comm> dist(comm, cl::temperature::learnable(0.07f, cl::optimizer::adam(1e-2f)), {}, 1);
  cl::step_record rec;
  ASSERT_TRUE(dist.forward_backward(rows.problem(), rows.dq.data(), rows.dk.data(), rec).ok());
  const cl::step_record finished_copy = rec;
  ASSERT_TRUE(dist.finish_step(rec).ok());
  ASSERT_TRUE(dist.forward_backward(rows.problem(), rows.dq.data(), rows.dk.data(), rec).ok());
  const float tau = dist.tau();
  cl::step_record stale = finished_copy;
  const cl::status st = dist.finish_step(rank == 1 ? stale : rec);
  EXPECT_EQ(st.code(), cl::errc::invalid_argument) << st.message();
  EXPECT_EQ(st.argument(), "rec");
  EXPECT_NE(st.message().find("rank 1: no step in progress"), std::string::npos) << st.message();
  EXPECT_TRUE(rec.pending);
  EXPECT_EQ(dist.steps(), 1);
  EXPECT_EQ(dist.tau(), tau);
  ASSERT_TRUE(dist.finish_step(rec).ok());
  EXPECT_FALSE(rec.skipped);
  EXPECT_EQ(dist.steps(), 2);
  EXPECT_NE(dist.tau(), tau);
  // A caller-edited non-finite gradient on one rank: every rank skips.
  ASSERT_TRUE(dist.forward_backward(rows.problem(), rows.dq.data(), rows.dk.data(), rec).ok());
  const float tau2 = dist.tau();
  if (rank == 0)
  {
    rec.grad_logit_scale = std::numeric_limits<float>::infinity();
  }
  ASSERT_TRUE(dist.finish_step(rec).ok());
  EXPECT_TRUE(rec.skipped);
  EXPECT_EQ(rec.first_nonfinite, cl::nonfinite_site::grad_logit_scale);
  EXPECT_EQ(dist.tau(), tau2);
}

/// A rank restored from another checkpoint (its step count differs) is refused on every rank at the next call.
template <class Comm>
void rank_restored_elsewhere(Comm comm)
{
  const int rank = comm.rank();
  rank_rows rows(rank, comm.size());
  out_of_step_loss<Comm> dist(comm, cl::temperature::learnable(0.07f), {}, 1);
  if (rank == 1)
  {
    auto c = dist.save();
    c.step = 5;
    ASSERT_TRUE(dist.restore(c).ok());
  }
  cl::step_record rec;
  expect_out_of_step(dist.step(rows.problem(), rows.dq.data(), rows.dk.data(), rec),
                     {"rank 0 at step 0 in forward_backward", "rank 1 at step 5 in forward_backward"});
  EXPECT_TRUE(rows.untouched());
}

/// A rank whose logit scale (tau) or logit bias differs from rank 0's, bit for bit, is refused on every rank, naming
/// it, before anything moves; with the same values the step goes on.
template <class Comm>
void rank_with_other_scalars(Comm comm)
{
  const int rank = comm.rank();
  const int culprit = comm.size() - 1;
  rank_rows rows(rank, comm.size());
  cl::distributed::loss<float, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::fused, Comm> dist(
      comm, cl::temperature::fixed(rank == culprit ? 0.05f : 0.07f), {}, 1);
  cl::step_record rec;
  cl::status st = dist.step(rows.problem(), rows.dq.data(), rows.dk.data(), rec);
  EXPECT_EQ(st.code(), cl::errc::invalid_argument);
  const auto g9 = [](float v)
  {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(v));
    return std::string(buf);
  };
  const std::string scale_msg = "logit_scale: rank " + std::to_string(culprit) +
                                ": logit scale s = " + g9(cl::temperature::fixed(0.05f).scale()) +
                                " (1/tau) where rank 0 has " + g9(cl::temperature::fixed(0.07f).scale());
  EXPECT_EQ(st.message().rfind(scale_msg, 0), 0u) << st.message();
  EXPECT_TRUE(rows.untouched());
  EXPECT_EQ(dist.steps(), 0);

  // The sigmoid objective: the same temperature, a bias that differs on the culprit, then the same bias.
  cl::distributed::loss<float, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::fused, Comm> sig(
      comm, cl::temperature::fixed(0.1f), {}, 1);
  ASSERT_TRUE(sig.set_logit_bias(cl::logit_bias::fixed(rank == culprit ? -9.5f : -10.0f)).ok());
  cl::problem<float> p = rows.problem();
  p.obj = cl::objective::sigmoid;
  st = sig.step(p, rows.dq.data(), rows.dk.data(), rec);
  EXPECT_EQ(st.code(), cl::errc::invalid_argument);
  EXPECT_EQ(st.message().rfind(
                "logit_bias: rank " + std::to_string(culprit) + ": logit bias b = -9.5 where rank 0 has -10", 0),
            0u)
      << st.message();
  EXPECT_TRUE(rows.untouched());
  ASSERT_TRUE(sig.set_logit_bias(cl::logit_bias::fixed(-10.0f)).ok());
  EXPECT_TRUE(sig.step(p, rows.dq.data(), rows.dk.data(), rec).ok());
  EXPECT_FALSE(rows.untouched());
}

/// forward then backward (collectives of their own) equal forward_backward bit for bit; a backward without a forward
/// on one rank is refused on every rank naming it; forward on one rank against forward_backward on the others is
/// out of step. The column log-sum-exps of this rank's keys match the one-process forward's.
template <class Comm>
void forward_then_backward(Comm comm)
{
  const int rank = comm.rank();
  rank_rows rows(rank, comm.size());
  out_of_step_loss<Comm> a(comm, cl::temperature::learnable(0.07f), {}, 1);
  out_of_step_loss<Comm> b(comm, cl::temperature::learnable(0.07f), {}, 1);
  cl::step_record rec;
  ASSERT_TRUE(a.forward_backward(rows.problem(), rows.dq.data(), rows.dk.data(), rec).ok());
  const std::vector<float> dq_a = rows.dq, dk_a = rows.dk;
  rows.reset();
  float value = 0.0f, g = 0.0f;
  std::vector<float> row_lse(rows.count), col_lse(rows.count);
  ASSERT_TRUE(b.forward(rows.problem(), value, row_lse.data(), col_lse.data()).ok());
  ASSERT_TRUE(b.backward(rows.dq.data(), rows.dk.data(), g).ok());
  EXPECT_EQ(value, rec.loss);
  EXPECT_EQ(g / a.loss_scale(), rec.grad_logit_scale);
  EXPECT_EQ(rows.dq, dq_a);
  EXPECT_EQ(rows.dk, dk_a);
  EXPECT_EQ(b.diagnose(), cl::nonfinite_site::none);
  // The one-process forward on the whole batch: this rank's slice of its column log-sum-exps.
  const std::size_t n = rows.n;
  const auto q = ct::random_rows<float>(n, rows.dim, 81), k = ct::random_rows<float>(n, rows.dim, 82);
  cl::loss<float, cl::temperature::learnable> one(cl::temperature::learnable(0.07f), {}, 1);
  std::vector<float> col_all(n);
  float v1 = 0.0f;
  ASSERT_TRUE(one.forward({q.data(), k.data(), n, n, rows.dim}, v1, nullptr, col_all.data()).ok());
  const split sk = share(n, rank, comm.size());
  for (std::size_t j = 0; j < rows.count; ++j)
  {
    EXPECT_NEAR(col_lse[j], col_all[sk.offset + j], 4e-6 * (1.0 + std::fabs(col_all[sk.offset + j])));
  }

  // A forward refused after the global checks (a non-finite key on one rank, another batch size) keeps the ready
  // forward's shape: its backward still equals forward_backward's (before, the refused call's counts overflowed
  // the reduce-scatter's buffers).
  rows.reset();
  ASSERT_TRUE(b.forward(rows.problem(), value).ok());
  {
    rank_rows bigger(0, 1); // 4 rows on every rank: 4 W keys against the ready forward's 3 W + 1
    if (rank == 0)
    {
      bigger.k[1] = NAN;
    }
    float v2 = 0.0f;
    const cl::status refused = b.forward(bigger.problem(), v2);
    EXPECT_EQ(refused.code(), cl::errc::non_finite_input) << refused.message();
    EXPECT_EQ(b.global_keys(), rows.n);
  }
  ASSERT_TRUE(b.backward(rows.dq.data(), rows.dk.data(), g).ok());
  EXPECT_EQ(rows.dq, dq_a);
  EXPECT_EQ(rows.dk, dk_a);

  // A bad output on one rank: refused on every rank, naming it, nothing written; the forward stays ready.
  rows.reset();
  ASSERT_TRUE(b.forward(rows.problem(), value).ok());
  cl::status st = b.backward(rank == 1 ? nullptr : rows.dq.data(), rows.dk.data(), g);
  EXPECT_EQ(st.code(), cl::errc::null_pointer) << st.message();
  EXPECT_EQ(st.message().rfind("dq: rank 1: null gradient output", 0), 0u) << st.message();
  EXPECT_TRUE(rows.untouched());
  ASSERT_TRUE(b.backward(rows.dq.data(), rows.dk.data(), g).ok());
  EXPECT_EQ(rows.dq, dq_a);
  // A backward with no forward since the last one: refused on every rank.
  rows.reset();
  st = b.backward(rows.dq.data(), rows.dk.data(), g);
  EXPECT_EQ(st.argument(), "forward") << st.message();
  EXPECT_EQ(st.message().rfind("forward: rank 0: backward needs a successful forward", 0), 0u) << st.message();
  EXPECT_TRUE(rows.untouched());

  if (rank == 0)
  {
    st = b.forward(rows.problem(), value);
  }
  else
  {
    st = b.forward_backward(rows.problem(), rows.dq.data(), rows.dk.data(), rec);
  }
  expect_out_of_step(st, {"rank 0 at step 0 in forward", "rank 1 at step 0 in forward_backward"});
  EXPECT_TRUE(rows.untouched());
}

/// step() is forward_backward then finish_step: ranks may mix the two forms in one step.
template <class Comm>
void mixed_step_forms(Comm comm)
{
  const int rank = comm.rank();
  rank_rows rows(rank, comm.size());
  out_of_step_loss<Comm> dist(comm, cl::temperature::learnable(0.07f), {}, 1);
  cl::step_record rec;
  for (int it = 0; it < 2; ++it)
  {
    if (rank % 2 == 0)
    {
      ASSERT_TRUE(dist.step(rows.problem(), rows.dq.data(), rows.dk.data(), rec, it).ok());
    }
    else
    {
      ASSERT_TRUE(dist.forward_backward(rows.problem(), rows.dq.data(), rows.dk.data(), rec, it).ok());
      std::vector<float> own(3, 1.0f);
      ASSERT_TRUE(dist.unscale_and_check(own.data(), own.size(), rec).ok());
      ASSERT_TRUE(dist.finish_step(rec).ok());
    }
  }
  EXPECT_EQ(dist.steps(), 2);
  // A negative iteration other than no_iteration is refused on every rank, naming the first rank.
  rows.reset();
  const cl::status st = dist.step(rows.problem(), rows.dq.data(), rows.dk.data(), rec, -2);
  EXPECT_EQ(st.code(), cl::errc::invalid_argument) << st.message();
  EXPECT_EQ(st.argument(), "iteration");
  EXPECT_EQ(st.message().rfind("iteration: rank 0: iteration = -2", 0), 0u) << st.message();
  EXPECT_TRUE(rows.untouched());
}
} // namespace

#if defined(CONTRASTIVE_TEST_MPI)
// The same cases over MPI ranks (ranks 2 and 4): every rank ends each case in the same call, so the next case (and
// MPI_Finalize) find them in step.
TEST(Distributed, OutOfStepRanksAreRefusedOnEveryRank)
{
  ASSERT_GE(world_size(), 2);
  rank_skipping_a_step(comm_t{});
  rank_skipping_finish_step(comm_t{});
  rank_finishing_a_stale_record(comm_t{});
  rank_restored_elsewhere(comm_t{});
  rank_with_other_scalars(comm_t{});
  mixed_step_forms(comm_t{});
  forward_then_backward(comm_t{});
}
#else
// Over 2-4 thread ranks in one process (tests/thread_comm.hpp): a rank that hangs or leaves early makes the others'
// collectives fail (the thread_world's watchdog) instead of hanging the test.
TEST(ThreadRanks, OutOfStepRanksAreRefusedOnEveryRank)
{
  for (int ranks = 2; ranks <= 4; ++ranks)
  {
    SCOPED_TRACE("ranks " + std::to_string(ranks));
    ct::run_ranks(ranks,
                  [](ct::thread_comm c)
                  {
                    rank_skipping_a_step(c);
                  });
    ct::run_ranks(ranks,
                  [](ct::thread_comm c)
                  {
                    rank_skipping_finish_step(c);
                  });
    ct::run_ranks(ranks,
                  [](ct::thread_comm c)
                  {
                    rank_finishing_a_stale_record(c);
                  });
    ct::run_ranks(ranks,
                  [](ct::thread_comm c)
                  {
                    rank_restored_elsewhere(c);
                  });
    ct::run_ranks(ranks,
                  [](ct::thread_comm c)
                  {
                    rank_with_other_scalars(c);
                  });
    ct::run_ranks(ranks,
                  [](ct::thread_comm c)
                  {
                    mixed_step_forms(c);
                  });
    ct::run_ranks(ranks,
                  [](ct::thread_comm c)
                  {
                    forward_then_backward(c);
                  });
  }
}

// Without the caller's iteration a rank that skips a whole step is not seen (its next call pairs with the others'
// current one; docs/distributed.md): the others' extra last step then waits for a rank that has gone. Over MPI that
// wait is forever; the thread_world reports it, which is what makes the cases above fail instead of hang.
TEST(ThreadRanks, WithoutAnIterationASkippedWholeStepIsNotSeen)
{
  ct::run_ranks(2,
                [](ct::thread_comm c)
                {
                  rank_rows rows(c.rank(), c.size());
                  out_of_step_loss<ct::thread_comm> dist(c, cl::temperature::learnable(0.07f), {}, 1);
                  cl::step_record rec;
                  for (int it = 0; it < 3; ++it)
                  {
                    if (c.rank() == 1 && it == 1)
                    {
                      continue;
                    }
                    const cl::status st = dist.step(rows.problem(), rows.dq.data(), rows.dk.data(), rec);
                    if (c.rank() == 0 && it == 2)
                    {
                      EXPECT_EQ(st.code(), cl::errc::communication_error) << st.message();
                      EXPECT_NE(st.message().find("rank 1 has returned"), std::string::npos) << st.message();
                    }
                    else
                    {
                      EXPECT_TRUE(st.ok()) << st.message();
                    }
                  }
                });
}

TEST(ThreadRanks, BadInputOnOneRankIsReportedOnAll)
{
  for (int ranks = 2; ranks <= 4; ++ranks)
  {
    SCOPED_TRACE("ranks " + std::to_string(ranks));
    ct::run_ranks(ranks,
                  [](ct::thread_comm c)
                  {
                    bad_input_on_one_rank(c);
                  });
  }
}

TEST(ThreadRanks, MatchOneProcessOnTheConcatenatedBatch)
{
  std::uint32_t seed = 900;
  for (int ranks = 2; ranks <= 4; ++ranks)
  {
    seed += 50;
    ct::run_ranks(ranks,
                  [seed](ct::thread_comm c)
                  {
                    matches_one_process<float, cl::algorithm::fused>(cl::objective::symmetric, false, seed, c);
                    matches_one_process<float, cl::algorithm::materialized>(cl::objective::info_nce, true, seed + 7, c);
                    matches_one_process<float, cl::algorithm::chunked>(cl::objective::symmetric, false, seed + 14, c);
                    matches_one_process<__nv_bfloat16, cl::algorithm::chunked>(
                        cl::objective::info_nce, false, seed + 21, c);
                  });
  }
}

// An allocation that cannot be had: resource_exhausted with the bytes asked for, on every rank, nothing written.
TEST(Distributed, MemoryThatCannotBeHadIsAStatusWithItsBytes)
{
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer aborts on a failed operator new; this test runs in the plain build";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  GTEST_SKIP() << "AddressSanitizer aborts on a failed operator new; this test runs in the plain build";
#endif
#endif
  const std::size_t n = std::size_t(1) << 20, dim = 4;
  const auto q = ct::random_rows<float>(n, dim, 91), k = ct::random_rows<float>(n, dim, 92);
  std::vector<float> dq(n * dim, 7.0f), dk(n * dim, 7.0f);
  cl::distributed::loss<float, cl::temperature::learnable, cl::scaler::static_scale, cl::algorithm::materialized> dist(
      {}, cl::temperature::learnable(0.07f), {}, 1);
  cl::step_record rec;
  const cl::status st = dist.step({q.data(), k.data(), n, n, dim}, dq.data(), dk.data(), rec);
  ASSERT_EQ(st.code(), cl::errc::resource_exhausted) << st.message();
  EXPECT_EQ(st.argument(), "memory");
  // n^2 floats of logits alone: 4 TiB.
  EXPECT_EQ(st.message().rfind("memory: rank 0: the host engine needs ", 0), 0u) << st.message();
  EXPECT_NE(st.message().find(" bytes on this rank (n_q = 1048576, global n_k = 1048576, dim = 4, materialized)"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(st.message().find("memory", 8), std::string::npos) << st.message();
  EXPECT_EQ(dist.steps(), 0);
  for (float v : dq)
  {
    ASSERT_EQ(v, 7.0f);
  }
}
#endif

// save/restore round-trips on every rank: a restored loss continues bit for bit.
TEST(Distributed, SaveRestoreRoundTrips)
{
  const int rank = world_rank(), ranks = world_size();
  const std::size_t n = 5 * static_cast<std::size_t>(ranks) + 1, dim = 20;
  const auto q = ct::random_rows<__nv_bfloat16>(n, dim, 61), k = ct::random_rows<__nv_bfloat16>(n, dim, 62);
  const split s = share(n, rank, ranks);
  const auto qm = rows_of(q, s, dim), km = rows_of(k, s, dim);
  using L = cl::distributed::
      loss<__nv_bfloat16, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::chunked, comm_t>;
  L a(comm_t{}, cl::temperature::learnable(0.05f), scaler_at(128.0f));
  const cl::problem<__nv_bfloat16> p{qm.data(), km.data(), s.count, s.count, dim, nullptr, cl::objective::symmetric};
  std::vector<__nv_bfloat16> dq(s.count * dim), dk(s.count * dim), dq2(s.count * dim), dk2(s.count * dim);
  cl::step_record r, r2;
  for (int i = 0; i < 3; ++i)
  {
    ASSERT_TRUE(a.step(p, dq.data(), dk.data(), r).ok());
  }
  L b(comm_t{}, cl::temperature::learnable(0.5f), scaler_at(2.0f));
  ASSERT_TRUE(b.restore(a.save()).ok());
  const auto sa = a.save(), sb = b.save();
  EXPECT_EQ(std::memcmp(&sa, &sb, sizeof sa), 0);
  ASSERT_TRUE(a.step(p, dq.data(), dk.data(), r).ok());
  ASSERT_TRUE(b.step(p, dq2.data(), dk2.data(), r2).ok());
  EXPECT_EQ(r.loss, r2.loss);
  EXPECT_EQ(r.grad_logit_scale, r2.grad_logit_scale);
  EXPECT_EQ(std::memcmp(dq.data(), dq2.data(), dq.size() * sizeof dq[0]), 0);
  EXPECT_EQ(std::memcmp(dk.data(), dk2.data(), dk.size() * sizeof dk[0]), 0);
  EXPECT_EQ(a.tau(), b.tau());
}

// Per rank, materialized holds its n_local x N block of logits and fused no N x N data at all.
TEST(Distributed, MemoryPerRank)
{
  const int rank = world_rank(), ranks = world_size();
  const std::size_t n = 1024, dim = 16;
  const auto q = ct::random_rows<float>(n, dim, 71), k = ct::random_rows<float>(n, dim, 72);
  const split s = share(n, rank, ranks);
  const auto qm = rows_of(q, s, dim), km = rows_of(k, s, dim);
  const cl::problem<float> p{qm.data(), km.data(), s.count, s.count, dim, nullptr, cl::objective::symmetric};
  std::vector<float> dq(s.count * dim), dk(s.count * dim);
  cl::step_record r;
  cl::distributed::loss<float, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::materialized, comm_t> m(
      comm_t{}, cl::temperature::fixed(0.1f), {}, 1);
  cl::distributed::loss<float, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::fused, comm_t> f(
      comm_t{}, cl::temperature::fixed(0.1f), {}, 1);
  ASSERT_TRUE(m.step(p, dq.data(), dk.data(), r).ok());
  ASSERT_TRUE(f.step(p, dq.data(), dk.data(), r).ok());
  const std::size_t block = s.count * n * sizeof(float);
  EXPECT_GE(m.bytes_held(), block);
  EXPECT_LT(m.bytes_held(), block + 64 * n * dim * sizeof(float) + (std::size_t(4) << 20));
  EXPECT_LT(f.bytes_held(), 64 * n * dim * sizeof(float) + (std::size_t(4) << 20));
  if (rank == 0)
  {
    std::printf("per rank (%d ranks, N = %zu, D = %zu, float): materialized %zu bytes, fused %zu bytes\n",
                ranks,
                n,
                dim,
                m.bytes_held(),
                f.bytes_held());
  }
}

#if defined(CONTRASTIVE_TEST_MPI)
namespace
{
/// On ranks other than 0 only failures are printed, prefixed with the rank.
class failure_printer : public ::testing::EmptyTestEventListener
{
  void OnTestPartResult(const ::testing::TestPartResult& r) override
  {
    if (r.failed())
    {
      std::fprintf(stderr,
                   "rank %d: %s:%d: failure\n%s\n",
                   world_rank(),
                   r.file_name() ? r.file_name() : "?",
                   r.line_number(),
                   r.summary());
    }
  }
};
} // namespace
#endif

int main(int argc, char** argv)
{
#if defined(CONTRASTIVE_TEST_MPI)
  MPI_Init(&argc, &argv);
#endif
  ::testing::InitGoogleTest(&argc, argv);
#if defined(CONTRASTIVE_TEST_MPI)
  if (world_rank() != 0)
  {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new failure_printer);
  }
#endif
  int rc = RUN_ALL_TESTS();
#if defined(CONTRASTIVE_TEST_MPI)
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  rc = any;
  MPI_Finalize();
#endif
  return rc;
}
