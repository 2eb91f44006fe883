// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `contrastive::distributed::loss`: the loss of the *global* batch when every rank holds n_local rows of Q and K
/// (data parallelism), with the same policies as `contrastive::loss` stepping identically on every rank.
///
/// One step on rank r (every rank calls it; every path, errors included, runs the same collectives):
///   1. agreement: the ranks' calls, step counts, iterations and shapes are all-gathered (ranks out of step are
///      refused on every rank at the first wrong call: distributed/agreement.hpp); every check runs (shapes, pointers,
///      labels against the global key count, finiteness, policies, sizes) and a failure on any rank is returned on
///      every rank, naming the rank
///      ("rank 2: k[5][0] is not finite"), before any feature moves. Allocation failures are agreed on the same way.
///   2. K is all-gathered in the element type (N_k x D; Q is not needed anywhere else).
///   3. The rank's block of rows, S_r = s Q_r K^T (n_local x N_k), goes through the single-process engine in block
///      mode: row statistics are complete locally; for the symmetric loss each column's negatives over the block's
///      rows are combined across ranks (an all-reduce max of N_k floats, then a sum of 2 N_k floats: the rescaled
///      sums and the positives), so every rank holds the global column log-sum-exps.
///   4. Backward of the block with the global coefficients: dQ_r is complete locally; the block's contribution to dK
///      for all N_k keys (float) is reduce-scattered back to the owners and rounded once to the element type.
///   5. Loss, max logit, d loss / d log s and the non-finite flags are all-gathered per rank and combined in rank
///      order (identical bits everywhere); the record, and then `finish_step` (which also agrees on a `parameters`
///      site found by `unscale_and_check` on any rank), step the policies in lockstep, as DDP + GradScaler do.
/// Communication per step: N_k D elements gathered, N_k D floats reduced, 3 N_k floats of column statistics (the
/// symmetric loss), and O(ranks) scalars; never N x N data. Memory per rank: the gathered K (N_k D elements), the
/// engine for an n_local x N_k problem (fused: packed K, O(N D); materialized: n_local x N_k logits, 1/ranks of one
/// process; chunked: its chunk) and the float dK partial (N_k D).
///
/// Unequal n_local per rank works. The symmetric objective needs n_q == n_k on each rank (pairs) and positives on the
/// global diagonal; info_nce labels are global key indices (null: the global diagonal). Comm: comm::local (one
/// process, no library) or comm::mpi (<contrastive/distributed/mpi.hpp>).

#include <contrastive/checks.hpp>
#include <contrastive/detail/checked.hpp>
#include <contrastive/detail/host_step.hpp>
#include <contrastive/detail/step_logic.hpp>
#include <contrastive/distributed/agreement.hpp>
#include <contrastive/distributed/communicator.hpp>
#include <contrastive/host/engine.hpp>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/numeric/online_lse.hpp>
#include <contrastive/policy/scaler.hpp>
#include <contrastive/policy/temperature.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

namespace contrastive
{
namespace distributed
{
template <class Element,
          class Temperature = temperature::learnable,
          class Scaler = scaler::static_scale,
          class Algorithm = algorithm::fused,
          class Comm = comm::local,
          class Gemm = gemm::builtin>
class loss
{
  static_assert(is_element_type_v<Element>, "Element must be float, __half or __nv_bfloat16");
  static_assert(temperature::is_temperature_policy_v<Temperature>, "Temperature must be a temperature policy");
  static_assert(scaler::is_scaler_policy_v<Scaler>, "Scaler must be a scaler policy");
  static_assert(is_algorithm_v<Algorithm>,
                "Algorithm must be algorithm::fused, algorithm::materialized or algorithm::chunked");
  static_assert(is_communicator_v<Comm>,
                "Comm must be a communicator (distributed::comm::local, or comm::mpi from "
                "<contrastive/distributed/mpi.hpp>)");

public:
  using element_type = Element;
  using problem_type = problem<Element>;

  /// Everything a training run must save to resume bit-exactly (trivially copyable).
  using checkpoint = contrastive::detail::checkpoint<Temperature, Scaler>;

  /// Construct on every rank with the same policies (a communicator constructor may itself be a collective).
  explicit loss(Comm comm = Comm{}, Temperature t = Temperature{}, Scaler s = Scaler{}, unsigned threads = 0)
      : comm_(std::move(comm)), temperature_(t), scaler_(s), engine_(threads)
  {
  }

