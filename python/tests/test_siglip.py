# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""SigLipLoss (the library's sigmoid objective) against open_clip's own SigLipLoss (open-clip-torch's loss.py, not a
re-implementation): one process for every dtype and algorithm, and 2 and 4 processes over gloo (one spawn per world
size) against one process on the concatenated batch and against open_clip's distributed SigLipLoss; errors.

open_clip runs in float64 on the same (dtype-rounded) values: the exact answer. Differences are normwise relative
(max |a - b| / max |b|), bounded by multiples of the type's eps: 256 for float32, 8 for the 16-bit types (the issue's
targets). d logit_bias = sum_ij dL/dz_ij and d logit_scale = sum_ij dL/dz_ij S_ij are sums whose terms cancel (the
positives' pull against the negatives'), so their bounds are relative to the sums of the terms' magnitudes
(`_conditions`): the materialized algorithm sums the element-type dS = round_T(dL/dz) as a framework's autocast does,
and a sum of rounded terms is accurate to the terms' size, not to the sum's. (In a 12-row batch d logit_scale can
cancel 65-fold: bfloat16 materialized was then 14.6 eps from float64, 0.22 eps of the terms' size; over 200 seeds
at most 0.36.)"""

import gc
import itertools
import json
import math
import os
import traceback

import pytest
import torch
import torch.nn.functional as F

import contrastive_torch as ct
import contrastive_torch.functional as CF
from conftest import require
from test_distributed import (PG_TIMEOUT_S, WORLDS, _draw, _open_clip_loss_module, _rel, checker, run_ranks,
                              start_gloo)

ALGORITHMS = ("fused", "materialized", "chunked")
BOUND_EPS = {torch.float32: 256, torch.bfloat16: 8, torch.float16: 8}
# The distributed exchanges: the library's engine, and torch's autograd all-gather with the one-process step (CUDA's).
EXCHANGES = ("engine", "gather")
NAMES = ("loss", "d image_features", "d text_features", "d logit_scale", "d logit_bias")


def _conditions(img, txt, t, b):
    """How much the sums of d logit_scale = sum_ij dL/dz_ij S_ij and d logit_bias = sum_ij dL/dz_ij cancel:
    sum |term| / |sum| of each (float64; >= 1)."""
    S = img.double() @ txt.double().T
    z = t * S + b
    labels = -torch.ones_like(z)
    labels[torch.arange(z.shape[0]), torch.arange(z.shape[0])] = 1.0
    g = -labels * torch.sigmoid(-labels * z) / z.shape[0]
    return tuple(float(x.abs().sum() / x.sum().abs().clamp_min(1e-300)) for x in (g * S, g))


def _bounds(dtype, img, txt, t, b):
    """The bound of each of NAMES for `dtype` (see the file comment)."""
    tol = BOUND_EPS[dtype] * torch.finfo(dtype).eps
    scale_condition, bias_condition = _conditions(img, txt, t, b)
    return (tol, tol, tol, tol * max(1.0, scale_condition), tol * max(1.0, bias_condition))


def _step(fn, img, txt, scale, bias, grad_factor=1.0, dtype=None):
    """loss and the gradients of img, txt, logit_scale and logit_bias for fn(img, txt, t, b) (leaves made here; img
    and txt in `dtype` when given)."""
    img = img.detach().clone().to(dtype or img.dtype).requires_grad_()
    txt = txt.detach().clone().to(dtype or txt.dtype).requires_grad_()
    t = torch.tensor(float(scale), dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                     requires_grad=True)
    b = torch.tensor(float(bias), dtype=t.dtype, requires_grad=True)
    loss = fn(img, txt, t, b)
    (loss * grad_factor).backward()
    return loss.detach(), img.grad, txt.grad, t.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_matches_open_clip(dtype, algorithm, seed):
    oc = _open_clip_loss_module()
    require("open_clip", oc is not None, "open-clip-torch is not installed")
    # SigLIP's initialisation (t = 10, b = -10) and a trained state (t = 30, b = -12).
    for n, d, t, b in ((48, 32, 10.0, -10.0), (37, 24, 30.0, -12.0)):
        img, txt = _draw(n, d, seed + n)
        I, T = img.to(dtype), txt.to(dtype)
        got = _step(ct.SigLipLoss(algorithm=algorithm, threads=2), I, T, t, b)
        want = _step(oc.SigLipLoss(), I, T, t, b, dtype=torch.float64)
        assert got[1].dtype == dtype and got[2].dtype == dtype
        eps = torch.finfo(dtype).eps
        for name, a, w, tol in zip(NAMES, got, want, _bounds(dtype, I, T, t, b)):
            err = _rel(a, w)
            assert err <= tol, f"{name}: {err / eps:.1f} eps from open_clip, bound {tol / eps:.1f} (n {n}, t {t}, b {b})"


def test_arguments_and_errors():
    img, txt = _draw(8, 16, 3)
    t, b = torch.tensor(10.0), torch.tensor(-10.0)
    fn = ct.SigLipLoss(threads=1)
    assert set(fn(img, txt, t, b, output_dict=True)) == {"contrastive_loss"}
    # No bias: z = t I T^T, as open_clip's get_logits with logit_bias=None.
    oc = _open_clip_loss_module()
    if oc is not None:
        want = oc.SigLipLoss()(img.double(), txt.double(), t.double(), None)
        assert abs(float(fn(img, txt, t, None)) - float(want)) <= 64 * torch.finfo(torch.float32).eps * float(want)
    for dist_impl in (None, "bidir", "shift", "reduce", "gather"):
        ct.SigLipLoss(dist_impl=dist_impl)
    with pytest.raises(ValueError, match="dist_impl"):
        ct.SigLipLoss(dist_impl="ring")
    with pytest.raises(ValueError, match="rank"):
        ct.SigLipLoss(rank=2, world_size=2)
    with pytest.raises(ValueError, match="logit_bias"):
        fn(img, txt, t, torch.tensor(float("nan")))
    with pytest.raises(ValueError, match="logit_bias"):
        fn(img, txt, t, torch.zeros(2))
    with pytest.raises(TypeError, match="logit_bias"):
        fn(img, txt, t, "b")
    with pytest.raises(ValueError, match="logit_scale"):
        fn(img, txt, torch.tensor(-1.0), b)
    with pytest.raises(ValueError, match="embedding"):
        fn(img, torch.randn(8, 15), t, b)
    with pytest.raises(ValueError):  # a non-finite feature: the library's refusal, naming the element
        bad = img.clone()
        bad[1, 2] = float("inf")
        fn(bad, txt, t, b)
    # Rectangular batches (more texts than images: a rank's extra negatives), the diagonal positives.
    more = F.normalize(torch.randn(12, 16), dim=1)
    if oc is not None:
        got = _step(fn, img, more, 10.0, -10.0)
        imgs = img.double().requires_grad_()
        z = 10.0 * imgs @ more.double().T - 10.0
        labels = -torch.ones_like(z)
        labels[torch.arange(8), torch.arange(8)] = 1.0
        want = -F.logsigmoid(labels * z).sum() / 8
        assert _rel(got[0], want) <= 64 * torch.finfo(torch.float32).eps


def _worker(rank, world, port, seed, out_dir):
    checks, failures, check = checker(rank)
    try:
        import torch.distributed as dist

        start_gloo(rank, world, port, PG_TIMEOUT_S)
        oc = _open_clip_loss_module()
        n, d, t, b = 6, 16, 10.0, -10.0
        img, txt = _draw(n * world, d, seed)
        mine = slice(rank * n, (rank + 1) * n)

        def mean_over_ranks(x):
            x = x.detach().double().clone()
            dist.all_reduce(x)
            return x / world

        for dtype in (torch.float32, torch.bfloat16):
            eps = torch.finfo(dtype).eps
            I, T = img.to(dtype), txt.to(dtype)
            bounds = _bounds(dtype, I, T, t, b)
            # open_clip's distributed SigLipLoss (its default 'bidir' exchange), float64 on the type's values.
            loss, di, dt, ds, db = _step(oc.SigLipLoss(rank=rank, world_size=world), I[mine], T[mine], t, b,
                                         dtype=torch.float64)
            theirs = (mean_over_ranks(loss), di, dt, mean_over_ranks(ds), mean_over_ranks(db))
            for algorithm, exchange in itertools.product(ALGORITHMS, EXCHANGES):
                where = f"{dtype} {algorithm} exchange={exchange}"
                ref = _step(ct.SigLipLoss(algorithm=algorithm, threads=1), I, T, t, b)
                got = _step(ct.SigLipLoss(rank=rank, world_size=world, algorithm=algorithm, threads=1,
                                          exchange=exchange), I[mine], T[mine], t, b)
                want = (ref[0], world * ref[1][mine], world * ref[2][mine], ref[3], ref[4])
                for name, a, w, tol in zip(NAMES, got, want, bounds):
                    err = _rel(a, w)
                    check(err <= tol, f"{where}: {name} {err / eps:.1f} eps from one process (seed {seed})")
                # The loss: the global one, the mean over ranks of open_clip's per-rank values; logit_scale and
                # logit_bias: d(global)/d on every rank, the mean (DDP's average) of open_clip's per-rank gradients.
                for name, a, w, tol in zip(NAMES, got, theirs, bounds):
                    err = _rel(a, w)
                    check(err <= tol, f"{where}: {name} {err / eps:.1f} eps from open_clip (seed {seed})")

        # A bad or differing logit_bias on one rank raises on every rank, naming it; then the ranks compute together.
        bad = world - 1
        ref = _step(ct.SigLipLoss(threads=1), img, txt, t, b)
        for exchange in EXCHANGES:
            fn = ct.SigLipLoss(rank=rank, world_size=world, threads=1, exchange=exchange)
            for what, bias in (("NaN logit_bias", float("nan")), ("another logit_bias", -9.0)):
                try:
                    _step(fn, img[mine], txt[mine], t, bias if rank == bad else b)
                    check(False, f"{what} on rank {bad} ({exchange}): nothing raised")
                except Exception as e:  # noqa: BLE001 - the type is checked
                    check(isinstance(e, ValueError) and f"rank {bad}" in str(e) and "logit_bias" in str(e),
                          f"{what} on rank {bad} ({exchange}): raised {type(e).__name__}: {e}")
            got = _step(fn, img[mine], txt[mine], t, b)
            check(_rel(got[1], world * ref[1][mine]) <= 256 * torch.finfo(torch.float32).eps,
                  f"after the refusals ({exchange}): d image_features differs")
        gc.collect()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the test
        failures.append(f"rank {rank}: {traceback.format_exc()}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"checks": checks[0], "failures": failures}, f)


@pytest.mark.parametrize("world", WORLDS)  # CONTRASTIVE_TORCH_DIST_WORLDS (test_distributed.py), default 2 and 4
def test_global_batch_over_gloo(world, seed, tmp_path):
    import torch.distributed as dist

    require("distributed", dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo")
    require("open_clip", _open_clip_loss_module() is not None, "open-clip-torch is not installed")
    reports = run_ranks(_worker, world, seed, tmp_path)
    failures = [f for got in reports for f in got["failures"]]
    checks = [got["checks"] for got in reports]
    assert not failures, "\n".join(failures[:20])
    # 2 exchanges x (2 dtypes x 3 algorithms x 2 x 5 values, 2 refusals and the check after them): every check ran on
    # every rank.
    assert checks == [2 * (2 * 3 * 10 + 3)] * world, f"checks per rank: {checks}"


# CUDA tensors: the device's chunked step, the CUDA kernel of contrastive_torch::sigmoid_step. Its backward logic is
# checked here on the CPU with a stand-in extension; running it needs a GPU (the tests after it skip without one).


def _cuda_chain(monkeypatch, inputs, grad):
    """An operator's CUDA kernel on CPU tensors (the extension is a stand-in), its setup_context and its autograd
    formula, whose feature_grads goes to the CUDA kernel too: the CUDA path of a backward, without a GPU. `inputs`:
    sigmoid_step's 7 or softmax_step's 9. Returns the gradients of q, k, the logit scale (and the bias)."""
    from contrastive_torch import _ops
    from cuda_standin import Ctx

    monkeypatch.setattr(_ops, "_feature_grads", _ops.feature_grads_cuda)
    sigmoid = len(inputs) == 7
    q, k = inputs[:2]
    ctx = Ctx((q.requires_grad, k.requires_grad) + tuple(isinstance(x, torch.Tensor) and x.requires_grad
                                                         for x in inputs[2:]))
    with torch.no_grad():  # as the operator and autograd's backward run
        plain = [x.detach() if isinstance(x, torch.Tensor) else x for x in inputs]
        kernel, setup, formula = ((_ops.sigmoid_step_cuda, _ops._sigmoid_setup_context, _ops._sigmoid_backward)
                                  if sigmoid else
                                  (_ops.softmax_step_cuda, _ops._softmax_setup_context, _ops._softmax_backward))
        output = kernel(*plain)
        setup(ctx, tuple(inputs), output)
        got = formula(ctx, torch.tensor(grad), *([None] * (len(output) - 1)))
    return got[:4] if sigmoid else got[:3]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("grad", [65536.0, 1.0])
def test_cuda_backward_reruns_float16_at_the_incoming_gradient(monkeypatch, dtype, grad):
    # The device step runs at loss scale 1 in the forward. Its float16 gradients there can be subnormal (here 3e-7:
    # 5 units of float16's 6e-8 spacing) where a GradScaler's scale puts them in the normal range, so a float16
    # backward with an incoming gradient g != 1 reruns the step at loss scale g (feature_grads' CUDA kernel), with
    # every other argument of the forward's call. Checked on the CPU with a stand-in for the extension that rounds an
    # exact gradient at the loss scale it is given, as the device does, and records its calls.
    from contrastive_torch import _device
    from cuda_standin import StandIn

    if not ct.HAS_CUSTOM_OPS:
        pytest.skip("torch.library.custom_op needs PyTorch >= 2.4")
    exact = 3.0e-7
    ext = StandIn(exact)
    monkeypatch.setattr(_device, "cuda_extension", lambda: ext)
    q = torch.zeros(4, 3, dtype=dtype, requires_grad=True)
    k = torch.zeros(4, 3, dtype=dtype, requires_grad=True)
    t = torch.tensor(10.0, requires_grad=True)
    b = torch.tensor(-10.0, requires_grad=True)
    labels64 = torch.tensor([3, 0, 2, 1])
    reruns = dtype == torch.float16 and grad != 1.0
    want = torch.tensor(exact * grad).to(dtype)
    runs = {
        "sigmoid": (q, k, t, b, "chunked", 0, True),
        "softmax": (q, k, t, None, True, "chunked", 0, False, True),
        "infonce": (q, k, t, labels64, False, "materialized", 0, True, True),
    }
    for name, inputs in runs.items():
        ext.clear()
        gq, gk, gt, *gb = _cuda_chain(monkeypatch, inputs, grad)
        assert ext.calls == ([1.0, grad] if reruns else [1.0]), name
        if reruns:  # the same call but for the loss scale: scale, bias, labels (int32, the features' device), options
            assert ext.args[1] == ext.args[0], name
        assert gq.dtype == dtype and torch.equal(gq, torch.full(q.shape, float(want), dtype=dtype)), name
        assert torch.equal(gk, -gq), name
        # d loss / d t = (d loss / d log t) / t, times the incoming gradient, in t's dtype and shape.
        assert gt.dtype == t.dtype and gt.shape == t.shape, name
        assert float(gt) == pytest.approx(0.25 * grad / 10.0, rel=1e-6), name
        if name == "sigmoid":
            assert float(gb[0]) == -0.125 * grad, name
    if reruns:
        # Without the rerun the gradient would be the subnormal times g: 0.6% off here.
        subnormal_times_g = float(torch.tensor(exact).to(dtype).float() * grad)
        assert abs(subnormal_times_g - exact * grad) > 1e-3 * exact * grad
    # No rerun when the features need no gradient (only t and b do).
    ext.clear()
    gq, gk, _gt, _gb = _cuda_chain(monkeypatch, (q.detach(), k.detach(), t, b, "chunked", 0, True), grad)
    assert ext.calls == [1.0] and gq is None and gk is None


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_open_clip(dtype, seed):
    oc = _open_clip_loss_module()
    require("open_clip", oc is not None, "open-clip-torch is not installed")
    for n, d, t, b in ((48, 32, 10.0, -10.0), (300, 64, 30.0, -12.0)):
        img, txt = _draw(n, d, seed + n)
        I, T = img.to(dtype), txt.to(dtype)
        fn = ct.SigLipLoss()  # algorithm None: 'chunked' on CUDA tensors
        got = _step(lambda *a: fn(*[x.cuda() for x in a]), I.cuda(), T.cuda(), t, b)
        want = _step(oc.SigLipLoss(), I, T, t, b, dtype=torch.float64)
        assert int(fn.last_step["first_nonfinite_code"]) == 0
        assert got[1].dtype == dtype and got[1].device.type == "cuda"
        eps = torch.finfo(dtype).eps
        # The device stores G_c in the element type for its tensor-core products: one more rounding than the host.
        for name, a, w, tol in zip(NAMES, got, want, _bounds(dtype, I, T, t, b)):
            err = _rel(a.cpu(), w)
            assert err <= 2 * tol, f"{name}: {err / eps:.1f} eps from open_clip, bound {2 * tol / eps:.1f} (n {n})"


@needs_cuda
def test_cuda_algorithm_choice_and_errors():
    img, txt = _draw(16, 8, 5)
    I, T = img.cuda(), txt.cuda()
    t, b = torch.tensor(10.0, device="cuda"), torch.tensor(-10.0, device="cuda")
    assert math.isfinite(float(ct.SigLipLoss(algorithm="chunked")(I, T, t, b)))
    for algorithm in ("fused", "materialized"):
        with pytest.raises(ValueError, match="algorithm"):
            ct.SigLipLoss(algorithm=algorithm)(I, T, t, b)
    bad = I.clone()
    bad[0, 0] = float("nan")
    # The device's sigmoid step never reads a value on the host: a NaN feature or bias makes the loss NaN and the
    # step's record names the logits.
    for args in ((bad, T, t, b), (I, T, t, torch.tensor(float("inf"), device="cuda"))):
        report = {}
        assert math.isnan(float(CF.siglip_loss(*args, report=report)))
        assert CF.NONFINITE_SITES[int(report["first_nonfinite_code"])] == "logits"
    with pytest.raises(ValueError, match="devices"):
        ct.SigLipLoss()(I, txt, t, b)
    with pytest.raises(ValueError, match="diagonal"):
        ct.SigLipLoss()(T.repeat(2, 1), T, t, b)


@needs_cuda
def test_cuda_opcheck_and_compiled_step():
    if not ct.HAS_CUSTOM_OPS:
        pytest.skip("torch.library.custom_op needs PyTorch >= 2.4")
    img, txt = _draw(64, 32, 9)
    I, T = img.cuda(), txt.cuda()
    t, b = torch.tensor(10.0, device="cuda"), torch.tensor(-10.0, device="cuda")
    torch.library.opcheck(torch.ops.contrastive_torch.sigmoid_step.default,
                          (I.clone().requires_grad_(), T.clone().requires_grad_(), t.clone().requires_grad_(),
                           b.clone().requires_grad_(), "chunked", 0, True))
    fn = ct.SigLipLoss()
    eager = _step(fn, I, T, 10.0, -10.0)
    compiled = _step(torch.compile(fn, fullgraph=True), I, T, 10.0, -10.0)
    for name, a, w in zip(NAMES, compiled, eager):
        assert _rel(a.cpu(), w.cpu()) <= 64 * torch.finfo(torch.float32).eps, name


