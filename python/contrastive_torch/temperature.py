# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Helpers for the temperature a PyTorch model owns (open_clip's `logit_scale`, the log of s = 1/tau)."""

import math

import torch


@torch.no_grad()
def clamp_logit_scale(logit_scale_param, max_scale=100.0, min_scale=1.0):
    """open_clip's clamp, on the user's parameter (log of s): keeps s = exp(param) in [min_scale, max_scale] (tau in
    [1/max_scale, 1/min_scale]); call after optimizer.step()."""
    logit_scale_param.clamp_(min=math.log(min_scale), max=math.log(max_scale))


def freeze_then_learn(logit_scale_param, step, unfreeze_step):
    """The seed's remedy: the temperature stays fixed (requires_grad False) until `unfreeze_step` finite steps."""
    logit_scale_param.requires_grad_(step >= unfreeze_step)