  const Comm& communicator() const noexcept
  {
    return comm_;
  }
  const Temperature& temperature() const noexcept
  {
    return temperature_;
  }
  const Scaler& scaler() const noexcept
  {
    return scaler_;
  }
  std::int64_t steps() const noexcept
  {
    return step_;
  }
  float tau() const noexcept
  {
    return temperature_.tau();
  }
  float loss_scale() const noexcept
  {
    return scaler_.loss_scale();
  }
  /// algorithm::chunked: rows per chunk of this rank's block (see chunk_options).
  void set_chunk(const chunk_options& o) noexcept
  {
    engine_.set_chunk(o);
  }
  /// The global batch of the last agreed step: total queries and keys, and this rank's first query and key index.
  std::size_t global_queries() const noexcept
  {
    return n_q_total_;
  }
  std::size_t global_keys() const noexcept
  {
    return n_k_total_;
  }
  std::size_t query_offset() const noexcept
  {
    return q_off_;
  }
  std::size_t key_offset() const noexcept
  {
    return k_off_;
  }
  /// Host bytes held by this rank between steps: the engine, the gathered K, the float partials and statistics.
  std::size_t bytes_held() const noexcept
  {
    return engine_.bytes_held() + k_all_.capacity() * sizeof(Element) + labels_.capacity() * sizeof(std::int32_t) +
           (dq_f_.capacity() + dk_all_f_.capacity() + dk_f_.capacity() + col_a_.capacity() + col_b_.capacity()) *
               sizeof(float);
  }

  checkpoint save() const noexcept
  {
    return contrastive::detail::save_checkpoint(temperature_, scaler_, step_);
  }

  /// Restores this rank's state (local; restore the same checkpoint on every rank).
  status restore(const checkpoint& c)
  {
    return contrastive::detail::restore_checkpoint(c, temperature_, scaler_, step_);
  }

