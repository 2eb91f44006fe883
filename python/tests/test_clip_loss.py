# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""contrastive_torch against a plain PyTorch implementation of open_clip's loss (CPU; GPU tests skip without CUDA)."""

import math

import pytest
import torch
import torch.nn.functional as F

import contrastive_torch as ct
import contrastive_torch.functional as CF


def reference_clip(img, txt, logit_scale):
    logits = logit_scale * img @ txt.t()
    labels = torch.arange(img.shape[0], device=img.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))


def features(n, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g), dim=1).to(dtype)


def grads_of(fn, img, txt, log_scale):
    img = img.detach().clone().requires_grad_()
    txt = txt.detach().clone().requires_grad_()
    log_scale = log_scale.detach().clone().requires_grad_()
    loss = fn(img, txt, log_scale.exp())
    loss.backward()
    return loss.detach(), img.grad, txt.grad, log_scale.grad


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("algorithm", ["fused", "materialized", "chunked"])
@pytest.mark.parametrize("n,d", [(129, 64), (256, 96), (1, 8)])
def test_clip_float32_matches_pytorch(algorithm, n, d):
    img, txt = features(n, d, seed=1), features(n, d, seed=2)
    log_scale = torch.tensor(math.log(1 / 0.07))
    ours = grads_of(ct.ClipLoss(algorithm=algorithm), img, txt, log_scale)
    ref = grads_of(reference_clip, img, txt, log_scale)
    assert abs(float(ours[0]) - float(ref[0])) <= 1e-5 * abs(float(ref[0])) + 1e-7
    if n > 1:
        for a, b in zip(ours[1:], ref[1:]):
            assert rel(a, b) <= 1e-5


@pytest.mark.parametrize("algorithm", ["fused", "materialized", "chunked"])
def test_infonce_with_labels_and_a_queue(algorithm):
    n_q, n_k, d = 50, 300, 32
    q, k = features(n_q, d, seed=3), features(n_k, d, seed=4)
    labels = torch.randint(0, n_k, (n_q,), generator=torch.Generator().manual_seed(5))
    log_scale = torch.tensor(math.log(1 / 0.1))

    def ref(qq, kk, s):
        return F.cross_entropy(s * qq @ kk.t(), labels)

    ours = grads_of(lambda qq, kk, s: ct.InfoNCELoss(algorithm=algorithm)(qq, kk, s, labels), q, k, log_scale)
    want = grads_of(ref, q, k, log_scale)
    assert abs(float(ours[0]) - float(want[0])) <= 1e-5 * abs(float(want[0]))
    for a, b in zip(ours[1:], want[1:]):
        assert rel(a, b) <= 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("algorithm", ["fused", "materialized", "chunked"])
def test_16bit_within_rounding(dtype, tol, algorithm):
    n, d = 129, 64
    img, txt = features(n, d, dtype, seed=6), features(n, d, dtype, seed=7)
    log_scale = torch.tensor(math.log(1 / 0.07))
    ours = grads_of(ct.ClipLoss(algorithm=algorithm), img, txt, log_scale)
    # The reference sees the same rounded inputs, in float32.
    ref = grads_of(reference_clip, img.float(), txt.float(), log_scale)
    assert ours[1].dtype == dtype and ours[2].dtype == dtype
    assert abs(float(ours[0]) - float(ref[0])) <= tol * abs(float(ref[0]))
    for a, b in zip(ours[1:3], ref[1:3]):
        assert rel(a, b) <= tol
    assert rel(ours[3], ref[3]) <= 10 * tol


def test_training_loop_follows_pytorch():
    torch.manual_seed(0)
    d_in, d_out, n = 24, 16, 64

    def make():
        torch.manual_seed(1)
        towers = torch.nn.ModuleList([torch.nn.Linear(d_in, d_out), torch.nn.Linear(d_in, d_out)])
        log_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        opt = torch.optim.Adam(list(towers.parameters()) + [log_scale], lr=1e-2)
        return towers, log_scale, opt

    data = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, d_in, generator=data) for _ in range(50)]
    runs = []
    for loss_fn in (ct.ClipLoss(), reference_clip):
        towers, log_scale, opt = make()
        losses = []
        for x in xs:
            img = F.normalize(towers[0](x), dim=1)
            txt = F.normalize(towers[1](x + 0.1), dim=1)
            loss = loss_fn(img, txt, log_scale.exp())
            opt.zero_grad()
            loss.backward()
            opt.step()
            ct.clamp_logit_scale(log_scale)
            losses.append(loss.item())
        runs.append((losses, log_scale.item()))
    (ours, s_ours), (ref, s_ref) = runs
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 1e-4 * abs(b) + 1e-6
    assert abs(s_ours - s_ref) <= 1e-4


