// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `contrastive::loss<Element, Temperature, Scaler, Algorithm>`: the compile-time configuration and one training step
/// on the host.
///
/// A step runs, in this order:
///   1. validate every input and policy setting (a failure returns a status and changes nothing);
///   2. forward at tau = Temperature::tau(), backward of loss_scale * loss (dQ, dK in Element, still scaled: they are
///      activation gradients the caller back-propagates further);
///   3. unscale-and-check: d(loss)/d(log s) is divided by the loss scale, and every gradient is tested for finiteness
///      in the pass that produces it (dQ/dK are tested on their scaled Element values; caller gradients passed to
///      `unscale_and_check` are tested *after* unscaling, in the same pass that multiplies them by 1/loss_scale);
///   4. `finish_step`: the scaler's `update(found_inf)`; then, only if the step was finite, the temperature's
///      `advance(grad)`.
/// `step()` is 2-4 at once for callers whose only gradients are dQ and dK.

#include <contrastive/checks.hpp>
#include <contrastive/detail/checked.hpp>
#include <contrastive/detail/host_step.hpp>
#include <contrastive/detail/step_logic.hpp>
#include <contrastive/host/engine.hpp>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/policy/scaler.hpp>
#include <contrastive/policy/temperature.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>

namespace contrastive
{
/// The loss with its policies. Element: float, __half or __nv_bfloat16. Policies come last, with defaults; the last,
/// Gemm, chooses the host GEMM core (gemm::builtin, or gemm::cblas with <contrastive/host/cblas_gemm.hpp>).
template <class Element,
          class Temperature = temperature::learnable,
          class Scaler = scaler::static_scale,
          class Algorithm = algorithm::fused,
          class Gemm = gemm::builtin>
class loss
{
  static_assert(is_element_type_v<Element>, "Element must be float, __half or __nv_bfloat16");
  static_assert(temperature::is_temperature_policy_v<Temperature>,
                "Temperature must be a trivially copyable policy with is_learnable, scale(), tau(), "
                "wants_gradient(), advance(float) and validate()");
  static_assert(
      scaler::is_scaler_policy_v<Scaler>,
      "Scaler must be a trivially copyable policy with is_dynamic, loss_scale(), update(bool) and validate()");
  static_assert(is_algorithm_v<Algorithm>,
                "Algorithm must be algorithm::fused, algorithm::materialized or algorithm::chunked");
  static_assert(is_gemm_v<Gemm>, "Gemm must be gemm::builtin or gemm::cblas");

public:
  using element_type = Element;
  using temperature_type = Temperature;
  using scaler_type = Scaler;
  using algorithm_type = Algorithm;
  using gemm_type = Gemm;
  using problem_type = problem<Element>;

  /// Everything a training run must save to resume bit-exactly (trivially copyable).
  using checkpoint = detail::checkpoint<Temperature, Scaler>;

