// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0

#include "collapse/train.hpp"

#include "collapse/data.hpp"
#include "collapse/model.hpp"

#include <contrastive/contrastive.hpp>
#include <contrastive/policy/range_guard.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <type_traits>

namespace collapse_demo
{
namespace
{
namespace cl = contrastive;

// ---------------------------------------------------------------------------------------------------------------------
// Temperature policies and scaler of each configuration

cl::optimizer tau_adam(const settings& s)
{
  return cl::optimizer::adam(s.tau_lr, 0.9f, s.tau_beta2);
}

cl::temperature::fixed make_policy(const settings& s, cl::temperature::fixed*)
{
  return cl::temperature::fixed(s.fixed_tau);
}
cl::temperature::learnable make_policy(const settings& s, cl::temperature::learnable*)
{
  return cl::temperature::learnable(s.tau_init, tau_adam(s));
}
cl::temperature::clamped make_policy(const settings& s, cl::temperature::clamped*)
{
  return cl::temperature::clamped(s.tau_init, s.tau_min, s.tau_max, tau_adam(s));
}
cl::temperature::freeze_then_learn make_policy(const settings& s, cl::temperature::freeze_then_learn*)
{
  // The freeze-then-learn remedy (docs/collapse.md): fixed at 0.05, then learnable with no bound.
  return cl::temperature::freeze_then_learn(s.fixed_tau, s.unfreeze_step, tau_adam(s));
}
cl::temperature::range_guard make_policy(const settings& s, cl::temperature::range_guard*)
{
  return cl::temperature::range_guard(s.tau_init, tau_adam(s), s.guard_headroom, s.guard_retreat, 1.0f, s.tau_max);
}

cl::scaler::dynamic make_scaler(const settings& s, bool sixteen_bit)
{
  if (!sixteen_bit || s.scaler == scaler_kind::none)
  {
    // A dynamic rule whose intervals are never reached (2^31 - 1 steps) keeps its scale: a constant 1, in the same
    // type.
    const std::int32_t never = std::numeric_limits<std::int32_t>::max();
    return cl::scaler::dynamic::paddle_dygraph(1.0f, 2.0f, 0.5f, never, never);
  }
  switch (s.scaler)
  {
  case scaler_kind::torch:
    return cl::scaler::dynamic::torch();
  case scaler_kind::paddle_static:
    return cl::scaler::dynamic::paddle_static();
  default:
    return cl::scaler::dynamic::paddle_dygraph();
  }
}

template <class P>
std::int64_t guard_events(const P&)
{
  return 0;
}
std::int64_t guard_events(const cl::temperature::range_guard& g)
{
  return g.events;
}

// ---------------------------------------------------------------------------------------------------------------------
// Training

/// Folds one finished step into the run's summary.
void record(const cl::step_record& rec, const step_row& row, std::int64_t& streak, run_result& res)
{
  res.rows.push_back(row);
  res.min_loss_scale = std::min(res.min_loss_scale, rec.next_loss_scale);
  if (!rec.skipped)
  {
    streak = 0;
    return;
  }
  ++res.skipped;
  ++streak;
  if (res.first_nonfinite_step < 0)
  {
    res.first_nonfinite_step = row.step;
    res.first_nonfinite_site = rec.first_nonfinite;
  }
}

/// The sigmoid objective's gradient mass lost to underflow in the materialized path on one batch: the share of
/// sum_ij |dL/dz_ij| whose dS_ij = round_T(loss_scale dL/dz_ij) is 0 (z = s <a_i, b_j> + bias from the element-type
/// features, as the loss computes it in float).
template <class T>
float lost_gradient_share(
    const std::vector<T>& fa, const std::vector<T>& fb, std::size_t n, std::size_t d, float s, float bias, float ls)
{
  double lost = 0.0, total = 0.0;
  for (std::size_t i = 0; i < n; ++i)
  {
    for (std::size_t j = 0; j < n; ++j)
    {
      float dot = 0.0f;
      for (std::size_t c = 0; c < d; ++c)
      {
        dot += cl::element_traits<T>::to_float(fa[i * d + c]) * cl::element_traits<T>::to_float(fb[j * d + c]);
      }
      const float z = s * dot + bias;
      const cl::sigmoid_term t = i == j ? cl::sigmoid_positive(z) : cl::sigmoid_negative(z);
      const double g = std::fabs(static_cast<double>(t.grad)) / static_cast<double>(n);
      total += g;
      if (cl::round_to<T>(ls * static_cast<float>(g)) == 0.0f)
      {
        lost += g;
      }
    }
  }
  return total > 0.0 ? static_cast<float>(lost / total) : 0.0f;
}

template <class T, class Temperature, class Algorithm>
run_result train_typed(const settings& s, const run_config& cfg, const progress_fn& progress)
{
  using loss_type = cl::loss<T, Temperature, cl::scaler::dynamic, Algorithm>;
  const auto t0 = std::chrono::steady_clock::now();
  run_result res;
  res.config = cfg;

  const paired_views data(s);
  rng init(s.seed ^ 0x1417ull);
  tower<T> ta(s.dim, s.input_dim, init), tb(s.dim, s.input_dim, init);
  rng train_rng(s.seed ^ 0x7a1aull);
  rng eval_rng(s.seed ^ 0xe7a1ull);
  std::vector<float> eval_a, eval_b;
  data.sample(eval_rng, s.eval_pairs, eval_a, eval_b);

  loss_type L(make_policy(s, static_cast<Temperature*>(nullptr)), make_scaler(s, !std::is_same_v<T, float>), s.threads);

  const std::size_t n = s.batch, d = s.dim;
  std::vector<float> xa, xb;
  std::vector<T> fa, fb, dfa(n * d), dfb(n * d), ea, eb;
  cl::problem<T> p;
  p.n_q = p.n_k = n;
  p.dim = d;
  p.obj = s.sigmoid ? cl::objective::sigmoid : cl::objective::symmetric;
  res.sigmoid = s.sigmoid;
  if (s.sigmoid)
  {
    const cl::logit_bias b =
        s.bias_lr > 0.0f ? cl::logit_bias::learnable(s.bias_init, cl::optimizer::adam(s.bias_lr, 0.9f, s.tau_beta2))
                         : cl::logit_bias::fixed(s.bias_init);
    if (const cl::status st = L.set_logit_bias(b); !st.ok())
    {
      res.error = st.message();
      return res;
    }
  }

  auto evaluate = [&]()
  {
    tower<T> ca = ta, cb = tb; // evaluation must not disturb the saved activations (cheap at this size)
    ca.forward(eval_a, s.eval_pairs, ea);
    cb.forward(eval_b, s.eval_pairs, eb);
    return retrieval_top1(ea, eb, s.eval_pairs, d);
  };

  res.rows.reserve(static_cast<std::size_t>(s.steps));
  res.min_loss_scale = L.loss_scale();
  std::int64_t streak = 0;
  std::int64_t adam_t = 0; // the encoders' Adam step count (finite steps)
  const std::int64_t progress_every = std::max<std::int64_t>(1, s.steps / 10);
  for (std::int64_t step = 0; step < s.steps; ++step)
  {
    // Linear warm-up of both learning rates (open_clip warms up every parameter, logit_scale included).
    const float warm =
        s.warmup > 0 && step < s.warmup ? static_cast<float>(step + 1) / static_cast<float>(s.warmup) : 1.0f;
    if constexpr (cl::temperature::has_optimizer_v<Temperature>)
    {
      if (step <= s.warmup)
      {
        cl::optimizer o = L.temperature().opt;
        o.lr = s.tau_lr * warm;
        if (const cl::status st = L.set_temperature_optimizer(o); !st.ok())
        {
          res.error = "step " + std::to_string(step) + ": " + st.message();
          break;
        }
      }
    }
    if (s.sigmoid && s.bias_lr > 0.0f && step <= s.warmup)
    {
      cl::logit_bias b = L.bias(); // the same warm-up as log(1/tau)'s, its optimiser state kept
      b.opt.lr = s.bias_lr * warm;
      if (const cl::status st = L.set_logit_bias(b); !st.ok())
      {
        res.error = "step " + std::to_string(step) + ": " + st.message();
        break;
      }
    }
    data.sample(train_rng, n, xa, xb);
    ta.forward(xa, n, fa);
    tb.forward(xb, n, fb);
    p.q = fa.data();
    p.k = fb.data();
    cl::step_record rec;
    cl::status st = L.forward_backward(p, dfa.data(), dfb.data(), rec);
    if (st.ok())
    {
      ta.backward(dfa);
      tb.backward(dfb);
      st = L.unscale_and_check(ta.grad().data(), ta.grad().size(), rec);
    }
    if (st.ok())
    {
      st = L.unscale_and_check(tb.grad().data(), tb.grad().size(), rec);
    }
    if (st.ok())
    {
      st = L.finish_step(rec);
    }
    if (!st.ok())
    {
      res.error = "step " + std::to_string(step) + ": " + st.message();
      break;
    }
    if (!rec.skipped)
    {
      ++adam_t;
      ta.adam_step(s.lr * warm, s.beta2, adam_t);
      tb.adam_step(s.lr * warm, s.beta2, adam_t);
    }
    step_row row;
    row.step = step;
    row.loss = rec.loss;
    row.tau = rec.tau;
    row.loss_scale = rec.loss_scale;
    row.max_logit = rec.max_logit;
    row.skipped = rec.skipped;
    row.site = rec.first_nonfinite;
    row.bias = rec.logit_bias;
    if ((step + 1) % s.eval_every == 0 || step + 1 == s.steps)
    {
      if (s.sigmoid && std::is_same_v<Algorithm, cl::algorithm::materialized> && !rec.skipped)
      {
        const float share = lost_gradient_share(fa, fb, n, d, 1.0f / rec.tau, rec.logit_bias, rec.loss_scale);
        res.lost_gradient = std::isnan(res.lost_gradient) ? share : std::max(res.lost_gradient, share);
      }
      row.accuracy = evaluate();
      res.best_accuracy = std::max(res.best_accuracy, row.accuracy);
    }
    record(rec, row, streak, res);
    if (progress && (step + 1) % progress_every == 0)
    {
      progress(step + 1, s.steps);
    }
  }
  if (!res.rows.empty())
  {
    const step_row& last = res.rows.back();
    // A skipped step's loss comes from non-finite logits and means nothing: report it as NaN.
    res.final_loss = last.skipped ? std::numeric_limits<float>::quiet_NaN() : last.loss;
    res.final_accuracy = std::isnan(last.accuracy) ? evaluate() : last.accuracy;
  }
  res.final_tau = L.tau();
  res.final_bias = L.bias().value;
  res.final_loss_scale = L.loss_scale();
  if (streak >= s.collapse_window && streak > 0)
  {
    res.collapse_step = static_cast<std::int64_t>(res.rows.size()) - streak;
    res.collapse_site = res.rows[static_cast<std::size_t>(res.collapse_step)].site;
  }
  res.guard_events = guard_events(L.temperature());
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

template <class T, class Algorithm>
run_result train_policy(const settings& s, const run_config& cfg, const progress_fn& progress)
{
  namespace tp = cl::temperature;
  switch (cfg.policy)
  {
  case policy_kind::fixed:
    return train_typed<T, tp::fixed, Algorithm>(s, cfg, progress);
  case policy_kind::learnable:
    return train_typed<T, tp::learnable, Algorithm>(s, cfg, progress);
  case policy_kind::clamped:
    return train_typed<T, tp::clamped, Algorithm>(s, cfg, progress);
  case policy_kind::scheduled:
    return train_typed<T, tp::freeze_then_learn, Algorithm>(s, cfg, progress);
  case policy_kind::guard:
    return train_typed<T, tp::range_guard, Algorithm>(s, cfg, progress);
  }
  return {};
}

template <class T>
run_result train_element(const settings& s, const run_config& cfg, const progress_fn& progress)
{
  return cfg.algorithm == algorithm_kind::materialized ? train_policy<T, cl::algorithm::materialized>(s, cfg, progress)
                                                       : train_policy<T, cl::algorithm::fused>(s, cfg, progress);
}
} // namespace

run_result train(const settings& s, const run_config& cfg, const progress_fn& progress)
{
  switch (cfg.element)
  {
  case element_kind::f32:
    return train_element<float>(s, cfg, progress);
  case element_kind::f16:
    return train_element<__half>(s, cfg, progress);
  case element_kind::bf16:
    return train_element<__nv_bfloat16>(s, cfg, progress);
  }
  return {};
}
} // namespace collapse_demo