def test_scaled_backward_and_a_skipped_step():
    # GradScaler's protocol on CPU: backward of scale * loss; an overflowing step is found and skipped, and a
    # skipped step does not move logit_scale. fp16 materialized logits overflow at s = 1e5.
    n, d = 32, 16
    img, txt = features(n, d, torch.float16, seed=8), features(n, d, torch.float16, seed=9)
    log_scale = torch.nn.Parameter(torch.tensor(math.log(20.0)))
    loss_fn = ct.ClipLoss(algorithm="materialized")
    a = img.clone().requires_grad_()
    b = txt.clone().requires_grad_()
    (loss_fn(a, b, log_scale.exp()) * 1024.0).backward()
    scaled = a.grad.float() / 1024.0
    a2 = img.clone().requires_grad_()
    loss_fn(a2, txt, log_scale.exp()).backward()
    assert rel(scaled, a2.grad.float()) <= 5e-3
    assert loss_fn.last_step["first_nonfinite"] == "none"

    opt = torch.optim.SGD([log_scale], lr=0.1)
    big = torch.nn.Parameter(torch.tensor(math.log(1e5)))
    a3 = img.clone().requires_grad_()
    loss = loss_fn(a3, txt, big.exp())
    (loss * 1024.0).backward()
    assert loss_fn.last_step["first_nonfinite"] == "logits"
    found_inf = not all(torch.isfinite(g).all() for g in (a3.grad, big.grad))
    assert found_inf
    before = log_scale.item()
    if not found_inf:
        opt.step()
    assert log_scale.item() == before


