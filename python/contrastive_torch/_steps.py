# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""One process's loss step: the arguments' scalars checked, the operator called (contrastive_torch._ops), the step's
diagnosis filled in. functional.py (one process) and _distributed.py (this rank's rows against the gathered ones)
both call these; this module imports neither of them."""

import torch

from . import _checks, _host
from ._extension import require_custom_ops
from ._host import NONFINITE_SITES


def compiling():
    """True while torch.compile (dynamo) traces the caller."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def _wants_grads(*tensors):
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _fill(report, out, q):
    """The step's diagnosis into `report` (a dict; None: nothing)."""
    if report is None or compiling():
        return
    loss, max_logit, site = out[0], out[-2], out[-1]
    report.update({"loss": loss.detach(), "max_logit": max_logit.detach(), "first_nonfinite_code": site})
    if q.device.type == "cpu":
        report["first_nonfinite"] = NONFINITE_SITES[int(site)]
        report["algorithm"] = _host.last_algorithm()


def softmax(q, k, logit_scale, labels, symmetric, algorithm, threads, fused_tiles, report, groups=(None, None)):
    """The softmax objectives (symmetric, InfoNCE) through contrastive_torch::softmax_step, or grouped_softmax_step
    with `groups` (checked int64 group ids, _checks.groups)."""
    require_custom_ops()
    s = _checks.scalar("logit_scale", logit_scale, q.device)
    if groups[0] is not None:
        out = torch.ops.contrastive_torch.grouped_softmax_step(q, k, s, groups[0], groups[1], symmetric, algorithm,
                                                               threads, _wants_grads(q, k, s))
        _fill(report, out, q)
        return out[0]
    labels = _checks.labels(labels, q.shape[0], q.device)
    out = torch.ops.contrastive_torch.softmax_step(q, k, s, labels, symmetric, algorithm, threads, fused_tiles,
                                                   _wants_grads(q, k, s))
    _fill(report, out, q)
    return out[0]


def sigmoid(q, k, logit_scale, logit_bias, algorithm, threads, report, groups=(None, None)):
    """The sigmoid objective (SigLIP) through contrastive_torch::sigmoid_step, or grouped_sigmoid_step with
    `groups`."""
    require_custom_ops()
    s = _checks.scalar("logit_scale", logit_scale, q.device)
    b = _checks.scalar("logit_bias", 0.0 if logit_bias is None else logit_bias, q.device,
                       "None, a number or a one-element tensor")
    if groups[0] is not None:
        out = torch.ops.contrastive_torch.grouped_sigmoid_step(q, k, s, b, groups[0], groups[1], algorithm, threads,
                                                               _wants_grads(q, k, s, b))
    else:
        out = torch.ops.contrastive_torch.sigmoid_step(q, k, s, b, algorithm, threads, _wants_grads(q, k, s, b))
    _fill(report, out, q)
    return out[0]
