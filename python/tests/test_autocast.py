# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""torch.autocast and the losses: contrastive_torch::softmax_step and sigmoid_step have an autocast rule on CPU and
CUDA (_ops._register_autocast), so float32 features inside an autocast region run at its dtype, as torch.matmul's
would, with logit_scale and logit_bias kept float32. Checked on the CPU: every loss, module and algorithm under
torch.autocast("cpu") with float32 features equals the same loss on features cast to the autocast dtype beforehand, bit
for bit (the rule is that cast; its backward casts the gradients up, exactly); nothing changes outside autocast or for
16-bit features; the scalars keep their float32 values; torch.compile traces the rule; the CUDA rule is dispatched for
(fake) CUDA tensors and runs the CUDA kernel (with the stand-in extension of cuda_standin.py) on the cast features."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import contrastive_torch as ct
import contrastive_torch.functional as CF
from conftest import require

pytestmark = pytest.mark.usefixtures("needs_custom_ops")

ALGORITHMS = (None, "fused", "materialized", "chunked")
# Values that 16-bit types round (bfloat16 keeps 8 bits: 14.3 -> 14.3125, -7.3 -> -7.3125): a rule that cast the
# scalars would change the loss.
SCALE, BIAS = 14.3, -7.3


def unit(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g), dim=1)


def losses():
    """(name, loss(q, k, s, b, algorithm)) for every function and module; b is SigLIP's bias (unused otherwise)."""
    labels = torch.randint(0, 40, (32,), generator=torch.Generator().manual_seed(7))
    return [
        ("clip_loss", lambda q, k, s, b, a: CF.clip_loss(q, k[:32], s, algorithm=a)),
        ("info_nce_loss", lambda q, k, s, b, a: CF.info_nce_loss(q, k, s, labels, algorithm=a)),
        ("siglip_loss", lambda q, k, s, b, a: CF.siglip_loss(q, k, s, b, algorithm=a)),
        ("ClipLoss", lambda q, k, s, b, a: ct.ClipLoss(algorithm=a)(q, k[:32], s)),
        ("SigLipLoss", lambda q, k, s, b, a: ct.SigLipLoss(algorithm=a)(q, k, s, b)),
        ("InfoNCELoss", lambda q, k, s, b, a: ct.InfoNCELoss(algorithm=a)(q, k, s, labels)),
    ]


def run(fn, q, k, context, grad=1.0):
    """(loss, dq, dk, d logit_scale, d logit_bias) of fn(q, k, s, b) inside `context`, with fresh leaves; the backward
    at the incoming gradient `grad` (a GradScaler's scale), outside the context as in training."""
    q, k = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    s = torch.tensor(SCALE, requires_grad=True)
    b = torch.tensor(BIAS, requires_grad=True)
    with context:
        loss = fn(q, k, s, b)
    (loss * grad).backward()
    return [loss.detach(), q.grad, k.grad, s.grad, b.grad]


