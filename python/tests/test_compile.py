# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The torch.library custom operators (PyTorch >= 2.4): torch.library.opcheck, and torch.compile(fullgraph=True) of a
two-tower training step against eager (CPU)."""

import math

import pytest
import torch
import torch.nn.functional as F

import contrastive_torch as ct
from conftest import require

ALGORITHMS = ("fused", "materialized", "chunked")


@pytest.fixture(autouse=True)
def needs_custom_ops():
    require("custom_ops", ct.HAS_CUSTOM_OPS, f"PyTorch {torch.__version__} < 2.4 has no torch.library.custom_op")


def unit(n, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g), dim=1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_opcheck(algorithm, dtype):
    # opcheck runs the operator under its schema check, FakeTensor (the fake implementation against the real one),
    # autograd registration and AOT dispatch with static and dynamic shapes.
    q, k = unit(40, 16, 1, dtype), unit(40, 16, 2, dtype)
    s = torch.tensor(12.0)
    loss = torch.ops.contrastive_torch.loss.default
    backward = torch.ops.contrastive_torch.loss_backward.default
    torch.library.opcheck(loss, (q.clone().requires_grad_(), k.clone().requires_grad_(), s.clone().requires_grad_(),
                                 None, True, algorithm, 0))
    torch.library.opcheck(loss, (q, k, s, None, True, algorithm, 1))  # no gradient wanted
    torch.library.opcheck(backward, (torch.tensor(1.0), q, k, s, None, True, algorithm, 0))
    # InfoNCE with labels and more keys than queries.
    keys = unit(70, 16, 3, dtype)
    labels = torch.randint(0, 70, (40,), generator=torch.Generator().manual_seed(4))
    torch.library.opcheck(loss, (q.clone().requires_grad_(), keys.clone().requires_grad_(), s, labels, False,
                                 algorithm, 0))
    torch.library.opcheck(backward, (torch.tensor(2.0), q, keys, s, labels, False, algorithm, 0))


def test_operator_refuses_bad_values():
    # Value checks happen when the operator runs (tracing reads no values): the library's messages, by argument.
    q = unit(8, 4, 5)
    bad = q.clone()
    bad[2, 1] = float("nan")
    op = torch.ops.contrastive_torch.loss
    with pytest.raises(ValueError, match=r"q\[2\]\[1\] is not finite"):
        op(bad, q, torch.tensor(10.0), None, True, "fused", 0)
    with pytest.raises(ValueError, match="logit_scale"):
        op(q, q, torch.tensor(-1.0), None, True, "fused", 0)
    with pytest.raises(ValueError, match="labels"):
        op(q, q, torch.tensor(10.0), torch.tensor([0, 1, 2, 3, 4, 5, 6, 8]), False, "fused", 0)
    with pytest.raises(ValueError, match="logit_scale"):
        ct.ClipLoss(custom_ops=True)(q, q, torch.ones(2))


class TwoTower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.text = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.logit_scale = torch.nn.Parameter(torch.ones([]) * math.log(1 / 0.07))


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("algorithm", ["fused", "chunked"])
def test_compiled_training_step_matches_eager(algorithm, monkeypatch):
    require("compile", hasattr(torch, "compile"), "no torch.compile")
    backward_calls = []
    real = ct._host_gradients
    monkeypatch.setattr(ct, "_host_gradients", lambda *a: backward_calls.append(1) or real(*a))
    loss_fn = ct.ClipLoss(algorithm=algorithm)

    def step(model, x, y):
        # The forward of a training step; loss.backward() and the optimizer run outside (dynamo does not trace a
        # .backward() call), the backward graph AOTAutograd derived from the operators' registered autograd.
        image = F.normalize(model.visual(x), dim=-1)
        text = F.normalize(model.text(y), dim=-1)
        return loss_fn(image, text, model.logit_scale.exp())

    torch.manual_seed(0)
    eager_model = TwoTower()
    compiled_model = TwoTower()
    compiled_model.load_state_dict(eager_model.state_dict())
    compiled_step = torch.compile(step, fullgraph=True)  # fullgraph: a graph break is an error
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-6)
            for m in (eager_model, compiled_model)]
    data = torch.Generator().manual_seed(1)
    eps = torch.finfo(torch.float32).eps
    for i in range(4):
        x = torch.randn(48, 24, generator=data)
        y = x + 0.3 * torch.randn(48, 24, generator=data)
        losses = []
        for fn, model, opt in ((step, eager_model, opts[0]), (compiled_step, compiled_model, opts[1])):
            opt.zero_grad()
            loss = fn(model, x, y)
            loss.backward()
            losses.append(loss.detach())
        # Inductor fuses the towers' arithmetic differently from eager, so the two agree to float32 rounding, not
        # bit for bit.
        assert rel(losses[1], losses[0]) <= 64 * eps, f"step {i}: loss {float(losses[1])} vs {float(losses[0])}"
        for (name, p), q in zip(compiled_model.named_parameters(), eager_model.parameters()):
            assert p.grad is not None, f"step {i}: {name} got no gradient from the compiled step"
            assert rel(p.grad, q.grad) <= 256 * eps, f"step {i}: grad of {name}: {rel(p.grad, q.grad) / eps:.1f} eps"
        for opt in opts:
            opt.step()
    assert len(backward_calls) == 4, "the compiled step's backward did not run the contrastive_torch::loss_backward op"
    # A last, smaller batch (a loader without drop_last): the fake implementations give the new shapes.
    x = torch.randn(19, 24, generator=data)
    y = x + 0.3 * torch.randn(19, 24, generator=data)
    for model in (eager_model, compiled_model):
        model.zero_grad()
    a, b = step(eager_model, x, y), compiled_step(compiled_model, x, y)
    (a + b).backward()
    assert rel(b.detach(), a.detach()) <= 64 * eps
    for p, q in zip(compiled_model.parameters(), eager_model.parameters()):
        assert rel(p.grad, q.grad) <= 256 * eps


# The CUDA operator (contrastive_torch::cuda_step): its fake implementation and autograd formula are checked here on
# the CPU; running it needs a GPU (the tests below skip without one).


def test_cuda_operator_traces_without_a_gpu():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(8, 4, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(8, 4, device="cuda", dtype=torch.bfloat16)
        s = torch.empty((), device="cuda")
        loss, dq, dk, dlogs = torch.ops.contrastive_torch.cuda_step(q, k, s, None, True, "chunked", False)
    assert (loss.shape, loss.dtype, loss.device.type) == ((), torch.float32, "cuda")
    assert (dq.shape, dq.dtype, dk.shape, dk.dtype) == (q.shape, q.dtype, k.shape, k.dtype)
    assert (dlogs.shape, dlogs.dtype) == ((), torch.float32)


def test_cuda_operator_autograd_formula():
    # The step's gradients at loss scale 1, times the incoming gradient (bfloat16 here: float16's rerun at it is
    # test_siglip.py's test_cuda_backward_reruns_float16_...); d loss / d s = (d loss / d log s) / s.
    from cuda_standin import Ctx

    dq, dk = torch.randn(6, 3).to(torch.bfloat16), torch.randn(6, 3).to(torch.bfloat16)
    dlogs, s = torch.tensor(0.75), torch.tensor(12.0)
    ctx = Ctx((True, True, True, False, False, False, False))
    ct._cuda_setup_context(ctx, (dq, dk, s, None, True, "chunked", False), (torch.tensor(0.5), dq, dk, dlogs))
    gq, gk, gs, *rest = ct._cuda_autograd(ctx, torch.tensor(65536.0), None, None, None)
    assert rest == [None] * 4
    assert gq.dtype == torch.bfloat16 and torch.equal(gq, (dq.float() * 65536.0).to(torch.bfloat16))
    assert torch.equal(gk, (dk.float() * 65536.0).to(torch.bfloat16))
    assert float(gs) == pytest.approx(0.75 * 65536.0 / 12.0, rel=1e-6) and gs.shape == s.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_feature_grads_opcheck(monkeypatch, dtype):
    # contrastive_torch::cuda_feature_grads (the CUDA operators' backward for the features) runs on every device; on
    # the CPU its rerun goes to a stand-in extension. opcheck: schema, fake implementation, AOT dispatch.
    from cuda_standin import StandIn

    monkeypatch.setattr(ct, "cuda_extension", lambda: StandIn(3.0e-7))
    q, k = unit(8, 4, 1, dtype), unit(8, 4, 2, dtype)
    dq, dk = unit(8, 4, 3, dtype), unit(8, 4, 4, dtype)
    s, b = torch.tensor(12.0), torch.tensor(-10.0)
    op = torch.ops.contrastive_torch.cuda_feature_grads.default
    saved = (q, k) if dtype == torch.float16 else (None, None)
    for grad in (torch.tensor(1.0), torch.tensor(65536.0)):
        for bias, labels in ((None, None), (None, torch.arange(8)), (b, None)):
            torch.library.opcheck(op, (grad, dq, dk, *saved, s, bias, labels, True, "chunked", False))
    # float16 under a loss scale without the features cannot rerun: a clear error, not a silently worse gradient.
    if dtype == torch.float16:
        with pytest.raises(RuntimeError, match="need q and k"):
            op(torch.tensor(65536.0), dq, dk, None, None, s, None, None, True, "chunked", False)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")


@needs_cuda
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_cuda_opcheck(algorithm):
    q, k = unit(64, 32, 6).cuda(), unit(64, 32, 7).cuda()
    s = torch.tensor(12.0, device="cuda")
    torch.library.opcheck(torch.ops.contrastive_torch.cuda_step.default,
                          (q.clone().requires_grad_(), k.clone().requires_grad_(), s.clone().requires_grad_(), None,
                           True, algorithm, False))


@needs_cuda
def test_cuda_compiled_step_matches_eager():
    loss_fn = ct.ClipLoss(algorithm="chunked")
    torch.manual_seed(0)
    models = [TwoTower().cuda(), TwoTower().cuda()]
    models[1].load_state_dict(models[0].state_dict())

    def step(model, x, y):
        return loss_fn(F.normalize(model.visual(x), dim=-1), F.normalize(model.text(y), dim=-1),
                       model.logit_scale.exp())

    x = torch.randn(64, 24, device="cuda")
    y = x + 0.3 * torch.randn(64, 24, device="cuda")
    a = step(models[0], x, y)
    b = torch.compile(step, fullgraph=True)(models[1], x, y)
    (a + b).backward()
    eps = torch.finfo(torch.float32).eps
    assert rel(b.detach(), a.detach()) <= 64 * eps
    for p, q in zip(models[1].parameters(), models[0].parameters()):
        assert rel(p.grad, q.grad) <= 256 * eps


# SigLipLoss's operators (contrastive_torch::sigmoid_loss, ::sigmoid_loss_backward).


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_sigmoid_opcheck(algorithm, dtype):
    q, k = unit(40, 16, 11, dtype), unit(52, 16, 12, dtype)
    t, b = torch.tensor(10.0), torch.tensor(-10.0)
    loss = torch.ops.contrastive_torch.sigmoid_loss.default
    backward = torch.ops.contrastive_torch.sigmoid_loss_backward.default
    torch.library.opcheck(loss, (q.clone().requires_grad_(), k.clone().requires_grad_(), t.clone().requires_grad_(),
                                 b.clone().requires_grad_(), algorithm, 0))
    torch.library.opcheck(loss, (q, k, t, b, algorithm, 1))
    torch.library.opcheck(backward, (torch.tensor(2.0), q, k, t, b, algorithm, 0))


def test_sigmoid_operator_refuses_bad_values():
    q = unit(8, 4, 13)
    op = torch.ops.contrastive_torch.sigmoid_loss
    with pytest.raises(ValueError, match="logit_bias"):
        op(q, q, torch.tensor(10.0), torch.tensor(float("nan")), "fused", 0)
    with pytest.raises(ValueError, match="logit_scale"):
        op(q, q, torch.tensor(0.0), torch.tensor(-10.0), "fused", 0)


def test_compiled_siglip_step_matches_eager():
    require("compile", hasattr(torch, "compile"), "no torch.compile")
    loss_fn = ct.SigLipLoss(algorithm="fused")

    def step(model, bias, x, y):
        image = F.normalize(model.visual(x), dim=-1)
        text = F.normalize(model.text(y), dim=-1)
        return loss_fn(image, text, model.logit_scale.exp(), bias)

    torch.manual_seed(0)
    eager_model, compiled_model = TwoTower(), TwoTower()
    compiled_model.load_state_dict(eager_model.state_dict())
    biases = [torch.nn.Parameter(torch.tensor(-10.0)) for _ in range(2)]
    compiled_step = torch.compile(step, fullgraph=True)  # a graph break is an error
    opts = [torch.optim.AdamW(list(m.parameters()) + [b], lr=1e-2) for m, b in zip((eager_model, compiled_model),
                                                                                     biases)]
    data = torch.Generator().manual_seed(2)
    eps = torch.finfo(torch.float32).eps
    for i in range(3):
        x = torch.randn(40, 24, generator=data)
        y = x + 0.3 * torch.randn(40, 24, generator=data)
        losses = []
        for fn, model, bias, opt in ((step, eager_model, biases[0], opts[0]),
                                     (compiled_step, compiled_model, biases[1], opts[1])):
            opt.zero_grad()
            loss = fn(model, bias, x, y)
            loss.backward()
            losses.append(loss.detach())
        assert rel(losses[1], losses[0]) <= 64 * eps, f"step {i}: loss {float(losses[1])} vs {float(losses[0])}"
        assert rel(biases[1].grad, biases[0].grad) <= 256 * eps, f"step {i}: logit_bias's gradient"
        for (name, p), q in zip(compiled_model.named_parameters(), eager_model.parameters()):
            assert p.grad is not None, f"step {i}: {name} got no gradient from the compiled step"
            assert rel(p.grad, q.grad) <= 256 * eps, f"step {i}: grad of {name}: {rel(p.grad, q.grad) / eps:.1f} eps"
        for opt in opts:
            opt.step()
