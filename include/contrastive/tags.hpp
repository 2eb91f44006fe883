// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The compile-time choices of a call: the objective, the algorithm tags (and the one list the bindings take their
/// names from), the host GEMM core.

#include <contrastive/detail/config.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

namespace contrastive
{
/// Which loss is taken over the logits S_ij = s <q_i, k_j>: a softmax cross-entropy (symmetric, info_nce) or the
/// pairwise sigmoid loss.
enum class objective : std::int32_t
{
  /// CLIP's loss: 0.5 * (mean_i CE(S_i., i) + mean_j CE(S_.j, j)); needs n_q == n_k, positives on the diagonal (with
  /// group ids, problem::query_groups: the pairs of equal ids, and n_q may differ from n_k).
  symmetric = 0,
  /// One-directional InfoNCE: mean_i CE(S_i., p_i) with p_i = labels[i] (default i); n_k may exceed n_q (MoCo queue).
  info_nce = 1,
  /// SigLIP's pairwise sigmoid loss: (1/n_q) sum_ij softplus(-l_ij z_ij) over the logits z_ij = S_ij + b (b: the
  /// logit bias, a parameter of the call), with l_ij = +1 for the positive pair p_i = labels[i] (default i) and -1
  /// for every other; n_k may differ from n_q (numeric/sigmoid_math.hpp). Host: every algorithm; device:
  /// algorithm::chunked (device/chunked.cuh) and the NCCL loss.
  sigmoid = 2,
};

/// Short name of an objective, as its enumerator is spelled; "unknown" for a value outside the enumeration.
inline const char* to_string(objective o) noexcept
{
  switch (o)
  {
  case objective::symmetric:
    return "symmetric";
  case objective::info_nce:
    return "info_nce";
  case objective::sigmoid:
    return "sigmoid";
  }
  return "unknown";
}

namespace algorithm
{
/// Builds the n_q x n_k logits in the element type, as frameworks' autocast does: A = round_T(Q K^T) (float
/// accumulation), S = round_T(s * A), cross-entropy in float; backward forms dS = round_T(loss_scale * dL/dS) and
/// dA = round_T(s * dS) in the element type, then dQ = round_T(dA K), dK = round_T(dA^T Q). Memory O(n_q n_k).
/// On this path a large s overflows fp16 logits exactly as framework autocast does.
struct materialized
{
  static constexpr const char* name = "materialized"; ///< its name in the bindings and in messages
  static constexpr bool element_logits = true; ///< the logits are stored in the element type (the device dispatch)
};

/// Tiled, online log-sum-exp (flash-attention style): logits live only in float tiles, never in memory; backward
/// recomputes them from the saved row/column log-sum-exps. The only rounding to the element type is the final
/// dQ = round_T(loss_scale * s * sum_j G_ij k_j) and dK likewise. Memory O((n_q + n_k) d).
struct fused
{
  static constexpr const char* name = "fused";  ///< its name in the bindings and in messages
  static constexpr bool element_logits = false; ///< logits only in float tiles, never in the element type
};

/// Row chunks of B queries against all keys: S_c = s Q_c K^T is stored for one chunk at a time (float), its row
/// statistics are complete within the chunk and the column statistics of the symmetric loss are merged from
/// per-chunk partials; the backward forms G_c, then dQ_c = s G_c K and dK += s G_c^T Q_c. Each step is one large
/// matrix product (cuBLAS on the device, the host GEMM policy on the host) plus element-wise passes built from the
/// shared tile math. Work: 6 n_q n_k d flops when one chunk holds every row, else 8 (the backward recomputes S_c);
/// memory O(B n_k + (n_q + n_k) d), B chosen by `chunk_options`. Numerics as `fused` (float logits, the positive's
/// gradient formed exactly); on the device G_c is rounded to the element type for the tensor-core products.
struct chunked
{
  static constexpr const char* name = "chunked"; ///< its name in the bindings and in messages
  static constexpr bool element_logits = false;  ///< float chunks of logits (on the device: device/chunked.cuh)
};

/// Host, one process: per call, `materialized` where its buffers (the engine's `bytes_for`) fit a memory budget, its
/// logits are float (float elements) and the objective is a softmax, else `fused`. For the softmax objectives
/// materialized executes 6 n_q n_k d flops to fused's 8 and is the faster host algorithm wherever its n_q n_k logits
/// fit; the sigmoid objective's fused step is one pass (6 to 6), faster than materialized, so it always runs fused.
/// Fused needs O((n_q + n_k) d) memory at any batch. The budget
/// is a quarter of the memory the operating system reports available at the call (Linux: MemAvailable within the
/// cgroup's and the address-space limits; what the loss holds already counts as available to it), or what
/// `set_memory_budget` sets.
/// Accuracy: materialized rounds A = Q K^T and S = s A to the element type, as frameworks' autocast does, so a logit is
/// off by up to |S| u / 2 (u: the element type's relative spacing, 2^-8 for bfloat16; |S| <= s for L2-normalised
/// features), and softmax(S) by that much relatively. On a batch the model has learned (each key next to its query) the
/// gradient is the small difference softmax(S) - target, and that rounding is a large part of it: measured on bfloat16
/// at s = 100 (docs/algorithms.md), dQ 0.079 off float64 on loss_test's AutomaticAccuracy learned batch and up to 1.0
/// on closer keys (scripts/trained_accuracy.py), where fused, whose logits are float, is 0.004 off. So: float runs
/// materialized whenever it fits (its logits are float); bfloat16 and __half always fused (float16's logits also
/// overflow at large logit scales: the fp16 collapse); pick `materialized` explicitly for autocast's numerics and its
/// 6/8 of fused's flops. `algorithm_used()` of the loss names the algorithm the last call ran, `materializes(p, s)` the
/// one a call would run now (s is not weighed by any host rule today). On the device (device/chunked.cuh) automatic is
/// the chunked loss sized by memory, whose logits are float at any s. Not one of `all`, the concrete algorithms the
/// bindings dispatch on.
struct automatic
{
  static constexpr const char* name = "automatic"; ///< its name in messages
  static constexpr bool element_logits = false;    ///< never: 16-bit runs fused, float's materialized logits are float
};

/// Every algorithm, in the order the bindings list them: the one table their names come from.
template <class... A>
struct list
{
  static constexpr std::size_t size = sizeof...(A); ///< number of algorithms in the list
};
/// The library's algorithms, in the bindings' order: fused, materialized, chunked.
using all = list<fused, materialized, chunked>;

/// Whether `A` is one of `list`'s algorithms.
template <class A, class List>
struct in_list;
template <class A, class... B>
struct in_list<A, list<B...>> : std::bool_constant<(std::is_same_v<A, B> || ...)>
{
};
/// Whether `A` is one of the library's algorithms (a member of `all`).
template <class A>
inline constexpr bool is_algorithm_v = in_list<A, all>::value;

/// Calls `f(Algorithm{})` for the algorithm of `list` whose `name` is `name` and returns true; false when none is
/// (then `names()` lists them for the error message).
template <class F, class... A>
bool dispatch_in(list<A...>, const char* name, F&& f)
{
  bool found = false;
  const auto one = [&](auto tag)
  {
    using T = decltype(tag);
    if (!found && std::strcmp(name, T::name) == 0)
    {
      found = true;
      f(tag);
    }
  };
  (one(A{}), ...);
  return found;
}
/// `dispatch_in` over `all`: calls `f(Algorithm{})` for the library's algorithm named `name` and returns true; false
/// when no algorithm has that name.
template <class F>
bool dispatch(const char* name, F&& f)
{
  return dispatch_in(all{}, name, std::forward<F>(f));
}

/// The names of a list, quoted and comma-separated, for messages.
template <class... A>
std::string names_in(list<A...>)
{
  std::string s;
  ((s += (s.empty() ? "'" : ", '") + std::string(A::name) + "'"), ...);
  return s;
}
/// "'fused', 'materialized', 'chunked'".
inline std::string names()
{
  return names_in(all{});
}
} // namespace algorithm

/// The host GEMM core, chosen at compile time (the last template argument of `contrastive::loss`; the device path
/// uses cuBLAS-free kernels of its own and ignores it).
namespace gemm
{
/// The library's own packed, register-blocked micro-kernel (host/gemm.hpp): no dependency.
struct builtin
{
  static constexpr const char* name = "builtin"; ///< its name in messages
};

/// A CBLAS `cblas_sgemm` (OpenBLAS, BLIS, MKL, ...) for users who already link one: include
/// <contrastive/host/cblas_gemm.hpp> and link a CBLAS (CMake: the `contrastive::cblas` target, which finds one with
/// FindBLAS). Run the BLAS single-threaded (OPENBLAS_NUM_THREADS=1, or `host::cblas_single_threaded()`): the loss
/// parallelises over its own workers and calls the BLAS from each of them.
struct cblas
{
  static constexpr const char* name = "cblas"; ///< its name in messages
};
} // namespace gemm

} // namespace contrastive