def autocast(dtype):
    return torch.autocast("cpu", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_float32_features_run_at_the_autocast_dtype(algorithm, dtype):
    q, k = unit(32, 24, 1), unit(40, 24, 2)
    for name, fn in losses():
        call = (lambda q, k, s, b: fn(q, k, s, b, algorithm))
        # float16 under a GradScaler's scale: the backward reruns the step at it on the saved (cast) features.
        for grad in (1.0, 1024.0) if dtype == torch.float16 else (1.0,):
            where = f"{name}, algorithm {algorithm}, {dtype}, incoming gradient {grad}"
            got = run(call, q, k, autocast(dtype), grad)
            # The features cast beforehand, in the same region (the modules' loss has open_clip's dtype there).
            want = run(call, q.to(dtype), k.to(dtype), autocast(dtype), grad)
            plain = run(call, q, k, contextlib.nullcontext(), grad)
            assert got[0].dtype == torch.float32, where
            assert got[1].dtype == got[2].dtype == torch.float32, where  # the cast's backward: float32 gradients
            assert want[1].dtype == dtype, where
            for i, (a, w) in enumerate(zip(got, want)):
                if w is None:  # logit_bias outside SigLIP: no gradient in either run
                    assert a is None, where
                    continue
                if i == 0:  # the loss: float32 here; open_clip's dtype there (SigLipLoss: the 16-bit features')
                    a = a.to(w.dtype)
                assert a.dtype == w.dtype if i == 0 else a.dtype == torch.float32, where
                assert torch.equal(a, w.to(a.dtype)), f"{where}: output {i} differs from the run on {dtype} features"
            assert not torch.equal(got[0], plain[0]), f"{where}: the loss is float32's: nothing was cast"


def test_outside_autocast_float32_stays_float32():
    q, k, s = unit(16, 8, 3), unit(16, 8, 4), torch.tensor(SCALE)
    step = torch.ops.contrastive_torch.softmax_step
    sigmoid = torch.ops.contrastive_torch.sigmoid_step

    def dq_dtypes():
        return (step(q, k, s, None, True, "fused", 0, False, True)[1].dtype,
                sigmoid(q, k, s, torch.tensor(BIAS), "fused", 0, True)[1].dtype)

    assert dq_dtypes() == (torch.float32,) * 2
    with autocast(torch.bfloat16):
        assert dq_dtypes() == (torch.bfloat16,) * 2  # the operators themselves, called directly, have the rule
        with torch.autocast("cpu", enabled=False):
            assert dq_dtypes() == (torch.float32,) * 2
    # Another device type's autocast leaves CPU tensors alone (CUDA's state is set directly: this may have no GPU).
    with cuda_autocast(torch.float16):
        assert dq_dtypes() == (torch.float32,) * 2
    plain = run(lambda q, k, s, b: CF.clip_loss(q, k, s), q, k, contextlib.nullcontext())
    off = run(lambda q, k, s, b: CF.clip_loss(q, k, s), q, k, torch.autocast("cpu", enabled=False))
    assert all(torch.equal(a, b) for a, b in zip(plain[:4], off[:4]))
    assert plain[1].dtype == torch.float32


@pytest.mark.parametrize("features, region", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16),
                                              (torch.bfloat16, torch.bfloat16)])
def test_16bit_features_are_left_as_they_are(features, region):
    q, k = unit(32, 24, 5).to(features), unit(40, 24, 6).to(features)
    for name, fn in losses():
        call = (lambda q, k, s, b: fn(q, k, s, b, None))
        got = run(call, q, k, autocast(region))
        want = run(call, q, k, contextlib.nullcontext())
        assert got[1].dtype == got[2].dtype == features, name
        # The modules' loss is float32 under autocast and the features' dtype outside (open_clip's): compared in the
        # latter.
        got[0] = got[0].to(want[0].dtype)
        for i, (a, w) in enumerate(zip(got, want)):
            assert (a is None and w is None) or torch.equal(a, w), f"{name} in a {region} region: output {i}"


@pytest.mark.parametrize("features", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("region", [None, torch.bfloat16, torch.float16])
def test_the_modules_loss_dtype_is_open_clips(features, region):
    # open_clip's own ClipLoss and SigLipLoss on the same inputs give the dtype each module must return: ClipLoss
    # float32 inside autocast (cross-entropy runs in float32), SigLipLoss the promotion of the features' dtype and the
    # region's (its labels take the former, its log-sigmoid the latter).
    try:
        import open_clip.loss as oc
    except Exception as e:  # ImportError, or an open_clip that does not import on this torch
        require("open_clip", False, f"{type(e).__name__}: {e}")
    q, k = unit(32, 24, 5).to(features), unit(32, 24, 6).to(features)
    s, b = torch.tensor(SCALE), torch.tensor(BIAS)
    region_of = contextlib.nullcontext() if region is None else autocast(region)
    for ours, theirs, args in ((ct.ClipLoss(), oc.ClipLoss(), (s,)), (ct.SigLipLoss(), oc.SigLipLoss(), (s, b))):
        with region_of:
            got, want = ours(q, k, *args), theirs(q, k, *args)
        assert got.dtype == want.dtype, (type(ours).__name__, features, region, got.dtype, want.dtype)
        # The same loss, to the dtype's rounding (both round a float32-or-better value once at most).
        tol = 4 * torch.finfo(want.dtype).eps if want.dtype != torch.float32 else 1e-2
        assert abs(float(got) - float(want)) <= tol * abs(float(want)) + 1e-2, (type(ours).__name__, features, region)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.float16, torch.float32)], ids=["bf16-f32", "f32-bf16", "f16-f32"])
