// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0

#include "collapse/output.hpp"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <sys/stat.h>

namespace collapse_demo
{
namespace cl = contrastive;

std::string format_number(float x, const char* fmt)
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

std::string format_table(const std::vector<run_result>& results)
{
  std::ostringstream os;
  char line[512];
  bool sigmoid = false; // SigLIP runs add the logit bias after tau
  for (const run_result& r : results)
  {
    sigmoid |= r.sigmoid;
  }
  std::snprintf(line,
                sizeof line,
                "%-9s %-10s %-12s %10s %7s %10s%s %10s %10s %8s %10s  %s\n",
                "type",
                "policy",
                "algorithm",
                "loss",
                "top-1",
                "tau",
                sigmoid ? "       bias lost grad" : "",
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
    char bias[48] = "";
    if (sigmoid)
    {
      std::snprintf(bias,
                    sizeof bias,
                    " %10s %9s",
                    format_number(r.final_bias, "%.3g").c_str(),
                    std::isnan(r.lost_gradient) ? "-" : format_number(100.0f * r.lost_gradient, "%.2g%%").c_str());
    }
    std::snprintf(line,
                  sizeof line,
                  "%-9s %-10s %-12s %10s %6.1f%% %10s%s %10s %10s %8lld %10s  %s\n",
                  to_string(r.config.element),
                  to_string(r.config.policy),
                  to_string(r.config.algorithm),
                  format_number(r.final_loss, "%.4g").c_str(),
                  100.0 * r.final_accuracy,
                  format_number(r.final_tau, "%.3g").c_str(),
                  bias,
                  format_number(r.min_loss_scale, "%.3g").c_str(),
                  format_number(r.final_loss_scale, "%.3g").c_str(),
                  static_cast<long long>(r.skipped),
                  collapsed.c_str(),
                  diag.c_str());
    os << line;
  }
  return os.str();
}

bool write_csv(const std::string& path, const run_result& r)
{
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr)
  {
    return false;
  }
  // SigLIP runs append the logit bias as a last column (the softmax runs' files are unchanged).
  std::fprintf(f, "step,loss,tau,loss_scale,skipped,accuracy,max_logit,first_nonfinite%s\n", r.sigmoid ? ",bias" : "");
  for (const step_row& row : r.rows)
  {
    const std::string acc = std::isnan(row.accuracy) ? "" : format_number(row.accuracy, "%.4f");
    const std::string bias = r.sigmoid ? "," + format_number(row.bias, "%.6g") : std::string();
    std::fprintf(f,
                 "%lld,%s,%s,%s,%d,%s,%s,%s%s\n",
                 static_cast<long long>(row.step),
                 format_number(row.loss, "%.6g").c_str(),
                 format_number(row.tau, "%.6g").c_str(),
                 format_number(row.loss_scale, "%.6g").c_str(),
                 row.skipped ? 1 : 0,
                 acc.c_str(),
                 format_number(row.max_logit, "%.6g").c_str(),
                 cl::to_string(row.site),
                 bias.c_str());
  }
  return std::fclose(f) == 0;
}

bool write_index(const std::string& path, const std::vector<run_result>& results)
{
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr)
  {
    return false;
  }
  for (const run_result& r : results)
  {
    std::fprintf(f, "%s\n", r.config.id().c_str());
  }
  return std::fclose(f) == 0;
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
} // namespace collapse_demo
