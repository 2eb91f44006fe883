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
use algorithm="chunked" (cuBLAS products) on GPUs. There the gradients are formed at loss scale 1 and multiplied by the
incoming gradient afterwards, so in float16 gradient values below fp16's range flush before GradScaler's scale
applies (bfloat16 and float32 are unaffected), and `last_step` holds device tensors (no synchronisation):
`first_nonfinite_code` indexes NONFINITE_SITES. Input checks on CUDA (finiteness, label range) synchronise once.
"""

import os
import threading

import torch

__all__ = ["ClipLoss", "InfoNCELoss", "clamp_logit_scale", "freeze_then_learn", "extension", "cuda_extension",
           "NONFINITE_SITES"]

NONFINITE_SITES = ("none", "logits", "loss", "grad_q", "grad_k", "grad_logit_scale", "parameters")

_HERE = os.path.dirname(os.path.abspath(__file__))
# An installed package carries the headers (setup.py copies them); a source checkout has them two levels up.
_PACKAGED_INCLUDE = os.path.join(_HERE, "include")
_REPO_INCLUDE = os.path.normpath(os.path.join(_HERE, "..", "..", "include"))
_ext = None
_cuda_ext = None
_ext_lock = threading.Lock()

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


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
            flags = ["-O3", "-std=c++17", "-DNDEBUG"]
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
                extra_cflags=["-O3", "-std=c++17", "-DNDEBUG"],
                extra_cuda_cflags=["-O3", "-std=c++17", "-DNDEBUG", "--expt-relaxed-constexpr"],
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


class _CudaFunction(torch.autograd.Function):
    """CUDA tensors: the device step computes the loss and the gradients at loss scale 1 in the forward; the backward
    multiplies them by the incoming gradient."""

    @staticmethod
    def forward(ctx, q, k, logit_scale, labels, symmetric, algorithm, fused_tiles, report):
        scale = _scale_value(logit_scale)
        try:
            loss, dq, dk, dlogs, max_logit, site = cuda_extension().step(q, k, scale, labels, symmetric, algorithm, 0,
                                                                         fused_tiles)
        except (RuntimeError, ValueError) as e:
            if "invalid" in str(e) or "algorithm" in str(e) or "dtype" in str(e):
                raise ValueError(str(e)) from None
            raise
        report.update({"loss": loss, "max_logit": max_logit, "first_nonfinite_code": site})
        ctx.save_for_backward(dq, dk, dlogs)
        ctx.scale = scale
        ctx.scale_shape = logit_scale.shape if isinstance(logit_scale, torch.Tensor) else None
        ctx.scale_dtype = logit_scale.dtype if isinstance(logit_scale, torch.Tensor) else torch.float32
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        dq, dk, dlogs = ctx.saved_tensors
        d_scale = None
        if ctx.needs_input_grad[2] and ctx.scale_shape is not None:
            d_scale = (dlogs * grad / ctx.scale).to(ctx.scale_dtype).reshape(ctx.scale_shape)
        # In float: a GradScaler scale of 65536 does not fit float16.
        return (dq.float() * grad).to(dq.dtype), (dk.float() * grad).to(dk.dtype), d_scale, None, None, None, None, None


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
    def __init__(self, algorithm="fused", threads=0, fused_tiles=False):
        super().__init__()
        if algorithm not in ("fused", "materialized", "chunked"):
            raise ValueError(f"algorithm: '{algorithm}' is not one of 'fused', 'materialized', 'chunked'")
        if not isinstance(threads, int) or threads < 0:
            raise ValueError(f"threads: must be an int >= 0 (0 = all cores), got {threads!r}")
        if not isinstance(fused_tiles, bool):
            raise TypeError(f"fused_tiles: expected a bool, got {type(fused_tiles).__name__}")
        self.algorithm = algorithm
        self.threads = threads
        # CUDA, algorithm="chunked", bfloat16/float16: the library's tensor-core logits tiles (chunk_options::
        # fused_tiles); ignored on the CPU, for float32 and for the other algorithms.
        self.fused_tiles = fused_tiles
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
        report = {}
        self.last_step = report
        labels32 = _labels_tensor(labels, q.shape[0])
        if q.device.type == "cuda":
            return self._run_cuda(q, k, logit_scale, labels32, symmetric, report)
        if labels32 is not None and labels32.device.type != "cpu":
            raise ValueError(f"labels: on {labels32.device} while the features are on the CPU")
        return _ContrastiveFunction.apply(q, k, logit_scale, labels32, symmetric, self.algorithm, self.threads,
                                          report)

    def _run_cuda(self, q, k, logit_scale, labels32, symmetric, report):
        # The device API does not check values (that would synchronise inside the step); check them here, once.
        for name, x in (("image_features" if symmetric else "query", q), ("text_features" if symmetric else "keys", k)):
            if not bool(torch.isfinite(x).all()):
                raise ValueError(f"{name}: holds a non-finite value")
        if labels32 is not None:
            labels32 = labels32.to(q.device)
            if labels32.numel() and (int(labels32.min()) < 0 or int(labels32.max()) >= k.shape[0]):
                raise ValueError(f"labels: values outside [0, {k.shape[0]}) (the number of keys)")
        elif not symmetric and q.shape[0] > k.shape[0]:
            raise ValueError(f"labels: None means the diagonal, which needs n_q <= n_k ({q.shape[0]} > {k.shape[0]})")
        if symmetric and q.shape[0] != k.shape[0]:
            raise ValueError(f"features: the symmetric loss needs as many texts as images ({q.shape[0]} and "
                             f"{k.shape[0]})")
        return _CudaFunction.apply(q, k, logit_scale, labels32, symmetric, self.algorithm, self.fused_tiles, report)


class ClipLoss(_Base):
    """open_clip's ClipLoss call shape: loss = ClipLoss()(image_features, text_features, logit_scale), with
    logit_scale = model.logit_scale.exp() (s = 1/tau). The symmetric loss over a batch of pairs; gradients to both
    feature tensors and to logit_scale."""

    def forward(self, image_features, text_features, logit_scale, output_dict=False):
        loss = self._run(image_features, text_features, logit_scale, None, True)
        return {"contrastive_loss": loss} if output_dict else loss


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