  /// Steps 1-3 of a training step over the global batch (collective). `p` is this rank's rows; dq and dk receive the
  /// gradients of loss_scale * (global loss) for them. On error (on any rank) every rank returns an error and no
  /// policy changes; a refused call writes nothing.
  ///
  /// Every rank must make the same calls in the same order. The loss's step count (`steps()`) travels with every
  /// call, so a rank that is a call behind or ahead (a finish_step skipped, a different checkpoint restored) is
  /// refused on every rank at the first wrong call (errc::invalid_argument, "step", naming the ranks and their
  /// steps). A rank that skips a *whole* step is only seen if the caller also gives `iteration` (its own step number,
  /// e.g. the training loop's index, the same on every rank): the loss cannot know which batch a call is for, and
  /// without it the skipping rank's next call pairs with the others' current one.
  status forward_backward(
      const problem_type& p, Element* dq, Element* dk, step_record& rec, std::int64_t iteration = no_iteration)
  {
    CONTRASTIVE_RETURN_IF_ERROR(agree_on_problem(p, dq, dk, iteration));
    iteration_ = iteration;
    const bool sym = p.obj == objective::symmetric;
    const std::size_t d = p.dim;

    // Buffers and the gathered keys (allocation failures are agreed on before any collective that needs them).
    const contrastive::detail::checked_size alloc_bytes =
        contrastive::detail::checked_size(n_k_total_) * d * sizeof(Element) +
        contrastive::detail::checked_size(p.n_q) * sizeof(std::int32_t) +
        (contrastive::detail::checked_size(p.n_q) * d + contrastive::detail::checked_size(n_k_total_) * d +
         contrastive::detail::checked_size(p.n_k) * d +
         contrastive::detail::checked_size(sym ? n_k_total_ : 0) * std::size_t(4)) *
            sizeof(float);
    status alloc = guarded(
        [&]
        {
          k_all_.resize(n_k_total_ * d);
          labels_.resize(p.n_q);
          dq_f_.resize(p.n_q * d);
          dk_all_f_.resize(n_k_total_ * d);
          dk_f_.resize(p.n_k * d);
          col_a_.resize(sym ? n_k_total_ : 0);
          col_b_.resize(sym ? 2 * n_k_total_ : 0);
        });
    CONTRASTIVE_RETURN_IF_ERROR(detail::agree(comm_, needs(alloc, "its buffers", alloc_bytes.value, p)));
    CONTRASTIVE_RETURN_IF_ERROR(comm_.allgatherv_rows(p.k, k_rows_.data(), d * sizeof(Element), k_all_.data()));
    for (std::size_t i = 0; i < p.n_q; ++i)
    {
      labels_[i] = static_cast<std::int32_t>(p.labels != nullptr ? p.labels[i] : q_off_ + i);
    }
    const problem_type block{p.q, k_all_.data(), p.n_q, n_k_total_, d, labels_.data(), p.obj};
    const grad_coefficients gc = sym ? grad_coefficients{static_cast<float>(0.5 / double(n_q_total_)),
                                                         static_cast<float>(0.5 / double(n_k_total_)),
                                                         static_cast<float>(0.5 / double(n_q_total_)) +
                                                             static_cast<float>(0.5 / double(n_k_total_))}
                                     : grad_coefficients{static_cast<float>(1.0 / double(n_q_total_)),
                                                         0.0f,
                                                         static_cast<float>(1.0 / double(n_q_total_))};
    engine_.set_block(true, gc);
    const std::size_t engine_bytes = engine_.template bytes_for<Algorithm>(block).value;
    CONTRASTIVE_RETURN_IF_ERROR(detail::agree(comm_,
                                              needs(guarded(
                                                        [&]
                                                        {
                                                          engine_.template prepare<Algorithm>(block);
                                                        }),
                                                    "the host engine",
                                                    engine_bytes,
                                                    p)));

    // Forward of the block; the symmetric loss's columns from every rank's partials.
    const float ls = scaler_.loss_scale();
    host::forward_result fr;
    status compute = guarded(
        [&]
        {
          fr = engine_.template forward<Algorithm>(temperature_.scale());
        });
    double col_loss_sum = 0.0;
    if (sym)
    {
      CONTRASTIVE_RETURN_IF_ERROR(combine_columns(p.n_q, compute, col_loss_sum));
    }
    host::backward_result br;
    if (compute.ok())
    {
      (void)(compute = guarded(
                 [&]
                 {
                   br = engine_.template backward<Algorithm>(ls, dq_f_.data(), dk_all_f_.data());
                 }));
    }

    // dK back to its owners; a failure of the engine's work on any rank is agreed on before anything is written.
    CONTRASTIVE_RETURN_IF_ERROR(comm_.reduce_scatter_sum(dk_all_f_.data(), dk_counts_.data(), dk_f_.data()));
    CONTRASTIVE_RETURN_IF_ERROR(detail::agree(comm_, needs(compute, "the host engine mid-step", engine_bytes, p)));
    const bool dq_bad = round_into(dq_f_.data(), p.n_q * d, dq);
    const bool dk_bad = round_into(dk_f_.data(), p.n_k * d, dk);

    // Per-rank results, combined in rank order on every rank.
    double row_loss_sum = 0.0;
    for (std::size_t i = 0; i < p.n_q; ++i)
    {
      row_loss_sum += static_cast<double>(engine_.row_losses()[i]);
    }
    const rank_result mine{row_loss_sum,
                           static_cast<double>(br.grad_logit_scale),
                           static_cast<double>(fr.max_logit),
                           fr.logits_nonfinite ? 1.0 : 0.0,
                           dq_bad ? 1.0 : 0.0,
                           dk_bad ? 1.0 : 0.0};
    std::vector<rank_result> all(static_cast<std::size_t>(comm_.size()));
    CONTRASTIVE_RETURN_IF_ERROR(comm_.allgather(&mine, sizeof mine, all.data()));
    double rows = 0.0, dlogs = 0.0;
    float max_logit = -contrastive::detail::infinity_f;
    bool logits_bad = false, any_dq_bad = false, any_dk_bad = false;
    for (std::size_t r = 0; r < all.size(); ++r)
    {
      rows += all[r].row_loss_sum;
      dlogs += all[r].dlogs;
      max_logit = contrastive::detail::max_nan(max_logit, static_cast<float>(all[r].max_logit));
      logits_bad |= all[r].logits_bad != 0.0;
      any_dq_bad |= all[r].dq_bad != 0.0;
      any_dk_bad |= all[r].dk_bad != 0.0;
    }
    const double total =
        sym ? 0.5 * (rows / double(n_q_total_) + col_loss_sum / double(n_k_total_)) : rows / double(n_q_total_);
    rec = contrastive::detail::make_record(
        step_,
        temperature_.tau(),
        ls,
        temperature_.wants_gradient(),
        {static_cast<float>(total), max_logit, static_cast<float>(dlogs), logits_bad, any_dq_bad, any_dk_bad});
    return {};
  }

  /// Multiplies this rank's own gradients by 1/loss_scale and records `parameters` if one is not finite (local; the
  /// next `finish_step` makes every rank skip if any rank recorded a non-finite value).
  status unscale_and_check(float* grads, std::size_t n, step_record& rec) const
  {
    return contrastive::detail::unscale_and_check_host(grads, n, rec);
  }

