// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `contrastive::basic_loss<Element, Temperature, Scaler, Algorithm, Comm, Gemm>`: the policies of a training step
/// (temperature, loss scaler, step count) over the step driver (step/driver.hpp), which does the work. One process
/// is `contrastive::loss` (Comm = comm::self, <contrastive/loss.hpp>); the global batch over ranks is
/// `contrastive::distributed::loss` (<contrastive/distributed/loss.hpp>). Both are this class.
///
/// A step runs, in this order:
///   1. validate every input and policy setting (a failure returns a status and changes nothing; ranks: on every
///      rank, naming the rank);
///   2. forward at tau = Temperature::tau(), backward of loss_scale * loss (dQ, dK in Element, still scaled: they are
///      activation gradients the caller back-propagates further);
///   3. unscale-and-check: d(loss)/d(log s) is divided by the loss scale, and every gradient is tested for finiteness
///      in the pass that produces it (dQ/dK are tested on their scaled Element values; caller gradients passed to
///      `unscale_and_check` are tested *after* unscaling, in the same pass that multiplies them by 1/loss_scale);
///   4. `finish_step`: the scaler's `update(found_inf)`; then, only if the step was finite, the temperature's
///      `advance(grad)` (ranks: after agreeing on the earliest non-finite site over all ranks, so the policies step
///      in lockstep, as DDP + GradScaler do).
/// `step()` is 2-4 at once for callers whose only gradients are dQ and dK.
///
/// Ranks must make the same calls in the same order. The step count travels with every call, so a rank that is a
/// call behind or ahead (a finish_step skipped, a different checkpoint restored) is refused on every rank at the
/// first wrong call (errc::invalid_argument, "step", naming the ranks and their steps). A rank that skips a *whole*
/// step is only seen if the caller also gives `iteration` (its own step number, the same on every rank): the loss
/// cannot know which batch a call is for.

#include <contrastive/checks.hpp>
#include <contrastive/comm/agreement.hpp>
#include <contrastive/comm/communicator.hpp>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/objectives/objectives.hpp>
#include <contrastive/policy/bias.hpp>
#include <contrastive/policy/scaler.hpp>
#include <contrastive/policy/temperature.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>
#include <contrastive/step/checkpoint.hpp>
#include <contrastive/step/front.hpp>
#include <contrastive/step/logic.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

namespace contrastive
{
/// The stateful training step (see the file comment): temperature and loss-scaler policies, the step count and the
/// sigmoid objective's logit bias over the step driver; one process, or the ranks of `Comm`.
template <class Element,
          class Temperature = temperature::learnable,
          class Scaler = scaler::static_scale,
          class Algorithm = algorithm::fused,
          class Comm = distributed::comm::self,
          class Gemm = gemm::builtin>
class basic_loss : public step::front<step::driver<Element, Algorithm, Gemm, Comm>>
{
  static_assert(temperature::is_temperature_policy_v<Temperature>,
                "Temperature must be a trivially copyable policy with is_learnable, scale(), tau(), "
                "wants_gradient(), advance(float) and validate()");
  static_assert(
      scaler::is_scaler_policy_v<Scaler>,
      "Scaler must be a trivially copyable policy with is_dynamic, loss_scale(), update(bool) and validate()");
  using driver_type = step::driver<Element, Algorithm, Gemm, Comm>;
  using base = step::front<driver_type>;
  using base::driver_;

public:
  /// The element type of q, k, dq and dk (float, __half or __nv_bfloat16).
  using element_type = Element;
  /// The temperature policy.
  using temperature_type = Temperature;
  /// The loss-scaler policy.
  using scaler_type = Scaler;
  /// The algorithm tag (algorithm::fused, materialized or chunked).
  using algorithm_type = Algorithm;
  /// The host GEMM core tag (gemm::builtin or gemm::cblas).
  using gemm_type = Gemm;
  /// The communicator (distributed::comm::self for one process).
  using comm_type = Comm;
  /// The inputs of one call, in Element (this rank's rows over ranks).
  using problem_type = problem<Element>;

  /// Everything a training run must save to resume bit-exactly (trivially copyable).
  using checkpoint = detail::checkpoint<Temperature, Scaler>;

