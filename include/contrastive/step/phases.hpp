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

/// Column j's finished statistics from its state over every row and its positive logit; grouped (`col_inv` not
/// null: 1 / |Q(g(j))| per column, 0 without a positive): the state holds every logit, and the column's term in the
/// loss sum is its lse where it has a positive (the positives' part is the rows' `column_positives`).
inline contrastive::row_loss finish_column(online_lse state, float positive, const float* col_inv, std::size_t j)
{
  if (col_inv == nullptr)
  {
    return finish_row(state, positive);
  }
  contrastive::row_loss rl = finish_row(state, -detail::infinity_f);
  rl.loss = col_inv[j] > 0.0f ? rl.lse : 0.0f;
  return rl;
}

/// Phase 5 for one process (symmetric): every column finished from the engine's own partials over all its rows;
/// returns the sum of the column losses (grouped: see finish_column).
template <class Algorithm, class Engine>
double finish_columns(Engine& engine, std::size_t n_k, const float* col_inv)
{
  double col_loss_sum = 0.0;
  for (std::size_t j = 0; j < n_k; ++j)
  {
    const contrastive::row_loss rl =
        finish_column(engine.template column_partial<Algorithm>(j), col_inv ? 0.0f : engine.positive(j), col_inv, j);
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
  std::vector<float> col_a, col_b;            ///< symmetric: the columns' maxima, then their sums and positives

  std::size_t bytes_held() const noexcept
  {
    return k_all.capacity() * sizeof(Element) + labels.capacity() * sizeof(std::int32_t) +
           (q_ids.capacity() + k_ids.capacity()) * sizeof(std::int64_t) +
           (dq_f.capacity() + dk_all_f.capacity() + dk_f.capacity() + col_a.capacity() + col_b.capacity()) *
               sizeof(float);
  }

  /// The bytes `resize` asks for: this rank's n_q rows and n_k keys of a batch of n_k_total keys of dimension d.
  static detail::checked_size
  bytes_for(std::size_t n_q, std::size_t n_k, std::size_t n_k_total, std::size_t d, bool symmetric) noexcept
  {
    using detail::checked_size;
    return checked_size(n_k_total) * d * sizeof(Element) + checked_size(n_q) * sizeof(std::int32_t) +
           (checked_size(float_out ? 0 : n_q) * d + checked_size(n_k_total) * d +
            checked_size(float_out ? 0 : n_k) * d + checked_size(symmetric ? n_k_total : 0) * std::size_t(3)) *
               sizeof(float);
  }

  /// Sizes every buffer (may throw std::bad_alloc; the driver guards it).
  void resize(std::size_t n_q, std::size_t n_k, std::size_t n_k_total, std::size_t d, bool symmetric)
  {
    k_all.resize(n_k_total * d);
    labels.resize(n_q);
    dq_f.resize(float_out ? 0 : n_q * d);
    dk_all_f.resize(n_k_total * d);
    dk_f.resize(float_out ? 0 : n_k * d);
    col_a.resize(symmetric ? n_k_total : 0);
    col_b.resize(symmetric ? 2 * n_k_total : 0);
  }
};

/// What a rank's row phase contributes to the batch's forward (doubles: one all-gather of plain values).
struct rank_forward
{
  double row_loss_sum, max_logit, logits_bad, column_positives;
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
    r.column_positives += f.column_positives;
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
/// positives) and finished into the engine; `col_loss_sum` is the sum of the finished column losses (identical on
/// every rank). If this rank's forward failed (`compute`; its engine may be released) it still takes part in both
/// reductions, with neutral partials, so the others are not left waiting; the driver refuses the step on every rank
/// afterwards.
template <class Algorithm, class Comm, class Engine, class Element>
status combine_columns(const Comm& comm,
                       Engine& engine,
                       rank_buffers<Element>& b,
                       std::size_t n_local,
                       std::size_t q_off,
                       const status& compute,
                       const float* col_inv,
                       double& col_loss_sum)
{
  const std::size_t n = b.col_a.size();
  const bool local_ok = compute.ok();
  for (std::size_t j = 0; j < n; ++j)
  {
    b.col_a[j] = local_ok ? engine.template column_partial<Algorithm>(j).max : -detail::infinity_f;
  }
  CONTRASTIVE_RETURN_IF_ERROR(comm.allreduce(b.col_a.data(), n, distributed::reduce_op::max));
  float* sums = b.col_b.data();
  float* pos = b.col_b.data() + n;
  for (std::size_t j = 0; j < n; ++j)
  {
    online_lse st = local_ok ? engine.template column_partial<Algorithm>(j) : online_lse{};
    st.rebase(b.col_a[j] == -detail::infinity_f ? st.max : b.col_a[j]);
    sums[j] = st.max == -detail::infinity_f ? 0.0f : st.sum;
    pos[j] = 0.0f;
  }
  // Column j's positive is global query j: owned by the rank whose queries start at q_off (grouped: none apart).
  for (std::size_t i = 0; local_ok && col_inv == nullptr && i < n_local; ++i)
  {
    pos[q_off + i] = engine.positive(i);
  }
  CONTRASTIVE_RETURN_IF_ERROR(comm.allreduce(b.col_b.data(), 2 * n, distributed::reduce_op::sum));
  col_loss_sum = 0.0;
  for (std::size_t j = 0; local_ok && j < n; ++j)
  {
    const contrastive::row_loss rl = finish_column(online_lse{b.col_a[j], sums[j]}, pos[j], col_inv, j);
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
