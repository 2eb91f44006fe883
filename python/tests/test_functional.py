# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""contrastive_torch.functional (the losses as functions) and what the modules add over it: the same values and
gradients bit for bit (one path), the report, the loss's dtype (open_clip's), open_clip's constructors (released 3.3
and its development branch), gradients-free calls, and a retained graph."""

import math
import os

import pytest
import torch
import torch.nn.functional as F

import contrastive_torch as ct
import contrastive_torch.functional as CF


pytestmark = pytest.mark.usefixtures("needs_custom_ops")


def unit(n, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g), dim=1).to(dtype)


def grads(fn, *inputs):
    """The value of fn(*leaves) and the leaves' gradients (tensor inputs that are floating point become leaves)."""
    leaves = [x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
              for x in inputs]
    loss = fn(*leaves)
    loss.backward()
    return [loss.detach()] + [x.grad for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_functions_equal_modules(seed, dtype):
    q, k = unit(30, 16, seed, dtype), unit(30, 16, seed + 1, dtype)
    keys = unit(45, 16, seed + 2, dtype)
    labels = torch.randint(0, 45, (30,), generator=torch.Generator().manual_seed(seed))
    s, b = torch.tensor(14.0), torch.tensor(-8.0)
    # The modules return open_clip's dtype here: float32, but SigLipLoss the dtype of bfloat16 features (a region of
    # their own dtype); the functions return float32. The loss is compared at the module's dtype.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pairs = [
            (lambda *a: CF.clip_loss(*a, algorithm="materialized"),
             lambda *a: ct.ClipLoss(algorithm="materialized")(*a), (q, k, s)),
            (lambda *a: CF.siglip_loss(*a), lambda *a: ct.SigLipLoss()(*a), (q, keys, s, b)),
            (lambda *a: CF.info_nce_loss(*a, algorithm="chunked"),
             lambda *a: ct.InfoNCELoss(algorithm="chunked")(*a), (q, keys, s, labels)),
        ]
        for function, module, inputs in pairs:
            got, want = grads(function, *inputs), grads(module, *inputs)
            assert len(got) == len(want) >= 4
            got[0] = got[0].to(want[0].dtype)
            for a, w in zip(got, want):
                assert a.dtype == w.dtype and torch.equal(a, w), f"seed {seed}"


def test_report_and_last_step():
    q, k = unit(12, 8, 1), unit(12, 8, 2)
    report = {}
    loss = CF.clip_loss(q, k, 10.0, report=report)
    assert set(report) == {"loss", "max_logit", "first_nonfinite_code", "first_nonfinite", "algorithm"}
    assert torch.equal(report["loss"], loss) and report["first_nonfinite"] == "none"
    assert float(report["max_logit"]) == pytest.approx(float((q @ k.T).max() * 10.0), rel=1e-5)
    big = {}
    CF.clip_loss(q.half(), k.half(), 1e6, algorithm="materialized", report=big)  # logits past float16's range
    assert big["first_nonfinite"] == "logits" and ct.NONFINITE_SITES[int(big["first_nonfinite_code"])] == "logits"
    fn = ct.SigLipLoss()
    fn(q, k, 10.0, -10.0)
    assert isinstance(fn.last_step, ct.StepReport) and fn.last_step["first_nonfinite"] == "none"


def test_loss_dtype_is_open_clips():
    # open_clip's ClipLoss is float32 under autocast (its cross-entropy runs in float32 there) and the features' dtype
    # in pure 16-bit training; its SigLipLoss the features' dtype in both (its log-sigmoid runs at the 16-bit logits'
    # dtype; test_autocast.py compares every combination with open_clip's own); the functions always return float32.
    for dtype in (torch.bfloat16, torch.float16):
        q, k = unit(16, 8, 3, dtype), unit(16, 8, 4, dtype)
        assert ct.ClipLoss()(q, k, 10.0).dtype == dtype
        assert ct.SigLipLoss()(q, k, 10.0, -10.0).dtype == dtype
        assert CF.clip_loss(q, k, 10.0).dtype == torch.float32
        with torch.autocast("cpu", dtype=dtype):
            assert ct.ClipLoss()(q, k, 10.0).dtype == torch.float32
            assert ct.SigLipLoss()(q, k, 10.0, -10.0).dtype == dtype
        a = q.clone().requires_grad_()
        ct.ClipLoss()(a, k, 10.0).backward()
        assert a.grad.dtype == dtype and torch.isfinite(a.grad).all()
    q = unit(16, 8, 3)
    assert ct.ClipLoss()(q, q, 10.0).dtype == torch.float32


