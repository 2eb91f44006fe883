// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `contrastive::step::driver<Element, Algorithm, Gemm, Comm>`: one forward + backward pass of the loss over the
/// batch, written once for one process and for every communicator, and free of policies: it takes the logit scale
/// s = 1/tau and the loss scale as numbers and returns the loss, the gradients and the diagnosis. The policy layer
/// (`basic_loss`, step/loss.hpp) and the framework bindings call it.
///
/// The phases of a step, in this order on every rank (every path, errors included, runs the same collectives):
///   forward    1. check     this rank's problem, pointers, dim and the caller's verdict on its policies;
///              2. agree     (ranks) all-gather every rank's call, step count, iteration, shape and verdict: ranks
///                           out of step, or one rank's bad input, are refused on every rank, naming the rank;
///                           checks that need the global sizes (labels, finiteness, sizes) then run and are agreed;
///              3. prepare   (ranks) gather K; size the engine for this rank's rows against every key;
///              4. rows      the engine's row phase: row statistics finished, each column's partial over these rows;
///              5. columns   (symmetric) combine the column partials (one process: its own; ranks: an all-reduce of
///                           the maxima, then of the rebased sums and the positives) and finish every column;
///              6. record    the loss, the largest logit and the non-finite flag, combined in rank order;
///   backward   7. agree     (ranks, a separate `backward` call only) the ranks' call, outputs and step;
///              8. gradients the engine's backward with the batch's coefficients (one process: straight into dq and
///                           dk; ranks: float partials, the key gradients reduce-scattered to their owners, rounded
///                           once);
///              9. record    d(loss_scale * loss)/d(log s) and the dQ/dK flags, combined in rank order.
/// A refused call writes nothing. An allocation or thread failure is an errc::resource_exhausted status (on every
/// rank), never an exception.
///
/// `Comm`: `distributed::comm::self` (one process: every collective is elided at compile time, K is read in place and
/// the gradients are written directly), `comm::local` (one process through the distributed algorithm's copies, which
/// tests it without MPI), `comm::mpi`, or any type with the collectives of distributed/communicator.hpp.

#include <contrastive/checks.hpp>
#include <contrastive/detail/checked.hpp>
#include <contrastive/distributed/agreement.hpp>
#include <contrastive/distributed/communicator.hpp>
#include <contrastive/host/engine.hpp>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/numeric/online_lse.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>
#include <contrastive/step/checkpoint.hpp>
#include <contrastive/step/logic.hpp>

#include <algorithm>
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
/// What the forward of a step found (over the whole batch; identical on every rank).
using forward_values = host::forward_result;
/// What the backward of a step found: d(loss_scale * loss)/d(log s) and whether dQ or dK held a non-finite value.
using backward_values = host::backward_result;

template <class Element, class Algorithm, class Gemm, class Comm>
class driver
{
  static_assert(is_element_type_v<Element>, "Element must be float, __half or __nv_bfloat16");
  static_assert(is_algorithm_v<Algorithm>,
                "Algorithm must be algorithm::fused, algorithm::materialized or algorithm::chunked");
  static_assert(is_gemm_v<Gemm>, "Gemm must be gemm::builtin or gemm::cblas");
  static_assert(distributed::is_communicator_v<Comm>,
                "Comm must be a communicator (distributed::comm::self, comm::local, or comm::mpi from "
                "<contrastive/distributed/mpi.hpp>)");

public:
  using problem_type = problem<Element>;
  using engine_type = host::engine<Element, Gemm>;
  /// One process without collectives (comm::self): K in place, gradients written directly, no agreement.
  static constexpr bool single = distributed::is_single_process_v<Comm>;
  /// Ranks with float gradients write them in place (no float partials of dq and dk besides the gathered dK's).
  static constexpr bool float_out = std::is_same_v<Element, float>;

  explicit driver(Comm comm = Comm{}, unsigned threads = 0) : comm_(std::move(comm)), engine_(threads) {}

