// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
//
// collapse_demo: reproduces the fp16 temperature collapse (docs/collapse.md) in a small CLIP-style training and
// shows each remedy.
// Prints the side-by-side table on stdout, writes one per-step CSV per run into --out, progress on stderr.
// Plot with scripts/plot_demo.gp (see docs/demo.md). The parts live in examples/collapse/: options, data, model,
// training loop, output.

#include "collapse/options.hpp"
#include "collapse/output.hpp"
#include "collapse/train.hpp"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace
{
namespace cd = collapse_demo;

[[noreturn]] void fail(const std::string& msg)
{
  std::fprintf(stderr, "collapse_demo: %s\n(see --help)\n", msg.c_str());
  std::exit(2);
}
} // namespace

int main(int argc, char** argv)
{
  cd::cli_options o;
  std::string why;
  if (!cd::parse_args(argc, argv, o, why))
  {
    fail(why);
  }
  if (o.help)
  {
    std::fputs(cd::help_text().c_str(), stdout);
    return 0;
  }
  const cd::settings& s = o.s;
  if (const std::string bad = cd::validate(s); !bad.empty())
  {
    fail(bad);
  }
  const std::vector<cd::run_config> selected = o.selected_runs();
  if (selected.empty())
  {
    fail("--types/--policies select no run");
  }
  if (o.write_csv && !cd::make_dir(o.out_dir))
  {
    fail("cannot create output directory '" + o.out_dir + "': " + std::strerror(errno));
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
  if (s.sigmoid)
  {
    std::printf("objective sigmoid (SigLIP): logit bias from %g, %s\n\n",
                static_cast<double>(s.bias_init),
                s.bias_lr > 0.0f ? ("learnable, Adam lr " + std::to_string(s.bias_lr)).c_str() : "fixed");
  }
  if (s.beta2 != cd::settings{}.beta2)
  {
    std::printf("encoders' Adam beta2 %g\n\n", s.beta2);
  }
  std::fflush(stdout);

  std::vector<cd::run_result> results;
  int failed = 0;
  for (std::size_t i = 0; i < selected.size(); ++i)
  {
    const cd::run_config& c = selected[i];
    const std::string tag = "[" + std::to_string(i + 1) + "/" + std::to_string(selected.size()) + "] " + c.id();
    cd::progress_fn progress;
    if (!o.quiet)
    {
      progress = [&](std::int64_t step, std::int64_t steps)
      {
        std::fprintf(
            stderr, "\r%s: step %lld/%lld", tag.c_str(), static_cast<long long>(step), static_cast<long long>(steps));
        std::fflush(stderr);
      };
    }
    cd::run_result r = cd::train(s, c, progress);
    if (!o.quiet)
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
    if (o.write_csv)
    {
      const std::string path = o.out_dir + "/" + c.id() + ".csv";
      if (!cd::write_csv(path, r))
      {
        fail("cannot write " + path + ": " + std::strerror(errno));
      }
    }
    results.push_back(std::move(r));
  }
  if (o.write_csv)
  {
    // The table's order, for scripts/plot_demo.gp.
    const std::string path = o.out_dir + "/index.txt";
    if (!cd::write_index(path, results))
    {
      fail("cannot write " + path + ": " + std::strerror(errno));
    }
  }
  std::printf("%s", cd::format_table(results).c_str());
  if (o.write_csv)
  {
    std::printf(
        "\nper-step CSVs in %s/; figure: gnuplot -e \"dir='%s'\" scripts/plot_demo.gp (writes %s/collapse.png)\n",
        o.out_dir.c_str(),
        o.out_dir.c_str(),
        o.out_dir.c_str());
  }
  return failed == 0 ? 0 : 1;
}
