// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The device step's small kernels around the row passes (device/kernels.cuh): the state's upload, the prologue that
/// reads the policies' scalars, the finish of the step record and the policies' update, and the caller gradients'
/// unscale-and-check. Only CUDA translation units include this file.

#include <contrastive/device/kernels/args.cuh>
#include <contrastive/numeric/math.hpp>
#include <contrastive/step/logic.hpp>

#include <cub/block/block_reduce.cuh>

#include <cstring>

namespace contrastive
{
namespace device
{
namespace kernels
{
/// Writes a state built on the host: it travels as this kernel's argument, copied when the launch is enqueued, and
/// lands byte for byte (padding included).
template <class State>
__global__ void store_state(State* out, State value)
{
  memcpy(out, &value, sizeof(State));
}

/// Reads the policies' current scale and loss scale into device scalars (no host round trip).
template <class State>
__global__ void prologue(const State* state, step_scalars* out)
{
  out->scale = state->temperature.scale();
  out->loss_scale = state->scaler.loss_scale();
  out->wants_gradient = state->temperature.wants_gradient() ? 1 : 0;
  out->bias = state->bias.value;
}

/// Sums of the reductions the finish kernel reads.
struct step_sums
{
  float row_loss;
  float col_loss;
  float dlogs;
  float max_logit;
  float dbias; ///< sigmoid: sum of G (d loss / d b before the loss scale)
};

/// Fills the pending step record from the reductions and flags (steps 1-3 of a step).
template <class State>
__global__ void finish_forward_backward(State* state,
                                        const step_scalars* scalars,
                                        const step_sums* sums,
                                        const int* flags,
                                        int n_q,
                                        int n_k,
                                        int symmetric,
                                        int materialized)
{
  const float ls = scalars->loss_scale;
  const float s = scalars->scale;
  detail::pass_outcome o{};
  o.loss = symmetric ? 0.5f * (sums->row_loss / n_q + sums->col_loss / n_k) : sums->row_loss / n_q;
  o.max_logit = sums->max_logit;
  o.grad_logit_scale_scaled = materialized ? s * sums->dlogs : ls * s * sums->dlogs;
  o.logits_bad = flags[0] != 0;
  o.dq_bad = flags[1] != 0;
  o.dk_bad = flags[2] != 0;
  state->record = detail::make_record(state->step, state->temperature.tau(), ls, scalars->wants_gradient != 0, o);
  state->bias_step = 0; // a softmax step: its finish_step leaves the bias alone, whatever came before
}

/// The sigmoid objective's step record (steps 1-3): the mean of the rows' losses, d loss / d log s and d loss / d b
/// (the sum of G), the bias used; a learnable bias with a non-finite gradient skips the step (`grad_logit_bias`), as
/// on the host. Marks the step as one whose finish_step moves the bias.
template <class State>
__global__ void finish_sigmoid_forward_backward(
    State* state, const step_scalars* scalars, const step_sums* sums, const int* flags, int n_q)
{
  const float ls = scalars->loss_scale;
  detail::pass_outcome o{};
  o.loss = sums->row_loss / n_q;
  o.max_logit = sums->max_logit;
  o.grad_logit_scale_scaled = ls * scalars->scale * sums->dlogs;
  o.logits_bad = flags[0] != 0;
  o.dq_bad = flags[1] != 0;
  o.dk_bad = flags[2] != 0;
  o.grad_logit_bias_scaled = ls * sums->dbias;
  step_record rec = detail::make_record(state->step, state->temperature.tau(), ls, scalars->wants_gradient != 0, o);
  rec.logit_bias = scalars->bias;
  if (state->bias.is_learnable() && rec.first_nonfinite == nonfinite_site::none && !detail::finite(rec.grad_logit_bias))
  {
    rec.first_nonfinite = nonfinite_site::grad_logit_bias;
  }
  state->record = rec;
  state->bias_step = 1;
}

/// Step 4 on the device: scaler update, then the temperature update for a finite step, and after a sigmoid step the
/// bias's (finite steps only, as on the host).
template <class Element, class State>
__global__ void finish_step(State* state)
{
  if (!state->record.pending)
  {
    return;
  }
  detail::finish_step<Element>(state->temperature, state->scaler, state->record);
  if (state->bias_step != 0)
  {
    if (!state->record.skipped)
    {
      state->bias.advance(state->record.grad_logit_bias);
    }
    state->bias_step = 0;
  }
  state->step += 1;
}

/// Caller gradients: multiply by 1/loss_scale and flag `parameters` if any result is not finite (one pass).
template <class State>
__global__ void __launch_bounds__(256) unscale_and_check(float* grads, long long n, State* state)
{
  if (!state->record.pending)
  {
    return; // no step in progress: nothing to unscale against (the host API reports this as an error)
  }
  const float inv = detail::unscale_factor(state->record.loss_scale);
  bool bad = false;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
  {
    const float g = grads[i] * inv;
    grads[i] = g;
    bad |= !detail::finite(g);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0)
  {
    atomicCAS(reinterpret_cast<int*>(&state->record.first_nonfinite),
              static_cast<int>(nonfinite_site::none),
              static_cast<int>(nonfinite_site::parameters));
  }
}
} // namespace kernels
} // namespace device
} // namespace contrastive