def test_features_of_two_dtypes_run_at_the_autocast_dtype(dtypes):
    """A bfloat16 tower beside a float32 one (a locked tower, a last op autocast keeps in float32): inside a bfloat16
    region both features run at bfloat16, as torch.matmul's operands do and open_clip's loss accepts them; bit for bit
    the loss on both cast beforehand, each gradient in its own features' dtype, the modules' loss of open_clip's dtype.
    Outside autocast two dtypes stay refused, naming the features."""
    q, k = unit(32, 24, 7).to(dtypes[0]), unit(40, 24, 8).to(dtypes[1])
    for name, fn in losses():
        call = (lambda q, k, s, b: fn(q, k, s, b, None))
        got = run(call, q, k, autocast(torch.bfloat16))
        want = run(call, q.to(torch.bfloat16), k.to(torch.bfloat16), autocast(torch.bfloat16))
        assert (got[1].dtype, got[2].dtype) == dtypes, name
        got[0] = got[0].to(want[0].dtype)
        for i, (a, w) in enumerate(zip(got, want)):
            assert (a is None and w is None) or torch.equal(a, w.to(a.dtype)), f"{name}, {dtypes}: output {i}"
        with pytest.raises(TypeError, match=r"features: dtypes differ"):
            call(q, k, torch.tensor(SCALE), torch.tensor(BIAS))
    try:
        import open_clip.loss as oc
    except Exception as e:  # ImportError, or an open_clip that does not import on this torch
        require("open_clip", False, f"{type(e).__name__}: {e}")
    s, b = torch.tensor(SCALE), torch.tensor(BIAS)
    for ours, theirs, args in ((ct.ClipLoss(), oc.ClipLoss(), (s,)), (ct.SigLipLoss(), oc.SigLipLoss(), (s, b))):
        with autocast(torch.bfloat16):
            got, want = ours(q, k[:32], *args), theirs(q, k[:32], *args)
        assert got.dtype == want.dtype, (type(ours).__name__, dtypes, got.dtype, want.dtype)


