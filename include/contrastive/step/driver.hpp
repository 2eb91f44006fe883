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
/// tests it without MPI), `comm::mpi`, or any type with the collectives of comm/communicator.hpp.

#include <contrastive/checks.hpp>
#include <contrastive/comm/agreement.hpp>
#include <contrastive/comm/communicator.hpp>
#include <contrastive/detail/checked.hpp>
#include <contrastive/host/engine.hpp>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/groups.hpp>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/numeric/online_lse.hpp>
#include <contrastive/objectives/objectives.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>
#include <contrastive/step/checkpoint.hpp>
#include <contrastive/step/logic.hpp>
#include <contrastive/step/phases.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
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
  static_assert(is_algorithm_v<Algorithm> || std::is_same_v<Algorithm, algorithm::automatic>,
                "Algorithm must be algorithm::fused, algorithm::materialized, algorithm::chunked or "
                "algorithm::automatic");
  static_assert(!std::is_same_v<Algorithm, algorithm::automatic> || distributed::is_single_process_v<Comm>,
                "algorithm::automatic decides per process from its own memory: a distributed loss needs one algorithm "
                "on every rank (choose fused, materialized or chunked)");
  static_assert(is_gemm_v<Gemm>, "Gemm must be gemm::builtin or gemm::cblas");
  static_assert(distributed::is_communicator_v<Comm>,
                "Comm must be a communicator (distributed::comm::self, comm::local, or comm::mpi from "
                "<contrastive/comm/mpi.hpp>)");

