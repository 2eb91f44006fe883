// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// collapse_demo: reproduces the seed's fp16 temperature collapse in a small CLIP-style training and shows each remedy.
// Prints the side-by-side table on stdout, writes one per-step CSV per run into --out, progress on stderr.
// Plot with scripts/plot_demo.gp (see docs/demo.md).

#include "collapse_demo.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <sys/stat.h>
#include <vector>

namespace
{
namespace cd = collapse_demo;

void print_help(std::FILE* f)
{
  const cd::settings d;
  std::fprintf(
      f,
      "usage: collapse_demo [options]\n"
      "\n"
      "Trains a two-tower contrastive model (linear + L2 normalisation per tower) on generated paired views,\n"
      "once per configuration, and prints a table: final loss, held-out top-1 retrieval, final tau, smallest\n"
      "and final loss scale, skipped steps, the step at which the run collapsed and the first non-finite site.\n"
      "\n"
      "Configurations (default: the seven of docs/demo.md):\n"
      "  --runs LIST          comma-separated type:policy[:algorithm], e.g. half:learnable,half:guard:fused\n"
      "                       type: float|half|bfloat16  policy: fixed|learnable|clamped|scheduled|guard\n"
      "                       algorithm: materialized (default) | fused\n"
      "  --types LIST         keep only runs of these element types (e.g. half,bfloat16)\n"
      "  --policies LIST      keep only runs with these policies (e.g. learnable,guard)\n"
      "\n"
      "Training:\n"
      "  --steps N            training steps per run (default %lld)\n"
      "  --batch N            pairs per batch (default %zu)\n"
      "  --dim N              embedding dimension (default %zu)\n"
      "  --input-dim N        dimension of each view (default %zu)\n"
      "  --latent N           shared latent factors (default %zu)\n"
      "  --noise X            per-coordinate noise std of each view (default %g)\n"
      "  --seed N             seed of data, weights and batches (default %llu)\n"
      "  --lr X               Adam learning rate of the encoders (default %g)\n"
      "  --tau-lr X           Adam learning rate of log(1/tau) (default %g)\n"
      "  --tau-beta2 X        Adam beta2 of log(1/tau) (default %g)\n"
      "  --warmup N           linear warm-up of both learning rates, in steps (default %lld)\n"
      "  --tau-init X         initial tau of learnable policies (default %g)\n"
      "  --tau-min X          clamped: smallest tau (default %g, open_clip)\n"
      "  --fixed-tau X        fixed, and scheduled before unfreezing (default %g)\n"
      "  --unfreeze N         scheduled: steps at the fixed tau before learning it (default %lld)\n"
      "  --guard-headroom X   guard: keep 1/tau <= max_finite / X (default %g)\n"
      "  --guard-retreat X    guard: log(1/tau) retreat per overflow event (default %g)\n"
      "  --scaler NAME        16-bit runs: paddle (dygraph, default) | torch | paddle-static | none\n"
      "  --eval-pairs N       held-out pairs for retrieval (default %zu)\n"
      "  --eval-every N       evaluate every N steps (default %lld)\n"
      "  --collapse-window N  a run ending in N consecutive skipped steps has collapsed (default %lld)\n"
      "  --threads N          threads of the loss (default 1, bit-reproducible; 0: all cores)\n"
      "\n"
      "Output:\n"
      "  --out DIR            directory for the per-step CSVs (default out; created if missing)\n"
      "  --no-csv             do not write CSVs\n"
      "  --quiet              no progress on stderr\n"
      "  -h, --help           this text\n",
      static_cast<long long>(d.steps),
      d.batch,
      d.dim,
      d.input_dim,
      d.latent,
      static_cast<double>(d.noise),
      static_cast<unsigned long long>(d.seed),
      static_cast<double>(d.lr),
      static_cast<double>(d.tau_lr),
      static_cast<double>(d.tau_beta2),
      static_cast<long long>(d.warmup),
      static_cast<double>(d.tau_init),
      static_cast<double>(d.tau_min),
      static_cast<double>(d.fixed_tau),
      static_cast<long long>(d.unfreeze_step),
      static_cast<double>(d.guard_headroom),
      static_cast<double>(d.guard_retreat),
      d.eval_pairs,
      static_cast<long long>(d.eval_every),
      static_cast<long long>(d.collapse_window));
}

[[noreturn]] void fail(const std::string& msg)
{
  std::fprintf(stderr, "collapse_demo: %s\n(see --help)\n", msg.c_str());
  std::exit(2);
}

std::vector<std::string> split(const std::string& s)
{
  std::vector<std::string> out;
  std::string cur;
  for (char c : s)
  {
    if (c == ',')
    {
      out.push_back(cur);
      cur.clear();
    }
    else
    {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

long long parse_int(const std::string& opt, const std::string& v, long long lo, long long hi)
{
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0 || x < lo || x > hi)
  {
    fail(opt + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + v + "'");
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
    fail(opt + " expects a finite number, got '" + v + "'");
  }
  return x;
}

bool make_dir(const std::string& dir)
{
  std::string path;
  for (std::size_t i = 0; i <= dir.size(); ++i)
  {
    if (i == dir.size() || dir[i] == '/')
    {
      if (!path.empty() && ::mkdir(path.c_str(), 0777) != 0 && errno != EEXIST)
      {
        return false;
      }
    }
    if (i < dir.size())
    {
      path += dir[i];
    }
  }
  struct stat st;
  return ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
} // namespace

int main(int argc, char** argv)
{
  cd::settings s;
  std::vector<cd::run_config> runs = cd::default_runs();
  std::vector<std::string> types, policies;
  std::string out_dir = "out";
  bool write_csv = true;
  bool quiet = false;

  for (int i = 1; i < argc; ++i)
  {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help")
    {
      print_help(stdout);
      return 0;
    }
    if (a == "--no-csv")
    {
      write_csv = false;
      continue;
    }
    if (a == "--quiet")
    {
      quiet = true;
      continue;
    }
    std::string opt = a, val;
    const std::size_t eq = a.find('=');
    if (a.rfind("--", 0) == 0 && eq != std::string::npos)
    {
      opt = a.substr(0, eq);
      val = a.substr(eq + 1);
    }
    else if (a.rfind("--", 0) == 0)
    {
      static const char* const with_value[] = {"--steps",           "--batch",     "--dim",        "--input-dim",
                                               "--latent",          "--noise",     "--seed",       "--lr",
                                               "--tau-lr",          "--tau-beta2", "--warmup",     "--tau-init",
                                               "--tau-min",         "--fixed-tau", "--unfreeze",   "--guard-headroom",
                                               "--guard-retreat",   "--scaler",    "--eval-pairs", "--eval-every",
                                               "--collapse-window", "--threads",   "--out",        "--runs",
                                               "--types",           "--policies"};
      if (std::find(std::begin(with_value), std::end(with_value), a) == std::end(with_value))
      {
        fail("unknown option '" + a + "'");
      }
      if (i + 1 >= argc)
      {
        fail("option " + a + " needs a value");
      }
      val = argv[++i];
    }
    else
    {
      fail("unexpected argument '" + a + "'");
    }
    const long long big = 1LL << 40;
    if (opt == "--steps")
    {
      s.steps = parse_int(opt, val, 1, big);
    }
    else if (opt == "--batch")
    {
      s.batch = static_cast<std::size_t>(parse_int(opt, val, 2, 1 << 16));
    }
    else if (opt == "--dim")
    {
      s.dim = static_cast<std::size_t>(parse_int(opt, val, 1, 1 << 14));
    }
    else if (opt == "--input-dim")
    {
      s.input_dim = static_cast<std::size_t>(parse_int(opt, val, 1, 1 << 14));
    }
    else if (opt == "--latent")
    {
      s.latent = static_cast<std::size_t>(parse_int(opt, val, 1, 1 << 14));
    }
    else if (opt == "--noise")
    {
      s.noise = parse_float(opt, val);
    }
    else if (opt == "--seed")
    {
      s.seed = static_cast<std::uint64_t>(parse_int(opt, val, 0, std::numeric_limits<long long>::max()));
    }
    else if (opt == "--lr")
    {
      s.lr = parse_float(opt, val);
    }
    else if (opt == "--tau-lr")
    {
      s.tau_lr = parse_float(opt, val);
    }
    else if (opt == "--tau-beta2")
    {
      s.tau_beta2 = parse_float(opt, val);
    }
    else if (opt == "--warmup")
    {
      s.warmup = parse_int(opt, val, 0, big);
    }
    else if (opt == "--tau-init")
    {
      s.tau_init = parse_float(opt, val);
    }
    else if (opt == "--tau-min")
    {
      s.tau_min = parse_float(opt, val);
    }
    else if (opt == "--fixed-tau")
    {
      s.fixed_tau = parse_float(opt, val);
    }
    else if (opt == "--unfreeze")
    {
      s.unfreeze_step = parse_int(opt, val, 0, big);
    }
    else if (opt == "--guard-headroom")
    {
      s.guard_headroom = parse_float(opt, val);
    }
    else if (opt == "--guard-retreat")
    {
      s.guard_retreat = parse_float(opt, val);
    }
    else if (opt == "--scaler")
    {
      if (!cd::parse_scaler(val, s.scaler))
      {
        fail("unknown --scaler '" + val + "' (paddle, torch, paddle-static, none)");
      }
    }
    else if (opt == "--eval-pairs")
    {
      s.eval_pairs = static_cast<std::size_t>(parse_int(opt, val, 2, 1 << 16));
    }
    else if (opt == "--eval-every")
    {
      s.eval_every = parse_int(opt, val, 1, big);
    }
    else if (opt == "--collapse-window")
    {
      s.collapse_window = parse_int(opt, val, 1, big);
    }
    else if (opt == "--threads")
    {
      s.threads = static_cast<unsigned>(parse_int(opt, val, 0, 1024));
    }
    else if (opt == "--out")
    {
      if (val.empty())
      {
        fail("--out needs a directory");
      }
      out_dir = val;
    }
    else if (opt == "--runs")
    {
      runs.clear();
      for (const std::string& r : split(val))
      {
        cd::run_config c;
        std::string why;
        if (!cd::parse_run(r, c, why))
        {
          fail("--runs: " + why);
        }
        runs.push_back(c);
      }
    }
    else if (opt == "--types")
    {
      for (const std::string& t : split(val))
      {
        cd::element_kind e;
        if (!cd::parse_element(t, e))
        {
          fail("--types: unknown element type '" + t + "' (float, half, bfloat16)");
        }
        types.push_back(cd::to_string(e));
      }
    }
    else if (opt == "--policies")
    {
      for (const std::string& t : split(val))
      {
        cd::policy_kind p;
        if (!cd::parse_policy(t, p))
        {
          fail("--policies: unknown policy '" + t + "' (fixed, learnable, clamped, scheduled, guard)");
        }
        policies.push_back(cd::to_string(p));
      }
    }
    else
    {
      fail("unknown option '" + opt + "'");
    }
  }
  if (const std::string why = cd::validate(s); !why.empty())
  {
    fail(why);
  }
  std::vector<cd::run_config> selected;
  for (const cd::run_config& r : runs)
  {
    const bool type_ok =
        types.empty() || std::find(types.begin(), types.end(), cd::to_string(r.element)) != types.end();
    const bool policy_ok =
        policies.empty() || std::find(policies.begin(), policies.end(), cd::to_string(r.policy)) != policies.end();
    if (type_ok && policy_ok)
    {
      selected.push_back(r);
    }
  }
  if (selected.empty())
  {
    fail("--types/--policies select no run");
  }
  if (write_csv && !make_dir(out_dir))
  {
    fail("cannot create output directory '" + out_dir + "': " + std::strerror(errno));
  }

  std::printf("collapse_demo: %lld steps, batch %zu, dim %zu, input %zu, latent %zu, noise %g, lr %g, tau-lr %g, "
              "tau-beta2 %g, seed %llu, scaler %s (16-bit runs), held-out pairs %zu\n\n",
              static_cast<long long>(s.steps),
              s.batch,
              s.dim,
              s.input_dim,
              s.latent,
              static_cast<double>(s.noise),
              static_cast<double>(s.lr),
              static_cast<double>(s.tau_lr),
              static_cast<double>(s.tau_beta2),
              static_cast<unsigned long long>(s.seed),
              cd::to_string(s.scaler),
              s.eval_pairs);
  std::fflush(stdout);

  std::vector<cd::run_result> results;
  int failed = 0;
  for (std::size_t i = 0; i < selected.size(); ++i)
  {
    const cd::run_config& c = selected[i];
    const std::string tag = "[" + std::to_string(i + 1) + "/" + std::to_string(selected.size()) + "] " + c.id();
    cd::progress_fn progress;
    if (!quiet)
    {
      progress = [&](std::int64_t step, std::int64_t steps)
      {
        std::fprintf(
            stderr, "\r%s: step %lld/%lld", tag.c_str(), static_cast<long long>(step), static_cast<long long>(steps));
        std::fflush(stderr);
      };
    }
    cd::run_result r = cd::train(s, c, progress);
    if (!quiet)
    {
      std::fprintf(stderr,
                   "\r%s: %.1f s, top-1 %.1f%%, %s\n",
                   tag.c_str(),
                   r.seconds,
                   100.0 * r.final_accuracy,
                   r.collapsed() ? ("collapsed at step " + std::to_string(r.collapse_step)).c_str() : "healthy");
    }
    if (!r.error.empty())
    {
      ++failed;
    }
    if (write_csv)
    {
      const std::string path = out_dir + "/" + c.id() + ".csv";
      if (!cd::write_csv(path, r))
      {
        fail("cannot write " + path + ": " + std::strerror(errno));
      }
    }
    results.push_back(std::move(r));
  }
  if (write_csv)
  {
    // The table's order, for scripts/plot_demo.gp.
    const std::string path = out_dir + "/index.txt";
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr)
    {
      fail("cannot write " + path + ": " + std::strerror(errno));
    }
    for (const cd::run_result& r : results)
    {
      std::fprintf(f, "%s\n", r.config.id().c_str());
    }
    std::fclose(f);
  }
  std::printf("%s", cd::format_table(results).c_str());
  if (write_csv)
  {
    std::printf(
        "\nper-step CSVs in %s/; figure: gnuplot -e \"dir='%s'\" scripts/plot_demo.gp (writes docs/collapse.png)\n",
        out_dir.c_str(),
        out_dir.c_str());
  }
  return failed == 0 ? 0 : 1;
}
