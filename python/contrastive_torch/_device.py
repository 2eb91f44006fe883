# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The device step (csrc/binding_cuda.cu): what the operators' CUDA kernels run. One call computes the loss and every
gradient (at a loss scale) on PyTorch's current stream, with its cuBLAS handle and caching allocator; no
synchronisation but the one value check (`_checks.device_values`)."""

import torch

from ._checks import bias_value, device_values, labels_int32, scale_value
from ._extension import cuda_extension


def step(q, k, logit_scale, logit_bias, labels, objective, algorithm, fused_tiles, loss_scale=1.0, checked=False):
    """(loss, dq, dk, d loss/d log s, d loss/d b or None, max logit, first non-finite site code) as device tensors;
    dq and dk at `loss_scale`. `checked`: the values were checked by this step's forward (a backward's rerun), so
    they are not read again."""
    if checked:
        labels32 = None if labels is None else labels.to(device=q.device, dtype=torch.int32).contiguous()
    else:
        labels32 = labels_int32(labels, q.device)
        device_values(q, k, labels32, objective)
    scale = scale_value(logit_scale)
    # The extension raises by the library's error code (csrc/errors.hpp): ValueError for a refused argument.
    if objective == "sigmoid":
        loss, dq, dk, dlogs, max_logit, site, dbias = cuda_extension().sigmoid_step(
            q, k, scale, bias_value(logit_bias), None, 0, loss_scale)
        dbias = dbias.clone()
    else:
        loss, dq, dk, dlogs, max_logit, site = cuda_extension().step(
            q, k, scale, labels32, objective == "symmetric", algorithm, 0, fused_tiles, loss_scale)
        dbias = None
    # The scalars view the step's state buffer: an operator's outputs must not alias it, so they are copied.
    return loss.clone(), dq, dk, dlogs.clone(), dbias, max_logit.clone(), site.clone()

