# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Every argument check, once. Two kinds:

- checks that read no tensor value (types, shapes, dtypes, devices, options): run in Python before any work, also
  while torch.compile traces (they read only what tracing knows);
- checks that read values (finiteness, label range, logit_scale > 0): run where the values are read anyway, inside
  the operators' kernels (`scale_value`, `bias_value`, `labels_int32`, `device_values`), so a compiled graph checks
  them when it runs. The host engine checks finiteness and label range itself (its messages name the element).

Every message starts with the argument's name."""

import math
import numbers
import operator

import torch

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
ALGORITHMS = ("fused", "materialized", "chunked")


# --- options (constructor and keyword arguments) ---------------------------------------------------------------------


def algorithm(value, allow_none=False):
    if value is None and allow_none:
        return None
    if value not in ALGORITHMS:
        raise ValueError(f"algorithm: '{value}' is not one of 'fused', 'materialized', 'chunked'")
    return value


def resolve_algorithm(value, device, distributed=False):
    """The softmax objectives' algorithm (`value` checked: None or a name in ALGORITHMS). None is 'automatic' in one
    process: on the CPU the library's algorithm::automatic (float32 'materialized' where its buffers fit the memory
    budget, else 'fused'; bfloat16 and float16 always 'fused'), on CUDA the device's (the chunked algorithm, its
    chunk chosen by a memory budget: all logits in one chunk where they fit). Over a process group (`distributed`)
    None is 'fused' on the CPU (the distributed engine's algorithm) and 'chunked' on CUDA. 'automatic' itself is never
    a user's value."""
    value = algorithm(value, allow_none=True)
    if value is not None:
        return value
    if distributed:
        return "chunked" if device.type == "cuda" else "fused"
    return "automatic"


def memory_budget(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= 2**63:
        raise ValueError(f"bytes: must be an int in [0, 2**63) (0: a quarter of the available memory at each "
                         f"call), got {value!r}")
    return value


def sigmoid_algorithm(algorithm, device):
    """SigLIP's algorithm: None is 'fused' on the CPU and 'chunked' on CUDA, the one device algorithm of this loss."""
    if device.type == "cuda":
        if algorithm not in (None, "chunked"):
            raise ValueError(f"algorithm: '{algorithm}' has no device path for the sigmoid loss; on CUDA tensors "
                             f"SigLipLoss runs 'chunked' (pass algorithm='chunked', or leave it unset)")
        return "chunked"
    return algorithm or "fused"


def compiling():
    """True while torch.compile (dynamo) traces the caller."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


MAX_THREADS = 4096  # the library's thread pool's limit (host/thread_pool.hpp, max_threads)


def threads(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"threads: must be an int >= 0 (0 = all cores), got {value!r}")
    if value > MAX_THREADS:
        raise ValueError(f"threads: {value} threads requested; at most {MAX_THREADS}")
    return value


def boolean(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def flag(name, value):
    """open_clip passes argparse's store_true values: bools and ints (0/1) are accepted, anything else refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return bool(value)
    raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def index(name, value):
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


def weight(name, value):
    """A loss term's weight (CoCaLoss's): a finite real number (Python's or numpy's), returned as given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: must be finite, got {value}")
    return value


def rank_and_world(rank, world_size):
    rank, world_size = index("rank", rank), index("world_size", world_size)
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    if rank < 0:
        raise ValueError(f"rank: must be >= 0, got {rank}")
    # open_clip reads rank only when world_size > 1 (its constructors take any rank at world_size 1), so this does too.
    if world_size > 1 and rank >= world_size:
        raise ValueError(f"rank: must be in [0, world_size) = [0, {world_size}), got {rank}")
    return rank, world_size


def group(value):
    if value is None:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup, got {type(value).__name__}")
    return value


# --- tensors, without reading values ---------------------------------------------------------------------------------


def dense(name, x):
    """A tensor of the strided (dense) layout: sparse, nested or other layouts are refused naming the argument."""
    if x.layout != torch.strided or getattr(x, "is_nested", False):
        layout = "nested" if getattr(x, "is_nested", False) else str(x.layout)
        raise TypeError(f"{name}: layout {layout}; a dense tensor is expected (call .to_dense())")


def report(value):
    """The caller's report: None or a dict (filled after the step; anything else would fail only after it ran)."""
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"report: expected a dict to fill (or None), got {type(value).__name__}")


def no_tangent(name, x):
    """Refuses a dual tensor of torch.autograd.forward_ad (naming the argument): the losses' derivatives are reverse
    mode only, and a tangent would otherwise be dropped without a word (a jvp of None, a jacfwd of zeros)."""
    from torch.autograd import forward_ad

    if getattr(forward_ad, "_current_level", -1) >= 0 and not compiling() and \
            forward_ad.unpack_dual(x).tangent is not None:
        raise NotImplementedError(f"{name}: has a forward-mode tangent (torch.autograd.forward_ad); the losses are "
                                  "differentiable in reverse mode only (backward(), torch.autograd.grad)")


