// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0

#include "collapse/options.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <stdexcept>

namespace collapse_demo
{
namespace
{
[[noreturn]] void reject(const std::string& why)
{
  throw std::invalid_argument(why);
}

std::vector<std::string> split(const std::string& s)
{
  std::vector<std::string> out(1);
  for (char c : s)
  {
    if (c == ',')
    {
      out.emplace_back();
    }
    else
    {
      out.back() += c;
    }
  }
  return out;
}

long long parse_int(const std::string& opt, const std::string& v, long long lo, long long hi)
{
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0 || x < lo || x > hi)
  {
    reject(opt + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + v + "'");
  }
  return x;
}

float parse_float(const std::string& opt, const std::string& v)
{
  errno = 0;
  char* end = nullptr;
  const float x = std::strtof(v.c_str(), &end);
  if (v.empty() || *end != '\0' || errno != 0 || !std::isfinite(x))
  {
    reject(opt + " expects a finite number, got '" + v + "'");
  }
  return x;
}

/// A default as --help prints it: %g for numbers, as is for integers.
std::string g(float x)
{
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(x));
  return buf;
}
std::string g(long long x)
{
  return std::to_string(x);
}
std::string g(std::size_t x)
{
  return std::to_string(x);
}

constexpr long long big = 1LL << 40;

// Row builders: the option's name is the first argument and nowhere else.
template <class F>
option row(const char* name, const char* value, std::string help, F set)
{
  return option{name, value, std::move(help), set};
}
option heading(const char* text)
{
  return option{"", "", text, nullptr};
}
option int_row(const char* name, std::string help, long long lo, long long hi, std::int64_t settings::*field)
{
  return row(name,
             "N",
             std::move(help),
             [=](cli_options& o, const std::string& v)
             {
               o.s.*field = parse_int(name, v, lo, hi);
             });
}
option size_row(const char* name, std::string help, long long lo, long long hi, std::size_t settings::*field)
{
  return row(name,
             "N",
             std::move(help),
             [=](cli_options& o, const std::string& v)
             {
               o.s.*field = static_cast<std::size_t>(parse_int(name, v, lo, hi));
             });
}
option float_row(const char* name, std::string help, float settings::*field)
{
  return row(name,
             "X",
             std::move(help),
             [=](cli_options& o, const std::string& v)
             {
               o.s.*field = parse_float(name, v);
             });
}

