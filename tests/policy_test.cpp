// Scaler state sequences for every preset, and temperature policy behaviour.

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

namespace cl = contrastive;
namespace ct = contrastive_test;

namespace
{
// Feeds `n` steps of the same outcome.
void feed(cl::scaler::dynamic& d, bool found_inf, int n)
{
  for (int i = 0; i < n; ++i)
  {
    d.update(found_inf);
  }
}
} // namespace

// torch.amp.GradScaler(): 2^16, x0.5 on every inf step, x2 after 2000 finite steps (tracker reset by an inf),
// growth to inf refused (tracker still reset), no floor: 166 consecutive infs from 2^16 reach exactly 0.
TEST(DynamicScaler, TorchPresetSequence)
{
  auto d = cl::scaler::dynamic::torch();
  EXPECT_EQ(d.loss_scale(), 65536.0f);
  d.update(true);
  EXPECT_EQ(d.scale, 32768.0f);
  EXPECT_EQ(d.good, 0);
  feed(d, false, 1999);
  EXPECT_EQ(d.scale, 32768.0f);
  EXPECT_EQ(d.good, 1999);
  d.update(true); // resets the tracker
  EXPECT_EQ(d.scale, 16384.0f);
  EXPECT_EQ(d.good, 0);
  feed(d, false, 2000);
  EXPECT_EQ(d.scale, 32768.0f);
  EXPECT_EQ(d.good, 0);
  // Growth that would reach inf is refused; the tracker is reset anyway.
  d.scale = std::ldexp(1.0f, 127);
  feed(d, false, 2000);
  EXPECT_EQ(d.scale, std::ldexp(1.0f, 127));
  EXPECT_EQ(d.good, 0);
  // No floor: from 2^16, 165 halvings reach 2^-149 (the smallest subnormal), the 166th rounds to 0 and stays there.
  d = cl::scaler::dynamic::torch();
  feed(d, true, 165);
  EXPECT_EQ(d.scale, std::ldexp(1.0f, -149));
  d.update(true);
  EXPECT_EQ(d.scale, 0.0f);
  feed(d, true, 5);
  EXPECT_EQ(d.scale, 0.0f);
  feed(d, false, 2000);
  EXPECT_EQ(d.scale, 0.0f); // 0 * 2 = 0: a run that reaches 0 can never recover
}

// paddle.amp.GradScaler() (dygraph AmpScaler._update): same factors, but growth is unchecked and can reach inf.
TEST(DynamicScaler, PaddleDygraphPresetSequence)
{
  auto d = cl::scaler::dynamic::paddle_dygraph();
  EXPECT_EQ(d.scale, 65536.0f);
  EXPECT_EQ(d.growth_interval, 2000);
  EXPECT_EQ(d.backoff_interval, 1);
  d.update(true);
  EXPECT_EQ(d.scale, 32768.0f);
  feed(d, false, 2000);
  EXPECT_EQ(d.scale, 65536.0f);
  d.scale = std::ldexp(1.0f, 127);
  feed(d, false, 2000);
  EXPECT_TRUE(std::isinf(d.scale));
  EXPECT_EQ(d.good, 0);
  // The seed's "decr_every_n_nan_or_inf": with 2, a single inf step leaves the scale alone.
  auto e = cl::scaler::dynamic::paddle_dygraph(1024.0f, 2.0f, 0.5f, 1000, 2);
  e.update(true);
  EXPECT_EQ(e.scale, 1024.0f);
  EXPECT_EQ(e.bad, 1);
  e.update(false); // a finite step resets the bad counter
  EXPECT_EQ(e.bad, 0);
  EXPECT_EQ(e.good, 1);
  e.update(true);
  e.update(true);
  EXPECT_EQ(e.scale, 512.0f);
  EXPECT_EQ(e.bad, 0);
  EXPECT_EQ(e.good, 0);
}

// fluid decorate() + update_loss_scaling op: 2^15, x0.8 (a float attribute) after 2 consecutive infs, floored at 1,
// x2 after 1000 finite steps, growth to inf refused.
TEST(DynamicScaler, PaddleStaticPresetSequence)
{
  auto d = cl::scaler::dynamic::paddle_static();
  EXPECT_EQ(d.scale, 32768.0f);
  d.update(true);
  EXPECT_EQ(d.scale, 32768.0f);
  EXPECT_EQ(d.bad, 1);
  d.update(true);
  // 2^15 * float(0.8) = 2^15 * 13421773 / 2^24 = 26214.400390625 exactly.
  EXPECT_EQ(d.scale, 26214.400390625f);
  EXPECT_EQ(d.bad, 0);
  feed(d, false, 999);
  EXPECT_EQ(d.scale, 26214.400390625f);
  d.update(false);
  EXPECT_EQ(d.scale, 52428.80078125f);
  EXPECT_EQ(d.good, 0);
  d.scale = 1.1f;
  feed(d, true, 2);
  EXPECT_EQ(d.scale, 1.0f); // 0.88 floored at 1
  feed(d, true, 40);
  EXPECT_EQ(d.scale, 1.0f);
  d.scale = std::ldexp(1.0f, 127);
  feed(d, false, 1000);
  EXPECT_EQ(d.scale, std::ldexp(1.0f, 127));
}

