# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The losses as functions, in the style of torch.nn.functional:

    import contrastive_torch.functional as CF
    loss = CF.clip_loss(image_features, text_features, model.logit_scale.exp())
    loss = CF.siglip_loss(image_features, text_features, model.logit_scale.exp(), model.logit_bias)
    loss = CF.info_nce_loss(query, keys, logit_scale, labels)

Each returns the loss (a 0-dim float32 tensor on the features' device) with gradients to the features, logit_scale
and logit_bias. Features are 2-D (batch x dim; any strides: a non-contiguous tensor is copied), float32, bfloat16 or
float16, CPU or CUDA; logit_scale (s = 1/tau) and logit_bias are numbers or one-element tensors. CPU tensors run the
library's host engine, CUDA tensors its device step; eager and torch.compile calls run the same operators (contrastive_torch._ops).

Under torch.autocast (CPU or CUDA), float32 features run at the region's dtype, as torch.matmul's would: they are
cast to it before the step (their gradients come back float32); logit_scale and logit_bias stay float32, 16-bit
features are left as they are (features of two dtypes both run at the region's dtype, as torch.matmul's operands),
and the loss is float32.

Common keyword arguments:
    algorithm  None (the default): the fastest path that fits. On CPU tensors float32 'materialized' where its
               buffers fit the memory budget (contrastive_torch.set_memory_budget; default a quarter of the available
               memory), else 'fused'; bfloat16 and float16 always 'fused' (their logits stay float32). On CUDA tensors the device's automatic choice: 'chunked' with
               its chunk chosen by a memory budget (all logits in one chunk where they fit). Over a group 'fused' on
               CPU tensors and 'chunked' on CUDA. SigLIP: 'fused' on the CPU, 'chunked' on CUDA. Or one of 'fused'
               (never the n x n logits: 8 n^2 d flops, memory O(n d)), 'materialized' (the logits in the features'
               dtype: 6 n^2 d flops, the fastest host path where they fit), 'chunked' (row chunks; cuBLAS products
               on GPUs, the one device algorithm of the sigmoid loss)
    threads    host threads (0: all cores)
    fused_tiles  CUDA, 'chunked', 16-bit features: tensor-core logits tiles consumed in registers
    report     a dict to fill with the step's diagnosis: 'loss', 'max_logit', 'first_nonfinite_code' (tensors; no
               synchronisation), and on the CPU 'first_nonfinite' (a NONFINITE_SITES name) and 'algorithm' (the one
               the step ran). Not filled while torch.compile traces.

Several positives per row: clip_loss and siglip_loss take `image_groups` and `text_groups`, info_nce_loss
`query_groups` and `key_groups`, 1-D integer tensors with one id per row (give both or neither; not with labels). A
pair is positive when its two ids are equal: every caption of the same image, not only the one on the diagonal.
The softmax losses then take each row's cross-entropy against the uniform distribution over its positives, averaged
over the rows that have one (clip_loss: over the images' rows and the texts' rows alike, and the two towers may differ
in size, e.g. five captions per image); siglip_loss labels every positive pair +1. A batch without a positive pair
gives 0 (the softmax losses). Ids that give each row exactly one positive give the one-positive loss bit for bit.
docs/multi_positive.md has the formulas. CUDA tensors run them as a chunked composition of PyTorch operations
(contrastive_torch._grouped): the device step takes one positive per row.

