// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// `contrastive::loss<Element, Temperature, Scaler, Algorithm, Gemm>`: the compile-time configuration and one training
/// step on the host, in one process. It is `basic_loss` (step/loss.hpp: the policies; step/driver.hpp: the step)
/// over `distributed::comm::self`, the communicator of one process, for which every collective is elided at compile
/// time.
///
/// Element: float, __half or __nv_bfloat16. Policies come last, with defaults; the last, Gemm, chooses the host GEMM
/// core (gemm::builtin, or gemm::cblas with <contrastive/host/cblas_gemm.hpp>).

#include <contrastive/comm/communicator.hpp>
#include <contrastive/policy/scaler.hpp>
#include <contrastive/policy/temperature.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/step/loss.hpp>

namespace contrastive
{
/// One process's training step on the host: `basic_loss` over distributed::comm::self (see the file comment).
template <class Element,
          class Temperature = temperature::learnable,
          class Scaler = scaler::static_scale,
          class Algorithm = algorithm::fused,
          class Gemm = gemm::builtin>
using loss = basic_loss<Element, Temperature, Scaler, Algorithm, distributed::comm::self, Gemm>;
} // namespace contrastive
