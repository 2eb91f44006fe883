// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The host-side pieces of a step that the single-process and the distributed loss share: the checkpoint of the
/// policies (saved byte-deterministically, restored after validation) and the unscale-and-check pass over a caller's
/// gradient buffer.

#include <contrastive/policy/bias.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>
#include <contrastive/step/logic.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

namespace contrastive
{
namespace detail
{
/// The refusal of a problem whose input holds a non-finite value: `bad` is the host engine's first_nonfinite (index
/// row * dim + col, plus 1, into q; negative: into k), named as the element, e.g. "k[3][7] is not finite".
inline status nonfinite_input(std::ptrdiff_t bad, std::size_t dim)
{
  const bool in_q = bad > 0;
  const std::size_t idx = static_cast<std::size_t>((in_q ? bad : -bad) - 1);
  const char* name = in_q ? "q" : "k";
  return {errc::non_finite_input,
          name,
          std::string(name) + "[" + std::to_string(idx / dim) + "][" + std::to_string(idx % dim) + "] is not finite"};
}

/// Everything a training run must save to resume bit-exactly (trivially copyable).
template <class Temperature, class Scaler>
struct checkpoint
{
  Temperature temperature;
  Scaler scaler;
  std::int64_t step;
  logit_bias bias; ///< the sigmoid objective's logit bias and its optimiser state
};

/// The largest step count `restore` accepts: 2^62 steps is more than any run makes (146 years at 10^9 steps a
/// second), and the count, incremented once per step, then cannot overflow in the steps that remain.
inline constexpr std::int64_t max_checkpoint_step = std::int64_t(1) << 62;

/// Whether a policy has explicit padding members that its `clear_padding()` zeroes (the library's policies).
template <class P, class = void>
struct has_clear_padding : std::false_type
{
};
template <class P>
struct has_clear_padding<P, std::void_t<decltype(std::declval<P&>().clear_padding())>> : std::true_type
{
};

/// Byte-deterministic: the checkpoint's own padding is zeroed, the policies are copied as bytes and their explicit
/// padding members zeroed (the library's policies have no implicit padding, which the compiler would not copy
/// reliably, nor zero in memory a policy was built in), so two saves of the same state compare equal with memcmp
/// and a checkpoint can be checksummed or compared as a blob. A custom policy with implicit padding has to name it
/// as members and zero them in a `clear_padding()` for the same guarantee.
template <class Temperature, class Scaler>
checkpoint<Temperature, Scaler>
save_checkpoint(const Temperature& t, const Scaler& s, std::int64_t step, const logit_bias& b = logit_bias{}) noexcept
{
  checkpoint<Temperature, Scaler> c;
  std::memset(static_cast<void*>(&c), 0, sizeof c);
  std::memcpy(static_cast<void*>(&c.temperature), &t, sizeof t);
  std::memcpy(static_cast<void*>(&c.scaler), &s, sizeof s);
  if constexpr (has_clear_padding<Temperature>::value)
  {
    c.temperature.clear_padding();
  }
  if constexpr (has_clear_padding<Scaler>::value)
  {
    c.scaler.clear_padding();
  }
  c.step = step;
  std::memcpy(static_cast<void*>(&c.bias), &b, sizeof b);
  return c;
}

/// Validates `c`, then copies it in as bytes (so save() after restore() of a saved checkpoint reproduces it exactly);
/// on error nothing changes. The policies' counters saturate; the step count, which the losses increment, is
/// refused above max_checkpoint_step.
template <class Temperature, class Scaler>
status restore_checkpoint(
    const checkpoint<Temperature, Scaler>& c, Temperature& t, Scaler& s, std::int64_t& step, logit_bias& b)
{
  if (const char* why = c.bias.validate(); why[0] != '\0')
  {
    return {errc::invalid_argument, "checkpoint.bias", why};
  }
  if (const char* why = c.temperature.validate(); why[0] != '\0')
  {
    return {errc::invalid_temperature, "checkpoint.temperature", why};
  }
  if (const char* why = c.scaler.validate(); why[0] != '\0')
  {
    return {errc::invalid_scaler, "checkpoint.scaler", why};
  }
  if (c.step < 0)
  {
    return {errc::invalid_argument, "checkpoint.step", "negative step count"};
  }
  if (c.step > max_checkpoint_step)
  {
    return {errc::invalid_argument,
            "checkpoint.step",
            "step count " + std::to_string(c.step) + " is above " + std::to_string(max_checkpoint_step) +
                " (2^62), more than any run makes"};
  }
  std::memcpy(static_cast<void*>(&t), &c.temperature, sizeof t);
  std::memcpy(static_cast<void*>(&s), &c.scaler, sizeof s);
  step = c.step;
  std::memcpy(static_cast<void*>(&b), &c.bias, sizeof b);
  return {};
}

/// Multiplies a caller's gradients by 1/loss_scale and records `parameters` as the non-finite site if any unscaled
/// value is not finite (one pass).
inline status unscale_and_check_host(float* grads, std::size_t n, step_record& rec)
{
  if (!rec.pending)
  {
    return {errc::invalid_argument, "rec", "no step in progress (call forward_backward first)"};
  }
  if (grads == nullptr && n != 0)
  {
    return {errc::null_pointer, "grads", "null gradient buffer with n = " + std::to_string(n)};
  }
  const float inv = unscale_factor(rec.loss_scale);
  float poison = 0.0f;
  for (std::size_t i = 0; i < n; ++i)
  {
    const float g = grads[i] * inv;
    poison += g * 0.0f;
    grads[i] = g;
  }
  if (poison != 0.0f && rec.first_nonfinite == nonfinite_site::none)
  {
    rec.first_nonfinite = nonfinite_site::parameters;
  }
  return {};
}
} // namespace detail
} // namespace contrastive
