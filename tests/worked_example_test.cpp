// A worked example: the InfoNCE loss of one query against four keys (positive at 0) over a sweep of temperatures,
// eight values computed in float64.

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cmath>

namespace
{
struct example_case
{
  float scores[4];
  float tau;
  double want;
};

template <class Algorithm>
float example_loss(const example_case& c)
{
  // One query q = [1] against keys k_j = [score_j] (dim 1), so <q, k_j> is the score itself.
  const float q[1] = {1.0f};
  contrastive::loss<float, contrastive::temperature::fixed, contrastive::scaler::static_scale, Algorithm> l(
      contrastive::temperature::fixed(c.tau));
  const std::int32_t label = 0;
  contrastive::problem<float> p;
  p.q = q;
  p.k = c.scores;
  p.n_q = 1;
  p.n_k = 4;
  p.dim = 1;
  p.labels = &label;
  p.obj = contrastive::objective::info_nce;
  float value = 0.0f;
  const contrastive::status st = l.forward(p, value);
  EXPECT_TRUE(st.ok()) << st.message();
  return value;
}

const example_case cases[] = {
    {{0.2f, 0.3f, 0.25f, 0.25f}, 0.05f, 2.626523375036445},
    {{0.2f, 0.3f, 0.25f, 0.25f}, 0.5f, 1.4887933201471417},
    {{0.2f, 0.3f, 0.25f, 0.25f}, 1.0f, 1.4369192960265726},
    {{0.2f, 0.3f, 0.25f, 0.25f}, 2.0f, 1.4114506070510497},
    {{0.7f, 0.1f, 0.05f, 0.15f}, 0.05f, 2.5105927394272577e-05},
    {{0.7f, 0.1f, 0.05f, 0.15f}, 0.5f, 0.6453200240879728},
    {{0.7f, 0.1f, 0.05f, 0.15f}, 1.0f, 0.9737318345317211},
    {{0.7f, 0.1f, 0.05f, 0.15f}, 2.0f, 1.170287066531068},
};
} // namespace

TEST(WorkedExample, FusedMatchesAllEightValuesToOneMillionth)
{
  for (const example_case& c : cases)
  {
    const double got = example_loss<contrastive::algorithm::fused>(c);
    EXPECT_LE(std::fabs(got - c.want), 1e-6 * c.want) << "tau " << c.tau << " got " << got << " want " << c.want;
  }
}

TEST(WorkedExample, MaterializedFloatMatchesAllEightValuesToOneMillionth)
{
  for (const example_case& c : cases)
  {
    const double got = example_loss<contrastive::algorithm::materialized>(c);
    EXPECT_LE(std::fabs(got - c.want), 1e-6 * c.want) << "tau " << c.tau << " got " << got << " want " << c.want;
  }
}

// What the naive formula does in float for the 2.51e-05 case: lse - S_p keeps only a couple of digits. This is the
// failure the log1p form in finish_row avoids.
TEST(WorkedExample, NaiveLogSumExpMinusPositiveLosesDigits)
{
  const float s = 20.0f;
  const float x[4] = {0.7f * s, 0.1f * s, 0.05f * s, 0.15f * s};
  float m = x[0], sum = 0.0f;
  for (float v : x)
  {
    sum += std::exp(v - m);
  }
  const float naive = (m + std::log(sum)) - x[0];
  const double want = 2.5105927394272577e-05;
  EXPECT_GT(std::fabs(naive - want), 1e-3 * want);
}
