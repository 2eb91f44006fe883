# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""contrastive as a drop-in CLIP loss for PyTorch (CPU and CUDA tensors; float32, bfloat16, float16).

    from contrastive_torch import ClipLoss
    loss = ClipLoss()(image_features, text_features, model.logit_scale.exp())   # open_clip's call
    loss.backward()

Installed with `pip install --no-build-isolation ./python`, the C++ extension is built at install time; from a source
checkout on sys.path it is compiled on first use with torch.utils.cpp_extension (about 30-60 s, cached afterwards in
torch's extension directory). It needs the CUDA Toolkit's headers for the 16-bit types (CUDA_HOME or
/usr/local/cuda); no GPU is used. The loss runs the library's host engine: forward computes the loss, backward the
gradients of the features and of logit_scale, with the incoming gradient (GradScaler's scale) applied before any
16-bit rounding, as PyTorch's own backward does.

CUDA tensors run the library's device step instead (a second extension, compiled with nvcc on first use where PyTorch
has CUDA): forward and backward in one call on PyTorch's current stream, with its cuBLAS handle and caching allocator;
use algorithm="chunked" (cuBLAS products) on GPUs. There the forward forms every gradient at loss scale 1 and the
backward multiplies them by the incoming gradient (bfloat16, float32), or for float16 with an incoming gradient other
than 1 (a GradScaler's scale) runs the step again at that loss scale, so that gradients below float16's normal range
at scale 1 are not lost (python/README.md); `last_step` holds device tensors (no synchronisation):
`first_nonfinite_code` indexes NONFINITE_SITES. Input checks on CUDA (finiteness, label range) synchronise once.

ClipLoss takes open_clip's constructor arguments (local_loss, gather_with_grad, cache_labels, rank, world_size,
use_horovod) and call (logit_bias, output_dict). With world_size > 1 (or group=a torch.distributed process group) it
computes the loss of the global batch over torch.distributed (gloo; CPU tensors): each rank passes its own rows, the
library gathers the text features, runs the rank's rows and reduce-scatters their gradients (python/README.md: the
gradient convention, which is open_clip's).
On PyTorch >= 2.4 the CPU loss is also the torch.library custom operators contrastive_torch::loss and
contrastive_torch::loss_backward, which torch.compile traces (fullgraph=True works); eager calls use the
autograd.Function, whose backward reuses the forward's engine instead of recomputing the forward.
"""

import operator
import os
import re
import threading
from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

__all__ = ["ClipLoss", "SigLipLoss", "InfoNCELoss", "clamp_logit_scale", "freeze_then_learn", "extension",
           "cuda_extension", "NONFINITE_SITES"]

NONFINITE_SITES = ("none", "logits", "loss", "grad_q", "grad_k", "grad_logit_scale", "parameters", "grad_logit_bias")

_HERE = os.path.dirname(os.path.abspath(__file__))
# An installed package carries the headers (setup.py copies them); a source checkout has them two levels up.
_PACKAGED_INCLUDE = os.path.join(_HERE, "include")
_REPO_INCLUDE = os.path.normpath(os.path.join(_HERE, "..", "..", "include"))
_ext = None
_cuda_ext = None
_ext_lock = threading.Lock()

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _torch_version():
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


# torch.library.custom_op / register_fake / register_autograd appeared in PyTorch 2.4; older PyTorch (Debian's 1.13)
# keeps the autograd.Function path only.
HAS_CUSTOM_OPS = _torch_version() >= (2, 4) and all(
    hasattr(torch.library, f) for f in ("custom_op", "register_fake", "register_autograd"))


def _std_flags():
    """The C++ standard is PyTorch's builder's choice (C++17 from PyTorch 2.1, C++20 from 2.13, whose headers need
    it); only older PyTorch, whose builder passes -std=c++14, is given the library's C++17."""
    return ["-std=c++17"] if _torch_version() < (2, 1) else []


def _include_dir():
    if "CONTRASTIVE_INCLUDE" in os.environ:
        return os.environ["CONTRASTIVE_INCLUDE"]
    if os.path.isfile(os.path.join(_PACKAGED_INCLUDE, "contrastive", "contrastive.hpp")):
        return _PACKAGED_INCLUDE
    return _REPO_INCLUDE


def _prebuilt(name):
    """The extension `pip install` built (contrastive_torch._C / _C_cuda), or None in a source checkout.
    CONTRASTIVE_TORCH_JIT=1 ignores it and compiles on first use instead."""
    if os.environ.get("CONTRASTIVE_TORCH_JIT") == "1":
        return None
    import importlib

    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError:
        return None


def extension():
    """The compiled host extension: the one `pip install` built, else compiled on first call."""
    global _ext
    with _ext_lock:
        if _ext is None:
            _ext = _prebuilt("_C")
        if _ext is None:
            from torch.utils import cpp_extension

            cuda = os.environ.get("CUDA_HOME") or cpp_extension.CUDA_HOME or "/usr/local/cuda"
            include = _include_dir()
            flags = ["-O3", "-DNDEBUG"] + _std_flags()
            if os.environ.get("CONTRASTIVE_NATIVE", "1") != "0":
                flags.append("-march=native")
            _ext = cpp_extension.load(
                name="contrastive_torch_ext",
                sources=[os.path.join(_HERE, "csrc", "binding.cpp")],
                extra_include_paths=[include, os.path.join(cuda, "include")],
                extra_cflags=flags,
                verbose=os.environ.get("CONTRASTIVE_VERBOSE_BUILD") == "1",
            )
    return _ext


def cuda_extension():
    """The compiled device extension: the one `pip install` built, else built with nvcc on first call (needs PyTorch
    with CUDA)."""
    global _cuda_ext
    with _ext_lock:
        if _cuda_ext is None:
            _cuda_ext = _prebuilt("_C_cuda")
        if _cuda_ext is None:
            from torch.utils import cpp_extension

            include = _include_dir()
            _cuda_ext = cpp_extension.load(
                name="contrastive_torch_cuda_ext",
                sources=[os.path.join(_HERE, "csrc", "binding_cuda.cu")],
                extra_include_paths=[include],
                extra_cflags=["-O3", "-DNDEBUG"] + _std_flags(),
                extra_cuda_cflags=["-O3", "-DNDEBUG", "--expt-relaxed-constexpr"] + _std_flags(),
                extra_ldflags=["-lcublas"],
                verbose=os.environ.get("CONTRASTIVE_VERBOSE_BUILD") == "1",
            )
    return _cuda_ext


def _check_features(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor (batch x dim), got shape {tuple(x.shape)}")
    if x.device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}: on {x.device}, but this PyTorch has no CUDA")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: on {x.device}; CPU and CUDA tensors only")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name}: dtype {x.dtype} is not float32, bfloat16 or float16")
    if not x.is_contiguous():
        raise ValueError(f"{name}: not contiguous (call .contiguous())")


def _scale_value(logit_scale):
    if isinstance(logit_scale, torch.Tensor):
        if logit_scale.numel() != 1:
            raise ValueError(f"logit_scale: expected one value, got shape {tuple(logit_scale.shape)}")
        value = float(logit_scale.detach().reshape(()))
    else:
        value = float(logit_scale)
    if not (value > 0.0 and value < float("inf")):
        raise ValueError(f"logit_scale: must be finite and > 0 (it is 1/tau), got {value}")
    return value


def _bias_value(logit_bias):
    """SigLIP's logit bias as a float (None: 0); one finite value."""
    if logit_bias is None:
        return 0.0
    if isinstance(logit_bias, bool) or not isinstance(logit_bias, (torch.Tensor, float, int)):
        raise TypeError(f"logit_bias: expected None, a number or a one-element tensor, got {type(logit_bias).__name__}")
    if isinstance(logit_bias, torch.Tensor):
        if logit_bias.numel() != 1:
            raise ValueError(f"logit_bias: expected one value (a per-logit bias is not supported), got shape "
                             f"{tuple(logit_bias.shape)}")
        value = float(logit_bias.detach().reshape(()))
    else:
        value = float(logit_bias)
    if not (abs(value) < float("inf")):
        raise ValueError(f"logit_bias: must be finite, got {value}")
    return value


