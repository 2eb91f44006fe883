// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// Integration test of the collapse demo: a shortened default run (seed 19, 800 steps) must show what docs/demo.md
// claims, and only what held for every one of seeds 1-6 on every host ISA (avx512, avx2, portable; measured with
// scripts/demo_seeds.py, docs/demo.md "Over seeds and ISAs"). The dynamics are chaotic: the micro-kernel's summation
// order differs per ISA, so one seed's trajectory differs per ISA, and per-seed outcomes (whether half + learnable
// collapses, the fused run's final accuracy) are not asserted. What is asserted:
//   - float + learnable and bfloat16 + learnable never collapse and never skip a step;
//   - half + clamped and half + range_guard stay healthy at high accuracy, with tau bounded as their policies say;
//   - half + scheduled is healthy while tau is frozen and collapses after unfreezing (18 of 18);
//   - half + fused never has a non-finite logit and never collapses (it can still degrade: tau is not bounded);
//   - wherever half + learnable collapses, it does so as docs/collapse.md describes: logits overflow at
//     1/tau > 65504, every later step is skipped with tau frozen, and the Paddle dygraph scale underflows to 0.
// If this fails after a change in the library's rounding, re-run `python3 scripts/demo_seeds.py` on the ISAs the
// machine has before editing the expectations or the docs.

#include "collapse/config.hpp"
#include "collapse/options.hpp"
#include "collapse/train.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>

namespace cd = collapse_demo;
namespace cl = contrastive;

namespace
{
const std::map<std::string, cd::run_result>& results()
{
  static const std::map<std::string, cd::run_result> r = []
  {
    cd::settings s; // the demo's defaults (seed, learning rates, data), shortened
    s.steps = 800;
    s.eval_pairs = 512;
    s.eval_every = 100;
    std::map<std::string, cd::run_result> out;
    for (const cd::run_config& c : cd::default_runs())
    {
      out[c.id()] = cd::train(s, c);
    }
    return out;
  }();
  return r;
}

const cd::run_result& run(const std::string& id)
{
  const auto it = results().find(id);
  EXPECT_NE(it, results().end()) << id;
  return it->second;
}

void expect_healthy(const cd::run_result& r)
{
  SCOPED_TRACE(r.config.id());
  EXPECT_TRUE(r.error.empty()) << r.error;
  EXPECT_FALSE(r.collapsed());
  EXPECT_TRUE(std::isfinite(r.final_loss));
  EXPECT_GT(r.final_loss_scale, 0.0f);
  EXPECT_LT(r.skipped, 20) << "a healthy run skips only the scaler's first back-offs";
  for (const cd::step_row& row : r.rows)
  {
    EXPECT_NE(row.site, cl::nonfinite_site::logits) << "step " << row.step;
  }
}
} // namespace

static void check_FloatLearnableStaysHealthy()
{
  const cd::run_result& f = run("float-learnable-materialized");
  expect_healthy(f);
  EXPECT_EQ(f.skipped, 0);
  EXPECT_GT(f.final_accuracy, 0.75f) << "seeds 1-6 x 3 ISAs: 97.2-100%";
}

static void check_HalfLearnableCollapsesAsTheSeedDescribes()
{
  const cd::run_result& h = run("half-learnable-materialized");
  ASSERT_TRUE(h.error.empty()) << h.error;
  // Seeds 1-6 x 3 ISAs at this length: collapsed in about half the runs (docs/demo.md), and a run can also be in the
  // middle of collapsing at its last step. A run whose logits never overflowed must be healthy; from its first logit
  // overflow on, a run must die the way docs/collapse.md describes.
  std::size_t first = h.rows.size();
  for (std::size_t i = 0; i < h.rows.size(); ++i)
  {
    if (h.rows[i].site == cl::nonfinite_site::logits)
    {
      first = i;
      break;
    }
  }
  if (first == h.rows.size())
  {
    expect_healthy(h);
    return;
  }
  if (h.collapsed())
  {
    EXPECT_EQ(h.collapse_site, cl::nonfinite_site::logits);
  }
  // At the overflow 1/tau has left fp16's range: tau < 1/65504.
  EXPECT_LT(h.rows[first].tau, 1.0f / 65504.0f * 1.01f);
  // Dead: every later step skipped (non-finite whatever the loss scale), tau frozen, and the Paddle dygraph scaler
  // (no floor) halving the scale on each one (powers of two: exact down to the smallest subnormal, then 0), so an
  // overflow more than ~170 steps before the end leaves the scale at exactly 0.
  for (std::size_t i = first; i < h.rows.size(); ++i)
  {
    EXPECT_TRUE(h.rows[i].skipped) << "step " << i;
    EXPECT_EQ(h.rows[i].site, cl::nonfinite_site::logits) << "step " << i;
    EXPECT_EQ(h.rows[i].tau, h.rows[first].tau) << "step " << i;
    if (i > first)
    {
      EXPECT_EQ(h.rows[i].loss_scale, h.rows[i - 1].loss_scale * 0.5f) << "step " << i;
    }
  }
  if (h.rows.size() - first > 170)
  {
    EXPECT_EQ(h.final_loss_scale, 0.0f) << "the Paddle dygraph scaler has no floor";
    EXPECT_EQ(h.min_loss_scale, 0.0f);
  }
}

