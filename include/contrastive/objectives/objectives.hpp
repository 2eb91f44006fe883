// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The objectives as types, and the one place a call's runtime `objective` becomes one: `visit(p, f)` calls
/// f(objectives::symmetric{}), f(info_nce{}) or f(sigmoid{}) from p.obj. Everything below the boundary (the host
/// engine, the step driver, the chunked runners) is templated on the objective and reads its traits:
///
///   code, name       its value in problem<T> and its name in messages
///   softmax          rows are cross-entropies (log-sum-exp statistics); else the pairwise sigmoid terms
///   columns          the columns are cross-entropies too (column statistics; the symmetric loss)
///   has_bias         takes a logit bias z = S + b (a softmax objective refuses a nonzero one)
///   takes_labels     one label per row (null: the diagonal); else the diagonal or group ids only
///   check_shape      its shape rule for one positive per row
///   coefficients, mean                     G's coefficients and the loss from the summed row (column) terms
///   grouped_coefficients, grouped_mean     the same with group ids (numeric/groups.hpp)
///   gradient, positive_gradient (softmax), term (sigmoid)   the per-logit functions, host and device
///
/// docs/extending.md walks through adding one.

#include <contrastive/numeric/math.hpp>
#include <contrastive/objectives/info_nce.hpp>
#include <contrastive/objectives/sigmoid.hpp>
#include <contrastive/objectives/symmetric.hpp>
#include <contrastive/status.hpp>
#include <contrastive/tags.hpp>

#include <string>
#include <type_traits>
#include <utility>

namespace contrastive
{
namespace objectives
{
/// Whether O is one of the objective types.
template <class O>
inline constexpr bool is_objective_v =
    std::is_same_v<O, symmetric> || std::is_same_v<O, info_nce> || std::is_same_v<O, sigmoid>;

/// The problem's field that holds the objective, as errors name it.
inline constexpr const char* field = "obj";

/// Whether `code` names an objective.
constexpr bool known(objective code) noexcept
{
  return code == symmetric::code || code == info_nce::code || code == sigmoid::code;
}

/// invalid_argument "obj" for a code that names no objective (check_problem's first objective check).
inline status check_known(objective code)
{
  if (known(code))
  {
    return {};
  }
  return {errc::invalid_argument,
          field,
          "unknown objective " + std::to_string(static_cast<int>(code)) + " (symmetric, info_nce or sigmoid)"};
}

/// f(O{}) for the objective of `code`; an unknown code (which check_known and check_problem refuse before any call
/// runs) is taken as symmetric.
template <class F>
decltype(auto) visit(objective code, F&& f)
{
  switch (code)
  {
  case info_nce::code:
    return std::forward<F>(f)(info_nce{});
  case sigmoid::code:
    return std::forward<F>(f)(sigmoid{});
  default:
    return std::forward<F>(f)(symmetric{});
  }
}
/// f(O{}) for the objective of problem `p` (any type with an `obj` member).
template <class P, class F>
decltype(auto) visit(const P& p, F&& f)
{
  return visit(p.obj, std::forward<F>(f));
}
/// The objective of problem `p`, as its enumerator (what ranks exchange to agree on it).
template <class P>
constexpr objective code_of(const P& p) noexcept
{
  return p.obj;
}

/// An objective's traits as values, for the boundary checks that read them before (or instead of) a dispatch.
struct runtime_traits
{
  const char* name;  ///< O::name
  bool softmax;      ///< O::softmax
  bool columns;      ///< O::columns
  bool has_bias;     ///< O::has_bias
  bool takes_labels; ///< O::takes_labels
};
/// The traits of problem `p`'s objective.
template <class P>
runtime_traits traits_of(const P& p) noexcept
{
  return visit(p,
               [](auto o)
               {
                 using O = decltype(o);
                 return runtime_traits{O::name, O::softmax, O::columns, O::has_bias, O::takes_labels};
               });
}

/// The logit bias b of z = S + b: finite, and 0 unless O takes one (a softmax is invariant to it, so a nonzero one
/// would do nothing: refused instead).
template <class O>
status check_logit_bias(float bias)
{
  if (!detail::finite(bias))
  {
    return {errc::invalid_argument, "logit_bias", "logit_bias = " + std::to_string(bias) + "; it must be finite"};
  }
  if (!O::has_bias && bias != 0.0f)
  {
    return {errc::invalid_argument,
            "logit_bias",
            "logit_bias = " + std::to_string(bias) + " with objective " + O::name +
                ": the bias applies to objective::sigmoid only (a softmax is invariant to it); pass 0"};
  }
  return {};
}
} // namespace objectives
} // namespace contrastive
