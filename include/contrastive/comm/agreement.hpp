// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// How the ranks of a distributed loss agree before any feature moves (host and device losses share this).
///
/// Every entry point that communicates (`forward_backward`, `forward`, `backward`, `finish_step`) starts with the same
/// collective: an all-gather of one fixed-size `call_msg` per rank, carrying which call the rank is in, the loss's step
/// count, the caller's iteration (if given), the rank's shape and the outcome of its own checks. Ranks that are in
/// different calls, or at different steps, therefore meet in that first all-gather whatever they called, see it on
/// every rank, and all refuse (errc::invalid_argument, "step", naming the ranks and their steps) before anything else
/// moves: an out-of-step rank is reported at the first wrong call instead of the ranks combining different steps'
/// results. Then every rank derives the same global facts (totals, offsets, counts, the first inconsistent rank), and
/// one more all-gather of error codes decides whether the step goes on; if not, the first failing rank broadcasts its
/// status and every rank returns it, naming that rank.
/// `Comm` needs `rank()`, `size()`, and host-memory `allgather(mine, bytes, all)` and `broadcast(buf, bytes, root)`.

#include <contrastive/comm/communicator.hpp>
#include <contrastive/detail/checked.hpp>
#include <contrastive/objectives/objectives.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace contrastive
{
namespace distributed
{
namespace agreement
{
/// The entry points that communicate; each starts with the all-gather of a `call_msg`.
enum class call_kind : std::int64_t
{
  forward_backward = 1,
  finish_step = 2,
  backward = 3,
  forward = 4,
};

/// What each rank says at the start of a call (one fixed size for every call, so ranks in different calls still meet
/// in the same all-gather).
struct call_msg
{
  std::int64_t kind;                       ///< call_kind
  std::int64_t step;                       ///< the loss's step count (finished steps)
  std::int64_t iteration;                  ///< the caller's iteration, or no_iteration
  std::int64_t n_q, n_k, dim;              ///< forward_backward: this rank's problem
  std::int64_t objective_code, has_labels; ///< its objective; labels 1, group ids 2, neither 0
  std::int64_t has_scalars;                ///< forward_backward: whether the next two are known (host)
  std::int64_t scale_bits, bias_bits;      ///< the logit scale s and bias b (float bit patterns)
  std::int64_t pending, site;              ///< finish_step: the record's state
  std::int64_t code;                       ///< the outcome of this rank's own checks (errc)
};

inline const char* call_name(std::int64_t kind) noexcept
{
  return kind == static_cast<std::int64_t>(call_kind::forward_backward) ? "forward_backward"
         : kind == static_cast<std::int64_t>(call_kind::finish_step)    ? "finish_step"
         : kind == static_cast<std::int64_t>(call_kind::backward)       ? "backward"
         : kind == static_cast<std::int64_t>(call_kind::forward)        ? "forward"
                                                                        : "an unknown call";
}

/// Ranks in different calls or at different steps (or with different iterations): the refusal every rank returns,
/// built from the gathered messages alone (identical on every rank); success when all agree.
inline status check_in_step(const std::vector<call_msg>& all)
{
  const call_msg& first = all[0];
  std::vector<std::size_t> odd;
  bool mixed_iteration = false;
  for (std::size_t r = 1; r < all.size(); ++r)
  {
    mixed_iteration |= (all[r].iteration == no_iteration) != (first.iteration == no_iteration);
    if (all[r].kind != first.kind || all[r].step != first.step || all[r].iteration != first.iteration)
    {
      odd.push_back(r);
    }
  }
  if (odd.empty())
  {
    return {};
  }
  const auto where = [&](std::size_t r)
  {
    const call_msg& m = all[r];
    std::string w = "rank " + std::to_string(r) + " at step " + std::to_string(m.step);
    if (m.iteration != no_iteration)
    {
      w += " (iteration " + std::to_string(m.iteration) + ")";
    }
    else if (mixed_iteration)
    {
      w += " (no iteration)";
    }
    return w + " in " + call_name(m.kind);
  };
  constexpr std::size_t shown_at_most = 8;
  const std::size_t shown = std::min(odd.size(), shown_at_most);
  std::string m = "ranks out of step: " + where(0);
  for (std::size_t i = 0; i < shown; ++i)
  {
    m += ", " + where(odd[i]);
  }
  if (odd.size() > shown)
  {
    m += ", and " + std::to_string(odd.size() - shown) + " more ranks not where rank 0 is";
  }
  else if (odd.size() + 1 < all.size())
  {
    m += " (the other ranks where rank 0 is)";
  }
  m += "; every rank must make the same calls in the same order (a call refused or skipped on one rank must be "
       "refused or skipped on all), and give the same iteration";
  return {errc::invalid_argument, "step", m};
}

/// A failing rank's status, broadcast to every rank.
struct status_msg
{
  std::int32_t code;
  char argument[60];
  char message[448];
};

/// A float carried as its bit pattern (call_msg), as text with every digit that tells floats apart.
inline std::string float_text(std::int64_t bits)
{
  const auto u = static_cast<std::uint32_t>(bits);
  float v;
  std::memcpy(&v, &u, sizeof v);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(v));
  return buf;
}
/// A float as call_msg carries it.
inline std::int64_t float_bits(float v) noexcept
{
  std::uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return static_cast<std::int64_t>(u);
}

/// What every rank derives identically from all ranks' shapes.
struct global_shape
{
  std::size_t n_q_total = 0, n_k_total = 0, q_off = 0, k_off = 0;
  std::vector<int> q_rows, k_rows, dk_counts; ///< per rank: query rows, key rows, key rows x dim
  int bad_rank = -1;                          ///< first rank whose shape disagrees (-1: none)
  status why;                                 ///< its error
  bool any_failed = false;                    ///< some rank failed its own checks or bad_rank >= 0
};

/// The global facts and consistency checks (identical on every rank).
inline global_shape derive_global(const std::vector<call_msg>& all, int me)
{
  global_shape g;
  const std::size_t ranks = all.size();
  detail::checked_size nq(0), nk(0);
  g.q_rows.assign(ranks, 0);
  g.k_rows.assign(ranks, 0);
  g.dk_counts.assign(ranks, 0);
  for (std::size_t r = 0; r < ranks; ++r)
  {
    const call_msg& s = all[r];
    if (r == static_cast<std::size_t>(me))
    {
      g.q_off = nq.value;
      g.k_off = nk.value;
    }
    nq = nq + detail::checked_size(static_cast<std::size_t>(s.n_q));
    nk = nk + detail::checked_size(static_cast<std::size_t>(s.n_k));
    g.any_failed |= s.code != 0;
    if (g.bad_rank >= 0 || s.code != 0)
    {
      continue;
    }
    const int rr = static_cast<int>(r);
    if (s.dim != all[0].dim)
    {
      g.bad_rank = rr;
      (void)(g.why = status{errc::shape_mismatch,
                            "dim",
                            "dim = " + std::to_string(s.dim) + " where rank 0 has " + std::to_string(all[0].dim)});
    }
    else if (s.objective_code != all[0].objective_code)
    {
      g.bad_rank = rr;
      (void)(g.why = status{errc::invalid_argument,
                            objectives::field,
                            std::string("objective ") + to_string(static_cast<objective>(s.objective_code)) +
                                " where rank 0 has " + to_string(static_cast<objective>(all[0].objective_code))});
    }
    else if (s.has_labels != all[0].has_labels)
    {
      // Named by what this rank or rank 0 passed: group ids where either passed them, else labels.
      const auto kind = [](std::int64_t v) -> std::string
      {
        return v == 1 ? "labels" : (v == 2 ? "group ids" : "neither labels nor group ids");
      };
      g.bad_rank = rr;
      (void)(g.why = status{errc::invalid_argument,
                            s.has_labels == 2 || all[0].has_labels == 2 ? "query_groups" : "labels",
                            kind(s.has_labels) + " where rank 0 passed " + kind(all[0].has_labels) +
                                "; every rank passes the same kind of positives"});
    }
    else if (s.has_scalars != 0 && all[0].has_scalars != 0 && s.scale_bits != all[0].scale_bits)
    {
      g.bad_rank = rr;
      (void)(g.why = status{errc::invalid_argument,
                            "logit_scale",
                            "logit scale s = " + float_text(s.scale_bits) + " (1/tau) where rank 0 has " +
                                float_text(all[0].scale_bits) +
                                ": every rank's step must use the same temperature (a rank restored from another "
                                "checkpoint, or policies not in lockstep)"});
    }
    else if (s.has_scalars != 0 && all[0].has_scalars != 0 && s.bias_bits != all[0].bias_bits)
    {
      g.bad_rank = rr;
      (void)(g.why = status{errc::invalid_argument,
                            "logit_bias",
                            "logit bias b = " + float_text(s.bias_bits) + " where rank 0 has " +
                                float_text(all[0].bias_bits) + ": every rank's step must use the same bias"});
    }
    else if (s.n_q > INT_MAX || s.n_k > INT_MAX ||
             (detail::checked_size(static_cast<std::size_t>(s.n_k)) * static_cast<std::size_t>(s.dim)).value >
                 static_cast<std::size_t>(INT_MAX))
    {
      g.bad_rank = rr;
      (void)(g.why = status{errc::size_overflow,
                            "n_k",
                            "n_k x dim = " + std::to_string(s.n_k) + " x " + std::to_string(s.dim) +
                                " exceeds the int counts of the collectives on one rank"});
    }
    else
    {
      g.q_rows[r] = static_cast<int>(s.n_q);
      g.k_rows[r] = static_cast<int>(s.n_k);
      g.dk_counts[r] = static_cast<int>(s.n_k * s.dim);
    }
  }
  if (g.bad_rank < 0 && !g.any_failed)
  {
    if (!nq.ok() || !nk.ok() || nq.value > static_cast<std::size_t>(INT_MAX) ||
        nk.value > static_cast<std::size_t>(INT_MAX))
    {
      g.bad_rank = 0;
      (void)(g.why = status{errc::size_overflow,
                            "n_k",
                            "the global batch exceeds 2^31 - 1 queries or keys (int32 labels and counts)"});
    }
    else if (all[0].has_labels != 2) // the objective's shape rule over the global batch (group ids have none)
    {
      const status shape =
          objectives::visit(static_cast<objective>(all[0].objective_code),
                            [&](auto o)
                            {
                              return decltype(o)::check_shape(nq.value, nk.value, all[0].has_labels == 1);
                            });
      if (!shape.ok())
      {
        g.bad_rank = 0;
        (void)(g.why = status{shape.code(), "n_k", "over all ranks: " + shape.reason()});
      }
    }
  }
  g.any_failed |= g.bad_rank >= 0;
  g.n_q_total = nq.value;
  g.n_k_total = nk.value;
  return g;
}

/// One all-gather of error codes; if any rank failed, the first failing rank's status (broadcast) on every rank.
template <class Comm>
status agree(const Comm& comm, const status& local)
{
  const std::int32_t mine = static_cast<std::int32_t>(local.code());
  std::vector<std::int32_t> codes(static_cast<std::size_t>(comm.size()));
  CONTRASTIVE_RETURN_IF_ERROR(comm.allgather(&mine, sizeof mine, codes.data()));
  for (int r = 0; r < comm.size(); ++r)
  {
    if (codes[static_cast<std::size_t>(r)] == 0)
    {
      continue;
    }
    status_msg m;
    std::memset(&m, 0, sizeof m);
    if (comm.rank() == r)
    {
      m.code = static_cast<std::int32_t>(local.code());
      std::strncpy(m.argument, local.argument().c_str(), sizeof m.argument - 1);
      std::strncpy(m.message, local.reason().c_str(), sizeof m.message - 1);
    }
    CONTRASTIVE_RETURN_IF_ERROR(comm.broadcast(&m, sizeof m, r));
    return {static_cast<errc>(m.code), m.argument, "rank " + std::to_string(r) + ": " + std::string(m.message)};
  }
  return {};
}

/// This rank's message at the start of a call (`code`: its own checks' outcome).
inline call_msg make_call(call_kind kind, std::int64_t step, std::int64_t iteration, const status& local) noexcept
{
  call_msg m;
  std::memset(&m, 0, sizeof m);
  m.kind = static_cast<std::int64_t>(kind);
  m.step = step;
  m.iteration = iteration;
  m.code = static_cast<std::int64_t>(local.code());
  return m;
}

/// The caller's iteration: a number >= 0, or no_iteration.
inline status check_iteration(std::int64_t iteration)
{
  if (iteration < 0 && iteration != no_iteration)
  {
    return {errc::invalid_argument,
            "iteration",
            "iteration = " + std::to_string(iteration) + "; give a number >= 0 (the same on every rank), or omit it"};
  }
  return {};
}

/// Step 1 of `forward_backward` or `forward` (`kind`; its first collective): all-gathers every rank's call, step,
/// iteration, shape, logit scale and bias (`scalars` = {s, b} where the caller knows them; the device losses keep
/// theirs on the device) and own verdict (`local`); refuses on every rank when the ranks are out of step; derives the
/// global facts into `g` (a rank whose s or b differs from rank 0's bit for bit is refused), runs
/// `checks_with_totals(g)` on every rank when nothing failed so far, and agrees.
template <class Comm, class T, class Checks>
status agree_on_problem(const Comm& comm,
                        const problem<T>& p,
                        std::int64_t step,
                        std::int64_t iteration,
                        status local,
                        global_shape& g,
                        Checks&& checks_with_totals,
                        call_kind kind = call_kind::forward_backward,
                        const float* scalars = nullptr)
{
  if (local.ok())
  {
    (void)(local = check_iteration(iteration));
  }
  call_msg mine = make_call(kind, step, iteration, local);
  mine.n_q = static_cast<std::int64_t>(p.n_q);
  mine.n_k = static_cast<std::int64_t>(p.n_k);
  mine.dim = static_cast<std::int64_t>(p.dim);
  mine.objective_code = static_cast<std::int64_t>(objectives::code_of(p));
  mine.has_labels = p.labels != nullptr ? 1 : (p.grouped() ? 2 : 0);
  if (scalars != nullptr)
  {
    mine.has_scalars = 1;
    mine.scale_bits = float_bits(scalars[0]);
    mine.bias_bits = float_bits(scalars[1]);
  }
  std::vector<call_msg> all(static_cast<std::size_t>(comm.size()));
  CONTRASTIVE_RETURN_IF_ERROR(comm.allgather(&mine, sizeof mine, all.data()));
  CONTRASTIVE_RETURN_IF_ERROR(check_in_step(all));
  g = derive_global(all, comm.rank());
  if (g.bad_rank == comm.rank() && local.ok())
  {
    (void)(local = g.why); // a disagreement is reported by the first rank that differs
  }
  if (!g.any_failed)
  {
    (void)(local = checks_with_totals(g));
  }
  return agree(comm, local);
}

/// The agreement a call starts with when it carries no shape (`backward`): the same all-gather (ranks in other calls
/// or at other steps are refused on every rank), then `local`, this rank's own checks, agreed.
template <class Comm>
status agree_on_call(const Comm& comm, call_kind kind, std::int64_t step, std::int64_t iteration, const status& local)
{
  const call_msg mine = make_call(kind, step, iteration, local);
  std::vector<call_msg> all(static_cast<std::size_t>(comm.size()));
  CONTRASTIVE_RETURN_IF_ERROR(comm.allgather(&mine, sizeof mine, all.data()));
  CONTRASTIVE_RETURN_IF_ERROR(check_in_step(all));
  return agree(comm, local);
}

/// `finish_step`'s agreement (its first collective): the same all-gather (so a rank still in `forward_backward`, or
/// at another step, is refused on every rank), then every rank must have a step in progress; `site` becomes the
/// earliest non-finite site over all ranks (nonfinite_site::none if none). `local`: this rank's own failure, if any
/// (every rank returns it).
template <class Comm>
status agree_on_finish(
    const Comm& comm, std::int64_t step, std::int64_t iteration, bool pending, const status& local, std::int32_t& site)
{
  call_msg mine = make_call(call_kind::finish_step, step, iteration, local);
  mine.pending = pending ? 1 : 0;
  mine.site = site;
  std::vector<call_msg> all(static_cast<std::size_t>(comm.size()));
  CONTRASTIVE_RETURN_IF_ERROR(comm.allgather(&mine, sizeof mine, all.data()));
  CONTRASTIVE_RETURN_IF_ERROR(check_in_step(all));
  for (const call_msg& m : all)
  {
    if (m.code != 0)
    {
      return agree(comm, local); // every rank sees the same codes, so every rank takes part
    }
  }
  constexpr auto none = static_cast<std::int32_t>(nonfinite_site::none);
  std::int32_t earliest = none;
  for (std::size_t r = 0; r < all.size(); ++r)
  {
    if (all[r].pending == 0)
    {
      return {errc::invalid_argument,
              "rec",
              "rank " + std::to_string(r) +
                  ": no step in progress, or finish_step already called for it (finish_step needs a "
                  "forward_backward on every rank)"};
    }
    const auto s = static_cast<std::int32_t>(all[r].site);
    if (s != none && (earliest == none || s < earliest))
    {
      earliest = s;
    }
  }
  site = earliest;
  return {};
}
} // namespace agreement
} // namespace distributed
} // namespace contrastive
