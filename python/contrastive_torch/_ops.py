# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The operators: every loss call, eager or compiled, CPU or CUDA, runs through these (torch.library, PyTorch >= 2.4).

    contrastive_torch::softmax_step(q, k, logit_scale, labels, symmetric, algorithm, threads, fused_tiles, grads)
        -> (loss, dq, dk, dlogs, max_logit, site)                 CLIP's symmetric loss and InfoNCE
    contrastive_torch::sigmoid_step(q, k, logit_scale, logit_bias, algorithm, threads, grads)
        -> (loss, dq, dk, dlogs, dbias, max_logit, site)           SigLIP's sigmoid loss
    contrastive_torch::grouped_softmax_step(q, k, logit_scale, query_groups, key_groups, symmetric, algorithm,
                                            threads, grads) -> (as softmax_step)      several positives per row
    contrastive_torch::grouped_sigmoid_step(q, k, logit_scale, logit_bias, query_groups, key_groups, algorithm,
                                            threads, grads) -> (as sigmoid_step)
    contrastive_torch::feature_grads(grad, dq, dk, q, k, logit_scale, logit_bias, labels, symmetric, algorithm,
                                     threads, fused_tiles, query_groups, key_groups) -> (dq, dk)
                                                                      float16 features' backward

The grouped steps take int64 group ids (one per query, one per key; a pair is positive when its ids are equal) in
place of labels: docs/multi_positive.md. Their CPU kernels run the host engine; their CUDA kernels a chunked PyTorch
composition (contrastive_torch._grouped), since the device step takes one positive per row.