def _like(value, param):
    """A 0-dim gradient `value` (a tensor) in the device, dtype and shape of `param` (a tensor; None for a number)."""
    if not isinstance(param, torch.Tensor):
        return None
    return value.to(device=param.device, dtype=param.dtype).reshape(param.shape)


class _Pool:
    """Loss engines by (dtype, algorithm, threads), reused across steps (their buffers stay allocated)."""

    def __init__(self):
        self._free = {}
        self._lock = threading.Lock()

    def take(self, key):
        with self._lock:
            stack = self._free.get(key)
            if stack:
                return stack.pop()
        return extension().Loss(key[0], key[1], key[2])

    def give(self, key, handle):
        with self._lock:
            self._free.setdefault(key, []).append(handle)


_pool = _Pool()


class _ContrastiveFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, logit_scale, labels, symmetric, algorithm, threads, report):
        key = (_DTYPES[q.dtype], algorithm, threads)
        handle = _pool.take(key)
        scale = _scale_value(logit_scale)
        try:
            value, _tau = handle.forward(q, k, scale, labels, symmetric)
        except Exception:
            _pool.give(key, handle)
            raise
        report["loss"] = value
        ctx.key, ctx.handle, ctx.scale = key, handle, scale
        ctx.report = report
        ctx.scale_shape = logit_scale.shape if isinstance(logit_scale, torch.Tensor) else None
        ctx.scale_dtype = logit_scale.dtype if isinstance(logit_scale, torch.Tensor) else torch.float32
        if not any(ctx.needs_input_grad[:3]):
            report["first_nonfinite"], report["max_logit"] = handle.diagnosis()
            _pool.give(key, handle)
            ctx.handle = None
        return torch.tensor(value, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        handle = ctx.handle
        if handle is None:
            raise RuntimeError("contrastive_torch: backward called twice, or after a forward without grad")
        g = float(grad)
        # The incoming gradient (e.g. GradScaler's scale) becomes the library's loss scale, so 16-bit gradients are
        # rounded after scaling. A gradient the library cannot take as a scale (0, negative, non-finite) is applied
        # afterwards instead.
        direct = g > 0.0 and g < 3.0e38
        try:
            dq, dk, dlogs = handle.backward(g if direct else 1.0)
            ctx.report["first_nonfinite"], ctx.report["max_logit"] = handle.diagnosis()
        finally:
            ctx.handle = None
            _pool.give(ctx.key, handle)
        if not direct:
            dq, dk, dlogs = dq * g, dk * g, dlogs * g
        d_scale = None
        if ctx.needs_input_grad[2] and ctx.scale_shape is not None:
            # d loss / d s = (d loss / d log s) / s.
            d_scale = (dlogs / ctx.scale).to(ctx.scale_dtype).reshape(ctx.scale_shape)
        return dq, dk, d_scale, None, None, None, None, None


class _SigmoidFunction(torch.autograd.Function):
    """SigLIP's sigmoid loss on the host (one process): as _ContrastiveFunction, with the logit bias an input whose
    gradient the library returns."""

    @staticmethod
    def forward(ctx, q, k, logit_scale, logit_bias, labels, algorithm, threads, report):
        key = (_DTYPES[q.dtype], algorithm, threads)
        handle = _pool.take(key)
        scale, bias = _scale_value(logit_scale), _bias_value(logit_bias)
        try:
            value, _tau = handle.forward_sigmoid(q, k, scale, bias, labels)
        except Exception:
            _pool.give(key, handle)
            raise
        report["loss"] = value
        ctx.key, ctx.handle, ctx.scale, ctx.report = key, handle, scale, report
        ctx.params = (logit_scale if isinstance(logit_scale, torch.Tensor) else None,
                      logit_bias if isinstance(logit_bias, torch.Tensor) else None)
        if not any(ctx.needs_input_grad[:4]):
            report["first_nonfinite"], report["max_logit"] = handle.diagnosis()
            _pool.give(key, handle)
            ctx.handle = None
        return torch.tensor(value, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        handle = ctx.handle
        if handle is None:
            raise RuntimeError("contrastive_torch: backward called twice, or after a forward without grad")
        g = float(grad)
        direct = g > 0.0 and g < 3.0e38  # as _ContrastiveFunction: the incoming gradient is the loss scale
        try:
            dq, dk, dlogs, dbias = handle.backward_sigmoid(g if direct else 1.0)
            ctx.report["first_nonfinite"], ctx.report["max_logit"] = handle.diagnosis()
        finally:
            ctx.handle = None
            _pool.give(ctx.key, handle)
        if not direct:
            dq, dk, dlogs, dbias = dq * g, dk * g, dlogs * g, dbias * g
        scale_param, bias_param = ctx.params
        d_scale = _like(dlogs / ctx.scale, scale_param) if ctx.needs_input_grad[2] else None
        d_bias = _like(dbias, bias_param) if ctx.needs_input_grad[3] else None
        return dq, dk, d_scale, d_bias, None, None, None, None


def _check_finite(named):
    """Raises ValueError naming the first (name, tensor) that holds a non-finite value (reads the values: one sync)."""
    for name, x in named:
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name}: holds a non-finite value")


def _check_cuda_values(q, k, labels32, symmetric):
    """The device API does not check values (that would synchronise inside the step); checked here, once. Returns the
    labels on the features' device."""
    _check_finite((("image_features" if symmetric else "query", q), ("text_features" if symmetric else "keys", k)))
    if labels32 is not None:
        labels32 = labels32.to(q.device)
        if labels32.numel() and (int(labels32.min()) < 0 or int(labels32.max()) >= k.shape[0]):
            raise ValueError(f"labels: values outside [0, {k.shape[0]}) (the number of keys)")
    elif not symmetric and q.shape[0] > k.shape[0]:
        raise ValueError(f"labels: None means the diagonal, which needs n_q <= n_k ({q.shape[0]} > {k.shape[0]})")
    if symmetric and q.shape[0] != k.shape[0]:
        raise ValueError(f"features: the symmetric loss needs as many texts as images ({q.shape[0]} and "
                         f"{k.shape[0]})")
    return labels32


def _rerun_scale(dtype, grad, needed=True):
    """The loss scale a CUDA backward reruns its step at, or None. The step ran at loss scale 1 in the forward; its
    float16 gradients there may be subnormal (at SigLIP's start and a batch of 32k, |dQ| ~ 1e-5, below float16's
    smallest normal 6.1e-5) where the same gradients at a GradScaler's scale g are not: for float16 and g other than 1
    the step runs again at loss scale g (one read of g, as the host path's backward reads it), as the host path runs
    its backward at g. bfloat16 and float keep float's exponent range: their gradients times g lose nothing (and g is
    not read). `needed`: whether a feature needs a gradient at all. The features are saved for the rerun only when
    they are float16 (_rerun_inputs)."""
    if dtype != torch.float16 or not needed:
        return None
    g = float(grad)
    return g if 0.0 < g < 3.0e38 and g != 1.0 else None


def _feature_grads(grad, dq, dk, rerun, needed=True):
    """The features' gradients for the incoming gradient `grad`, from the step's dq and dk at loss scale 1: float16
    with grad != 1 reruns the step at loss scale grad (`rerun(g)` returns its dq and dk; see _rerun_scale), anything
    else is multiplied in float (a GradScaler scale of 65536 does not fit float16)."""
    g = _rerun_scale(dq.dtype, grad, needed)
    if g is not None:
        return rerun(g)
    return (dq.float() * grad).to(dq.dtype), (dk.float() * grad).to(dk.dtype)


def _rerun_inputs(q, k):
    """What a CUDA forward saves for _rerun_scale's second pass: the features when float16, else nothing (so that
    bfloat16 and float features are neither kept alive nor checked for in-place changes by the backward)."""
    return (q, k) if q.dtype == torch.float16 else (None, None)


class _CudaFunction(torch.autograd.Function):
    """CUDA tensors: the device step computes the loss and the gradients at loss scale 1 in the forward; the backward
    multiplies them by the incoming gradient (float16: reruns the step at it, see _rerun_scale)."""

    @staticmethod
    def forward(ctx, q, k, logit_scale, labels, symmetric, algorithm, fused_tiles, report):
        scale = _scale_value(logit_scale)
        # The extension raises by the library's error code (csrc/errors.hpp): ValueError for a refused argument.
        loss, dq, dk, dlogs, max_logit, site = cuda_extension().step(q, k, scale, labels, symmetric, algorithm, 0,
                                                                     fused_tiles)
        report.update({"loss": loss, "max_logit": max_logit, "first_nonfinite_code": site})
        ctx.save_for_backward(*_rerun_inputs(q, k), labels, dq, dk, dlogs)
        ctx.scale, ctx.call = scale, (symmetric, algorithm, fused_tiles)
        ctx.scale_shape = logit_scale.shape if isinstance(logit_scale, torch.Tensor) else None
        ctx.scale_dtype = logit_scale.dtype if isinstance(logit_scale, torch.Tensor) else torch.float32
        return loss.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, labels, dq, dk, dlogs = ctx.saved_tensors
        d_scale = None
        if ctx.needs_input_grad[2] and ctx.scale_shape is not None:
            d_scale = (dlogs * grad / ctx.scale).to(ctx.scale_dtype).reshape(ctx.scale_shape)
        symmetric, algorithm, fused_tiles = ctx.call
        dq, dk = _feature_grads(
            grad, dq, dk, lambda g: cuda_extension().step(q, k, ctx.scale, labels, symmetric, algorithm, 0, fused_tiles,
                                                          g)[1:3], any(ctx.needs_input_grad[:2]))
        return dq, dk, d_scale, None, None, None, None, None


def _check_cuda_sigmoid(q, k):
    """SigLipLoss on CUDA tensors: what the device API does not check (values; that would synchronise inside the
    step), once, here."""
    _check_finite((("image_features", q), ("text_features", k)))
    if q.shape[0] > k.shape[0]:
        raise ValueError(f"features: the positives are the diagonal, which needs as many texts as images or more "
                         f"({q.shape[0]} images, {k.shape[0]} texts)")


class _CudaSigmoidFunction(torch.autograd.Function):
    """SigLIP's sigmoid loss on CUDA tensors: the device's chunked step computes the loss and every gradient at loss
    scale 1 in the forward (as _CudaFunction); the backward multiplies them by the incoming gradient (float16: reruns
    the step at it, see _rerun_scale)."""

    @staticmethod
    def forward(ctx, q, k, logit_scale, logit_bias, report):
        scale, bias = _scale_value(logit_scale), _bias_value(logit_bias)
        loss, dq, dk, dlogs, max_logit, site, dbias = cuda_extension().sigmoid_step(q, k, scale, bias, None, 0)
        report.update({"loss": loss, "max_logit": max_logit, "first_nonfinite_code": site})
        ctx.save_for_backward(*_rerun_inputs(q, k), dq, dk, dlogs, dbias)
        ctx.scale, ctx.bias = scale, bias
        ctx.params = (logit_scale if isinstance(logit_scale, torch.Tensor) else None,
                      logit_bias if isinstance(logit_bias, torch.Tensor) else None)
        return loss.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, dq, dk, dlogs, dbias = ctx.saved_tensors
        scale_param, bias_param = ctx.params
        # d loss / d s = (d loss / d log s) / s; in float: a GradScaler scale of 65536 does not fit float16.
        d_scale = _like(dlogs * grad / ctx.scale, scale_param) if ctx.needs_input_grad[2] else None
        d_bias = _like(dbias * grad, bias_param) if ctx.needs_input_grad[3] else None
        dq, dk = _feature_grads(grad, dq, dk,
                                lambda g: cuda_extension().sigmoid_step(q, k, ctx.scale, ctx.bias, None, 0, g)[1:3],
                                any(ctx.needs_input_grad[:2]))
        return dq, dk, d_scale, d_bias, None


def _cuda_step_forward(q, k, logit_scale, labels, symmetric, algorithm, fused_tiles):
    """contrastive_torch::cuda_step's work (at module level: the tests run it on the CPU with a stand-in extension)."""
    labels = _check_cuda_values(q, k, _labels_tensor(labels, q.shape[0]), symmetric)
    scale = _scale_value(logit_scale)
    # The extension raises by the library's error code (csrc/errors.hpp): ValueError for a refused argument.
    loss, dq, dk, dlogs, _max_logit, _site = cuda_extension().step(q, k, scale, labels, symmetric, algorithm, 0,
                                                                  fused_tiles)
    # loss and dlogs view the step's state buffer: an operator's outputs must not alias, so they are copied.
    return loss.clone(), dq, dk, dlogs.clone()


def _cuda_sigmoid_step_forward(q, k, logit_scale, logit_bias):
    """contrastive_torch::cuda_sigmoid_step's work (at module level, as _cuda_step_forward)."""
    _check_cuda_sigmoid(q, k)
    loss, dq, dk, dlogs, _max_logit, _site, dbias = cuda_extension().sigmoid_step(
        q, k, _scale_value(logit_scale), _bias_value(logit_bias), None, 0)
    # loss, dlogs and dbias view the step's state buffer: an operator's outputs must not alias, so they are copied.
    return loss.clone(), dq, dk, dlogs.clone(), dbias.clone()


# --- torch.distributed ------------------------------------------------------------------------------------------

_ALGORITHMS = ("fused", "materialized", "chunked")
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
# The Python exception kinds `agree` carries from the failing rank to every rank.
_KINDS = {1: TypeError, 2: ValueError, 3: NotImplementedError, 4: RuntimeError, 5: MemoryError, 6: OverflowError}


def _kind_of(error):
    for code in (3, 1, 2, 5, 6):  # NotImplementedError before RuntimeError (it is one)
        if isinstance(error, _KINDS[code]):
            return code
    return 4


def _with_rank(rank, text):
    """'argument: what' -> 'argument: rank r: what', as the library's agreed errors read."""
    head, sep, rest = text.partition(": ")
    if sep and " " not in head.strip():
        return f"{head}: rank {rank}: {rest}"
    return f"rank {rank}: {text}"


def _agree(group, error, values):
    """Every rank's verdict on its own checks (`error`: None or the exception it would raise) and its `values`,
    all-gathered over `group`: if any rank failed, every rank raises the first failing rank's error, naming it.
    Returns every rank's values."""
    kind = 0 if error is None else _kind_of(error)
    bad, bad_kind, text, got = extension().agree(group, kind, "" if error is None else str(error),
                                                 [float(v) for v in values])
    if bad >= 0:
        raised = _KINDS.get(bad_kind, RuntimeError)(_with_rank(bad, text))
        if error is not None and bad == group.rank():
            raise raised from error
        raise raised
    return got


def _first_other(got, i):
    """The first rank whose value i differs from rank 0's (bitwise: NaN differs from everything), or None."""
    import struct

    bits = [struct.pack("<d", v[i]) for v in got]
    for r in range(1, len(got)):
        if bits[r] != bits[0]:
            return r
    return None


def _check_same(got, symmetric):
    """The ranks' dtype, algorithm, objective and logit_scale must agree (the same error on every rank)."""
    names = {code: str(dtype) for dtype, code in _DTYPE_CODES.items()}
    r = _first_other(got, 0)
    if r is not None:
        what = "image_features" if symmetric else "query"
        raise TypeError(f"{what}: rank {r}: dtype {names.get(int(got[r][0]))} where rank 0 has "
                        f"{names.get(int(got[0][0]))}; every rank must pass the same dtype")
    r = _first_other(got, 1)
    if r is not None:
        raise ValueError(f"algorithm: rank {r}: '{_ALGORITHMS[int(got[r][1])]}' where rank 0 has "
                         f"'{_ALGORITHMS[int(got[0][1])]}'; every rank must use the same algorithm")
    r = _first_other(got, 3)
    if r is not None:
        raise ValueError(f"labels: rank {r} {'passes' if got[r][3] else 'omits'} labels where rank 0 "
                         f"{'passes' if got[0][3] else 'omits'} them")
    r = _first_other(got, 4)
    if r is not None:
        raise ValueError(f"logit_scale: rank {r}: {got[r][4]!r} where rank 0 has {got[0][4]!r}; every rank must "
                         "pass the same logit_scale (a parameter that DDP keeps equal on every rank)")
    r = _first_other(got, 5)
    if r is not None:
        raise ValueError(f"logit_bias: rank {r}: {got[r][5]!r} where rank 0 has {got[0][5]!r}; every rank must "
                         "pass the same logit_bias (a parameter that DDP keeps equal on every rank)")


def _run_eagerly(reason):
    """A decorator: torch.compile runs the function eagerly (a graph break; fullgraph=True refuses it, giving
    `reason`)."""

    def wrap(f):
        disable = getattr(getattr(torch, "compiler", None), "disable", None)
        if disable is None:
            return f
        try:
            return disable(f, reason=reason)
        except TypeError:  # PyTorch before reason=
            return disable(f)

    return wrap


_eager_only = _run_eagerly("contrastive_torch: with world_size > 1 the loss is a torch.distributed collective, run "
                           "eagerly (a graph break); fullgraph=True needs world_size=1")


class _DistFunction(torch.autograd.Function):
    """The loss of the global batch over a process group: forward and backward are collectives of every rank. The
    backward runs the library's at loss scale grad_ranks x the incoming gradient (which every rank must share), so the
    features get grad_ranks x d(global loss)/d(this rank's rows): open_clip's gather-with-grad convention for
    grad_ranks = world size (see python/README.md)."""

    @staticmethod
    def forward(ctx, q, k, logit_scale, labels, symmetric, owner, key, group, scale, grad_ranks, report,
                logit_bias=None, bias=None):
        # bias None: a softmax objective (symmetric or InfoNCE); a float: SigLIP's sigmoid loss with that bias.
        handle = owner._take_handle(key, group)
        ctx.sigmoid = bias is not None
        ctx.bias_param = logit_bias if isinstance(logit_bias, torch.Tensor) else None
        try:
            if ctx.sigmoid:
                value, _tau = handle.forward_sigmoid(q, k, scale, bias, labels, group)
            else:
                value, _tau = handle.forward(q, k, scale, labels, symmetric, group)
        except Exception:
            owner._give_handle(key, handle)
            raise
        report["loss"] = value
        ctx.owner, ctx.key, ctx.handle, ctx.group = owner, key, handle, group
        ctx.scale, ctx.grad_ranks, ctx.report = scale, grad_ranks, report
        ctx.scale_shape = logit_scale.shape if isinstance(logit_scale, torch.Tensor) else None
        ctx.scale_dtype = logit_scale.dtype if isinstance(logit_scale, torch.Tensor) else torch.float32
        if not (any(ctx.needs_input_grad[:3]) or (ctx.sigmoid and ctx.needs_input_grad[11])):
            report["first_nonfinite"], report["max_logit"] = handle.diagnosis()
            owner._give_handle(key, handle)
            ctx.handle = ctx.group = None
        return torch.tensor(value, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        handle, g, c = ctx.handle, float(grad), ctx.grad_ranks
        ctx.handle = None
        try:
            error = None if handle is not None else RuntimeError(
                "contrastive_torch: backward called twice, or after a forward without grad")
            got = _agree(ctx.group, error, [g])
            r = _first_other(got, 0)
            if r is not None:
                raise ValueError(f"loss: rank {r}: the incoming gradient is {got[r][0]!r} where rank 0's is "
                                 f"{got[0][0]!r}; the global loss's backward takes one loss scale, the same on every "
                                 "rank (GradScaler's scale, or 1)")
            # As _ContrastiveFunction: the incoming gradient (times c) is the library's loss scale when it can be.
            direct = g > 0.0 and g * c < 3.0e38
            dbias = None
            if ctx.sigmoid:
                dq, dk, dlogs, dbias = handle.backward_sigmoid(g * c if direct else float(c), ctx.group)
            else:
                dq, dk, dlogs = handle.backward(g * c if direct else float(c), ctx.group)
            ctx.report["first_nonfinite"], ctx.report["max_logit"] = handle.diagnosis()
        finally:
            ctx.group = None  # not kept with the graph (see _take_handle)
            if handle is not None:
                ctx.owner._give_handle(ctx.key, handle)
        if not direct:
            dq, dk, dlogs = dq * g, dk * g, dlogs * g
            dbias = dbias * g if dbias is not None else None
        d_scale = None
        if ctx.needs_input_grad[2] and ctx.scale_shape is not None:
            # The library's d(loss)/d(log s) is of the global loss on every rank (not scaled by c).
            d_scale = (dlogs / (c * ctx.scale)).to(ctx.scale_dtype).reshape(ctx.scale_shape)
        d_bias = None
        if dbias is not None and ctx.needs_input_grad[11]:
            d_bias = _like(dbias / c, ctx.bias_param)  # likewise d(global loss)/d b on every rank
        return dq, dk, d_scale, None, None, None, None, None, None, None, None, d_bias, None


def _host_forward(q, k, scale, labels, symmetric, algorithm, threads):
    """Loss value of one host forward; the engine goes back to the pool (nothing is kept for a backward)."""
    key = (_DTYPES[q.dtype], algorithm, threads)
    handle = _pool.take(key)
    try:
        value, _tau = handle.forward(q, k, scale, labels, symmetric)
    finally:
        _pool.give(key, handle)
    return value


def _host_gradients(grad, q, k, scale, labels, symmetric, algorithm, threads):
    """dq, dk and d loss / d log s of one host forward + backward at the incoming gradient `grad` (a float)."""
    key = (_DTYPES[q.dtype], algorithm, threads)
    handle = _pool.take(key)
    direct = grad > 0.0 and grad < 3.0e38  # as _ContrastiveFunction.backward: the gradient becomes the loss scale
    try:
        handle.forward(q, k, scale, labels, symmetric)
        dq, dk, dlogs = handle.backward(grad if direct else 1.0)
    finally:
        _pool.give(key, handle)
    if not direct:
        dq, dk, dlogs = dq * grad, dk * grad, dlogs * grad
    return dq, dk, dlogs


def _sigmoid_host_forward(q, k, scale, bias, algorithm, threads):
    """Loss value of one host forward of the sigmoid objective (the engine goes back to the pool)."""
    key = (_DTYPES[q.dtype], algorithm, threads)
    handle = _pool.take(key)
    try:
        value, _tau = handle.forward_sigmoid(q, k, scale, bias, None)
    finally:
        _pool.give(key, handle)
    return value


def _sigmoid_host_gradients(grad, q, k, scale, bias, algorithm, threads):
    """dq, dk, d loss / d log s and d loss / d b of one host forward + backward of the sigmoid objective at `grad`."""
    key = (_DTYPES[q.dtype], algorithm, threads)
    handle = _pool.take(key)
    direct = grad > 0.0 and grad < 3.0e38
    try:
        handle.forward_sigmoid(q, k, scale, bias, None)
        dq, dk, dlogs, dbias = handle.backward_sigmoid(grad if direct else 1.0)
    finally:
        _pool.give(key, handle)
    if not direct:
        dq, dk, dlogs, dbias = dq * grad, dk * grad, dlogs * grad, dbias * grad
    return dq, dk, dlogs, dbias


if HAS_CUSTOM_OPS:
    # The host loss as torch.library custom operators, so that torch.compile keeps it in one graph: a functional
    # forward (the loss) and backward (the gradients, recomputing the forward inside the library: no engine state
    # crosses the two ops), fake implementations for tracing, and the backward registered as the forward's autograd
    # formula. Eager calls keep the stateful autograd.Function above (no recomputation); torch.compile routes here.

    @torch.library.custom_op("contrastive_torch::loss", mutates_args=())
    def _loss_op(q: torch.Tensor, k: torch.Tensor, logit_scale: torch.Tensor, labels: Optional[torch.Tensor],
                 symmetric: bool, algorithm: str, threads: int) -> torch.Tensor:
        labels = _labels_tensor(labels, q.shape[0])
        value = _host_forward(q, k, _scale_value(logit_scale), labels, symmetric, algorithm, threads)
        return torch.tensor(value, dtype=torch.float32)

    @_loss_op.register_fake
    def _(q, k, logit_scale, labels, symmetric, algorithm, threads):
        return q.new_empty((), dtype=torch.float32)

    @torch.library.custom_op("contrastive_torch::loss_backward", mutates_args=())
    def _loss_backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, logit_scale: torch.Tensor,
                          labels: Optional[torch.Tensor], symmetric: bool, algorithm: str,
                          threads: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scale = _scale_value(logit_scale)
        labels = _labels_tensor(labels, q.shape[0])
        dq, dk, dlogs = _host_gradients(float(grad), q, k, scale, labels, symmetric, algorithm, threads)
        # d loss / d s = (d loss / d log s) / s, in logit_scale's dtype and shape.
        return dq, dk, (dlogs / scale).to(logit_scale.dtype).reshape(logit_scale.shape)

    @_loss_backward_op.register_fake
    def _(grad, q, k, logit_scale, labels, symmetric, algorithm, threads):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(logit_scale)

    def _loss_setup_context(ctx, inputs, output):
        q, k, logit_scale, labels, symmetric, algorithm, threads = inputs
        ctx.save_for_backward(q, k, logit_scale, labels)
        ctx.options = (symmetric, algorithm, threads)

    def _loss_autograd(ctx, grad):
        q, k, logit_scale, labels = ctx.saved_tensors
        dq, dk, ds = torch.ops.contrastive_torch.loss_backward(grad, q, k, logit_scale, labels, *ctx.options)
        return dq, dk, ds, None, None, None, None

    _loss_op.register_autograd(_loss_autograd, setup_context=_loss_setup_context)

    # SigLIP's sigmoid loss the same way (contrastive_torch::sigmoid_loss, ::sigmoid_loss_backward): the bias is a
    # tensor input (SigLipLoss passes a 0 for None) whose gradient the backward returns.
    @torch.library.custom_op("contrastive_torch::sigmoid_loss", mutates_args=())
    def _sigmoid_loss_op(q: torch.Tensor, k: torch.Tensor, logit_scale: torch.Tensor, logit_bias: torch.Tensor,
                         algorithm: str, threads: int) -> torch.Tensor:
        value = _sigmoid_host_forward(q, k, _scale_value(logit_scale), _bias_value(logit_bias), algorithm, threads)
        return torch.tensor(value, dtype=torch.float32)

    @_sigmoid_loss_op.register_fake
    def _(q, k, logit_scale, logit_bias, algorithm, threads):
        return q.new_empty((), dtype=torch.float32)

    @torch.library.custom_op("contrastive_torch::sigmoid_loss_backward", mutates_args=())
    def _sigmoid_loss_backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, logit_scale: torch.Tensor,
                                  logit_bias: torch.Tensor, algorithm: str,
                                  threads: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        scale = _scale_value(logit_scale)
        dq, dk, dlogs, dbias = _sigmoid_host_gradients(float(grad), q, k, scale, _bias_value(logit_bias), algorithm,
                                                       threads)
        return (dq, dk, (dlogs / scale).to(logit_scale.dtype).reshape(logit_scale.shape),
                dbias.to(logit_bias.dtype).reshape(logit_bias.shape))

    @_sigmoid_loss_backward_op.register_fake
    def _(grad, q, k, logit_scale, logit_bias, algorithm, threads):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(logit_scale), torch.empty_like(logit_bias)

    def _sigmoid_setup_context(ctx, inputs, output):
        q, k, logit_scale, logit_bias, algorithm, threads = inputs
        ctx.save_for_backward(q, k, logit_scale, logit_bias)
        ctx.options = (algorithm, threads)

    def _sigmoid_autograd(ctx, grad):
        q, k, logit_scale, logit_bias = ctx.saved_tensors
        dq, dk, ds, db = torch.ops.contrastive_torch.sigmoid_loss_backward(grad, q, k, logit_scale, logit_bias,
                                                                           *ctx.options)
        return dq, dk, ds, db, None, None

    _sigmoid_loss_op.register_autograd(_sigmoid_autograd, setup_context=_sigmoid_setup_context)

    # CUDA tensors: the device step computes the loss and the gradients at loss scale 1 in one call (as
    # _CudaFunction), so the operator returns all of them and its autograd formula scales the saved gradients by the
    # incoming one (contrastive_torch::cuda_feature_grads: float16 under a GradScaler reruns the step at its scale, as
    # _CudaFunction's backward does). Written and traced on the CPU only (its fake implementation); not yet run on a
    # GPU.
    @torch.library.custom_op("contrastive_torch::cuda_step", mutates_args=(), device_types="cuda")
    def _cuda_step_op(q: torch.Tensor, k: torch.Tensor, logit_scale: torch.Tensor, labels: Optional[torch.Tensor],
                      symmetric: bool, algorithm: str,
                      fused_tiles: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _cuda_step_forward(q, k, logit_scale, labels, symmetric, algorithm, fused_tiles)

    @_cuda_step_op.register_fake
    def _(q, k, logit_scale, labels, symmetric, algorithm, fused_tiles):
        scalar = q.new_empty((), dtype=torch.float32)
        return scalar, torch.empty_like(q), torch.empty_like(k), torch.empty_like(scalar)

    # The features' gradients of the CUDA operators' backward (_feature_grads as an operator: it reads the incoming
    # gradient's value, which a traced autograd formula cannot). q and k are given only when float16 (the rerun's
    # inputs); a logit_bias means the sigmoid objective (cuda_sigmoid_step's), none the softmax one (cuda_step's, with
    # its labels, symmetric, algorithm and fused_tiles). Registered for every device: on the CPU it multiplies, which
    # the tests check, with a stand-in extension for the rerun.
    @torch.library.custom_op("contrastive_torch::cuda_feature_grads", mutates_args=())
    def _cuda_feature_grads_op(grad: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, q: Optional[torch.Tensor],
                               k: Optional[torch.Tensor], logit_scale: torch.Tensor, logit_bias: Optional[torch.Tensor],
                               labels: Optional[torch.Tensor], symmetric: bool, algorithm: str,
                               fused_tiles: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        def rerun(g):
            if q is None or k is None:
                raise RuntimeError("cuda_feature_grads: float16 gradients under a loss scale need q and k to rerun "
                                   "the step")
            scale = _scale_value(logit_scale)
            if logit_bias is not None:
                return tuple(cuda_extension().sigmoid_step(q, k, scale, _bias_value(logit_bias), None, 0, g)[1:3])
            # The forward validated the labels (_cuda_step_forward): converted only, no second read of their values.
            labels32 = None if labels is None else labels.to(device=q.device, dtype=torch.int32).contiguous()
            return tuple(cuda_extension().step(q, k, scale, labels32, symmetric, algorithm, 0, fused_tiles, g)[1:3])

        return _feature_grads(grad, dq, dk, rerun)

    @_cuda_feature_grads_op.register_fake
    def _(grad, dq, dk, q, k, logit_scale, logit_bias, labels, symmetric, algorithm, fused_tiles):
        return torch.empty_like(dq), torch.empty_like(dk)

    def _cuda_setup_context(ctx, inputs, output):
        q, k, logit_scale, labels, symmetric, algorithm, fused_tiles = inputs
        _loss, dq, dk, dlogs = output
        ctx.save_for_backward(*_rerun_inputs(q, k), labels, dq, dk, dlogs, logit_scale)
        ctx.call = (symmetric, algorithm, fused_tiles)

    def _cuda_autograd(ctx, grad, _grad_dq, _grad_dk, _grad_dlogs):
        q, k, labels, dq, dk, dlogs, logit_scale = ctx.saved_tensors
        # d loss / d s = (d loss / d log s) / s; in float: a GradScaler scale of 65536 does not fit float16.
        d_scale = (dlogs * grad / logit_scale.float()).to(logit_scale.dtype).reshape(logit_scale.shape)
        gq = gk = None
        if any(ctx.needs_input_grad[:2]):
            gq, gk = torch.ops.contrastive_torch.cuda_feature_grads(grad, dq, dk, q, k, logit_scale, None, labels,
                                                                    *ctx.call)
        return gq, gk, d_scale, None, None, None, None

    _cuda_step_op.register_autograd(_cuda_autograd, setup_context=_cuda_setup_context)

    # SigLipLoss on CUDA tensors (contrastive_torch::cuda_sigmoid_step): the device's chunked step, all gradients in
    # one call, as cuda_step; the bias is a tensor input (SigLipLoss passes a 0 for None). Written and traced on the
    # CPU only (its fake implementation); not yet run on a GPU.
    @torch.library.custom_op("contrastive_torch::cuda_sigmoid_step", mutates_args=(), device_types="cuda")
    def _cuda_sigmoid_step_op(
            q: torch.Tensor, k: torch.Tensor, logit_scale: torch.Tensor,
            logit_bias: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _cuda_sigmoid_step_forward(q, k, logit_scale, logit_bias)

    @_cuda_sigmoid_step_op.register_fake
    def _(q, k, logit_scale, logit_bias):
        scalar = q.new_empty((), dtype=torch.float32)
        return scalar, torch.empty_like(q), torch.empty_like(k), torch.empty_like(scalar), torch.empty_like(scalar)

    def _cuda_sigmoid_setup_context(ctx, inputs, output):
        q, k, logit_scale, logit_bias = inputs
        _loss, dq, dk, dlogs, dbias = output
        ctx.save_for_backward(*_rerun_inputs(q, k), dq, dk, dlogs, dbias, logit_scale, logit_bias)

    def _cuda_sigmoid_autograd(ctx, grad, _grad_dq, _grad_dk, _grad_dlogs, _grad_dbias):
        q, k, dq, dk, dlogs, dbias, logit_scale, logit_bias = ctx.saved_tensors
        d_scale = _like(dlogs * grad / logit_scale.float().to(dlogs.device), logit_scale)
        d_bias = _like(dbias * grad, logit_bias)
        gq = gk = None
        if any(ctx.needs_input_grad[:2]):
            gq, gk = torch.ops.contrastive_torch.cuda_feature_grads(grad, dq, dk, q, k, logit_scale, logit_bias, None,
                                                                    True, "chunked", False)
        return gq, gk, d_scale, d_bias

    _cuda_sigmoid_step_op.register_autograd(_cuda_sigmoid_autograd, setup_context=_cuda_sigmoid_setup_context)


def _compiling():
    """True while torch.compile (dynamo) traces the caller."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling()
    dynamo = getattr(torch, "_dynamo", None)
    return bool(dynamo is not None and hasattr(dynamo, "is_compiling") and dynamo.is_compiling())


def _labels_tensor(labels, n_q):
    if labels is None:
        return None
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels: expected a torch.Tensor, got {type(labels).__name__}")
    if labels.dim() != 1 or labels.numel() != n_q:
        raise ValueError(f"labels: expected shape ({n_q},), got {tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels: dtype {labels.dtype} is not an integer type (int64 or int32)")
    if labels.numel() and (int(labels.min()) < -(2**31) or int(labels.max()) >= 2**31):
        raise ValueError("labels: values outside the int32 range")
    return labels.to(torch.int32).contiguous()


class _Base(torch.nn.Module):
    def __init__(self, *, algorithm="fused", threads=0, fused_tiles=False, custom_ops=False):
        super().__init__()
        if algorithm not in ("fused", "materialized", "chunked"):
            raise ValueError(f"algorithm: '{algorithm}' is not one of 'fused', 'materialized', 'chunked'")
        if not isinstance(threads, int) or threads < 0:
            raise ValueError(f"threads: must be an int >= 0 (0 = all cores), got {threads!r}")
        if not isinstance(fused_tiles, bool):
            raise TypeError(f"fused_tiles: expected a bool, got {type(fused_tiles).__name__}")
        if not isinstance(custom_ops, bool):
            raise TypeError(f"custom_ops: expected a bool, got {type(custom_ops).__name__}")
        if custom_ops and not HAS_CUSTOM_OPS:
            raise ValueError(f"custom_ops: needs PyTorch >= 2.4 (torch.library.custom_op); this is {torch.__version__}")
        self.algorithm = algorithm
        self.threads = threads
        # Run eager calls through the torch.library operators too (what torch.compile traces; on the CPU their
        # backward recomputes the forward). Under torch.compile they are used whatever this says.
        self.use_custom_ops = custom_ops
        # CUDA, algorithm="chunked", bfloat16/float16: the library's tensor-core logits tiles (chunk_options::
        # fused_tiles); ignored on the CPU, for float32 and for the other algorithms.
        self.fused_tiles = fused_tiles
        self.group = None  # ClipLoss(group=...): the torch.distributed process group (None: the default group)
        self._dist_free = {}
        self._dist_lock = threading.Lock()
        self.last_step = {}
        """Diagnosis of the last call: loss, first_nonfinite ('none', 'logits', 'loss', 'grad_q', 'grad_k',
        'grad_logit_scale'), max_logit. Filled by forward and completed by backward."""

    def _run(self, q, k, logit_scale, labels, symmetric):
        _check_features("image_features" if symmetric else "query", q)
        _check_features("text_features" if symmetric else "keys", k)
        if q.dtype != k.dtype:
            raise TypeError(f"features: dtypes differ ({q.dtype} and {k.dtype})")
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"features: embedding sizes differ ({q.shape[1]} and {k.shape[1]})")
        if q.device != k.device:
            raise ValueError(f"features: on different devices ({q.device} and {k.device})")
        if HAS_CUSTOM_OPS and (self.use_custom_ops or _compiling()):
            return self._run_op(q, k, logit_scale, labels, symmetric)
        report = {}
        self.last_step = report
        labels32 = _labels_tensor(labels, q.shape[0])
        if q.device.type == "cuda":
            return self._run_cuda(q, k, logit_scale, labels32, symmetric, report)
        if labels32 is not None and labels32.device.type != "cpu":
            raise ValueError(f"labels: on {labels32.device} while the features are on the CPU")
        return _ContrastiveFunction.apply(q, k, logit_scale, labels32, symmetric, self.algorithm, self.threads,
                                          report)

    def _run_op(self, q, k, logit_scale, labels, symmetric):
        """The custom-operator path (torch.compile): checks that read no tensor values (those would break the graph);
        values (finiteness, label range, logit_scale > 0) are checked when the operator runs."""
        if labels is not None:
            if not isinstance(labels, torch.Tensor):
                raise TypeError(f"labels: expected a torch.Tensor, got {type(labels).__name__}")
            if labels.dim() != 1 or labels.shape[0] != q.shape[0]:
                raise ValueError(f"labels: expected shape ({q.shape[0]},), got {tuple(labels.shape)}")
            if labels.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"labels: dtype {labels.dtype} is not an integer type (int64 or int32)")
            if q.device.type == "cpu" and labels.device.type != "cpu":
                raise ValueError(f"labels: on {labels.device} while the features are on the CPU")
        if not isinstance(logit_scale, torch.Tensor):
            logit_scale = torch.tensor(float(logit_scale), dtype=torch.float32, device=q.device)
        elif logit_scale.numel() != 1:
            raise ValueError(f"logit_scale: expected one value, got shape {tuple(logit_scale.shape)}")
        if q.device.type == "cuda":
            return torch.ops.contrastive_torch.cuda_step(q, k, logit_scale, labels, symmetric, self.algorithm,
                                                         self.fused_tiles)[0]
        return torch.ops.contrastive_torch.loss(q, k, logit_scale, labels, symmetric, self.algorithm, self.threads)

    def _take_handle(self, key, group):
        """A distributed engine for key = (dtype, algorithm, threads, rank, size), reused across steps (per module:
        every rank's module makes the same calls, so every rank takes its engines in the same order). The group is
        passed with each call, never kept: a process group alive at interpreter exit (after destroy_process_group) can
        abort the process, so no engine or pool here holds one."""
        with self._dist_lock:
            stack = self._dist_free.get(key)
            if stack:
                return stack.pop()
        return extension().Loss(key[0], key[1], key[2], group)

    def _give_handle(self, key, handle):
        with self._dist_lock:
            self._dist_free.setdefault(key, []).append(handle)

    @_eager_only  # a collective of the process group: torch.compile runs it eagerly (a graph break)
    def _run_dist(self, q, k, logit_scale, labels, symmetric, grad_ranks_of, sigmoid=False, logit_bias=None):
        """The loss of the global batch over the process group (every rank calls it). Every check whose outcome could
        differ between ranks is agreed on first (one all-gather), so a bad input on one rank raises on every rank,
        naming it; the library's own checks (shapes, finiteness, labels against the global keys) are agreed on inside
        its forward. `grad_ranks_of(size)`: the factor of the features' gradients (python/README.md)."""
        import torch.distributed as dist

        if not dist.is_available() or not getattr(extension(), "HAS_DISTRIBUTED", False):
            raise NotImplementedError("world_size > 1: this PyTorch (or the extension) has no torch.distributed")
        if not dist.is_initialized():
            raise RuntimeError("world_size > 1: torch.distributed is not initialized (call "
                               "torch.distributed.init_process_group first, on every rank)")
        group = self.group if self.group is not None else dist.group.WORLD
        rank, size = group.rank(), group.size()
        error, values, labels32, scale = None, [], None, None
        try:
            qn, kn = ("image_features", "text_features") if symmetric else ("query", "keys")
            _check_features(qn, q)
            _check_features(kn, k)
            if q.device.type == "cuda" or k.device.type == "cuda":
                raise NotImplementedError(
                    f"{qn}: CUDA tensors with world_size > 1: the distributed loss runs on the CPU (gloo) only for "
                    "now (the device engine has no torch.distributed path yet); pass CPU tensors, or all-gather the "
                    "features yourself and use world_size=1")
            if q.dtype != k.dtype:
                raise TypeError(f"features: dtypes differ ({q.dtype} and {k.dtype})")
            if q.shape[1] != k.shape[1]:
                raise ValueError(f"features: embedding sizes differ ({q.shape[1]} and {k.shape[1]})")
            if self.world_size > 1 and self.world_size != size:
                raise ValueError(f"world_size: {self.world_size}, but the process group has {size} ranks")
            if self.world_size > 1 and self.rank != rank:
                raise ValueError(f"rank: {self.rank}, but this process is rank {rank} of the process group")
            scale = _scale_value(logit_scale)
            bias = _bias_value(logit_bias) if sigmoid else 0.0
            labels32 = _labels_tensor(labels, q.shape[0])
            if labels32 is not None and labels32.device.type != "cpu":
                raise ValueError(f"labels: on {labels32.device} while the features are on the CPU")
            values = [_DTYPE_CODES[q.dtype], _ALGORITHMS.index(self.algorithm), float(symmetric),
                      float(labels32 is not None), scale, bias]
        except Exception as e:  # raised below on every rank, after the agreement
            error = e
        try:
            got = _agree(group, error, values)
        except RuntimeError as e:
            if isinstance(error, NotImplementedError) and not isinstance(e, NotImplementedError):
                raise error from e  # e.g. a CUDA-only (NCCL) group cannot run the agreement on the CPU
            raise
        _check_same(got, symmetric)
        report = {}
        self.last_step = report
        key = (_DTYPES[q.dtype], self.algorithm, self.threads, rank, size)
        return _DistFunction.apply(q, k, logit_scale, labels32, symmetric, self, key, group, scale,
                                   grad_ranks_of(size), report, logit_bias if sigmoid else None,
                                   bias if sigmoid else None)

    def _run_cuda(self, q, k, logit_scale, labels32, symmetric, report):
        labels32 = _check_cuda_values(q, k, labels32, symmetric)
        return _CudaFunction.apply(q, k, logit_scale, labels32, symmetric, self.algorithm, self.fused_tiles, report)


def _flag(name, value):
    # open_clip passes argparse's store_true values; accept bools and ints (0/1), refuse anything else by name.
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return bool(value)
    raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def _index(name, value):
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


class ClipLoss(_Base):
    """open_clip's ClipLoss: same constructor, same call.

        loss_fn = ClipLoss(local_loss=False, gather_with_grad=False, cache_labels=False, rank=0, world_size=1,
                           use_horovod=False, *, algorithm="fused", threads=0, fused_tiles=False)
        loss = loss_fn(image_features, text_features, logit_scale)      # logit_scale = model.logit_scale.exp()

    The symmetric loss over a batch of pairs, (CE(s I T^T) + CE(s T I^T)) / 2 with s = 1/tau; gradients to both
    feature tensors and to logit_scale. open_clip's arguments mean what they mean there: `local_loss` and
    `gather_with_grad` choose how a multi-process loss is formed (with one process, world_size=1, both change
    nothing, as in open_clip); `cache_labels` caches open_clip's label tensor (nothing to cache here: the diagonal is
    implied); `rank`, `world_size`: this process in the job. use_horovod=True raises NotImplementedError (never
    supported). The keyword-only options are this library's (see _Base).

    world_size > 1, or `group` (a torch.distributed ProcessGroup; default: the default group), computes the loss of
    the global batch: every rank of the group calls it with its own rows (CPU tensors, gloo), and every rank gets the
    global loss (also for local_loss=True, whose open_clip value is the rank's share: their mean over ranks is this).
    Gradients follow open_clip's (python/README.md): each rank's features get world_size x d(global loss)/d(its rows)
    with gather_with_grad=True or local_loss=True (DDP's averaging then gives the exact gradient), 1 x with neither;
    logit_scale gets d(global loss)/d(logit_scale) on every rank. rank and world_size, where world_size > 1, must be
    the group's. Every rank must pass the same dtype, algorithm and logit_scale; an error on one rank is raised on
    every rank, naming it."""

    def __init__(self, local_loss=False, gather_with_grad=False, cache_labels=False, rank=0, world_size=1,
                 use_horovod=False, *, algorithm="fused", threads=0, fused_tiles=False, custom_ops=False,
                 group=None):
        super().__init__(algorithm=algorithm, threads=threads, fused_tiles=fused_tiles, custom_ops=custom_ops)
        self.local_loss = _flag("local_loss", local_loss)
        self.gather_with_grad = _flag("gather_with_grad", gather_with_grad)
        self.cache_labels = _flag("cache_labels", cache_labels)
        self.use_horovod = _flag("use_horovod", use_horovod)
        self.rank = _index("rank", rank)
        self.world_size = _index("world_size", world_size)
        if self.world_size < 1:
            raise ValueError(f"world_size: must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: must be in [0, world_size) = [0, {self.world_size}), got {self.rank}")
        if self.use_horovod:
            raise NotImplementedError("use_horovod: Horovod is not supported by contrastive_torch (use_horovod=True)")
        if group is not None:
            import torch.distributed as dist

            if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
                raise TypeError(f"group: expected a torch.distributed ProcessGroup, got {type(group).__name__}")
        self.group = group
        self.distributed = self.world_size > 1 or group is not None
        if self.distributed and custom_ops:
            raise NotImplementedError(
                "custom_ops: the torch.library operators run one process; with world_size > 1 (or a group) the loss "
                "is a collective run eagerly (torch.compile runs it as a graph break); use custom_ops=False")

    def forward(self, image_features, text_features, logit_scale, logit_bias=None, output_dict=False):
        """open_clip's forward. open_clip adds `logit_bias` to every logit; one value (open_clip's CLIP models pass
        None) shifts every row and column alike, which no softmax sees: it changes neither the loss nor the other
        gradients, and its own gradient is 0, which it gets here. A per-logit bias is refused."""
        if self.distributed:
            loss = self._run_dist(image_features, text_features, logit_scale, None, True, self._grad_ranks)
        else:
            loss = self._run(image_features, text_features, logit_scale, None, True)
        if logit_bias is not None:
            if not isinstance(logit_bias, (torch.Tensor, float, int)) or isinstance(logit_bias, bool):
                raise TypeError(f"logit_bias: expected None, a number or a one-element tensor, got "
                                f"{type(logit_bias).__name__}")
            if isinstance(logit_bias, torch.Tensor):
                if logit_bias.numel() != 1:
                    raise ValueError(f"logit_bias: expected one value (a per-logit bias is not supported), got shape "
                                     f"{tuple(logit_bias.shape)}")
                if logit_bias.requires_grad:
                    loss = loss + (logit_bias.reshape(()) * 0).to(loss.dtype)
        return {"contrastive_loss": loss} if output_dict else loss


    def _grad_ranks(self, size):
        """open_clip's factor on the features' gradients: its all-gather with grad sums every rank's gradient of the
        (global, or with local_loss=True the rank's share of the) loss, size x d(global loss)/d(rows); with neither
        option only the rank's own slot of the gathered features has a gradient, 1 x. open_clip's local_loss=True
        without gather_with_grad drops the cross-rank terms (python/README.md); the exact size x is given there."""
        return size if (self.gather_with_grad or self.local_loss) else 1


_DIST_IMPLS = ("bidir", "shift", "reduce", "gather")


class SigLipLoss(_Base):
    """open_clip's SigLipLoss: same constructor, same call.

        loss_fn = SigLipLoss(cache_labels=False, rank=0, world_size=1, dist_impl=None, *, algorithm=None,
                             threads=0, group=None)
        loss = loss_fn(image_features, text_features, logit_scale, logit_bias)  # logit_scale = t = exp(t')

    SigLIP's pairwise sigmoid loss (Zhai et al. 2023): logits z = t I T^T + b, loss -(1/n) sum log sigmoid(l z) with
    l = +1 on the diagonal and -1 elsewhere, n the number of images; gradients to both feature tensors, to
    logit_scale and to logit_bias (None: no bias). The library's objective::sigmoid: on CPU tensors the host engine
    (algorithm None or 'fused': forward and backward in one pass, never the n x n logits; 'materialized', 'chunked'),
    on CUDA tensors the device's chunked step (cuBLAS products, one element-wise pass per chunk; algorithm None or
    'chunked', the one device algorithm for this loss: 'fused' and 'materialized' are refused there by name). The CUDA
    path is written and compiled but has not run on a GPU yet. `cache_labels` caches
    open_clip's label matrix (nothing to cache here: the diagonal is implied); `dist_impl` picks open_clip's exchange
    for world_size > 1 ('bidir', 'shift', 'reduce', 'gather', default 'bidir'): all four give the same loss and
    gradients, and so does this one, which gathers the text features once and reduce-scatters their gradients
    whichever is named.

    world_size > 1, or `group`, computes the loss of the global batch over torch.distributed (gloo; CPU tensors):
    each rank passes its own images and texts (positives on the global diagonal) and gets the global loss, (1/N)
    sum over all N x N pairs: the mean over ranks of open_clip's per-rank values (each of which is normalised by the
    rank's own batch). Gradients are open_clip's (its exchanges carry gradients back): each rank's features get
    world_size x d(global loss)/d(its rows), which DDP's averaging turns into the exact gradient; logit_scale and
    logit_bias get d(global loss)/d(them) on every rank. Every rank must pass the same dtype, algorithm, logit_scale
    and logit_bias; an error on one rank is raised on every rank, naming it.

    On PyTorch >= 2.4 the one-process loss is also the custom operators contrastive_torch::sigmoid_loss and
    ::sigmoid_loss_backward, which torch.compile traces (custom_ops=True uses them in eager calls too)."""

    def __init__(self, cache_labels=False, rank=0, world_size=1, dist_impl=None, *, algorithm=None, threads=0,
                 custom_ops=False, group=None):
        # None: 'fused' on CPU tensors, 'chunked' (the only device algorithm of this loss) on CUDA tensors.
        super().__init__(algorithm="fused" if algorithm is None else algorithm, threads=threads,
                         custom_ops=custom_ops)
        self.algorithm_given = algorithm is not None
        self.cache_labels = _flag("cache_labels", cache_labels)
        self.rank = _index("rank", rank)
        self.world_size = _index("world_size", world_size)
        if self.world_size < 1:
            raise ValueError(f"world_size: must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: must be in [0, world_size) = [0, {self.world_size}), got {self.rank}")
        if dist_impl is not None and dist_impl not in _DIST_IMPLS:
            raise ValueError(f"dist_impl: '{dist_impl}' is not one of {', '.join(repr(d) for d in _DIST_IMPLS)}")
        self.dist_impl = dist_impl or "bidir"
        if group is not None:
            import torch.distributed as dist

            if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
                raise TypeError(f"group: expected a torch.distributed ProcessGroup, got {type(group).__name__}")
        self.group = group
        self.distributed = self.world_size > 1 or group is not None
        if self.distributed and custom_ops:
            raise NotImplementedError(
                "custom_ops: the torch.library operators run one process; with world_size > 1 (or a group) the loss "
                "is a collective run eagerly (torch.compile runs it as a graph break); use custom_ops=False")

    def forward(self, image_features, text_features, logit_scale, logit_bias=None, output_dict=False):
        if self.distributed:
            loss = self._run_dist(image_features, text_features, logit_scale, None, False, lambda size: size,
                                  sigmoid=True, logit_bias=logit_bias)
        else:
            loss = self._run_sigmoid(image_features, text_features, logit_scale, logit_bias)
        return {"contrastive_loss": loss} if output_dict else loss

    def _run_sigmoid(self, q, k, logit_scale, logit_bias):
        _check_features("image_features", q)
        _check_features("text_features", k)
        if q.dtype != k.dtype:
            raise TypeError(f"features: dtypes differ ({q.dtype} and {k.dtype})")
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"features: embedding sizes differ ({q.shape[1]} and {k.shape[1]})")
        if q.device != k.device:
            raise ValueError(f"features: on different devices ({q.device} and {k.device})")
        if q.device.type == "cuda":
            return self._run_sigmoid_cuda(q, k, logit_scale, logit_bias)
        if HAS_CUSTOM_OPS and (self.use_custom_ops or _compiling()):
            # The operators (what torch.compile traces): checks that read no values here; values inside the op.
            logit_scale, logit_bias = _operator_scalars(logit_scale, logit_bias, None)
            return torch.ops.contrastive_torch.sigmoid_loss(q, k, logit_scale, logit_bias, self.algorithm,
                                                            self.threads)
        _bias_value(logit_bias)  # its type and value, before any work
        report = {}
        self.last_step = report
        return _SigmoidFunction.apply(q, k, logit_scale, logit_bias, None, self.algorithm, self.threads, report)

    def _run_sigmoid_cuda(self, q, k, logit_scale, logit_bias):
        if self.algorithm_given and self.algorithm != "chunked":
            raise ValueError(f"algorithm: '{self.algorithm}' has no device path for the sigmoid loss; on CUDA tensors "
                             f"SigLipLoss runs 'chunked' (pass algorithm='chunked', or leave it unset)")
        if HAS_CUSTOM_OPS and (self.use_custom_ops or _compiling()):
            # The operator (what torch.compile traces): nothing here reads a value; the operator checks them.
            logit_scale, logit_bias = _operator_scalars(logit_scale, logit_bias, q.device)
            loss, _dq, _dk, _dlogs, _dbias = torch.ops.contrastive_torch.cuda_sigmoid_step(q, k, logit_scale,
                                                                                          logit_bias)
            return loss
        _bias_value(logit_bias)  # its type and value, before any work
        _check_cuda_sigmoid(q, k)
        report = {}
        self.last_step = report
        return _CudaSigmoidFunction.apply(q, k, logit_scale, logit_bias, report)


def _operator_scalars(logit_scale, logit_bias, device):
    """SigLipLoss's logit_scale and logit_bias as the one-element tensors its operators take (numbers become float32
    tensors on `device`, None for the default; a None bias is 0), checked without reading a value."""
    if isinstance(logit_bias, bool) or not (logit_bias is None or isinstance(logit_bias, (torch.Tensor, float, int))):
        raise TypeError(f"logit_bias: expected None, a number or a one-element tensor, got {type(logit_bias).__name__}")
    if not isinstance(logit_scale, torch.Tensor):
        logit_scale = torch.tensor(float(logit_scale), dtype=torch.float32, device=device)
    if not isinstance(logit_bias, torch.Tensor):
        logit_bias = torch.tensor(float(logit_bias or 0.0), dtype=torch.float32, device=device)
    for name, x in (("logit_scale", logit_scale), ("logit_bias", logit_bias)):
        if x.numel() != 1:
            raise ValueError(f"{name}: expected one value, got shape {tuple(x.shape)}")
    return logit_scale, logit_bias


class InfoNCELoss(_Base):
    """One-directional InfoNCE: mean_i CE(s q_i . K^T, labels[i]); keys may outnumber queries (a MoCo queue).
    labels=None means the diagonal (needs n_q <= n_k)."""

    def forward(self, query, keys, logit_scale, labels=None):
        return self._run(query, keys, logit_scale, labels, False)


@torch.no_grad()
def clamp_logit_scale(logit_scale_param, max_scale=100.0, min_scale=1.0):
    """open_clip's clamp, on the user's parameter (log of s): keeps s = exp(param) in [min_scale, max_scale] (tau in
    [1/max_scale, 1/min_scale]); call after optimizer.step()."""
    logit_scale_param.clamp_(min=float(torch.log(torch.tensor(min_scale))),
                             max=float(torch.log(torch.tensor(max_scale))))


def freeze_then_learn(logit_scale_param, step, unfreeze_step):
    """The seed's remedy: the temperature stays fixed (requires_grad False) until `unfreeze_step` finite steps."""
    logit_scale_param.requires_grad_(step >= unfreeze_step)