  const Comm& communicator() const noexcept
  {
    return comm_;
  }
  unsigned threads() const noexcept
  {
    return engine_.threads();
  }
  /// algorithm::chunked only: rows per chunk, or the chunk buffer's budget (see chunk_options); applies from the next
  /// forward. Other algorithms refuse it (invalid_argument "chunk"), so a setting never silently does nothing.
  status set_chunk(const chunk_options& o)
  {
    if constexpr (!host::algorithm_traits<Algorithm>::chunks)
    {
      (void)o;
      return {errc::invalid_argument, "chunk", "chunk options apply to algorithm::chunked only"};
    }
    else
    {
      engine_.set_chunk(o);
      return {};
    }
  }
  /// algorithm::chunked: rows per chunk this rank's rows use (one process: against the problem's keys; ranks: against
  /// the global key count of the last agreed forward, or the problem's before any).
  std::size_t chunk_rows_for(const problem_type& p) const noexcept
  {
    problem_type block = p;
    if (!single && n_k_total_ != 0)
    {
      block.n_k = n_k_total_;
    }
    return engine_.chunk_rows_for(block);
  }
  /// The batch of the last agreed forward: total queries and keys, and this rank's first query and key index.
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
  /// Host bytes held between calls: the engine, and for ranks the gathered K, labels and float partials.
  std::size_t bytes_held() const noexcept
  {
    return engine_.bytes_held() + k_all_.capacity() * sizeof(Element) + labels_.capacity() * sizeof(std::int32_t) +
           (dq_f_.capacity() + dk_all_f_.capacity() + dk_f_.capacity() + col_a_.capacity() + col_b_.capacity()) *
               sizeof(float);
  }

  /// The caller's iteration of the last accepted forward (no_iteration if it gave none): what its backward and the
  /// step's finish_step agree on.
  std::int64_t iteration() const noexcept
  {
    return iteration_;
  }
  /// Whether a forward is ready for `backward`.
  bool forward_ready() const noexcept
  {
    return ready_;
  }
  const forward_values& last_forward() const noexcept
  {
    return fwd_;
  }
  const backward_values& last_backward() const noexcept
  {
    return bwd_;
  }
  /// The loss scale of the last backward (what its gradients are multiplied by).
  float last_loss_scale() const noexcept
  {
    return loss_scale_;
  }
  /// The last forward's finished log-sum-exps: this rank's rows (n_q floats), and (symmetric) this rank's keys'
  /// columns (n_k floats).
  void copy_lse(float* row_lse, float* col_lse) const
  {
    if (row_lse != nullptr)
    {
      std::copy(engine_.row_lse().begin(), engine_.row_lse().end(), row_lse);
    }
    if (col_lse != nullptr && p_.obj == objective::symmetric && engine_.col_lse().size() >= k_off_ + p_.n_k)
    {
      std::copy_n(engine_.col_lse().begin() + static_cast<std::ptrdiff_t>(k_off_), p_.n_k, col_lse);
    }
  }

