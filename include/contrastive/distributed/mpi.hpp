// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Deprecated path: include <contrastive/comm/mpi.hpp>, where this header now lives.

#include <contrastive/comm/mpi.hpp>
