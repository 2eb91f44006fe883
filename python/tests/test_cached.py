# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""CachedStep (gradient caching) against the one-pass step on the same batch: every parameter's gradient, the logit
scale's and the bias's, for ClipLoss and SigLipLoss, with dropout (the reference draws the same per-chunk masks: it
runs the encoders chunk by chunk from the same random state, keeping every graph), float32, bfloat16 autocast and
float16 with a GradScaler; an open_clip model from open_clip's own classes; BatchNorm (per-chunk statistics, the known
difference); 2 gloo ranks under DDP; the errors. Differences are normwise relative, in multiples of the type's eps."""

import datetime
import gc
import json
import os
import traceback

import pytest
import torch
import torch.nn.functional as F

import contrastive_torch as ct
from conftest import require


pytestmark = pytest.mark.usefixtures("needs_custom_ops")


class Towers(torch.nn.Module):
    def __init__(self, d_in=24, d_out=16, dropout=0.2, norm=None):
        super().__init__()

        def tower():
            layers = [torch.nn.Linear(d_in, 48)]
            if norm == "batch":
                layers.append(torch.nn.BatchNorm1d(48))
            layers += [torch.nn.GELU(), torch.nn.Dropout(dropout), torch.nn.Linear(48, d_out)]
            return torch.nn.Sequential(*layers)

        self.visual, self.text = tower(), tower()
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.6593))
        self.logit_bias = torch.nn.Parameter(torch.tensor(-10.0))

    # open_clip's model interface (CachedStep's model form): encode_image/encode_text(normalize=...), and forward
    # returning (image features, text features, logit_scale.exp()).
    def encode_image(self, x, normalize=True):
        return F.normalize(self.visual(x), dim=-1)

    def encode_text(self, y, normalize=True):
        return F.normalize(self.text(y), dim=-1)

    def forward(self, image, text):
        return self.encode_image(image), self.encode_text(text), self.logit_scale.exp()