  /// One process (Comm = comm::self).
  template <class C = Comm, std::enable_if_t<distributed::is_single_process_v<C>, int> = 0>
  explicit basic_loss(Temperature t = Temperature{}, Scaler s = Scaler{}, unsigned threads = 0)
      : base(Comm{}, threads), temperature_(t), scaler_(s)
  {
  }
  /// Ranks: construct on every rank with the same policies (a communicator constructor may itself be a collective).
  template <class C = Comm, std::enable_if_t<!distributed::is_single_process_v<C>, int> = 0>
  explicit basic_loss(Comm comm = Comm{}, Temperature t = Temperature{}, Scaler s = Scaler{}, unsigned threads = 0)
      : base(std::move(comm), threads), temperature_(t), scaler_(s)
  {
  }

  /// The temperature policy as it stands: moved by each finite step's `finish_step`.
  const Temperature& temperature() const noexcept
  {
    return temperature_;
  }
  /// The loss scaler as it stands: updated by every `finish_step`.
  const Scaler& scaler() const noexcept
  {
    return scaler_;
  }
  /// Steps finished (`finish_step` calls that succeeded, skipped steps included), or the count restored.
  std::int64_t steps() const noexcept
  {
    return step_;
  }
  /// The temperature the next step runs at.
  float tau() const noexcept
  {
    return temperature_.tau();
  }
  /// The loss scale the next backward multiplies the loss by.
  float loss_scale() const noexcept
  {
    return scaler_.loss_scale();
  }
  using base::materializes;
  /// algorithm::automatic: whether the next call on `p` would run materialized, at the logit scale the temperature
  /// policy gives now (1 / tau()); false for the other algorithms.
  bool materializes(const problem_type& p) const noexcept
  {
    return base::materializes(p, temperature_.scale());
  }
  /// The temperature optimiser's settings (learning rate, betas, ...), e.g. for a learning-rate schedule; its state
  /// (moments, step count) and theta are kept. Refused, changing nothing, when the settings are out of their domain
  /// (invalid_temperature "optimizer") or the policy has no optimiser (invalid_argument "optimizer": fixed, schedule).
  /// Ranks: local; set the same on every rank.
  status set_temperature_optimizer(const optimizer& o)
  {
    if constexpr (!temperature::has_optimizer_v<Temperature>)
    {
      (void)o;
      return {errc::invalid_argument, "optimizer", "this temperature policy has no optimizer"};
    }
    else
    {
      if (!o.valid())
      {
        return {errc::invalid_temperature,
                "optimizer",
                "optimizer settings out of range (0 <= lr < 1e30, 0 <= betas/momentum < 1, 0 < eps < 1e30)"};
      }
      temperature_.opt = o;
      return {};
    }
  }

  /// The sigmoid objective's logit bias (z = s <q, k> + b): `logit_bias::fixed(b)` or `logit_bias::learnable(b,
  /// optimizer)` (SigLIP: learnable from -10). Default: fixed at 0. Refused, changing nothing, when out of its domain
  /// (invalid_argument "logit_bias"). A step of a softmax objective refuses a nonzero or learnable bias. Ranks: local;
  /// set the same on every rank. Set it between steps: a bias set between forward_backward and finish_step is the one
  /// finish_step moves, by the gradient computed at the bias the step used (`rec.logit_bias`).
  status set_logit_bias(const logit_bias& b)
  {
    if (const char* why = b.validate(); why[0] != '\0')
    {
      return {errc::invalid_argument, "logit_bias", why};
    }
    bias_ = b;
    return {};
  }
  /// The sigmoid objective's logit bias as it stands (value and, if learnable, optimiser state).
  const logit_bias& bias() const noexcept
  {
    return bias_;
  }

  /// The whole state. Byte-deterministic (padding zeroed, members copied as bytes): two saves of the same state
  /// compare equal with memcmp, so a checkpoint can be checksummed or compared as a blob.
  checkpoint save() const noexcept
  {
    return detail::save_checkpoint(temperature_, scaler_, step_, bias_);
  }

  /// Restores a checkpoint after validating it; on error nothing changes. Ranks: local; restore the same checkpoint
  /// on every rank.
  status restore(const checkpoint& c)
  {
    CONTRASTIVE_RETURN_IF_ERROR(detail::restore_checkpoint(c, temperature_, scaler_, step_, bias_));
    in_step_ = false; // a step in progress belonged to the state replaced: its record can no longer finish
    return {};
  }

