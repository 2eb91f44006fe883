// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `contrastive::core<Element, Algorithm, Gemm, Comm>`: the policy-free call, for frameworks that own the
/// temperature and the loss scaling themselves (PyTorch: the `logit_scale` parameter and its GradScaler):
///   (problem, s, loss scale) -> loss, dQ, dK (Element, multiplied by the loss scale), d(loss)/d(log s), diagnosis;
/// the sigmoid objective also takes its logit bias b (z = s <q, k> + b) and returns d(loss)/d b.
/// No temperature, scaler or step record is kept; what it holds between calls is the engine's buffers and the
/// statistics a `backward` reuses. `contrastive::loss` is the stateful wrapper (policies, scaler, record) over the same
/// step driver (step/driver.hpp).
///
/// Over a communicator (`Comm` other than comm::self) every call is a collective of the global batch, as for
/// `distributed::loss`: bad input on one rank is refused on every rank, naming it.

#include <contrastive/checks.hpp>
#include <contrastive/comm/communicator.hpp>
#include <contrastive/objectives/objectives.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>
#include <contrastive/step/front.hpp>
#include <contrastive/step/logic.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

namespace contrastive
{
/// What a whole pass (`core::step`) found. `grad_logit_scale` is d(loss)/d(log s), already divided by the loss scale;
/// `first_nonfinite` orders the flags as a step record does (logits, loss, dQ, dK, d loss / d log s).
struct core_values
{
  float loss = 0.0f;             ///< the loss, unscaled
  float max_logit = 0.0f;        ///< largest logit (materialized: its element-type value; sigmoid: of z = S + b)
  float grad_logit_scale = 0.0f; ///< d(loss)/d(log s), divided by the loss scale
  float grad_logit_bias = 0.0f;  ///< d(loss)/d b, divided by the loss scale (sigmoid objective; 0 otherwise)
  bool logits_nonfinite = false; ///< a logit is +-inf or NaN
  bool dq_nonfinite = false;     ///< dQ (scaled, in Element) holds a non-finite value
  bool dk_nonfinite = false;     ///< dK (scaled, in Element) holds a non-finite value
  /// The first non-finite site of the pass (none: every value finite).
  nonfinite_site first_nonfinite = nonfinite_site::none;
};

/// The policy-free host call (see the file comment): loss and gradients at the logit scale, logit bias and loss
/// scale each call gives; it keeps no temperature, scaler or step record.
template <class Element,
          class Algorithm = algorithm::fused,
          class Gemm = gemm::builtin,
          class Comm = distributed::comm::self>
class core : public step::front<step::driver<Element, Algorithm, Gemm, Comm>>
{
  using driver_type = step::driver<Element, Algorithm, Gemm, Comm>;
  using base = step::front<driver_type>;
  using base::driver_;

public:
  /// The element type of q, k, dq and dk (float, __half or __nv_bfloat16).
  using element_type = Element;
  /// The algorithm tag (algorithm::fused, materialized, chunked or automatic).
  using algorithm_type = Algorithm;
  /// The inputs of one call, in Element.
  using problem_type = problem<Element>;

  /// One process (Comm = comm::self).
  template <class C = Comm, std::enable_if_t<distributed::is_single_process_v<C>, int> = 0>
  explicit core(unsigned threads = 0) : base(Comm{}, threads)
  {
  }
  /// Ranks: construct on every rank (a communicator constructor may itself be a collective).
  template <class C = Comm, std::enable_if_t<!distributed::is_single_process_v<C>, int> = 0>
  explicit core(Comm comm = Comm{}, unsigned threads = 0) : base(std::move(comm), threads)
  {
  }

  /// Completed forward + backward pairs: what the ranks' calls are matched by (every rank must make the same calls).
  std::int64_t passes() const noexcept
  {
    return passes_;
  }