TEST(DynamicScaler, CustomFloorCapAndValidation)
{
  cl::scaler::dynamic d;
  d.min_scale = 4.0f;
  d.max_scale = 128.0f;
  d.scale = 64.0f;
  d.growth_interval = 3;
  feed(d, false, 3);
  EXPECT_EQ(d.scale, 128.0f);
  feed(d, false, 3);
  EXPECT_EQ(d.scale, 128.0f);
  feed(d, true, 10);
  EXPECT_EQ(d.scale, 4.0f);
  EXPECT_STREQ(d.validate(), "");
  d.backoff_factor = 1.5;
  EXPECT_STRNE(d.validate(), "");
  cl::scaler::static_scale s(0.0f);
  EXPECT_STRNE(s.validate(), "");
  s.update(true);
  EXPECT_EQ(s.scale, 0.0f);
}

TEST(Temperature, FixedNeverMoves)
{
  cl::temperature::fixed f(0.07f);
  const float before = f.tau();
  for (float g : {1e3f, -1e3f, 0.5f})
  {
    f.advance(g);
  }
  EXPECT_EQ(f.tau(), before);
  EXPECT_FALSE(f.wants_gradient());
  EXPECT_EQ(f.scale(), static_cast<float>(1.0 / double(0.07f)));
}

TEST(Temperature, LearnableSgdAndAdamUpdates)
{
  cl::temperature::learnable sgd(0.1f, cl::optimizer::sgd(0.5f));
  const float t0 = sgd.theta;
  sgd.advance(0.25f);
  EXPECT_FLOAT_EQ(sgd.theta, t0 - 0.125f);
  EXPECT_EQ(sgd.steps, 1);
  // Adam's first step moves by lr * g / (|g| + eps) = lr in the gradient's direction.
  cl::temperature::learnable adam(0.1f, cl::optimizer::adam(0.01f));
  const float a0 = adam.theta;
  adam.advance(-3.0f);
  EXPECT_NEAR(adam.theta, a0 + 0.01f, 1e-6f);
  EXPECT_EQ(adam.opt_state.t, 1);
  // Defaults are CLIP's: tau 0.07.
  EXPECT_NEAR(cl::temperature::learnable{}.tau(), 0.07f, 1e-7f);
}

TEST(Temperature, ClampHoldsBothBounds)
{
  cl::temperature::clamped c(0.07f, 0.01f, 1.0f, cl::optimizer::sgd(10.0f));
  EXPECT_FLOAT_EQ(c.max_theta, std::log(100.0f));
  EXPECT_FLOAT_EQ(c.min_theta, 0.0f);
  for (int i = 0; i < 5; ++i)
  {
    c.advance(-100.0f); // pushes theta up: tau down
    EXPECT_LE(c.theta, c.max_theta);
  }
  EXPECT_EQ(c.theta, c.max_theta);
  EXPECT_NEAR(c.tau(), 0.01f, 1e-7f);
  c.advance(1e4f);
  EXPECT_EQ(c.theta, c.min_theta);
  EXPECT_NEAR(c.tau(), 1.0f, 1e-7f);
  // An initial tau outside the bounds is clamped at construction.
  cl::temperature::clamped d(0.001f, 0.01f, 1.0f);
  EXPECT_EQ(d.theta, d.max_theta);
  cl::temperature::clamped bad(0.1f, 0.5f, 0.2f);
  EXPECT_STRNE(bad.validate(), "");
}

TEST(Temperature, FreezeThenLearnUnfreezesAtItsStep)
{
  cl::temperature::freeze_then_learn s(0.05f, 3, cl::optimizer::sgd(0.1f));
  static_assert(cl::temperature::freeze_then_learn::is_learnable);
  for (int i = 0; i < 3; ++i)
  {
    EXPECT_FALSE(s.wants_gradient());
    s.advance(-5.0f); // ignored while frozen
    EXPECT_FLOAT_EQ(s.tau(), 0.05f);
  }
  EXPECT_EQ(s.steps, 3);
  EXPECT_EQ(s.opt_state.t, 0) << "no optimiser step while frozen";
  EXPECT_TRUE(s.wants_gradient());
  const float theta = s.theta;
  s.advance(-5.0f);
  EXPECT_FLOAT_EQ(s.theta, theta + 0.5f);
  // Optional clamp after unfreezing.
  cl::temperature::freeze_then_learn c(0.05f, 0, cl::optimizer::sgd(10.0f), 0.02f, 1.0f);
  c.advance(-100.0f);
  EXPECT_NEAR(c.tau(), 0.02f, 1e-7f);
  cl::temperature::freeze_then_learn bad(0.05f, -1);
  EXPECT_STRNE(bad.validate(), "");
}

// `scheduled` is the former name of freeze_then_learn: same state, same steps.
TEST(Temperature, ScheduledIsFreezeThenLearn)
{
  auto old = cl::temperature::scheduled::freeze_then_learn(0.05f, 2, cl::optimizer::adam(0.1f), 0.01f, 1.0f);
  cl::temperature::freeze_then_learn now(0.05f, 2, cl::optimizer::adam(0.1f), 0.01f, 1.0f);
  static_assert(std::is_base_of_v<cl::temperature::freeze_then_learn, cl::temperature::scheduled>);
  for (int i = 0; i < 6; ++i)
  {
    old.advance(-1.0f);
    now.advance(-1.0f);
    EXPECT_EQ(old.theta, now.theta) << i;
  }
  EXPECT_EQ(cl::temperature::scheduled{}.unfreeze_step, cl::temperature::freeze_then_learn{}.unfreeze_step);
}