  explicit loss(Temperature t = Temperature{}, Scaler s = Scaler{}, unsigned threads = 0)
      : temperature_(t), scaler_(s), engine_(threads)
  {
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
  unsigned threads() const noexcept
  {
    return engine_.threads();
  }
  /// algorithm::chunked only: rows per chunk, or the chunk buffer's budget (see chunk_options); applies from the next
  /// call. Other algorithms refuse it (invalid_argument "chunk"), so a setting never silently does nothing.
  status set_chunk(const chunk_options& o)
  {
    if constexpr (!std::is_same_v<Algorithm, algorithm::chunked>)
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
  /// The temperature optimiser's settings (learning rate, betas, ...), e.g. for a learning-rate schedule; its state
  /// (moments, step count) and theta are kept. Refused, changing nothing, when the settings are out of their domain
  /// (invalid_temperature "optimizer") or the policy has no optimiser (invalid_argument "optimizer": fixed, schedule).
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
                "optimizer settings out of range (finite lr >= 0, 0 <= betas/momentum < 1, finite eps > 0)"};
      }
      temperature_.opt = o;
      return {};
    }
  }
  /// algorithm::chunked: rows per chunk a problem would use (a multiple of the row block, at most all rows).
  std::size_t chunk_rows_for(const problem_type& p) const noexcept
  {
    return engine_.chunk_rows_for(p);
  }

  /// Bytes of host memory held between calls (operands, saved statistics, scratch, materialized logits).
  std::size_t bytes_held() const noexcept
  {
    return engine_.bytes_held();
  }

  /// The whole state. Byte-deterministic (padding zeroed, members copied as bytes): two saves of the same state
  /// compare equal with memcmp, so a checkpoint can be checksummed or compared as a blob.
  checkpoint save() const noexcept
  {
    return detail::save_checkpoint(temperature_, scaler_, step_);
  }

  /// Restores a checkpoint after validating it; on error nothing changes.
  status restore(const checkpoint& c)
  {
    return detail::restore_checkpoint(c, temperature_, scaler_, step_);
  }

  /// Loss at the current temperature; per-row (and, symmetric, per-column) log-sum-exps if the pointers are given
  /// (n_q and n_k floats). Changes no policy state. Keep `p` alive until `backward`.
  status forward(const problem_type& p, float& loss_value, float* row_lse = nullptr, float* col_lse = nullptr)
  {
    CONTRASTIVE_RETURN_IF_ERROR(validate(p, nullptr, nullptr, false));
    host::forward_result r;
    CONTRASTIVE_RETURN_IF_ERROR(guarded(
        [&]
        {
          r = engine_.template forward<Algorithm>(temperature_.scale());
        }));
    forward_ready_ = true;
    forward_problem_ = p;
    last_forward_ = r;
    loss_value = r.loss;
    if (row_lse != nullptr)
    {
      std::copy(engine_.row_lse().begin(), engine_.row_lse().end(), row_lse);
    }
    if (col_lse != nullptr && p.obj == objective::symmetric)
    {
      std::copy(engine_.col_lse().begin(), engine_.col_lse().end(), col_lse);
    }
    return {};
  }

  /// What the last successful `forward` saw (loss, largest logit, whether a logit was non-finite) and the last
  /// `backward` produced (whether dQ/dK held a non-finite value, d(loss_scale * loss)/d(log s)): the step diagnosis
  /// for callers who run the two halves themselves (`diagnose` orders it as a step record does).
  const host::forward_result& last_forward() const noexcept
  {
    return last_forward_;
  }
  const host::backward_result& last_backward() const noexcept
  {
    return last_backward_;
  }
  /// The first non-finite site of the last forward + backward pair, in the order of `step_record::first_nonfinite`.
  nonfinite_site diagnose() const noexcept
  {
    return detail::first_nonfinite(last_forward_.logits_nonfinite,
                                   last_forward_.loss,
                                   last_backward_.dq_nonfinite,
                                   last_backward_.dk_nonfinite,
                                   temperature_.wants_gradient(),
                                   last_backward_.grad_logit_scale);
  }

  /// Backward of the last `forward` at the current loss scale: dq, dk (Element, multiplied by the loss scale) and
  /// d(loss_scale * loss)/d(log s) in `grad_logit_scale_scaled`. Changes no policy state.
  status backward(Element* dq, Element* dk, float& grad_logit_scale_scaled)
  {
    if (!forward_ready_)
    {
      return {errc::invalid_argument, "forward", "backward needs a successful forward on the same problem first"};
    }
    if (dq == nullptr)
    {
      return {errc::null_pointer, "dq", "null gradient output for q"};
    }
    if (dk == nullptr)
    {
      return {errc::null_pointer, "dk", "null gradient output for k"};
    }
    CONTRASTIVE_RETURN_IF_ERROR(check_outputs(forward_problem_, dq, dk));
    host::backward_result br;
    CONTRASTIVE_RETURN_IF_ERROR(guarded(
        [&]
        {
          br = engine_.template backward<Algorithm>(scaler_.loss_scale(), dq, dk);
        }));
    grad_logit_scale_scaled = br.grad_logit_scale;
    forward_ready_ = false;
    last_backward_ = br;
    return {};
  }

  /// Steps 1-3 of a training step (see the file comment). On success `rec.pending` is true and `finish_step` must
  /// follow (after any `unscale_and_check` of the caller's own gradients). On error nothing changes.
  status forward_backward(const problem_type& p, Element* dq, Element* dk, step_record& rec)
  {
    CONTRASTIVE_RETURN_IF_ERROR(validate(p, dq, dk, true));
    const float ls = scaler_.loss_scale();
    host::forward_result fr;
    host::backward_result br;
    CONTRASTIVE_RETURN_IF_ERROR(guarded(
        [&]
        {
          fr = engine_.template forward<Algorithm>(temperature_.scale());
          br = engine_.template backward<Algorithm>(ls, dq, dk);
        }));
    forward_ready_ = false;
    rec = detail::make_record(
        step_,
        temperature_.tau(),
        ls,
        temperature_.wants_gradient(),
        {fr.loss, fr.max_logit, br.grad_logit_scale, fr.logits_nonfinite, br.dq_nonfinite, br.dk_nonfinite});
    return {};
  }

  /// One pass over a caller gradient buffer (e.g. encoder weight gradients from back-propagating dQ/dK): multiplies
  /// by 1/loss_scale and records `parameters` as the non-finite site if any unscaled value is not finite.
  status unscale_and_check(float* grads, std::size_t n, step_record& rec) const
  {
    return detail::unscale_and_check_host(grads, n, rec);
  }

  /// Step 4: scaler update, then (finite steps only) the temperature update, then the temperature's optional
  /// `observe(rec, max_finite)` hook (policies that react to the scaler or the element type's range). Fills `skipped`
  /// and `next_loss_scale`.
  status finish_step(step_record& rec)
  {
    if (!rec.pending)
    {
      return {errc::invalid_argument, "rec", "no step in progress, or finish_step already called for it"};
    }
    detail::finish_step<Element>(temperature_, scaler_, rec);
    step_ = detail::saturating_increment(step_);
    return {};
  }

  /// A whole training step whose only gradients are dq and dk.
  status step(const problem_type& p, Element* dq, Element* dk, step_record& rec)
  {
    CONTRASTIVE_RETURN_IF_ERROR(forward_backward(p, dq, dk, rec));
    return finish_step(rec);
  }

