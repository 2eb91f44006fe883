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


pytestmark = pytest.mark.usefixtures("needs_custom_ops")


def unit(n, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g), dim=1).to(dtype)


SOFTMAX = torch.ops.contrastive_torch.softmax_step.default if ct.HAS_CUSTOM_OPS else None
SIGMOID = torch.ops.contrastive_torch.sigmoid_step.default if ct.HAS_CUSTOM_OPS else None
FEATURE_GRADS = torch.ops.contrastive_torch.feature_grads.default if ct.HAS_CUSTOM_OPS else None


def grad_leaves(*xs):
    return tuple(x.clone().requires_grad_() for x in xs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_opcheck(algorithm, dtype):
    # opcheck runs each operator under its schema check, FakeTensor (the fake implementation against the real one),
    # autograd registration and AOT dispatch with static and dynamic shapes.
    q, k = unit(40, 16, 1, dtype), unit(40, 16, 2, dtype)
    s = torch.tensor(12.0)
    torch.library.opcheck(SOFTMAX, (*grad_leaves(q, k, s), None, True, algorithm, 0, False, True))
    torch.library.opcheck(SOFTMAX, (q, k, s, None, True, algorithm, 1, False, False))  # no gradient wanted
    # InfoNCE with labels and more keys than queries.
    keys = unit(70, 16, 3, dtype)
    labels = torch.randint(0, 70, (40,), generator=torch.Generator().manual_seed(4))
    torch.library.opcheck(SOFTMAX, (*grad_leaves(q, keys), s, labels, False, algorithm, 0, False, True))
    # The backward for the features: multiplied, or (float16 under a loss scale) the host step rerun at it.
    _, dq, dk, *_ = SOFTMAX(q, keys, s, labels, False, algorithm, 0, False, True)
    saved = (q, keys) if dtype == torch.float16 else (None, None)
    for grad in (torch.tensor(1.0), torch.tensor(65536.0)):
        torch.library.opcheck(FEATURE_GRADS, (grad, dq, dk, *saved, s, None, labels, False, algorithm, 0, False))
    if dtype != torch.float16:
        t, b = torch.tensor(10.0), torch.tensor(-10.0)
        torch.library.opcheck(SIGMOID, (*grad_leaves(q, keys, t, b), algorithm, 0, True))
        torch.library.opcheck(SIGMOID, (q, keys, t, b, algorithm, 1, False))


def test_feature_grads_needs_the_features_to_rerun():
    # float16 under a loss scale without the features cannot rerun: a clear error, not a silently worse gradient.
    q = unit(8, 4, 5, torch.float16)
    with pytest.raises(RuntimeError, match="need q and k"):
        FEATURE_GRADS(torch.tensor(65536.0), q, q, None, None, torch.tensor(10.0), None, None, True, "fused", 0,
                      False)


def test_float16_backward_reruns_at_the_incoming_gradient(monkeypatch):
    # On the CPU too a float16 backward under g != 1 runs the host step again at loss scale g: the gradients equal
    # the host engine's at loss scale g, bit for bit (GradScaler's protocol; no underflow at scale 1 is kept).
    from contrastive_torch import _host

    q, k = unit(24, 8, 6, torch.float16), unit(24, 8, 7, torch.float16)
    s = torch.tensor(30.0)
    calls = []
    real = _host.step
    monkeypatch.setattr(_host, "step", lambda *a, **kw: calls.append(a[-1] if len(a) == 10 else 1.0) or real(*a))
    a, b = q.clone().requires_grad_(), k.clone().requires_grad_()
    (ct.ClipLoss()(a, b, s) * 4096.0).backward()
    assert calls == [1.0, 4096.0]
    want = real(q, k, 30.0, 0.0, None, "symmetric", "fused", 0, True, 4096.0)
    assert torch.equal(a.grad, want[1]) and torch.equal(b.grad, want[2])


def test_operator_refuses_bad_values():
    # Value checks happen when the operator runs (tracing reads no values): the library's messages, by argument.
    q = unit(8, 4, 5)
    bad = q.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"q\[2\]\[1\] is not finite"):
        SOFTMAX(bad, q, torch.tensor(10.0), None, True, "fused", 0, False, False)
    with pytest.raises(ValueError, match="logit_scale"):
        SOFTMAX(q, q, torch.tensor(-1.0), None, True, "fused", 0, False, False)
    with pytest.raises(ValueError, match="labels"):
        SOFTMAX(q, q, torch.tensor(10.0), torch.tensor([0, 1, 2, 3, 4, 5, 6, 8]), False, "fused", 0, False, False)
    with pytest.raises(ValueError, match="logit_scale"):
        ct.ClipLoss()(q, q, torch.ones(2))
    with pytest.raises(ValueError, match="logit_bias"):
        SIGMOID(q, q, torch.tensor(10.0), torch.tensor(float("nan")), "fused", 0, False)
    with pytest.raises(ValueError, match="logit_scale"):
        SIGMOID(q, q, torch.tensor(0.0), torch.tensor(-10.0), "fused", 0, False)


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
    from contrastive_torch import _ops

    kernel_calls = []
    real = _ops.softmax_step_cpu
    monkeypatch.setattr(_ops, "softmax_step_cpu", lambda *a: kernel_calls.append(a[-1]) or real(*a))
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
    # One path: the eager and the compiled step each ran contrastive_torch::softmax_step once per step, with grads.
    assert kernel_calls == [True] * 8, f"operator calls (grads): {kernel_calls}"
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


# The CUDA kernels (the same operators): their fake implementations are checked here on the CPU; running them needs a
# GPU (the tests below skip without one). Their backward logic runs on the CPU with a stand-in extension
# (test_siglip.py's test_cuda_backward_reruns_float16_...).


def test_cuda_operators_trace_without_a_gpu():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(8, 4, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(12, 4, device="cuda", dtype=torch.bfloat16)
        s, b = torch.empty((), device="cuda"), torch.empty((), device="cuda")
        softmax = torch.ops.contrastive_torch.softmax_step(q, k, s, None, False, "chunked", 0, False, True)
        sigmoid = torch.ops.contrastive_torch.sigmoid_step(q, k, s, b, "chunked", 0, True)
        no_grads = torch.ops.contrastive_torch.softmax_step(q, k, s, None, False, "chunked", 0, False, False)
    for out in (softmax, sigmoid):
        loss, dq, dk, dlogs = out[:4]
        assert (loss.shape, loss.dtype, loss.device.type) == ((), torch.float32, "cuda")
        assert (dq.shape, dq.dtype, dk.shape, dk.dtype) == (q.shape, q.dtype, k.shape, k.dtype)
        assert (dlogs.shape, dlogs.dtype) == ((), torch.float64)
        assert (out[-2].dtype, out[-1].dtype) == (torch.float32, torch.int32)
    assert sigmoid[4].dtype == torch.float64
    assert no_grads[1].shape == (0, 4) and no_grads[2].shape == (0, 4)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")


@needs_cuda
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_cuda_opcheck(algorithm):
    q, k = unit(64, 32, 6).cuda(), unit(64, 32, 7).cuda()
    s = torch.tensor(12.0, device="cuda")
    torch.library.opcheck(SOFTMAX, (*grad_leaves(q, k, s), None, True, algorithm, 0, False, True))


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