  /// Phases 1-6 at logit scale `s` (s = 1/tau) and, for the sigmoid objective, logit bias `bias` (z = S + bias; the
  /// softmax objectives, invariant to it, take 0 only: invalid_argument "logit_bias"). `policies`: the caller's
  /// verdict on its own settings (a failure is returned, on every rank, after the problem's own checks).
  /// `need_grads`: dq/dk must be given (forward_backward: they are checked now, so that a refused call writes
  /// nothing). `step`, `iteration`: what the ranks agree on.
  status forward(const problem_type& p,
                 float s,
                 float bias,
                 const status& policies,
                 Element* dq,
                 Element* dk,
                 bool need_grads,
                 std::int64_t step,
                 std::int64_t iteration,
                 forward_values& out)
  {
    status local = check_problem(p, dq, dk, need_grads, /*check_labels=*/single);
    if (local.ok())
    {
      (void)(local = engine_type::check_dim(p.dim));
    }
    if (local.ok())
    {
      (void)(local = check_bias(p.obj, bias));
    }
    if (local.ok() && !policies.ok())
    {
      (void)(local = policies);
    }
    if (local.ok() && engine_.threads() > host::max_threads)
    {
      (void)(local = status{errc::invalid_argument,
                            "threads",
                            std::to_string(engine_.threads()) + " threads requested; at most " +
                                std::to_string(host::max_threads)});
    }
    if constexpr (single)
    {
      (void)step;
      CONTRASTIVE_RETURN_IF_ERROR(local);
      CONTRASTIVE_RETURN_IF_ERROR(distributed::agreement::check_iteration(iteration));
      CONTRASTIVE_RETURN_IF_ERROR(checks_with_totals(p, p.n_k));
      ready_ = false;
      n_q_total_ = p.n_q;
      n_k_total_ = p.n_k;
      q_off_ = k_off_ = 0;
      // forward_backward: the outputs are known now (the sigmoid objective's fused pass may accumulate in them).
      const std::size_t bytes = engine_.template bytes_for<Algorithm>(p, need_grads).value;
      CONTRASTIVE_RETURN_IF_ERROR(needs(guarded(
                                            [&]
                                            {
                                              engine_.template prepare<Algorithm>(
                                                  p, need_grads ? dq : nullptr, need_grads ? dk : nullptr);
                                            }),
                                        "the host engine",
                                        bytes,
                                        p));
      gc_ = make_grad_coefficients(p.obj, p.n_q, p.n_k);
      host::row_pass rp;
      CONTRASTIVE_RETURN_IF_ERROR(guarded(
          [&]
          {
            rp = engine_.template forward_rows<Algorithm>(s, bias);
          }));
      double col_loss_sum = 0.0;
      if (p.obj == objective::symmetric)
      {
        for (std::size_t j = 0; j < p.n_k; ++j)
        {
          const contrastive::row_loss rl =
              finish_row(engine_.template column_partial<Algorithm>(j), engine_.positive(j));
          engine_.set_column(j, rl);
          col_loss_sum += static_cast<double>(rl.loss);
        }
      }
      fwd_ = {batch_loss(p.obj, rp.row_loss_sum, col_loss_sum), rp.max_logit, rp.logits_nonfinite};
    }
    else
    {
      const float scalars[2] = {s, bias};
      CONTRASTIVE_RETURN_IF_ERROR(agree_on_problem(p,
                                                   step,
                                                   iteration,
                                                   local,
                                                   need_grads ? distributed::agreement::call_kind::forward_backward
                                                              : distributed::agreement::call_kind::forward,
                                                   scalars));
      ready_ = false;
      CONTRASTIVE_RETURN_IF_ERROR(gather_keys(p));
      const bool sym = p.obj == objective::symmetric;
      const problem_type block{p.q, k_all_.data(), p.n_q, n_k_total_, p.dim, labels_.data(), p.obj};
      const std::size_t bytes = engine_.template bytes_for<Algorithm>(block).value;
      CONTRASTIVE_RETURN_IF_ERROR(distributed::agreement::agree(comm_,
                                                                needs(guarded(
                                                                          [&]
                                                                          {
                                                                            engine_.template prepare<Algorithm>(block);
                                                                          }),
                                                                      "the host engine",
                                                                      bytes,
                                                                      p)));
      gc_ = make_grad_coefficients(p.obj, n_q_total_, n_k_total_);
      host::row_pass rp;
      status compute = guarded(
          [&]
          {
            rp = engine_.template forward_rows<Algorithm>(s, bias);
          });
      double col_loss_sum = 0.0;
      if (sym)
      {
        CONTRASTIVE_RETURN_IF_ERROR(combine_columns(p.n_q, compute, col_loss_sum));
      }
      // Every rank's rows, combined in rank order (identical bits everywhere); a failure on any rank is agreed on.
      const rank_forward mine{rp.row_loss_sum, static_cast<double>(rp.max_logit), rp.logits_nonfinite ? 1.0 : 0.0};
      std::vector<rank_forward> all;
      CONTRASTIVE_RETURN_IF_ERROR(gather(needs(compute, "the host engine mid-step", bytes, p), mine, all));
      double rows = 0.0;
      float max_logit = -contrastive::detail::infinity_f;
      bool logits_bad = false;
      for (const rank_forward& r : all)
      {
        rows += r.row_loss_sum;
        max_logit = contrastive::detail::max_nan(max_logit, static_cast<float>(r.max_logit));
        logits_bad |= r.logits_bad != 0.0;
      }
      fwd_ = {batch_loss(p.obj, rows, col_loss_sum), max_logit, logits_bad};
    }
    p_ = p;
    iteration_ = iteration;
    ready_ = true;
    out = fwd_;
    return {};
  }

