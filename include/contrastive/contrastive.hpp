// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Umbrella header: everything a host user needs.

#include <contrastive/core.hpp>
#include <contrastive/detail/config.hpp>
#include <contrastive/loss.hpp>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/online_lse.hpp>
#include <contrastive/policy/optimizer.hpp>
#include <contrastive/policy/range_guard.hpp>
#include <contrastive/policy/scaler.hpp>
#include <contrastive/policy/temperature.hpp>
#include <contrastive/problem.hpp>
#include <contrastive/status.hpp>
