# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""ClipLoss over torch.distributed: 2 and 4 processes over gloo on 127.0.0.1, one spawn per world size, every case run
inside the workers (CI time: each spawn costs the ranks' start-up, which dominates these small shapes).

Per rank, for float32 and bfloat16 and every algorithm: loss and gradients (both features and logit_scale) against
one process on the concatenated batch, for all four (local_loss, gather_with_grad) settings, and against open_clip's
own distributed ClipLoss(local_loss, gather_with_grad, rank, world_size) over the same group; unequal rows per rank
against one process; bad input on one rank (wrong dim, NaN or differing logit_scale, a non-finite feature, another
dtype, a wrong rank argument, another incoming gradient) raising on every rank, naming that rank, after which the
ranks still compute together. Each run is bounded: init_process_group's timeout, and a join timeout that fails the
test (and kills the ranks) instead of hanging.

Differences are normwise relative (as in test_open_clip.py), bounded by multiples of the type's eps: 256 for
float32, 8 for bfloat16 (the issue's targets)."""

import contextlib
import datetime
import gc
import importlib.util
import itertools
import json
import os
import socket
import time
import traceback

import pytest
import torch
import torch.nn.functional as F

import contrastive_torch as ct
from conftest import require

ALGORITHMS = ("fused", "materialized", "chunked")
# The exchanges: the library's distributed engine, and torch's autograd all-gather with the one-process step (the one
# CUDA tensors use, run here on CPU tensors over gloo).
EXCHANGES = ("engine", "gather")
DTYPES = (torch.float32, torch.bfloat16)
BOUND_EPS = {torch.float32: 256, torch.bfloat16: 8}
JOIN_TIMEOUT_S = 240  # measured: 6-8 s (2 ranks) and 15-17 s (4 ranks) on 2 loaded cores
PG_TIMEOUT_S = 60


def _rel(a, b):
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _draw(n, d, seed, pairing=0.5):
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(n, d, generator=g), dim=1)
    txt = F.normalize(torch.randn(n, d, generator=g) + pairing * img, dim=1)
    return img, txt


def _open_clip_loss_module():
    """open_clip's own loss.py (open-clip-torch), loaded by itself: importing the open_clip package pulls in its
    models and tokenizers (~2 s per rank); loss.py needs only torch. None if open_clip is not installed.
    CONTRASTIVE_OPEN_CLIP_LOSS=path/to/loss.py compares against that file instead (another open_clip version, e.g.
    its development branch's src/open_clip/loss.py)."""
    path = os.environ.get("CONTRASTIVE_OPEN_CLIP_LOSS")
    if not path:
        spec = importlib.util.find_spec("open_clip")
        if spec is None or not spec.submodule_search_locations:
            return None
        path = os.path.join(list(spec.submodule_search_locations)[0], "loss.py")
    loss_spec = importlib.util.spec_from_file_location("_open_clip_loss", path)
    module = importlib.util.module_from_spec(loss_spec)
    loss_spec.loader.exec_module(module)
    return module


def _step(fn, img, txt, scale, grad_factor=1.0):
    """loss, d img, d txt, d logit_scale of fn(img, txt, s) (leaves made here)."""
    img = img.detach().clone().requires_grad_()
    txt = txt.detach().clone().requires_grad_()
    s = torch.tensor(float(scale), requires_grad=True)
    loss = fn(img, txt, s)
    (loss * grad_factor).backward()
    return loss.detach(), img.grad, txt.grad, s.grad


def checker(rank):
    """A rank's record of its checks: (checks, failures, check(ok, what)); checks[0] counts them."""
    checks, failures = [0], []

    def check(ok, what):
        checks[0] += 1
        if not ok:
            failures.append(f"rank {rank}: {what}")

    return checks, failures, check


def start_gloo(rank, world, port, timeout_s=PG_TIMEOUT_S):
    """A spawned rank's set-up: tracebacks on a crash, torch's deprecation warnings off (open_clip's gather uses
    torch.distributed.nn.all_gather), one thread, and the gloo group on 127.0.0.1:`port`, bounded by `timeout_s`."""
    import faulthandler
    import warnings

    import torch.distributed as dist

    faulthandler.enable()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def stop_gloo():
    """A rank's tear-down: reference cycles collected first (a refusal's traceback holds frames that hold the group),
    so that no process group outlives destroy_process_group into the interpreter's exit, where gloo's can abort the
    process."""
    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def _worker(rank, world, port, seed, out_dir):
    checks, failures, check = checker(rank)
    try:
        import torch.distributed as dist

        start_gloo(rank, world, port)
        oc = _open_clip_loss_module()
        n, d, scale = 6, 16, 1 / 0.07
        img, txt = _draw(n * world, d, seed)
        mine = slice(rank * n, (rank + 1) * n)
        names = ("loss", "d image_features", "d text_features", "d logit_scale")

        def mean_over_ranks(x):
            x = x.detach().double().clone()
            dist.all_reduce(x)
            return x / world

        for dtype in DTYPES:
            tol = BOUND_EPS[dtype] * torch.finfo(dtype).eps
            eps = torch.finfo(dtype).eps
            I, T = img.to(dtype), txt.to(dtype)
            # open_clip's distributed loss, in float32 on the type's values (the exact answer for them to float32's
            # precision), per setting; collectives of the group like ours.
            theirs = {}
            if oc is not None:
                for local_loss, gwg in itertools.product((False, True), repeat=2):
                    fn = oc.ClipLoss(local_loss=local_loss, gather_with_grad=gwg, rank=rank, world_size=world)
                    loss, di, dt, ds = _step(fn, I[mine].float(), T[mine].float(), scale)
                    theirs[local_loss, gwg] = (loss, di, dt, ds, mean_over_ranks(loss), mean_over_ranks(ds))
            for algorithm, exchange in itertools.product(ALGORITHMS, EXCHANGES):
                ref = _step(ct.ClipLoss(algorithm=algorithm, threads=1), I, T, scale)
                for local_loss, gwg in itertools.product((False, True), repeat=2):
                    where = f"{dtype} {algorithm} {exchange} local_loss={local_loss} gather_with_grad={gwg}"
                    fn = ct.ClipLoss(local_loss, gwg, rank=rank, world_size=world, algorithm=algorithm, threads=1,
                                     exchange=exchange)
                    got = _step(fn, I[mine], T[mine], scale)
                    check(got[1].dtype == dtype and got[2].dtype == dtype, f"{where}: gradient dtype")
                    c = world if (gwg or local_loss) else 1
                    want = (ref[0], c * ref[1][mine], c * ref[2][mine], ref[3])
                    for name, a, b in zip(names, got, want):
                        err = _rel(a, b)
                        check(err <= tol, f"{where}: {name} {err / eps:.1f} eps from one process (seed {seed})")
                    if oc is None:
                        continue
                    loss, di, dt, ds, mean_loss, mean_ds = theirs[local_loss, gwg]
                    # The loss: the global one on every rank; open_clip's local_loss=True value is the rank's share,
                    # whose mean over ranks is the global loss. logit_scale: d(global)/ds on every rank; open_clip's
                    # local_loss=True gives each rank d(its share)/ds, whose mean (DDP's average) is the same.
                    pairs = [("loss", got[0], mean_loss if local_loss else loss),
                             ("d logit_scale", got[3], mean_ds if local_loss else ds)]
                    if gwg or not local_loss:
                        pairs += [("d image_features", got[1], di), ("d text_features", got[2], dt)]
                    else:
                        # open_clip's local_loss=True without gather_with_grad drops the cross-rank terms: ours is
                        # the exact gradient (checked against one process above), which differs from open_clip's.
                        check(_rel(got[1], di) > 1e-2, f"{where}: open_clip's truncated gradient equals ours?")
                    for name, a, b in pairs:
                        err = _rel(a, b)
                        check(err <= tol, f"{where}: {name} {err / eps:.1f} eps from open_clip (seed {seed})")

        # open_clip's get_logits over ranks (the towers gathered: with gradients, or without and this rank's rows kept)
        # and get_ground_truth: the same logits and gradients as open_clip's, per setting.
        if oc is not None:
            for local_loss, gwg in itertools.product((False, True), repeat=2):
                runs = []
                for cls in (ct.ClipLoss, oc.ClipLoss):
                    fn = cls(local_loss=local_loss, gather_with_grad=gwg, rank=rank, world_size=world)
                    i, t = img[mine].clone().requires_grad_(), txt[mine].clone().requires_grad_()
                    s = torch.tensor(scale, requires_grad=True)
                    per_image, per_text = fn.get_logits(i, t, s)
                    (per_image.square().sum() + 2 * per_text.sum()).backward()
                    runs.append((per_image.detach(), per_text.detach(), i.grad, t.grad, s.grad,
                                 fn.get_ground_truth("cpu", n)))
                # The gradients through a gather sum the ranks' parts in the collective's order (PyTorch's functional
                # all-gather here, torch.distributed.nn's in open_clip 3.3): equal to float32's rounding.
                for name, a, b in zip(("logits_per_image", "logits_per_text", "d image_features", "d text_features",
                                       "d logit_scale", "labels"), *runs):
                    exact = name.startswith(("logits", "labels"))
                    same = torch.equal(a, b) if exact else _rel(a, b) <= 4 * torch.finfo(torch.float32).eps
                    check(same, f"get_logits local_loss={local_loss} gather_with_grad={gwg}: {name}")
            # A loss given the group alone (world_size left at 1) offsets its labels by the group's rank.
            check(torch.equal(ct.ClipLoss(local_loss=True, group=dist.group.WORLD).get_ground_truth("cpu", n),
                              oc.ClipLoss(local_loss=True, rank=rank, world_size=world).get_ground_truth("cpu", n)),
                  "get_ground_truth with group= only")

        # Unequal rows per rank, against one process on the concatenated batch (open_clip needs equal rows).
        counts = [n - 2, n + 2] if world == 2 else [n - 3, n + 3, n, n]
        offset = sum(counts[:rank])
        rows = slice(offset, offset + counts[rank])
        tol = BOUND_EPS[torch.float32] * torch.finfo(torch.float32).eps
        for algorithm, exchange in itertools.product(ALGORITHMS, EXCHANGES):
            ref = _step(ct.ClipLoss(algorithm=algorithm, threads=1), img, txt, scale)
            got = _step(ct.ClipLoss(True, True, rank=rank, world_size=world, algorithm=algorithm, threads=1,
                                    exchange=exchange), img[rows], txt[rows], scale)
            want = (ref[0], world * ref[1][rows], world * ref[2][rows], ref[3])
            for name, a, b in zip(names, got, want):
                err = _rel(a, b)
                check(err <= tol, f"unequal rows {counts} {algorithm} {exchange}: {name} {err:.2e} from one process")

        # Bad input on one rank raises on every rank, naming it; then the ranks still compute together.
        bad = world - 1
        fn = ct.ClipLoss(True, True, rank=rank, world_size=world, threads=1)
        good = (img[mine], txt[mine], scale)
        wide = (F.normalize(torch.randn(n, d + 1), dim=1), F.normalize(torch.randn(n, d + 1), dim=1), scale)
        inf_img = img[mine].clone()
        inf_img[2, 3] = float("inf")
        cases = [
            ("wrong dim", ValueError, wide, fn, 1.0),
            ("NaN logit_scale", ValueError, (img[mine], txt[mine], float("nan")), fn, 1.0),
            ("another logit_scale", ValueError, (img[mine], txt[mine], 2 * scale), fn, 1.0),
            ("non-finite feature", ValueError, (inf_img, txt[mine], scale), fn, 1.0),
            ("another dtype", TypeError, (img[mine].bfloat16(), txt[mine].bfloat16(), scale), fn, 1.0),
            ("wrong rank argument", ValueError, good, ct.ClipLoss(True, True, rank=(rank + 1) % world,
                                                                  world_size=world, threads=1), 1.0),
            ("another incoming gradient", ValueError, good, fn, 2.0),
        ]
        gather = ct.ClipLoss(True, True, rank=rank, world_size=world, threads=1, exchange="gather")
        # The 'gather' exchange: the same refusals but the incoming gradient (its backward sums what every rank
        # sends, as open_clip's), and an exchange that differs between ranks; then the agreement carried by torch's
        # own all-gather (as over NCCL) instead of the library's, for two of them.
        cases += [(f"{what} (gather)", kind, args, gather if bad_fn is fn else ct.ClipLoss(
            True, True, rank=(rank + 1) % world, world_size=world, threads=1, exchange="gather"), 1.0)
            for what, kind, args, bad_fn, factor in cases if factor == 1.0]
        cases.append(("another exchange", ValueError, good, fn, 1.0))
        for what, kind, args, bad_fn, factor in cases:
            use = args if rank == bad else good
            f = bad_fn if rank == bad else (gather if "gather" in what or what == "another exchange" else fn)
            try:
                _step(f, *use, grad_factor=factor if rank == bad else 1.0)
                check(False, f"{what} on rank {bad}: nothing raised")
            except Exception as e:  # noqa: BLE001 - the type is checked
                check(isinstance(e, kind) and f"rank {bad}" in str(e),
                      f"{what} on rank {bad}: raised {type(e).__name__}: {e}")
                if what.startswith("non-finite feature"):  # named as the caller names it, either exchange
                    check("image_features" in str(e), f"{what}: the message does not say image_features: {e}")
        from contrastive_torch import _distributed

        library_agreement = _distributed._agreement_device
        _distributed._agreement_device = lambda group: torch.device("cpu")
        for what, kind, args in (("wrong dim (torch's agreement)", ValueError, wide),
                                 ("another dtype (torch's agreement)", TypeError,
                                  (img[mine].bfloat16(), txt[mine].bfloat16(), scale))):
            try:
                _step(gather, *(args if rank == bad else good))
                check(False, f"{what} on rank {bad}: nothing raised")
            except Exception as e:  # noqa: BLE001 - the type is checked
                check(isinstance(e, kind) and f"rank {bad}" in str(e),
                      f"{what} on rank {bad}: raised {type(e).__name__}: {e}")
        _distributed._agreement_device = library_agreement
        # Found by review: gradient wishes that differ per tower, an empty rank, a bad keyword or logit_bias on one
        # rank: raised on every rank, naming it, for both exchanges (each would otherwise leave the other ranks in a
        # collective, or sum mismatched gradients).
        import contrastive_torch.functional as CF

        for exchange in EXCHANGES:
            loss_fn = ct.ClipLoss(True, True, rank=rank, world_size=world, threads=1, exchange=exchange)
            i_only = (img[mine].clone().requires_grad_(), txt[mine].clone(), scale)
            both = (img[mine].clone().requires_grad_(), txt[mine].clone().requires_grad_(), scale)
            empty = (img[mine][:0].clone(), txt[mine][:0].clone(), scale)
            two_bias = (*both, torch.zeros(2))
            for what, kind, call in (
                    ("images only want gradients", ValueError, lambda: loss_fn(*(i_only if rank == bad else both))),
                    ("no rows", ValueError, lambda: loss_fn(*(empty if rank == bad else both))),
                    ("threads=-1", ValueError, lambda: CF.clip_loss(*both, group=dist.group.WORLD, exchange=exchange,
                                                                    threads=-1 if rank == bad else 1)),
                    ("a logit_bias of 2 values", ValueError, lambda: loss_fn(*(two_bias if rank == bad else both)))):
                try:
                    call().backward()
                    check(False, f"{what} on rank {bad} ({exchange}): nothing raised")
                except Exception as e:  # noqa: BLE001 - the type is checked
                    check(isinstance(e, kind) and f"rank {bad}" in str(e),
                          f"{what} on rank {bad} ({exchange}): raised {type(e).__name__}: {e}")
        # float16 over the gather: the one-process steps see the caller's incoming gradient itself, so they rerun
        # where one process would (g != 1), never for the gather's own weights.
        from contrastive_torch import _host

        real_step, calls = _host.step, []
        _host.step = lambda *a: calls.append(a[9] if len(a) == 10 else None) or real_step(*a)
        for factor, want in ((1.0, [None, None]), (1024.0, [None, None, 1024.0, 1024.0])):
            calls.clear()
            _step(gather, img[mine].half(), txt[mine].half(), scale, grad_factor=factor)
            check(calls == want, f"float16 gather, incoming gradient {factor}: host steps {calls}, want {want}")
        _host.step = real_step
        ref = _step(ct.ClipLoss(threads=1), img, txt, scale)
        for f in (fn, gather):
            got = _step(f, *good)
            check(_rel(got[1], world * ref[1][mine]) <= tol, "after the refusals: d image_features differs")
        # The refusals' tracebacks (frames holding the group) are reference cycles: collected now, so that no process
        # group outlives destroy_process_group into the interpreter's exit (where gloo's can abort the process).
        del cases
        stop_gloo()
    except Exception:  # noqa: BLE001 - reported to the test
        failures.append(f"rank {rank}: {traceback.format_exc()}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"checks": checks[0], "failures": failures}, f)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, world, seed, tmp_path, join_timeout=JOIN_TIMEOUT_S):
    """Spawns `world` processes of worker(rank, world, port, seed, out_dir) (gloo on 127.0.0.1, the extension loaded
    here first) and returns each rank's JSON report (rank{r}.json in tmp_path). A rank that does not finish within
    `join_timeout` fails the test, after every rank is killed, as does a rank without a report or a nonzero exit."""
    import torch.multiprocessing as mp

    ct.extension()  # compiled (or loaded) once here, before the ranks load it
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, seed, str(tmp_path))) for r in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, join_timeout - (time.monotonic() - start)))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} of {world} did not finish within {join_timeout} s (seed {seed})"
    reports = []
    for r, p in enumerate(procs):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} exited with {p.exitcode} and no report (seed {seed})"
        assert p.exitcode == 0, f"rank {r} exited with {p.exitcode} after its report (seed {seed})"
        reports.append(json.loads(path.read_text()))
    return reports


