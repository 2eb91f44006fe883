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

# algorithm::automatic's budget in bytes for every host engine (0: a quarter of the memory available at each call).
_budget = 0
# The algorithm the calling thread's last host step ran (read into `report` by functional).
_last = threading.local()


def set_memory_budget(bytes=0):
    """The memory budget of algorithm=None (the library's algorithm::automatic). On CPU tensors a float32 call runs
    'materialized' (the n x n float logits: 6 n^2 d flops, the fastest host path) when its buffers fit `bytes`, else
    'fused' (8 n^2 d flops, memory O(n d) at any batch); float16 and bfloat16 always run 'fused' (logits rounded to
    16 bits cost a learned batch's gradients all their digits; float16's also overflow). On CUDA tensors a call keeps
    every row's float logits in one chunk (6 n^2 d flops) when that workspace fits `bytes`, else it runs 'chunked'
    with 4096-row chunks (8 n^2 d flops, about 2 GiB at n = 65536, d = 768). 0, the default: a quarter of the memory
    available at each call (the operating system's on the CPU, the device's free memory on CUDA)."""
    global _budget
    from . import _checks
    _budget = _checks.memory_budget(bytes)


def memory_budget():
    """The budget set by set_memory_budget (0: the default, a quarter of the available memory at each call)."""
    return _budget


def host_kernels():
    """What CPU tensors run on in this process, as the extension was compiled (-march=native unless
    CONTRASTIVE_NATIVE=0) and on this CPU: {'float': the float micro-kernel ('avx512', 'avx2+fma', 'avx', 'generic'),
    'bfloat16': the kernel of bfloat16 products ('amx_bf16', 'avx512_bf16', or 'none': converted to float and run on
    the float kernel), 'amx': why the AMX tiles run or not}. float16 always runs on the float kernel. Set
    CONTRASTIVE_HOST_AMX=0 in the environment before the first bfloat16 step to keep the tiles off."""
    return dict(extension().host_kernels())


def last_algorithm():
    """The algorithm the calling thread's last CPU step ran ('fused', 'materialized', ...; None before any)."""
    return getattr(_last, "algorithm", None)


def step(q, k, scale, bias, labels32, objective, algorithm, threads, grads, loss_scale=1.0, query_groups=None,
         key_groups=None):
    """One host forward (and, when `grads`, backward at `loss_scale`): (loss, dq, dk, d loss/d log s, d loss/d b,
    max logit, first non-finite site) with the scalars as float64 values. `objective`: 'symmetric', 'info_nce' or
    'sigmoid' (then `bias` is the logit bias); `query_groups`, `key_groups`: int64 group ids instead of labels. The
    engine goes back to the pool before returning."""
    key = (DTYPE_NAMES[q.dtype], algorithm, threads)
    handle = pool.take(key)
    try:
        if algorithm == "automatic":
            handle.set_memory_budget(_budget)
        if objective == "sigmoid":
            value, _tau = handle.forward_sigmoid(q, k, scale, bias, labels32, query_groups=query_groups,
                                                 key_groups=key_groups)
        else:
            value, _tau = handle.forward(q, k, scale, labels32, objective == "symmetric", query_groups=query_groups,
                                         key_groups=key_groups)
        dq = dk = dlogs = dbias = None
        if grads:
            if objective == "sigmoid":
                dq, dk, dlogs, dbias = handle.backward_sigmoid(loss_scale)
            else:
                dq, dk, dlogs = handle.backward(loss_scale)
        site, max_logit = handle.diagnosis()
        _last.algorithm = handle.algorithm_used()
    finally:
        pool.give(key, handle)
    return value, dq, dk, dlogs, dbias, max_logit, NONFINITE_SITES.index(site)