std::vector<option> make_table()
{
  const settings d;
  const auto dflt = [](const std::string& x)
  {
    return " (default " + x + ")";
  };
  return {
      heading("Configurations (default: the seven of docs/demo.md):"),
      row("--runs",
          "LIST",
          "comma-separated type:policy[:algorithm], e.g. half:learnable,half:guard:fused\n"
          "type: float|half|bfloat16  policy: fixed|learnable|clamped|scheduled|guard\n"
          "algorithm: materialized (default) | fused",
          [](cli_options& o, const std::string& v)
          {
            o.runs.clear();
            for (const std::string& r : split(v))
            {
              run_config c;
              std::string why;
              if (!parse_run(r, c, why))
              {
                reject("--runs: " + why);
              }
              o.runs.push_back(c);
            }
          }),
      row("--types",
          "LIST",
          "keep only runs of these element types (e.g. half,bfloat16)",
          [](cli_options& o, const std::string& v)
          {
            for (const std::string& t : split(v))
            {
              element_kind e;
              if (!parse_element(t, e))
              {
                reject("--types: unknown element type '" + t + "' (float, half, bfloat16)");
              }
              o.types.push_back(to_string(e));
            }
          }),
      row("--policies",
          "LIST",
          "keep only runs with these policies (e.g. learnable,guard)",
          [](cli_options& o, const std::string& v)
          {
            for (const std::string& t : split(v))
            {
              policy_kind p;
              if (!parse_policy(t, p))
              {
                reject("--policies: unknown policy '" + t + "' (fixed, learnable, clamped, scheduled, guard)");
              }
              o.policies.push_back(to_string(p));
            }
          }),
      heading(""),
      heading("Training:"),
      row("--preset",
          "NAME",
          "default: the fast reproduction below (its tau optimiser is accelerated)\n"
          "open_clip: open_clip's Adam (lr 5e-4, beta2 0.98, encoders, tau and bias alike),\n"
          "20000 steps, evaluation every 500; later options override a preset",
          [](cli_options& o, const std::string& v)
          {
            if (!apply_preset(v, o.s))
            {
              reject("unknown --preset '" + v + "' (default, open_clip)");
            }
          }),
      int_row("--steps", "training steps per run" + dflt(g(static_cast<long long>(d.steps))), 1, big, &settings::steps),
      size_row("--batch", "pairs per batch" + dflt(g(d.batch)), 2, 1 << 16, &settings::batch),
      size_row("--dim", "embedding dimension" + dflt(g(d.dim)), 1, 1 << 14, &settings::dim),
      size_row("--input-dim", "dimension of each view" + dflt(g(d.input_dim)), 1, 1 << 14, &settings::input_dim),
      size_row("--latent", "shared latent factors" + dflt(g(d.latent)), 1, 1 << 14, &settings::latent),
      float_row("--noise", "per-coordinate noise std of each view" + dflt(g(d.noise)), &settings::noise),
      row("--seed",
          "N",
          "seed of data, weights and batches" + dflt(std::to_string(d.seed)),
          [](cli_options& o, const std::string& v)
          {
            o.s.seed = static_cast<std::uint64_t>(parse_int("--seed", v, 0, std::numeric_limits<long long>::max()));
          }),
      float_row("--lr", "Adam learning rate of the encoders" + dflt(g(d.lr)), &settings::lr),
      row("--beta2",
          "X",
          "Adam beta2 of the encoders" + dflt(g(static_cast<float>(d.beta2))),
          [](cli_options& o, const std::string& v)
          {
            parse_float("--beta2", v); // checks the text
            o.s.beta2 = std::strtod(v.c_str(), nullptr);
          }),
      float_row("--tau-lr",
                "Adam learning rate of log(1/tau)" + dflt(g(d.tau_lr) + ", accelerated: see above"),
                &settings::tau_lr),
      float_row("--tau-beta2",
                "Adam beta2 of log(1/tau)" + dflt(g(d.tau_beta2) + ", accelerated: see above"),
                &settings::tau_beta2),
      int_row("--warmup",
              "linear warm-up of both learning rates, in steps" + dflt(g(static_cast<long long>(d.warmup))),
              0,
              big,
              &settings::warmup),
      row("--objective",
          "NAME",
          "symmetric (CLIP's loss, default) | sigmoid (SigLIP's: z = <a, b> / tau + bias;\n"
          "sets --tau-init and --fixed-tau to SigLIP's t = 1/tau = 10; later options override)",
          [](cli_options& o, const std::string& v)
          {
            if (v == "symmetric")
            {
              o.s.sigmoid = false;
            }
            else if (v == "sigmoid")
            {
              o.s.sigmoid = true;
              o.s.tau_init = 0.1f;
              o.s.fixed_tau = 0.1f;
            }
            else
            {
              reject("unknown --objective '" + v + "' (symmetric, sigmoid)");
            }
          }),
      float_row("--bias-init", "sigmoid: initial logit bias" + dflt(g(d.bias_init)), &settings::bias_init),
      float_row("--bias-lr",
                "sigmoid: Adam learning rate of the bias, 0: fixed" + dflt(g(d.bias_lr) + ", as log(1/tau)'s"),
                &settings::bias_lr),
      float_row("--tau-init", "initial tau of learnable policies" + dflt(g(d.tau_init)), &settings::tau_init),
      float_row("--tau-min", "clamped: smallest tau (default " + g(d.tau_min) + ", open_clip)", &settings::tau_min),
      float_row("--fixed-tau", "fixed, and scheduled before unfreezing" + dflt(g(d.fixed_tau)), &settings::fixed_tau),
      int_row("--unfreeze",
              "scheduled: steps at the fixed tau before learning it" + dflt(g(static_cast<long long>(d.unfreeze_step))),
              0,
              big,
              &settings::unfreeze_step),
      float_row("--guard-headroom",
                "guard: keep 1/tau <= max_finite / X" + dflt(g(d.guard_headroom)),
                &settings::guard_headroom),
      float_row("--guard-retreat",
                "guard: log(1/tau) retreat per overflow event" + dflt(g(d.guard_retreat)),
                &settings::guard_retreat),
      row("--scaler",
          "NAME",
          "16-bit runs: paddle (dygraph, default) | torch | paddle-static | none",
          [](cli_options& o, const std::string& v)
          {
            if (!parse_scaler(v, o.s.scaler))
            {
              reject("unknown --scaler '" + v + "' (paddle, torch, paddle-static, none)");
            }
          }),
      size_row(
          "--eval-pairs", "held-out pairs for retrieval" + dflt(g(d.eval_pairs)), 2, 1 << 16, &settings::eval_pairs),
      int_row("--eval-every",
              "evaluate every N steps" + dflt(g(static_cast<long long>(d.eval_every))),
              1,
              big,
              &settings::eval_every),
      int_row("--collapse-window",
              "a run ending in N consecutive skipped steps has collapsed" +
                  dflt(g(static_cast<long long>(d.collapse_window))),
              1,
              big,
              &settings::collapse_window),
      row("--threads",
          "N",
          "threads of the loss (default 1, bit-reproducible; 0: all cores)",
          [](cli_options& o, const std::string& v)
          {
            o.s.threads = static_cast<unsigned>(parse_int("--threads", v, 0, 1024));
          }),
      heading(""),
      heading("Output:"),
      row("--out",
          "DIR",
          "directory for the per-step CSVs (default out; created if missing)",
          [](cli_options& o, const std::string& v)
          {
            if (v.empty())
            {
              reject("--out needs a directory");
            }
            o.out_dir = v;
          }),
      row("--no-csv",
          "",
          "do not write CSVs",
          [](cli_options& o, const std::string&)
          {
            o.write_csv = false;
          }),
      row("--quiet",
          "",
          "no progress on stderr",
          [](cli_options& o, const std::string&)
          {
            o.quiet = true;
          }),
      row("--help",
          "",
          "this text",
          [](cli_options& o, const std::string&)
          {
            o.help = true;
          }),
  };
}