clip_loss and siglip_loss take `group` (a torch.distributed ProcessGroup): every rank of the group calls with its own
rows and gets the loss of the global batch (see contrastive_torch._distributed for the exchanges and the gradient
convention; `grad_ranks` is the factor on the features' gradients, default the group's size, which DDP's averaging
turns into the exact gradient)."""

import torch

from . import _checks, _distributed, _steps
from ._host import NONFINITE_SITES

__all__ = ["clip_loss", "siglip_loss", "info_nce_loss", "NONFINITE_SITES"]


def clip_loss(image_features, text_features, logit_scale, *, algorithm=None, threads=0, fused_tiles=False,
              group=None, grad_ranks=None, exchange=None, report=None, image_groups=None, text_groups=None):
    """CLIP's symmetric loss (CE(s I T^T) + CE(s T I^T)) / 2 over a batch of pairs (row i of each is a pair).

    `image_groups`, `text_groups`: group ids, several positives per row (see the module's text); the towers may then
    differ in size.

    `group`: the loss of the global batch over a torch.distributed process group (each rank passes its own rows);
    `grad_ranks`: the features' gradient factor (default: the group's size); `exchange`: 'engine' (the library's
    distributed engine: gathers the texts, reduce-scatters their gradients; CPU tensors) or 'gather' (torch's
    autograd all-gather of both towers and the one-process step on this rank's rows; CPU and CUDA); None picks
    'engine' for CPU tensors and 'gather' for CUDA tensors."""
    if group is not None:  # every argument is checked there, agreed between the ranks
        return _distributed.global_loss("symmetric", image_features, text_features, logit_scale, None, algorithm,
                                        threads, fused_tiles, _checks.group(group), grad_ranks, exchange, report,
                                        groups=(image_groups, text_groups))
    _checks.threads(threads)
    _checks.boolean("fused_tiles", fused_tiles)
    _checks.feature_pair(image_features, text_features, ("image_features", "text_features"))
    groups = _checks.groups(image_groups, text_groups, image_features.shape[0], text_features.shape[0],
                            image_features.device, names=("image_groups", "text_groups"))
    algorithm = _checks.resolve_algorithm(algorithm, image_features.device)
    return _steps.softmax(image_features, text_features, logit_scale, None, True, algorithm, threads, fused_tiles,
                          report, groups, _steps.TOWER_NAMES)


def info_nce_loss(query, keys, logit_scale, labels=None, *, algorithm=None, threads=0, fused_tiles=False,
                  report=None, query_groups=None, key_groups=None):
    """One-directional InfoNCE: mean_i CE(s q_i . K^T, labels[i]). Keys may outnumber queries (a MoCo queue);
    labels=None means the diagonal (needs n_q <= n_k); labels: int64 or int32, one per query, in [0, n_k).
    `query_groups`, `key_groups`: group ids instead of labels, several positives per row (see the module's text)."""
    _checks.threads(threads)
    _checks.boolean("fused_tiles", fused_tiles)
    _checks.feature_pair(query, keys, ("query", "keys"))
    groups = _checks.groups(query_groups, key_groups, query.shape[0], keys.shape[0], query.device, labels)
    algorithm = _checks.resolve_algorithm(algorithm, query.device)
    return _steps.softmax(query, keys, logit_scale, labels, False, algorithm, threads, fused_tiles, report, groups)


def siglip_loss(image_features, text_features, logit_scale, logit_bias=None, *, algorithm=None, threads=0,
                group=None, grad_ranks=None, exchange=None, report=None, image_groups=None, text_groups=None):
    """SigLIP's pairwise sigmoid loss (Zhai et al. 2023): logits z = s I T^T + b, loss -(1/n) sum log sigmoid(l z)
    with l = +1 on the diagonal and -1 elsewhere, n the number of images (texts may outnumber images). logit_bias None
    means no bias. `group`, `grad_ranks`, `exchange`: as clip_loss's (the texts are gathered). `image_groups`,
    `text_groups`: group ids, l = +1 for every pair with equal ids (see the module's text)."""
    if group is not None:  # every argument is checked there, agreed between the ranks
        return _distributed.global_loss("sigmoid", image_features, text_features, logit_scale, logit_bias,
                                        algorithm, threads, False, _checks.group(group), grad_ranks, exchange, report,
                                        groups=(image_groups, text_groups))
    _checks.algorithm(algorithm, allow_none=True)
    _checks.threads(threads)
    _checks.feature_pair(image_features, text_features, ("image_features", "text_features"))
    groups = _checks.groups(image_groups, text_groups, image_features.shape[0], text_features.shape[0],
                            image_features.device, names=("image_groups", "text_groups"))
    algorithm = _checks.sigmoid_algorithm(algorithm, image_features.device)
    return _steps.sigmoid(image_features, text_features, logit_scale, logit_bias, algorithm, threads, report, groups)
