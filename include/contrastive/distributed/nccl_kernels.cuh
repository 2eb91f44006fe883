// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// The small kernels of the device global-batch loss (distributed/nccl.cuh) around its collectives: the rows'
/// global labels, the column partials rescaled to the global maxima and finished, the rank's sums and flags packed
/// for one all-reduce and unpacked, and finish_step's agreement on the first non-finite site. Only CUDA translation
/// units include this file.

#include <contrastive/device/kernels.cuh>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/numeric/online_lse.hpp>
#include <contrastive/record.hpp>

#include <cstdint>

namespace contrastive
{
namespace distributed
{
namespace nccl_kernels
{
constexpr int threads = 256;

/// Row i's positive column: the caller's global label, or the global diagonal.
template <int = 0>
__global__ void fill_labels(std::int32_t* out, const std::int32_t* user, long long n, long long q_off)
{
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
  {
    out[i] = user != nullptr ? user[i] : static_cast<std::int32_t>(q_off + i);
  }
}

/// Each column's local negatives rescaled to the global max (sums), and zeroed positives.
template <int = 0>
__global__ void
rescale_columns(const float* local_max, const float* local_sum, const float* global_max, float* pack, long long n)
{
  for (long long j = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<long long>(gridDim.x) * blockDim.x)
  {
    online_lse s{local_max[j], local_sum[j]};
    s.rebase(global_max[j] == -detail::infinity_f ? s.max : global_max[j]);
    pack[j] = s.max == -detail::infinity_f ? 0.0f : s.sum;
    pack[n + j] = 0.0f;
  }
}

/// Column q_off + i's positive is this rank's row i's.
template <int = 0>
__global__ void scatter_positives(const float* pos, float* pack_pos, long long n_rows, long long q_off)
{
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n_rows;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
  {
    pack_pos[q_off + i] = pos[i];
  }
}

/// The global column log-sum-exps and losses.
template <int = 0>
__global__ void
finish_global_columns(const float* global_max, const float* pack, float* col_lse, float* col_loss, long long n)
{
  for (long long j = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<long long>(gridDim.x) * blockDim.x)
  {
    const row_loss rl = finish_row(online_lse{global_max[j], pack[j]}, pack[n + j]);
    col_lse[j] = rl.lse;
    col_loss[j] = rl.loss;
  }
}

/// This rank's sums and flags into `red`: row loss, <dQ, Q>, three flags, [5] the failure flag (set by the host),
/// [6] the max logit; 0..5 are summed over ranks, 6 maxed.
template <int = 0>
__global__ void pack_results(const device::kernels::step_sums* sums, const int* flags, float* red)
{
  red[0] = sums->row_loss;
  red[1] = sums->dlogs;
  red[2] = flags[0] != 0 ? 1.0f : 0.0f;
  red[3] = flags[1] != 0 ? 1.0f : 0.0f;
  red[4] = flags[2] != 0 ? 1.0f : 0.0f;
  red[6] = sums->max_logit;
}

/// The all-reduced results back into the sums and flags the finish kernel reads (column losses are already global).
template <int = 0>
__global__ void unpack_results(const float* red, device::kernels::step_sums* sums, int* flags)
{
  sums->row_loss = red[0];
  sums->dlogs = red[1];
  flags[0] = red[2] != 0.0f ? 1 : 0;
  flags[1] = red[3] != 0.0f ? 1 : 0;
  flags[2] = red[4] != 0.0f ? 1 : 0;
  sums->max_logit = red[6];
}

/// finish_step's agreement: this rank's first non-finite site (none -> a large value) out, the minimum back in.
template <class State>
__global__ void site_out(const State* state, std::int32_t* site)
{
  const auto s = static_cast<std::int32_t>(state->record.first_nonfinite);
  site[0] = s == static_cast<std::int32_t>(nonfinite_site::none) ? 1 << 30 : s;
  site[1] = state->record.pending ? 0 : -1; // the minimum is -1 when any rank has no step in progress
}
template <class State>
__global__ void site_in(State* state, const std::int32_t* site)
{
  if (site[1] == 0) // every rank pending (the host refuses otherwise)
  {
    state->record.first_nonfinite = site[0] == (1 << 30) ? nonfinite_site::none : static_cast<nonfinite_site>(site[0]);
  }
}
} // namespace nccl_kernels
} // namespace distributed
} // namespace contrastive