static void check_RemediesStayHealthy()
{
  // Clamp and guard: healthy at high accuracy in all 18 runs (clamp 100%, guard 98.9-100%).
  for (const char* id : {"half-clamped-materialized", "half-guard-materialized"})
  {
    const cd::run_result& r = run(id);
    expect_healthy(r);
    EXPECT_GT(r.final_accuracy, 0.9f) << id;
  }
  // Fused: its logits are float, so they never overflow and it never collapses (18 of 18), but tau is not bounded:
  // in 4 of 18 runs it dived below 1e-5 and the run ended 10-47 points below float (docs/demo.md). No accuracy claim.
  const cd::run_result& f = run("half-learnable-fused");
  SCOPED_TRACE(f.config.id());
  EXPECT_TRUE(f.error.empty()) << f.error;
  EXPECT_FALSE(f.collapsed());
  EXPECT_GT(f.final_loss_scale, 0.0f);
  for (const cd::step_row& row : f.rows)
  {
    EXPECT_NE(row.site, cl::nonfinite_site::logits) << "step " << row.step;
  }
}

static void check_ClampAndGuardBoundTau()
{
  EXPECT_GE(run("half-clamped-materialized").final_tau, 0.01f * 0.999f);
  const cd::run_result& g = run("half-guard-materialized");
  for (const cd::step_row& row : g.rows)
  {
    EXPECT_LE(1.0f / row.tau, 65504.0f / 16.0f * 1.001f) << "step " << row.step;
  }
}

static void check_ScheduledIsHealthyWhileFrozenAndCollapsesAfter()
{
  const cd::settings s;
  const cd::run_result& r = run("half-scheduled-materialized");
  ASSERT_TRUE(r.error.empty()) << r.error;
  for (const cd::step_row& row : r.rows)
  {
    if (row.step < s.unfreeze_step)
    {
      EXPECT_NEAR(row.tau, s.fixed_tau, 1e-6f) << "step " << row.step;
      EXPECT_NE(row.site, cl::nonfinite_site::logits) << "step " << row.step;
    }
  }
  ASSERT_TRUE(r.collapsed());
  EXPECT_GT(r.collapse_step, s.unfreeze_step);
  EXPECT_EQ(r.collapse_site, cl::nonfinite_site::logits);
}

static void check_BFloat16LearnableDoesNotOverflow()
{
  const cd::run_result& b = run("bfloat16-learnable-materialized");
  EXPECT_TRUE(b.error.empty()) << b.error;
  EXPECT_FALSE(b.collapsed());
  EXPECT_EQ(b.skipped, 0);
}

// One test over one shortened default run (all seven configurations, about 6 s on 2 cores), so that ctest trains once.
TEST(CollapseDemo, ShortenedDefaultRunShowsTheClaims)
{
  {
    SCOPED_TRACE("FloatLearnableStaysHealthy");
    check_FloatLearnableStaysHealthy();
  }
  {
    SCOPED_TRACE("HalfLearnableCollapsesAsTheSeedDescribes");
    check_HalfLearnableCollapsesAsTheSeedDescribes();
  }
  {
    SCOPED_TRACE("RemediesStayHealthy");
    check_RemediesStayHealthy();
  }
  {
    SCOPED_TRACE("ClampAndGuardBoundTau");
    check_ClampAndGuardBoundTau();
  }
  {
    SCOPED_TRACE("ScheduledIsHealthyWhileFrozenAndCollapsesAfter");
    check_ScheduledIsHealthyWhileFrozenAndCollapsesAfter();
  }
  {
    SCOPED_TRACE("BFloat16LearnableDoesNotOverflow");
    check_BFloat16LearnableDoesNotOverflow();
  }
}

