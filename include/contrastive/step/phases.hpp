// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Pieces of the step driver's phases (step/driver.hpp), as functions of their inputs: how engine work's failures
/// become statuses, the columns' finish (one process: from its own partials; ranks: combined over the ranks), and
/// what only ranks hold and do (the gathered K, the rows' global labels, float partials; the per-rank results
/// gathered and combined in rank order, so that every rank computes the same bits).

#include <contrastive/comm/agreement.hpp>
#include <contrastive/comm/communicator.hpp>
#include <contrastive/detail/checked.hpp>
#include <contrastive/host/engine.hpp>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/numeric/online_lse.hpp>
#include <contrastive/status.hpp>

#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

namespace contrastive
{
namespace step
{
/// The batch of a step: its total queries and keys, and this rank's first query and key index (one process: its
/// own problem's sizes, offsets 0).
struct batch_extent
{
  std::size_t n_q_total = 0, n_k_total = 0, q_off = 0, k_off = 0;
};

/// Runs `f` (allocation or engine work) and turns what it throws into an errc::resource_exhausted status: "memory"
/// for an allocation, "threads" for a resource the system refused (the worker pool). Nothing escapes.
template <class F>
status guard_resources(F&& f)
{
  try
  {
    std::forward<F>(f)();
    return {};
  }
  catch (const std::bad_alloc&)
  {
    return {errc::resource_exhausted, "memory", "a buffer of the host engine could not be allocated"};
  }
  catch (const std::length_error&)
  {
    return {errc::resource_exhausted, "memory", "a buffer of the host engine exceeds the largest possible allocation"};
  }
  catch (const std::system_error& e)
  {
    return {errc::resource_exhausted, "threads", std::string("the system refused a resource: ") + e.what()};
  }
  catch (...)
  {
    return {errc::resource_exhausted, "memory", "an allocation failed"};
  }
}

/// A resource failure `st` of `what`, with the bytes it asked for and the sizes they were for: this rank's n_q rows of
/// dimension `dim` against n_k keys (`ranks`: the global key count; the status keeps the argument `st` named, where
/// one process names "memory"). Other statuses are returned unchanged.
inline status with_bytes(const status& st,
                         const char* what,
                         std::size_t bytes,
                         std::size_t n_q,
                         std::size_t n_k,
                         std::size_t dim,
                         const char* algorithm,
                         bool ranks)
{
  if (st.code() != errc::resource_exhausted)
  {
    return st;
  }
  const std::string sizes = ranks ? " bytes on this rank (n_q = " + std::to_string(n_q) +
                                        ", global n_k = " + std::to_string(n_k) + ", dim = " + std::to_string(dim) +
                                        ", " + algorithm
                                  : " bytes for n_q = " + std::to_string(n_q) + ", n_k = " + std::to_string(n_k) +
                                        ", dim = " + std::to_string(dim) + " (" + algorithm;
  return {errc::resource_exhausted,
          ranks ? st.argument() : std::string("memory"),
          std::string(what) + " needs " + std::to_string(bytes) + sizes + "): " + st.reason()};
}

/// Phase 5 for one process (symmetric): every column finished from the engine's own partials over all its rows (its
/// negatives and its positive; `grouped`: its negatives and its positives, numeric/groups.hpp's finish_grouped);
/// returns the sum of the column losses (grouped: 0 for a column without a positive).
template <class Algorithm, class Engine>
double finish_columns(Engine& engine, std::size_t n_k, bool grouped)
{
  double col_loss_sum = 0.0;
  for (std::size_t j = 0; j < n_k; ++j)
  {
    if (grouped)
    {
      const grouped_stats g =
          finish_grouped(engine.template column_partial<Algorithm>(j), engine.template column_positives<Algorithm>(j));
      engine.set_column(j, g);
      col_loss_sum += static_cast<double>(g.loss);
      continue;
    }
    const contrastive::row_loss rl = finish_row(engine.template column_partial<Algorithm>(j), engine.positive(j));
    engine.set_column(j, rl);
    col_loss_sum += static_cast<double>(rl.loss);
  }
  return col_loss_sum;
}

/// A rank's buffers besides its engine, sized by `resize` once the ranks agreed on the batch.
template <class Element>
struct rank_buffers
{
  /// float gradients are written in place (the engine's dQ and the reduce-scatter's dK go straight to the caller's
  /// arrays): no float partials of dq and dk besides the gathered dK's.
  static constexpr bool float_out = std::is_same_v<Element, float>;

