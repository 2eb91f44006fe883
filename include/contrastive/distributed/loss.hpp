// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `contrastive::distributed::loss`: the loss of the *global* batch when every rank holds n_local rows of Q and K
/// (data parallelism), with the same policies as `contrastive::loss` stepping identically on every rank. It is
/// `basic_loss` (step/loss.hpp) over a communicator: the same class, API and step driver (step/driver.hpp) as one
/// process, whose collectives run here.
///
/// What moves per step on rank r (every rank calls it; every path, errors included, runs the same collectives):
///   agreement  the ranks' calls, step counts, iterations and shapes are all-gathered (ranks out of step are refused
///              on every rank at the first wrong call: comm/agreement.hpp); every check runs (shapes,
///              pointers, labels against the global key count, finiteness, policies, sizes) and a failure on any rank
///              is returned on every rank, naming the rank ("rank 2: k[5][0] is not finite"), before any feature
///              moves. Allocation failures are agreed on the same way.
///   keys       K is all-gathered in the element type (N_k x D; Q is not needed anywhere else).
///   rows       the rank's block of rows, S_r = s Q_r K^T (n_local x N_k), goes through the host engine's row
///              phase: row statistics are complete locally; for the symmetric loss each column's negatives over the
///              block's rows are combined across ranks (an all-reduce max of N_k floats, then a sum of 2 N_k floats:
///              the rescaled sums and the positives), so every rank holds the global column log-sum-exps.
///   backward   with the global coefficients: dQ_r is complete locally; the block's contribution to dK for all N_k
///              keys (float) is reduce-scattered back to the owners and rounded once to the element type.
///   record     loss, max logit, d loss / d log s and the non-finite flags are all-gathered per rank and combined in
///              rank order (identical bits everywhere); `finish_step` (which also agrees on a `parameters` site found
///              by `unscale_and_check` on any rank) steps the policies in lockstep, as DDP + GradScaler do.
/// Communication per step: N_k D elements gathered, N_k D floats reduced, 3 N_k floats of column statistics (the
/// symmetric loss), and O(ranks) scalars; never N x N data. Memory per rank: the gathered K (N_k D elements), the
/// engine for an n_local x N_k problem (fused: no packed K, its workers' key tiles; materialized: n_local x N_k logits,
/// 1/ranks of one process; chunked: its chunk) and the float dK partial (N_k D).
///
/// Unequal n_local per rank works. The symmetric objective needs n_q == n_k on each rank (pairs) and positives on the
/// global diagonal; info_nce labels are global key indices (null: the global diagonal). With group ids (each rank its
/// own rows' ids, problem::query_groups) a positive may lie on any rank and no shape rule applies. Comm: comm::local
/// (one process through this algorithm's copies, no library) or comm::mpi (<contrastive/comm/mpi.hpp>), or any type
/// with the collectives of comm/communicator.hpp.

#include <contrastive/comm/communicator.hpp>
#include <contrastive/policy/scaler.hpp>
#include <contrastive/policy/temperature.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/step/loss.hpp>

namespace contrastive
{
namespace distributed
{
/// The global-batch loss on the host (see the file comment): `basic_loss` over the communicator `Comm`, with the
/// single-process loss's policies, algorithm and GEMM backend.
template <class Element,
          class Temperature = temperature::learnable,
          class Scaler = scaler::static_scale,
          class Algorithm = algorithm::fused,
          class Comm = comm::local,
          class Gemm = gemm::builtin>
using loss = basic_loss<Element, Temperature, Scaler, Algorithm, Comm, Gemm>;
} // namespace distributed
} // namespace contrastive
