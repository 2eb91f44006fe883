// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The core of `collapse_demo`: a small CLIP-style training on generated paired data, run once per configuration
/// (element type x temperature policy x algorithm), with the per-step record and a summary of each run.
///
/// Data: latent factors z ~ N(0, I_latent); two views x_a = M_a z + noise, x_b = M_b z + noise (fixed random mixing
/// matrices), so a pair shares its z and retrieval of b from a (and back) is learnable but not trivial.
/// Model: two towers, each f = normalize(W x) with W (dim x input_dim), float master weights, Adam.
/// Compute in the element type T, as framework autocast does: x and W are rounded to T, h = round_T(W x) with float
/// accumulation, f = round_T(h / |h|) with the norm in float; backward: dF (T, scaled by the loss scale, from the
/// library's loss), dh = round_T((dF - f <f, dF>) / |h|), dW = round_T(dh^T x) (the fp16 GEMM's output), then
/// `unscale_and_check` on the float copy. A skipped step skips Adam too.
/// Everything is deterministic given the seed: the random numbers come from splitmix64 with our own Box-Muller, not
/// from <random>'s distributions (whose output differs between standard libraries).

#include <contrastive/contrastive.hpp>
#include <contrastive/policy/range_guard.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace collapse_demo
{
namespace cl = contrastive;

// ---------------------------------------------------------------------------------------------------------------------
// Configuration

enum class element_kind
{
  f32,
  f16,
  bf16,
};
enum class policy_kind
{
  fixed,
  learnable,
  clamped,
  scheduled,
  guard,
};
enum class algorithm_kind
{
  materialized,
  fused,
};

inline const char* to_string(element_kind e)
{
  return e == element_kind::f32 ? "float" : (e == element_kind::f16 ? "half" : "bfloat16");
}
inline const char* to_string(policy_kind p)
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
inline const char* to_string(algorithm_kind a)
{
  return a == algorithm_kind::materialized ? "materialized" : "fused";
}

/// One line of the table.
struct run_config
{
  element_kind element = element_kind::f32;
  policy_kind policy = policy_kind::learnable;
  algorithm_kind algorithm = algorithm_kind::materialized;

  /// "half-learnable-materialized": the CSV's file name and the figure's panel key.
  std::string id() const
  {
    return std::string(to_string(element)) + "-" + to_string(policy) + "-" + to_string(algorithm);
  }
};

inline bool parse_element(const std::string& s, element_kind& out)
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
inline bool parse_policy(const std::string& s, policy_kind& out)
{
  const policy_kind all[] = {
      policy_kind::fixed, policy_kind::learnable, policy_kind::clamped, policy_kind::scheduled, policy_kind::guard};
  for (policy_kind p : all)
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
  return false;
}
inline bool parse_algorithm(const std::string& s, algorithm_kind& out)
{
  if (s == "materialized")
  {
    out = algorithm_kind::materialized;
  }
  else if (s == "fused")
  {
    out = algorithm_kind::fused;
  }
  else
  {
    return false;
  }
  return true;
}

/// Parses "type:policy[:algorithm]" (algorithm defaults to materialized). On failure returns false and says why.
inline bool parse_run(const std::string& s, run_config& out, std::string& why)
{
  std::vector<std::string> parts;
  std::string cur;
  for (char c : s)
  {
    if (c == ':')
    {
      parts.push_back(cur);
      cur.clear();
    }
    else
    {
      cur += c;
    }
  }
  parts.push_back(cur);
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

/// The default table: the seed's failure, each remedy, and the range guard.
inline std::vector<run_config> default_runs()
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

/// The dynamic scaler's rule for the 16-bit runs (float runs use a constant scale of 1, as fp32 training does).
enum class scaler_kind
{
  paddle,        ///< Paddle dygraph GradScaler defaults: 2^16, x2 per 2000 finite steps, x0.5 per non-finite step
  torch,         ///< torch.amp.GradScaler defaults (the same numbers; growth to inf refused)
  paddle_static, ///< Paddle static graph: 2^15, x2 per 1000, x0.8 per 2 non-finite steps, floor 1
  none,          ///< constant scale 1
};

inline const char* to_string(scaler_kind s)
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
inline bool parse_scaler(const std::string& s, scaler_kind& out)
{
  const scaler_kind all[] = {scaler_kind::paddle, scaler_kind::torch, scaler_kind::paddle_static, scaler_kind::none};
  for (scaler_kind k : all)
  {
    if (s == to_string(k))
    {
      out = k;
      return true;
    }
  }
  return false;
}

/// Everything but the configuration: data, model, optimisation and policy settings.
struct settings
{
  std::int64_t steps = 1200;
  std::size_t batch = 128;
  std::size_t dim = 8;        ///< embedding dimension (each tower's output)
  std::size_t input_dim = 64; ///< each view's dimension
  std::size_t latent = 8;     ///< shared latent factors
  float noise = 0.05f;        ///< per-coordinate noise std of each view (signal std is 1)
  std::uint64_t seed = 2;
  float lr = 2e-3f;          ///< Adam learning rate of the encoders
  float tau_lr = 1.0f;       ///< Adam learning rate of theta = log(1/tau): deliberately aggressive (docs/demo.md)
  float tau_beta2 = 0.9f;    ///< Adam beta2 of theta (beta1 0.9, eps 1e-8)
  std::int64_t warmup = 100; ///< linear warm-up of both learning rates over the first steps (as open_clip's --warmup)
  float tau_init = 0.07f;    ///< CLIP's initial temperature
  float tau_min = 0.01f;     ///< clamped: open_clip's bound (logit scale <= 100)
  float tau_max = 1.0f;      ///< clamped and guard: open_clip's upper bound
  float fixed_tau = 0.05f;   ///< fixed, and scheduled before its unfreeze step (the seed author's value)
  std::int64_t unfreeze_step = 600; ///< scheduled: finite steps at fixed_tau before tau becomes learnable
  float guard_headroom = 16.0f;
  float guard_retreat = 0.5f;
  scaler_kind scaler = scaler_kind::paddle;
  std::size_t eval_pairs = 1024; ///< held-out pairs; top-1 retrieval among all of them
  std::int64_t eval_every = 50;
  std::int64_t collapse_window = 50; ///< a run that ends with this many consecutive skipped steps has collapsed
  unsigned threads = 1;              ///< threads of the loss engine; 1 keeps runs bit-reproducible (0: all cores)
};

// ---------------------------------------------------------------------------------------------------------------------
// Results

/// One training step, as written to the CSV.
struct step_row
{
  std::int64_t step = 0;
  float loss = 0.0f;
  float tau = 0.0f;
  float loss_scale = 0.0f;
  float max_logit = 0.0f;
  bool skipped = false;
  cl::nonfinite_site site = cl::nonfinite_site::none;
  float accuracy = std::numeric_limits<float>::quiet_NaN(); ///< held-out top-1, only on evaluation steps
};

struct run_result
{
  run_config config;
  std::vector<step_row> rows;
  float final_loss = 0.0f;     ///< loss of the last step (NaN if that step was skipped)
  float final_accuracy = 0.0f; ///< held-out top-1 (mean of a->b and b->a) after the last step
  float best_accuracy = 0.0f;
  float final_tau = 0.0f;
  float min_loss_scale = 0.0f;
  float final_loss_scale = 0.0f;
  std::int64_t skipped = 0;
  std::int64_t collapse_step = -1; ///< first step of the terminal run of >= collapse_window skipped steps
  std::int64_t first_nonfinite_step = -1;
  cl::nonfinite_site first_nonfinite_site = cl::nonfinite_site::none;
  cl::nonfinite_site collapse_site = cl::nonfinite_site::none; ///< the site at collapse_step
  std::int64_t guard_events = 0;                               ///< range_guard only
  double seconds = 0.0;
  std::string error; ///< non-empty if the library refused a call

  bool collapsed() const
  {
    return collapse_step >= 0;
  }
};

// ---------------------------------------------------------------------------------------------------------------------
// Random numbers: splitmix64 and Box-Muller, identical on every platform.

class rng
{
public:
  explicit rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next()
  {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// Uniform in (0, 1).
  double uniform()
  {
    return (static_cast<double>(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
  }
  float normal()
  {
    if (has_spare_)
    {
      has_spare_ = false;
      return spare_;
    }
    const double r = std::sqrt(-2.0 * std::log(uniform()));
    const double t = 6.283185307179586 * uniform();
    spare_ = static_cast<float>(r * std::sin(t));
    has_spare_ = true;
    return static_cast<float>(r * std::cos(t));
  }

private:
  std::uint64_t state_;
  float spare_ = 0.0f;
  bool has_spare_ = false;
};

// ---------------------------------------------------------------------------------------------------------------------
// Data

/// Two views of shared latent factors. Signal per view coordinate has unit variance.
class paired_views
{
public:
  paired_views(const settings& s) : in_(s.input_dim), latent_(s.latent), noise_(s.noise)
  {
    rng r(s.seed ^ 0x5eed0000da7aull);
    mix_a_.resize(in_ * latent_);
    mix_b_.resize(in_ * latent_);
    const float g = 1.0f / std::sqrt(static_cast<float>(latent_));
    for (float& x : mix_a_)
    {
      x = g * r.normal();
    }
    for (float& x : mix_b_)
    {
      x = g * r.normal();
    }
  }

  /// n pairs into xa, xb (n x input_dim each).
  void sample(rng& r, std::size_t n, std::vector<float>& xa, std::vector<float>& xb) const
  {
    xa.assign(n * in_, 0.0f);
    xb.assign(n * in_, 0.0f);
    std::vector<float> z(latent_);
    for (std::size_t i = 0; i < n; ++i)
    {
      for (float& v : z)
      {
        v = r.normal();
      }
      for (std::size_t c = 0; c < in_; ++c)
      {
        float a = 0.0f, b = 0.0f;
        for (std::size_t l = 0; l < latent_; ++l)
        {
          a += mix_a_[c * latent_ + l] * z[l];
          b += mix_b_[c * latent_ + l] * z[l];
        }
        xa[i * in_ + c] = a + noise_ * r.normal();
        xb[i * in_ + c] = b + noise_ * r.normal();
      }
    }
  }

private:
  std::size_t in_, latent_;
  float noise_;
  std::vector<float> mix_a_, mix_b_;
};

// ---------------------------------------------------------------------------------------------------------------------
// Model: one tower f = normalize(W x), computed in T, float master weights and Adam.

template <class T>
class tower
{
  using traits = cl::element_traits<T>;

public:
  tower(std::size_t dim, std::size_t in, rng& r)
      : dim_(dim), in_(in), w_(dim * in), m_(dim * in, 0.0f), v_(dim * in, 0.0f), grad_(dim * in, 0.0f)
  {
    const float g = 1.0f / std::sqrt(static_cast<float>(in));
    for (float& x : w_)
    {
      x = g * r.normal();
    }
  }

  /// Features of n inputs (n x in) into `f` (n x dim, element type); keeps what backward needs.
  void forward(const std::vector<float>& x, std::size_t n, std::vector<T>& f)
  {
    n_ = n;
    xr_.resize(n * in_);
    for (std::size_t i = 0; i < n * in_; ++i)
    {
      xr_[i] = cl::round_to<T>(x[i]);
    }
    wr_.resize(dim_ * in_);
    for (std::size_t i = 0; i < dim_ * in_; ++i)
    {
      wr_[i] = cl::round_to<T>(w_[i]);
    }
    f.resize(n * dim_);
    ff_.resize(n * dim_);
    norm_.resize(n);
    std::vector<float> h(dim_);
    for (std::size_t i = 0; i < n; ++i)
    {
      const float* xi = &xr_[i * in_];
      double sq = 0.0;
      for (std::size_t r = 0; r < dim_; ++r)
      {
        const float* wr = &wr_[r * in_];
        float acc = 0.0f;
        for (std::size_t c = 0; c < in_; ++c)
        {
          acc += wr[c] * xi[c];
        }
        h[r] = cl::round_to<T>(acc);
        sq += static_cast<double>(h[r]) * h[r];
      }
      const float nrm = std::max(static_cast<float>(std::sqrt(sq)), 1e-12f);
      norm_[i] = nrm;
      for (std::size_t r = 0; r < dim_; ++r)
      {
        const T v = traits::from_float(h[r] / nrm);
        f[i * dim_ + r] = v;
        ff_[i * dim_ + r] = traits::to_float(v);
      }
    }
  }

  /// From dF (n x dim, T, scaled) to the scaled float weight gradient `grad()`.
  void backward(const std::vector<T>& df)
  {
    std::fill(grad_.begin(), grad_.end(), 0.0f);
    std::vector<float> dh(dim_);
    std::vector<float> acc(dim_ * in_, 0.0f);
    for (std::size_t i = 0; i < n_; ++i)
    {
      const float* fi = &ff_[i * dim_];
      float proj = 0.0f;
      for (std::size_t r = 0; r < dim_; ++r)
      {
        proj += fi[r] * traits::to_float(df[i * dim_ + r]);
      }
      const float inv = 1.0f / norm_[i];
      for (std::size_t r = 0; r < dim_; ++r)
      {
        dh[r] = cl::round_to<T>((traits::to_float(df[i * dim_ + r]) - fi[r] * proj) * inv);
      }
      const float* xi = &xr_[i * in_];
      for (std::size_t r = 0; r < dim_; ++r)
      {
        float* a = &acc[r * in_];
        const float d = dh[r];
        for (std::size_t c = 0; c < in_; ++c)
        {
          a[c] += d * xi[c];
        }
      }
    }
    for (std::size_t j = 0; j < dim_ * in_; ++j)
    {
      grad_[j] = cl::round_to<T>(acc[j]);
    }
  }

  std::vector<float>& grad()
  {
    return grad_;
  }

  void adam_step(float lr, std::int64_t t)
  {
    const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
    const float bc1 = 1.0f - static_cast<float>(std::pow(0.9, static_cast<double>(t)));
    const float bc2 = 1.0f - static_cast<float>(std::pow(0.999, static_cast<double>(t)));
    for (std::size_t j = 0; j < w_.size(); ++j)
    {
      const float g = grad_[j];
      m_[j] = b1 * m_[j] + (1.0f - b1) * g;
      v_[j] = b2 * v_[j] + (1.0f - b2) * g * g;
      w_[j] -= lr * (m_[j] / bc1) / (std::sqrt(v_[j] / bc2) + eps);
    }
  }

private:
  std::size_t dim_, in_, n_ = 0;
  std::vector<float> w_, m_, v_, grad_;
  std::vector<float> xr_, wr_, ff_, norm_;
};

/// Top-1 retrieval accuracy among n pairs (mean of a->b and b->a); a tie counts as a miss.
template <class T>
float retrieval_top1(const std::vector<T>& fa, const std::vector<T>& fb, std::size_t n, std::size_t dim)
{
  using traits = cl::element_traits<T>;
  std::vector<float> a(n * dim), b(n * dim);
  for (std::size_t i = 0; i < n * dim; ++i)
  {
    a[i] = traits::to_float(fa[i]);
    b[i] = traits::to_float(fb[i]);
  }
  std::vector<float> sim(n * n);
  for (std::size_t i = 0; i < n; ++i)
  {
    for (std::size_t j = 0; j < n; ++j)
    {
      float s = 0.0f;
      for (std::size_t c = 0; c < dim; ++c)
      {
        s += a[i * dim + c] * b[j * dim + c];
      }
      sim[i * n + j] = s;
    }
  }
  std::size_t hits = 0;
  for (std::size_t i = 0; i < n; ++i)
  {
    bool row_ok = true, col_ok = true;
    for (std::size_t j = 0; j < n; ++j)
    {
      if (j != i && !(sim[i * n + j] < sim[i * n + i]))
      {
        row_ok = false;
      }
      if (j != i && !(sim[j * n + i] < sim[i * n + i]))
      {
        col_ok = false;
      }
    }
    hits += (row_ok ? 1 : 0) + (col_ok ? 1 : 0);
  }
  return static_cast<float>(hits) / static_cast<float>(2 * n);
}

// ---------------------------------------------------------------------------------------------------------------------
// Temperature policies of each configuration

inline cl::optimizer tau_adam(const settings& s)
{
  return cl::optimizer::adam(s.tau_lr, 0.9f, s.tau_beta2);
}

inline cl::temperature::fixed make_policy(const settings& s, cl::temperature::fixed*)
{
  return cl::temperature::fixed(s.fixed_tau);
}
inline cl::temperature::learnable make_policy(const settings& s, cl::temperature::learnable*)
{
  return cl::temperature::learnable(s.tau_init, tau_adam(s));
}
inline cl::temperature::clamped make_policy(const settings& s, cl::temperature::clamped*)
{
  return cl::temperature::clamped(s.tau_init, s.tau_min, s.tau_max, tau_adam(s));
}
inline cl::temperature::scheduled make_policy(const settings& s, cl::temperature::scheduled*)
{
  // The seed author's remedy: fixed at 0.05, then learnable with no bound.
  return cl::temperature::scheduled::freeze_then_learn(s.fixed_tau, s.unfreeze_step, tau_adam(s));
}
inline cl::temperature::range_guard make_policy(const settings& s, cl::temperature::range_guard*)
{
  return cl::temperature::range_guard(s.tau_init, tau_adam(s), s.guard_headroom, s.guard_retreat, 1.0f, s.tau_max);
}

inline cl::scaler::dynamic make_scaler(const settings& s, bool sixteen_bit)
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
inline std::int64_t guard_events(const cl::temperature::range_guard& g)
{
  return g.events;
}

// ---------------------------------------------------------------------------------------------------------------------
// Training

/// Called every `progress_every` steps with (step, steps).
using progress_fn = std::function<void(std::int64_t, std::int64_t)>;

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
  p.obj = cl::objective::symmetric;

  auto evaluate = [&]()
  {
    tower<T> ca = ta, cb = tb; // evaluation must not disturb the saved activations (cheap at this size)
    ca.forward(eval_a, s.eval_pairs, ea);
    cb.forward(eval_b, s.eval_pairs, eb);
    return retrieval_top1(ea, eb, s.eval_pairs, d);
  };

  res.rows.reserve(static_cast<std::size_t>(s.steps));
  res.min_loss_scale = L.loss_scale();
  std::int64_t adam_t = 0;
  std::int64_t streak = 0;
  const std::int64_t progress_every = std::max<std::int64_t>(1, s.steps / 10);
  for (std::int64_t step = 0; step < s.steps; ++step)
  {
    // Linear warm-up of both learning rates (open_clip warms up every parameter, logit_scale included).
    const float warm =
        s.warmup > 0 && step < s.warmup ? static_cast<float>(step + 1) / static_cast<float>(s.warmup) : 1.0f;
    if constexpr (Temperature::is_learnable)
    {
      if (step <= s.warmup)
      {
        typename loss_type::checkpoint c = L.save();
        c.temperature.opt.lr = s.tau_lr * warm;
        if (const cl::status st = L.restore(c); !st.ok())
        {
          res.error = "step " + std::to_string(step) + ": " + st.message();
          break;
        }
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
      ta.adam_step(s.lr * warm, adam_t);
      tb.adam_step(s.lr * warm, adam_t);
    }
    step_row row;
    row.step = step;
    row.loss = rec.loss;
    row.tau = rec.tau;
    row.loss_scale = rec.loss_scale;
    row.max_logit = rec.max_logit;
    row.skipped = rec.skipped;
    row.site = rec.first_nonfinite;
    if ((step + 1) % s.eval_every == 0 || step + 1 == s.steps)
    {
      row.accuracy = evaluate();
      res.best_accuracy = std::max(res.best_accuracy, row.accuracy);
    }
    res.rows.push_back(row);

    res.min_loss_scale = std::min(res.min_loss_scale, rec.next_loss_scale);
    if (rec.skipped)
    {
      ++res.skipped;
      ++streak;
      if (res.first_nonfinite_step < 0)
      {
        res.first_nonfinite_step = step;
        res.first_nonfinite_site = rec.first_nonfinite;
      }
    }
    else
    {
      streak = 0;
    }
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
    return train_typed<T, tp::scheduled, Algorithm>(s, cfg, progress);
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

/// Trains one configuration from the seed's initial weights on the seed's data stream (the same for every run).
inline run_result train(const settings& s, const run_config& cfg, const progress_fn& progress = {})
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

/// Checks the settings; returns an empty string or what is wrong.
inline std::string validate(const settings& s)
{
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
  if (!(s.tau_beta2 >= 0.0f && s.tau_beta2 < 1.0f))
  {
    return "--tau-beta2 must be in [0, 1)";
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

// ---------------------------------------------------------------------------------------------------------------------
// Output

inline std::string format_number(float x, const char* fmt)
{
  if (std::isnan(x))
  {
    return "nan";
  }
  if (std::isinf(x))
  {
    return x > 0 ? "inf" : "-inf";
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, static_cast<double>(x));
  return buf;
}

/// The side-by-side table.
inline std::string format_table(const std::vector<run_result>& results)
{
  std::ostringstream os;
  char line[512];
  std::snprintf(line,
                sizeof line,
                "%-9s %-10s %-12s %10s %7s %10s %10s %10s %8s %10s  %s\n",
                "type",
                "policy",
                "algorithm",
                "loss",
                "top-1",
                "tau",
                "min scale",
                "scale",
                "skipped",
                "collapsed",
                "first non-finite (step: site) / at collapse");
  os << line;
  for (const run_result& r : results)
  {
    std::string collapsed = r.collapsed() ? "step " + std::to_string(r.collapse_step) : "no";
    std::string diag = "-";
    if (r.first_nonfinite_step >= 0)
    {
      diag = std::to_string(r.first_nonfinite_step) + ": " + cl::to_string(r.first_nonfinite_site);
      if (r.collapsed())
      {
        diag += " / " + std::string(cl::to_string(r.collapse_site));
      }
    }
    if (!r.error.empty())
    {
      diag = "error: " + r.error;
    }
    std::snprintf(line,
                  sizeof line,
                  "%-9s %-10s %-12s %10s %6.1f%% %10s %10s %10s %8lld %10s  %s\n",
                  to_string(r.config.element),
                  to_string(r.config.policy),
                  to_string(r.config.algorithm),
                  format_number(r.final_loss, "%.4g").c_str(),
                  100.0 * r.final_accuracy,
                  format_number(r.final_tau, "%.3g").c_str(),
                  format_number(r.min_loss_scale, "%.3g").c_str(),
                  format_number(r.final_loss_scale, "%.3g").c_str(),
                  static_cast<long long>(r.skipped),
                  collapsed.c_str(),
                  diag.c_str());
    os << line;
  }
  return os.str();
}

/// Per-step CSV: step,loss,tau,loss_scale,skipped,accuracy,max_logit,first_nonfinite (accuracy empty between
/// evaluations). Returns false if the file cannot be written.
inline bool write_csv(const std::string& path, const run_result& r)
{
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr)
  {
    return false;
  }
  std::fprintf(f, "step,loss,tau,loss_scale,skipped,accuracy,max_logit,first_nonfinite\n");
  for (const step_row& row : r.rows)
  {
    const std::string acc = std::isnan(row.accuracy) ? "" : format_number(row.accuracy, "%.4f");
    std::fprintf(f,
                 "%lld,%s,%s,%s,%d,%s,%s,%s\n",
                 static_cast<long long>(row.step),
                 format_number(row.loss, "%.6g").c_str(),
                 format_number(row.tau, "%.6g").c_str(),
                 format_number(row.loss_scale, "%.6g").c_str(),
                 row.skipped ? 1 : 0,
                 acc.c_str(),
                 format_number(row.max_logit, "%.6g").c_str(),
                 cl::to_string(row.site));
  }
  return std::fclose(f) == 0;
}
} // namespace collapse_demo
