# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""DistillClipLoss against open_clip's own DistillClipLoss and a float64 reference of its definition: both terms,
every gradient (the student's features and scale, the teacher's where they ask), chunkings that split the rows,
16-bit features, autocast, open_clip's factory, refusals, and the global batch over 2 gloo ranks (against one
process on the concatenated batch and against open_clip's distributed DistillClipLoss).

Differences are normwise relative (test_open_clip.py's rel); tolerances are multiples of the type's eps."""

import importlib
import itertools
import json
import os

import pytest
import torch
import torch.nn.functional as F

import contrastive_torch as ct
from contrastive_torch import _distill
from conftest import require
from test_open_clip import open_clip_args, open_clip_loss, rel  # noqa: F401 - the fixture

EPS32 = torch.finfo(torch.float32).eps
NAMES = ("contrastive_loss", "distill_loss", "d image_features", "d text_features", "d dist_image_features",
         "d dist_text_features", "d logit_scale", "d dist_logit_scale")


def _draw(n, d, d_teacher, seed, pairing=0.5):
    """Student (d) and teacher (d_teacher) unit features of one batch; each text leans towards its image, and the
    teacher's features are a rotation of the student's plus noise (a teacher that roughly agrees)."""
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(n, d, generator=g), dim=1)
    txt = F.normalize(torch.randn(n, d, generator=g) + pairing * img, dim=1)
    mix = torch.randn(d, d_teacher, generator=g)
    t_img = F.normalize(img @ mix + 0.3 * torch.randn(n, d_teacher, generator=g), dim=1)
    t_txt = F.normalize(txt @ mix + 0.3 * torch.randn(n, d_teacher, generator=g), dim=1)
    return img, txt, t_img, t_txt


def _run(fn, inputs, s, t, teacher_grads=True, **kw):
    """Both terms and every gradient: (contrastive, distill, dI, dT, dI', dT', ds, dt)."""
    xs = [x.detach().clone().requires_grad_(i < 2 or teacher_grads) for i, x in enumerate(inputs)]
    s = torch.tensor(float(s), requires_grad=True)
    t = torch.tensor(float(t), requires_grad=teacher_grads)
    out = fn(xs[0], xs[1], s, xs[2], xs[3], t, **kw)
    contrastive, distill = (out["contrastive_loss"], out["distill_loss"]) if isinstance(out, dict) else out
    (contrastive + distill).backward()
    return [contrastive.detach(), distill.detach()] + [x.grad for x in xs] + [s.grad, t.grad]


def _reference(inputs, s, t):
    """open_clip's definition in float64 with autograd: (contrastive, distill, dI, dT, dI', dT', ds, dt)."""
    xs = [x.detach().double().requires_grad_() for x in inputs]
    s64 = torch.tensor(float(s), dtype=torch.float64, requires_grad=True)
    t64 = torch.tensor(float(t), dtype=torch.float64, requires_grad=True)
    S = s64 * xs[0] @ xs[1].t()
    U = t64 * xs[2] @ xs[3].t()
    labels = torch.arange(S.shape[0])
    contrastive = (F.cross_entropy(S, labels) + F.cross_entropy(S.t(), labels)) / 2

    def ce(teacher, student):
        return -(teacher.softmax(1) * student.log_softmax(1)).sum(1).mean()

    distill = (ce(U, S) + ce(U.t(), S.t())) / 2
    (contrastive + distill).backward()
    return [contrastive.detach(), distill.detach()] + [x.grad for x in xs] + [s64.grad, t64.grad]


@pytest.mark.parametrize("chunk", [None, 7 * 40], ids=["one_chunk", "chunks_of_7_rows"])
def test_distill_is_open_clips(open_clip_loss, chunk, monkeypatch, seed):
    """float32 against open_clip's DistillClipLoss (teacher of another width, teacher gradients on), and both against
    float64; output_dict; rows split into chunks of 7 (the last one short)."""
    if chunk is not None:
        monkeypatch.setattr(_distill, "CHUNK_ELEMENTS", chunk)
    inputs = _draw(40, 16, 24, seed)
    ours = _run(ct.DistillClipLoss(), inputs, 17.0, 25.0)
    as_dict = _run(ct.DistillClipLoss(), inputs, 17.0, 25.0, output_dict=True)
    theirs = _run(open_clip_loss.DistillClipLoss(), inputs, 17.0, 25.0)
    exact = _reference(inputs, 17.0, 25.0)
    # d dist_logit_scale is a sum that cancels: measured against the size of its terms.
    t_terms = _teacher_scale_terms(inputs, 17.0, 25.0)
    for name, a, b, c, x in zip(NAMES, ours, theirs, exact, as_dict):
        assert a.dtype == b.dtype, f"{name}: {a.dtype} vs open_clip's {b.dtype}"
        assert torch.equal(a, x), f"{name}: output_dict differs"
        def err(y):
            return float((a.double() - y.double()).abs()) / t_terms if name == NAMES[7] else rel(a, y)
        assert err(c) <= 64 * EPS32, f"{name}: {err(c) / EPS32:.1f} eps32 from float64 (seed {seed})"
        assert err(b) <= 256 * EPS32, f"{name}: {err(b) / EPS32:.1f} eps32 from open_clip (seed {seed})"
    # A teacher without gradients (open_clip_train's, computed under no_grad) gets none.
    frozen = _run(ct.DistillClipLoss(), inputs, 17.0, 25.0, teacher_grads=False)
    assert frozen[4] is None and frozen[5] is None and frozen[7] is None
    for name, a, b in zip(NAMES[:4], frozen, ours):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("scales", [(100.0, 100.0), (50.0, 200.0)], ids=["clamp_100", "teacher_200"])
@pytest.mark.parametrize("chunk", [None, 7 * 40], ids=["one_chunk", "chunks_of_7_rows"])
def test_distill_at_large_scales_as_accurate_as_open_clip(open_clip_loss, scales, chunk, monkeypatch, seed):
    """At open_clip's clamp of the logit scale (100) and a teacher beyond it, float32, 16 draws: each output's median
    error from float64 within 3x open_clip's float32 median (each log-sum-exp is kept as (shift, log of the sum):
    their float32 sum would put |logit| x eps into every probability, 5x open_clip's error on the teacher's
    gradients). A draw's error against open_clip's varies about 3x either way; over 150 draws the two medians are
    within 10% of each other, and resampled 16 at a time their ratio stayed below 2.8 in 20000 tries (below 4.1 for 8
    draws, which made 2x at 8 draws fail one run in 30)."""
    if chunk is not None:
        monkeypatch.setattr(_distill, "CHUNK_ELEMENTS", chunk)
    s, t = scales
    errors = {"ours": [], "open_clip": []}
    for draw in range(16):
        inputs = _draw(40, 16, 24, seed + draw)
        exact = _reference(inputs, s, t)
        t_terms = _teacher_scale_terms(inputs, s, t)
        for who, fn in (("ours", ct.DistillClipLoss()), ("open_clip", open_clip_loss.DistillClipLoss())):
            got = _run(fn, inputs, s, t)
            errors[who].append([float((a.double() - c).abs()) / t_terms if name == NAMES[7] else rel(a, c)
                                for name, a, c in zip(NAMES, got, exact)])
    ours, theirs = (torch.tensor(errors[who]).median(0).values for who in ("ours", "open_clip"))
    for name, a, b in zip(NAMES, ours.tolist(), theirs.tolist()):
        assert a <= 3 * b + 2 * EPS32, f"{name}: median {a / EPS32:.1f} eps32 from float64, open_clip's " \
            f"{b / EPS32:.1f} (s {s}, t {t}, seed {seed})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_distill_16bit_against_float64(dtype, seed):
    """16-bit features: the distillation term and its gradients within a few eps of the type from float64 on the
    same 16-bit values (the logits are float32 from exact products; the gradients are rounded once)."""
    inputs = [x.to(dtype) for x in _draw(33, 16, 8, seed)]
    got = _run(ct.DistillClipLoss(), inputs, 30.0, 50.0)
    exact = _reference(inputs, 30.0, 50.0)
    eps = torch.finfo(dtype).eps
    # d dist_logit_scale is a sum that cancels (it can be 1e-4 of its terms): measured against their size.
    t_terms = _teacher_scale_terms(inputs, 30.0, 50.0)
    for name, a, b in zip(NAMES, got, exact):
        if name in ("contrastive_loss", "distill_loss"):
            assert a.dtype == dtype, f"{name}: {a.dtype}: open_clip's loss for {dtype} features is {dtype}"
        # The scales' gradients are float32 but carry the contrastive term's 16-bit rounding of its dS.
        err = float((a.double() - b.double()).abs()) / t_terms if name == NAMES[7] else rel(a, b)
        assert err <= 4 * eps, f"{name}: {err / eps:.2f} eps of {dtype} from float64 (seed {seed})"


def test_distill_under_autocast(seed):
    """float32 features in a CPU bfloat16 autocast region run at bfloat16, as the library's losses do."""
    inputs = _draw(24, 16, 16, seed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(ct.DistillClipLoss(), inputs, 20.0, 20.0)
    cast = _run(ct.DistillClipLoss(), [x.bfloat16() for x in inputs], 20.0, 20.0)
    # The same float32 values, rounded once: the contrastive term float32 in the region, the distillation term
    # bfloat16 there (open_clip's: CPU autocast runs its softmax at the region's dtype; CUDA's in float32).
    assert got[0].dtype == torch.float32 and torch.equal(got[0].bfloat16(), cast[0])
    assert got[1].dtype == torch.bfloat16 and torch.equal(got[1], cast[1])
    # The two terms' bfloat16 gradients meet in float32 in the region (each cast back first), in bfloat16 outside.
    eps = torch.finfo(torch.bfloat16).eps
    for name, a, b in zip(NAMES[2:], got[2:], cast[2:]):
        assert a.dtype == torch.float32 and rel(a, b) <= 2 * eps, f"{name}: {rel(a, b) / eps:.2f} eps"


@pytest.mark.parametrize("region", [None, torch.bfloat16, torch.float16], ids=["no_autocast", "bf16", "fp16"])
def test_distill_dtypes_are_open_clips(open_clip_loss, region, seed):
    """Both terms' dtypes equal open_clip's for every student x teacher dtype, outside and inside CPU autocast."""
    inputs = _draw(8, 8, 4, seed)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    region_of = (lambda: torch.autocast("cpu", dtype=region)) if region else (
        lambda: torch.autocast("cpu", enabled=False))
    for student, teacher in itertools.product(dtypes, dtypes):
        args = [inputs[0].to(student), inputs[1].to(student), torch.tensor(10.0), inputs[2].to(teacher),
                inputs[3].to(teacher), torch.tensor(20.0)]
        with region_of():
            ours = ct.DistillClipLoss()(*args)
            theirs = open_clip_loss.DistillClipLoss()(*args)
        assert [x.dtype for x in ours] == [x.dtype for x in theirs], (student, teacher, region)


def test_distill_from_open_clips_factory_and_refusals(open_clip_loss, monkeypatch, seed):
    if os.environ.get("CONTRASTIVE_OPEN_CLIP_LOSS"):
        pytest.skip("CONTRASTIVE_OPEN_CLIP_LOSS: the factory is the installed package's, not that loss.py's")
    factory = importlib.import_module("open_clip.factory")
    assert type(factory.create_loss(open_clip_args(distill=True))) is open_clip_loss.DistillClipLoss
    monkeypatch.setattr(factory, "DistillClipLoss", ct.DistillClipLoss)
    loss_fn = factory.create_loss(open_clip_args(distill=True))
    assert isinstance(loss_fn, ct.DistillClipLoss) and loss_fn.cache_labels is True
    img, txt, t_img, t_txt = _draw(12, 8, 8, seed)
    s = torch.tensor(10.0)
    # A strided teacher is taken (only PyTorch operations read it).
    assert torch.equal(loss_fn(img, txt, s, t_img.t().contiguous().t(), t_txt, s)[1],
                       loss_fn(img, txt, s, t_img, t_txt, s)[1])
    before = loss_fn.last_step
    for call, kind, name in (
            (lambda: loss_fn(img, txt, s, t_img[:5], t_txt, s), ValueError, "dist_image_features"),
            (lambda: loss_fn(img, txt, s, t_img, t_txt[:, :3], s), ValueError, "dist_text_features: embedding"),
            (lambda: loss_fn(img, txt, s, t_img.double(), t_txt.double(), s), TypeError, "dist_image_features"),
            (lambda: loss_fn(img, txt, s, t_img, t_txt, "10"), TypeError, "dist_logit_scale"),
            (lambda: loss_fn(img, txt, s, t_img, t_txt, torch.ones(2)), ValueError, "dist_logit_scale"),
            (lambda: loss_fn(img, txt[:5], s, t_img, t_txt, s), ValueError,
             "^text_features: 5 rows where image_features has 12"),
            (lambda: loss_fn(img, txt, s, t_img.to_sparse(), t_txt, s), TypeError,
             "dist_image_features: layout torch.sparse_coo"),
            # On CPU tensors the teacher's values are refused as the student's are (the student's by the engine).
            *((lambda v=v: loss_fn(img, txt, s, t_img, t_txt, v), ValueError, "^dist_logit_scale: must be finite")
              for v in (0.0, -1.0, float("nan"), float("inf"))),
            (lambda: loss_fn(img, txt, s, t_img, t_txt.index_put((torch.tensor(3), torch.tensor(2)),
                                                                   torch.tensor(float("nan"))), s),
             ValueError, r"^dist_text_features: dist_text_features\[3\]\[2\] is not finite")):
        with pytest.raises(kind, match=name):
            call()
        assert loss_fn.last_step is before, "a refused call changed last_step"
    # Differentiable once, as the library's operators: a second derivative through the distillation term raises
    # (it would drop the kept gradients' own dependence on the inputs), naming it.
    x = img.clone().requires_grad_()
    g, = torch.autograd.grad(loss_fn(x, txt, s, t_img, t_txt, s)[1], x, create_graph=True)
    with pytest.raises(RuntimeError, match="DistillClipLoss's distillation term: the loss is differentiable once"):
        (g ** 2).sum().backward()


def _teacher_scale_terms(inputs, s, t):
    """sum over the pairs of |the terms of d distill / d dist_logit_scale| (float64): the size its sum cancels from."""
    img, txt, t_img, t_txt = (x.double() for x in inputs)
    S, raw = s * img @ txt.t(), t_img @ t_txt.t()
    total = 0.0
    for a, u in ((S, raw), (S.t(), raw.t())):
        p, lsm = torch.softmax(t * u, 1), torch.log_softmax(a, 1)
        total += float((p * (lsm - (p * lsm).sum(1, keepdim=True)) * u).abs().sum()) / (2 * a.shape[0])
    return total


def _worker(rank, world, port, seed, out_dir):
    """Each rank: ours over the group against one process on the whole batch, and against open_clip's distributed
    DistillClipLoss, for every (local_loss, gather_with_grad); then a refusal on rank 1 raised on both ranks."""
    from test_distributed import checker, start_gloo, stop_gloo

    checks, failures, check = checker(rank)
    try:
        import torch.distributed as dist

        start_gloo(rank, world, port)
        oc = importlib.import_module("open_clip.loss")
        n = 5
        inputs = _draw(n * world, 16, 12, seed)
        mine = slice(rank * n, (rank + 1) * n)
        whole = _run(ct.DistillClipLoss(), inputs, 12.0, 20.0)
        t_terms = _teacher_scale_terms(inputs, 12.0, 20.0)
        local_inputs = [x[mine] for x in inputs]

        def mean_over_ranks(x):
            x = x.detach().double().clone()
            dist.all_reduce(x)
            return x / world

        for local_loss, gwg in itertools.product((False, True), repeat=2):
            c = world if (local_loss or gwg) else 1
            got = _run(ct.DistillClipLoss(local_loss=local_loss, gather_with_grad=gwg, rank=rank, world_size=world),
                       local_inputs, 12.0, 20.0)
            theirs = _run(oc.DistillClipLoss(local_loss=local_loss, gather_with_grad=gwg, rank=rank,
                                             world_size=world), local_inputs, 12.0, 20.0)
            setting = f"local_loss={local_loss} gather_with_grad={gwg}"
            for i, name in enumerate(NAMES):
                want = whole[i] if i < 2 or i > 5 else whole[i][mine] * c
                # d dist_logit_scale is a sum that cancels: bounded against the size of its terms.
                err = (float((got[i] - want).abs()) / t_terms if i == 7 else rel(got[i], want))
                check(err <= 256 * EPS32, f"{setting}: {name} {err / EPS32:.1f} eps32 from one process")
            # open_clip's value per rank is the global loss, or with local_loss this rank's share (their mean is it).
            for i in (0, 1):
                check(rel(got[i], mean_over_ranks(theirs[i])) <= 256 * EPS32,
                      f"{setting}: {NAMES[i]} against open_clip's mean over ranks")
        # A refusal on one rank is raised on every rank, naming it; then the ranks still compute together.
        bad = [x[:3] if (rank == 1 and i == 2) else x for i, x in enumerate(local_inputs)]
        try:
            _run(ct.DistillClipLoss(rank=rank, world_size=world), bad, 12.0, 20.0)
            check(False, "a teacher with too few rows on rank 1 was accepted")
        except ValueError as e:
            check("dist_image_features: rank 1" in str(e), f"refusal names the argument and rank: {e}")
        try:
            _run(ct.DistillClipLoss(rank=rank, world_size=world), local_inputs, 12.0, 20.0 + rank)
            check(False, "a teacher scale that differs between the ranks was accepted")
        except ValueError as e:
            check("dist_logit_scale: rank 1" in str(e), f"refusal names the teacher's scale and rank: {e}")
        again = _run(ct.DistillClipLoss(rank=rank, world_size=world), local_inputs, 12.0, 20.0)
        check(rel(again[1], whole[1]) <= 256 * EPS32, "a valid call after the refusals")
        # CoCaLoss over the group: the contrastive term is the global batch's, the captioning term this rank's (as
        # open_clip's); labels refused on rank 1 only are refused on every rank, before any term runs.
        g = torch.Generator().manual_seed(seed + 7)
        logits = torch.randn(n * world, 4, 9, generator=g)
        labels = torch.randint(0, 9, (n * world, 4), generator=g)
        coca = ct.CoCaLoss(2.0, 1.0, rank=rank, world_size=world)
        clip, caption = coca(*local_inputs[:2], logits[mine], labels[mine], torch.tensor(12.0))
        check(rel(clip, ct.ClipLoss()(*inputs[:2], torch.tensor(12.0))) <= 256 * EPS32, "CoCa: contrastive term")
        want = 2.0 * F.cross_entropy(logits[mine].permute(0, 2, 1), labels[mine], ignore_index=0)
        check(rel(caption, want) <= 16 * EPS32, "CoCa: captioning term")
        mine_labels = labels[mine]
        for bad, name in ((mine_labels.float() if rank == 1 else mine_labels, "labels: rank 1: dtype"),
                          (mine_labels + 9 * rank, "labels: rank 1")):
            try:
                coca(*local_inputs[:2], logits[mine], bad, torch.tensor(12.0))
                check(False, f"CoCa: bad labels on rank 1 accepted ({name})")
            except (TypeError, ValueError) as e:
                check(name in str(e), f"CoCa: refusal names the labels and rank: {e}")
        stop_gloo()  # the refusals' tracebacks hold the group: collected before it is destroyed
    except Exception as e:  # reported to the parent
        failures.append(f"rank {rank}: {type(e).__name__}: {e}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"checks": checks[0], "failures": failures}, f)


def test_distill_and_coca_over_two_gloo_ranks(seed, tmp_path):
    import torch.distributed as dist

    require("distributed", dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo")
    from test_distributed import run_ranks

    reports = run_ranks(_worker, 2, seed, tmp_path)
    failures = [f for got in reports for f in got["failures"]]
    assert not failures, "\n".join(failures[:20])
    # 4 settings x (8 against one process + 2 against open_clip) + 2 refusals + the call after them, and CoCa's
    # 2 terms and 2 refusals, on every rank.
    assert [got["checks"] for got in reports] == [4 * (8 + 2) + 3 + 4] * 2