private:
  /// Runs `f` (engine work that may allocate) and turns any exception into a status: the library never throws.
  /// A failure leaves the engine released and no forward ready.
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
      return fail_resources("memory", "a buffer of the host engine could not be allocated");
    }
    catch (const std::length_error&)
    {
      return fail_resources("memory", "a buffer of the host engine exceeds the largest possible allocation");
    }
    catch (const std::system_error& e)
    {
      return fail_resources("threads", std::string("the system refused a resource: ") + e.what());
    }
    catch (...)
    {
      return fail_resources("memory", "an allocation failed");
    }
  }

  status fail_resources(const char* what, std::string message)
  {
    engine_.release();
    forward_ready_ = false;
    return {errc::resource_exhausted, what, std::move(message)};
  }

  /// Step 1: every check, before any state or buffer changes. Only then does the engine resize and convert; if that
  /// runs out of memory the engine is released (errc::resource_exhausted) and no earlier forward stays ready.
  status validate(const problem_type& p, const void* dq, const void* dk, bool need_grads)
  {
    CONTRASTIVE_RETURN_IF_ERROR(check_problem(p, dq, dk, need_grads));
    CONTRASTIVE_RETURN_IF_ERROR(engine_type::check_dim(p.dim));
    if (const char* why = temperature_.validate(); why[0] != '\0')
    {
      return {errc::invalid_temperature, "temperature", why};
    }
    if (const char* why = scaler_.validate(); why[0] != '\0')
    {
      return {errc::invalid_scaler, "scaler", why};
    }
    if (engine_.threads() > host::max_threads)
    {
      return {errc::invalid_argument,
              "threads",
              std::to_string(engine_.threads()) + " threads requested; at most " + std::to_string(host::max_threads)};
    }
    const detail::checked_size bytes = engine_.template bytes_for<Algorithm>(p);
    if (!bytes.ok())
    {
      return {errc::size_overflow,
              "n_q",
              "the engine's buffers for n_q = " + std::to_string(p.n_q) + ", n_k = " + std::to_string(p.n_k) +
                  ", dim = " + std::to_string(p.dim) + " (" + Algorithm::name + ") do not fit in size_t bytes"};
    }
    if (const std::ptrdiff_t bad = engine_.first_nonfinite(p); bad != 0)
    {
      return detail::nonfinite_input(bad, p.dim);
    }
    forward_ready_ = false;
    status st = guarded(
        [&]
        {
          engine_.template prepare<Algorithm>(p);
        });
    if (!st.ok())
    {
      return {errc::resource_exhausted,
              "memory",
              "the host engine needs " + std::to_string(bytes.value) + " bytes for n_q = " + std::to_string(p.n_q) +
                  ", n_k = " + std::to_string(p.n_k) + ", dim = " + std::to_string(p.dim) + " (" + Algorithm::name +
                  "): " + st.reason()};
    }
    return {};
  }

  Temperature temperature_;
  Scaler scaler_;
  using engine_type = host::engine<Element, Gemm>;
  engine_type engine_;
  std::int64_t step_ = 0;
  bool forward_ready_ = false;
  problem_type forward_problem_{}; // the problem of the forward a backward finishes (its outputs' shapes and inputs)
  host::forward_result last_forward_{};
  host::backward_result last_backward_{};
};
} // namespace contrastive