TEST(Temperature, ScheduleIsDeterministicWithNoOptimiser)
{
  static_assert(!cl::temperature::schedule::is_learnable);
  static_assert(!cl::temperature::has_optimizer_v<cl::temperature::schedule>);
  static_assert(cl::temperature::has_optimizer_v<cl::temperature::learnable>);
  static_assert(cl::temperature::is_temperature_policy_v<cl::temperature::schedule>);
  cl::temperature::schedule lin(cl::temperature::schedule_kind::linear, 0.1f, 0.02f, 10);
  cl::temperature::schedule cosine(cl::temperature::schedule_kind::cosine, 0.1f, 0.02f, 10);
  EXPECT_FLOAT_EQ(lin.tau(), 0.1f);
  EXPECT_FLOAT_EQ(cosine.tau(), 0.1f);
  for (int i = 0; i < 5; ++i)
  {
    lin.advance(123.0f); // gradients are ignored
    cosine.advance(123.0f);
  }
  EXPECT_NEAR(lin.tau(), 0.06f, 1e-6f);
  EXPECT_NEAR(cosine.tau(), 0.06f, 1e-6f); // half way, cos(pi/2) = 0
  lin.advance(0.0f);
  cosine.advance(0.0f);
  EXPECT_NEAR(lin.tau(), 0.1f - 0.08f * 0.6f, 1e-6f);
  EXPECT_NEAR(cosine.tau(), 0.1f - 0.08f * 0.5f * (1.0f - std::cos(3.14159265f * 0.6f)), 1e-6f);
  for (int i = 0; i < 20; ++i)
  {
    lin.advance(0.0f);
  }
  EXPECT_NEAR(lin.tau(), 0.02f, 1e-7f);
  EXPECT_FALSE(lin.wants_gradient());
  EXPECT_STREQ(lin.validate(), "");
  cl::temperature::schedule bad = lin;
  bad.kind = static_cast<cl::temperature::schedule_kind>(0);
  EXPECT_STRNE(bad.validate(), "");
  // Duration 0: tau_end from the first step on (tau_at(0)), not one step at tau_start.
  for (auto kind : {cl::temperature::schedule_kind::linear, cl::temperature::schedule_kind::cosine})
  {
    cl::temperature::schedule now(kind, 1.0f, 0.01f, 0);
    EXPECT_FLOAT_EQ(now.tau(), now.tau_at(0));
    EXPECT_FLOAT_EQ(now.tau(), 0.01f);
    now.advance(0.0f);
    EXPECT_FLOAT_EQ(now.tau(), 0.01f);
  }
}

TEST(Temperature, RangeGuardCeilingOnlyComesDown)
{
  cl::temperature::range_guard g(0.07f, cl::optimizer::sgd(10.0f));
  EXPECT_EQ(g.ceiling, __builtin_huge_valf());
  EXPECT_FLOAT_EQ(g.min_theta, 0.0f); // tau_max = 1
  cl::step_record ok;
  ok.loss_scale = ok.next_loss_scale = 1.0f;
  g.observe(ok, 65504.0f);
  EXPECT_FLOAT_EQ(g.ceiling, std::log(65504.0f / 16.0f));
  g.advance(-100.0f); // pushes theta far up: stops at the ceiling
  EXPECT_EQ(g.theta, g.ceiling);
  cl::step_record overflow = ok;
  overflow.skipped = true;
  overflow.first_nonfinite = cl::nonfinite_site::logits;
  const float before = g.ceiling;
  g.observe(overflow, 65504.0f);
  EXPECT_FLOAT_EQ(g.ceiling, before - 0.5f);
  EXPECT_EQ(g.theta, g.ceiling);
  EXPECT_EQ(g.events, 1);
  g.observe(ok, 65504.0f); // the range bound is higher now: the ceiling stays down
  EXPECT_FLOAT_EQ(g.ceiling, before - 0.5f);
  g.advance(1e4f); // and theta never goes below log(1/tau_max)
  EXPECT_EQ(g.theta, g.min_theta);
  cl::temperature::range_guard bad = g;
  bad.ceiling = -1.0f;
  EXPECT_STRNE(bad.validate(), "");
}