  /// Step 4 (collective): the ranks agree on the step's first non-finite site (the earliest in step order over all
  /// ranks), then every rank runs the same scaler and temperature update.
  /// Its first collective is the same as forward_backward's, so a rank still in forward_backward (or at another
  /// step) is refused on every rank; a refused finish_step changes nothing (the record stays pending).
  status finish_step(step_record& rec)
  {
    std::int32_t site = static_cast<std::int32_t>(rec.first_nonfinite);
    CONTRASTIVE_RETURN_IF_ERROR(detail::agree_on_finish(comm_, step_, iteration_, rec.pending, status{}, site));
    rec.first_nonfinite = static_cast<nonfinite_site>(site);
    contrastive::detail::finish_step<Element>(temperature_, scaler_, rec);
    step_ = contrastive::detail::saturating_increment(step_);
    return {};
  }

  /// A whole step whose only gradients are dq and dk (collective): exactly forward_backward, then finish_step, so
  /// ranks may mix the two forms within one step.
  status step(const problem_type& p, Element* dq, Element* dk, step_record& rec, std::int64_t iteration = no_iteration)
  {
    CONTRASTIVE_RETURN_IF_ERROR(forward_backward(p, dq, dk, rec, iteration));
    return finish_step(rec);
  }

private:
  /// What each rank contributes to the step record (all-gathered, combined in rank order).
  struct rank_result
  {
    double row_loss_sum, dlogs, max_logit, logits_bad, dq_bad, dk_bad;
  };
  /// Step 1: the ranks' shapes, every check, and one agreement (distributed/agreement.hpp).
  status agree_on_problem(const problem_type& p, Element* dq, Element* dk, std::int64_t iteration)
  {
    status local = check_problem(p, dq, dk, true, /*check_labels=*/false);
    if (local.ok())
    {
      local = host::engine<Element, Gemm>::check_dim(p.dim);
    }
    if (local.ok())
    {
      if (const char* why = temperature_.validate(); why[0] != '\0')
      {
        local = {errc::invalid_temperature, "temperature", why};
      }
      else if (const char* why2 = scaler_.validate(); why2[0] != '\0')
      {
        local = {errc::invalid_scaler, "scaler", why2};
      }
      else if (engine_.threads() > host::max_threads)
      {
        local = {errc::invalid_argument, "threads", "at most " + std::to_string(host::max_threads) + " threads"};
      }
    }
    detail::global_shape g;
    return detail::agree_on_problem(comm_,
                                    p,
                                    step_,
                                    iteration,
                                    local,
                                    g,
                                    [&](const detail::global_shape& gs)
                                    {
                                      n_q_total_ = gs.n_q_total;
                                      n_k_total_ = gs.n_k_total;
                                      q_off_ = gs.q_off;
                                      k_off_ = gs.k_off;
                                      k_rows_ = gs.k_rows;
                                      dk_counts_ = gs.dk_counts;
                                      return checks_with_totals(p);
                                    });
  }

  /// Checks that need the global sizes: labels against the global key count, finiteness, the engine's size.
  status checks_with_totals(const problem_type& p)
  {
    if (p.labels != nullptr)
    {
      for (std::size_t i = 0; i < p.n_q; ++i)
      {
        if (p.labels[i] < 0 || static_cast<std::size_t>(p.labels[i]) >= n_k_total_)
        {
          return {errc::label_out_of_range,
                  "labels",
                  "labels[" + std::to_string(i) + "] = " + std::to_string(p.labels[i]) +
                      " is outside the global keys [0, " + std::to_string(n_k_total_) + ")"};
        }
      }
    }
    if (const std::ptrdiff_t bad = engine_.first_nonfinite(p); bad != 0)
    {
      return contrastive::detail::nonfinite_input(bad, p.dim);
    }
    const problem_type block{p.q, p.k, p.n_q, n_k_total_, p.dim, p.labels, p.obj};
    const contrastive::detail::checked_size bytes =
        engine_.template bytes_for<Algorithm>(block) +
        contrastive::detail::checked_size(n_k_total_) * p.dim * (sizeof(Element) + sizeof(float));
    if (!bytes.ok())
    {
      return {errc::size_overflow, "n_k", "this rank's buffers for the global batch do not fit in size_t bytes"};
    }
    return {};
  }

