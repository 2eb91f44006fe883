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

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

namespace contrastive
{
namespace objectives
{
/// A list of objective types.
template <class... Os>
struct list
{
  static constexpr std::size_t size = sizeof...(Os); ///< the number of types
};
/// Every objective, in the order of their codes: the one list the checks, the dispatch and the messages below read
/// (adding an objective adds its type here).
using all = list<symmetric, info_nce, sigmoid>;

/// The operations on a list that the functions below apply to `all`.
namespace lists
{
/// Whether O is in the list.
template <class O, class... Os>
constexpr bool contains(list<Os...>) noexcept
{
  return (std::is_same_v<O, Os> || ...);
}
/// Whether `code` is the code of a type in the list.
template <class... Os>
constexpr bool known_in(objective code, list<Os...>) noexcept
{
  return ((code == Os::code) || ...);
}
/// The types' names as a message lists them: "a, b or c".
template <class... Os>
std::string names_of(list<Os...>)
{
  const char* names[] = {Os::name...};
  std::string out;
  for (std::size_t i = 0; i < sizeof...(Os); ++i)
  {
    out += i == 0 ? "" : (i + 1 == sizeof...(Os) ? " or " : ", ");
    out += names[i];
  }
  return out;
}
/// No type left: an unknown code, taken as symmetric (see visit).
template <class F>
decltype(auto) visit_in(objective, F&& f, list<>)
{
  return std::forward<F>(f)(symmetric{});
}
/// f(O{}) for the first type O of the list whose code is `code`.
template <class F, class O, class... Os>
decltype(auto) visit_in(objective code, F&& f, list<O, Os...>)
{
  if (code == O::code)
  {
    return std::forward<F>(f)(O{});
  }
  return visit_in(code, std::forward<F>(f), list<Os...>{});
}
} // namespace lists

/// Whether O is one of the objective types.
template <class O>
inline constexpr bool is_objective_v = lists::contains<O>(all{});

/// The number of objectives.
inline constexpr std::size_t count = all::size;

/// The problem's field that holds the objective, as errors name it.
inline constexpr const char* field = "obj";

/// Whether `code` names an objective.
constexpr bool known(objective code) noexcept
{
  return lists::known_in(code, all{});
}

/// The objectives' names as a message lists them ("symmetric, info_nce or sigmoid").
inline std::string names()
{
  return lists::names_of(all{});
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
          "unknown objective " + std::to_string(static_cast<int>(code)) + " (" + names() + ")"};
}

/// f(O{}) for the objective of `code`, O the type in `all` whose code it is; an unknown code (which check_known and
/// check_problem refuse before any call runs) is taken as symmetric. Every call of f must return the same type.
template <class F>
decltype(auto) visit(objective code, F&& f)
{
  return lists::visit_in(code, std::forward<F>(f), all{});
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
    return {errc::invalid_argument, "logit_bias", "logit_bias = " + detail::number_text(bias) + "; it must be finite"};
  }
  if (!O::has_bias && bias != 0.0f)
  {
    return {errc::invalid_argument,
            "logit_bias",
            "logit_bias = " + detail::number_text(bias) + " with objective " + O::name +
                ": the bias applies to objective::sigmoid only (a softmax is invariant to it); pass 0"};
  }
  return {};
}
} // namespace objectives
} // namespace contrastive