TEST(Temperature, LossSetsTheTemperatureOptimiser)
{
  cl::loss<float, cl::temperature::clamped, cl::scaler::static_scale> l(
      cl::temperature::clamped(0.07f, 0.01f, 1.0f, cl::optimizer::adam(1e-3f)));
  EXPECT_TRUE(l.set_temperature_optimizer(cl::optimizer::adam(0.5f, 0.9f, 0.98f)).ok());
  EXPECT_EQ(l.temperature().opt.lr, 0.5f);
  EXPECT_EQ(l.temperature().opt.beta2, 0.98f);
  const cl::status bad = l.set_temperature_optimizer(cl::optimizer::adam(-1.0f));
  EXPECT_EQ(bad.code(), cl::errc::invalid_temperature);
  EXPECT_EQ(l.temperature().opt.lr, 0.5f) << "a refused setting changes nothing";
  // A finite learning rate at the bound is refused too, and the message states the bound it broke.
  const cl::status huge = l.set_temperature_optimizer(cl::optimizer::sgd(1e30f));
  EXPECT_EQ(huge.code(), cl::errc::invalid_temperature);
  EXPECT_EQ(huge.argument(), "optimizer");
  EXPECT_NE(huge.message().find("lr < 1e30"), std::string::npos) << huge.message();
  cl::temperature::learnable restored(0.07f, cl::optimizer::adam(1e-3f, 0.9f, 0.999f, 1e30f));
  EXPECT_NE(std::string(restored.validate()).find("eps < 1e30"), std::string::npos) << restored.validate();
  cl::loss<float, cl::temperature::fixed, cl::scaler::static_scale> f(cl::temperature::fixed(0.07f));
  EXPECT_EQ(f.set_temperature_optimizer(cl::optimizer::adam(0.5f)).code(), cl::errc::invalid_argument);
}

// Save, run, restore, run again: bit-identical records, policies and step counters.
TEST(Checkpoint, SaveRestoreRoundTripsBitExactly)
{
  const std::size_t n = 40, dim = 16;
  const auto q = ct::random_rows<__half>(n, dim, 31);
  const auto k = ct::random_rows<__half>(n, dim, 32);
  cl::problem<__half> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  using loss_t = cl::loss<__half, cl::temperature::clamped, cl::scaler::dynamic>;
  auto dyn = cl::scaler::dynamic::torch();
  dyn.growth_interval = 2; // so the scaler's state moves within a few steps
  dyn.scale = 256.0f;
  loss_t l(cl::temperature::clamped(0.1f, 0.01f, 1.0f, cl::optimizer::adam(0.05f)), dyn);
  std::vector<__half> dq(n * dim), dk(n * dim);
  cl::step_record r;
  for (int i = 0; i < 3; ++i)
  {
    ASSERT_TRUE(l.step(p, dq.data(), dk.data(), r).ok());
  }
  const loss_t::checkpoint saved = l.save();
  std::vector<cl::step_record> first;
  for (int i = 0; i < 4; ++i)
  {
    ASSERT_TRUE(l.step(p, dq.data(), dk.data(), r).ok());
    first.push_back(r);
  }
  const loss_t::checkpoint after = l.save();
  ASSERT_TRUE(l.restore(saved).ok());
  EXPECT_EQ(l.steps(), 3);
  for (int i = 0; i < 4; ++i)
  {
    ASSERT_TRUE(l.step(p, dq.data(), dk.data(), r).ok());
    EXPECT_EQ(r.step, first[i].step);
    EXPECT_EQ(r.loss, first[i].loss);
    EXPECT_EQ(r.tau, first[i].tau);
    EXPECT_EQ(r.loss_scale, first[i].loss_scale);
  }
  const loss_t::checkpoint again = l.save();
  EXPECT_EQ(std::memcmp(&again, &after, sizeof(after)), 0);
  EXPECT_GT(again.scaler.scale, 256.0f); // the scaler state did move, so the comparison means something
  // An invalid checkpoint is refused and changes nothing.
  loss_t::checkpoint broken = saved;
  broken.scaler.backoff_interval = 0;
  const cl::status st = l.restore(broken);
  EXPECT_EQ(st.code(), cl::errc::invalid_scaler);
  EXPECT_EQ(st.argument(), "checkpoint.scaler");
  const loss_t::checkpoint unchanged = l.save();
  EXPECT_EQ(std::memcmp(&unchanged, &after, sizeof(after)), 0);
}

// ---- Issue 18: counters at their maximum, save() padding, trajectories that leave the domain ----

namespace
{
constexpr std::int64_t int64_max = std::numeric_limits<std::int64_t>::max();
constexpr std::int32_t int32_max = std::numeric_limits<std::int32_t>::max();

/// The smallest and the largest float tau that `valid_tau` accepts (the domain's edges as the code computes them).
float smallest_valid_tau()
{
  float t = std::exp(-cl::temperature::theta_limit) * 0.99f;
  while (!cl::temperature::valid_tau(t))
  {
    t = std::nextafter(t, 1.0f);
  }
  return t;
}
float largest_valid_tau()
{
  float t = std::exp(cl::temperature::theta_limit) * 1.01f;
  while (!cl::temperature::valid_tau(t))
  {
    t = std::nextafter(t, 1.0f);
  }
  return t;
}

/// Drives a policy with gradients that push theta hard both ways and, for range_guard, overflow events; it must stay
/// in its domain at every step.
template <class P>
void expect_trajectory_stays_inside(P p, const char* what)
{
  ASSERT_STREQ(p.validate(), "") << what;
  const float grads[] = {-1e30f, 1e30f, -3.0e38f, 3.0e38f, 0.0f, -1.0f, 1.0f};
  for (int i = 0; i < 400; ++i)
  {
    p.advance(grads[i % 7] * (i % 3 == 0 ? -1.0f : 1.0f));
    if constexpr (cl::temperature::has_observe_v<P>)
    {
      cl::step_record rec;
      rec.loss_scale = 1.0f;
      rec.next_loss_scale = i % 2 == 0 ? 0.5f : 1.0f;
      rec.skipped = i % 2 == 0;
      rec.first_nonfinite = i % 2 == 0 ? cl::nonfinite_site::logits : cl::nonfinite_site::none;
      p.observe(rec, i % 4 == 0 ? 65504.0f : 3.4e38f);
    }
    ASSERT_STREQ(p.validate(), "") << what << " after step " << i;
    ASSERT_TRUE(std::isfinite(p.tau()) && p.tau() > 0.0f) << what << " after step " << i;
    ASSERT_TRUE(std::isfinite(p.scale()) && p.scale() > 0.0f) << what << " after step " << i;
  }
}
} // namespace

