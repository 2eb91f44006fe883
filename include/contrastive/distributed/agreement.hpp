// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// How the ranks of a distributed loss agree before any feature moves (host and device losses share this):
/// every rank all-gathers its shape and the outcome of its own checks, every rank derives the same global facts
/// (totals, offsets, counts, the first inconsistent rank), and one more all-gather of error codes decides whether the
/// step goes on; if not, the first failing rank broadcasts its status and every rank returns it, naming that rank.
/// `Comm` needs `rank()`, `size()`, and host-memory `allgather(mine, bytes, all)` and `broadcast(buf, bytes, root)`.

#include <contrastive/detail/checked.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace contrastive
{
namespace distributed
{
namespace detail
{
/// Each rank's shape and the outcome of its own checks.
struct shape_msg
{
  std::int64_t n_q, n_k, dim, obj, has_labels, code;
};

/// A failing rank's status, broadcast to every rank.
struct status_msg
{
  std::int32_t code;
  char argument[60];
  char message[448];
};

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
inline global_shape derive_global(const std::vector<shape_msg>& all, int me)
{
  global_shape g;
  const std::size_t ranks = all.size();
  contrastive::detail::checked_size nq(0), nk(0);
  g.q_rows.assign(ranks, 0);
  g.k_rows.assign(ranks, 0);
  g.dk_counts.assign(ranks, 0);
  for (std::size_t r = 0; r < ranks; ++r)
  {
    const shape_msg& s = all[r];
    if (r == static_cast<std::size_t>(me))
    {
      g.q_off = nq.value;
      g.k_off = nk.value;
    }
    nq = nq + contrastive::detail::checked_size(static_cast<std::size_t>(s.n_q));
    nk = nk + contrastive::detail::checked_size(static_cast<std::size_t>(s.n_k));
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
    else if (s.obj != all[0].obj || s.has_labels != all[0].has_labels)
    {
      g.bad_rank = rr;
      (void)(g.why = status{errc::invalid_argument, "obj", "objective or labels differ from rank 0's"});
    }
    else if (s.n_q > INT_MAX || s.n_k > INT_MAX ||
             (contrastive::detail::checked_size(static_cast<std::size_t>(s.n_k)) * static_cast<std::size_t>(s.dim))
                     .value > static_cast<std::size_t>(INT_MAX))
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
    else if (all[0].obj == static_cast<std::int64_t>(objective::symmetric) && nq.value != nk.value)
    {
      g.bad_rank = 0;
      (void)(g.why = status{errc::shape_mismatch,
                            "n_k",
                            "symmetric: the global n_q (" + std::to_string(nq.value) + ") and n_k (" +
                                std::to_string(nk.value) + ") differ"});
    }
    else if (all[0].obj == static_cast<std::int64_t>(objective::info_nce) && all[0].has_labels == 0 &&
             nq.value > nk.value)
    {
      g.bad_rank = 0;
      (void)(g.why = status{errc::shape_mismatch,
                            "n_k",
                            "global diagonal labels need n_q <= n_k over all ranks (" + std::to_string(nq.value) +
                                " > " + std::to_string(nk.value) + ")"});
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
      std::strncpy(m.message, local.message().c_str(), sizeof m.message - 1);
    }
    CONTRASTIVE_RETURN_IF_ERROR(comm.broadcast(&m, sizeof m, r));
    return {static_cast<errc>(m.code), m.argument, "rank " + std::to_string(r) + ": " + std::string(m.message)};
  }
  return {};
}

/// Step 1 of a distributed step: all-gathers the shapes with each rank's own verdict (`local`), derives the global
/// facts into `g`, runs `checks_with_totals(g)` on every rank when nothing failed so far, and agrees.
template <class Comm, class T, class Checks>
status
agree_on_problem(const Comm& comm, const problem<T>& p, status local, global_shape& g, Checks&& checks_with_totals)
{
  const shape_msg mine{static_cast<std::int64_t>(p.n_q),
                       static_cast<std::int64_t>(p.n_k),
                       static_cast<std::int64_t>(p.dim),
                       static_cast<std::int64_t>(p.obj),
                       p.labels != nullptr ? 1 : 0,
                       static_cast<std::int64_t>(local.code())};
  std::vector<shape_msg> all(static_cast<std::size_t>(comm.size()));
  CONTRASTIVE_RETURN_IF_ERROR(comm.allgather(&mine, sizeof mine, all.data()));
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
} // namespace detail
} // namespace distributed
} // namespace contrastive