def features(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    dense(name, x)
    no_tangent(name, x)
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor (batch x dim), got shape {tuple(x.shape)}")
    if x.device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}: on {x.device}, but this PyTorch has no CUDA")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: on {x.device}; CPU and CUDA tensors only")
    if x.dtype not in DTYPE_NAMES:
        raise TypeError(f"{name}: dtype {x.dtype} is not float32, bfloat16 or float16")
    # Any strides are taken (a transposed, sliced or expanded tensor, as open_clip takes them): the steps run on a
    # contiguous copy where the tensor is not contiguous (_steps, _distributed), and its gradient comes back in the
    # caller's layout through autograd.


def no_forward_transform(*tensors):
    """Refuses a call inside torch.func.jvp or jacfwd (functorch's forward mode), whose tangents the losses would drop
    without a word (a jacfwd of zeros), and inside torch.func.grad, vjp or jacrev (functorch's reverse mode, which
    PyTorch refuses for these autograd.Functions with a message about setup_context), where one of `tensors` is
    tracked by the transform; a loss of untracked tensors (a constant of the transformed function), vmap and no
    transform pass. Read from functorch's interpreter stack, where this PyTorch has one."""
    functorch = getattr(torch._C, "_functorch", None)
    if compiling() or functorch is None or getattr(functorch, "peek_interpreter_stack", lambda: None)() is None:
        return
    tracked = getattr(functorch, "is_gradtrackingtensor", None)
    if tracked is not None and not any(isinstance(t, torch.Tensor) and tracked(t) for t in tensors):
        return
    try:
        from torch._functorch import pyfunctorch

        jvp, grad = functorch.TransformType.Jvp, functorch.TransformType.Grad
        levels = [i.key() for i in pyfunctorch.retrieve_all_functorch_interpreters()]
    except (AttributeError, ImportError):
        return
    if jvp in levels:
        raise NotImplementedError("contrastive_torch: called inside torch.func.jvp / jacfwd (forward mode); the "
                                  "losses are differentiable in reverse mode only (backward(), torch.autograd.grad)")
    if grad in levels:
        raise NotImplementedError("contrastive_torch: called inside torch.func.grad / vjp / jacrev; the losses are "
                                  "differentiated by torch.autograd (backward(), torch.autograd.grad), not by "
                                  "torch.func's transforms")


def feature_pair(q, k, names):
    """Both feature tensors and what they must share (dtype, embedding size, device)."""
    no_forward_transform(q, k)
    features(names[0], q)
    features(names[1], k)
    if q.dtype != k.dtype:
        from ._ops import autocast_dtype  # (_ops imports this module)

        # Inside autocast both become the region's dtype (autocast_features), as torch.matmul's operands do.
        if autocast_dtype(q.device.type) is None:
            raise TypeError(f"features: dtypes differ ({names[0]} {q.dtype}, {names[1]} {k.dtype}; inside "
                            "torch.autocast both would run at its dtype)")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"features: embedding sizes differ ({names[0]} {q.shape[1]}, {names[1]} {k.shape[1]})")
    if q.device != k.device:
        raise ValueError(f"features: on different devices ({names[0]} on {q.device}, {names[1]} on {k.device})")


def scalar(name, value, device, kinds="a number or a one-element tensor"):
    """logit_scale / logit_bias as the one-element float tensor the operators take, on the features' `device`: a
    number (Python's or numpy's) becomes a float32 tensor there; a tensor elsewhere is moved there (a differentiable
    copy: the gradient reaches the parameter where it lives); an integer tensor becomes float32. Its value is not
    read."""
    if isinstance(value, torch.Tensor):
        no_tangent(name, value)
        no_forward_transform(value)
        if value.numel() != 1:
            extra = " (a per-logit bias is not supported)" if name == "logit_bias" else ""
            raise ValueError(f"{name}: expected one value{extra}, got shape {tuple(value.shape)}")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name}: dtype {value.dtype} is not a real number type")
        if value.device.type == "meta":  # no value to move to the features' device
            raise ValueError(f"{name}: on the meta device, which holds no value")
        if not value.is_floating_point():
            value = value.float()
        if value.dtype == torch.float64 and value.device.type == "cpu" and not compiling():
            _float32_range(name, float(value.detach().reshape(())))  # a host read: no synchronisation
        return value if value.device == device else value.to(device)
    if isinstance(value, (str, bytes, bool)) or not hasattr(value, "__float__"):
        raise TypeError(f"{name}: expected {kinds}, got {type(value).__name__}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected {kinds}, got {type(value).__name__} {value!r}") from None
    _float32_range(name, number)
    return torch.tensor(number, dtype=torch.float32, device=device)


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_FLOAT32_TINIEST = 2.0 ** -149  # the smallest subnormal: half of it and less round to 0


def _float32_range(name, number):
    """Refuses a finite, nonzero logit_scale / logit_bias that float32 (the loss's arithmetic) cannot hold: it would
    become inf (or a scale 0), and the refusal would then name a value the caller never passed."""
    underflow = name == "logit_scale" and abs(number) <= _FLOAT32_TINIEST / 2  # a bias may round to 0
    if number != 0.0 and abs(number) < float("inf") and (abs(number) > _FLOAT32_MAX or underflow):
        raise ValueError(f"{name}: {number!r} lies outside float32's range, in which the loss computes (largest "
                         f"{_FLOAT32_MAX:.6g}, smallest nonzero {_FLOAT32_TINIEST:.6g})")