// A restored counter at its maximum saturates instead of overflowing (UBSan: signed overflow) on the next step.
TEST(Checkpoint, CountersAtTheirMaximumSaturate)
{
  cl::temperature::learnable l(0.07f, cl::optimizer::adam(1e-3f));
  l.steps = int64_max;
  l.opt_state.t = int64_max;
  ASSERT_STREQ(l.validate(), "");
  l.advance(0.5f);
  EXPECT_EQ(l.steps, int64_max);
  EXPECT_EQ(l.opt_state.t, int64_max);
  EXPECT_STREQ(l.validate(), "");

  cl::temperature::learnable s(0.07f, cl::optimizer::sgd(1e-3f, 0.5f));
  s.opt_state.t = int64_max;
  s.advance(0.5f);
  EXPECT_EQ(s.opt_state.t, int64_max);

  cl::temperature::freeze_then_learn f(0.07f, int64_max, cl::optimizer::sgd(1e-3f));
  f.steps = int64_max - 1;
  f.advance(0.5f); // the last frozen step
  EXPECT_EQ(f.steps, int64_max);
  EXPECT_TRUE(f.wants_gradient());
  f.advance(0.5f);
  EXPECT_EQ(f.steps, int64_max);

  cl::temperature::schedule sch(cl::temperature::schedule_kind::linear, 0.1f, 0.02f, 10);
  sch.steps = int64_max;
  sch.advance(0.0f);
  EXPECT_EQ(sch.steps, int64_max);
  EXPECT_EQ(sch.theta, cl::temperature::logit_scale_of(0.02f));

  cl::temperature::range_guard g(0.07f);
  g.events = int32_max;
  cl::step_record overflow;
  overflow.loss_scale = overflow.next_loss_scale = 1.0f;
  overflow.skipped = true;
  overflow.first_nonfinite = cl::nonfinite_site::logits;
  g.observe(overflow, 65504.0f);
  EXPECT_EQ(g.events, int32_max);
  EXPECT_STREQ(g.validate(), "");
}

// The same through a loss: restore a checkpoint whose counters are at their maximum, then step. The loss's own step
// count is refused above the largest a run can reach (it is incremented on every step).
TEST(Checkpoint, RestoredCountersAtTheirMaximumKeepStepping)
{
  const std::size_t n = 12, dim = 8;
  const auto q = ct::random_rows<float>(n, dim, 61);
  const auto k = ct::random_rows<float>(n, dim, 62);
  const cl::problem<float> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  std::vector<float> dq(n * dim), dk(n * dim);
  cl::step_record rec;
  {
    using L = cl::loss<float, cl::temperature::learnable, cl::scaler::dynamic>;
    L l(cl::temperature::learnable(0.07f), cl::scaler::dynamic::torch());
    L::checkpoint c = l.save();
    c.temperature.steps = int64_max;
    c.temperature.opt_state.t = int64_max;
    c.step = cl::detail::max_checkpoint_step;
    ASSERT_TRUE(l.restore(c).ok());
    ASSERT_TRUE(l.step(p, dq.data(), dk.data(), rec).ok());
    EXPECT_FALSE(rec.skipped);
    EXPECT_EQ(l.temperature().steps, int64_max);
    EXPECT_EQ(l.temperature().opt_state.t, int64_max);
    EXPECT_EQ(l.steps(), cl::detail::max_checkpoint_step + 1);
    const L::checkpoint before = l.save();
    for (std::int64_t step : {cl::detail::max_checkpoint_step + 1, int64_max})
    {
      c.step = step;
      const cl::status st = l.restore(c);
      EXPECT_EQ(st.code(), cl::errc::invalid_argument) << step;
      EXPECT_EQ(st.argument(), "checkpoint.step");
      const L::checkpoint after = l.save();
      EXPECT_EQ(std::memcmp(&before, &after, sizeof before), 0) << "a refused restore changed the state";
    }
  }
  {
    using L = cl::loss<float, cl::temperature::schedule, cl::scaler::static_scale>;
    L l(cl::temperature::schedule(cl::temperature::schedule_kind::cosine, 0.1f, 0.05f, 3));
    L::checkpoint c = l.save();
    c.temperature.steps = int64_max;
    ASSERT_TRUE(l.restore(c).ok());
    ASSERT_TRUE(l.step(p, dq.data(), dk.data(), rec).ok());
    EXPECT_EQ(l.temperature().steps, int64_max);
    EXPECT_EQ(l.tau(), static_cast<float>(std::exp(-static_cast<double>(cl::temperature::logit_scale_of(0.05f)))));
  }
}