  /// Loss at the current temperature (and logit bias); per-row (and, symmetric, per-column) log-sum-exps if the
  /// pointers are given (this rank's n_q and n_k floats; sigmoid: each row's loss sum_j softplus(-l_ij z_ij) in
  /// row_lse, nothing in col_lse). Changes no policy state. Keep `p` alive until `backward`. Ranks: collective.
  status forward(const problem_type& p,
                 float& loss_value,
                 float* row_lse = nullptr,
                 float* col_lse = nullptr,
                 std::int64_t iteration = distributed::no_iteration)
  {
    step::forward_values fr;
    // The outputs' overlap with the inputs is refused as the policies are: after the problem's checks, on every rank.
    status settings = policies(p);
    if (settings.ok())
    {
      settings = check_statistics_outputs(p, row_lse, col_lse);
    }
    CONTRASTIVE_RETURN_IF_ERROR(
        driver_.forward(p, temperature_.scale(), bias_.value, settings, nullptr, nullptr, false, step_, iteration, fr));
    loss_value = fr.loss;
    driver_.copy_lse(row_lse, col_lse);
    return {};
  }

  /// The first non-finite site of the last forward + backward pair, in the order of `step_record::first_nonfinite`.
  nonfinite_site diagnose() const noexcept
  {
    return base::first_nonfinite(temperature_.wants_gradient(), bias_.is_learnable());
  }

  /// Backward of the last `forward` at the current loss scale: dq, dk (Element, multiplied by the loss scale) and
  /// d(loss_scale * loss)/d(log s) in `grad_logit_scale_scaled`. Changes no policy state. Ranks: collective.
  status backward(Element* dq, Element* dk, float& grad_logit_scale_scaled)
  {
    step::backward_values br;
    CONTRASTIVE_RETURN_IF_ERROR(driver_.backward(scaler_.loss_scale(), dq, dk, false, step_, br));
    grad_logit_scale_scaled = br.grad_logit_scale;
    return {};
  }

  /// Steps 1-3 of a training step (see the file comment). On success `rec.pending` is true and `finish_step` must
  /// follow (after any `unscale_and_check` of the caller's own gradients). On error nothing changes. Ranks: `p` is
  /// this rank's rows; dq and dk receive the gradients of loss_scale * (global loss) for them (collective).
  status forward_backward(const problem_type& p,
                          Element* dq,
                          Element* dk,
                          step_record& rec,
                          std::int64_t iteration = distributed::no_iteration)
  {
    const float ls = scaler_.loss_scale();
    step::forward_values fr;
    CONTRASTIVE_RETURN_IF_ERROR(
        driver_.forward(p, temperature_.scale(), bias_.value, policies(p), dq, dk, true, step_, iteration, fr));
    step::backward_values br;
    CONTRASTIVE_RETURN_IF_ERROR(driver_.backward(ls, dq, dk, true, step_, br));
    rec = detail::make_record(step_,
                              temperature_.tau(),
                              ls,
                              temperature_.wants_gradient(),
                              {fr.loss,
                               fr.max_logit,
                               br.grad_logit_scale,
                               fr.logits_nonfinite,
                               br.dq_nonfinite,
                               br.dk_nonfinite,
                               br.grad_logit_bias});
    rec.logit_bias = bias_.value;
    if (bias_.is_learnable() && rec.first_nonfinite == nonfinite_site::none && !detail::finite(rec.grad_logit_bias))
    {
      rec.first_nonfinite = nonfinite_site::grad_logit_bias;
    }
    in_step_ = true;
    issued_ = rec;
    return {};
  }

  /// One pass over a caller gradient buffer (e.g. encoder weight gradients from back-propagating dQ/dK): multiplies
  /// by 1/loss_scale and records `parameters` as the non-finite site if any unscaled value is not finite (local;
  /// ranks: the next `finish_step` makes every rank skip if any rank recorded one).
  status unscale_and_check(float* grads, std::size_t n, step_record& rec) const
  {
    return detail::unscale_and_check_host(grads, n, rec);
  }