class OperatorCalls(TorchDispatchMode):
    """Records the dtypes of (q, k, logit_scale, and SigLIP's logit_bias) each loss operator receives: below the
    autocast keys, so after the rule."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "contrastive_torch" and func._opname in ("softmax_step", "sigmoid_step"):
            self.seen.append((func._opname, args[0].dtype, args[1].dtype, args[2].dtype,
                              args[3].dtype if func._opname == "sigmoid_step" else None))
        return func(*args, **(kwargs or {}))


def test_logit_scale_and_bias_stay_float32():
    q, k = unit(32, 24, 7), unit(40, 24, 8)
    siglip = (lambda q, k, s, b: CF.siglip_loss(q, k, s, b))
    clip = (lambda q, k, s, b: CF.clip_loss(q, k[:32], s))
    for fn in (clip, siglip):
        with OperatorCalls() as calls:
            got = run(fn, q, k, autocast(torch.bfloat16))
        assert calls.seen[0][1:3] == (torch.bfloat16, torch.bfloat16)
        assert calls.seen[0][3] == torch.float32 and calls.seen[0][4] in (None, torch.float32), calls.seen
        assert got[3].dtype == torch.float32 and (got[4] is None or got[4].dtype == torch.float32)
        # Scalars rounded to bfloat16 would give another loss: the rule's result is the float32 scalars'.
        kept = run(fn, q.bfloat16(), k.bfloat16(), contextlib.nullcontext())
        rounded = run(lambda q, k, s, b: fn(q, k, s.bfloat16().float(), b.bfloat16().float()), q.bfloat16(),
                      k.bfloat16(), contextlib.nullcontext())
        assert torch.equal(got[0], kept[0])
        assert not torch.equal(kept[0], rounded[0])


@pytest.mark.parametrize("where", ["around the compiled call", "inside the compiled function"])
def test_torch_compile_traces_the_rule(where):
    require("compile", hasattr(torch, "compile"), "no torch.compile")
    torch._dynamo.reset()
    q, k = unit(32, 24, 9), unit(40, 24, 10)
    siglip = ct.SigLipLoss()

    def clip(q, k, s, b):
        return CF.clip_loss(q, k[:32], s) + siglip(q, k, s, b)

    if where == "around the compiled call":
        compiled, region = torch.compile(clip, fullgraph=True), autocast(torch.bfloat16)
    else:
        def inside(q, k, s, b):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return clip(q, k, s, b)

        compiled, region = torch.compile(inside, fullgraph=True), contextlib.nullcontext()
    got = run(compiled, q, k, region)
    # Eager in the same region (each loss there equals its run on features cast beforehand: the test above; the
    # features' two gradients are summed in float32 after the casts, as here).
    want = run(clip, q, k, autocast(torch.bfloat16))
    for i, (a, w) in enumerate(zip(got, want)):
        assert a.dtype == torch.float32, i
        assert torch.equal(a, w), f"output {i}: the compiled call differs from eager autocast"
    # (The functional SigLIP: the module returns bfloat16 features' loss as bfloat16, open_clip's dtype, and float32
    # features' as float32.)
    cast = run(lambda q, k, s, b: CF.clip_loss(q, k[:32], s) + CF.siglip_loss(q, k, s, b), q.bfloat16(), k.bfloat16(),
               autocast(torch.bfloat16))
    assert torch.equal(got[0], cast[0]), "the compiled loss is not the one on features cast to bfloat16"
    # The same compiled function without autocast (a recompilation: dynamo guards on the autocast state) is float32.
    plain = run(clip, q, k, contextlib.nullcontext())
    if where == "around the compiled call":
        again = run(compiled, q, k, contextlib.nullcontext())
        assert all(torch.equal(a, b) for a, b in zip(again, plain))
    assert not torch.equal(got[0], plain[0])


# --- the CUDA rule, without a GPU -----------------------------------------------------------------------------------


@contextlib.contextmanager
def cuda_autocast(dtype):
    """CUDA's autocast state on, at `dtype`, set directly (torch.autocast("cuda") turns itself off without a GPU)."""
    enabled, before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", before)