namespace
{
/// A value of P built in memory filled with `garbage` (so any byte its constructor does not write holds `garbage`).
template <class P, class Make>
P* build_in(unsigned char* buffer, unsigned char garbage, Make&& make)
{
  std::memset(buffer, garbage, sizeof(P));
  return new (buffer) P(make());
}

/// Two losses of the same state, each built (policies and loss) in differently garbaged memory, save equal bytes;
/// so do two saves of one, before and after steps, and save() after restore().
template <class T, class Make, class MakeScaler>
void expect_save_is_byte_deterministic(Make make_t, MakeScaler make_s, const char* what)
{
  using L = cl::loss<float, T, typename std::invoke_result_t<MakeScaler>>;
  using S = typename L::scaler_type;
  alignas(T) unsigned char tb[2][sizeof(T)];
  alignas(S) unsigned char sb[2][sizeof(S)];
  alignas(L) unsigned char lb[2][sizeof(L)];
  const unsigned char garbage[2] = {0xAB, 0x5C};
  L* l[2];
  for (int i = 0; i < 2; ++i)
  {
    const T* t = build_in<T>(tb[i], garbage[i], make_t);
    const S* s = build_in<S>(sb[i], garbage[i], make_s);
    std::memset(lb[i], garbage[i], sizeof(L));
    l[i] = new (lb[i]) L(*t, *s, 1);
  }
  const std::size_t n = 10, dim = 8;
  const auto q = ct::random_rows<float>(n, dim, 71);
  const auto k = ct::random_rows<float>(n, dim, 72);
  const cl::problem<float> p{q.data(), k.data(), n, n, dim, nullptr, cl::objective::symmetric};
  std::vector<float> dq(n * dim), dk(n * dim);
  for (int steps = 0; steps < 3; ++steps)
  {
    const typename L::checkpoint a = l[0]->save(), b = l[1]->save(), a2 = l[0]->save();
    EXPECT_EQ(std::memcmp(&a, &a2, sizeof a), 0) << what << ": two saves of one loss differ";
    EXPECT_EQ(std::memcmp(&a, &b, sizeof a), 0) << what << ": saves of one state differ (step " << steps << ")";
    ASSERT_TRUE(l[1]->restore(a).ok());
    const typename L::checkpoint r = l[1]->save();
    EXPECT_EQ(std::memcmp(&a, &r, sizeof a), 0) << what << ": save() after restore() differs";
    cl::step_record rec;
    for (L* x : l)
    {
      ASSERT_TRUE(x->step(p, dq.data(), dk.data(), rec).ok()) << what;
    }
  }
  for (L* x : l)
  {
    x->~L();
  }
}
} // namespace

TEST(Checkpoint, SaveIsByteDeterministicWhateverTheMemoryHeld)
{
  namespace tp = cl::temperature;
  auto torch = []
  {
    return cl::scaler::dynamic::torch();
  };
  auto dygraph = []
  {
    return cl::scaler::dynamic::paddle_dygraph(1024.0f);
  };
  auto paddle_static = []
  {
    return cl::scaler::dynamic::paddle_static();
  };
  auto one = []
  {
    return cl::scaler::static_scale(2.0f);
  };
  auto fixed = []
  {
    return tp::fixed(0.1f);
  };
  auto learnable = []
  {
    return tp::learnable(0.1f, cl::optimizer::adam(0.01f));
  };
  auto clamped = []
  {
    return tp::clamped(0.1f, 0.01f, 1.0f, cl::optimizer::sgd(0.1f, 0.9f));
  };
  auto freeze = []
  {
    return tp::freeze_then_learn(0.1f, 1, cl::optimizer::adam(0.01f), 0.02f, 1.0f);
  };
  auto scheduled = []
  {
    return tp::scheduled::freeze_then_learn(0.1f, 1);
  };
  auto schedule = []
  {
    return tp::schedule(tp::schedule_kind::linear, 0.1f, 0.05f, 4);
  };
  auto guard = []
  {
    return tp::range_guard(0.1f);
  };
  expect_save_is_byte_deterministic<tp::fixed>(fixed, torch, "fixed + dynamic");
  expect_save_is_byte_deterministic<tp::fixed>(fixed, one, "fixed + static");
  expect_save_is_byte_deterministic<tp::learnable>(learnable, torch, "learnable + dynamic");
  expect_save_is_byte_deterministic<tp::learnable>(learnable, dygraph, "learnable + paddle_dygraph");
  expect_save_is_byte_deterministic<tp::clamped>(clamped, one, "clamped + static");
  expect_save_is_byte_deterministic<tp::clamped>(clamped, paddle_static, "clamped + paddle_static");
  expect_save_is_byte_deterministic<tp::freeze_then_learn>(freeze, torch, "freeze_then_learn + dynamic");
  expect_save_is_byte_deterministic<tp::scheduled>(scheduled, one, "scheduled + static");
  expect_save_is_byte_deterministic<tp::schedule>(schedule, one, "schedule + static");
  expect_save_is_byte_deterministic<tp::schedule>(schedule, torch, "schedule + dynamic");
  expect_save_is_byte_deterministic<tp::range_guard>(guard, torch, "range_guard + dynamic");
  expect_save_is_byte_deterministic<tp::range_guard>(guard, one, "range_guard + static");
}