  /// Phases 7-9 of the last forward at loss scale `loss_scale`: dq, dk (this rank's rows and keys, Element,
  /// multiplied by the loss scale). `agreed`: the call's outputs were checked and agreed on by `forward` (a
  /// forward_backward); otherwise the ranks agree on this call first.
  /// `checks`: the caller's verdict on its own arguments (e.g. the loss scale), returned like this call's own.
  status backward(float loss_scale,
                  Element* dq,
                  Element* dk,
                  bool agreed,
                  std::int64_t step,
                  backward_values& out,
                  const status& checks = status{})
  {
    status local;
    if (!checks.ok())
    {
      (void)(local = checks);
    }
    else if (!ready_)
    {
      (void)(local = status{
                 errc::invalid_argument, "forward", "backward needs a successful forward on the same problem first"});
    }
    else if (dq == nullptr)
    {
      (void)(local = status{errc::null_pointer, "dq", "null gradient output for q"});
    }
    else if (dk == nullptr)
    {
      (void)(local = status{errc::null_pointer, "dk", "null gradient output for k"});
    }
    else
    {
      (void)(local = check_outputs(p_, dq, dk));
    }
    if constexpr (single)
    {
      (void)agreed;
      (void)step;
      CONTRASTIVE_RETURN_IF_ERROR(local);
      backward_values br;
      CONTRASTIVE_RETURN_IF_ERROR(guarded(
          [&]
          {
            br = engine_.template backward<Algorithm>(loss_scale, gc_, dq, dk);
          }));
      bwd_ = br;
    }
    else
    {
      if (!agreed)
      {
        CONTRASTIVE_RETURN_IF_ERROR(distributed::agreement::agree_on_call(
            comm_, distributed::agreement::call_kind::backward, step, iteration_, local));
      }
      else
      {
        CONTRASTIVE_RETURN_IF_ERROR(distributed::agreement::agree(comm_, local));
      }
      ready_ = false; // every rank starts the engine's backward (materialized: dA overwrites the logits)
      const std::size_t d = p_.dim;
      backward_values br;
      // float: the engine writes this rank's dQ and the reduce-scatter its dK straight into dq and dk (as one
      // process's engine does: a failure agreed on below may leave them partly written); 16-bit: into float
      // partials, rounded once after the agreement, in the pass that tests them.
      float* const dq_out = float_out ? reinterpret_cast<float*>(dq) : dq_f_.data();
      float* const dk_out = float_out ? reinterpret_cast<float*>(dk) : dk_f_.data();
      status compute = guarded(
          [&]
          {
            br = engine_.template backward<Algorithm>(loss_scale, gc_, dq_out, dk_all_f_.data());
          });
      // dK back to its owners; a failure of the engine's work on any rank is agreed on before a result is used.
      CONTRASTIVE_RETURN_IF_ERROR(comm_.reduce_scatter_sum(dk_all_f_.data(), dk_counts_.data(), dk_out));
      CONTRASTIVE_RETURN_IF_ERROR(distributed::agreement::agree(comm_, compute));
      const rank_backward mine{static_cast<double>(br.grad_logit_scale),
                               round_into(dq_out, p_.n_q * d, dq) ? 1.0 : 0.0,
                               round_into(dk_out, p_.n_k * d, dk) ? 1.0 : 0.0,
                               static_cast<double>(br.grad_logit_bias)};
      std::vector<rank_backward> all;
      CONTRASTIVE_RETURN_IF_ERROR(gather(status{}, mine, all));
      double dlogs = 0.0, dbias = 0.0;
      bool dq_bad = false, dk_bad = false;
      for (const rank_backward& r : all)
      {
        dlogs += r.dlogs;
        dbias += r.dbias;
        dq_bad |= r.dq_bad != 0.0;
        dk_bad |= r.dk_bad != 0.0;
      }
      bwd_ = {static_cast<float>(dlogs), dq_bad, dk_bad, static_cast<float>(dbias)};
    }
    ready_ = false;
    loss_scale_ = loss_scale;
    out = bwd_;
    return {};
  }

private:
  struct rank_forward
  {
    double row_loss_sum, max_logit, logits_bad;
  };
  struct rank_backward
  {
    double dlogs, dq_bad, dk_bad, dbias;
  };

