# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Shared by the tests: which optional parts must be there, and fresh random seeds.

CONTRASTIVE_TORCH_REQUIRE (comma-separated: open_clip, open_clip_train, custom_ops, compile, distributed;
tests/CMakeLists.txt sets all five for the venv of scripts/setup.sh) turns the skip of a missing part into a failure, so CI cannot pass by skipping.
CONTRASTIVE_TEST_SEED fixes the seeds that the parity tests otherwise draw afresh on every run (each failure message
names its seed)."""

import os
import secrets

import pytest

REQUIRED = {p.strip() for p in os.environ.get("CONTRASTIVE_TORCH_REQUIRE", "").split(",") if p.strip()}


def require(part, available, why):
    """Skips the calling test when `part` is unavailable, unless CONTRASTIVE_TORCH_REQUIRE names it (then fails)."""
    if available:
        return
    if part in REQUIRED:
        pytest.fail(f"{part} is required here (CONTRASTIVE_TORCH_REQUIRE) but unavailable: {why}")
    pytest.skip(f"{part} unavailable: {why}")


@pytest.fixture
def seed():
    value = os.environ.get("CONTRASTIVE_TEST_SEED")
    return int(value) if value is not None else secrets.randbits(31)


@pytest.fixture
def needs_custom_ops():
    """Skips (or, where required, fails) a test on PyTorch without torch.library.custom_op (< 2.4): the losses run
    through the operators only. Use with pytestmark = pytest.mark.usefixtures("needs_custom_ops")."""
    import torch

    import contrastive_torch as ct

    require("custom_ops", ct.HAS_CUSTOM_OPS, f"PyTorch {torch.__version__} < 2.4 has no torch.library.custom_op")