// A policy whose settings let a finite step move tau out of the domain is refused when it is built (every call
// validates it) or restored, instead of being accepted and then refusing every later call.
TEST(Temperature, BoundsOutsideTheDomainAreRefused)
{
  namespace tp = cl::temperature;
  const float inf = std::numeric_limits<float>::infinity();
  const auto sgd = cl::optimizer::sgd(1.0f);
  struct bounds
  {
    float tau, tau_min, tau_max;
  };
  for (const bounds b : {bounds{0.07f, inf, inf},
                         bounds{0.07f, 0.0f, 0.0f},
                         bounds{0.07f, 1e-38f, 1e-38f},
                         bounds{0.07f, 1e36f, 1e37f},
                         bounds{0.07f, 1e-37f, 1e-36f},
                         bounds{0.07f, 0.01f, 1e36f},
                         bounds{0.07f, 1e-37f, 1.0f},
                         bounds{0.07f, 0.0f, 1e36f},
                         bounds{0.07f, 1e-37f, inf}})
  {
    const tp::freeze_then_learn f(b.tau, 0, sgd, b.tau_min, b.tau_max);
    EXPECT_STRNE(f.validate(), "") << "freeze_then_learn [" << b.tau_min << ", " << b.tau_max << "]";
    if (b.tau_min != inf && b.tau_max != 0.0f)
    {
      const tp::clamped c(b.tau, b.tau_min, b.tau_max, sgd);
      EXPECT_STRNE(c.validate(), "") << "clamped [" << b.tau_min << ", " << b.tau_max << "]";
    }
  }
  // restore() of clamped bounds outside the domain (theta in [85, 85]) is refused, naming the checkpoint.
  using L = cl::loss<float, tp::clamped, cl::scaler::static_scale>;
  L l(tp::clamped(0.07f, 0.01f, 1.0f));
  L::checkpoint c = l.save();
  c.temperature.min_theta = c.temperature.max_theta = tp::theta_limit + 5.0f;
  c.temperature.theta = tp::theta_limit;
  const cl::status st = l.restore(c);
  EXPECT_EQ(st.code(), cl::errc::invalid_temperature);
  EXPECT_EQ(st.argument(), "checkpoint.temperature");
  // A clamped theta outside its own bounds (tau = 1.9e-22 for [0.01, 1]) is refused too: clamped never reaches it.
  c = l.save();
  c.temperature.theta = 50.0f;
  EXPECT_EQ(l.restore(c).argument(), "checkpoint.temperature");
  EXPECT_NEAR(l.temperature().tau(), 0.07f, 1e-6f);
  tp::clamped hand_set(0.07f, 0.01f, 1.0f);
  hand_set.theta = -5.0f; // tau = 148
  EXPECT_STRNE(hand_set.validate(), "");
  // freeze_then_learn's frozen start may lie outside its bounds (it is not clamped): accepted.
  EXPECT_STREQ(tp::freeze_then_learn(0.001f, 10, sgd, 0.01f, 1.0f).validate(), "");
  // range_guard: a tau_max outside the domain (its ceiling could retreat below -80) is refused; inf is no bound.
  EXPECT_STRNE(tp::range_guard(0.07f, sgd, 16.0f, 0.5f, 1.0f, 1e36f).validate(), "");
  EXPECT_STRNE(tp::range_guard(0.07f, sgd, 16.0f, 0.5f, 1.0f, 0.0f).validate(), "");
  EXPECT_STREQ(tp::range_guard(0.07f, sgd, 16.0f, 0.5f, 1.0f, inf).validate(), "");
  tp::range_guard g(0.07f);
  g.ceiling = -tp::theta_limit - 1.0f;
  g.min_theta = -inf;
  EXPECT_STRNE(g.validate(), "");
}