# CONTRASTIVE_TORCH_DIST_WORLDS: the world sizes to spawn (install_check.sh runs 2 only: the installed build of the
# same code, and 4 ranks cost ~15 s more of CI).
WORLDS = [int(w) for w in os.environ.get("CONTRASTIVE_TORCH_DIST_WORLDS", "2,4").split(",") if w.strip()]


@pytest.mark.parametrize("world", WORLDS)
def test_global_batch_over_gloo(world, seed, tmp_path):
    import torch.distributed as dist

    require("distributed", dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo")
    require("open_clip", _open_clip_loss_module() is not None, "open-clip-torch is not installed")
    reports = run_ranks(_worker, world, seed, tmp_path)
    failures = [f for got in reports for f in got["failures"]]
    checks = [got["checks"] for got in reports]
    assert not failures, "\n".join(failures[:20])
    # 2 exchanges x (2 dtypes x 3 algorithms x (4 settings x 5 vs one process + 15 vs open_clip) + unequal rows
    # (3 x 4)) + the refusals (7 engine, 6 gather, 1 exchange, 2 over torch's agreement, 2 after them, 2 x 4 found by
    # review) + 2 float16 rerun counts + 2 names of the non-finite feature + get_logits (4 settings x 6, and group=):
    # every check ran on every rank.
    assert checks == [2 * (2 * 3 * (4 * 5 + 15) + 3 * 4) + 7 + 6 + 1 + 2 + 2 + 2 * 4 + 2 + 2 + 4 * 6 + 1] * world, \
        f"checks per rank: {checks}"


def test_distributed_arguments():
    # Refused before any collective (the same on every rank: constructor arguments).
    with pytest.raises(ValueError, match="exchange"):
        ct.ClipLoss(world_size=2, rank=0, exchange="ring")
    with pytest.raises(TypeError, match="group"):
        ct.ClipLoss(group="WORLD")
    import torch.distributed as dist

    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            ct.ClipLoss(world_size=2, rank=0)(torch.randn(4, 8), torch.randn(4, 8), 10.0)


@contextlib.contextmanager
def _one_rank_group(backend):
    """A process group of this process alone (rank 0 of 1) for the `with` block, destroyed at its end."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        yield dist
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("exchange", ["engine", "gather"])
def test_one_rank_group_equals_one_process(exchange, seed):
    # group= a group of one rank: the global batch is this rank's, so both exchanges give the one-process loss and
    # gradients (grad_ranks = the group's size = 1).
    import torch.distributed as dist

    require("distributed", dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo")
    with _one_rank_group("gloo") as dist:
        img, txt = _draw(12, 16, seed)
        ref = _step(ct.ClipLoss(threads=1), img, txt, 14.0)
        got = _step(ct.ClipLoss(threads=1, group=dist.group.WORLD, exchange=exchange), img, txt, 14.0)
        eps = torch.finfo(torch.float32).eps
        for name, a, b in zip(("loss", "d image", "d text", "d logit_scale"), got, ref):
            assert _rel(a, b) <= 16 * eps, f"{exchange}: {name} (seed {seed})"


@pytest.mark.parametrize("exchange", ["engine", "gather"])
def test_one_rank_group_under_autocast(exchange, seed):
    # torch.autocast over a group: float32 features run at the region's dtype, cast before the exchange (the ranks
    # agree on and move bfloat16), so the loss and gradients are those of the features cast beforehand, bit for bit;
    # the gradients come back float32; the scalars stay float32 (SigLIP's bias too).
    import torch.distributed as dist

    require("distributed", dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo")
    with _one_rank_group("gloo") as dist:
        img, txt = _draw(12, 16, seed)
        for name, fn, extra in (("ClipLoss", ct.ClipLoss(threads=1, group=dist.group.WORLD, exchange=exchange), ()),
                                ("SigLipLoss", ct.SigLipLoss(threads=1, group=dist.group.WORLD, exchange=exchange),
                                 (-7.3,))):
            def step(i, t, region):
                i, t = i.clone().requires_grad_(), t.clone().requires_grad_()
                s = torch.tensor(14.3, requires_grad=True)
                with region:
                    loss = fn(i, t, s, *extra)
                loss.backward()
                return loss.detach(), i.grad, t.grad, s.grad

            region = torch.autocast("cpu", dtype=torch.bfloat16)
            got = step(img, txt, region)
            want = step(img.bfloat16(), txt.bfloat16(), torch.autocast("cpu", dtype=torch.bfloat16))
            plain = step(img, txt, torch.autocast("cpu", enabled=False))
            where = f"{name}, {exchange} (seed {seed})"
            assert [x.dtype for x in got] == [torch.float32] * 4, where
            assert want[1].dtype == torch.bfloat16, where
            for what, a, b in zip(("loss", "d image", "d text", "d logit_scale"), got, want):
                # (SigLipLoss returns bfloat16 features' loss as bfloat16, open_clip's dtype: compared at it.)
                assert torch.equal(a.to(b.dtype) if what == "loss" else a, b.float() if what != "loss" else b), \
                    f"{where}: {what} differs from the bfloat16 features' run"
            assert not torch.equal(got[0], plain[0]), f"{where}: the loss is float32's: nothing was cast"


@pytest.mark.parametrize("exchange", ["engine", "gather"])
def test_one_rank_group_refuses_a_second_derivative(exchange, seed):
    # As one process's loss: create_graph=True gives the plain first derivatives, and differentiating them again
    # raises (it would otherwise drop a gradient penalty silently).
    import torch.distributed as dist

    require("distributed", dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo")
    with _one_rank_group("gloo") as dist:
        img, txt = _draw(12, 16, seed)
        img.requires_grad_()
        s = torch.tensor(14.0, requires_grad=True)
        fn = ct.ClipLoss(threads=1, group=dist.group.WORLD, exchange=exchange)
        plain = torch.autograd.grad(fn(img, txt, s), (img, s))
        loss = fn(img, txt, s)
        graphed = torch.autograd.grad(loss, (img, s), create_graph=True)
        for a, b in zip(graphed, plain):
            assert torch.equal(a.detach(), b), f"{exchange} (seed {seed})"
        with pytest.raises(RuntimeError, match="the loss is differentiable once"):
            (loss + graphed[0].square().sum()).backward()
        # torch.autograd.grad towards the features follows only their paths: it reaches the refusal too.
        (g_img,) = torch.autograd.grad(fn(img, txt, s), img, create_graph=True)
        with pytest.raises(RuntimeError, match="the loss is differentiable once"):
            torch.autograd.grad(g_img.sum(), img)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU tests skipped")


@needs_cuda
def test_cuda_gather_over_a_one_rank_nccl_group(seed):
    # CUDA tensors with a process group: the gather exchange over NCCL (the torch-tensor agreement, torch's autograd
    # all-gather, the one-process device step), on one GPU as a group of one rank, against the one-process step.
    import torch.distributed as dist

    require("distributed", dist.is_available() and dist.is_nccl_available(), "torch.distributed with NCCL")
    with _one_rank_group("nccl") as dist:
        img, txt = _draw(300, 64, seed)
        img, txt = img.cuda(), txt.cuda()
        for make in (lambda **kw: ct.ClipLoss(algorithm="chunked", **kw), lambda **kw: ct.SigLipLoss(**kw)):
            args = (14.0,) if isinstance(make(), ct.ClipLoss) else (10.0, -10.0)

            def run(fn):
                a, b = img.clone().requires_grad_(), txt.clone().requires_grad_()
                loss = fn(a, b, *args)
                loss.backward()
                return loss.detach(), a.grad, b.grad

            ref = run(make())
            got = run(make(group=dist.group.WORLD))
            for name, x, y in zip(("loss", "d image", "d text"), got, ref):
                assert _rel(x.cpu(), y.cpu()) <= 64 * torch.finfo(torch.float32).eps, f"{name} (seed {seed})"
        bad = img.clone()
        bad[0, 0] = float("nan")
        with pytest.raises(ValueError, match="rank 0"):
            ct.ClipLoss(group=dist.group.WORLD)(bad, txt, 14.0)
