// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0

#include "collapse/config.hpp"

#include <cmath>

namespace collapse_demo
{
const char* to_string(element_kind e)
{
  return e == element_kind::f32 ? "float" : (e == element_kind::f16 ? "half" : "bfloat16");
}

const char* to_string(policy_kind p)
{
  switch (p)
  {
  case policy_kind::fixed:
    return "fixed";
  case policy_kind::learnable:
    return "learnable";
  case policy_kind::clamped:
    return "clamped";
  case policy_kind::scheduled:
    return "scheduled";
  case policy_kind::guard:
    return "guard";
  }
  return "?";
}

const char* to_string(algorithm_kind a)
{
  return a == algorithm_kind::materialized ? "materialized" : "fused";
}

const char* to_string(scaler_kind s)
{
  switch (s)
  {
  case scaler_kind::paddle:
    return "paddle";
  case scaler_kind::torch:
    return "torch";
  case scaler_kind::paddle_static:
    return "paddle-static";
  case scaler_kind::none:
    return "none";
  }
  return "?";
}

bool parse_element(const std::string& s, element_kind& out)
{
  if (s == "float" || s == "fp32" || s == "f32")
  {
    out = element_kind::f32;
  }
  else if (s == "half" || s == "fp16" || s == "f16")
  {
    out = element_kind::f16;
  }
  else if (s == "bfloat16" || s == "bf16")
  {
    out = element_kind::bf16;
  }
  else
  {
    return false;
  }
  return true;
}

bool parse_policy(const std::string& s, policy_kind& out)
{
  for (policy_kind p :
       {policy_kind::fixed, policy_kind::learnable, policy_kind::clamped, policy_kind::scheduled, policy_kind::guard})
  {
    if (s == to_string(p))
    {
      out = p;
      return true;
    }
  }
  if (s == "range_guard")
  {
    out = policy_kind::guard;
    return true;
  }
  if (s == "freeze_then_learn")
  {
    out = policy_kind::scheduled;
    return true;
  }
  return false;
}

bool parse_algorithm(const std::string& s, algorithm_kind& out)
{
  for (algorithm_kind a : {algorithm_kind::materialized, algorithm_kind::fused})
  {
    if (s == to_string(a))
    {
      out = a;
      return true;
    }
  }
  return false;
}

bool parse_scaler(const std::string& s, scaler_kind& out)
{
  for (scaler_kind k : {scaler_kind::paddle, scaler_kind::torch, scaler_kind::paddle_static, scaler_kind::none})
  {
    if (s == to_string(k))
    {
      out = k;
      return true;
    }
  }
  return false;
}

std::string run_config::id() const
{
  return std::string(to_string(element)) + "-" + to_string(policy) + "-" + to_string(algorithm);
}

bool parse_run(const std::string& s, run_config& out, std::string& why)
{
  std::vector<std::string> parts(1);
  for (char c : s)
  {
    if (c == ':')
    {
      parts.emplace_back();
    }
    else
    {
      parts.back() += c;
    }
  }
  if (parts.size() < 2 || parts.size() > 3)
  {
    why = "'" + s + "' is not type:policy[:algorithm]";
    return false;
  }
  run_config r;
  if (!parse_element(parts[0], r.element))
  {
    why = "unknown element type '" + parts[0] + "' in '" + s + "' (float, half, bfloat16)";
    return false;
  }
  if (!parse_policy(parts[1], r.policy))
  {
    why = "unknown policy '" + parts[1] + "' in '" + s + "' (fixed, learnable, clamped, scheduled, guard)";
    return false;
  }
  if (parts.size() == 3 && !parse_algorithm(parts[2], r.algorithm))
  {
    why = "unknown algorithm '" + parts[2] + "' in '" + s + "' (materialized, fused)";
    return false;
  }
  out = r;
  return true;
}

std::vector<run_config> default_runs()
{
  using e = element_kind;
  using p = policy_kind;
  using a = algorithm_kind;
  return {
      {e::f32, p::learnable, a::materialized},
      {e::f16, p::learnable, a::materialized},
      {e::f16, p::clamped, a::materialized},
      {e::f16, p::scheduled, a::materialized},
      {e::bf16, p::learnable, a::materialized},
      {e::f16, p::learnable, a::fused},
      {e::f16, p::guard, a::materialized},
  };
}

bool apply_preset(const std::string& name, settings& s)
{
  if (name == "default")
  {
    s = settings{};
    return true;
  }
  if (name == "open_clip")
  {
    s = settings{};
    s.steps = 20000;
    s.lr = 5e-4f;
    s.beta2 = 0.98;
    s.tau_lr = 5e-4f;
    s.tau_beta2 = 0.98f;
    s.bias_lr = 5e-4f; // SigLIP trains t and b with the same optimiser
    s.eval_every = 500;
    return true;
  }
  return false;
}

std::string validate(const settings& s)
{
  if (s.bias_lr < 0.0f)
  {
    return "--bias-lr must be >= 0";
  }
  if (s.steps < 1)
  {
    return "--steps must be >= 1";
  }
  if (s.batch < 2)
  {
    return "--batch must be >= 2";
  }
  if (s.dim < 1 || s.input_dim < 1 || s.latent < 1)
  {
    return "--dim, --input-dim and --latent must be >= 1";
  }
  if (s.eval_pairs < 2)
  {
    return "--eval-pairs must be >= 2";
  }
  if (s.eval_every < 1)
  {
    return "--eval-every must be >= 1";
  }
  if (!(s.noise >= 0.0f && std::isfinite(s.noise)))
  {
    return "--noise must be finite and >= 0";
  }
  if (!(s.lr > 0.0f && std::isfinite(s.lr)) || !(s.tau_lr >= 0.0f && std::isfinite(s.tau_lr)))
  {
    return "--lr must be > 0 and --tau-lr >= 0, both finite";
  }
  if (!(s.tau_init > 0.0f && s.tau_init <= s.tau_max && s.tau_min > 0.0f && s.tau_min <= s.tau_max &&
        s.fixed_tau > 0.0f && std::isfinite(s.tau_max)))
  {
    return "temperatures must be > 0 with tau-min <= tau-init <= tau-max";
  }
  if (!(s.beta2 >= 0.0f && s.beta2 < 1.0f) || !(s.tau_beta2 >= 0.0f && s.tau_beta2 < 1.0f))
  {
    return "--beta2 and --tau-beta2 must be in [0, 1)";
  }
  if (s.warmup < 0)
  {
    return "--warmup must be >= 0";
  }
  if (s.unfreeze_step < 0)
  {
    return "--unfreeze must be >= 0";
  }
  if (!(s.guard_headroom >= 1.0f) || !(s.guard_retreat > 0.0f))
  {
    return "--guard-headroom must be >= 1 and --guard-retreat > 0";
  }
  if (s.collapse_window < 1)
  {
    return "--collapse-window must be >= 1";
  }
  return "";
}
} // namespace collapse_demo