  /// The symmetric loss's columns: each rank's partial column states over its rows, combined (max, then the
  /// rescaled sums and the positives); returns the sum of the global column losses (identical on every rank).
  /// If this rank's forward failed (`compute`; its engine may be released) it still takes part in both reductions,
  /// with neutral partials, so the others are not left waiting; the step is refused on every rank afterwards.
  status combine_columns(std::size_t n_local, status& compute, double& col_loss_sum)
  {
    const std::size_t n = n_k_total_;
    const std::vector<float>& part_max = engine_.block_column_max();
    const std::vector<float>& part_sum = engine_.block_column_sum();
    if (compute.ok() && (part_max.size() < n || part_sum.size() < n || engine_.positives().size() < n_local))
    {
      (void)(compute = status{errc::invalid_argument, "engine", "the engine's column partials are missing"});
    }
    const bool local_ok = compute.ok();
    for (std::size_t j = 0; j < n; ++j)
    {
      col_a_[j] = local_ok ? part_max[j] : -contrastive::detail::infinity_f;
    }
    CONTRASTIVE_RETURN_IF_ERROR(comm_.allreduce(col_a_.data(), n, reduce_op::max));
    float* sums = col_b_.data();
    float* pos = col_b_.data() + n;
    for (std::size_t j = 0; j < n; ++j)
    {
      online_lse s{local_ok ? part_max[j] : -contrastive::detail::infinity_f, local_ok ? part_sum[j] : 0.0f};
      s.rebase(col_a_[j] == -contrastive::detail::infinity_f ? s.max : col_a_[j]);
      sums[j] = s.max == -contrastive::detail::infinity_f ? 0.0f : s.sum;
      pos[j] = 0.0f;
    }
    // Column j's positive is global query j: owned by the rank whose queries start at q_off_.
    for (std::size_t i = 0; local_ok && i < n_local; ++i)
    {
      pos[q_off_ + i] = engine_.positives()[i];
    }
    CONTRASTIVE_RETURN_IF_ERROR(comm_.allreduce(col_b_.data(), 2 * n, reduce_op::sum));
    if (!local_ok)
    {
      col_loss_sum = 0.0;
      return {};
    }
    col_loss_sum = 0.0;
    for (std::size_t j = 0; j < n; ++j)
    {
      const contrastive::row_loss rl = finish_row(online_lse{col_a_[j], sums[j]}, pos[j]);
      engine_.set_column(j, rl); // lse, loss and its shift + log_sum split, as the one-process forward keeps them
      col_loss_sum += static_cast<double>(rl.loss);
    }
    return {};
  }

  /// Rounds float gradients to the element type; returns whether any result is non-finite.
  static bool round_into(const float* in, std::size_t n, Element* out) noexcept
  {
    float poison = 0.0f;
    for (std::size_t i = 0; i < n; ++i)
    {
      const Element v = element_traits<Element>::from_float(in[i]);
      poison += element_traits<Element>::to_float(v) * 0.0f;
      out[i] = v;
    }
    return poison != 0.0f;
  }

  /// A resource failure of `what` with the bytes it asked for (other statuses unchanged).
  status needs(const status& st, const char* what, std::size_t bytes, const problem_type& p) const
  {
    if (st.code() != errc::resource_exhausted)
    {
      return st;
    }
    return {errc::resource_exhausted,
            st.argument(),
            std::string(what) + " needs " + std::to_string(bytes) +
                " bytes on this rank (n_q = " + std::to_string(p.n_q) + ", global n_k = " + std::to_string(n_k_total_) +
                ", dim = " + std::to_string(p.dim) + ", " + Algorithm::name + "): " + st.reason()};
  }

  /// Runs `f` (allocation or engine work) and turns an exception into a status: nothing escapes to the caller.
  template <class F>
  status guarded(F&& f)
  {
    try
    {
      f();
      return {};
    }
    catch (const std::bad_alloc&)
    {
      engine_.release();
      return {errc::resource_exhausted, "memory", "a buffer of the distributed loss could not be allocated"};
    }
    catch (const std::length_error&)
    {
      engine_.release();
      return {errc::resource_exhausted, "memory", "a buffer of the distributed loss exceeds the largest allocation"};
    }
    catch (const std::system_error& e)
    {
      return {errc::resource_exhausted, "threads", std::string("the system refused a resource: ") + e.what()};
    }
    catch (...)
    {
      engine_.release();
      return {errc::resource_exhausted, "memory", "an allocation failed"};
    }
  }

  Comm comm_;
  Temperature temperature_;
  Scaler scaler_;
  host::engine<Element, Gemm> engine_;
  std::int64_t step_ = 0;
  std::int64_t iteration_ = no_iteration; ///< the caller's iteration of the last agreed forward_backward
  std::size_t n_q_total_ = 0, n_k_total_ = 0, q_off_ = 0, k_off_ = 0;
  std::vector<int> k_rows_, dk_counts_;
  std::vector<Element> k_all_;
  std::vector<std::int32_t> labels_;
  std::vector<float> dq_f_, dk_all_f_, dk_f_, col_a_, col_b_;
};
} // namespace distributed
} // namespace contrastive