  std::vector<int> q_rows, k_rows, dk_counts; ///< every rank's query and key rows (all-gathers, reduce-scatter counts)
  std::vector<Element> k_all;                 ///< K gathered in the element type (n_k_total x d)
  std::vector<std::int32_t> labels;           ///< this rank's rows' global positives
  std::vector<std::int64_t> q_ids, k_ids;     ///< grouped: every rank's query and key group ids
  std::vector<float> dq_f, dk_all_f, dk_f;    ///< float partials (dq_f, dk_f: 16-bit elements only)
  /// Symmetric: the columns' maxima (grouped: the negatives', then the positives'), then their sums and positives
  /// (grouped: the negatives' sums, then the positives' deficits, gaps and counts), `columns` of each.
  std::vector<float> col_a, col_b;
  std::size_t columns = 0;

  std::size_t bytes_held() const noexcept
  {
    return k_all.capacity() * sizeof(Element) + labels.capacity() * sizeof(std::int32_t) +
           (q_ids.capacity() + k_ids.capacity()) * sizeof(std::int64_t) +
           (dq_f.capacity() + dk_all_f.capacity() + dk_f.capacity() + col_a.capacity() + col_b.capacity()) *
               sizeof(float);
  }

  /// The bytes `resize` asks for: this rank's n_q rows and n_k keys of a batch of n_k_total keys of dimension d;
  /// `grouped`: a symmetric step with group ids.
  static detail::checked_size bytes_for(
      std::size_t n_q, std::size_t n_k, std::size_t n_k_total, std::size_t d, bool symmetric, bool grouped) noexcept
  {
    using detail::checked_size;
    return checked_size(n_k_total) * d * sizeof(Element) + checked_size(n_q) * sizeof(std::int32_t) +
           (checked_size(float_out ? 0 : n_q) * d + checked_size(n_k_total) * d +
            checked_size(float_out ? 0 : n_k) * d +
            checked_size(symmetric ? n_k_total : 0) * std::size_t(grouped ? 6 : 3)) *
               sizeof(float);
  }