  /// The logit bias: finite, and 0 unless the objective is sigmoid (a softmax is invariant to it, so a nonzero one
  /// would do nothing: refused instead).
  static status check_bias(objective obj, float bias)
  {
    if (!contrastive::detail::finite(bias))
    {
      return {errc::invalid_argument, "logit_bias", "logit_bias = " + std::to_string(bias) + "; it must be finite"};
    }
    if (obj != objective::sigmoid && bias != 0.0f)
    {
      return {errc::invalid_argument,
              "logit_bias",
              "logit_bias = " + std::to_string(bias) + " with objective " + to_string(obj) +
                  ": the bias applies to objective::sigmoid only (a softmax is invariant to it); pass 0"};
    }
    return {};
  }

  /// The loss of the batch from its row (and column) loss sums.
  float batch_loss(objective obj, double row_loss_sum, double col_loss_sum) const noexcept
  {
    double total = row_loss_sum / static_cast<double>(n_q_total_);
    if (obj == objective::symmetric)
    {
      total = 0.5 * (total + col_loss_sum / static_cast<double>(n_k_total_));
    }
    return static_cast<float>(total);
  }

  /// Checks that need the batch's key count: labels (ranks: against the global keys; one process: check_problem
  /// read them), the sizes of every buffer, and finiteness (read last: it reads every element).
  status checks_with_totals(const problem_type& p, std::size_t n_k_total)
  {
    if (!single && p.labels != nullptr)
    {
      for (std::size_t i = 0; i < p.n_q; ++i)
      {
        if (p.labels[i] < 0 || static_cast<std::size_t>(p.labels[i]) >= n_k_total)
        {
          return {errc::label_out_of_range,
                  "labels",
                  "labels[" + std::to_string(i) + "] = " + std::to_string(p.labels[i]) +
                      " is outside the global keys [0, " + std::to_string(n_k_total) + ")"};
        }
      }
    }
    const problem_type block{p.q, p.k, p.n_q, n_k_total, p.dim, p.labels, p.obj};
    contrastive::detail::checked_size bytes = engine_.template bytes_for<Algorithm>(block);
    if (!single)
    {
      bytes = bytes + contrastive::detail::checked_size(n_k_total) * p.dim * (sizeof(Element) + sizeof(float));
    }
    if (!bytes.ok())
    {
      return {errc::size_overflow,
              single ? "n_q" : "n_k",
              "the engine's buffers for n_q = " + std::to_string(p.n_q) + ", n_k = " + std::to_string(n_k_total) +
                  ", dim = " + std::to_string(p.dim) + " (" + Algorithm::name + ") do not fit in size_t bytes"};
    }
    std::ptrdiff_t bad = 0;
    CONTRASTIVE_RETURN_IF_ERROR(guarded(
        [&]
        {
          bad = engine_.first_nonfinite(p); // on the worker pool, which may fail to start
        }));
    if (bad != 0)
    {
      return contrastive::detail::nonfinite_input(bad, p.dim);
    }
    return {};
  }