TEST(CollapseDemo, RunsAreDeterministic)
{
  cd::settings s;
  s.steps = 60;
  s.eval_pairs = 64;
  const cd::run_config c{cd::element_kind::f16, cd::policy_kind::learnable, cd::algorithm_kind::materialized};
  const cd::run_result a = cd::train(s, c), b = cd::train(s, c);
  ASSERT_EQ(a.rows.size(), b.rows.size());
  for (std::size_t i = 0; i < a.rows.size(); ++i)
  {
    EXPECT_EQ(a.rows[i].loss, b.rows[i].loss) << i;
    EXPECT_EQ(a.rows[i].tau, b.rows[i].tau) << i;
  }
}

TEST(CollapseDemo, ParsesRunsAndRejectsBadOnes)
{
  cd::run_config c;
  std::string why;
  EXPECT_TRUE(cd::parse_run("half:guard:fused", c, why));
  EXPECT_EQ(c.element, cd::element_kind::f16);
  EXPECT_EQ(c.policy, cd::policy_kind::guard);
  EXPECT_EQ(c.algorithm, cd::algorithm_kind::fused);
  EXPECT_FALSE(cd::parse_run("half", c, why));
  EXPECT_FALSE(cd::parse_run("double:learnable", c, why));
  EXPECT_NE(why.find("double"), std::string::npos);
  cd::settings s;
  s.batch = 1;
  EXPECT_FALSE(cd::validate(s).empty());
}

TEST(CollapseDemo, OptionTableParsesAndDocumentsEveryOption)
{
  cd::cli_options o;
  std::string why;
  const char* argv[] = {"collapse_demo", "--steps=5", "--runs", "half:guard:fused", "--quiet", "--beta2", "0.98"};
  ASSERT_TRUE(cd::parse_args(7, argv, o, why)) << why;
  EXPECT_EQ(o.s.steps, 5);
  ASSERT_EQ(o.runs.size(), 1u);
  EXPECT_EQ(o.runs[0].policy, cd::policy_kind::guard);
  EXPECT_TRUE(o.quiet);
  EXPECT_EQ(o.s.beta2, 0.98);

  const char* bad[] = {"collapse_demo", "--no-such-option"};
  EXPECT_FALSE(cd::parse_args(2, bad, o, why));
  EXPECT_NE(why.find("--no-such-option"), std::string::npos);
  const char* flag_with_value[] = {"collapse_demo", "--quiet=1"};
  EXPECT_FALSE(cd::parse_args(2, flag_with_value, o, why));
  const char* missing[] = {"collapse_demo", "--steps"};
  EXPECT_FALSE(cd::parse_args(2, missing, o, why));

  const std::string help = cd::help_text();
  for (const cd::option& opt : cd::option_table())
  {
    if (!opt.name.empty())
    {
      EXPECT_NE(help.find("  " + (opt.name == "--help" ? std::string("-h, --help") : opt.name)), std::string::npos)
          << opt.name;
    }
  }
}

TEST(CollapseDemo, OpenClipPresetSetsOpenClipsOptimiser)
{
  cd::cli_options o;
  std::string why;
  const char* argv[] = {"collapse_demo", "--preset", "open_clip", "--steps", "7"};
  ASSERT_TRUE(cd::parse_args(5, argv, o, why)) << why;
  EXPECT_EQ(o.s.lr, 5e-4f);
  EXPECT_EQ(o.s.tau_lr, 5e-4f);
  EXPECT_EQ(o.s.beta2, 0.98);
  EXPECT_EQ(o.s.tau_beta2, 0.98f);
  EXPECT_EQ(o.s.steps, 7) << "a later option overrides the preset";
  EXPECT_TRUE(cd::validate(o.s).empty());
  cd::settings s;
  EXPECT_FALSE(cd::apply_preset("no_such_preset", s));
  ASSERT_TRUE(cd::apply_preset("default", s));
  EXPECT_EQ(s.tau_lr, 1.0f);
  EXPECT_EQ(s.tau_beta2, 0.9f);
}
