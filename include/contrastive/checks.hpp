// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// What both APIs check before doing anything: the problem's shapes, pointers, labels, size products and output
/// aliasing (`check_problem`), and the compile-time choices (`is_algorithm_v`, `is_gemm_v`). The host `loss` and the
/// device API include this header; the device API does not pull in the host engine.

#include <contrastive/detail/checked.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/objectives/objectives.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace contrastive
{
/// Whether `A` is one of the library's algorithm tags (algorithm::all).
template <class A>
inline constexpr bool is_algorithm_v = algorithm::is_algorithm_v<A>;

namespace detail
{
/// Whether the byte ranges [a, a + a_bytes) and [b, b + b_bytes) share a byte.
inline bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) noexcept
{
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

/// One input of a problem as a byte range: `data` null when not given; `bytes` not ok when its size does not fit
/// size_t (check_problem refuses that problem).
struct input_range
{
  const void* data;
  checked_size bytes;
  const char* name;
};

/// The inputs the backward reads: q, k, then the integer ones (labels, query_groups, key_groups).
template <class T>
std::array<input_range, 5> input_ranges(const problem<T>& p) noexcept
{
  const auto bytes = [](std::size_t count, std::size_t size)
  {
    return checked_size(count) * size;
  };
  return {{{p.q, bytes(p.n_q, sizeof(T)) * p.dim, "q"},
           {p.k, bytes(p.n_k, sizeof(T)) * p.dim, "k"},
           {p.labels, bytes(p.n_q, sizeof(std::int32_t)), "labels"},
           {p.query_groups, bytes(p.n_q, sizeof(std::int64_t)), "query_groups"},
           {p.key_groups, bytes(p.n_k, sizeof(std::int64_t)), "key_groups"}}};
}

/// invalid_argument naming `out` where the output [out, out + out_bytes) overlaps one of `inputs` (given, sized).
template <std::size_t N>
status refuse_overlap(const void* out,
                      std::size_t out_bytes,
                      const char* out_name,
                      const std::array<input_range, N>& inputs,
                      std::size_t first,
                      const char* rule)
{
  for (std::size_t i = first; i < N; ++i)
  {
    const input_range& in = inputs[i];
    if (in.data != nullptr && in.bytes.ok() && overlaps(out, out_bytes, in.data, in.bytes.value))
    {
      return {errc::invalid_argument, out_name, std::string(out_name) + " overlaps " + in.name + "; " + rule};
    }
  }
  return {};
}
} // namespace detail

/// Checks that the gradient outputs dq (n_q x dim) and dk (n_k x dim) do not overlap each other or the inputs: q, k,
/// and the labels or group ids where given. dq == dk would silently lose dQ, and an output over an input would be read
/// after it is written (the backward reads the labels and ids again). The sizes must already be known to fit
/// (check_problem checks them first). `forward_backward` runs it through check_problem,
/// `backward` on its own against the problem of the forward it finishes.
template <class T>
status check_outputs(const problem<T>& p, const void* dq, const void* dk)
{
  using detail::overlaps;
  const std::size_t qb = p.n_q * p.dim * sizeof(T), kb = p.n_k * p.dim * sizeof(T);
  if (overlaps(dq, qb, dk, kb))
  {
    return {errc::invalid_argument, "dk", "dk overlaps dq; the two gradient outputs must be separate buffers"};
  }
  // Every input, named in the message (q, k, then the integer ones the backward reads again).
  const auto inputs = detail::input_ranges(p);
  const char* rule = "outputs must not alias inputs";
  CONTRASTIVE_RETURN_IF_ERROR(detail::refuse_overlap(dq, qb, "dq", inputs, 0, rule));
  return detail::refuse_overlap(dk, kb, "dk", inputs, 0, rule);
}

/// Checks that a forward's statistics outputs (`row_lse`: n_q floats, `col_lse`: n_k floats; null: not asked for)
/// overlap neither each other nor an input (q, k, labels, group ids), which the backward reads after they are written.
/// Sizes that do not fit size_t are left to check_problem (nothing is compared).
template <class T>
status check_statistics_outputs(const problem<T>& p, const float* row_lse, const float* col_lse)
{
  const detail::checked_size row_bytes = detail::checked_size(p.n_q) * sizeof(float);
  const detail::checked_size col_bytes = detail::checked_size(p.n_k) * sizeof(float);
  const auto in = detail::input_ranges(p);
  const char* rule = "outputs must not alias inputs or each other";
  // row_lse against every input and col_lse; col_lse against the inputs.
  if (row_lse != nullptr && row_bytes.ok())
  {
    const std::array<detail::input_range, 6> with_col = {
        in[0], in[1], in[2], in[3], in[4], {col_lse, col_bytes, "col_lse"}};
    CONTRASTIVE_RETURN_IF_ERROR(detail::refuse_overlap(row_lse, row_bytes.value, "row_lse", with_col, 0, rule));
  }
  if (col_lse != nullptr && col_bytes.ok())
  {
    return detail::refuse_overlap(col_lse, col_bytes.value, "col_lse", in, 0, rule);
  }
  return {};
}

/// Every one of the n_q `labels` (null: the diagonal, nothing to read) indexes one of `n_keys` keys (`global`: the
/// keys of every rank, which a rank's labels index).
inline status check_label_range(const std::int32_t* labels, std::size_t n_q, std::size_t n_keys, bool global)
{
  for (std::size_t i = 0; labels != nullptr && i < n_q; ++i)
  {
    const std::int64_t l = labels[i];
    if (l < 0 || static_cast<std::size_t>(l) >= n_keys)
    {
      return {errc::label_out_of_range,
              "labels",
              "labels[" + std::to_string(i) + "] = " + std::to_string(l) + " is outside " +
                  (global ? "the global keys [0, " : "[0, n_k = ") + std::to_string(n_keys) + ")"};
    }
  }
  return {};
}

/// The loss scale of a policy-free call (contrastive::core, device::core): finite and > 0, else invalid_scaler
/// "loss_scale".
inline status check_loss_scale(float s)
{
  if (!(s > 0.0f) || !detail::finite(s))
  {
    return {
        errc::invalid_scaler, "loss_scale", "loss_scale = " + detail::number_text(s) + "; it must be finite and > 0"};
  }
  return {};
}

/// The logit bias b of z = S + b for the objective `code` (objectives::check_logit_bias: finite, and 0 unless the
/// objective takes a bias).
inline status check_logit_bias(objective code, float bias)
{
  CONTRASTIVE_RETURN_IF_ERROR(objectives::check_known(code));
  return objectives::visit(code,
                           [&](auto o)
                           {
                             return objectives::check_logit_bias<decltype(o)>(bias);
                           });
}

/// Checks shapes, pointers and labels of a problem (not the finiteness of its values, which the conversion pass
/// checks). `need_grads` also requires dq/dk. `check_labels = false` skips reading the labels (device pointers).
template <class T>
status check_problem(const problem<T>& p,
                     const void* dq = nullptr,
                     const void* dk = nullptr,
                     bool need_grads = false,
                     bool check_labels = true)
{
  if (p.n_q == 0)
  {
    return {errc::empty_input, "n_q", "no queries (n_q = 0)"};
  }
  if (p.n_k == 0)
  {
    return {errc::empty_input, "n_k", "no keys (n_k = 0)"};
  }
  if (p.dim == 0)
  {
    return {errc::empty_input, "dim", "embedding dimension is 0"};
  }
  if (p.q == nullptr)
  {
    return {errc::null_pointer, "q", "null pointer with n_q = " + std::to_string(p.n_q)};
  }
  if (p.k == nullptr)
  {
    return {errc::null_pointer, "k", "null pointer with n_k = " + std::to_string(p.n_k)};
  }
  if (need_grads && dq == nullptr)
  {
    return {errc::null_pointer, "dq", "null gradient output for q"};
  }
  if (need_grads && dk == nullptr)
  {
    return {errc::null_pointer, "dk", "null gradient output for k"};
  }
  CONTRASTIVE_RETURN_IF_ERROR(objectives::check_known(objectives::code_of(p)));
  if (p.grouped())
  {
    if (p.query_groups == nullptr)
    {
      return {errc::null_pointer, "query_groups", "key_groups given without query_groups: give both or neither"};
    }
    if (p.key_groups == nullptr)
    {
      return {errc::null_pointer, "key_groups", "query_groups given without key_groups: give both or neither"};
    }
    if (p.labels != nullptr)
    {
      return {errc::invalid_argument,
              "labels",
              "labels and group ids together: the positives come from one or the other; pass null labels"};
    }
  }
  else
  {
    CONTRASTIVE_RETURN_IF_ERROR(objectives::visit(p,
                                                  [&](auto o)
                                                  {
                                                    return decltype(o)::check_shape(p.n_q, p.n_k, p.labels != nullptr);
                                                  }));
  }
  // Every product of caller sizes the library forms (elements and bytes of the inputs and outputs) must fit size_t.
  const detail::checked_size q_bytes = detail::checked_size(p.n_q) * p.dim * sizeof(T);
  const detail::checked_size k_bytes = detail::checked_size(p.n_k) * p.dim * sizeof(T);
  if (!q_bytes.ok())
  {
    return {errc::size_overflow,
            "n_q",
            "n_q * dim * sizeof(element) = " + std::to_string(p.n_q) + " * " + std::to_string(p.dim) + " * " +
                std::to_string(sizeof(T)) + " bytes does not fit in size_t"};
  }
  if (!k_bytes.ok())
  {
    return {errc::size_overflow,
            "n_k",
            "n_k * dim * sizeof(element) = " + std::to_string(p.n_k) + " * " + std::to_string(p.dim) + " * " +
                std::to_string(sizeof(T)) + " bytes does not fit in size_t"};
  }
  // The integer inputs' bytes (int32 labels, int64 group ids), which check_outputs compares.
  if (!(detail::checked_size(p.n_q) * sizeof(std::int64_t)).ok())
  {
    return {errc::size_overflow, "n_q", "n_q labels or group ids do not fit in size_t bytes"};
  }
  if (!(detail::checked_size(p.n_k) * sizeof(std::int64_t)).ok())
  {
    return {errc::size_overflow, "n_k", "n_k group ids do not fit in size_t bytes"};
  }
  if (need_grads)
  {
    CONTRASTIVE_RETURN_IF_ERROR(check_outputs(p, dq, dk));
  }
  if (check_labels)
  {
    return check_label_range(p.labels, p.n_q, p.n_k, false);
  }
  return {};
}

/// What the device paths refuse besides check_problem: group ids (several positives per row), which the host paths
/// compute (numeric/groups.hpp).
template <class T>
status check_device_problem(const problem<T>& p)
{
  if (p.grouped())
  {
    return {errc::invalid_argument,
            p.query_groups != nullptr ? "query_groups" : "key_groups",
            "group ids (several positives per row) run on the host paths; the device paths take labels or the "
            "diagonal"};
  }
  return {};
}

template <class G>
inline constexpr bool is_gemm_v = std::is_same_v<G, gemm::builtin> || std::is_same_v<G, gemm::cblas>;

} // namespace contrastive