  /// Phase 2 for ranks (distributed/agreement.hpp); `scalars`: this rank's {s, b}, which every rank must share.
  status agree_on_problem(const problem_type& p,
                          std::int64_t step,
                          std::int64_t iteration,
                          const status& local,
                          distributed::agreement::call_kind kind,
                          const float* scalars)
  {
    // The batch's shape is kept only once every rank agreed: a refused call leaves the ready forward's shape (its
    // backward's counts and offsets) as it was.
    distributed::agreement::global_shape g;
    CONTRASTIVE_RETURN_IF_ERROR(distributed::agreement::agree_on_problem(
        comm_,
        p,
        step,
        iteration,
        local,
        g,
        [&](const distributed::agreement::global_shape& gs)
        {
          return checks_with_totals(p, gs.n_k_total);
        },
        kind,
        scalars));
    n_q_total_ = g.n_q_total;
    n_k_total_ = g.n_k_total;
    q_off_ = g.q_off;
    k_off_ = g.k_off;
    k_rows_ = std::move(g.k_rows);
    dk_counts_ = std::move(g.dk_counts);
    return {};
  }

  /// Phase 3 for ranks: this rank's buffers (agreed), K gathered in the element type, the rows' global labels.
  status gather_keys(const problem_type& p)
  {
    const bool sym = p.obj == objective::symmetric;
    const std::size_t d = p.dim;
    using contrastive::detail::checked_size;
    const checked_size alloc_bytes =
        checked_size(n_k_total_) * d * sizeof(Element) + checked_size(p.n_q) * sizeof(std::int32_t) +
        (checked_size(float_out ? 0 : p.n_q) * d + checked_size(n_k_total_) * d +
         checked_size(float_out ? 0 : p.n_k) * d + checked_size(sym ? n_k_total_ : 0) * std::size_t(3)) *
            sizeof(float);
    status alloc = guarded(
        [&]
        {
          k_all_.resize(n_k_total_ * d);
          labels_.resize(p.n_q);
          dq_f_.resize(float_out ? 0 : p.n_q * d);
          dk_all_f_.resize(n_k_total_ * d);
          dk_f_.resize(float_out ? 0 : p.n_k * d);
          col_a_.resize(sym ? n_k_total_ : 0);
          col_b_.resize(sym ? 2 * n_k_total_ : 0);
        });
    CONTRASTIVE_RETURN_IF_ERROR(
        distributed::agreement::agree(comm_, needs(alloc, "its buffers", alloc_bytes.value, p)));
    CONTRASTIVE_RETURN_IF_ERROR(comm_.allgatherv_rows(p.k, k_rows_.data(), d * sizeof(Element), k_all_.data()));
    for (std::size_t i = 0; i < p.n_q; ++i)
    {
      labels_[i] = static_cast<std::int32_t>(p.labels != nullptr ? p.labels[i] : q_off_ + i);
    }
    return {};
  }

  /// Phase 5 for ranks: each rank's partial column states over its rows, combined (max, then the rescaled sums and
  /// the positives); `col_loss_sum` is the sum of the finished column losses (identical on every rank). If this
  /// rank's forward failed (`compute`; its engine may be released) it still takes part in both reductions, with
  /// neutral partials, so the others are not left waiting; the step is refused on every rank afterwards.
  status combine_columns(std::size_t n_local, const status& compute, double& col_loss_sum)
  {
    const std::size_t n = n_k_total_;
    const bool local_ok = compute.ok();
    for (std::size_t j = 0; j < n; ++j)
    {
      col_a_[j] = local_ok ? engine_.template column_partial<Algorithm>(j).max : -contrastive::detail::infinity_f;
    }
    CONTRASTIVE_RETURN_IF_ERROR(comm_.allreduce(col_a_.data(), n, distributed::reduce_op::max));
    float* sums = col_b_.data();
    float* pos = col_b_.data() + n;
    for (std::size_t j = 0; j < n; ++j)
    {
      online_lse st = local_ok ? engine_.template column_partial<Algorithm>(j) : online_lse{};
      st.rebase(col_a_[j] == -contrastive::detail::infinity_f ? st.max : col_a_[j]);
      sums[j] = st.max == -contrastive::detail::infinity_f ? 0.0f : st.sum;
      pos[j] = 0.0f;
    }
    // Column j's positive is global query j: owned by the rank whose queries start at q_off_.
    for (std::size_t i = 0; local_ok && i < n_local; ++i)
    {
      pos[q_off_ + i] = engine_.positive(i);
    }
    CONTRASTIVE_RETURN_IF_ERROR(comm_.allreduce(col_b_.data(), 2 * n, distributed::reduce_op::sum));
    col_loss_sum = 0.0;
    for (std::size_t j = 0; local_ok && j < n; ++j)
    {
      const contrastive::row_loss rl = finish_row(online_lse{col_a_[j], sums[j]}, pos[j]);
      engine_.set_column(j, rl);
      col_loss_sum += static_cast<double>(rl.loss);
    }
    return {};
  }