const option* find(const std::string& name)
{
  for (const option& o : option_table())
  {
    if (!o.name.empty() && (o.name == name || (o.name == "--help" && name == "-h")))
    {
      return &o;
    }
  }
  return nullptr;
}
} // namespace

std::vector<run_config> cli_options::selected_runs() const
{
  std::vector<run_config> out;
  for (const run_config& r : runs)
  {
    const bool type_ok = types.empty() || std::find(types.begin(), types.end(), to_string(r.element)) != types.end();
    const bool policy_ok =
        policies.empty() || std::find(policies.begin(), policies.end(), to_string(r.policy)) != policies.end();
    if (type_ok && policy_ok)
    {
      out.push_back(r);
    }
  }
  return out;
}

const std::vector<option>& option_table()
{
  static const std::vector<option> table = make_table();
  return table;
}

std::string help_text()
{
  std::string out = "usage: collapse_demo [options]\n"
                    "\n"
                    "Trains a two-tower contrastive model (linear + L2 normalisation per tower) on generated paired "
                    "views,\n"
                    "once per configuration, and prints a table: final loss, held-out top-1 retrieval, final tau, "
                    "smallest\n"
                    "and final loss scale, skipped steps, the step at which the run collapsed and the first non-finite "
                    "site.\n"
                    "\n"
                    "The default is a fast reproduction (1200 steps, seconds): its optimiser of log(1/tau) is "
                    "accelerated,\n"
                    "Adam lr 1.0 and beta2 0.9 against the encoders' lr 2e-3 and beta2 0.999, so that the drift of tau "
                    "over\n"
                    "a long CLIP run fits in a short one. --preset open_clip trains with open_clip's settings instead "
                    "(Adam\n"
                    "lr 5e-4, beta2 0.98, the same for the encoders and tau) for 20000 steps. docs/demo.md has both "
                    "results.\n"
                    "\n";
  for (const option& o : option_table())
  {
    if (o.name.empty())
    {
      out += o.help + "\n";
      continue;
    }
    std::string label = o.name == "--help" ? "-h, --help" : o.name;
    if (!o.value.empty())
    {
      label += " " + o.value;
    }
    char col[64];
    std::snprintf(col, sizeof col, "  %-20s ", label.c_str());
    out += col;
    for (char c : o.help)
    {
      out += c;
      if (c == '\n')
      {
        out += std::string(23, ' ');
      }
    }
    out += "\n";
  }
  return out;
}

bool parse_args(int argc, const char* const* argv, cli_options& out, std::string& why)
{
  try
  {
    for (int i = 1; i < argc; ++i)
    {
      const std::string a = argv[i];
      if (a.rfind("--", 0) != 0 && a != "-h")
      {
        reject("unexpected argument '" + a + "'");
      }
      const std::size_t eq = a.find('=');
      const std::string name = eq == std::string::npos ? a : a.substr(0, eq);
      const option* o = find(name);
      if (o == nullptr)
      {
        reject("unknown option '" + name + "'");
      }
      std::string value;
      if (o->value.empty())
      {
        if (eq != std::string::npos)
        {
          reject("option " + name + " takes no value");
        }
      }
      else if (eq != std::string::npos)
      {
        value = a.substr(eq + 1);
      }
      else if (i + 1 >= argc)
      {
        reject("option " + a + " needs a value");
      }
      else
      {
        value = argv[++i];
      }
      o->set(out, value);
      if (out.help)
      {
        return true;
      }
    }
  }
  catch (const std::invalid_argument& e)
  {
    why = e.what();
    return false;
  }
  return true;
}
} // namespace collapse_demo