public:
  using problem_type = problem<Element>;
  using engine_type = host::engine<Element, Gemm>;
  /// One process without collectives (comm::self): K in place, gradients written directly, no agreement.
  static constexpr bool single = distributed::is_single_process_v<Comm>;
  /// Ranks with float gradients write them in place (no float partials of dq and dk besides the gathered dK's).
  static constexpr bool float_out = rank_buffers<Element>::float_out;

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
  /// algorithm::automatic only: the memory budget its choice compares materialized's bytes with (0: a quarter of the
  /// memory available at each call). Other algorithms refuse it (invalid_argument "budget").
  status set_memory_budget(std::size_t bytes)
  {
    if constexpr (!std::is_same_v<Algorithm, algorithm::automatic>)
    {
      (void)bytes;
      return {errc::invalid_argument, "budget", "a memory budget applies to algorithm::automatic only"};
    }
    else
    {
      engine_.set_memory_budget(bytes);
      return {};
    }
  }
  /// The budget algorithm::automatic uses now (the one set, else a quarter of the available memory).
  std::size_t memory_budget() const noexcept
  {
    return engine_.memory_budget();
  }
  /// Whether algorithm::automatic would choose materialized for `p` at logit scale `s` now (false for every other
  /// algorithm).
  bool materializes(const problem_type& p, float s) const noexcept
  {
    if constexpr (std::is_same_v<Algorithm, algorithm::automatic>)
    {
      return engine_.materializes(p, true, s);
    }
    else
    {
      (void)p;
      (void)s;
      return false;
    }
  }
  /// The algorithm the last call ran ("none" before the first): Algorithm's name, or automatic's choice.
  const char* algorithm_used() const noexcept
  {
    return engine_.algorithm_used();
  }
  /// algorithm::chunked: rows per chunk this rank's rows use (one process: against the problem's keys; ranks: against
  /// the global key count of the last agreed forward, or the problem's before any).
  std::size_t chunk_rows_for(const problem_type& p) const noexcept
  {
    problem_type block = p;
    if (!single && batch_.n_k_total != 0)
    {
      block.n_k = batch_.n_k_total;
    }
    return engine_.chunk_rows_for(block);
  }
  /// The batch of the last agreed forward: total queries and keys, and this rank's first query and key index.
  const batch_extent& batch() const noexcept
  {
    return batch_;
  }
  /// Host bytes held between calls: the engine, and for ranks the gathered K, labels and float partials.
  std::size_t bytes_held() const noexcept
  {
    return engine_.bytes_held() + ranks_.bytes_held() + groups_.bytes_held();
  }

  /// The caller's iteration of the last accepted forward (no_iteration if it gave none): what its backward and the
  /// step's finish_step agree on.
  std::int64_t iteration() const noexcept
  {
    return iteration_;
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
    // The column statistics exist for an objective with columns only (the engine sizes them 0 otherwise).
    if (col_lse != nullptr && engine_.col_lse().size() >= batch_.k_off + p_.n_k)
    {
      std::copy_n(engine_.col_lse().begin() + static_cast<std::ptrdiff_t>(batch_.k_off), p_.n_k, col_lse);
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
    // The objective becomes a type here, once per call; an unknown one runs as symmetric only as far as
    // check_problem, which refuses it (on every rank, after the agreement).
    return objectives::visit(p,
                             [&](auto o)
                             {
                               return forward_as<decltype(o)>(
                                   p, s, bias, policies, dq, dk, need_grads, step, iteration, out);
                             });
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
    return objectives::visit(p_,
                             [&](auto o)
                             {
                               return backward_as<decltype(o)>(loss_scale, dq, dk, agreed, step, out, checks);
                             });
  }

private:
  /// `forward` for objective O.
  template <class O>
  status forward_as(const problem_type& p,
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
      (void)(local = objectives::check_logit_bias<O>(bias));
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
      CONTRASTIVE_RETURN_IF_ERROR(checks_with_totals<O>(p, p.n_k));
      ready_ = false;
      batch_ = {p.n_q, p.n_k, 0, 0};
    }
    else
    {
      const float scalars[2] = {s, bias};
      CONTRASTIVE_RETURN_IF_ERROR(agree_on_problem<O>(p,
                                                      step,
                                                      iteration,
                                                      local,
                                                      need_grads ? distributed::agreement::call_kind::forward_backward
                                                                 : distributed::agreement::call_kind::forward,
                                                      scalars));
      ready_ = false;
      CONTRASTIVE_RETURN_IF_ERROR(gather_keys<O>(p));
    }
    CONTRASTIVE_RETURN_IF_ERROR(count_groups<O>(p));
    // The engine, sized for this rank's rows against every key; one process's forward_backward passes its outputs
    // now (the sigmoid objective's fused pass may accumulate in them). Group ids with one positive per row run as
    // labels (the diagonal, symmetric).
    problem_type block = p;
    if (!single)
    {
      block.k = ranks_.k_all.data();
      block.n_k = batch_.n_k_total;
      block.labels = ranks_.labels.data();
    }
    else if (p.grouped())
    {
      block.labels = grouped_ || !O::takes_labels ? nullptr : groups_.labels.data();
    }
    // A grouped step's engine sizes its positives' buffers from the ids; it reads them through set_groups.
    if (!grouped_)
    {
      block.query_groups = block.key_groups = nullptr;
    }
    const bool outputs = single && need_grads;
    std::size_t bytes = 0;
    if constexpr (std::is_same_v<Algorithm, algorithm::automatic>)
    {
      // Decided once, at this call's logit scale: the bytes a refusal quotes are those of the algorithm the prepare
      // runs.
      bytes = engine_.decide(block, outputs, s)
                  ? engine_.template bytes_for_objective<algorithm::materialized, O>(block, outputs).value
                  : engine_.template bytes_for_objective<algorithm::fused, O>(block, outputs).value;
    }
    else
    {
      bytes = engine_.template bytes_for<Algorithm>(block, outputs).value; // automatic excluded above
    }
    status prepared =
        needs(guarded(
                  [&]
                  {
                    engine_.template prepare<Algorithm>(block, outputs ? dq : nullptr, outputs ? dk : nullptr);
                  }),
              "the host engine",
              bytes,
              p);
    if constexpr (!single)
    {
      (void)(prepared = distributed::agreement::agree(comm_, prepared));
    }
    CONTRASTIVE_RETURN_IF_ERROR(prepared);
    engine_.set_groups(grouped_ ? groups_.view(single ? p.query_groups : ranks_.q_ids.data() + batch_.q_off,
                                               single ? p.key_groups : ranks_.k_ids.data())
                                : group_view{});
    gc_ = grouped_ ? O::grouped_coefficients(batch_.n_q_total, groups_.rows_with_positive, groups_.cols_with_positive)
                   : O::coefficients(batch_.n_q_total, batch_.n_k_total);
    const bool grouped_columns = grouped_ && O::columns;
    host::row_pass rp;
    const status compute = guarded(
        [&]
        {
          rp = engine_.template forward_rows<Algorithm, O>(s, bias);
        });
    double col_loss_sum = 0.0;
    if constexpr (single)
    {
      CONTRASTIVE_RETURN_IF_ERROR(compute);
      if constexpr (O::columns)
      {
        col_loss_sum = finish_columns<Algorithm>(engine_, p.n_k, grouped_columns);
      }
    }
    else
    {
      if constexpr (O::columns)
      {
        CONTRASTIVE_RETURN_IF_ERROR(combine_columns<Algorithm>(
            comm_, engine_, ranks_, p.n_q, batch_.q_off, compute, grouped_columns, col_loss_sum));
      }
      // Every rank's rows, combined in rank order (identical bits everywhere); a failure on any rank is agreed on.
      const rank_forward mine{rp.row_loss_sum, static_cast<double>(rp.max_logit), rp.logits_nonfinite ? 1.0 : 0.0};
      std::vector<rank_forward> all;
      CONTRASTIVE_RETURN_IF_ERROR(gather_ranks(comm_, needs(compute, "the host engine mid-step", bytes, p), mine, all));
      rp = combine_ranks(all);
    }
    fwd_ = {grouped_ ? O::grouped_mean(batch_.n_q_total,
                                       groups_.rows_with_positive,
                                       groups_.cols_with_positive,
                                       rp.row_loss_sum,
                                       col_loss_sum)
                     : O::mean(batch_.n_q_total, batch_.n_k_total, rp.row_loss_sum, col_loss_sum),
            rp.max_logit,
            rp.logits_nonfinite};
    p_ = p;
    iteration_ = iteration;
    ready_ = true;
    out = fwd_;
    return {};
  }

  /// `backward` for objective O (the last forward's).
  template <class O>
  status backward_as(float loss_scale,
                     Element* dq,
                     Element* dk,
                     bool agreed,
                     std::int64_t step,
                     backward_values& out,
                     const status& checks)
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
            br = engine_.template backward<Algorithm, O>(loss_scale, gc_, dq, dk);
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
      float* const dq_out = float_out ? reinterpret_cast<float*>(dq) : ranks_.dq_f.data();
      float* const dk_out = float_out ? reinterpret_cast<float*>(dk) : ranks_.dk_f.data();
      status compute = guarded(
          [&]
          {
            br = engine_.template backward<Algorithm, O>(loss_scale, gc_, dq_out, ranks_.dk_all_f.data());
          });
      // dK back to its owners; a failure of the engine's work on any rank is agreed on before a result is used.
      CONTRASTIVE_RETURN_IF_ERROR(comm_.reduce_scatter_sum(ranks_.dk_all_f.data(), ranks_.dk_counts.data(), dk_out));
      CONTRASTIVE_RETURN_IF_ERROR(distributed::agreement::agree(comm_, compute));
      const rank_backward mine{static_cast<double>(br.grad_logit_scale),
                               round_into(dq_out, p_.n_q * d, dq) ? 1.0 : 0.0,
                               round_into(dk_out, p_.n_k * d, dk) ? 1.0 : 0.0,
                               static_cast<double>(br.grad_logit_bias)};
      std::vector<rank_backward> all;
      CONTRASTIVE_RETURN_IF_ERROR(gather_ranks(comm_, status{}, mine, all));
      bwd_ = combine_ranks(all);
    }
    ready_ = false;
    loss_scale_ = loss_scale;
    out = bwd_;
    return {};
  }

  /// Checks that need the batch's key count: labels (ranks: against the global keys; one process: check_problem
  /// read them), the sizes of every buffer, and finiteness (read last: it reads every element).
  template <class O>
  status checks_with_totals(const problem_type& p, std::size_t n_k_total)
  {
    if (!single)
    {
      CONTRASTIVE_RETURN_IF_ERROR(check_label_range(p.labels, p.n_q, n_k_total, true));
    }
    problem_type block = p;
    block.n_k = n_k_total;
    const detail::checked_size bytes =
        engine_.template bytes_for<Algorithm>(block) +
        (single
             ? detail::checked_size(0)
             : rank_buffers<Element>::bytes_for(p.n_q, p.n_k, n_k_total, p.dim, O::columns, O::softmax && p.grouped()));
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
      return detail::nonfinite_input(bad, p.dim);
    }
    return {};
  }

  /// Phase 2 for ranks (comm/agreement.hpp); `scalars`: this rank's {s, b}, which every rank must share.
  template <class O>
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
          return checks_with_totals<O>(p, gs.n_k_total);
        },
        kind,
        scalars));
    batch_ = {g.n_q_total, g.n_k_total, g.q_off, g.k_off};
    ranks_.q_rows = std::move(g.q_rows);
    ranks_.k_rows = std::move(g.k_rows);
    ranks_.dk_counts = std::move(g.dk_counts);
    return {};
  }

  /// Phase 3 for ranks: this rank's buffers (agreed), K gathered in the element type, the rows' global labels.
  template <class O>
  status gather_keys(const problem_type& p)
  {
    constexpr bool sym = O::columns;
    const bool grouped = O::softmax && p.grouped();
    const std::size_t d = p.dim;
    status alloc = guarded(
        [&]
        {
          ranks_.resize(p.n_q, p.n_k, batch_.n_k_total, d, sym, grouped);
        });
    CONTRASTIVE_RETURN_IF_ERROR(distributed::agreement::agree(
        comm_,
        needs(alloc,
              "its buffers",
              rank_buffers<Element>::bytes_for(p.n_q, p.n_k, batch_.n_k_total, d, sym, grouped).value,
              p)));
    CONTRASTIVE_RETURN_IF_ERROR(
        comm_.allgatherv_rows(p.k, ranks_.k_rows.data(), d * sizeof(Element), ranks_.k_all.data()));
    for (std::size_t i = 0; i < p.n_q; ++i)
    {
      ranks_.labels[i] = static_cast<std::int32_t>(p.labels != nullptr ? p.labels[i] : batch_.q_off + i);
    }
    if (p.grouped()) // bytes, not gradients: every rank's ids, so that each rank counts the whole batch's groups
    {
      CONTRASTIVE_RETURN_IF_ERROR(distributed::agreement::agree(comm_,
                                                                guarded(
                                                                    [&]
                                                                    {
                                                                      ranks_.q_ids.resize(batch_.n_q_total);
                                                                      ranks_.k_ids.resize(batch_.n_k_total);
                                                                    })));
      CONTRASTIVE_RETURN_IF_ERROR(
          comm_.allgatherv_rows(p.query_groups, ranks_.q_rows.data(), sizeof(std::int64_t), ranks_.q_ids.data()));
      CONTRASTIVE_RETURN_IF_ERROR(
          comm_.allgatherv_rows(p.key_groups, ranks_.k_rows.data(), sizeof(std::int64_t), ranks_.k_ids.data()));
    }
    return {};
  }

  /// The batch's groups (numeric/groups.hpp), after every rank's ids are here: grouped_ unless every query has one
  /// positive, which then runs as labels (ranks: this rank's rows' global positives into its labels).
  template <class O>
  status count_groups(const problem_type& p)
  {
    grouped_ = false;
    if (!p.grouped())
    {
      groups_ = group_weights{}; // released: a grouped step may have sized them
      return {};
    }
    status counted = guarded(
        [&]
        {
          if constexpr (single)
          {
            groups_.template compute<O>(p.query_groups, p.n_q, p.key_groups, p.n_k, 0, p.n_q);
          }
          else
          {
            groups_.template compute<O>(
                ranks_.q_ids.data(), batch_.n_q_total, ranks_.k_ids.data(), batch_.n_k_total, batch_.q_off, p.n_q);
          }
        });
    if constexpr (!single)
    {
      (void)(counted = distributed::agreement::agree(comm_, counted));
    }
    CONTRASTIVE_RETURN_IF_ERROR(counted);
    grouped_ = !groups_.single_positive;
    if (!single && groups_.single_positive && O::takes_labels)
    {
      std::copy(groups_.labels.begin(), groups_.labels.end(), ranks_.labels.begin());
    }
    return {};
  }

  /// A resource failure of `what` with the bytes it asked for (other statuses unchanged).
  status needs(const status& st, const char* what, std::size_t bytes, const problem_type& p) const
  {
    return with_bytes(st, what, bytes, p.n_q, single ? p.n_k : batch_.n_k_total, p.dim, Algorithm::name, !single);
  }

  /// Runs `f` (allocation or engine work) and turns an exception into a status (`guard_resources`): nothing escapes
  /// to the caller. An allocation failure releases the engine (a half-sized engine holds no memory), and so does a
  /// refused thread for one process; no forward stays ready.
  template <class F>
  status guarded(F&& f)
  {
    status st = guard_resources(std::forward<F>(f));
    if (!st.ok())
    {
      if (single || st.argument() != std::string("threads"))
      {
        engine_.release();
      }
      ready_ = false;
    }
    return st;
  }

  Comm comm_;
  engine_type engine_;
  problem_type p_{}; ///< this rank's problem of the ready forward (its outputs' shapes and inputs)
  bool ready_ = false;
  std::int64_t iteration_ = distributed::no_iteration;
  grad_coefficients gc_{};
  group_weights groups_; ///< the last forward's group counts and weights (group ids only)
  bool grouped_ = false; ///< the last forward runs the grouped tiles (group ids with a row of several positives)
  forward_values fwd_{};
  backward_values bwd_{};
  float loss_scale_ = 1.0f;
  batch_extent batch_;          ///< the batch of the last agreed forward
  rank_buffers<Element> ranks_; ///< ranks only: the gathered keys, labels, float partials, column statistics
};
} // namespace step
} // namespace contrastive