  /// All-gathers each rank's `mine` (rank order) after agreeing on `local` (one collective when every rank is fine).
  template <class R>
  status gather(const status& local, const R& mine, std::vector<R>& all)
  {
    struct msg
    {
      std::int64_t code;
      R value;
    };
    const msg m{static_cast<std::int64_t>(local.code()), mine};
    std::vector<msg> got(static_cast<std::size_t>(comm_.size()));
    CONTRASTIVE_RETURN_IF_ERROR(comm_.allgather(&m, sizeof m, got.data()));
    for (const msg& g : got)
    {
      if (g.code != 0)
      {
        return distributed::agreement::agree(comm_, local); // every rank saw the same codes: every rank takes part
      }
    }
    all.resize(got.size());
    for (std::size_t r = 0; r < got.size(); ++r)
    {
      all[r] = got[r].value;
    }
    return {};
  }

  /// Rounds float gradients to the element type; returns whether any result is non-finite.
  static bool round_into(const float* in, std::size_t n, Element* out) noexcept
  {
    float poison = 0.0f;
    if constexpr (float_out)
    {
      (void)out; // in == out: only the test
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

  /// A resource failure of `what` with the bytes it asked for (other statuses unchanged).
  status needs(const status& st, const char* what, std::size_t bytes, const problem_type& p) const
  {
    if (st.code() != errc::resource_exhausted)
    {
      return st;
    }
    if constexpr (single)
    {
      return {errc::resource_exhausted,
              "memory",
              std::string(what) + " needs " + std::to_string(bytes) + " bytes for n_q = " + std::to_string(p.n_q) +
                  ", n_k = " + std::to_string(p.n_k) + ", dim = " + std::to_string(p.dim) + " (" + Algorithm::name +
                  "): " + st.reason()};
    }
    else
    {
      return {errc::resource_exhausted,
              st.argument(),
              std::string(what) + " needs " + std::to_string(bytes) + " bytes on this rank (n_q = " +
                  std::to_string(p.n_q) + ", global n_k = " + std::to_string(n_k_total_) +
                  ", dim = " + std::to_string(p.dim) + ", " + Algorithm::name + "): " + st.reason()};
    }
  }

  /// Runs `f` (allocation or engine work) and turns an exception into a status: nothing escapes to the caller. An
  /// allocation failure releases the engine (a half-sized engine holds no memory) and no forward stays ready.
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
      return fail("memory", "a buffer of the host engine could not be allocated", true);
    }
    catch (const std::length_error&)
    {
      return fail("memory", "a buffer of the host engine exceeds the largest possible allocation", true);
    }
    catch (const std::system_error& e)
    {
      return fail("threads", std::string("the system refused a resource: ") + e.what(), single);
    }
    catch (...)
    {
      return fail("memory", "an allocation failed", true);
    }
  }
  status fail(const char* what, std::string message, bool release)
  {
    if (release)
    {
      engine_.release();
    }
    ready_ = false;
    return {errc::resource_exhausted, what, std::move(message)};
  }