  /// Loss of `p` with logits S = logit_scale * Q K^T (logit_scale = 1/tau: finite and > 0, else
  /// invalid_temperature "logit_scale"); per-row (and, symmetric, per-column) log-sum-exps if the pointers are given.
  /// Keep `p` alive until `backward`.
  status forward(const problem_type& p,
                 float logit_scale,
                 step::forward_values& out,
                 float* row_lse = nullptr,
                 float* col_lse = nullptr,
                 std::int64_t iteration = distributed::no_iteration)
  {
    return forward(p, logit_scale, 0.0f, out, row_lse, col_lse, iteration);
  }
  /// The same with a logit bias (objective::sigmoid: z = logit_scale * Q K^T + logit_bias, finite; the softmax
  /// objectives take 0 only, else invalid_argument "logit_bias"). Sigmoid: row_lse receives each row's loss
  /// sum_j softplus(-l_ij z_ij) (n_q floats), col_lse nothing.
  status forward(const problem_type& p,
                 float logit_scale,
                 float logit_bias,
                 step::forward_values& out,
                 float* row_lse = nullptr,
                 float* col_lse = nullptr,
                 std::int64_t iteration = distributed::no_iteration)
  {
    // The outputs' overlap with the inputs is refused as a bad scale is: after the problem's checks, on every rank.
    status settings = check_scale(logit_scale);
    if (settings.ok())
    {
      settings = check_statistics_outputs(p, row_lse, col_lse);
    }
    CONTRASTIVE_RETURN_IF_ERROR(
        driver_.forward(p, logit_scale, logit_bias, settings, nullptr, nullptr, false, passes_, iteration, out));
    biased_ = objectives::traits_of(p).has_bias;
    driver_.copy_lse(row_lse, col_lse);
    return {};
  }

  /// Backward of `loss_scale * loss` for the last `forward` (loss_scale finite and > 0, else invalid_scaler
  /// "loss_scale"): dq, dk in Element, multiplied by loss_scale; out.grad_logit_scale = d(loss_scale * loss)/d(log s),
  /// out.grad_logit_bias = d(loss_scale * loss)/d b.
  status backward(float loss_scale, Element* dq, Element* dk, step::backward_values& out)
  {
    CONTRASTIVE_RETURN_IF_ERROR(
        driver_.backward(loss_scale, dq, dk, false, passes_, out, check_loss_scale(loss_scale)));
    passes_ = detail::saturating_increment(passes_);
    return {};
  }

  /// forward, then backward, with every argument checked first (a refused call writes nothing).
  status step(const problem_type& p,
              float logit_scale,
              float loss_scale,
              Element* dq,
              Element* dk,
              core_values& out,
              std::int64_t iteration = distributed::no_iteration)
  {
    return step(p, logit_scale, 0.0f, loss_scale, dq, dk, out, iteration);
  }
  /// The same with a logit bias (see `forward`); out.grad_logit_bias = d(loss)/d b.
  status step(const problem_type& p,
              float logit_scale,
              float logit_bias,
              float loss_scale,
              Element* dq,
              Element* dk,
              core_values& out,
              std::int64_t iteration = distributed::no_iteration)
  {
    status checks = check_scale(logit_scale);
    if (checks.ok())
    {
      (void)(checks = check_loss_scale(loss_scale));
    }
    step::forward_values f;
    CONTRASTIVE_RETURN_IF_ERROR(
        driver_.forward(p, logit_scale, logit_bias, checks, dq, dk, true, passes_, iteration, f));
    biased_ = objectives::traits_of(p).has_bias;
    step::backward_values b;
    CONTRASTIVE_RETURN_IF_ERROR(driver_.backward(loss_scale, dq, dk, true, passes_, b));
    passes_ = detail::saturating_increment(passes_);
    out.loss = f.loss;
    out.max_logit = f.max_logit;
    out.grad_logit_scale = b.grad_logit_scale / loss_scale;
    out.grad_logit_bias = b.grad_logit_bias / loss_scale;
    out.logits_nonfinite = f.logits_nonfinite;
    out.dq_nonfinite = b.dq_nonfinite;
    out.dk_nonfinite = b.dk_nonfinite;
    out.first_nonfinite =
        detail::first_nonfinite(f.logits_nonfinite, f.loss, b.dq_nonfinite, b.dk_nonfinite, true, out.grad_logit_scale);
    if (out.first_nonfinite == nonfinite_site::none && objectives::traits_of(p).has_bias &&
        !detail::finite(out.grad_logit_bias))
    {
      out.first_nonfinite = nonfinite_site::grad_logit_bias;
    }
    return {};
  }

  /// The first non-finite site of the last forward + backward pair (d loss / d log s counts unless
  /// `wants_gradient` is false, e.g. for a fixed temperature; d loss / d b for the sigmoid objective), as `step`
  /// reports it.
  nonfinite_site diagnose(bool wants_gradient = true) const noexcept
  {
    return base::first_nonfinite(wants_gradient, biased_);
  }

private:
  static status check_scale(float s)
  {
    if (!(s > 0.0f) || !detail::finite(s))
    {
      return {errc::invalid_temperature,
              "logit_scale",
              "logit_scale = " + detail::number_text(s) + "; it must be finite and > 0 (it is 1/tau)"};
    }
    return {};
  }

  std::int64_t passes_ = 0;
  bool biased_ = false; ///< the last forward's objective takes a logit bias (its d loss / d b counts in diagnose)
};
} // namespace contrastive