def test_open_clip_constructors():
    # Released 3.3: ClipLoss(local_loss, gather_with_grad, cache_labels, rank, world_size, use_horovod) and
    # SigLipLoss(cache_labels, rank, world_size, dist_impl); the development branch drops use_horovod and adds
    # SigLipLoss's chunk_size (open_clip's logits memory bound; nothing to bound here).
    ct.ClipLoss(False, False, False, 0, 1)
    ct.ClipLoss(False, False, False, 0, 1, False)
    fn = ct.SigLipLoss(False, 0, 1, "bidir", 4096)
    assert fn.chunk_size == 4096
    ct.SigLipLoss(cache_labels=True, rank=0, world_size=1, dist_impl=None, chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        ct.SigLipLoss(chunk_size=-1)
    with pytest.raises(TypeError, match="chunk_size"):
        ct.SigLipLoss(chunk_size="big")
    with pytest.raises(NotImplementedError, match="use_horovod"):
        ct.ClipLoss(use_horovod=True)


def test_argument_errors_name_the_argument():
    q, k = unit(8, 4, 5), unit(8, 4, 6)
    with pytest.raises(TypeError, match="group"):
        CF.clip_loss(q, k, 10.0, group="WORLD")
    with pytest.raises(ValueError, match="algorithm"):
        CF.siglip_loss(q, k, 10.0, algorithm="magic")
    with pytest.raises(ValueError, match="threads"):
        CF.info_nce_loss(q, k, 10.0, threads=-1)
    with pytest.raises(TypeError, match="fused_tiles"):
        CF.clip_loss(q, k, 10.0, fused_tiles=1)
    with pytest.raises(TypeError, match="logit_scale"):
        CF.clip_loss(q, k, "10")
    with pytest.raises(ValueError, match="logit_scale"):
        CF.clip_loss(q, k, float("inf"))
    with pytest.raises(TypeError, match="logit_scale"):
        CF.clip_loss(q, k, torch.tensor(10.0j))
    # numpy numbers and integer tensors are numbers: accepted, as float() takes them.
    import numpy as np

    want = CF.clip_loss(q, k, 10.0)
    for scale in (np.float32(10.0), np.array(10.0), torch.tensor(10), 10):
        assert torch.equal(CF.clip_loss(q, k, scale), want), type(scale)
    with pytest.raises(ValueError, match="labels"):
        CF.info_nce_loss(q, k, 10.0, torch.arange(8).reshape(2, 4))
    with pytest.raises(ValueError, match="query"):
        CF.info_nce_loss(q[0], k, 10.0)
    with pytest.raises(TypeError, match="logit_bias"):
        CF.siglip_loss(q, k, 10.0, [1.0])
    assert math.isfinite(float(CF.clip_loss(q, k, 10.0)))  # after the refusals


def test_no_gradients_wanted_and_a_retained_graph(monkeypatch):
    from contrastive_torch import _ops

    calls = []
    real = _ops.softmax_step_cpu
    monkeypatch.setattr(_ops, "softmax_step_cpu", lambda *a: calls.append(a[-1]) or real(*a))
    q, k = unit(20, 8, 7), unit(20, 8, 8)
    with torch.no_grad():
        evaluated = CF.clip_loss(q.requires_grad_(), k, 10.0)
    assert calls == [False] and not evaluated.requires_grad  # forward only: no gradients computed
    q = q.detach()
    assert torch.equal(CF.clip_loss(q, k, 10.0), evaluated) and calls[-1] is False
    # A retained graph can be differentiated twice (the gradients are saved, not an engine's state).
    a = q.clone().requires_grad_()
    loss = CF.clip_loss(a, k, 10.0)
    loss.backward(retain_graph=True)
    once = a.grad.clone()
    loss.backward()
    assert torch.equal(a.grad, 2 * once)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_algorithm_none_is_materialized_within_the_budget_else_fused(seed, dtype):
    """algorithm=None on CPU tensors: the library's algorithm::automatic, bit for bit the algorithm it names in the
    report (float32 materialized within the memory budget, fused beyond it; 16-bit always fused), modules alike."""
    q, k = unit(70, 24, seed, dtype), unit(70, 24, seed + 1, dtype)
    keys = unit(90, 24, seed + 2, dtype)
    labels = torch.randint(0, 90, (70,), generator=torch.Generator().manual_seed(seed))
    try:
        for budget in (0, 1 << 40, 1):
            ct.set_memory_budget(budget)
            assert ct.memory_budget() == budget
            want = "materialized" if budget != 1 and dtype == torch.float32 else "fused"
            calls = [(lambda *a, **kw: CF.clip_loss(*a, **kw), (q, k, 14.0)),
                     (lambda *a, **kw: CF.info_nce_loss(*a, **kw), (q, keys, 14.0, labels))]
            for fn, inputs in calls:
                report = {}
                got = grads(lambda *a: fn(*a, report=report), *inputs)
                assert report["algorithm"] == want, (budget, dtype)
                ref = grads(lambda *a: fn(*a, algorithm=want), *inputs)
                for a, w in zip(got, ref):
                    assert torch.equal(a, w), f"seed {seed}, budget {budget}"
            module = ct.ClipLoss()
            assert module.algorithm is None
            module(q, k, torch.tensor(14.0))
            assert module.last_step["algorithm"] == want
    finally:
        ct.set_memory_budget(0)


def test_algorithm_none_runs_fused_for_16bit():
    """16-bit CPU features: materialized rounds the logits to the features' dtype, which on a learned batch is the
    size of the gradient itself, so algorithm=None runs fused at every logit scale (open_clip's clamp, 100, included);
    float32 keeps materialized at any scale."""
    try:
        ct.set_memory_budget(1 << 40)
        for dtype, scale, want in ((torch.bfloat16, 10.0, "fused"), (torch.bfloat16, 100.0, "fused"),
                                   (torch.bfloat16, 2000.0, "fused"), (torch.float16, 10.0, "fused"),
                                   (torch.float32, 2000.0, "materialized")):
            q, k = unit(40, 16, 3, dtype), unit(40, 16, 4, dtype)
            report = {}
            got = grads(lambda *a: CF.clip_loss(*a, report=report), q, k, scale)
            assert report["algorithm"] == want, (dtype, scale)
            ref = grads(lambda *a: CF.clip_loss(*a, algorithm=want), q, k, scale)
            for a, w in zip(got, ref):
                assert torch.equal(a, w), (dtype, scale)
    finally:
        ct.set_memory_budget(0)


def test_host_kernels_name_what_runs():
    kernels = ct.host_kernels()
    assert set(kernels) == {"float", "bfloat16", "amx"}
    assert kernels["float"] in ("avx512", "avx2+fma", "avx", "generic")
    assert kernels["bfloat16"] in ("amx_bf16", "amx_bf16 (emulated)", "avx512_bf16", "none")
    assert isinstance(kernels["amx"], str) and kernels["amx"]
    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    if "amx_bf16" not in flags:
        assert kernels["bfloat16"] != "amx_bf16", kernels
    if kernels["bfloat16"] == "amx_bf16":
        assert kernels["amx"] == "AMX-BF16 tiles active", kernels
    # A -march=native build on an AVX512-BF16 CPU has the bf16 kernel.
    native = os.environ.get("CONTRASTIVE_NATIVE", "1") != "0"
    if native and kernels["float"] == "avx512" and "avx512_bf16" in flags:
        assert kernels["bfloat16"] in ("avx512_bf16", "amx_bf16", "amx_bf16 (emulated)"), kernels


def test_algorithm_none_by_device_and_group():
    # None: 'automatic' in one process (the host's algorithm::automatic on the CPU, the device's chunk choice on
    # CUDA); over a process group 'fused' on the CPU (the distributed engine's) and 'chunked' on CUDA. A name is kept.
    from contrastive_torch import _checks

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
    assert _checks.resolve_algorithm(None, cpu) == _checks.resolve_algorithm(None, cuda) == "automatic"
    assert _checks.resolve_algorithm(None, cpu, distributed=True) == "fused"
    assert _checks.resolve_algorithm(None, cuda, distributed=True) == "chunked"
    for name in ("fused", "materialized", "chunked"):
        for device in (cpu, cuda):
            assert _checks.resolve_algorithm(name, device) == _checks.resolve_algorithm(name, device, True) == name
    assert _checks.sigmoid_algorithm(None, cpu) == "fused" and _checks.sigmoid_algorithm(None, cuda) == "chunked"
    # 'automatic' is what None means, not a name a caller passes.
    for device in (cpu, cuda):
        with pytest.raises(ValueError, match="algorithm: 'automatic' is not one of 'fused', 'materialized', 'chunked'"):
            _checks.resolve_algorithm("automatic", device)
    with pytest.raises(ValueError, match="algorithm: 'automatic'"):
        ct.ClipLoss(algorithm="automatic")
    with pytest.raises(ValueError, match="algorithm: 'fastest' is not one of"):
        CF.info_nce_loss(unit(4, 8, 1), unit(4, 8, 2), 10.0, algorithm="fastest")


def test_memory_budget_errors():
    for bad in (-1, 1.5, True, "1", 2**63):
        with pytest.raises(ValueError, match="bytes"):
            ct.set_memory_budget(bad)
    assert ct.memory_budget() == 0
    with pytest.raises(ValueError, match="algorithm"):
        CF.clip_loss(unit(4, 8, 1), unit(4, 8, 2), 10.0, algorithm="automatic")
