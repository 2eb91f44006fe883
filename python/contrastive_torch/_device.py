# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The device step (csrc/binding_cuda.cu): what the operators' CUDA kernels run. One call computes the loss and every
gradient (at a loss scale) on PyTorch's current stream, with its cuBLAS handle and caching allocator.

The default algorithms ('automatic', 'chunked', and SigLIP's) never synchronise: logit_scale and logit_bias travel as
device tensors and the step reads them on the device; a value the host would refuse (a non-finite or non-positive
logit_scale, a non-finite logit_bias, a non-finite feature, a label outside [0, n_keys)) makes the step's loss NaN
or inf and its record name the first non-finite site ('logits'), as a diverged step does, instead of raising. So a
CUDA graph (torch.compile's mode="reduce-overhead") can capture a training step that calls the loss. 'fused' and
'materialized' check the values first, as before (one synchronisation), and raise ValueError naming the argument."""

import torch

from . import _host
from ._checks import device_values, labels_int32, scale_value
from ._extension import cuda_extension

SYNC_FREE = ("automatic", "chunked")


def _device_scalar(value, device):
    """A one-element float32 tensor on `device` holding `value` (a tensor or a number), without reading it."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(1).to(device=device, dtype=torch.float32).contiguous()
    return torch.tensor([float(value)], dtype=torch.float32, device=device)


def _labels_on_device(labels, q, n_k):
    """int32 labels without reading them: values outside int32 are clamped to -1 or n_k first, outside [0, n_k) in
    either case, so the step reports them (a row without its positive has an infinite loss)."""
    if labels is None:
        return None
    if labels.dtype != torch.int32:
        labels = labels.clamp(-1, n_k)
    return labels.to(device=q.device, dtype=torch.int32).contiguous()


def step(q, k, logit_scale, logit_bias, labels, objective, algorithm, fused_tiles, loss_scale=1.0, checked=False):
    """(loss, dq, dk, d loss/d log s, d loss/d b or None, max logit, first non-finite site code) as device tensors;
    dq and dk at `loss_scale`. `checked`: the values were checked by this step's forward (a backward's rerun), so
    they are not read again."""
    # Only 'fused' and 'materialized' read values, and a backward's rerun not again (its forward read them).
    reads = not checked and objective != "sigmoid" and algorithm not in SYNC_FREE
    labels32 = labels_int32(labels, q.device) if reads else _labels_on_device(labels, q, k.shape[0])
    device_values(q, k, labels32, objective, read=reads)
    if reads:
        scale_value(logit_scale)
    scale = _device_scalar(logit_scale, q.device)
    # The extension raises by the library's error code (csrc/errors.hpp): ValueError for a refused argument.
    if objective == "sigmoid":
        bias = None if logit_bias is None else _device_scalar(logit_bias, q.device)
        loss, dq, dk, dlogs, max_logit, site, dbias = cuda_extension().sigmoid_step(
            q, k, scale, bias, None, 0, loss_scale)
        dbias = dbias.clone()
    else:
        # 'automatic' keeps the logits in one chunk where its workspace fits the memory budget (set_memory_budget;
        # 0: a quarter of the free device memory).
        budget = _host.memory_budget() if algorithm == "automatic" else 0
        loss, dq, dk, dlogs, max_logit, site = cuda_extension().step(
            q, k, scale, labels32, objective == "symmetric", algorithm, 0, fused_tiles, loss_scale, budget)
        dbias = None
    # The scalars view the step's state buffer: an operator's outputs must not alias it, so they are copied.
    return loss.clone(), dq, dk, dlogs.clone(), dbias, max_logit.clone(), site.clone()