// Every setting a policy accepts keeps tau inside the domain whatever finite gradients and overflow events it sees,
// up to the domain's edges as the code computes them.
TEST(Temperature, AcceptedPoliciesNeverLeaveTheDomain)
{
  namespace tp = cl::temperature;
  const float inf = std::numeric_limits<float>::infinity();
  const float lo = smallest_valid_tau(), hi = largest_valid_tau();
  ASSERT_FALSE(tp::valid_tau(std::nextafter(lo, 0.0f)));
  ASSERT_FALSE(tp::valid_tau(std::nextafter(hi, inf)));
  for (const auto& opt : {cl::optimizer::sgd(1e29f), cl::optimizer::sgd(1.0f, 0.9f), cl::optimizer::adam(50.0f)})
  {
    expect_trajectory_stays_inside(tp::learnable(lo, opt), "learnable at the lowest tau");
    expect_trajectory_stays_inside(tp::learnable(hi, opt), "learnable at the highest tau");
    expect_trajectory_stays_inside(tp::clamped(0.07f, lo, hi, opt), "clamped to the whole domain");
    expect_trajectory_stays_inside(tp::clamped(lo, lo, lo, opt), "clamped to the lowest tau");
    expect_trajectory_stays_inside(tp::clamped(hi, hi, hi, opt), "clamped to the highest tau");
    expect_trajectory_stays_inside(tp::clamped(0.07f, 0.0f, inf, opt), "clamped without bounds");
    expect_trajectory_stays_inside(tp::freeze_then_learn(lo, 0, opt), "freeze_then_learn without bounds");
    expect_trajectory_stays_inside(tp::freeze_then_learn(hi, 2, opt, lo, hi), "freeze_then_learn over the domain");
    expect_trajectory_stays_inside(tp::freeze_then_learn(0.07f, 1, opt, hi, hi), "freeze_then_learn at the top");
    expect_trajectory_stays_inside(tp::range_guard(0.07f, opt, 16.0f, 0.5f, 1.0f, inf), "range_guard, no tau_max");
    expect_trajectory_stays_inside(tp::range_guard(hi, opt, 16.0f, 79.0f, 1.0f, hi), "range_guard at the top");
    expect_trajectory_stays_inside(tp::range_guard(lo, opt, 1.0f, 0.5f, 1.0f, 1.0f), "range_guard at the bottom");
  }
  for (const auto kind : {tp::schedule_kind::linear, tp::schedule_kind::cosine})
  {
    expect_trajectory_stays_inside(tp::schedule(kind, 5e34f, 1.9e-35f, 7), "schedule 5e34 -> 1.9e-35");
    expect_trajectory_stays_inside(tp::schedule(kind, hi, lo, 1000), "schedule over the whole domain, down");
    expect_trajectory_stays_inside(tp::schedule(kind, lo, hi, 3), "schedule over the whole domain, up");
    expect_trajectory_stays_inside(tp::schedule(kind, hi, hi, 3), "constant schedule at the top");
    tp::schedule s(kind, hi, lo, 5);
    for (int i = 0; i < 5; ++i)
    {
      s.advance(0.0f);
    }
    EXPECT_EQ(s.theta, tp::logit_scale_of(lo)) << "a schedule ends exactly at tau_end";
  }
}

// The dynamic scaler accepts exactly the states its rule can be in: a scale outside [min_scale, max_scale], +inf
// where growth to inf is refused, and a non-finite floor or a cap <= 0 are refused, each naming the field.
TEST(DynamicScaler, RefusesStatesItsRuleCannotReach)
{
  const float inf = std::numeric_limits<float>::infinity();
  struct refusal
  {
    cl::scaler::dynamic d;
    const char* field;
  };
  std::vector<refusal> cases;
  auto d = cl::scaler::dynamic::torch();
  d.scale = inf; // torch refuses growth to inf: no run gets there
  cases.push_back({d, "scale"});
  d = cl::scaler::dynamic::paddle_static(0.5f); // below its floor of 1: a back-off would raise it
  cases.push_back({d, "scale"});
  d = cl::scaler::dynamic::paddle_static(0.0f);
  cases.push_back({d, "scale"});
  d = cl::scaler::dynamic::torch();
  d.max_scale = 1024.0f; // above the cap
  cases.push_back({d, "scale"});
  d = cl::scaler::dynamic::torch();
  d.min_scale = inf;
  d.scale = inf;
  cases.push_back({d, "min_scale"});
  d = cl::scaler::dynamic::torch();
  d.min_scale = std::numeric_limits<float>::quiet_NaN();
  cases.push_back({d, "min_scale"});
  d = cl::scaler::dynamic::paddle_dygraph(0.0f);
  d.max_scale = 0.0f;
  cases.push_back({d, "max_scale"});
  d = cl::scaler::dynamic::torch();
  d.min_scale = 4.0f;
  d.max_scale = 2.0f;
  cases.push_back({d, "max_scale"});
  for (const refusal& r : cases)
  {
    const std::string why = r.d.validate();
    EXPECT_EQ(why.rfind(r.field, 0), 0u) << "scale " << r.d.scale << ": '" << why << "' should name " << r.field;
  }
  // What the presets' rules reach stays accepted: 0 after 166 back-offs without a floor, +inf after unchecked
  // growth, the floor and the cap.
  auto torch = cl::scaler::dynamic::torch();
  auto dygraph = cl::scaler::dynamic::paddle_dygraph(std::ldexp(1.0f, 120), 2.0f, 0.5f, 1, 1);
  auto paddle_static = cl::scaler::dynamic::paddle_static(4.0f, 2.0f, 0.8f, 1, 1);
  auto capped = cl::scaler::dynamic::torch();
  capped.max_scale = 70000.0f;
  capped.growth_interval = 1;
  for (int i = 0; i < 200; ++i)
  {
    torch.update(true);
    dygraph.update(false);
    paddle_static.update(true);
    capped.update(false);
    ASSERT_STREQ(torch.validate(), "") << i;
    ASSERT_STREQ(dygraph.validate(), "") << i;
    ASSERT_STREQ(paddle_static.validate(), "") << i;
    ASSERT_STREQ(capped.validate(), "") << i;
  }
  EXPECT_EQ(torch.scale, 0.0f);
  EXPECT_EQ(dygraph.scale, inf);
  EXPECT_EQ(paddle_static.scale, paddle_static.min_scale);
  EXPECT_EQ(capped.scale, capped.max_scale);
  for (int i = 0; i < 5; ++i)
  {
    dygraph.update(true); // inf * 0.5 = inf: a dead end, as in Paddle
    EXPECT_EQ(dygraph.scale, inf);
    EXPECT_STREQ(dygraph.validate(), "");
  }
}