  Comm comm_;
  engine_type engine_;
  problem_type p_{}; ///< this rank's problem of the ready forward (its outputs' shapes and inputs)
  bool ready_ = false;
  std::int64_t iteration_ = distributed::no_iteration;
  grad_coefficients gc_{};
  forward_values fwd_{};
  backward_values bwd_{};
  float loss_scale_ = 1.0f;
  std::size_t n_q_total_ = 0, n_k_total_ = 0, q_off_ = 0, k_off_ = 0;
  // Ranks only: the agreed counts, the gathered keys, the rows' global labels, float partials (dq_f_ and dk_f_ for
  // 16-bit elements only), column statistics.
  std::vector<int> k_rows_, dk_counts_;
  std::vector<Element> k_all_;
  std::vector<std::int32_t> labels_;
  std::vector<float> dq_f_, dk_all_f_, dk_f_, col_a_, col_b_;
};
/// What every front end over a driver (basic_loss, core) exposes unchanged: the configuration, the sizes, the batch of
/// the last agreed forward and what the last forward and backward found. The front end adds its calls.
template <class Driver>
class front
{
public:
  using problem_type = typename Driver::problem_type;

  unsigned threads() const noexcept
  {
    return driver_.threads();
  }
  /// The communicator (comm::self for one process).
  decltype(auto) communicator() const noexcept
  {
    return driver_.communicator();
  }
  /// algorithm::chunked only: rows per chunk, or the chunk buffer's budget (see chunk_options); applies from the next
  /// call. Other algorithms refuse it (invalid_argument "chunk"), so a setting never silently does nothing.
  status set_chunk(const chunk_options& o)
  {
    return driver_.set_chunk(o);
  }
  /// algorithm::chunked: rows per chunk a problem would use (a multiple of the row block, at most all rows).
  std::size_t chunk_rows_for(const problem_type& p) const noexcept
  {
    return driver_.chunk_rows_for(p);
  }
  /// Bytes of host memory held between calls (operands, saved statistics, scratch, materialized logits; ranks: also
  /// the gathered K and the float partials).
  std::size_t bytes_held() const noexcept
  {
    return driver_.bytes_held();
  }
  /// The batch of the last agreed forward: total queries and keys, and this rank's first query and key index.
  std::size_t global_queries() const noexcept
  {
    return driver_.global_queries();
  }
  std::size_t global_keys() const noexcept
  {
    return driver_.global_keys();
  }
  std::size_t query_offset() const noexcept
  {
    return driver_.query_offset();
  }
  std::size_t key_offset() const noexcept
  {
    return driver_.key_offset();
  }
  /// What the last successful forward saw (loss, largest logit, whether a logit was non-finite) and the last backward
  /// produced (whether dQ/dK held a non-finite value, d(loss_scale * loss)/d(log s)).
  const forward_values& last_forward() const noexcept
  {
    return driver_.last_forward();
  }
  const backward_values& last_backward() const noexcept
  {
    return driver_.last_backward();
  }

protected:
  template <class... Args>
  explicit front(Args&&... args) : driver_(std::forward<Args>(args)...)
  {
  }
  /// The first non-finite site of the last forward + backward pair, in the order of `step_record::first_nonfinite`
  /// (d loss / d log s counts when `wants_gradient`, d loss / d b when `wants_bias_gradient`), from the unscaled
  /// gradients as a step record has them (a scaled value can be finite where its division by a small loss scale is
  /// not).
  nonfinite_site first_nonfinite(bool wants_gradient, bool wants_bias_gradient = false) const noexcept
  {
    const forward_values& f = driver_.last_forward();
    const backward_values& b = driver_.last_backward();
    const float ls = driver_.last_loss_scale();
    const nonfinite_site site = detail::first_nonfinite(
        f.logits_nonfinite, f.loss, b.dq_nonfinite, b.dk_nonfinite, wants_gradient, b.grad_logit_scale / ls);
    if (site == nonfinite_site::none && wants_bias_gradient && !detail::finite(b.grad_logit_bias / ls))
    {
      return nonfinite_site::grad_logit_bias;
    }
    return site;
  }

  Driver driver_;
};
} // namespace step
} // namespace contrastive
