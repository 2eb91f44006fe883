# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Several positives per row from group ids (clip_loss / siglip_loss image_groups, text_groups; info_nce_loss
query_groups, key_groups): against a float64 reference written with torch's own ops, per algorithm and dtype; ids
that give one positive per row equal to the one-positive loss bit for bit; the modules; opcheck and torch.compile;
the refusals; and 2 gloo ranks whose positives lie on the other rank, over both exchanges."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

import contrastive_torch as ct
import contrastive_torch.functional as CF
from conftest import require

pytestmark = pytest.mark.usefixtures("needs_custom_ops")

ALGORITHMS = (None, "fused", "materialized", "chunked")


def unit(n, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g), dim=1).to(dtype)


def draw_ids(n_q, n_k, seed, kind):
    """'captions': query i is image i, keys its five captions (n_k = 5 n_q, shuffled); 'random': ids in [0, n_q / 3)
    on both sides (duplicates, rows without a positive); 'none': no positive pair."""
    g = torch.Generator().manual_seed(seed)
    if kind == "captions":
        return torch.arange(n_q) * 3 + 1, ((torch.arange(n_k) % n_q) * 3 + 1)[torch.randperm(n_k, generator=g)]
    if kind == "random":
        hi = max(2, n_q // 3)
        return torch.randint(0, hi, (n_q,), generator=g), torch.randint(0, hi, (n_k,), generator=g)
    return torch.arange(n_q), torch.arange(n_k) + n_q


def reference(objective, q, k, s, qg, kg, b=0.0):
    """The loss in float64 from its definition (docs/multi_positive.md), differentiable by torch."""
    return reference_of_logits(objective, s * q.double() @ k.double().T, qg, kg, b)


def reference_of_logits(objective, S, qg, kg, b=0.0):
    """reference()'s loss as a function of the logits S = s Q K^T (float64), for their gradient G."""
    pos = qg[:, None] == kg[None, :]
    if objective == "sigmoid":
        return -F.logsigmoid((2 * pos.double() - 1) * (S + b)).sum() / S.shape[0]

    def direction(L, p):
        has = p.any(1)
        if not bool(has.any()):
            return L.sum() * 0
        return (torch.logsumexp(L, 1) - (L * p).sum(1) / p.sum(1).clamp(min=1))[has].mean()

    if objective == "info_nce":
        return direction(S, pos)
    return (direction(S, pos) + direction(S.T, pos.T)) / 2


def call(objective, q, k, s, qg, kg, b=None, **kw):
    if objective == "symmetric":
        return CF.clip_loss(q, k, s, image_groups=qg, text_groups=kg, **kw)
    if objective == "info_nce":
        return CF.info_nce_loss(q, k, s, query_groups=qg, key_groups=kg, **kw)
    return CF.siglip_loss(q, k, s, b, image_groups=qg, text_groups=kg, **kw)


def run(objective, q, k, s, qg, kg, b=None, **kw):
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    s = torch.tensor(float(s), requires_grad=True)
    b = None if b is None else torch.tensor(float(b), requires_grad=True)
    loss = call(objective, q, k, s, qg, kg, b, **kw)
    loss.backward()
    return loss.detach(), q.grad, k.grad, s.grad, None if b is None else b.grad


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("objective", ["symmetric", "info_nce", "sigmoid"])
@pytest.mark.parametrize("kind", ["captions", "random", "none"])
def test_matches_the_float64_reference(objective, algorithm, dtype, kind):
    if objective == "sigmoid" and algorithm == "materialized":
        algorithm = "fused"  # siglip_loss takes None, 'fused' or 'chunked' on the CPU
    n_q, n_k = (12, 60) if kind == "captions" else (40, 33)
    q, k = unit(n_q, 24, 1, dtype), unit(n_k, 24, 2, dtype)
    qg, kg = draw_ids(n_q, n_k, 3, kind)
    s, b = 12.0, (-4.0 if objective == "sigmoid" else None)
    loss, dq, dk, ds, db = run(objective, q, k, s, qg, kg, b, algorithm=algorithm)
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    s64 = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    b64 = torch.tensor(b or 0.0, dtype=torch.float64, requires_grad=True)
    want = reference(objective, q64, k64, s64, qg, kg, b64)
    want.backward()
    if kind == "none" and objective != "sigmoid":
        assert float(loss) == 0.0 and not dq.any() and not dk.any() and float(ds) == 0.0
        return
    u = torch.finfo(dtype).eps / 2
    # Loss: float accumulation, plus (bfloat16, algorithm 'materialized') logits rounded to bfloat16.
    want = want.detach()
    assert abs(float(loss) - float(want)) <= (1e-5 + 8 * u * s) * (1 + abs(float(want))), (float(loss), float(want))
    for name, got, ref in (("dq", dq, q64.grad), ("dk", dk, k64.grad)):
        assert got.dtype == dtype
        assert rel(got, ref) <= 1e-4 + 16 * u * (1 + s / 4), f"{name}: {rel(got, ref)}"
    assert abs(float(ds) - float(s64.grad)) <= 1e-3 + 32 * u * s * (1 + abs(float(s64.grad)))
    if objective == "sigmoid":
        assert abs(float(db) - float(b64.grad)) <= 1e-3 + 32 * u * s * (1 + abs(float(b64.grad)))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("objective", ["symmetric", "info_nce", "sigmoid"])
def test_one_positive_per_row_is_the_one_positive_loss_bit_for_bit(objective, algorithm):
    if objective == "sigmoid" and algorithm == "materialized":
        algorithm = "chunked"
    n = 50
    q, k = unit(n, 16, 4), unit(n, 16, 5)
    ids = torch.randperm(n, generator=torch.Generator().manual_seed(6)) * 7  # distinct, equal on the diagonal
    grouped = run(objective, q, k, 9.0, ids, ids.clone(), -2.0 if objective == "sigmoid" else None,
                  algorithm=algorithm)
    s = torch.tensor(9.0, requires_grad=True)
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    if objective == "symmetric":
        loss = CF.clip_loss(qq, kk, s, algorithm=algorithm)
    elif objective == "info_nce":
        loss = CF.info_nce_loss(qq, kk, s, torch.arange(n), algorithm=algorithm)
    else:
        b = torch.tensor(-2.0, requires_grad=True)
        loss = CF.siglip_loss(qq, kk, s, b, algorithm=algorithm)
    loss.backward()
    for got, want in zip(grouped, (loss.detach(), qq.grad, kk.grad, s.grad)):
        assert torch.equal(got, want)


def test_the_false_negative_effect():
    # Five captions per image, every caption close to its image. With labels (caption i of image i on the diagonal)
    # the other four captions of an image are negatives: the loss pushes them away from their own image. With group
    # ids they are positives: the loss is at its floor (log 5, the entropy of the uniform target) and barely moves them.
    n_img, d = 8, 32
    img = unit(n_img, d, 7)
    txt = F.normalize(img.repeat(5, 1) + 0.05 * unit(5 * n_img, d, 8), dim=1)
    ids = torch.arange(n_img)
    t1, t2 = txt.clone().requires_grad_(), txt.clone().requires_grad_()
    grouped = CF.info_nce_loss(img, t1, 20.0, query_groups=ids, key_groups=ids.repeat(5))
    labelled = CF.info_nce_loss(img, t2, 20.0, torch.arange(n_img))
    grouped.backward()
    labelled.backward()
    others = slice(n_img, 5 * n_img)  # the captions that labels call negatives
    assert abs(grouped.item() - float(torch.log(torch.tensor(5.0)))) < 0.05
    assert float(t1.grad[others].norm()) < 0.1 * float(t2.grad[others].norm())


def test_modules_take_the_same_keywords():
    img, txt = unit(6, 8, 9), unit(18, 8, 10)
    ig, tg = torch.arange(6), torch.arange(18) % 6
    assert torch.equal(ct.ClipLoss()(img, txt, 10.0, image_groups=ig, text_groups=tg),
                       CF.clip_loss(img, txt, 10.0, image_groups=ig, text_groups=tg))
    assert torch.equal(ct.SigLipLoss()(img, txt, 10.0, -3.0, image_groups=ig, text_groups=tg),
                       CF.siglip_loss(img, txt, 10.0, -3.0, image_groups=ig, text_groups=tg))
    assert torch.equal(ct.InfoNCELoss()(img, txt, 10.0, query_groups=ig, key_groups=tg),
                       CF.info_nce_loss(img, txt, 10.0, query_groups=ig, key_groups=tg))
    out = ct.ClipLoss()(img, txt, 10.0, output_dict=True, image_groups=ig, text_groups=tg)
    assert set(out) == {"contrastive_loss"}


def test_refusals_name_the_argument():
    img, txt = unit(6, 8, 11), unit(6, 8, 12)
    ids = torch.arange(6)
    with pytest.raises(ValueError, match="text_groups: None"):
        CF.clip_loss(img, txt, 10.0, image_groups=ids)
    with pytest.raises(ValueError, match="query_groups: None"):
        CF.info_nce_loss(img, txt, 10.0, key_groups=ids)
    with pytest.raises(ValueError, match="labels: given with"):
        CF.info_nce_loss(img, txt, 10.0, ids, query_groups=ids, key_groups=ids)
    with pytest.raises(ValueError, match=r"text_groups: expected shape \(6,\)"):
        CF.clip_loss(img, txt, 10.0, image_groups=ids, text_groups=torch.arange(5))
    with pytest.raises(TypeError, match="image_groups: dtype torch.float32"):
        CF.siglip_loss(img, txt, 10.0, image_groups=ids.float(), text_groups=ids)
    with pytest.raises(TypeError, match="key_groups: expected a torch.Tensor"):
        CF.info_nce_loss(img, txt, 10.0, query_groups=ids, key_groups=[0, 1, 2, 3, 4, 5])
    # Without ids the symmetric loss still needs as many texts as images.
    with pytest.raises(ValueError, match="text_features: the symmetric loss needs image_features.shape.0. == "
                                         "text_features.shape.0. .*group ids"):
        CF.clip_loss(img, unit(7, 8, 13), 10.0)


def test_the_operators_check_the_ids_layout():
    # The operators read the ids (and labels) through raw pointers: called directly, without the functions' checks, a
    # short tensor would be read past its end and a strided one in the wrong order. Both are refused.
    q, k, s = unit(6, 8, 25), unit(6, 8, 26), torch.tensor(5.0)
    ids = torch.arange(6) % 3
    strided = (torch.arange(12) % 3)[::2]
    softmax = torch.ops.contrastive_torch.grouped_softmax_step
    sigmoid = torch.ops.contrastive_torch.grouped_sigmoid_step
    for qg, kg, match in ((ids[:3], ids, r"query_groups: expected shape \(6,\)"),
                          (ids, ids[:5], r"key_groups: expected shape \(6,\)"),
                          (ids[None], ids, r"query_groups: expected shape \(6,\)"),
                          (strided, ids, "query_groups: not contiguous"),
                          (ids, ids.int(), "key_groups: expected int64")):
        with pytest.raises(ValueError, match=match):
            softmax(q, k, s, qg, kg, True, "fused", 0, False)
        with pytest.raises(ValueError, match=match):
            sigmoid(q, k, s, torch.tensor(-1.0), qg, kg, "fused", 0, False)
    with pytest.raises(ValueError, match=r"labels: expected shape \(6,\)"):
        torch.ops.contrastive_torch.softmax_step(q, k, s, torch.arange(3, dtype=torch.int32), False, "fused", 0,
                                                 False, False)
    with pytest.raises(ValueError, match="k: dtype or embedding size"):
        softmax(q, unit(6, 4, 27), s, ids, ids, True, "fused", 0, False)


def test_the_extension_refuses_tensors_on_another_device():
    # The bindings read every tensor through a raw pointer at q's device: one elsewhere (here on the meta device, no
    # storage) is refused naming it before anything is read, on the host binding as on the CUDA one.
    from contrastive_torch import _host
    q, k, s = unit(6, 8, 28), unit(6, 8, 29), 5.0
    ids, labels = torch.arange(6) % 3, torch.arange(6, dtype=torch.int32)
    meta = lambda t: t.to("meta")
    for kw, match in (({"k": meta(k)}, "k: on meta, expected q's device cpu"),
                      ({"labels32": meta(labels)}, "labels: on meta, expected q's device cpu"),
                      ({"query_groups": meta(ids), "key_groups": ids}, "query_groups: on meta"),
                      ({"query_groups": ids, "key_groups": meta(ids)}, "key_groups: on meta")):
        args = {"k": k, "labels32": None, **kw}
        groups = {n: args.pop(n) for n in ("query_groups", "key_groups") if n in args}
        for objective in ("symmetric", "sigmoid"):
            with pytest.raises(ValueError, match=match):
                _host.step(q, args["k"], s, -1.0 if objective == "sigmoid" else 0.0, args["labels32"], objective,
                           "fused", 0, True, **groups)


def test_a_refused_call_keeps_the_modules_last_step():
    img, txt = unit(6, 8, 21), unit(12, 8, 22)
    ig, tg = torch.arange(6), torch.arange(12) % 6
    for module, kw in ((ct.ClipLoss(), ("image_groups", "text_groups")), (ct.SigLipLoss(), ("image_groups",
                                                                                           "text_groups")),
                       (ct.InfoNCELoss(), ("query_groups", "key_groups"))):
        module(img, txt, 10.0, **{kw[0]: ig, kw[1]: tg})
        kept = module.last_step
        assert kept["first_nonfinite"] == "none"
        for bad in ({kw[0]: ig}, {kw[0]: ig[:5], kw[1]: tg}, {kw[0]: ig.float(), kw[1]: tg}):
            with pytest.raises((ValueError, TypeError)):
                module(img, txt, 10.0, **bad)
            assert module.last_step is kept and kept["first_nonfinite"] == "none"
    module = ct.InfoNCELoss()
    module(img, txt, 10.0, query_groups=ig, key_groups=tg)
    kept = module.last_step
    with pytest.raises(ValueError, match="labels: given with"):
        module(img, txt, 10.0, torch.arange(6), query_groups=ig, key_groups=tg)
    assert module.last_step is kept


def test_float16_takes_ids_made_under_inference_mode():
    # As float32 and bfloat16 do (and int32 ids, copied to int64 before the step): float16, whose backward keeps the
    # ids for its rerun under a loss scale, keeps a copy of ids autograd cannot save.
    q, k = unit(6, 8, 23, torch.float16), unit(9, 8, 24, torch.float16)
    with torch.inference_mode():
        qg, kg = torch.arange(6) % 4, torch.arange(9) % 3
    want = run("symmetric", q, k, 5.0, qg.clone(), kg.clone())
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    loss = CF.clip_loss(qq, kk, 5.0, image_groups=qg, text_groups=kg)
    loss.backward()
    assert torch.equal(loss.detach(), want[0]) and torch.equal(qq.grad, want[1]) and torch.equal(kk.grad, want[2])
    qq.grad = kk.grad = None
    (CF.clip_loss(qq, kk, 5.0, image_groups=qg, text_groups=kg) * 1024.0).backward()  # the rerun
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    (reference("symmetric", q64, k64, 5.0, qg, kg) * 1024.0).backward()
    assert rel(qq.grad, q64.grad) <= 4e-3 and rel(kk.grad, k64.grad) <= 4e-3


def test_opcheck_and_compile():
    q, k = unit(10, 8, 14), unit(25, 8, 15)
    qg, kg = draw_ids(10, 25, 16, "random")
    s, b = torch.tensor(9.0), torch.tensor(-2.0)
    leaves = lambda *xs: tuple(x.clone().requires_grad_() for x in xs)  # noqa: E731
    for algorithm in ("fused", "materialized", "chunked"):
        torch.library.opcheck(torch.ops.contrastive_torch.grouped_softmax_step.default,
                              (*leaves(q, k, s), qg, kg, True, algorithm, 0, True))
        torch.library.opcheck(torch.ops.contrastive_torch.grouped_softmax_step.default,
                              (q, k, s, qg, kg, False, algorithm, 1, False))
    for algorithm in ("fused", "chunked"):
        torch.library.opcheck(torch.ops.contrastive_torch.grouped_sigmoid_step.default,
                              (*leaves(q, k, s, b), qg, kg, algorithm, 0, True))

    def step(q, k, s):
        return CF.clip_loss(q, k, s, image_groups=qg, text_groups=kg)

    eager = run("symmetric", q, k, 9.0, qg, kg)
    compiled = torch.compile(step, fullgraph=True)
    qq, kk, ss = leaves(q, k, torch.tensor(9.0))
    loss = compiled(qq, kk, ss)
    loss.backward()
    for got, want in zip((loss.detach(), qq.grad, kk.grad, ss.grad), eager):
        assert torch.equal(got, want)


def test_float16_under_a_loss_scale_reruns_with_the_ids():
    # float16 features' backward under an incoming gradient g != 1 reruns the step at loss scale g: with the ids.
    q, k = unit(16, 8, 17, torch.float16), unit(30, 8, 18, torch.float16)
    qg, kg = draw_ids(16, 30, 19, "random")
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    (CF.info_nce_loss(qq, kk, 10.0, query_groups=qg, key_groups=kg) * 1024.0).backward()
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    (reference("info_nce", q64, k64, 10.0, qg, kg) * 1024.0).backward()
    assert rel(qq.grad, q64.grad) <= 4e-3 and rel(kk.grad, k64.grad) <= 4e-3


# --- two gloo ranks ------------------------------------------------------------------------------------------------


def _worker(rank, world, port, seed, out_dir):
    failures, checks = [], [0]
    try:
        import datetime

        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        n_img, n_txt = 5, 11  # per rank: rectangular, ids that pair rows across ranks
        img, txt = unit(n_img * world, 16, seed), unit(n_txt * world, 16, seed + 1)
        ig, tg = draw_ids(n_img * world, n_txt * world, seed + 2, "random")
        mi, mt = slice(rank * n_img, (rank + 1) * n_img), slice(rank * n_txt, (rank + 1) * n_txt)
        from contrastive_torch import _ops

        host_kernels = (_ops.grouped_softmax_step_cpu, _ops.grouped_sigmoid_step_cpu, _ops.feature_grads_cpu)
        # Both exchanges: the library's engine and torch's all-gather with the one-process step (CUDA's default),
        # the latter also with the CUDA kernels' composition (_grouped) in place of the host engine, as CUDA runs it.
        for exchange, composed in (("engine", False), ("gather", False), ("gather", True)):
            _ops.grouped_softmax_step_cpu, _ops.grouped_sigmoid_step_cpu, _ops.feature_grads_cpu = (
                (_ops.grouped_softmax_step_cuda, _ops.grouped_sigmoid_step_cuda, _ops.feature_grads_cuda)
                if composed else host_kernels)
            exchange_name = exchange + (" (composition)" if composed else "")
            for objective in ("symmetric", "sigmoid"):
                b = -3.0 if objective == "sigmoid" else None
                got = run(objective, img[mi], txt[mt], 8.0, ig[mi], tg[mt], b, group=dist.group.WORLD,
                          exchange=exchange)
                i64, t64 = img.double().requires_grad_(), txt.double().requires_grad_()
                s64 = torch.tensor(8.0, dtype=torch.float64, requires_grad=True)
                b64 = torch.tensor(b or 0.0, dtype=torch.float64, requires_grad=True)
                want = reference(objective, i64, t64, s64, ig, tg, b64)
                want.backward()
                # The features' gradients carry the group's size (grad_ranks' default), the scalars' do not.
                pairs = [("loss", got[0], want.detach()), ("d image", got[1], world * i64.grad[mi]),
                         ("d text", got[2], world * t64.grad[mt]), ("d logit_scale", got[3], s64.grad)]
                if b is not None:
                    pairs.append(("d logit_bias", got[4], b64.grad))
                for name, a, w in pairs:
                    checks[0] += 1
                    if rel(a, w) > 1e-5:
                        failures.append(f"rank {rank}: {exchange_name} {objective} {name}: {rel(a, w)}")
            # Only rank 1's images have a positive (on rank 0): rank 0's image term weighs 0, its texts carry all.
            # No positive anywhere: loss 0, zero gradients.
            lone = (torch.arange(n_img * world) + 1000, torch.arange(n_txt * world) + 5000)
            lone[0][n_img] = lone[1][0] = 7
            for name, (qg, kg) in (("one positive pair", lone), ("no positive", draw_ids(n_img * world,
                                                                                        n_txt * world, 0, "none"))):
                got = run("symmetric", img[mi], txt[mt], 8.0, qg[mi], kg[mt], group=dist.group.WORLD,
                          exchange=exchange)
                i64, t64 = img.double().requires_grad_(), txt.double().requires_grad_()
                s64 = torch.tensor(8.0, dtype=torch.float64, requires_grad=True)
                want = reference("symmetric", i64, t64, s64, qg, kg)
                want.backward()
                for part, a, w in (("loss", got[0], want.detach()), ("d image", got[1], world * i64.grad[mi]),
                                   ("d text", got[2], world * t64.grad[mt]), ("d logit_scale", got[3], s64.grad)):
                    checks[0] += 1
                    bad = (a.abs().max() != 0) if name == "no positive" else (rel(a, w) > 1e-5)
                    if bool(bad):
                        failures.append(f"rank {rank}: {exchange_name} {name} {part}: {a} against {w}")
        _ops.grouped_softmax_step_cpu, _ops.grouped_sigmoid_step_cpu, _ops.feature_grads_cpu = host_kernels
        # Ids let a rank's towers differ in length, not vanish: a rank without texts is refused on every rank, by
        # name, over both exchanges (the gather once refused on that rank alone and left the other in a collective),
        # and the group still serves the next call.
        for exchange in ("engine", "gather"):
            for objective in ("symmetric", "sigmoid"):
                texts, b = slice(0, 0) if rank == 1 else mt, -3.0 if objective == "sigmoid" else None
                try:
                    run(objective, img[mi], txt[texts], 8.0, ig[mi], tg[texts], b, group=dist.group.WORLD,
                        exchange=exchange)
                    failures.append(f"rank {rank}: {exchange} {objective}: a rank without texts was not refused")
                except ValueError as e:
                    checks[0] += 1
                    if not str(e).startswith("text_features: rank 1: no rows on this rank"):
                        failures.append(f"rank {rank}: {exchange} {objective}: refusal reads {e}")
            got = run("symmetric", img[mi], txt[mt], 8.0, ig[mi], tg[mt], group=dist.group.WORLD, exchange=exchange)
            checks[0] += 1
            if not bool(torch.isfinite(got[0])):
                failures.append(f"rank {rank}: {exchange}: the call after the refusal gave {got[0]}")
        # One rank without ids: refused on every rank, naming the rank.
        try:
            CF.clip_loss(img[mi], txt[mt], 8.0, group=dist.group.WORLD, image_groups=ig[mi] if rank == 0 else None,
                         text_groups=tg[mt] if rank == 0 else None)
            failures.append(f"rank {rank}: a call with ids on one rank only was not refused")
        except ValueError as e:
            checks[0] += 1
            if "rank 1" not in str(e):
                failures.append(f"rank {rank}: refusal does not name rank 1: {e}")
        from test_distributed import stop_gloo

        stop_gloo()  # the refusals' tracebacks hold the group: collected before it is destroyed
    except Exception as e:  # reported, not raised: the parent reads the report
        failures.append(f"rank {rank}: {type(e).__name__}: {e}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"failures": failures, "checks": checks[0]}, f)


def test_two_gloo_ranks(seed, tmp_path):
    import torch.distributed as dist

    require("distributed", dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo")
    from test_distributed import run_ranks

    reports = run_ranks(_worker, 2, seed, tmp_path)
    failures = [f for got in reports for f in got["failures"]]
    assert not failures, "\n".join(failures[:20])
    assert [got["checks"] for got in reports] == [58, 58]


def test_ids_changed_or_made_under_inference_mode_are_fine():
    # Every dtype's backward uses the forward's ids: ids changed in place after the forward, or made under
    # torch.inference_mode(), are fine (float32 and bfloat16 do not save them; float16 keeps its own copy for its
    # rerun under a loss scale).
    q, k = unit(6, 5, 31), unit(6, 5, 32)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ids = torch.arange(6) % 3
        a = q.to(dtype).clone().requires_grad_()
        want = CF.clip_loss(a, k.to(dtype), 3.0, image_groups=ids.clone(), text_groups=ids.clone())
        (want * 1024.0).backward()
        b = q.to(dtype).clone().requires_grad_()
        got = CF.clip_loss(b, k.to(dtype), 3.0, image_groups=ids, text_groups=ids)
        ids.fill_(0)
        (got * 1024.0).backward()
        assert torch.equal(got.detach(), want.detach()) and torch.equal(b.grad, a.grad), dtype
        with torch.inference_mode():
            frozen = torch.arange(6) % 3
        c = q.to(dtype).clone().requires_grad_()
        (CF.clip_loss(c, k.to(dtype), 3.0, image_groups=frozen, text_groups=frozen) * 1024.0).backward()
        assert torch.equal(c.grad, a.grad), dtype


# --- the CUDA kernels' composition (contrastive_torch._grouped), run here on CPU tensors ---------------------------


def _composition(objective, q, k, s, b, qg, kg, grads=True, loss_scale=1.0):
    from contrastive_torch import _grouped

    return _grouped.step(q, k, torch.tensor(s), torch.tensor(b), qg, kg, objective, grads, loss_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("objective", ["symmetric", "info_nce", "sigmoid"])
@pytest.mark.parametrize("kind", ["captions", "random", "none"])
def test_the_cuda_composition_matches_float64_and_the_host_engine(objective, dtype, kind, seed, monkeypatch):
    from contrastive_torch import _grouped

    n_q, n_k = (12, 60) if kind == "captions" else (40, 33)
    q, k = unit(n_q, 24, seed, dtype), unit(n_k, 24, seed + 1, dtype)
    qg, kg = draw_ids(n_q, n_k, seed + 2, kind)
    s, b = 12.0, -4.0
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    s64 = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    b64 = torch.tensor(b, dtype=torch.float64, requires_grad=True)
    want = reference(objective, q64, k64, s64, qg, kg, b64)
    want.backward()
    want = want.detach()
    u = torch.finfo(dtype).eps / 2
    whole = None
    for rows in (n_q, 7, 1):  # one chunk, several (the last one short), one row each
        monkeypatch.setattr(_grouped, "CHUNK_ELEMENTS", rows * n_k)
        loss, dq, dk, dlogs, dbias, max_logit, site = _composition(objective, q, k, s, b, qg, kg)
        assert (loss.dtype, dq.dtype, dk.dtype, dlogs.dtype, site.dtype) == (torch.float32, dtype, dtype,
                                                                             torch.float64, torch.int32)
        assert int(site) == 0 and (dbias is not None) == (objective == "sigmoid"), (site, seed)
        if kind == "none" and objective != "sigmoid":
            assert float(loss) == 0.0 and not dq.any() and not dk.any() and float(dlogs) == 0.0
            continue
        # Logits and their statistics in float32 from the features as given; dQ and dK rounded once (bfloat16: dS
        # rounded before the products, as the host's chunked path does).
        assert abs(float(loss) - float(want)) <= 2e-6 * (1 + abs(float(want))), (float(loss), float(want), seed)
        grad_tol = 1e-5 if dtype == torch.float32 else 4 * u
        for name, got, ref in (("dq", dq, q64.grad), ("dk", dk, k64.grad)):
            assert rel(got, ref) <= grad_tol, (name, rel(got, ref), seed)
        assert abs(float(dlogs) - s * float(s64.grad)) <= 1e-5 * (1 + abs(s * float(s64.grad))), seed
        if objective == "sigmoid":
            assert abs(float(dbias) - float(b64.grad)) <= 1e-5 * (1 + abs(float(b64.grad))), seed
        S = s * (q.double() @ k.double().T) + (b if objective == "sigmoid" else 0.0)
        assert abs(float(max_logit) - float(S.max())) <= 1e-5 * float(S.abs().max()), seed
        if whole is None:
            whole = (loss, dq, dk, dlogs)
        else:  # the chunking changes only summation order
            assert abs(float(loss) - float(whole[0])) <= 1e-6 * (1 + abs(float(whole[0])))
    # The host engine on the same inputs (the CPU kernel of the same operator).
    if objective == "sigmoid":
        host = torch.ops.contrastive_torch.grouped_sigmoid_step(q, k, torch.tensor(s), torch.tensor(b), qg, kg,
                                                                "chunked", 0, True)
    else:
        host = torch.ops.contrastive_torch.grouped_softmax_step(q, k, torch.tensor(s), qg, kg,
                                                                objective == "symmetric", "chunked", 0, True)
    got = _composition(objective, q, k, s, b, qg, kg)
    assert abs(float(got[0]) - float(host[0])) <= 2e-6 * (1 + abs(float(host[0])))
    for a, h in ((got[1], host[1]), (got[2], host[2])):
        assert rel(a, h) <= (1e-5 if dtype == torch.float32 else 4 * u) or (not h.any() and not a.any())


def test_the_cuda_composition_reads_no_value_on_the_host():
    # No .item(), no data-dependent shape (unique, nonzero, boolean indexing): each would synchronise a CUDA stream.
    from torch.utils._python_dispatch import TorchDispatchMode

    syncing = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten._unique2.default, torch.ops.aten.unique_dim.default,
               torch.ops.aten.masked_select.default, torch.ops.aten.index.Tensor}

    class NoReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            assert func not in syncing, f"{func} reads a value on the host"
            return func(*args, **(kwargs or {}))

    q, k = unit(20, 8, 40), unit(30, 8, 41)
    qg, kg = draw_ids(20, 30, 42, "random")
    for objective in ("symmetric", "info_nce", "sigmoid"):
        with NoReads():
            out = _composition(objective, q, k, 10.0, -3.0, qg, kg)
        assert int(out[-1]) == 0 and torch.isfinite(out[0])


@pytest.mark.parametrize("objective", ["symmetric", "info_nce", "sigmoid"])
def test_the_cuda_composition_reports_what_the_host_refuses(objective):
    # As the device's sync-free step: no exception; a NaN or infinite loss and the first non-finite site 'logits'.
    q, k = unit(10, 8, 43), unit(10, 8, 44)
    qg, kg = draw_ids(10, 10, 45, "random")
    bad_q = q.clone()
    bad_q[3, 2] = float("inf")
    for args in ((q, k, 0.0, -1.0), (q, k, -2.0, -1.0), (q, k, float("nan"), -1.0), (bad_q, k, 5.0, -1.0)) + (
            ((q, k, 5.0, float("inf")),) if objective == "sigmoid" else ()):
        loss, dq, dk, dlogs, dbias, max_logit, site = _composition(objective, *args[:2], args[2], args[3], qg, kg)
        assert not torch.isfinite(loss) and ct.NONFINITE_SITES[int(site)] == "logits", (args[2:], loss, site)


def test_the_cuda_kernels_behind_the_functions_and_the_modules(monkeypatch):
    # The functions, the modules and their autograd formulas with the CPU kernels routed to the CUDA ones: the
    # composition's results where the host engine's were, float16's rerun under a loss scale included.
    from contrastive_torch import _ops

    q, k = unit(16, 12, 46), unit(40, 12, 47)
    qg, kg = draw_ids(16, 40, 48, "captions")
    qs, ks = unit(24, 12, 49), unit(24, 12, 50)
    sg, sk = draw_ids(24, 24, 51, "random")
    host = {o: run(o, *(q, k, 9.0, qg, kg) if o != "symmetric" else (qs, ks, 9.0, sg, sk),
                   -2.0 if o == "sigmoid" else None) for o in ("symmetric", "info_nce", "sigmoid")}
    monkeypatch.setattr(_ops, "grouped_softmax_step_cpu", _ops.grouped_softmax_step_cuda)
    monkeypatch.setattr(_ops, "grouped_sigmoid_step_cpu", _ops.grouped_sigmoid_step_cuda)
    monkeypatch.setattr(_ops, "feature_grads_cpu", _ops.feature_grads_cuda)
    for objective, want in host.items():
        args = (q, k, 9.0, qg, kg) if objective != "symmetric" else (qs, ks, 9.0, sg, sk)
        got = run(objective, *args, -2.0 if objective == "sigmoid" else None)
        for g, w in zip(got, want):
            if w is not None:
                assert rel(g, w) <= 1e-5, objective
    module = ct.ClipLoss()
    qq, kk = qs.clone().requires_grad_(), ks.clone().requires_grad_()
    module(qq, kk, torch.tensor(9.0), image_groups=sg, text_groups=sk).backward()
    assert rel(qq.grad, host["symmetric"][1]) <= 1e-5 and rel(kk.grad, host["symmetric"][2]) <= 1e-5
    # float16 under a loss scale: feature_grads reruns the composition at that scale, with the ids.
    h, hk = q.half().requires_grad_(), k.half().requires_grad_()
    (CF.info_nce_loss(h, hk, 10.0, query_groups=qg, key_groups=kg) * 4096.0).backward()
    q64, k64 = q.half().double().requires_grad_(), k.half().double().requires_grad_()
    (reference("info_nce", q64, k64, 10.0, qg, kg) * 4096.0).backward()
    assert rel(h.grad, q64.grad) <= 4e-3 and rel(hk.grad, k64.grad) <= 4e-3


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("objective", ["symmetric", "info_nce", "sigmoid"])
def test_cuda_group_ids_match_the_host_engine(objective, dtype):
    # CUDA tensors run the composition: the host engine's results on the same inputs, CPU ids copied over.
    q, k = unit(96, 32, 60, dtype), unit(200, 32, 61, dtype)
    qg, kg = draw_ids(96, 200, 62, "random")
    if objective == "symmetric":
        k, kg = k[:96], kg[:96]
    b = -3.0 if objective == "sigmoid" else None
    want = run(objective, q, k, 11.0, qg, kg, b)
    got = run(objective, q.cuda(), k.cuda(), 11.0, qg, kg.cuda(), b)
    u = torch.finfo(dtype).eps / 2
    assert abs(float(got[0]) - float(want[0])) <= 2e-6 * (1 + abs(float(want[0])))
    for g, w in zip(got[1:3], want[1:3]):
        assert g.device.type == "cuda" and rel(g.cpu(), w) <= (1e-5 if dtype == torch.float32 else 4 * u)
    for g, w in zip(got[3:], want[3:]):
        if w is not None:
            assert abs(float(g) - float(w)) <= 1e-5 * (1 + abs(float(w)))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("objective", ["symmetric", "sigmoid"])
def test_cuda_group_ids_step_is_captured_by_a_cuda_graph(objective, dtype):
    # No host synchronisation with every input on the device: a CUDA graph captures the grouped forward and backward,
    # and its replay equals eager. (float16's backward reads the incoming gradient on the host, as every float16 step.)
    q, k = unit(64, 16, 63, dtype).cuda(), unit(64, 16, 64, dtype).cuda()
    qg, kg = (x.cuda() for x in draw_ids(64, 64, 65, "random"))
    s, b = torch.tensor(10.0, device="cuda"), torch.tensor(-3.0, device="cuda")
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()

    def step():
        qq.grad = kk.grad = None
        if objective == "symmetric":
            loss = CF.clip_loss(qq, kk, s, image_groups=qg, text_groups=kg)
        else:
            loss = CF.siglip_loss(qq, kk, s, b, image_groups=qg, text_groups=kg)
        loss.backward()
        return loss.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            eager = step()
    torch.cuda.current_stream().wait_stream(side)
    eager_grads = (qq.grad.clone(), kk.grad.clone())
    graph = torch.cuda.CUDAGraph()
    qq.grad = kk.grad = None
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert torch.equal(qq.grad, eager_grads[0]) and torch.equal(kk.grad, eager_grads[1])


def test_the_cuda_composition_equals_the_host_engine_on_random_draws(seed, monkeypatch):
    # Shapes from one row up, ids from a small range (duplicates, rows without a positive), every objective and
    # dtype, chunks of any size: the composition against float64, at least as close as the host engine on the same
    # inputs, and the host's loss, scalars and diagnosis.
    from contrastive_torch import _grouped

    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # noqa: E731
    for trial in range(40):
        objective = ("symmetric", "info_nce", "sigmoid")[trial % 3]
        dtype = (torch.float32, torch.bfloat16, torch.float16)[draw(0, 2)]
        n_q, n_k, d = draw(1, 30), draw(1, 30), draw(1, 12)
        q, k = unit(n_q, d, seed + 2 * trial, dtype), unit(n_k, d, seed + 2 * trial + 1, dtype)
        hi = draw(1, 8)
        qg, kg = torch.randint(0, hi, (n_q,), generator=g), torch.randint(0, hi, (n_k,), generator=g)
        s, b = torch.tensor(float(draw(1, 40))), torch.tensor(float(draw(-8, 2)))
        monkeypatch.setattr(_grouped, "CHUNK_ELEMENTS", draw(1, n_q) * n_k)
        got = _grouped.step(q, k, s, b, qg, kg, objective, True)
        if objective == "sigmoid":
            want = torch.ops.contrastive_torch.grouped_sigmoid_step(q, k, s, b, qg, kg, "fused", 1, True)
        else:
            want = torch.ops.contrastive_torch.grouped_softmax_step(q, k, s, qg, kg, objective == "symmetric",
                                                                    "fused", 1, True)
        q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
        s64, b64 = s.double().requires_grad_(), b.double().requires_grad_()
        reference(objective, q64, k64, s64, qg, kg, b64).backward()
        # The scale of each gradient's terms, s sum_j |G_ij| |k_j| (and the transpose): with d = 1 and ties a
        # gradient can cancel to float64's noise, which no float32 sum reproduces relative to itself.
        S = (float(s) * q.double() @ k.double().T).requires_grad_()
        G, = torch.autograd.grad(reference_of_logits(objective, S, qg, kg, float(b)), S)
        terms = (float(s) * float((G.abs() @ k.double().abs()).max()),
                 float(s) * float((G.abs().T @ q.double().abs()).max()))
        where = f"trial {trial} seed {seed}: {objective} {dtype} n_q {n_q} n_k {n_k} d {d} ids < {hi}"
        u = torch.finfo(dtype).eps / 2
        assert abs(float(got[0]) - float(want[0])) <= 4e-6 * (1 + abs(float(want[0]))), where
        for a, w, ref, scale in zip(got[1:3], want[1:3], (q64.grad, k64.grad), terms):
            assert a.dtype == w.dtype and a.shape == w.shape, where
            # Absolute errors against float64. Allowed: one rounding to the dtype of the largest element (float16:
            # and two of its subnormal steps, 2^-24, where a converged batch's gradients fall), float32 sums off by a
            # few eps32 of the terms' scale (bfloat16: its dS rounded, u of the terms), or no further than the host.
            # The terms' scale matters where the gradient cancels (d = 1 and ties give float64's noise).
            def off(x):
                return float((x.double() - ref).abs().max())

            allowed = ((2e-5 if dtype == torch.float32 else 4 * u) * float(ref.abs().max())
                       + (16 * 2.0**-23 + (2 * u if dtype == torch.bfloat16 else 0.0)) * scale
                       + (2 * 2.0**-24 if dtype == torch.float16 else 0.0))
            assert off(a) <= max(allowed, 1.5 * off(w)), (where, off(a), off(w), allowed)
        # The scalars against float64 too: the host forms 16-bit steps' from dS rounded to the dtype (off by u of
        # their terms, which cancel), the composition from float dS.
        scalars = [(3, float(s) * float(s64.grad))] + ([(4, float(b64.grad))] if objective == "sigmoid" else [])
        for at, exact in scalars:
            mine, host = abs(float(got[at]) - exact), abs(float(want[at]) - exact)
            assert mine <= max(2e-5 * (1 + abs(exact)), 1.5 * host), (where, at, float(got[at]), float(want[at]), exact)
        assert int(got[-1]) == int(want[-1]) == 0, where
        assert abs(float(got[-2]) - float(want[-2])) <= 1e-5 * (1 + abs(float(want[-2]))), where


@pytest.mark.parametrize("objective", ["symmetric", "info_nce"])
def test_the_cuda_composition_keeps_a_trained_batchs_digits(objective):
    # Keys next to their queries at a large scale (a trained batch): the loss sits just above its floor and G on each
    # positive is a small difference. The log1p / expm1 forms keep them (a plain exp(S - lse) lost the gradients' and
    # d loss / d log s's digits here: 6e-3 and 1e-2 relative).
    g = torch.Generator().manual_seed(70)
    q = F.normalize(torch.randn(64, 32, generator=g), dim=1)
    k = F.normalize(q + 0.01 * torch.randn(64, 32, generator=g), dim=1)
    ids = torch.arange(64)
    k2 = F.normalize(q + 0.01 * torch.randn(64, 32, generator=g), dim=1)  # a second caption of each image
    for keys, key_ids, s in ((k, ids, 30.0), (torch.cat([k, k2]), torch.cat([ids, ids]), 100.0)):
        got = _composition(objective, q, keys, s, 0.0, ids, key_ids)
        q64, k64 = q.double().requires_grad_(), keys.double().requires_grad_()
        s64 = torch.tensor(s, dtype=torch.float64, requires_grad=True)
        want = reference(objective, q64, k64, s64, ids, key_ids)
        want.backward()
        want = want.detach()
        host = torch.ops.contrastive_torch.grouped_softmax_step(q, keys, torch.tensor(s), ids, key_ids,
                                                                objective == "symmetric", "fused", 1, True)
        dlogs = s * float(s64.grad)

        def errors(out):
            return (abs(float(out[0]) - float(want)) / abs(float(want)), rel(out[1], q64.grad), rel(out[2], k64.grad),
                    abs(float(out[3]) - dlogs) / abs(dlogs))

        # Within the host engine's own error, or within what float32 logits allow: a row with two positives takes
        # their difference, which float32 logits at s = 100 give to ~1e-4 relative (the forms this guards against
        # lost 6e-3 of dq and 1e-2 of d loss / d log s).
        for mine, theirs, name, floor in zip(errors(got), errors(host), ("loss", "dq", "dk", "dlogs"),
                                             (1e-6, 1e-3, 1e-3, 1e-3)):
            assert mine <= max(2 * theirs + 1e-6, floor), (name, s, mine, theirs)


@pytest.mark.parametrize("objective", ["symmetric", "info_nce"])
@pytest.mark.parametrize("chunk_rows", [None, 16])
def test_the_cuda_composition_is_as_exact_as_its_logits_on_near_duplicate_captions(objective, chunk_rows,
                                                                                   monkeypatch):
    # Two or three captions per image, each 1e-3 from it (near duplicates), at s = 30 and 100: on a positive G is a
    # small difference of softmax terms that each sit near 1 / |P|. Forming it from the row's log-sum-exp over every
    # logit cancelled two float32 numbers near log |P| and lost 5x (3 captions: 20x) of dQ's digits; with the
    # positives kept apart the gradients are as close to float64 as the float64 gradients of the same float32 logits.
    # In chunks of 16 rows a caption's column sees its image in one chunk and only negatives in the others (the
    # merged column statistics must not lose the positive's digits).
    for captions, s in ((2, 30.0), (3, 30.0), (3, 100.0)):
        if chunk_rows:
            monkeypatch.setattr(ct._grouped, "CHUNK_ELEMENTS", chunk_rows * 64 * captions)
        g = torch.Generator().manual_seed(73 + captions)
        q = F.normalize(torch.randn(64, 32, generator=g), dim=1)
        keys = torch.cat([F.normalize(q + 1e-3 * torch.randn(64, 32, generator=g), dim=1) for _ in range(captions)])
        ids = torch.arange(64)
        key_ids = ids.repeat(captions)
        got = _composition(objective, q, keys, s, 0.0, ids, key_ids)
        q64, k64 = q.double().requires_grad_(), keys.double().requires_grad_()
        reference(objective, q64, k64, torch.tensor(s, dtype=torch.float64), ids, key_ids).backward()
        # The floor: float64 gradients of the step's own float32 logits.
        logits = (torch.mm(q, keys.t()) * s).double().requires_grad_()
        reference_of_logits(objective, logits, ids, key_ids).backward()
        floor_dq, floor_dk = s * logits.grad @ keys.double(), s * logits.grad.t() @ q.double()
        for mine, floor, want, name in ((got[1], floor_dq, q64.grad, "dq"), (got[2], floor_dk, k64.grad, "dk")):
            assert rel(mine, want) <= 1.5 * rel(floor, want) + 1e-5, (name, captions, s, rel(mine, want),
                                                                        rel(floor, want))


def test_the_cuda_composition_merges_column_statistics_over_chunks_without_losing_digits(monkeypatch):
    # Each text's image lies 36 above every other logit of its column: in chunks of 2 rows a text's column sees only
    # negatives in one chunk and its positive in the other. Its loss (1e-15 above the floor) and each positive's G (as
    # small) keep their digits as in one chunk (a merge that scaled the first chunk's sum by a subnormal weight lost
    # 1e-3 of both). K = I and s = 1, so dq is G itself.
    S = torch.tensor([[36.0, 0.0, 0.5, 0.2], [0.1, 36.0, 0.0, 1.0], [0.3, 0.4, 36.0, 0.0], [0.0, 0.5, 0.2, 36.0]])
    ids = torch.arange(4)
    # float64 without cancellation: each row's and column's sum of exp(S - S_ii) over its negatives.
    S64, off = S.double(), ~torch.eye(4, dtype=torch.bool)
    rows = (S64 - S64.diagonal()[:, None]).exp().mul(off).sum(1)
    cols = (S64 - S64.diagonal()[None, :]).exp().mul(off).sum(0)
    want = float(0.5 * torch.log1p(rows).mean() + 0.5 * torch.log1p(cols).mean())
    want_diag = -(rows / (1 + rows) + cols / (1 + cols)) / 8
    for chunk in (None, 8):
        if chunk:
            monkeypatch.setattr(ct._grouped, "CHUNK_ELEMENTS", chunk)
        got = _composition("symmetric", S, torch.eye(4), 1.0, 0.0, ids, ids)
        assert abs(float(got[0]) - want) <= 1e-6 * want, (chunk, float(got[0]), want)
        diag = got[1].double().diagonal()
        assert float(((diag - want_diag).abs() / want_diag.abs()).max()) <= 1e-5, (chunk, diag, want_diag)


def test_the_cuda_composition_takes_negatives_far_above_the_positives(monkeypatch):
    # Negatives 100 to 300 above a row's or column's positives (an untrained batch at a large scale, with duplicates):
    # past exp's range from the positives, so every sum is measured from a point that keeps it finite; the loss and
    # the gradients are the float64 ones, in one chunk and in chunks of 2 rows.
    g = torch.Generator().manual_seed(76)
    S = torch.randn(7, 6, generator=g)
    S[torch.rand(7, 6, generator=g) < 0.25] += 300.0
    S[0, 5] += 100.0
    qg, kg = torch.tensor([0, 1, 1, 2, 3, 0, 4]), torch.tensor([1, 0, 2, 2, 3, 9])
    for objective in ("symmetric", "info_nce"):
        logits = S.double().requires_grad_()
        want = reference_of_logits(objective, logits, qg, kg)
        want.backward()
        want = want.detach()
        for chunk in (None, 12):
            if chunk:
                monkeypatch.setattr(ct._grouped, "CHUNK_ELEMENTS", chunk)
            got = _composition(objective, S, torch.eye(6), 1.0, 0.0, qg, kg)
            assert int(got[-1]) == 0, (objective, chunk)
            assert abs(float(got[0]) - float(want)) <= 1e-6 * float(want), (objective, chunk)
            assert rel(got[1], logits.grad) <= 1e-5, (objective, chunk)


def test_the_cuda_composition_ignores_an_autocast_region():
    # float16's backward reruns the step, possibly inside the caller's autocast region: its float32 products must
    # not be cast down there.
    q, k = unit(40, 16, 71, torch.float16), unit(50, 16, 72, torch.float16)
    qg, kg = draw_ids(40, 50, 73, "random")
    for objective in ("symmetric", "info_nce", "sigmoid"):
        k_used, kg_used = (k[:40], kg[:40]) if objective == "symmetric" else (k, kg)
        plain = _composition(objective, q, k_used, 20.0, -3.0, qg, kg_used, loss_scale=1024.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = _composition(objective, q, k_used, 20.0, -3.0, qg, kg_used, loss_scale=1024.0)
        for a, b in zip(plain, inside):
            assert a is None and b is None or torch.equal(a, b), objective


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ids_edited_after_the_forward_leave_the_backward_as_it_was(dtype, seed):
    """Every dtype's backward uses the forward's positives: editing the ids (or labels) in place in between changes
    nothing (float16 reruns the step under a loss scale from its own copy; it raised autograd's version error)."""
    g = torch.Generator().manual_seed(seed)
    q0 = F.normalize(torch.randn(10, 8, generator=g), dim=1).to(dtype)
    k0 = F.normalize(torch.randn(10, 8, generator=g), dim=1).to(dtype)
    ids = torch.randint(0, 5, (10,), generator=g)
    labels = torch.randperm(10, generator=g)
    for call, positives in ((lambda q, k, p: CF.clip_loss(q, k, 10.0, image_groups=p, text_groups=p), ids),
                            (lambda q, k, p: CF.info_nce_loss(q, k, 10.0, p), labels)):
        grads = []
        for edit in (False, True):
            q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
            mine = positives.clone()
            loss = call(q, k, mine)
            if edit:
                mine.copy_(mine.flip(0))
            (loss * 1024.0).backward()
            grads.append((q.grad, k.grad))
        assert all(torch.equal(a, b) for a, b in zip(*grads)), f"{dtype} (seed {seed})"