def batch(n, seed, d_in=24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    return x, x + 0.3 * torch.randn(n, d_in, generator=g)


def loss_args(model, sigmoid):
    return (model.logit_scale.exp(), model.logit_bias) if sigmoid else (model.logit_scale.exp(),)


def one_pass(model, loss_fn, x, y, chunk, sigmoid, scale=1.0):
    """The reference: the encoders chunk by chunk with a graph (the same random draws as CachedStep's passes), the loss
    on everything, one backward (of scale x loss)."""
    bounds = ct.cached._chunks(len(x), -(-len(x) // chunk), chunk)  # CachedStep's chunks (no one-row tail)
    parts = [(model.encode_image(x[a:b]), model.encode_text(y[a:b])) for a, b in bounds]
    f, g = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    loss = loss_fn(f, g, *loss_args(model, sigmoid))
    (loss * scale).backward()
    return loss.detach()


def grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def compare(make_loss, sigmoid, seed, n=40, chunk=7, dtype=None, scaler=False, norm=None, dropout=0.2, frozen=()):
    """(loss rel. difference, {parameter: rel. difference}) of CachedStep against one_pass, same seed and masks;
    the towers named in `frozen` ('visual', 'text') without trainable parameters in both."""
    torch.manual_seed(seed)
    ref_model = Towers(dropout=dropout, norm=norm)
    model = Towers(dropout=dropout, norm=norm)
    model.load_state_dict(ref_model.state_dict())
    for m in (ref_model, model):
        for tower in frozen:
            getattr(m, tower).requires_grad_(False)
    x, y = batch(n, seed + 1)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None else torch.autocast("cpu", enabled=False)
    scale = 1024.0 if scaler else 1.0
    torch.manual_seed(seed + 2)
    with autocast:
        want = one_pass(ref_model, make_loss(), x, y, chunk, sigmoid, scale)
    step = ct.CachedStep(lambda v: model.encode_image(v), lambda v: model.encode_text(v), make_loss(), chunk)
    torch.manual_seed(seed + 2)
    gs = torch.amp.GradScaler("cpu", init_scale=scale) if scaler else None
    with autocast:
        got = step(x, y, *loss_args(model, sigmoid), scaler=gs)
    after_step = torch.rand(()).item()  # the random state after the step: as after one pass
    probe = Towers(dropout=dropout, norm=norm)
    torch.manual_seed(seed + 2)
    with autocast:
        one_pass(probe, make_loss(), x, y, chunk, sigmoid)
    assert torch.rand(()).item() == after_step, "CachedStep left another random state than the one-pass step"
    want_grads, got_grads = grads(ref_model), grads(model)
    assert set(got_grads) == set(want_grads)
    return rel(got, want), {name: rel(got_grads[name], want_grads[name]) for name in want_grads}


CASES = [("clip", False, lambda: ct.ClipLoss()), ("siglip", True, lambda: ct.SigLipLoss())]


@pytest.mark.parametrize("name,sigmoid,make_loss", CASES)
def test_float32_equals_the_one_pass_step(name, sigmoid, make_loss, seed):
    eps = torch.finfo(torch.float32).eps
    for n, chunk in ((40, 7), (40, 40), (33, 16)):
        loss_err, errs = compare(make_loss, sigmoid, seed, n=n, chunk=chunk)
        assert loss_err <= 16 * eps, f"{name} n {n} chunk {chunk}: loss (seed {seed})"
        for p, err in errs.items():
            assert err <= 64 * eps, f"{name} n {n} chunk {chunk}: d {p} {err / eps:.1f} eps32 (seed {seed})"
        if sigmoid:
            assert "logit_bias" in errs
        assert "logit_scale" in errs


@pytest.mark.parametrize("name,sigmoid,make_loss", CASES)
def test_frozen_towers(name, sigmoid, make_loss, seed):
    # LiT (open_clip's lock_image) trains the text tower against a locked image tower: pass 2 back-propagates only
    # into towers with a graph; with both locked only the logit scale (and bias) learn.
    eps = torch.finfo(torch.float32).eps
    for frozen in (("visual",), ("text",), ("visual", "text")):
        loss_err, errs = compare(make_loss, sigmoid, seed, frozen=frozen)
        assert loss_err <= 16 * eps, f"{name} frozen {frozen}: loss (seed {seed})"
        assert not any(p.startswith(frozen) for p in errs), f"{name} frozen {frozen}: a locked tower got a gradient"
        assert "logit_scale" in errs
        for p, err in errs.items():
            assert err <= 64 * eps, f"{name} frozen {frozen}: d {p} {err / eps:.1f} eps32 (seed {seed})"


@pytest.mark.parametrize("name,sigmoid,make_loss", CASES)
def test_bfloat16_autocast_and_float16_with_a_grad_scaler(name, sigmoid, make_loss, seed):
    # 16-bit: the encoders' matmuls round to the type in both steps alike; the cached step adds no rounding of its
    # own but the features' concatenation order, so the bound is a few eps of the type.
    for dtype, scaler in ((torch.bfloat16, False), (torch.float16, True)):
        eps = torch.finfo(dtype).eps
        loss_err, errs = compare(make_loss, sigmoid, seed, dtype=dtype, scaler=scaler)
        assert loss_err <= 4 * eps, f"{name} {dtype}: loss (seed {seed})"
        for p, err in errs.items():
            assert err <= 8 * eps, f"{name} {dtype}: d {p} {err / eps:.2f} eps (seed {seed})"


def test_batchnorm_statistics_are_per_chunk(seed):
    # BatchNorm normalises each chunk by the chunk's statistics in both passes: the cached step equals the one-pass
    # step run chunk by chunk (the reference above), and differs from a whole-batch BatchNorm, the known difference.
    eps = torch.finfo(torch.float32).eps
    _, errs = compare(lambda: ct.ClipLoss(), False, seed, norm="batch", dropout=0.0)
    assert max(errs.values()) <= 256 * eps
    # 33 rows in chunks of 16: 16, 15 and 2 (BatchNorm refuses a chunk of one row in training).
    _, errs = compare(lambda: ct.ClipLoss(), False, seed, n=33, chunk=16, norm="batch", dropout=0.0)
    assert max(errs.values()) <= 256 * eps
    _, whole = compare(lambda: ct.ClipLoss(), False, seed, norm="batch", dropout=0.0, chunk=40)
    torch.manual_seed(seed)
    model = Towers(dropout=0.0, norm="batch")
    x, y = batch(40, seed + 1)
    step = ct.CachedStep(lambda v: model.encode_image(v), lambda v: model.encode_text(v), ct.ClipLoss(), 8)
    step(x, y, model.logit_scale.exp())
    chunked = grads(model)
    torch.manual_seed(seed)
    ref = Towers(dropout=0.0, norm="batch")
    one_pass(ref, ct.ClipLoss(), x, y, 40, False)
    assert rel(chunked["visual.0.weight"], grads(ref)["visual.0.weight"]) > 1e-3  # per-chunk statistics differ


def test_open_clip_model():
    # An open_clip model from open_clip's own classes (the installed package), small for the CPU, in the model form.
    open_clip = pytest.importorskip("open_clip")
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(0)
    cfg = dict(embed_dim=32, vision_cfg=CLIPVisionCfg(layers=2, width=64, head_width=32, patch_size=8, image_size=32),
               text_cfg=CLIPTextCfg(context_length=12, vocab_size=64, width=64, heads=2, layers=2))
    models = [CLIP(**cfg), CLIP(**cfg)]
    models[1].load_state_dict(models[0].state_dict())
    images = torch.randn(20, 3, 32, 32)
    texts = torch.randint(0, 64, (20, 12))
    ref = models[0]
    f, g, s = ref(images, texts)
    ct.ClipLoss()(f, g, s).backward()
    step = ct.CachedStep(models[1], ct.ClipLoss(), chunk_size=6)
    step(images, texts, models[1].logit_scale.exp())
    eps = torch.finfo(torch.float32).eps
    for (name, p), q in zip(models[1].named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        assert rel(p.grad, q.grad) <= 512 * eps, f"{name}: {rel(p.grad, q.grad) / eps:.1f} eps32"
    assert open_clip is not None


def scalar_scales(f, t, s, b, ids, sigmoid):
    """{parameter: the scale of its gradient's terms}, float64, for logit_scale (sum of |dL/dS_ij S_ij|) and
    logit_bias (sum of |dL/dS_ij|). Each of their gradients is a sum over the logits that cancels (here to a hundredth
    of its terms), so features that differ in their last bits (the towers run on other rows per call) move it by
    eps32 of its terms, not of itself."""
    from test_groups import reference_of_logits

    S = (float(s.detach()) * f.detach().double() @ t.detach().double().T).requires_grad_()
    loss = reference_of_logits("sigmoid" if sigmoid else "symmetric", S, ids["image_groups"], ids["text_groups"],
                               float(b.detach()) if sigmoid else 0.0)
    G, = torch.autograd.grad(loss, S)
    return {"logit_scale": float((G * S).abs().sum()), "logit_bias": float(G.abs().sum())}


def errors(ref, model, f, t, ids, sigmoid):
    """{parameter: relative difference of model's gradient from ref's}; the scalars' against their terms' scale
    (scalar_scales), the others' against their largest element. `f`, `t`: ref's features."""
    want_grads, got_grads = grads(ref), grads(model)
    assert set(got_grads) == set(want_grads)
    scales = scalar_scales(f, t, ref.logit_scale.exp(), ref.logit_bias if sigmoid else 0.0, ids, sigmoid)
    out = {}
    for p in want_grads:
        out[p] = rel(got_grads[p], want_grads[p])
        if p in scales:
            out[p] = float((got_grads[p] - want_grads[p]).abs().max()) / max(scales[p], 1e-300)
    return out


@pytest.mark.parametrize("name,sigmoid,make_loss", CASES)
def test_group_ids_and_towers_of_different_lengths(name, sigmoid, make_loss, seed):
    # Five captions per image (16 images, 80 texts), the ids through the loss's keywords: CachedStep against the
    # one-pass step on the whole batch (no dropout: the chunks' pairing of the two towers draws no masks), for chunk
    # sizes that split the shorter tower into uneven and empty chunks.
    eps = torch.finfo(torch.float32).eps
    torch.manual_seed(seed)
    base = Towers(dropout=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(16, 24, generator=g)
    y = x.repeat(5, 1) + 0.3 * torch.randn(80, 24, generator=g)
    ids = {"image_groups": torch.arange(16), "text_groups": torch.arange(80) % 16}
    for chunk in (7, 16, 32, 100):
        models = [Towers(dropout=0.0) for _ in range(2)]
        for m in models:
            m.load_state_dict(base.state_dict())
        ref, model = models
        f, t = ref.encode_image(x), ref.encode_text(y)
        want = make_loss()(f, t, *loss_args(ref, sigmoid), **ids)
        want.backward()
        step = ct.CachedStep(lambda v: model.encode_image(v), lambda v: model.encode_text(v), make_loss(), chunk)
        got = step(x, y, *loss_args(model, sigmoid), **ids)
        assert rel(got, want.detach()) <= 16 * eps, f"{name} chunk {chunk}: loss (seed {seed})"
        for p, err in errors(ref, model, f, t, ids, sigmoid).items():
            assert err <= 64 * eps, f"{name} chunk {chunk}: d {p} {err / eps:.1f} eps32 (seed {seed})"
    # The open_clip model form, one tower's rows missing from some chunks (model.encode_* run alone).
    models = [Towers(dropout=0.0) for _ in range(2)]
    for m in models:
        m.load_state_dict(base.state_dict())
    ref, model = models
    f, t = ref.encode_image(x), ref.encode_text(y)
    make_loss()(f, t, *loss_args(ref, sigmoid), **ids).backward()
    ct.CachedStep(model, make_loss(), 9)(x, y, *loss_args(model, sigmoid), **ids)
    for p, err in errors(ref, model, f, t, ids, sigmoid).items():
        assert err <= 64 * eps, f"{name} model form: d {p} {err / eps:.1f} eps32 (seed {seed})"


def test_errors_name_the_argument(monkeypatch):
    model = Towers()
    enc_i, enc_t = (lambda v: model.encode_image(v)), (lambda v: model.encode_text(v))
    x, y = batch(10, 1)
    s = model.logit_scale.exp()
    for bad in (0, -3, 2.5, "8"):
        with pytest.raises((ValueError, TypeError), match="chunk_size"):
            ct.CachedStep(enc_i, enc_t, ct.ClipLoss(), bad)
    step = ct.CachedStep(enc_i, enc_t, ct.ClipLoss(), 4)
    # Towers of different lengths without group ids: refused before any encoder runs.
    with pytest.raises(ValueError, match="texts: 9 rows where images has 10; without group ids"):
        step(x, y[:9], s)
    for name, args in (("images", (x[:0], y)), ("texts", (x, y[:0]))):
        with pytest.raises(ValueError, match=name):
            step(*args, s)
    with pytest.raises(TypeError, match="image_encoder"):
        ct.CachedStep(lambda v: (model.encode_image(v), 1), enc_t, ct.ClipLoss(), 4)(x, y, s)
    with pytest.raises(TypeError, match="text_encoder"):
        ct.CachedStep(enc_i, lambda v: model.encode_text(v)[0], ct.ClipLoss(), 4)(x, y, s)
    with pytest.raises(TypeError, match="model"):
        ct.CachedStep(torch.nn.Linear(3, 3), ct.ClipLoss())
    with pytest.raises(TypeError, match="text_encoder"):
        ct.CachedStep(enc_i, "text", ct.ClipLoss())

    class Wrapped(torch.nn.Module):  # a DDP-like wrapper around an open_clip-like model, without no_sync
        def __init__(self, module):
            super().__init__()
            self.module = module

    from contrastive_torch import cached

    monkeypatch.setattr(cached, "_is_ddp", lambda m: isinstance(m, Wrapped))
    with pytest.raises(TypeError, match="no_sync"):
        ct.CachedStep(Wrapped(model), ct.ClipLoss())
    assert model.visual[0].weight.grad is None  # nothing ran


def test_refused_group_ids_run_no_encoder():
    # Ids the loss would refuse are refused before pass 1: no encoder runs, so BatchNorm's running statistics, the
    # random generator and the module's last_step stay as they were.
    model = Towers(norm="batch")
    enc_i, enc_t = (lambda v: model.encode_image(v)), (lambda v: model.encode_text(v))
    x, y = batch(8, 2)
    y = y.repeat(2, 1)  # two captions per image
    ig, tg = torch.arange(8), torch.arange(16) % 8
    s, b = model.logit_scale.exp(), model.logit_bias
    stats, rng = model.visual[1].running_mean.clone(), torch.get_rng_state()
    cases = [
        (ct.ClipLoss(), (s,), {"image_groups": ig[:4], "text_groups": tg}, ValueError, r"image_groups: expected shape"),
        (ct.ClipLoss(), (s,), {"image_groups": ig, "text_groups": tg.float()}, TypeError, "text_groups: dtype"),
        (ct.ClipLoss(), (s,), {"image_groups": ig}, ValueError, "text_groups: None"),
        (ct.ClipLoss(), (s,), {"image_groups": None, "text_groups": None}, ValueError, "texts: 16 rows"),
        (ct.ClipLoss(), (s,), {"query_groups": ig, "key_groups": tg}, TypeError, "loss: ClipLoss takes"),
        (ct.SigLipLoss(), (s, b), {"image_groups": ig, "text_groups": tg[:9]}, ValueError, "text_groups: expected"),
        (ct.InfoNCELoss(), (s, torch.arange(8)), {"query_groups": ig, "key_groups": tg}, ValueError,
         "labels: given with"),
    ]
    for loss, args, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            ct.CachedStep(enc_i, enc_t, loss, 4)(x, y, *args, **kwargs)
        assert torch.equal(model.visual[1].running_mean, stats), match
        assert torch.equal(torch.get_rng_state(), rng), match
        assert not loss.last_step, match
    assert all(p.grad is None for p in model.parameters())
    ct.CachedStep(enc_i, enc_t, ct.ClipLoss(), 4)(x, y, s, image_groups=ig, text_groups=tg)  # the good call runs


# --- 2 gloo ranks under DDP: the global batch, against the one-pass DDP step -----------------------------------------


def _ddp_worker(rank, world, port, seed, out_dir):
    failures = []
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        x, y = batch(16 * world, seed)
        mine = slice(16 * rank, 16 * (rank + 1))
        torch.manual_seed(seed)
        base = Towers(dropout=0.0)
        results = []
        for cached in (False, True):
            model = Towers(dropout=0.0)
            model.load_state_dict(base.state_dict())
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            loss_fn = ct.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
            if cached:  # the model form: DDP's forward per chunk, no_sync for all but the last
                loss = ct.CachedStep(ddp, loss_fn, 5)(x[mine], y[mine], model.logit_scale.exp())
            else:
                f, g, s = ddp(x[mine], y[mine])
                loss = loss_fn(f, g, s)
                loss.backward()
            results.append((float(loss), grads(model)))
        (l0, g0), (l1, g1) = results
        eps = torch.finfo(torch.float32).eps
        if abs(l0 - l1) > 16 * eps * abs(l0):
            failures.append(f"rank {rank}: loss {l1} vs {l0}")
        for name in g0:
            if rel(g1[name], g0[name]) > 256 * eps:
                failures.append(f"rank {rank}: d {name} {rel(g1[name], g0[name]) / eps:.1f} eps32 (seed {seed})")
        # The DDP wrappers hold the process group (one through the CachedStep's own reference cycle): freed before the
        # group is destroyed, or a ProcessGroupGloo alive at interpreter exit aborts the rank (std::terminate).
        del ddp, loss_fn, loss, f, g, s
        gc.collect()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the test
        failures.append(f"rank {rank}: {traceback.format_exc()}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"failures": failures}, f)


def test_ddp_over_gloo_equals_the_one_pass_step(seed, tmp_path):
    import torch.distributed as dist

    from test_distributed import run_ranks

    require("distributed", dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo")
    failures = [f for got in run_ranks(_ddp_worker, 2, seed, tmp_path, join_timeout=180) for f in got["failures"]]
    assert not failures, "\n".join(failures)


def test_distill_clip_loss_equals_the_one_pass_step(seed):
    """DistillClipLoss through CachedStep (the teacher's features of the whole batch as loss arguments) against the
    one-pass step: its tuple of terms is summed. CoCaLoss is refused by name."""
    eps = torch.finfo(torch.float32).eps
    torch.manual_seed(seed)
    ref_model, model = Towers(), Towers()
    model.load_state_dict(ref_model.state_dict())
    x, y = batch(33, seed + 1)
    g = torch.Generator().manual_seed(seed + 3)
    t_img, t_txt = (F.normalize(torch.randn(33, 12, generator=g), dim=1) for _ in range(2))
    teacher = (t_img, t_txt, torch.tensor(30.0))
    torch.manual_seed(seed + 2)
    bounds = ct.cached._chunks(33, -(-33 // 8), 8)
    parts = [(ref_model.encode_image(x[a:b]), ref_model.encode_text(y[a:b])) for a, b in bounds]
    f, t = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    want = sum(ct.DistillClipLoss()(f, t, ref_model.logit_scale.exp(), *teacher))
    want.backward()
    torch.manual_seed(seed + 2)
    step = ct.CachedStep(lambda v: model.encode_image(v), lambda v: model.encode_text(v), ct.DistillClipLoss(), 8)
    got = step(x, y, model.logit_scale.exp(), *teacher)
    assert rel(got, want.detach()) <= 16 * eps
    want_grads, got_grads = grads(ref_model), grads(model)
    assert set(got_grads) == set(want_grads) and "logit_scale" in got_grads
    for name in want_grads:
        assert rel(got_grads[name], want_grads[name]) <= 64 * eps, f"d {name} (seed {seed})"
    with pytest.raises(TypeError, match="loss: CoCaLoss's captioning term"):
        ct.CachedStep(lambda v: model.encode_image(v), lambda v: model.encode_text(v), ct.CoCaLoss(1.0, 1.0), 8)
