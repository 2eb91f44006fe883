// Bad input gets a clear error naming the argument and changes nothing; non-finite steps are diagnosed and skipped
// exactly as the policies say.

#include "test_util.hpp"

#include <contrastive/core.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>

namespace cl = contrastive;
namespace ct = contrastive_test;

namespace
{
using half_loss = cl::loss<__half, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::materialized>;

struct fixture_data
{
  std::size_t n = 24, dim = 12;
  std::vector<__half> q = ct::random_rows<__half>(24, 12, 77);
  std::vector<__half> k = ct::random_rows<__half>(24, 12, 78);
  std::vector<__half> dq = std::vector<__half>(24 * 12, cl::element_traits<__half>::from_float(7.0f));
  std::vector<__half> dk = std::vector<__half>(24 * 12, cl::element_traits<__half>::from_float(7.0f));

  cl::problem<__half> problem() const
  {
    return {q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  }
};

template <class L>
void expect_unchanged(const L& l, const typename L::checkpoint& before)
{
  const typename L::checkpoint now = l.save();
  EXPECT_EQ(std::memcmp(&now, &before, sizeof(now)), 0) << "policy state changed";
}

bool untouched(const std::vector<__half>& v)
{
  for (__half x : v)
  {
    if (cl::element_traits<__half>::to_float(x) != 7.0f)
    {
      return false;
    }
  }
  return true;
}
} // namespace

TEST(BadInput, EachErrorNamesItsArgumentAndChangesNothing)
{
  fixture_data d;
  half_loss l(cl::temperature::learnable(0.07f), cl::scaler::dynamic::torch());
  const half_loss::checkpoint before = l.save();
  std::vector<std::int32_t> labels(d.n, 0);

  struct bad_case
  {
    const char* what;
    cl::problem<__half> p;
    bool null_dq, null_dk;
    cl::errc code;
    const char* argument;
  };
  std::vector<bad_case> cases;
  auto add = [&](const char* what, auto mutate, cl::errc code, const char* arg, bool ndq = false, bool ndk = false)
  {
    cl::problem<__half> p = d.problem();
    mutate(p);
    cases.push_back({what, p, ndq, ndk, code, arg});
  };
  add(
      "n_q = 0",
      [](auto& p)
      {
        p.n_q = 0;
      },
      cl::errc::empty_input,
      "n_q");
  add(
      "n_k = 0",
      [](auto& p)
      {
        p.n_k = 0;
      },
      cl::errc::empty_input,
      "n_k");
  add(
      "dim = 0",
      [](auto& p)
      {
        p.dim = 0;
      },
      cl::errc::empty_input,
      "dim");
  add(
      "q null",
      [](auto& p)
      {
        p.q = nullptr;
      },
      cl::errc::null_pointer,
      "q");
  add(
      "k null",
      [](auto& p)
      {
        p.k = nullptr;
      },
      cl::errc::null_pointer,
      "k");
  add(
      "dq null", [](auto&) {}, cl::errc::null_pointer, "dq", true, false);
  add(
      "dk null", [](auto&) {}, cl::errc::null_pointer, "dk", false, true);
  add(
      "symmetric n_q != n_k",
      [](auto& p)
      {
        p.n_k = 20;
      },
      cl::errc::shape_mismatch,
      "n_k");
  add(
      "symmetric with labels",
      [&](auto& p)
      {
        p.labels = labels.data();
      },
      cl::errc::invalid_argument,
      "labels");
  add(
      "diagonal needs n_q <= n_k",
      [](auto& p)
      {
        p.obj = cl::objective::info_nce;
        p.n_k = 10;
      },
      cl::errc::shape_mismatch,
      "labels");
  std::vector<std::int32_t> neg(d.n, 1), big(d.n, 1);
  neg[5] = -1;
  big[23] = 24;
  add(
      "label -1",
      [&](auto& p)
      {
        p.obj = cl::objective::info_nce;
        p.labels = neg.data();
      },
      cl::errc::label_out_of_range,
      "labels");
  add(
      "label n_k",
      [&](auto& p)
      {
        p.obj = cl::objective::info_nce;
        p.labels = big.data();
      },
      cl::errc::label_out_of_range,
      "labels");
  std::vector<__half> q_nan = d.q, k_inf = d.k;
  q_nan[2 * d.dim + 3] = cl::element_traits<__half>::from_float(NAN);
  k_inf[7 * d.dim + 11] = cl::element_traits<__half>::from_float(INFINITY);
  add(
      "NaN in q",
      [&](auto& p)
      {
        p.q = q_nan.data();
      },
      cl::errc::non_finite_input,
      "q");
  add(
      "inf in k",
      [&](auto& p)
      {
        p.k = k_inf.data();
      },
      cl::errc::non_finite_input,
      "k");

  for (const bad_case& c : cases)
  {
    SCOPED_TRACE(c.what);
    cl::step_record rec;
    rec.loss = 42.0f;
    const cl::status st = l.step(c.p, c.null_dq ? nullptr : d.dq.data(), c.null_dk ? nullptr : d.dk.data(), rec);
    EXPECT_FALSE(st.ok());
    EXPECT_EQ(st.code(), c.code) << st.message();
    EXPECT_EQ(st.argument(), c.argument) << st.message();
    EXPECT_NE(st.message().find(c.argument), std::string::npos);
    EXPECT_EQ(rec.loss, 42.0f) << "record written on error";
    EXPECT_TRUE(untouched(d.dq)) << "dq written on error";
    EXPECT_TRUE(untouched(d.dk)) << "dk written on error";
    expect_unchanged(l, before);
    EXPECT_EQ(l.steps(), 0);
  }
  // The messages locate the bad element.
  cl::step_record rec;
  cl::problem<__half> p = d.problem();
  p.q = q_nan.data();
  EXPECT_NE(l.step(p, d.dq.data(), d.dk.data(), rec).message().find("q[2][3]"), std::string::npos);
  p = d.problem();
  p.obj = cl::objective::info_nce;
  p.labels = big.data();
  EXPECT_NE(l.step(p, d.dq.data(), d.dk.data(), rec).message().find("labels[23] = 24"), std::string::npos);
}

TEST(BadInput, InvalidPolicySettings)
{
  fixture_data d;
  cl::step_record rec;
  for (float tau : {0.0f, -1.0f, NAN, INFINITY})
  {
    cl::loss<float, cl::temperature::fixed> l{cl::temperature::fixed{tau}};
    std::vector<float> q(d.n * d.dim, 0.1f), dq(d.n * d.dim), dk(d.n * d.dim);
    cl::problem<float> p{q.data(), q.data(), d.n, d.n, d.dim, nullptr, cl::objective::symmetric};
    const cl::status st = l.step(p, dq.data(), dk.data(), rec);
    EXPECT_EQ(st.code(), cl::errc::invalid_temperature) << tau;
    EXPECT_EQ(st.argument(), "temperature");
    EXPECT_EQ(l.steps(), 0);
  }
  {
    cl::loss<__half, cl::temperature::learnable> l(cl::temperature::learnable(-0.5f));
    EXPECT_EQ(l.step(d.problem(), d.dq.data(), d.dk.data(), rec).code(), cl::errc::invalid_temperature);
  }
  {
    cl::loss<__half, cl::temperature::clamped> l(cl::temperature::clamped(0.1f, 0.5f, 0.2f));
    EXPECT_EQ(l.step(d.problem(), d.dq.data(), d.dk.data(), rec).code(), cl::errc::invalid_temperature);
  }
  {
    cl::loss<__half, cl::temperature::fixed, cl::scaler::static_scale> l(cl::temperature::fixed(0.1f),
                                                                         cl::scaler::static_scale(-2.0f));
    const cl::status st = l.step(d.problem(), d.dq.data(), d.dk.data(), rec);
    EXPECT_EQ(st.code(), cl::errc::invalid_scaler);
    EXPECT_EQ(st.argument(), "scaler");
  }
  {
    auto dyn = cl::scaler::dynamic::torch();
    dyn.growth_interval = 0;
    cl::loss<__half, cl::temperature::fixed, cl::scaler::dynamic> l(cl::temperature::fixed(0.1f), dyn);
    EXPECT_EQ(l.step(d.problem(), d.dq.data(), d.dk.data(), rec).code(), cl::errc::invalid_scaler);
  }
  EXPECT_TRUE(untouched(d.dq));
}

// A dynamic scaler state its rule cannot reach (a start at +inf where growth to inf is refused, or outside
// [min_scale, max_scale]) is refused by every call, naming the scaler and the field, and changes nothing.
TEST(BadInput, DynamicScalerOutsideItsReachIsRefused)
{
  fixture_data d;
  cl::step_record rec;
  auto at_inf = cl::scaler::dynamic::torch();
  at_inf.scale = INFINITY;
  auto below_floor = cl::scaler::dynamic::paddle_static(0.5f);
  auto above_cap = cl::scaler::dynamic::torch();
  above_cap.max_scale = 1024.0f;
  for (const cl::scaler::dynamic& s : {at_inf, below_floor, above_cap})
  {
    half_loss l(cl::temperature::learnable(0.1f), s);
    const half_loss::checkpoint before = l.save();
    const cl::status st = l.step(d.problem(), d.dq.data(), d.dk.data(), rec);
    EXPECT_EQ(st.code(), cl::errc::invalid_scaler) << s.scale;
    EXPECT_EQ(st.argument(), "scaler");
    EXPECT_NE(st.message().find(": scale must be"), std::string::npos) << st.message();
    expect_unchanged(l, before);
    EXPECT_EQ(l.steps(), 0);
  }
  EXPECT_TRUE(untouched(d.dq));
  EXPECT_TRUE(untouched(d.dk));
  // 0 is where a torch run without a floor ends: it is accepted and every step is skipped, as in PyTorch.
  auto collapsed = cl::scaler::dynamic::torch();
  collapsed.scale = 0.0f;
  half_loss l(cl::temperature::learnable(0.1f), collapsed);
  ASSERT_TRUE(l.step(d.problem(), d.dq.data(), d.dk.data(), rec).ok());
  EXPECT_TRUE(rec.skipped);
  EXPECT_EQ(l.loss_scale(), 0.0f);
}

// The collapse's end state, for every temperature policy: at loss scale 0 (and +inf, unchecked growth's end) the
// unscaled gradients are 0/0, so every step is non-finite at dQ and skipped, as PyTorch's GradScaler skips every step
// there (its unscale multiplies by 1/0). The temperature does not move and the scale stays where it is.
template <class Temperature>
void expect_dead_scale_skips(Temperature t)
{
  fixture_data d;
  for (const float dead : {0.0f, INFINITY})
  {
    auto s = cl::scaler::dynamic::paddle_dygraph(); // the rule that accepts both 0 and +inf
    s.scale = dead;
    cl::loss<__half, Temperature, cl::scaler::dynamic, cl::algorithm::materialized> l(t, s);
    const auto before = l.save();
    cl::step_record rec;
    ASSERT_TRUE(l.step(d.problem(), d.dq.data(), d.dk.data(), rec).ok()) << Temperature::name;
    EXPECT_TRUE(rec.skipped) << Temperature::name << " at scale " << dead;
    EXPECT_EQ(rec.first_nonfinite, cl::nonfinite_site::grad_q) << Temperature::name << " at scale " << dead;
    EXPECT_EQ(rec.loss_scale, dead);
    EXPECT_EQ(rec.next_loss_scale, dead);
    const auto after = l.save();
    EXPECT_EQ(std::memcmp(&after.temperature, &before.temperature, sizeof(before.temperature)), 0) << Temperature::name;
    EXPECT_EQ(l.tau(), t.tau()) << Temperature::name;
  }
}

TEST(DeadLossScale, EveryTemperaturePolicySkipsTheStep)
{
  expect_dead_scale_skips(cl::temperature::fixed(0.07f));
  expect_dead_scale_skips(cl::temperature::learnable(0.07f));
  expect_dead_scale_skips(cl::temperature::clamped(0.07f, 0.01f, 1.0f));
  expect_dead_scale_skips(cl::temperature::freeze_then_learn(0.07f, 0));    // learnable from the first step
  expect_dead_scale_skips(cl::temperature::freeze_then_learn(0.07f, 1000)); // frozen: no gradient wanted
  expect_dead_scale_skips(cl::temperature::schedule(cl::temperature::schedule_kind::cosine, 0.07f, 0.01f, 100));
  // range_guard's first observe lowers its ceiling to the range bound, skipped step or not: start it there.
  cl::temperature::range_guard guard(0.07f);
  guard.ceiling = guard.range_bound(cl::element_traits<__half>::max_finite());
  expect_dead_scale_skips(guard);
}

TEST(BadInput, StepProtocolMisuse)
{
  fixture_data d;
  half_loss l(cl::temperature::learnable(0.07f), cl::scaler::dynamic::torch());
  cl::step_record rec;
  EXPECT_EQ(l.finish_step(rec).code(), cl::errc::invalid_argument);
  float g = 1.0f;
  EXPECT_EQ(l.unscale_and_check(&g, 1, rec).code(), cl::errc::invalid_argument);
  ASSERT_TRUE(l.forward_backward(d.problem(), d.dq.data(), d.dk.data(), rec).ok());
  EXPECT_EQ(l.unscale_and_check(nullptr, 3, rec).code(), cl::errc::null_pointer);
  ASSERT_TRUE(l.finish_step(rec).ok());
  const half_loss::checkpoint after = l.save();
  EXPECT_EQ(l.finish_step(rec).code(), cl::errc::invalid_argument); // not twice
  expect_unchanged(l, after);
  float out[1];
  EXPECT_EQ(l.backward(d.dq.data(), d.dk.data(), out[0]).code(), cl::errc::invalid_argument);
}

// An output over the labels or group ids (which the backward reads again) is refused naming the output, before
// anything is written: the ids, the other output and the policy state stay as they were.
TEST(BadInput, OutputsOverlappingLabelsOrGroupIdsAreRefused)
{
  fixture_data d;
  half_loss l(cl::temperature::learnable(0.07f), cl::scaler::dynamic::torch());
  const half_loss::checkpoint before = l.save();
  static_assert(alignof(std::int64_t) <= alignof(std::max_align_t));
  // Scratch outputs that hold the ids in their bytes (n * dim halves = 576 bytes: room for n int64 ids).
  std::vector<std::int64_t> dq_storage(d.n * d.dim / 4, 0), dk_storage(d.n * d.dim / 4, 0);
  auto* dq = reinterpret_cast<__half*>(dq_storage.data());
  auto* dk = reinterpret_cast<__half*>(dk_storage.data());
  struct bad_case
  {
    const char* ids;
    const char* output;
  };
  for (const bad_case c : {bad_case{"labels", "dq"},
                           bad_case{"labels", "dk"},
                           bad_case{"query_groups", "dq"},
                           bad_case{"key_groups", "dk"},
                           bad_case{"key_groups", "dq"}})
  {
    SCOPED_TRACE(std::string(c.output) + " over " + c.ids);
    cl::problem<__half> p = d.problem();
    p.obj = cl::objective::info_nce;
    std::vector<std::int64_t>& over = std::string(c.output) == "dq" ? dq_storage : dk_storage;
    std::vector<std::int64_t>& other = &over == &dq_storage ? dk_storage : dq_storage;
    std::fill(over.begin(), over.end(), 0);
    std::fill(other.begin(), other.end(), 7);
    std::vector<std::int64_t> groups(d.n);
    for (std::size_t i = 0; i < d.n; ++i)
    {
      groups[i] = static_cast<std::int64_t>(i % 5); // valid ids: every row has a positive
    }
    if (std::string(c.ids) == "labels")
    {
      auto* labels = reinterpret_cast<std::int32_t*>(over.data());
      for (std::size_t i = 0; i < d.n; ++i)
      {
        labels[i] = static_cast<std::int32_t>((i * 7) % d.n);
      }
      p.labels = labels;
    }
    else
    {
      std::copy(groups.begin(), groups.end(), over.begin());
      p.query_groups = std::string(c.ids) == "query_groups" ? over.data() : groups.data();
      p.key_groups = std::string(c.ids) == "key_groups" ? over.data() : groups.data();
    }
    const std::vector<std::int64_t> over_before = over, other_before = other;
    cl::step_record rec;
    const cl::status st = l.forward_backward(p, dq, dk, rec);
    EXPECT_EQ(st.code(), cl::errc::invalid_argument) << st.message();
    EXPECT_EQ(st.argument(), c.output);
    EXPECT_NE(st.message().find(c.ids), std::string::npos) << st.message();
    EXPECT_EQ(over, over_before);
    EXPECT_EQ(other, other_before);
    expect_unchanged(l, before);
    // The same problem with separate outputs runs.
    std::vector<__half> own_dq(d.n * d.dim), own_dk(d.n * d.dim);
    EXPECT_TRUE(l.forward_backward(p, own_dq.data(), own_dk.data(), rec).ok());
    EXPECT_TRUE(l.finish_step(rec).ok());
    ASSERT_TRUE(l.restore(before).ok());
  }
}

// A forward's statistics outputs (row_lse, col_lse) over an input or each other are refused naming the output, before
// anything is written; the backward would read what they overwrote.
TEST(BadInput, StatisticsOutputsOverlappingInputsAreRefused)
{
  fixture_data d;
  half_loss l(cl::temperature::learnable(0.07f), cl::scaler::dynamic::torch());
  const half_loss::checkpoint before = l.save();
  std::vector<std::int32_t> labels(d.n);
  for (std::size_t i = 0; i < d.n; ++i)
  {
    labels[i] = static_cast<std::int32_t>((i * 5) % d.n);
  }
  cl::problem<__half> p = d.problem();
  p.obj = cl::objective::info_nce;
  p.labels = labels.data();
  const std::vector<std::int32_t> labels_before = labels;
  const std::vector<__half> k_before = d.k;
  std::vector<float> rows(d.n), cols(d.n);
  float value = 0.0f;
  struct bad_case
  {
    float* row;
    float* col;
    const char* output;
    const char* input;
  };
  for (const bad_case c : {bad_case{reinterpret_cast<float*>(labels.data()), nullptr, "row_lse", "labels"},
                           bad_case{reinterpret_cast<float*>(d.k.data()), nullptr, "row_lse", "k"},
                           bad_case{rows.data(), reinterpret_cast<float*>(d.k.data()) + 3, "col_lse", "k"},
                           bad_case{rows.data(), rows.data() + 1, "row_lse", "col_lse"}})
  {
    SCOPED_TRACE(std::string(c.output) + " over " + c.input);
    const cl::status st = l.forward(p, value, c.row, c.col);
    EXPECT_EQ(st.code(), cl::errc::invalid_argument) << st.message();
    EXPECT_EQ(st.argument(), c.output);
    EXPECT_NE(st.message().find(std::string("overlaps ") + c.input), std::string::npos) << st.message();
    EXPECT_EQ(labels, labels_before);
    EXPECT_EQ(std::memcmp(d.k.data(), k_before.data(), k_before.size() * sizeof(__half)), 0);
    expect_unchanged(l, before);
  }
  EXPECT_TRUE(l.forward(p, value, rows.data(), cols.data()).ok());
  // The policy-free core refuses the same.
  cl::core<__half> core(1);
  cl::step::forward_values fv;
  EXPECT_EQ(core.forward(p, 14.0f, fv, reinterpret_cast<float*>(labels.data())).argument(), "row_lse");
  EXPECT_EQ(labels, labels_before);
  EXPECT_TRUE(core.forward(p, 14.0f, fv, rows.data()).ok());
}

// A refused number is printed with its digits: a logit scale of -1e-7 is not "-0.000000", a bias of 1e-7 with an
// objective that has none is not "0.000000 ... pass 0".
TEST(BadInput, RefusedNumbersKeepTheirDigits)
{
  fixture_data d;
  cl::core<__half> core(1);
  cl::core_values out;
  const cl::status scale = core.step(d.problem(), -1e-7f, 1.0f, d.dq.data(), d.dk.data(), out);
  EXPECT_EQ(scale.argument(), "logit_scale");
  EXPECT_NE(scale.message().find("logit_scale = -1"), std::string::npos) << scale.message();
  const cl::status loss_scale = core.step(d.problem(), 14.0f, -1e-30f, d.dq.data(), d.dk.data(), out);
  EXPECT_EQ(loss_scale.argument(), "loss_scale");
  EXPECT_NE(loss_scale.message().find("loss_scale = -1"), std::string::npos) << loss_scale.message();
  const cl::status bias = core.step(d.problem(), 14.0f, 1e-7f, 1.0f, d.dq.data(), d.dk.data(), out);
  EXPECT_EQ(bias.argument(), "logit_bias");
  EXPECT_NE(bias.message().find("logit_bias = 1"), std::string::npos) << bias.message();
  for (const cl::status* st : {&scale, &loss_scale, &bias})
  {
    EXPECT_NE(st->message().find("e-"), std::string::npos) << st->message();
    EXPECT_EQ(st->message().find("0.000000"), std::string::npos) << st->message();
  }
}

// finish_step takes only the loss's own step in progress: a copy of a finished record, a record made up without a
// forward_backward, or one from before a restore is refused and changes nothing; a record whose gradient the caller
// made non-finite skips the step (the temperature's optimizer state stays finite) instead of moving the policies.
TEST(BadInput, FinishStepTakesOnlyTheStepInProgress)
{
  fixture_data d;
  half_loss l(cl::temperature::learnable(0.07f), cl::scaler::dynamic::torch());
  cl::step_record rec;
  ASSERT_TRUE(l.forward_backward(d.problem(), d.dq.data(), d.dk.data(), rec).ok());
  const cl::step_record copy = rec;
  ASSERT_TRUE(l.finish_step(rec).ok());
  const half_loss::checkpoint after_one = l.save();
  cl::step_record stale = copy;
  EXPECT_EQ(l.finish_step(stale).code(), cl::errc::invalid_argument);
  expect_unchanged(l, after_one);
  cl::step_record made_up;
  made_up.pending = true;
  made_up.step = l.steps();
  made_up.loss_scale = 65536.0f;
  EXPECT_EQ(l.finish_step(made_up).code(), cl::errc::invalid_argument);
  expect_unchanged(l, after_one);
  // A second forward_backward replaces the step in progress: the first one's record is refused, the second finishes.
  fixture_data other;
  other.q = ct::random_rows<__half>(24, 12, 79);
  cl::step_record first, second;
  ASSERT_TRUE(l.forward_backward(d.problem(), d.dq.data(), d.dk.data(), first).ok());
  ASSERT_TRUE(l.forward_backward(other.problem(), other.dq.data(), other.dk.data(), second).ok());
  ASSERT_EQ(first.step, second.step);
  EXPECT_EQ(l.finish_step(first).code(), cl::errc::invalid_argument);
  expect_unchanged(l, after_one);
  ASSERT_TRUE(l.finish_step(second).ok());
  ASSERT_TRUE(l.restore(after_one).ok());
  // A restore abandons the step in progress.
  ASSERT_TRUE(l.forward_backward(d.problem(), d.dq.data(), d.dk.data(), rec).ok());
  ASSERT_TRUE(l.restore(after_one).ok());
  EXPECT_EQ(l.finish_step(rec).code(), cl::errc::invalid_argument);
  expect_unchanged(l, after_one);
  // An edited gradient: the step is skipped, the scaler backs off, the temperature stays where it was.
  ASSERT_TRUE(l.forward_backward(d.problem(), d.dq.data(), d.dk.data(), rec).ok());
  const float tau = l.temperature().tau();
  rec.grad_logit_scale = std::numeric_limits<float>::quiet_NaN();
  ASSERT_TRUE(l.finish_step(rec).ok());
  EXPECT_TRUE(rec.skipped);
  EXPECT_EQ(rec.first_nonfinite, cl::nonfinite_site::grad_logit_scale);
  EXPECT_EQ(l.temperature().tau(), tau);
  EXPECT_STREQ(l.temperature().validate(), "");
  ASSERT_TRUE(l.forward_backward(d.problem(), d.dq.data(), d.dk.data(), rec).ok());
  ASSERT_TRUE(l.finish_step(rec).ok());
  EXPECT_FALSE(rec.skipped);
}

// The fp16 collapse's failure (docs/collapse.md) on the materialized FP16 path: a scale large enough to push logits
// past 65504 is reported as a logits overflow; the step is skipped; the temperature and its optimiser do not move; the
// scaler backs off per its rule; the fused path computes the same logits in float and does not overflow there.
TEST(Overflow, Fp16LogitsOverflowIsDiagnosedAndSkipped)
{
  const std::size_t n = 16, dim = 8;
  const auto q = ct::random_rows<__half>(n, dim, 91);
  cl::problem<__half> p{q.data(), q.data(), n, n, dim, nullptr, cl::objective::symmetric}; // <q_i, q_i> = 1
  std::vector<__half> dq(n * dim), dk(n * dim);
  const float tau = 1.0f / 70000.0f; // s = 70000 > 65504
  cl::loss<__half, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::materialized> l(
      cl::temperature::learnable(tau, cl::optimizer::adam(0.1f)), cl::scaler::dynamic::torch());
  const auto before = l.save();
  cl::step_record rec;
  ASSERT_TRUE(l.step(p, dq.data(), dk.data(), rec).ok());
  EXPECT_TRUE(rec.skipped);
  EXPECT_EQ(rec.first_nonfinite, cl::nonfinite_site::logits);
  EXPECT_STREQ(cl::to_string(rec.first_nonfinite), "logits");
  EXPECT_TRUE(std::isinf(rec.max_logit));
  const auto after = l.save();
  EXPECT_EQ(std::memcmp(&after.temperature, &before.temperature, sizeof(before.temperature)), 0);
  EXPECT_EQ(after.scaler.scale, 32768.0f);
  EXPECT_EQ(after.scaler.good, 0);
  EXPECT_EQ(rec.loss_scale, 65536.0f);
  EXPECT_EQ(rec.next_loss_scale, 32768.0f);
  EXPECT_EQ(l.steps(), 1);

  // Just below the threshold the same data does not overflow its logits.
  cl::loss<__half, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::materialized> below(
      cl::temperature::fixed(1.0f / 60000.0f));
  float value = 0.0f;
  ASSERT_TRUE(below.forward(p, value).ok());
  EXPECT_TRUE(std::isfinite(value));

  cl::loss<__half, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::fused> fused(
      cl::temperature::learnable(tau, cl::optimizer::adam(0.1f)), cl::scaler::dynamic::torch());
  ASSERT_TRUE(fused.step(p, dq.data(), dk.data(), rec).ok());
  EXPECT_NE(rec.first_nonfinite, cl::nonfinite_site::logits);
  EXPECT_NEAR(rec.max_logit, 70000.0f, 700.0f);
}

// A loss scale too large for fp16 gradients is diagnosed as grad_q (the first gradient formed), and caller gradients
// with a non-finite value as `parameters`; both skip the temperature update.
TEST(Overflow, GradientOverflowAndParameterDiagnosis)
{
  const std::size_t n = 8, dim = 4;
  const auto q = ct::random_rows<__half>(n, dim, 5);
  const auto k = ct::random_rows<__half>(n, dim, 6);
  cl::problem<__half> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  std::vector<__half> dq(n * dim), dk(n * dim);
  cl::loss<__half, cl::temperature::learnable, cl::scaler::static_scale, cl::algorithm::fused> l(
      cl::temperature::learnable(0.05f), cl::scaler::static_scale(1e9f));
  const auto before = l.save();
  cl::step_record rec;
  ASSERT_TRUE(l.step(p, dq.data(), dk.data(), rec).ok());
  EXPECT_EQ(rec.first_nonfinite, cl::nonfinite_site::grad_q);
  EXPECT_TRUE(rec.skipped);
  EXPECT_EQ(l.temperature().theta, before.temperature.theta);

  cl::loss<__half, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::fused> m(
      cl::temperature::learnable(0.05f), cl::scaler::dynamic::torch());
  auto dyn = cl::scaler::dynamic::torch();
  dyn.scale = 64.0f;
  m = decltype(m)(cl::temperature::learnable(0.05f), dyn);
  ASSERT_TRUE(m.forward_backward(p, dq.data(), dk.data(), rec).ok());
  EXPECT_EQ(rec.first_nonfinite, cl::nonfinite_site::none);
  std::vector<float> wgrad = {64.0f, -128.0f, INFINITY};
  ASSERT_TRUE(m.unscale_and_check(wgrad.data(), wgrad.size(), rec).ok());
  EXPECT_EQ(wgrad[0], 1.0f);
  EXPECT_EQ(wgrad[1], -2.0f);
  EXPECT_EQ(rec.first_nonfinite, cl::nonfinite_site::parameters);
  const float theta = m.temperature().theta;
  ASSERT_TRUE(m.finish_step(rec).ok());
  EXPECT_TRUE(rec.skipped);
  EXPECT_EQ(m.temperature().theta, theta);
  EXPECT_EQ(m.scaler().scale, 32.0f);
}

// Callers who run forward and backward themselves get the same diagnosis a step record gives.
TEST(Overflow, ForwardBackwardHalvesReportTheDiagnosis)
{
  const std::size_t n = 16, dim = 8;
  const auto q = ct::random_rows<__half>(n, dim, 91), k = ct::random_rows<__half>(n, dim, 92);
  std::vector<__half> dq(n * dim), dk(n * dim);
  cl::loss<__half, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::materialized> hot(
      cl::temperature::fixed(1e-5f));
  float value = 0.0f, g = 0.0f;
  ASSERT_TRUE(hot.forward({q.data(), k.data(), n, n, dim}, value).ok());
  ASSERT_TRUE(hot.backward(dq.data(), dk.data(), g).ok());
  EXPECT_TRUE(hot.last_forward().logits_nonfinite);
  EXPECT_EQ(hot.diagnose(), cl::nonfinite_site::logits);

  cl::loss<__half, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::materialized> cool(
      cl::temperature::fixed(0.1f));
  ASSERT_TRUE(cool.forward({q.data(), k.data(), n, n, dim}, value).ok());
  ASSERT_TRUE(cool.backward(dq.data(), dk.data(), g).ok());
  EXPECT_EQ(cool.diagnose(), cl::nonfinite_site::none);
  EXPECT_EQ(cool.last_forward().loss, value);
  EXPECT_GT(cool.last_forward().max_logit, 0.0f);
  EXPECT_LE(cool.last_forward().max_logit, 10.0f + 1e-2f); // |S| <= s for unit vectors
}

// A status carries the code of the library below that failed (CUDA, cuBLAS, NCCL, MPI); the library's own refusals
// carry none, and copies keep it.
TEST(Status, CarriesTheNativeCodeOfTheLibraryThatFailed)
{
  const cl::status own{cl::errc::invalid_argument, "dim", "dim must be positive"};
  EXPECT_EQ(own.native().api, cl::native_api::none);
  EXPECT_EQ(own.native().code, 0);
  EXPECT_EQ(cl::status{}.native().api, cl::native_api::none);
  const cl::status nccl{cl::errc::communication_error,
                        "ncclAllReduce",
                        "ncclAllReduce failed: unhandled system error",
                        {cl::native_api::nccl, 2}};
  const cl::status copy = nccl;
  EXPECT_EQ(copy.native().api, cl::native_api::nccl);
  EXPECT_EQ(copy.native().code, 2);
  EXPECT_EQ(copy.message(), "ncclAllReduce: ncclAllReduce failed: unhandled system error");
  EXPECT_STREQ(cl::to_string(cl::native_api::cuda), "cuda");
  EXPECT_STREQ(cl::to_string(cl::native_api::cublas), "cublas");
  EXPECT_STREQ(cl::to_string(cl::native_api::nccl), "nccl");
  EXPECT_STREQ(cl::to_string(cl::native_api::mpi), "mpi");
  EXPECT_STREQ(cl::to_string(cl::native_api::none), "none");
}