def test_the_cuda_rule_is_dispatched_for_cuda_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name in ("softmax_step", "sigmoid_step"):
        for key in ("AutocastCPU", "AutocastCUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"contrastive_torch::{name}", key), (name, key)
    softmax, sigmoid = torch.ops.contrastive_torch.softmax_step, torch.ops.contrastive_torch.sigmoid_step

    def both(q, k, s, b):
        return softmax(q, k, s, None, False, "chunked", 0, False, True), sigmoid(q, k, s, b, "chunked", 0, True)

    for on in (True, False):
        with FakeTensorMode(), contextlib.ExitStack() as stack:
            if on:
                stack.enter_context(cuda_autocast(torch.float16))
            calls = stack.enter_context(OperatorCalls())
            q, k = torch.empty(8, 4, device="cuda"), torch.empty(12, 4, device="cuda")
            s, b = torch.empty((), device="cuda"), torch.empty((), device="cuda")
            outs = both(q, k, s, b)
            cpu = both(torch.empty(8, 4), torch.empty(12, 4), torch.empty(()), torch.empty(()))
        want = torch.float16 if on else torch.float32
        assert [out[1].dtype for out in outs] == [want, want]
        assert calls.seen[:2] == [("softmax_step", want, want, torch.float32, None),
                                  ("sigmoid_step", want, want, torch.float32, torch.float32)]
        # CUDA's autocast casts CUDA tensors only.
        assert [out[1].dtype for out in cpu] == [torch.float32, torch.float32]


def value_of(described):
    """A scalar argument the stand-in recorded: a number, or a one-element tensor (described by dtype and values)."""
    if isinstance(described, tuple):
        assert described[0] == "tensor" and len(described[3]) == 1, described
        return described[3][0]
    return described


def test_the_cuda_rule_runs_the_cuda_kernel_on_the_cast_features(monkeypatch):
    # The CUDA rule (as registered) called on CPU tensors under CUDA's autocast state, with the operators' CPU kernels
    # routed to their CUDA kernels and the CUDA extension replaced by the stand-in: the device step receives float16
    # features and the float32 scalars' values, and the gradients come back float32 (the stand-in's float16 values).
    from contrastive_torch import _device, _ops
    from cuda_standin import StandIn

    ext = StandIn(3.0e-3)
    monkeypatch.setattr(_device, "cuda_extension", lambda: ext)
    monkeypatch.setattr(_ops, "softmax_step_cpu", _ops.softmax_step_cuda)
    monkeypatch.setattr(_ops, "sigmoid_step_cpu", _ops.sigmoid_step_cuda)
    softmax_rule = _ops.AUTOCAST_RULES[("softmax_step", "cuda")]
    sigmoid_rule = _ops.AUTOCAST_RULES[("sigmoid_step", "cuda")]
    for on in (True, False):
        dtype = torch.float16 if on else torch.float32
        for name, rule, rest in (("softmax", softmax_rule, (None, True, "chunked", 0, False, True)),
                                 ("sigmoid", sigmoid_rule, ("chunked", 0, True))):
            ext.clear()
            q, k = unit(8, 4, 11).requires_grad_(), unit(8, 4, 12).requires_grad_()
            s = torch.tensor(SCALE, requires_grad=True)
            args = (q, k, s) + ((torch.tensor(BIAS),) if name == "sigmoid" else ()) + rest
            with cuda_autocast(torch.float16) if on else contextlib.nullcontext():
                loss = rule(*args)[0]
            loss.backward()
            seen = ext.args[0]
            assert (seen[0][1], seen[1][1]) == (dtype, dtype), (name, on)
            # float32's 14.3 (float16's is 14.296875), as a number or a device tensor (the sync-free step's).
            assert value_of(seen[3]) == float(torch.tensor(SCALE)), (name, seen[3])
            if name == "sigmoid":
                assert value_of(seen[4]) == float(torch.tensor(BIAS)), (name, seen[4])
            assert q.grad.dtype == k.grad.dtype == torch.float32
            assert torch.equal(q.grad, torch.full(q.shape, 3.0e-3).to(dtype).float()), (name, on)
            assert torch.equal(k.grad, -q.grad)


def test_a_feature_past_the_autocast_dtype_is_named_as_passed():
    # A float32 feature that is finite (1e5, -7e4) but past float16's 65504 becomes inf when a float16 region casts it:
    # the refusal names the value the caller passed and the cast, not "not finite"; a feature that is not finite as
    # passed keeps the library's message, and bfloat16 (float32's range) runs it.
    q, k = unit(8, 4, 21), unit(8, 4, 22)
    q[2, 3], k[5, 1] = 1e5, -7e4
    calls = (("image_features[2][3] = 100000", lambda: CF.clip_loss(q, k, SCALE)),
             ("image_features[2][3] = 100000", lambda: CF.siglip_loss(q, k, SCALE, BIAS)),
             ("query[2][3] = 100000", lambda: CF.info_nce_loss(q, k, SCALE)),
             ("text_features[5][1] = -70000", lambda: CF.clip_loss(unit(8, 4, 23), k, SCALE)))
    for said, call in calls:
        with autocast(torch.float16), pytest.raises(ValueError) as refused:
            call()
        assert said in str(refused.value) and "overflows float16 (largest finite 65504)" in str(refused.value)
        assert "[non_finite_input]" in str(refused.value)
    q[2, 3] = float("inf")
    with autocast(torch.float16), pytest.raises(ValueError, match=r"image_features\[2\]\[3\] is not finite"):
        CF.clip_loss(q, k, SCALE)
    q[2, 3] = 1e5
    with autocast(torch.bfloat16):
        assert torch.isfinite(CF.clip_loss(q, k, SCALE))