  /// Step 4: scaler update, then (finite steps only) the temperature update, then the temperature's optional
  /// `observe(rec, max_finite)` hook (policies that react to the scaler or the element type's range). Fills `skipped`
  /// and `next_loss_scale`. Ranks: collective; its first collective is the same as the other calls', so a rank
  /// still in forward_backward (or at another step) is refused on every rank, and a refused finish_step changes
  /// nothing (the record stays pending).
  status finish_step(step_record& rec)
  {
    // The record must be this loss's step in progress: a copy of an already finished record (or one made up)
    // would move the policies a second time.
    // A second forward_backward before finish_step replaces the step in progress (same index): the first one's record
    // is told apart by the values the loss wrote into it.
    const bool pending = rec.pending && in_step_ && rec.step == step_ && same_issue(rec, issued_);
    // The record is the caller's: a gradient edited to a non-finite value skips the step (on every rank) instead of
    // reaching the temperature's optimizer state; forward_backward already records its own non-finite gradients.
    nonfinite_site local = rec.first_nonfinite;
    if (local == nonfinite_site::none && temperature_.wants_gradient() && !detail::finite(rec.grad_logit_scale))
    {
      local = nonfinite_site::grad_logit_scale;
    }
    if (local == nonfinite_site::none && bias_.is_learnable() && !detail::finite(rec.grad_logit_bias))
    {
      local = nonfinite_site::grad_logit_bias;
    }
    if constexpr (driver_type::single)
    {
      if (!pending)
      {
        return {errc::invalid_argument, "rec", "no step in progress, or finish_step already called for it"};
      }
      rec.first_nonfinite = local;
    }
    else
    {
      std::int32_t site = static_cast<std::int32_t>(local);
      CONTRASTIVE_RETURN_IF_ERROR(distributed::agreement::agree_on_finish(
          driver_.communicator(), step_, driver_.iteration(), pending, status{}, site));
      rec.first_nonfinite = static_cast<nonfinite_site>(site);
    }
    in_step_ = false;
    detail::finish_step<Element>(temperature_, scaler_, rec);
    if (!rec.skipped)
    {
      bias_.advance(rec.grad_logit_bias);
    }
    step_ = detail::saturating_increment(step_);
    return {};
  }

  /// A whole training step whose only gradients are dq and dk: exactly forward_backward, then finish_step (so ranks
  /// may mix the two forms within one step).
  status step(const problem_type& p,
              Element* dq,
              Element* dk,
              step_record& rec,
              std::int64_t iteration = distributed::no_iteration)
  {
    CONTRASTIVE_RETURN_IF_ERROR(forward_backward(p, dq, dk, rec, iteration));
    return finish_step(rec);
  }

private:
  /// The policies' own settings, checked before any step (a failure is returned after the problem's checks).
  status policies(const problem_type& p) const
  {
    if (bias_.is_learnable() && !objectives::traits_of(p).has_bias)
    {
      return {errc::invalid_argument,
              "logit_bias",
              std::string("a learnable logit bias with objective ") + to_string(objectives::code_of(p)) +
                  ": the bias applies to objective::sigmoid only (a softmax is invariant to it)"};
    }
    if (const char* why = temperature_.validate(); why[0] != '\0')
    {
      return {errc::invalid_temperature, "temperature", why};
    }
    if (const char* why = scaler_.validate(); why[0] != '\0')
    {
      return {errc::invalid_scaler, "scaler", why};
    }
    return {};
  }

  Temperature temperature_;
  Scaler scaler_;
  logit_bias bias_{};
  std::int64_t step_ = 0;
  bool in_step_ = false; ///< a forward_backward succeeded and its finish_step has not run (record step_)
  step_record issued_{}; ///< the record of the step in progress, as forward_backward wrote it

  /// Whether `rec` carries the values forward_backward wrote into `issued` (bit for bit; the fields a caller has no
  /// reason to edit: the loss, tau, the loss scale, the largest logit, the bias).
  static bool same_issue(const step_record& rec, const step_record& issued) noexcept
  {
    const float mine[5] = {rec.loss, rec.tau, rec.loss_scale, rec.max_logit, rec.logit_bias};
    const float theirs[5] = {issued.loss, issued.tau, issued.loss_scale, issued.max_logit, issued.logit_bias};
    return std::memcmp(mine, theirs, sizeof mine) == 0;
  }
};
} // namespace contrastive
