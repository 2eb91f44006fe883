// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What one run of the collapse demo is: the configuration of a table line (element type x temperature policy x
/// algorithm) and the settings shared by every line (data, model, optimisation, policy values, scaler).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace collapse_demo
{
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
  scheduled, ///< temperature::freeze_then_learn (the demo keeps the name its table has always printed)
  guard,
};
enum class algorithm_kind
{
  materialized,
  fused,
};

/// The dynamic scaler's rule for the 16-bit runs (float runs use a constant scale of 1, as fp32 training does).
enum class scaler_kind
{
  paddle,        ///< Paddle dygraph GradScaler defaults: 2^16, x2 per 2000 finite steps, x0.5 per non-finite step
  torch,         ///< torch.amp.GradScaler defaults (the same numbers; growth to inf refused)
  paddle_static, ///< Paddle static graph: 2^15, x2 per 1000, x0.8 per 2 non-finite steps, floor 1
  none,          ///< constant scale 1
};

const char* to_string(element_kind e);
const char* to_string(policy_kind p);
const char* to_string(algorithm_kind a);
const char* to_string(scaler_kind s);

/// Each parser accepts the name `to_string` gives (and a few aliases: fp16, bf16, range_guard, ...).
bool parse_element(const std::string& s, element_kind& out);
bool parse_policy(const std::string& s, policy_kind& out);
bool parse_algorithm(const std::string& s, algorithm_kind& out);
bool parse_scaler(const std::string& s, scaler_kind& out);

/// One line of the table.
struct run_config
{
  element_kind element = element_kind::f32;
  policy_kind policy = policy_kind::learnable;
  algorithm_kind algorithm = algorithm_kind::materialized;

  /// "half-learnable-materialized": the CSV's file name and the figure's panel key.
  std::string id() const;
};

/// Parses "type:policy[:algorithm]" (algorithm defaults to materialized). On failure returns false and says why.
bool parse_run(const std::string& s, run_config& out, std::string& why);

/// The default table: the fp16 collapse, each remedy, and the range guard.
std::vector<run_config> default_runs();

/// Everything but the configuration: data, model, optimisation and policy settings.
struct settings
{
  std::int64_t steps = 1200;
  std::size_t batch = 128;
  std::size_t dim = 8;        ///< embedding dimension (each tower's output)
  std::size_t input_dim = 64; ///< each view's dimension
  std::size_t latent = 8;     ///< shared latent factors
  float noise = 0.05f;        ///< per-coordinate noise std of each view (signal std is 1)
  /// Seed of data, weights and batches. Chosen (docs/demo.md, "Over seeds and ISAs"): half + learnable collapses
  /// in about half of all seeds, and seed 19 is one where it collapses on the AVX-512, AVX2 and portable kernels alike,
  /// so the default table shows the collapse on any CPU.
  std::uint64_t seed = 19;
  float lr = 2e-3f;       ///< Adam learning rate of the encoders
  double beta2 = 0.999;   ///< Adam beta2 of the encoders (beta1 0.9, eps 1e-8; double: its powers are taken in double)
  float tau_lr = 1.0f;    ///< Adam learning rate of theta = log(1/tau): deliberately aggressive (docs/demo.md)
  float tau_beta2 = 0.9f; ///< Adam beta2 of theta (beta1 0.9, eps 1e-8)
  std::int64_t warmup = 100; ///< linear warm-up of both learning rates over the first steps (as open_clip's --warmup)
  float tau_init = 0.07f;    ///< CLIP's initial temperature
  float tau_min = 0.01f;     ///< clamped: open_clip's bound (logit scale <= 100)
  float tau_max = 1.0f;      ///< clamped and guard: open_clip's upper bound
  float fixed_tau = 0.05f;   ///< fixed, and scheduled before its unfreeze step (freeze-then-learn's warm-up tau)
  std::int64_t unfreeze_step = 600; ///< scheduled: finite steps at fixed_tau before tau becomes learnable
  float guard_headroom = 16.0f;
  float guard_retreat = 0.5f;
  scaler_kind scaler = scaler_kind::paddle;
  std::size_t eval_pairs = 1024; ///< held-out pairs; top-1 retrieval among all of them
  std::int64_t eval_every = 50;
  std::int64_t collapse_window = 50; ///< a run that ends with this many consecutive skipped steps has collapsed
  unsigned threads = 1;              ///< threads of the loss engine; 1 keeps runs bit-reproducible (0: all cores)
  /// --objective sigmoid: SigLIP's pairwise sigmoid loss over z = <a, b> / tau + bias instead of CLIP's symmetric
  /// cross-entropy (the same model, data and policies; tau = 1/t). It also sets tau_init and fixed_tau to SigLIP's
  /// t = 10 (later options override).
  bool sigmoid = false;
  float bias_init = -10.0f; ///< sigmoid: the initial logit bias (SigLIP's and open_clip's -10)
  float bias_lr = 1.0f;     ///< sigmoid: Adam learning rate of the bias (beta2 tau_beta2), as log(1/tau)'s; 0: fixed
};

/// Named settings. "default": the fast reproduction (the values above; its tau optimiser, Adam lr 1.0 and beta2 0.9,
/// is accelerated so that the drift of tau over a long CLIP run fits in 1200 steps). "open_clip": open_clip's
/// optimiser settings (Adam lr 5e-4, beta1 0.9, beta2 0.98 for the encoders, log(1/tau) and the bias alike) over 20000
/// steps, the rest as the default. Returns false for an unknown name (and leaves `s` alone).
bool apply_preset(const std::string& name, settings& s);

/// Checks the settings; returns an empty string or what is wrong.
std::string validate(const settings& s);
} // namespace collapse_demo