  /// Sizes every buffer (may throw std::bad_alloc; the driver guards it).
  void resize(std::size_t n_q, std::size_t n_k, std::size_t n_k_total, std::size_t d, bool symmetric, bool grouped)
  {
    k_all.resize(n_k_total * d);
    labels.resize(n_q);
    dq_f.resize(float_out ? 0 : n_q * d);
    dk_all_f.resize(n_k_total * d);
    dk_f.resize(float_out ? 0 : n_k * d);
    const std::size_t n = symmetric ? n_k_total : 0;
    col_a.resize(n * (grouped ? 2 : 1));
    col_b.resize(n * (grouped ? 4 : 2));
    columns = n; // after the buffers that hold them
  }
};

/// What a rank's row phase contributes to the batch's forward (doubles: one all-gather of plain values).
struct rank_forward
{
  double row_loss_sum, max_logit, logits_bad;
};
/// What a rank's backward contributes: d(loss_scale * loss)/d(log s), d(loss_scale * loss)/d b, the dQ/dK flags.
struct rank_backward
{
  double dlogs, dq_bad, dk_bad, dbias;
};

/// Every rank's row phase, combined in rank order (the same bits on every rank).
inline host::row_pass combine_ranks(const std::vector<rank_forward>& all) noexcept
{
  host::row_pass r;
  r.max_logit = -detail::infinity_f;
  for (const rank_forward& f : all)
  {
    r.row_loss_sum += f.row_loss_sum;
    r.max_logit = detail::max_nan(r.max_logit, static_cast<float>(f.max_logit));
    r.logits_nonfinite |= f.logits_bad != 0.0;
  }
  return r;
}
/// Every rank's backward, combined in rank order.
inline host::backward_result combine_ranks(const std::vector<rank_backward>& all) noexcept
{
  double dlogs = 0.0, dbias = 0.0;
  host::backward_result r;
  for (const rank_backward& b : all)
  {
    dlogs += b.dlogs;
    dbias += b.dbias;
    r.dq_nonfinite |= b.dq_bad != 0.0;
    r.dk_nonfinite |= b.dk_bad != 0.0;
  }
  r.grad_logit_scale = static_cast<float>(dlogs);
  r.grad_logit_bias = static_cast<float>(dbias);
  return r;
}

/// All-gathers each rank's `mine` (rank order) after agreeing on `local` (one collective when every rank is fine).
template <class Comm, class R>
status gather_ranks(const Comm& comm, const status& local, const R& mine, std::vector<R>& all)
{
  struct msg
  {
    std::int64_t code;
    R value;
  };
  const msg m{static_cast<std::int64_t>(local.code()), mine};
  std::vector<msg> got(static_cast<std::size_t>(comm.size()));
  CONTRASTIVE_RETURN_IF_ERROR(comm.allgather(&m, sizeof m, got.data()));
  for (const msg& g : got)
  {
    if (g.code != 0)
    {
      return distributed::agreement::agree(comm, local); // every rank saw the same codes: every rank takes part
    }
  }
  all.resize(got.size());
  for (std::size_t r = 0; r < got.size(); ++r)
  {
    all[r] = got[r].value;
  }
  return {};
}

/// Phase 5 for ranks (symmetric): each rank's partial column states over its `n_local` rows (from `engine`, whose
/// rows start at global query `q_off`), combined over the ranks (the maxima, then the rebased sums and the
/// positives; `grouped`: the positives' states, numeric/groups.hpp's positive_stats) and finished into the engine;
/// `col_loss_sum` is the sum of the finished column losses (identical on every rank). If this rank's forward failed
/// (`compute`; its engine may be released) it still takes part in both reductions, with neutral partials, so the
/// others are not left waiting; the driver refuses the step on every rank afterwards.
template <class Algorithm, class Comm, class Engine, class Element>
status combine_columns(const Comm& comm,
                       Engine& engine,
                       rank_buffers<Element>& b,
                       std::size_t n_local,
                       std::size_t q_off,
                       const status& compute,
                       bool grouped,
                       double& col_loss_sum)
{
  const std::size_t n = b.columns;
  const bool local_ok = compute.ok();
  float* neg_max = b.col_a.data();
  float* pos_max = neg_max + n; // grouped
  for (std::size_t j = 0; j < n; ++j)
  {
    neg_max[j] = local_ok ? engine.template column_partial<Algorithm>(j).max : -detail::infinity_f;
    if (grouped)
    {
      pos_max[j] = local_ok ? engine.template column_positives<Algorithm>(j).max : -detail::infinity_f;
    }
  }
  CONTRASTIVE_RETURN_IF_ERROR(comm.allreduce(b.col_a.data(), grouped ? 2 * n : n, distributed::reduce_op::max));
  float* sums = b.col_b.data();
  float* pos = b.col_b.data() + n; // grouped: the positives' deficits, gaps and counts from here
  for (std::size_t j = 0; j < n; ++j)
  {
    online_lse st = local_ok ? engine.template column_partial<Algorithm>(j) : online_lse{};
    st.rebase(neg_max[j] == -detail::infinity_f ? st.max : neg_max[j]);
    sums[j] = st.max == -detail::infinity_f ? 0.0f : st.sum;
    pos[j] = 0.0f;
    if (grouped)
    {
      positive_stats ps = local_ok ? engine.template column_positives<Algorithm>(j) : positive_stats{};
      if (ps.count > 0.0f && ps.max != pos_max[j])
      {
        ps.rebase(pos_max[j]);
      }
      pos[j] = ps.deficit;
      pos[n + j] = ps.gap;
      pos[2 * n + j] = ps.count;
    }
  }
  // Column j's positive is global query j: owned by the rank whose queries start at q_off (grouped: none apart).
  for (std::size_t i = 0; local_ok && !grouped && i < n_local; ++i)
  {
    pos[q_off + i] = engine.positive(i);
  }
  CONTRASTIVE_RETURN_IF_ERROR(comm.allreduce(b.col_b.data(), grouped ? 4 * n : 2 * n, distributed::reduce_op::sum));
  col_loss_sum = 0.0;
  for (std::size_t j = 0; local_ok && j < n; ++j)
  {
    if (grouped)
    {
      const grouped_stats g = finish_grouped(online_lse{neg_max[j], sums[j]},
                                             positive_stats{pos_max[j], pos[j], pos[n + j], pos[2 * n + j]});
      engine.set_column(j, g);
      col_loss_sum += static_cast<double>(g.loss);
      continue;
    }
    const contrastive::row_loss rl = finish_row(online_lse{neg_max[j], sums[j]}, pos[j]);
    engine.set_column(j, rl);
    col_loss_sum += static_cast<double>(rl.loss);
  }
  return {};
}

/// Rounds float gradients to the element type (float: `in` is `out`, only tested); returns whether any result is
/// non-finite.
template <class Element>
bool round_into(const float* in, std::size_t n, Element* out) noexcept
{
  float poison = 0.0f;
  if constexpr (std::is_same_v<Element, float>)
  {
    (void)out;
    for (std::size_t i = 0; i < n; ++i)
    {
      poison += in[i] * 0.0f;
    }
    return poison != 0.0f;
  }
  for (std::size_t i = 0; i < n; ++i)
  {
    const Element v = element_traits<Element>::from_float(in[i]);
    poison += element_traits<Element>::to_float(v) * 0.0f;
    out[i] = v;
  }
  return poison != 0.0f;
}
} // namespace step
} // namespace contrastive
