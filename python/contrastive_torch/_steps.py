# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""One process's loss step: the arguments' scalars checked, the operator called (contrastive_torch._ops), the step's
diagnosis filled in. functional.py (one process) and _distributed.py (this rank's rows against the gathered ones)
both call these; this module imports neither of them."""

import math
import re

import torch

from . import _checks, _host
from ._checks import compiling
from ._extension import require_custom_ops
from ._ops import autocast_dtype
from ._host import NONFINITE_SITES


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


# The caller's names of (q, k, query_groups, key_groups), which the library's messages call by its own.
QUERY_NAMES = ("query", "keys", "query_groups", "key_groups")
TOWER_NAMES = ("image_features", "text_features", "image_groups", "text_groups")


def renamed(error, names, inputs=None):
    """The library's refusal (ValueError, OverflowError) with its argument named as the caller named it: q, k, n_q,
    n_k, dim (the features' width), query_groups and key_groups become names[0], names[1], names[0], names[1],
    names[0], names[2], names[3], in the message's head and in its text (n_q and n_k as names[0].shape[0] and
    names[1].shape[0]; the message keeps the library's detail, e.g. 'image_features: image_features[2][3] is not
    finite'). Other errors unchanged.
    Eager calls only: under torch.compile the operator raises inside the compiled graph, with the library's names.
    `inputs` (the caller's q and k): a feature finite as passed but cast past the autocast dtype's range is said so
    (_cast_overflow)."""
    text = str(error)
    head = re.match(r"contrastive: (\w+): ", text)
    mapping = {"q": names[0], "n_q": names[0], "k": names[1], "n_k": names[1], "dim": names[0],
               "query_groups": names[2], "key_groups": names[3]}
    if head is None:
        return error
    said = text[head.end():]
    rest = re.sub(r"\bk\[", names[1] + "[", re.sub(r"\bq\[", names[0] + "[", said))
    rest = re.sub(r"\bkey_groups\b", names[3], re.sub(r"\bquery_groups\b", names[2], rest))
    rest = re.sub(r"\bn_k\b", names[1] + ".shape[0]", re.sub(r"\bn_q\b", names[0] + ".shape[0]", rest))
    name = mapping.get(head.group(1), head.group(1))
    if name == head.group(1) and rest == said:
        return _cast_overflow(error, names, inputs)
    return _cast_overflow(type(error)(f"contrastive: {name}: {rest}"), names, inputs)


def _cast_overflow(error, names, inputs):
    """A 'not finite' refusal of a feature that is finite as the caller passed it (float32) but not in the dtype an
    autocast region runs it at (a float16 region and a value past 65504): said so, instead of naming a value the
    caller never passed. `inputs`: the caller's (q, k), or None."""
    found = re.match(r"contrastive: (\w+): (\w+)\[(\d+)\]\[(\d+)\] is not finite", str(error))
    if inputs is None or found is None or found.group(2) not in names[:2]:
        return error
    x = inputs[names.index(found.group(2))]
    dtype = autocast_dtype(x.device.type) if isinstance(x, torch.Tensor) else None
    if dtype is None or x.dtype != torch.float32 or x.device.type != "cpu" or compiling():
        return error
    value = float(x.detach()[int(found.group(3)), int(found.group(4))])
    if not math.isfinite(value):
        return error
    return type(error)(f"contrastive: {found.group(1)}: {found.group(2)}[{found.group(3)}][{found.group(4)}] = "
                       f"{value:g} is finite in float32 but overflows {str(dtype).replace('torch.', '')} (largest "
                       f"finite {torch.finfo(dtype).max:g}), the dtype this autocast region runs the features at; "
                       "scale the features into its range or call the loss outside autocast [non_finite_input]")


def softmax(q, k, logit_scale, labels, symmetric, algorithm, threads, fused_tiles, report, groups=(None, None),
            names=QUERY_NAMES):
    """The softmax objectives (symmetric, InfoNCE) through contrastive_torch::softmax_step, or grouped_softmax_step
    with `groups` (checked int64 group ids, _checks.groups). `names`: the caller's names of q, k and the two ids, for
    the operator's refusals (renamed)."""
    require_custom_ops()
    _checks.report(report)
    q, k = q.contiguous(), k.contiguous()  # the operators take rows in place (a copy only where not contiguous)
    s = _checks.scalar("logit_scale", logit_scale, q.device)
    labels = _checks.labels(labels, q.shape[0], q.device) if groups[0] is None else None
    try:
        if groups[0] is not None:
            out = torch.ops.contrastive_torch.grouped_softmax_step(q, k, s, groups[0], groups[1], symmetric,
                                                                   algorithm, threads, _wants_grads(q, k, s))
        else:
            out = torch.ops.contrastive_torch.softmax_step(q, k, s, labels, symmetric, algorithm, threads,
                                                           fused_tiles, _wants_grads(q, k, s))
    except (ValueError, OverflowError) as e:
        raise renamed(e, names, (q, k)) from None
    _fill(report, out, q)
    return out[0]


def sigmoid(q, k, logit_scale, logit_bias, algorithm, threads, report, groups=(None, None), names=TOWER_NAMES):
    """The sigmoid objective (SigLIP) through contrastive_torch::sigmoid_step, or grouped_sigmoid_step with
    `groups`; `names` as softmax's."""
    require_custom_ops()
    _checks.report(report)
    q, k = q.contiguous(), k.contiguous()  # as softmax's
    s = _checks.scalar("logit_scale", logit_scale, q.device)
    b = _checks.scalar("logit_bias", 0.0 if logit_bias is None else logit_bias, q.device,
                       "None, a number or a one-element tensor")
    if groups[0] is None and q.dim() == 2 and k.dim() == 2 and q.shape[0] > k.shape[0]:
        # The operator's own words are the C++ objective's (null labels); SigLIP here takes none.
        raise ValueError(f"contrastive: {names[1]}: {k.shape[0]} texts for {q.shape[0]} images; without group ids "
                         "the positives are the diagonal (image i with text i), which needs as many texts as images "
                         "or more [shape_mismatch]")
    try:
        if groups[0] is not None:
            out = torch.ops.contrastive_torch.grouped_sigmoid_step(q, k, s, b, groups[0], groups[1], algorithm,
                                                                   threads, _wants_grads(q, k, s, b))
        else:
            out = torch.ops.contrastive_torch.sigmoid_step(q, k, s, b, algorithm, threads, _wants_grads(q, k, s, b))
    except (ValueError, OverflowError) as e:
        raise renamed(e, names, (q, k)) from None
    _fill(report, out, q)
    return out[0]