def labels(value, n_q, device):
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"labels: expected a torch.Tensor, got {type(value).__name__}")
    dense("labels", value)
    if value.dim() != 1 or value.shape[0] != n_q:
        raise ValueError(f"labels: expected shape ({n_q},), got {tuple(value.shape)}")
    if value.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels: dtype {value.dtype} is not an integer type (int64 or int32)")
    if device.type == "cpu" and value.device.type != "cpu":
        raise ValueError(f"labels: on {value.device} while the features are on the CPU")
    return value


def groups(query_groups, key_groups, n_q, n_k, device, labels=None, names=("query_groups", "key_groups")):
    """Group ids (several positives per row: pair (i, j) is positive when the ids are equal): both or neither, not
    with labels; each a 1-D integer tensor with one id per row of its side, on the features' device or the CPU.
    Returns them as int64, contiguous, on the features' device (CPU ids for CUDA features are copied there), or
    (None, None). `device` None (the features' device not known yet: CachedStep before its first
    pass): the devices are not checked."""
    if query_groups is None and key_groups is None:
        return None, None
    for name, value, other in ((names[0], query_groups, names[1]), (names[1], key_groups, names[0])):
        if value is None:
            raise ValueError(f"{name}: None while {other} is given; give both group ids or neither")
    if labels is not None:
        raise ValueError(f"labels: given with {names[0]} and {names[1]}; the positives come from labels or from "
                         "group ids, not both")
    out = []
    for name, value, n in ((names[0], query_groups, n_q), (names[1], key_groups, n_k)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
        dense(name, value)
        if value.dim() != 1 or value.shape[0] != n:
            raise ValueError(f"{name}: expected shape ({n},), one id per row, got {tuple(value.shape)}")
        if value.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"{name}: dtype {value.dtype} is not one of the id types int64, int32, int16, int8 and "
                            "uint8")
        if device is not None and value.device.type != "cpu" and value.device != device:
            raise ValueError(f"{name}: on {value.device} while the features are on {device}")
        out.append(value.to(device=device if device is not None else value.device, dtype=torch.int64).contiguous())
    return tuple(out)


# --- values (read inside the operators' kernels) ---------------------------------------------------------------------


def scale_value(logit_scale):
    value = float(logit_scale.detach().reshape(())) if isinstance(logit_scale, torch.Tensor) else float(logit_scale)
    if not (value > 0.0 and value < float("inf")):
        raise ValueError(f"logit_scale: must be finite and > 0 (it is 1/tau), got {value}")
    return value


def bias_value(logit_bias):
    if logit_bias is None:
        return 0.0
    value = float(logit_bias.detach().reshape(())) if isinstance(logit_bias, torch.Tensor) else float(logit_bias)
    if not abs(value) < float("inf"):
        raise ValueError(f"logit_bias: must be finite, got {value}")
    return value


def labels_int32(value, device=None):
    """The labels as the engines take them: int32, contiguous (on `device` when given); values outside int32 are
    refused (the engines check the range against the number of keys)."""
    if value is None:
        return None
    if value.numel() and (int(value.min()) < -(2**31) or int(value.max()) >= 2**31):
        raise ValueError("labels: values outside the int32 range")
    return value.to(device=device if device is not None else value.device, dtype=torch.int32).contiguous()


def device_values(q, k, labels32, objective, read=True):
    """What the device engine does not check (reading values would synchronise inside its step), checked once:
    finiteness, the label range (one synchronisation), the shapes each objective needs. `read=False`: the shapes
    only (the sync-free device step reports bad values in its record instead)."""
    names = ("query", "keys") if objective == "info_nce" else ("image_features", "text_features")
    if k.device != q.device:  # an operator called directly: the step would read k at an address that is not there
        raise ValueError(f"{names[1]}: on {k.device}, expected {names[0]}'s device {q.device}")
    for name, x in zip(names, (q, k) if read else ()):
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name}: holds a non-finite value")
    if labels32 is not None:
        if read and labels32.numel() and (int(labels32.min()) < 0 or int(labels32.max()) >= k.shape[0]):
            raise ValueError(f"labels: values outside [0, {k.shape[0]}) (the number of keys)")
    elif objective == "info_nce" and q.shape[0] > k.shape[0]:
        raise ValueError(f"labels: None means the diagonal, which needs n_q <= n_k ({q.shape[0]} > {k.shape[0]})")
    if objective == "symmetric" and q.shape[0] != k.shape[0]:
        raise ValueError(f"features: the symmetric loss needs as many texts as images ({q.shape[0]} and "
                         f"{k.shape[0]})")
    if objective == "sigmoid" and q.shape[0] > k.shape[0]:
        raise ValueError(f"features: the positives are the diagonal, which needs as many texts as images or more "
                         f"({q.shape[0]} images, {k.shape[0]} texts)")
