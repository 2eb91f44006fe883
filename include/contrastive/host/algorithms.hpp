// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The host engine's phases per algorithm (`forward_rows`, `backward`), each templated on the objective O
/// (objectives/objectives.hpp): the only place the engine picks code by algorithm tag. The buffers each needs are its
/// `algorithm_traits` (host/algorithm_traits.hpp).

#include <contrastive/host/algorithm_traits.hpp>
#include <contrastive/host/chunked.hpp>
#include <contrastive/host/engine_state.hpp>
#include <contrastive/host/fused.hpp>
#include <contrastive/host/materialized.hpp>
#include <contrastive/host/sigmoid.hpp>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/tags.hpp>

namespace contrastive
{
namespace host
{
template <class Algorithm>
struct algorithm_impl;

template <>
struct algorithm_impl<algorithm::fused> : algorithm_traits<algorithm::fused>
{
  /// The sigmoid objective runs forward and backward in one pass (host/sigmoid.hpp): its backward only scales.
  template <class O, class T, class Gemm>
  static row_pass forward_rows(engine_state<T, Gemm>& st, float s)
  {
    if constexpr (O::softmax)
    {
      return fused_forward_rows<O>(st, s);
    }
    else
    {
      return fused_sigmoid_forward_rows<O>(st, s);
    }
  }
  template <class O, class T, class Gemm, class Out>
  static backward_result
  backward(engine_state<T, Gemm>& st, float loss_scale, const grad_coefficients& gc, Out* dq, Out* dk)
  {
    if constexpr (O::softmax)
    {
      return fused_backward<O>(st, loss_scale, gc, dq, dk);
    }
    else
    {
      return fused_sigmoid_backward(st, loss_scale, gc, dq, dk);
    }
  }
};

template <>
struct algorithm_impl<algorithm::materialized> : algorithm_traits<algorithm::materialized>
{
  template <class O, class T, class Gemm>
  static row_pass forward_rows(engine_state<T, Gemm>& st, float s)
  {
    return st.template forward_rows<algorithm::materialized, O>(s);
  }
  template <class O, class T, class Gemm, class Out>
  static backward_result
  backward(engine_state<T, Gemm>& st, float loss_scale, const grad_coefficients& gc, Out* dq, Out* dk)
  {
    return materialized_backward<O>(st, loss_scale, gc, dq, dk);
  }
};

template <>
struct algorithm_impl<algorithm::chunked> : algorithm_traits<algorithm::chunked>
{
  template <class O, class T, class Gemm>
  static row_pass forward_rows(engine_state<T, Gemm>& st, float s)
  {
    return chunked_forward_rows<O>(st, s);
  }
  template <class O, class T, class Gemm, class Out>
  static backward_result
  backward(engine_state<T, Gemm>& st, float loss_scale, const grad_coefficients& gc, Out* dq, Out* dk)
  {
    return chunked_backward<O>(st, loss_scale, gc, dq, dk);
  }
};
} // namespace host
} // namespace contrastive
