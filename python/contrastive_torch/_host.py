# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The host engine (csrc/binding.cpp's `Loss`): one pool of engines, reused across calls (their buffers stay
allocated), and the one-process step that the operators' CPU kernels run."""

import threading

from ._checks import DTYPE_NAMES
from ._extension import extension

# The library's step record sites (contrastive::nonfinite_site), in its order: first_nonfinite_code indexes this.
NONFINITE_SITES = ("none", "logits", "loss", "grad_q", "grad_k", "grad_logit_scale", "parameters", "grad_logit_bias")


class Pool:
    """Engines by key: (dtype, algorithm, threads) for one process, (dtype, algorithm, threads, rank, size) for an
    engine over a process group. An engine is taken for one forward (and its backward) and given back; every rank of
    a group makes the same calls, so every rank takes its engines in the same order. A distributed engine is given
    the group with each call, never keeps it (a process group alive at interpreter exit, after
    destroy_process_group, can abort the process)."""

    def __init__(self):
        self._free = {}
        self._lock = threading.Lock()

    def take(self, key, group=None):
        with self._lock:
            stack = self._free.get(key)
            if stack:
                return stack.pop()
        return extension().Loss(*key[:3]) if group is None else extension().Loss(*key[:3], group)

    def give(self, key, handle):
        with self._lock:
            self._free.setdefault(key, []).append(handle)


pool = Pool()


def step(q, k, scale, bias, labels32, objective, algorithm, threads, grads, loss_scale=1.0):
    """One host forward (and, when `grads`, backward at `loss_scale`): (loss, dq, dk, d loss/d log s, d loss/d b,
    max logit, first non-finite site) with the scalars as float64 values. `objective`: 'symmetric', 'info_nce' or
    'sigmoid' (then `bias` is the logit bias). The engine goes back to the pool before returning."""
    key = (DTYPE_NAMES[q.dtype], algorithm, threads)
    handle = pool.take(key)
    try:
        if objective == "sigmoid":
            value, _tau = handle.forward_sigmoid(q, k, scale, bias, labels32)
        else:
            value, _tau = handle.forward(q, k, scale, labels32, objective == "symmetric")
        dq = dk = dlogs = dbias = None
        if grads:
            if objective == "sigmoid":
                dq, dk, dlogs, dbias = handle.backward_sigmoid(loss_scale)
            else:
                dq, dk, dlogs = handle.backward(loss_scale)
        site, max_logit = handle.diagnosis()
    finally:
        pool.give(key, handle)
    return value, dq, dk, dlogs, dbias, max_logit, NONFINITE_SITES.index(site)
