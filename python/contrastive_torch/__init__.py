# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""contrastive as PyTorch losses: CLIP's symmetric loss, SigLIP's sigmoid loss and InfoNCE, fused and memory-lean,
exact in float32, bfloat16 and float16, on CPU tensors (the library's host engine) and CUDA tensors (its device step).

    from contrastive_torch import ClipLoss                       # open_clip's constructor and call
    loss = ClipLoss()(image_features, text_features, model.logit_scale.exp())

    import contrastive_torch.functional as CF                    # or as functions
    loss = CF.clip_loss(image_features, text_features, model.logit_scale.exp())

Where things are: functional.py (the losses as functions), losses.py (the modules), _ops.py (the torch.library
operators every call runs, eager or compiled), _checks.py (every argument check), _host.py and _device.py (the
engines), _grouped.py and _distill.py (group ids on CUDA tensors, the distillation term: PyTorch operations in row
chunks), _distributed.py (the global batch over torch.distributed), _extension.py (building and loading the C++
extensions), temperature.py (the learnable temperature's tools). PyTorch >= 2.4; the guide is python/README.md.
"""

import os as _os

import torch  # noqa: F401 - contrastive_torch.torch, as before

from . import _ops  # noqa: F401 - registers the operators
from . import functional, temperature
from ._extension import HAS_CUSTOM_OPS, cuda_extension, extension
from ._host import NONFINITE_SITES, host_kernels, memory_budget, set_memory_budget
from .losses import ClipLoss, CoCaLoss, DistillClipLoss, InfoNCELoss, SigLipLoss, StepReport
from .temperature import CollapseMonitor, RangeGuard, clamp_logit_scale, freeze_then_learn
from .cached import CachedStep



def _version():
    """The project's one version: VERSION beside the package (an install), else the repository's (a checkout)."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    for path in (_os.path.join(here, "VERSION"), _os.path.join(here, "..", "..", "VERSION")):
        if _os.path.isfile(path):
            with open(path) as f:
                return f.read().strip()
    return "unknown"


__version__ = _version()
__all__ = ["ClipLoss", "SigLipLoss", "CoCaLoss", "DistillClipLoss", "InfoNCELoss", "StepReport", "CachedStep",
           "functional", "temperature", "clamp_logit_scale", "freeze_then_learn", "RangeGuard", "CollapseMonitor",
           "extension", "cuda_extension", "NONFINITE_SITES", "HAS_CUSTOM_OPS", "set_memory_budget", "memory_budget",
           "host_kernels"]