A step computes the loss and, when `grads`, every gradient at loss scale 1 in one engine call (the host engine's
forward and backward, or the device's one pass): loss (float32), dq and dk (the features' dtype; 0 x dim when not
`grads`), dlogs = d loss / d log s and dbias = d loss / d b (float64), the largest logit (float32) and the first
non-finite site (int32, an index into NONFINITE_SITES). Each step has a CPU kernel (the host engine) and a CUDA kernel
(the device step) on the one operator, a fake implementation, and one autograd formula: the incoming gradient g
multiplies the saved gradients (in float: a GradScaler scale of 65536 does not fit float16; in the formula itself for
bfloat16 and float32), except for float16 features under g != 1, where feature_grads (which reads g) runs the step
again at loss scale g, so that gradients below float16's
normal range at scale 1 keep their digits (at SigLIP's start and a batch of 32k, |dQ| ~ 1e-5). bfloat16 and float32
keep float's exponent range, so multiplying loses nothing there (for a power-of-two g, as GradScaler's, the result is
bit for bit the engine's at loss scale g).

Autocast: softmax_step and sigmoid_step have a rule for torch.autocast on CPU and CUDA (AutocastCPU, AutocastCUDA),
as torch.matmul has: inside an autocast region of the features' device type, float32 q and k are cast to the region's
dtype (torch.get_autocast_dtype) before the step runs; logit_scale and logit_bias stay float32 (a 16-bit logit scale
would round s itself), 16-bit features are left as they are, and outside autocast nothing changes. The loss is float32
as always, and the cast's backward brings the features' gradients back to float32. Eager calls and torch.compile both
dispatch through the rule (compile traces it into the graph)."""

from typing import Callable, NamedTuple, Optional

import torch

from . import _device, _grouped, _host
from ._checks import bias_value, labels_int32, scale_value
from ._extension import HAS_CUSTOM_OPS

_OBJECTIVES = {True: "symmetric", False: "info_nce"}


def rerun_scale(dtype, grad):
    """The loss scale a backward reruns the step at (float16 features and an incoming gradient g other than 1, finite
    and > 0; one read of g), else None (the saved gradients are multiplied by g)."""
    if dtype != torch.float16:
        return None
    g = float(grad)
    return g if 0.0 < g < 3.0e38 and g != 1.0 else None


def _outputs(q, k, value, dq, dk, dlogs, dbias, max_logit, site, sigmoid):
    """The host step's results as the operators' output tensors."""
    if dq is None:
        dq, dk = q.new_empty((0, q.shape[1])), k.new_empty((0, k.shape[1]))
        dlogs, dbias = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    out = [torch.tensor(value, dtype=torch.float32), dq, dk, dlogs]  # the engine's scalars: float64, 0-dim
    if sigmoid:
        out.append(dbias)
    return tuple(out + [torch.tensor(max_logit, dtype=torch.float32), torch.tensor(site, dtype=torch.int32)])


def _device_outputs(q, k, out, grads, sigmoid):
    loss, dq, dk, dlogs, dbias, max_logit, site = out
    if not grads:
        dq, dk = q.new_empty((0, q.shape[1])), k.new_empty((0, k.shape[1]))
    res = [loss, dq, dk, dlogs.to(torch.float64)]
    if sigmoid:
        res.append(dbias.to(torch.float64))
    return tuple(res + [max_logit, site.to(torch.int32)])


# --- autocast ------------------------------------------------------------------------------------------------------


def autocast_dtype(device_type):
    """The dtype float32 features run at on `device_type` ('cpu', 'cuda'): the autocast region's
    (torch.get_autocast_dtype) where autocast is enabled for that device type, else None."""
    if HAS_CUSTOM_OPS:  # PyTorch >= 2.4: the device-type API
        enabled, dtype = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    elif device_type == "cpu":
        enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    else:
        enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
    if not enabled:
        return None
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def autocast_features(q, k, device_type=None):
    """q and k as an autocast region runs them: float32 features on an autocast-enabled device type become its dtype
    (a differentiable cast: their gradients come back float32); features of two dtypes (a bfloat16 tower beside a
    float32 one) both become it, as torch.matmul's operands do; anything else is returned as it is. `device_type`:
    the type whose autocast state is read (default: q's device type)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        return q, k
    dtype = autocast_dtype(device_type or q.device.type)
    if dtype is None:
        return q, k
    if q.dtype != k.dtype and q.is_floating_point() and k.is_floating_point():
        return q.to(dtype), k.to(dtype)
    return tuple(x.to(dtype) if x.dtype == torch.float32 else x for x in (q, k))


# The rules registered below, by (operator name, device type): the tests call the CUDA ones on the CPU.
AUTOCAST_RULES = {}


def _register_autocast(name, device_type):
    """Registers the autocast rule of contrastive_torch::`name` for `device_type`: cast q and k (the first two
    arguments; autocast_features), then run the operator again below this autocast key, as torch.library's own
    register_autocast does (which would cast every floating input, logit_scale and logit_bias included)."""
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    op = getattr(torch.ops.contrastive_torch, name).default

    def rule(q, k, *rest):
        q, k = autocast_features(q, k, device_type)
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(q, k, *rest)

    _LIB.impl(name, rule, key)
    AUTOCAST_RULES[(name, device_type)] = rule


# --- kernels (module level: the tests run the CUDA ones on the CPU with a stand-in extension) ----------------------


def softmax_step_cpu(q, k, logit_scale, labels, symmetric, algorithm, threads, fused_tiles, grads):
    value, dq, dk, dlogs, _, max_logit, site = _host.step(q, k, scale_value(logit_scale), 0.0, labels_int32(labels),
                                                          _OBJECTIVES[symmetric], algorithm, threads, grads)
    return _outputs(q, k, value, dq, dk, dlogs, None, max_logit, site, False)


def grouped_softmax_step_cpu(q, k, logit_scale, query_groups, key_groups, symmetric, algorithm, threads, grads):
    value, dq, dk, dlogs, _, max_logit, site = _host.step(q, k, scale_value(logit_scale), 0.0, None,
                                                          _OBJECTIVES[symmetric], algorithm, threads, grads,
                                                          query_groups=query_groups, key_groups=key_groups)
    return _outputs(q, k, value, dq, dk, dlogs, None, max_logit, site, False)


def grouped_sigmoid_step_cpu(q, k, logit_scale, logit_bias, query_groups, key_groups, algorithm, threads, grads):
    value, dq, dk, dlogs, dbias, max_logit, site = _host.step(q, k, scale_value(logit_scale), bias_value(logit_bias),
                                                              None, "sigmoid", algorithm, threads, grads,
                                                              query_groups=query_groups, key_groups=key_groups)
    return _outputs(q, k, value, dq, dk, dlogs, dbias, max_logit, site, True)


def grouped_softmax_step_cuda(q, k, logit_scale, query_groups, key_groups, symmetric, algorithm, threads, grads):
    # The device step takes one positive per row: group ids run as a PyTorch composition (_grouped), whatever the
    # algorithm asked for.
    out = _grouped.step(q, k, logit_scale, None, query_groups, key_groups, _OBJECTIVES[symmetric], grads)
    return _device_outputs(q, k, out, grads, False)


def grouped_sigmoid_step_cuda(q, k, logit_scale, logit_bias, query_groups, key_groups, algorithm, threads, grads):
    out = _grouped.step(q, k, logit_scale, logit_bias, query_groups, key_groups, "sigmoid", grads)
    return _device_outputs(q, k, out, grads, True)


def softmax_step_cuda(q, k, logit_scale, labels, symmetric, algorithm, threads, fused_tiles, grads):
    out = _device.step(q, k, logit_scale, None, labels, _OBJECTIVES[symmetric], algorithm, fused_tiles)
    return _device_outputs(q, k, out, grads, False)


def sigmoid_step_cpu(q, k, logit_scale, logit_bias, algorithm, threads, grads):
    value, dq, dk, dlogs, dbias, max_logit, site = _host.step(q, k, scale_value(logit_scale), bias_value(logit_bias),
                                                              None, "sigmoid", algorithm, threads, grads)
    return _outputs(q, k, value, dq, dk, dlogs, dbias, max_logit, site, True)


def sigmoid_step_cuda(q, k, logit_scale, logit_bias, algorithm, threads, grads):
    out = _device.step(q, k, logit_scale, logit_bias, None, "sigmoid", "chunked", False)
    return _device_outputs(q, k, out, grads, True)


def _scaled(grad, dq, dk, reuse=False):
    """dq and dk times the incoming gradient (a 0-dim float32 tensor): one rounding to their dtype (16-bit products
    are formed in float). `reuse` (an autograd formula, not an operator, whose outputs must not alias its inputs): an
    eager CPU backward with g = 1 returns the saved gradients themselves (no copy: autograd's accumulation copies a
    gradient that a saved variable still holds), which a traced formula cannot check."""
    if reuse and type(grad) is torch.Tensor and grad.device.type == "cpu" and not torch.compiler.is_compiling():
        if float(grad) == 1.0:
            return dq, dk
    return dq * grad, dk * grad


def _feature_grads_with(rerun, grad, dq, dk, q, k, logit_scale, logit_bias, labels, symmetric):
    """feature_grads' kernels: the saved gradients times g, or (float16, g != 1) `rerun(g, objective)`'s dq and dk."""
    g = rerun_scale(dq.dtype, grad)
    if g is None:
        return _scaled(grad, dq, dk)
    if q is None or k is None:
        raise RuntimeError("feature_grads: float16 gradients under a loss scale need q and k to rerun the step")
    out = rerun(g, "sigmoid" if logit_bias is not None else _OBJECTIVES[symmetric])
    return out[1], out[2]


def feature_grads_cpu(grad, dq, dk, q, k, logit_scale, logit_bias, labels, symmetric, algorithm, threads,
                      fused_tiles, query_groups=None, key_groups=None):
    return _feature_grads_with(
        lambda g, objective: _host.step(q, k, scale_value(logit_scale), bias_value(logit_bias), labels_int32(labels),
                                        objective, algorithm, threads, True, g,
                                        **({} if query_groups is None else
                                           {"query_groups": query_groups, "key_groups": key_groups})),
        grad, dq, dk, q, k, logit_scale, logit_bias, labels, symmetric)


def feature_grads_cuda(grad, dq, dk, q, k, logit_scale, logit_bias, labels, symmetric, algorithm, threads,
                       fused_tiles, query_groups=None, key_groups=None):
    # The forward checked the values: the rerun converts the labels only (no second read, no synchronisation).
    if query_groups is not None:
        return _feature_grads_with(
            lambda g, objective: _grouped.step(q, k, logit_scale, logit_bias, query_groups, key_groups, objective,
                                               True, g),
            grad, dq, dk, q, k, logit_scale, logit_bias, labels, symmetric)
    return _feature_grads_with(
        lambda g, objective: _device.step(q, k, logit_scale, logit_bias, labels, objective,
                                          "chunked" if objective == "sigmoid" else algorithm, fused_tiles, g,
                                          checked=True),
        grad, dq, dk, q, k, logit_scale, logit_bias, labels, symmetric)


# --- autograd ----------------------------------------------------------------------------------------------------


def _feature_grads(grad, dq, dk, *args):
    """The features' gradients for the incoming gradient: float16 goes through contrastive_torch::feature_grads
    (which reads g and may rerun the step; named here so that the tests can route the formulas to the CUDA kernel with
    a stand-in extension on the CPU); bfloat16 and float32 are multiplied right here (no value read: a traced formula
    keeps them in its graph)."""
    if dq.dtype != torch.float16:
        return _scaled(grad, dq, dk, reuse=True)
    return torch.ops.contrastive_torch.feature_grads(grad, dq, dk, *args)


def _param_grad(value, param):
    """A float64 0-dim gradient in the device, dtype and shape of `param`."""
    value = value.to(device=param.device, dtype=param.dtype)
    return value if value.shape == param.shape else value.reshape(param.shape)


def _rerun_inputs(q, k, *positives):
    """What a step saves for feature_grads' rerun: the features and what gives the positives (labels, or the two group
    ids) when float16, else nothing (so that bfloat16 and float32 inputs are not checked for in-place changes by the
    backward, and ids made under torch.inference_mode() are accepted; features that want gradients are referenced,
    not saved, by _anchor_features). float16 keeps its own
    copy of the labels or ids (n integers): the rerun uses the forward's positives, as the other dtypes' backward
    does, whatever the caller does to its tensor in between (an in-place edit made autograd's version check raise),
    and ids made under torch.inference_mode(), which autograd cannot save, are taken."""
    if q.dtype != torch.float16:
        return (None,) * (2 + len(positives))
    return (q, k, *(p.clone() if isinstance(p, torch.Tensor) else p for p in positives))


def _no_grads(ctx):
    if not ctx.grads:
        raise RuntimeError("contrastive_torch: the step ran with grads=False (no input required a gradient when it "
                           "ran, or it ran under torch.vmap, whose batched forward computes no gradients: "
                           "differentiate a loss called outside vmap), so it has no gradients to give")


def _anchor_features(ctx, q, k):
    """The features, kept (as references, not saved tensors: no version check) as anchors of not_twice, so that a
    second derivative towards them or anything upstream (a gradient penalty on the towers' weights, a Hessian in the
    features) passes through the refusing node instead of finding no path and silently dropping the loss's part."""
    ctx.anchors = tuple(x for x in (q, k) if isinstance(x, torch.Tensor) and x.requires_grad)


def _only_the_loss(ctx, output):
    """The loss is the steps' one differentiable output: the saved gradients and the diagnosis are not, and autograd
    does not make zero gradients for them (16 MiB at N = 4096, D = 512 in float32, a peak the backward needs not)."""
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _softmax_setup_context(ctx, inputs, output):
    q, k, logit_scale, labels, symmetric, algorithm, threads, fused_tiles, grads = inputs
    _anchor_features(ctx, q, k)
    _loss, dq, dk, dlogs, _max_logit, _site = output
    _only_the_loss(ctx, output)
    ctx.grads = grads
    ctx.save_for_backward(*_rerun_inputs(q, k, labels), dq, dk, dlogs, logit_scale)
    ctx.call = (symmetric, algorithm, threads, fused_tiles)


def _softmax_backward(ctx, grad, *_unused):
    _no_grads(ctx)
    q, k, labels, dq, dk, dlogs, logit_scale = ctx.saved_tensors
    d_scale = gq = gk = None
    if ctx.needs_input_grad[2]:  # d loss / d s = (d loss / d log s) / s
        d_scale = _param_grad(dlogs * grad / logit_scale, logit_scale)
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
        gq, gk = _feature_grads(grad, dq, dk, q, k, logit_scale, None, labels, *ctx.call)
    return gq, gk, d_scale, None, None, None, None, None, None


def _sigmoid_setup_context(ctx, inputs, output):
    q, k, logit_scale, logit_bias, algorithm, threads, grads = inputs
    _anchor_features(ctx, q, k)
    _loss, dq, dk, dlogs, dbias, _max_logit, _site = output
    _only_the_loss(ctx, output)
    ctx.grads = grads
    ctx.save_for_backward(*_rerun_inputs(q, k), dq, dk, dlogs, dbias, logit_scale, logit_bias)
    ctx.call = (True, algorithm, threads, False)


def _sigmoid_backward(ctx, grad, *_unused):
    _no_grads(ctx)
    q, k, dq, dk, dlogs, dbias, logit_scale, logit_bias = ctx.saved_tensors
    d_scale = d_bias = gq = gk = None
    if ctx.needs_input_grad[2]:
        d_scale = _param_grad(dlogs * grad / logit_scale, logit_scale)
    if ctx.needs_input_grad[3]:
        d_bias = _param_grad(dbias * grad, logit_bias)
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
        gq, gk = _feature_grads(grad, dq, dk, q, k, logit_scale, logit_bias, None, *ctx.call)
    return gq, gk, d_scale, d_bias, None, None, None


def _grouped_softmax_setup_context(ctx, inputs, output):
    q, k, logit_scale, query_groups, key_groups, symmetric, algorithm, threads, grads = inputs
    _anchor_features(ctx, q, k)
    _only_the_loss(ctx, output)
    ctx.grads = grads
    ctx.save_for_backward(*_rerun_inputs(q, k, query_groups, key_groups), *output[1:4], logit_scale)
    ctx.call = (symmetric, algorithm, threads, False)


def _grouped_softmax_backward(ctx, grad, *_unused):
    _no_grads(ctx)
    q, k, query_groups, key_groups, dq, dk, dlogs, logit_scale = ctx.saved_tensors
    d_scale = gq = gk = None
    if ctx.needs_input_grad[2]:
        d_scale = _param_grad(dlogs * grad / logit_scale, logit_scale)
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
        gq, gk = _feature_grads(grad, dq, dk, q, k, logit_scale, None, None, *ctx.call, query_groups, key_groups)
    return gq, gk, d_scale, None, None, None, None, None, None


def _grouped_sigmoid_setup_context(ctx, inputs, output):
    q, k, logit_scale, logit_bias, query_groups, key_groups, algorithm, threads, grads = inputs
    _anchor_features(ctx, q, k)
    _only_the_loss(ctx, output)
    ctx.grads = grads
    ctx.save_for_backward(*_rerun_inputs(q, k, query_groups, key_groups), *output[1:5], logit_scale, logit_bias)
    ctx.call = (True, algorithm, threads, False)


def _grouped_sigmoid_backward(ctx, grad, *_unused):
    _no_grads(ctx)
    q, k, query_groups, key_groups, dq, dk, dlogs, dbias, logit_scale, logit_bias = ctx.saved_tensors
    d_scale = d_bias = gq = gk = None
    if ctx.needs_input_grad[2]:
        d_scale = _param_grad(dlogs * grad / logit_scale, logit_scale)
    if ctx.needs_input_grad[3]:
        d_bias = _param_grad(dbias * grad, logit_bias)
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
        gq, gk = _feature_grads(grad, dq, dk, q, k, logit_scale, logit_bias, None, *ctx.call, query_groups,
                                key_groups)
    return gq, gk, d_scale, d_bias, None, None, None, None, None


def _fake_step(q, k, grads, sigmoid):
    scalar = q.new_empty((), dtype=torch.float32)
    dq = torch.empty_like(q) if grads else q.new_empty((0, q.shape[1]))
    dk = torch.empty_like(k) if grads else k.new_empty((0, k.shape[1]))
    wide = q.new_empty((), dtype=torch.float64)
    extra = (torch.empty_like(wide),) if sigmoid else ()
    return (scalar, dq, dk, wide) + extra + (torch.empty_like(scalar), q.new_empty((), dtype=torch.int32))


class Operator(NamedTuple):
    """One operator of the table below: everything its registration needs. Adding an objective's operator is one
    row: its schema, its CPU and CUDA kernels (module-level functions, looked up by name at each call so that the
    tests can route them), its fake (shapes for torch.compile), its autograd formula and whether torch.autocast casts
    its float32 features."""

    name: str  # contrastive_torch::<name>
    schema: str  # the operator's signature, without its name
    cpu: str  # the CPU kernel's name in this module
    cuda: str  # the CUDA kernel's name in this module
    fake: Callable
    backward: Optional[Callable] = None  # the autograd formula, with setup_context; None: not differentiable
    setup_context: Optional[Callable] = None
    autocast: bool = False  # an AutocastCPU/AutocastCUDA rule that casts q and k (the first two arguments)


_STEP_OUTPUTS = "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
_SIGMOID_OUTPUTS = "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
OPERATORS = (
    Operator("softmax_step",
             "(Tensor q, Tensor k, Tensor logit_scale, Tensor? labels, bool symmetric, str algorithm, SymInt threads, "
             "bool fused_tiles, bool grads) -> " + _STEP_OUTPUTS,
             "softmax_step_cpu", "softmax_step_cuda",
             lambda q, k, s, labels, sym, alg, threads, tiles, grads: _fake_step(q, k, grads, False),
             _softmax_backward, _softmax_setup_context, autocast=True),
    Operator("sigmoid_step",
             "(Tensor q, Tensor k, Tensor logit_scale, Tensor logit_bias, str algorithm, SymInt threads, bool grads) -> "
             + _SIGMOID_OUTPUTS,
             "sigmoid_step_cpu", "sigmoid_step_cuda",
             lambda q, k, s, b, alg, threads, grads: _fake_step(q, k, grads, True),
             _sigmoid_backward, _sigmoid_setup_context, autocast=True),
    # Several positives per row: group ids in place of labels.
    Operator("grouped_softmax_step",
             "(Tensor q, Tensor k, Tensor logit_scale, Tensor query_groups, Tensor key_groups, bool symmetric, "
             "str algorithm, SymInt threads, bool grads) -> " + _STEP_OUTPUTS,
             "grouped_softmax_step_cpu", "grouped_softmax_step_cuda",
             lambda q, k, s, qg, kg, sym, alg, threads, grads: _fake_step(q, k, grads, False),
             _grouped_softmax_backward, _grouped_softmax_setup_context, autocast=True),
    Operator("grouped_sigmoid_step",
             "(Tensor q, Tensor k, Tensor logit_scale, Tensor logit_bias, Tensor query_groups, Tensor key_groups, "
             "str algorithm, SymInt threads, bool grads) -> " + _SIGMOID_OUTPUTS,
             "grouped_sigmoid_step_cpu", "grouped_sigmoid_step_cuda",
             lambda q, k, s, b, qg, kg, alg, threads, grads: _fake_step(q, k, grads, True),
             _grouped_sigmoid_backward, _grouped_sigmoid_setup_context, autocast=True),
    # The float16 backward (reads the incoming gradient, may rerun the step): runs on what the forward's step saved,
    # so it has no autocast rule.
    Operator("feature_grads",
             "(Tensor grad, Tensor dq, Tensor dk, Tensor? q, Tensor? k, Tensor logit_scale, Tensor? logit_bias, "
             "Tensor? labels, bool symmetric, str algorithm, SymInt threads, bool fused_tiles, "
             "Tensor? query_groups=None, Tensor? key_groups=None) -> (Tensor, Tensor)",
             "feature_grads_cpu", "feature_grads_cuda",
             lambda grad, dq, dk, *rest: (torch.empty_like(dq), torch.empty_like(dk))),
)


class _NotTwice(torch.autograd.Function):
    """Gradients that must not be differentiated again: copies of them whose backward refuses, made when a backward
    runs with create_graph=True. The anchors (the step's saved inputs that require grad, and a fresh leaf that does)
    give the copies a grad_fn that reaches them even where the gradients hang off no graph (float32 and bfloat16
    return the step's saved gradients), so that a second derivative through them raises instead of being dropped."""

    @staticmethod
    def forward(ctx, name, count, *tensors):
        ctx.name = name
        return tuple(g.clone() for g in tensors[:count])

    @staticmethod
    def backward(ctx, *_grads):
        raise RuntimeError(
            f"contrastive_torch: {ctx.name}: the loss is differentiable once: its gradients (taken with "
            "create_graph=True) were differentiated again, as a gradient penalty or a second derivative does; "
            "the step computes them in one engine call, without a graph of their own. Differentiate PyTorch's own "
            "loss where second derivatives are needed")


def _differentiable_once(name, backward):
    """The autograd formula `backward`, and under create_graph=True (grad mode on in the backward) the same gradients
    without a graph, behind _NotTwice: a second derivative through the loss raises, naming the operator, where it
    would otherwise be wrong (the formulas multiply saved gradients, whose own dependence on the inputs is not in any
    graph). Traced backwards (torch.compile) run without grad mode and are unchanged."""

    def formula(ctx, *grads_in):
        if not torch.is_grad_enabled():
            return backward(ctx, *grads_in)
        with torch.no_grad():
            out = backward(ctx, *grads_in)
        return not_twice(name, out, ctx.saved_tensors + getattr(ctx, "anchors", ()))

    formula.__name__ = backward.__name__
    return formula


def not_twice(name, grads, anchors):
    """A backward's results `grads` (tensors or None) behind _NotTwice when grad mode is on (create_graph=True);
    `anchors`: the inputs the step saved (those that require grad are kept as the copies' inputs)."""
    if not torch.is_grad_enabled():
        return grads
    where = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
    if not where:
        return grads
    held = [t for t in anchors if isinstance(t, torch.Tensor) and t.requires_grad]
    held.append(torch.zeros((), requires_grad=True))
    with torch.enable_grad():
        copies = _NotTwice.apply(name, len(where), *(grads[i].detach() for i in where), *held)
    out = list(grads)
    for i, c in zip(where, copies):
        out[i] = c
    return tuple(out)


def _late(kernel_name):
    """The module-level kernel `kernel_name`, looked up at each call."""

    def call(*args):
        return globals()[kernel_name](*args)

    call.__name__ = kernel_name
    return call


def _register(op):
    """Registers one row of OPERATORS: the operator with its CPU kernel, its CUDA kernel, its fake, its autograd
    formula and its autocast rules. Returns the operator."""
    # The CUDA kernels of 'fused' and 'materialized', and float16's backward, read values on the host (one
    # synchronisation), which CUDA graph capture cannot hold: tagged so that torch.compile's cudagraphs leave these
    # operators out of a captured graph.
    tags = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
    custom = torch.library.custom_op("contrastive_torch::" + op.name, _late(op.cpu), mutates_args=(),
                                     schema=op.schema, tags=tags)
    custom.register_kernel("cuda")(_late(op.cuda))
    custom.register_fake(op.fake)
    if op.backward is not None:
        custom.register_autograd(_differentiable_once(op.name, op.backward), setup_context=op.setup_context)
    return custom


if HAS_CUSTOM_OPS:
    _REGISTERED = {op.name: _register(op) for op in OPERATORS}
    softmax_step = _REGISTERED["softmax_step"]
    sigmoid_step = _REGISTERED["sigmoid_step"]
    grouped_softmax_step = _REGISTERED["grouped_softmax_step"]
    grouped_sigmoid_step = _REGISTERED["grouped_sigmoid_step"]
    feature_grads = _REGISTERED["feature_grads"]

    # The steps' autocast rules.
    _LIB = torch.library.Library("contrastive_torch", "FRAGMENT")
    for _op in OPERATORS:
        if _op.autocast:
            for _device_type in ("cpu", "cuda"):
                _register_autocast(_op.name, _device_type)