def test_autocast_features():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(40, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        f = lin(x)
        img, txt = F.normalize(f.float(), dim=1).to(f.dtype), F.normalize(f.float() + 0.05, dim=1).to(f.dtype)
        loss = ct.ClipLoss()(img, txt, torch.tensor(10.0))
    loss.backward()
    assert img.dtype == torch.bfloat16
    assert torch.isfinite(lin.weight.grad).all() and lin.weight.grad.abs().sum() > 0


def test_freeze_then_learn():
    p = torch.nn.Parameter(torch.tensor(1.0))
    ct.freeze_then_learn(p, step=3, unfreeze_step=10)
    assert not p.requires_grad
    ct.freeze_then_learn(p, step=10, unfreeze_step=10)
    assert p.requires_grad


def test_features_of_any_strides_equal_their_contiguous_copies():
    # As open_clip's losses take them: transposed, column-strided and expanded features give the loss and gradients of
    # their contiguous copies (one copy inside the call), the gradients in the caller's layout; the caller's tensors
    # are not changed.
    wide = features(8, 16)
    pairs = (("transposed", features(4, 8).t(), features(8, 4)), ("strided", wide[:, ::2], wide[:, 1::2]),
             ("expanded", features(1, 4).expand(8, 4), features(8, 4)))
    calls = (lambda q, k, s: ct.ClipLoss()(q, k, s), lambda q, k, s: CF.siglip_loss(q, k, s, -2.0),
             lambda q, k, s: CF.info_nce_loss(q, k, s))
    for name, q0, k0 in pairs:
        for call in calls:
            before = (q0.clone(), k0.clone())
            runs = []
            for q, k in ((q0, k0), (q0.contiguous(), k0.contiguous())):
                q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
                s = torch.tensor(10.0, requires_grad=True)
                loss = call(q, k, s)
                loss.backward()
                runs.append((loss, q.grad, k.grad, s.grad))
                assert q.grad.shape == q.shape and k.grad.shape == k.shape
            for a, b in zip(*runs):
                assert torch.equal(a, b), name
            assert torch.equal(q0, before[0]) and torch.equal(k0, before[1])


def test_bad_inputs_raise():
    img, txt = features(8, 4), features(8, 4)
    s = torch.tensor(10.0)
    loss = ct.ClipLoss()
    with pytest.raises(ValueError, match="2-D"):
        loss(img[0], txt, s)
    with pytest.raises(TypeError, match="dtype"):
        loss(img.double(), txt.double(), s)
    with pytest.raises(TypeError, match="differ"):
        loss(img, txt.half(), s)
    with pytest.raises(ValueError, match="embedding sizes"):
        loss(img, features(8, 5), s)
    with pytest.raises(ValueError, match=r"image_features.shape\[0\] == text_features.shape\[0\]"):
        loss(img, features(9, 4), s)
    bad = img.clone()
    bad[3, 2] = float("nan")
    with pytest.raises(ValueError, match=r"image_features: image_features\[3\]\[2\] is not finite"):
        loss(bad, txt, s)
    with pytest.raises(ValueError, match="logit_scale"):
        loss(img, txt, torch.tensor(0.0))
    with pytest.raises(ValueError, match="logit_scale"):
        loss(img, txt, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="labels"):
        ct.InfoNCELoss()(img, txt, s, torch.tensor([0, 1, 2, 3, 4, 5, 6, 99]))
    with pytest.raises(ValueError, match="labels"):
        ct.InfoNCELoss()(img, txt, s, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="labels"):
        ct.InfoNCELoss()(img, txt, s, torch.zeros(8))
    with pytest.raises(ValueError, match="algorithm"):
        ct.ClipLoss(algorithm="magic")
    with pytest.raises(TypeError, match="fused_tiles"):
        ct.ClipLoss(algorithm="chunked", fused_tiles="yes")
    with pytest.raises(ValueError, match="empty|n_q = 0"):
        loss(features(8, 4)[:0], features(8, 4)[:0], s)
    # After every refusal the loss still works.
    assert math.isfinite(float(loss(img, txt, s)))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")


@needs_cuda
@pytest.mark.parametrize("algorithm", ["chunked", "fused", "materialized"])
def test_cuda_matches_reference(algorithm):
    img, txt = features(300, 64, seed=11).cuda(), features(300, 64, seed=12).cuda()
    log_scale = torch.tensor(math.log(20.0), device="cuda")
    ref = grads_of(reference_clip, img, txt, log_scale)
    fn = ct.ClipLoss(algorithm=algorithm)
    got = grads_of(fn, img, txt, log_scale)
    assert abs(float(got[0]) - float(ref[0])) <= 2e-5 * abs(float(ref[0]))
    for g, r in zip(got[1:], ref[1:]):
        assert rel(g, r) <= 1e-4
    assert int(fn.last_step["first_nonfinite_code"]) == 0


@needs_cuda
@pytest.mark.parametrize("fused_tiles", [False, True])
def test_cuda_bfloat16_and_the_incoming_gradient(fused_tiles):
    img, txt = features(256, 32, seed=13).cuda(), features(256, 32, seed=14).cuda()
    log_scale = torch.tensor(math.log(10.0), device="cuda")
    ref = grads_of(reference_clip, img, txt, log_scale)
    fn = ct.ClipLoss(algorithm="chunked", fused_tiles=fused_tiles)
    a = img.to(torch.bfloat16).requires_grad_()
    b = txt.to(torch.bfloat16).requires_grad_()
    s = log_scale.clone().requires_grad_()
    loss = fn(a, b, s.exp())
    (loss * 1024.0).backward()  # a GradScaler-like incoming gradient
    assert abs(float(loss) - float(ref[0])) <= 1e-2 * abs(float(ref[0]))
    assert rel(a.grad.float() / 1024.0, ref[1]) <= 2e-2
    assert rel(b.grad.float() / 1024.0, ref[2]) <= 2e-2


@needs_cuda
def test_cuda_bad_input_raises():
    img = features(8, 4).cuda()
    bad = img.clone()
    bad[0, 0] = float("nan")
    s = torch.tensor(10.0, device="cuda")
    out_of_range = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9], device="cuda")
    # 'fused' and 'materialized' read the values first (one synchronisation) and raise, naming the argument.
    with pytest.raises(ValueError, match="non-finite"):
        ct.ClipLoss(algorithm="fused")(bad, img, s)
    with pytest.raises(ValueError, match="labels"):
        ct.InfoNCELoss(algorithm="fused")(img, img, s, out_of_range)
    with pytest.raises(ValueError, match="logit_scale"):
        ct.ClipLoss(algorithm="materialized")(img, img, torch.tensor(-1.0, device="cuda"))
    # The sync-free algorithms (the default 'automatic', and 'chunked') never read a value on the host: the step
    # reports it (a NaN or infinite loss and the first non-finite site), as a diverged step does.
    for algorithm in (None, "chunked"):
        report = {}
        assert math.isnan(float(CF.clip_loss(bad, img, s, algorithm=algorithm, report=report)))
        assert CF.NONFINITE_SITES[int(report["first_nonfinite_code"])] == "logits"
        report = {}
        assert not math.isfinite(float(CF.info_nce_loss(img, img, s, out_of_range, algorithm=algorithm,
                                                        report=report)))
        assert int(report["first_nonfinite_code"]) != 0
        report = {}
        assert math.isnan(float(CF.clip_loss(img, img, torch.tensor(-1.0, device="cuda"), algorithm=algorithm,
                                             report=report)))
        assert CF.NONFINITE_SITES[int(report["first_nonfinite_code"])] == "logits"
    with pytest.raises(ValueError, match="devices"):
        ct.ClipLoss()(img, img.cpu(), torch.tensor(10.0))
