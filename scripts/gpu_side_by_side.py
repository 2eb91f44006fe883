#!/usr/bin/env python3
# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Contrastive losses side by side on one CUDA GPU: forward + backward (to both feature tensors, log s and, for
SigLIP, the bias) of

  eager     PyTorch in open_clip's form. CLIP: logits_per_image = s * img @ txt.T, logits_per_text its transpose,
            (F.cross_entropy(lpi, labels) + F.cross_entropy(lpt, labels)) / 2. SigLIP (big_vision's, open_clip's
            SigLipLoss): logits = s * img @ txt.T + b, labels = 2 eye - 1, -F.logsigmoid(labels * logits).sum() / n
  compile   torch.compile(fullgraph=True, dynamic=False) of the same function (one fresh compile per row)
  ours      contrastive_torch.functional.clip_loss / siglip_loss, algorithm None (the default), 'chunked',
            'materialized', 'fused' (--ours; 'chunked_tiles': chunked with fused_tiles=True)
  ours:<alg>+ids  the same with group ids (--groups K: pairs i and j positive when i // K == j // K, K positives a
            row), to set the cost of several positives per row beside one; no float64 errors on these rows
  inf_cl    Inf-CL (pip inf-cl, CLIP only): (cal_inf_loss(s * img, txt) + cal_inf_loss(s * txt, img)) / 2, its
            single-process path (its scale= argument all-reduces the scale's gradient, which needs a process group)
  siglip_kernel  siglip-kernel (pip siglip-kernel, SigLIP only): fused_siglip_loss(img, txt, log s, b), its router

The leaves are log s (s = exp(log s): CLIP s = 100, SigLIP s = 10, i.e. t = ln 10) and b = -10, float32, as
open_clip's model.logit_scale.exp() and logit_bias. Two input modes: 'bf16' (bfloat16 features) and 'autocast'
(float32 features, the loss called under torch.autocast(bfloat16): what open_clip hands the loss with amp_bf16).
Features are L2-normalised Gaussian rows rounded to bfloat16; the autocast mode gets those values as float32, so one
float64 reference serves both modes.

Per row: the median time of R forward+backward steps (CUDA events) after a warm-up (at least --warmup steps, more
until two consecutive steps agree within 5%); the peak memory of one more step above what the inputs hold
(torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus memory_allocated before it); at the smallest N
the errors against a float64 reference computed on the device from the same inputs (row chunks of --ref-chunk):
loss |L - L64| / |L64|; features max(|g - g64|) / max(|g64|), the worse of the two tensors; d log s (and d b) the
same. An exception in a row (OOM included) is caught and becomes the row's status; a row is skipped with the reason
when its memory lower bound exceeds the device's (eager: 2 N^2 logits-sized matrices), when it is predicted (N^2
scaling from the previous N) to overrun the budget, or fused above --fused-max-n. The rows run in a worker process
under this one: a crash (a lost CUDA context) or a row over --row-timeout is recorded and a fresh worker goes on with
the rest. --budget seconds (counted once the worker is ready, the extension built) are checked between rows.

    python3 scripts/gpu_side_by_side.py [--n 16384 65536 262144] [--d 768] [--modes bf16 autocast]
        [--objectives clip siglip] [--contenders eager compile ours peers] [--ours None chunked materialized fused]
        [--reps 10] [--budget 240] [--out side_by_side.md] [--groups 5]
    python3 scripts/gpu_side_by_side.py --dry-run        # the CPU, tiny N, end to end (CUDA/Triton rows skipped)

Output: the markdown table (card, versions, command) on stdout at the end and in --out (default
$OUT/side_by_side.md when $OUT is set), JSON records one per line in --json (default: --out's name with .jsonl),
rewritten after every row, so a run cut off leaves what it measured. The peers are used where importable (on the
GPU machine: pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site).
"""

import argparse
import contextlib
import gc
import glob
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(ROOT, "python")
CLIP_SCALE, SIGLIP_SCALE, SIGLIP_BIAS = 100.0, 10.0, -10.0
GPU_N, CPU_N = [16384, 65536, 262144], [96, 160]
OURS = ("None", "chunked", "materialized", "fused", "chunked_tiles")
GROUPS = ("eager", "compile", "ours", "peers")
PEERS = {"clip": "inf_cl", "siglip": "siglip_kernel"}
CONTEXT_LOST = 3  # the worker's exit status after a CUDA error that poisons the context


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dry-run", action="store_true",
                    help="the CPU with tiny N (default N 96 160, D 64, R 3, budget 300 s), --check on")
    ap.add_argument("--n", type=int, nargs="+", help=f"batch sizes (default {GPU_N}; CPU {CPU_N})")
    ap.add_argument("--d", type=int, help="embedding size (default 768; CPU 64)")
    ap.add_argument("--modes", nargs="+", choices=["bf16", "autocast"], default=["bf16", "autocast"])
    ap.add_argument("--objectives", nargs="+", choices=["clip", "siglip"], default=["clip", "siglip"])
    ap.add_argument("--contenders", nargs="+", choices=GROUPS, default=list(GROUPS))
    ap.add_argument("--ours", nargs="+", choices=OURS, default=["None", "chunked", "materialized", "fused"],
                    help="our algorithms ('None': the default choice)")
    ap.add_argument("--groups", type=int, default=0, metavar="K",
                    help="also run each of ours with group ids, K pairs per group (0: not)")
    ap.add_argument("--fused-max-n", type=int, default=65536,
                    help="skip fused (and None where it resolves to fused) above this N; 0: never skip")
    ap.add_argument("--reps", type=int, help="timed steps per row (default 10; CPU 3)")
    ap.add_argument("--warmup", type=int, default=3, help="at least this many timed warm-up steps after the first")
    ap.add_argument("--max-warmup", type=int, default=10)
    ap.add_argument("--budget", type=float, help="seconds for the rows, from when the worker is ready (default "
                                                 "240; dry run 300); checked between rows")
    ap.add_argument("--row-timeout", type=float, default=120.0, help="a row running longer is killed (s)")
    ap.add_argument("--wall-limit", type=float, default=0.0,
                    help="seconds from the start: no row starts that would end later, and the row running then is "
                         "killed, so that the table is written before a caller's own limit (0: none)")
    ap.add_argument("--setup-timeout", type=float, default=480.0,
                    help="imports and the extension's build (s), in the first worker")
    ap.add_argument("--accuracy-n", type=int, help="the N whose rows get float64 errors (default: the smallest)")
    ap.add_argument("--ref-chunk", type=int, default=4096, help="rows per chunk of the float64 reference")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="markdown file (default $OUT/side_by_side.md when $OUT is set)")
    ap.add_argument("--json", help="JSON records, one per line (default: --out with .jsonl)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if a row failed (error, crash, timeout) or the reference's self-check did; "
                         "OOM and skips are no failure")
    ap.add_argument("--no-supervisor", action="store_true", help="run the rows in this process")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fault", help=argparse.SUPPRESS)  # KEY=hang|crash|lost: the supervisor's own test
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
        args.check = True
    cpu = args.device == "cpu"
    args.n = sorted(set(args.n or (CPU_N if cpu else GPU_N)))
    args.d = args.d or (64 if cpu else 768)
    args.reps = args.reps or (3 if cpu else 10)
    args.budget = args.budget if args.budget is not None else (300.0 if args.dry_run else 240.0)
    args.accuracy_n = args.accuracy_n or args.n[0]
    if args.out is None and os.environ.get("OUT"):
        args.out = os.path.join(os.environ["OUT"], "side_by_side.md")
    if args.json is None and args.out:
        args.json = os.path.splitext(args.out)[0] + ".jsonl"
    return args


# --- records -----------------------------------------------------------------------------------------------------


def read_records(path):
    records = []
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    pass  # a line cut off by a kill
    return records


def append_record(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def row_key(mode, objective, n, contender):
    return f"{mode}/{objective}/{n}/{contender}"


def heartbeat(path, key, limit):
    tmp = path + ".current.tmp"
    with open(tmp, "w") as f:
        json.dump({"key": key, "start": time.time(), "limit": limit}, f)
    os.replace(tmp, path + ".current")


# --- the losses --------------------------------------------------------------------------------------------------


def eager_fn(torch, objective):
    F = torch.nn.functional

    def clip(img, txt, log_s, bias):
        logits_per_image = log_s.exp() * img @ txt.T
        logits_per_text = logits_per_image.T
        labels = torch.arange(img.shape[0], device=img.device)
        return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2

    def siglip(img, txt, log_s, bias):
        logits = log_s.exp() * img @ txt.T + bias
        n = img.shape[0]
        labels = 2 * torch.eye(n, device=img.device, dtype=img.dtype) - torch.ones(n, n, device=img.device,
                                                                                   dtype=img.dtype)
        return -F.logsigmoid(labels * logits).sum() / n

    return clip if objective == "clip" else siglip


def reference(torch, img, txt, objective, chunk):
    """Loss and gradients (to img, txt, log s, b) in float64, in row chunks: never more than chunk x N logits."""
    q, k = img.double(), txt.double()
    n = q.shape[0]
    f64 = dict(dtype=torch.float64, device=q.device)
    dq, dk = torch.empty_like(q), torch.zeros_like(k)
    dlogs, db = torch.zeros((), **f64), torch.zeros((), **f64)
    if objective == "clip":
        s = CLIP_SCALE
        diag = s * (q * k).sum(1)
        r, c = torch.empty(n, **f64), torch.full((n,), -math.inf, **f64)
        for i in range(0, n, chunk):
            S = s * q[i:i + chunk] @ k.T
            r[i:i + chunk] = torch.logsumexp(S, 1)
            c = torch.logaddexp(c, torch.logsumexp(S, 0))
        loss = ((r - diag).sum() + (c - diag).sum()) / (2 * n)
        for i in range(0, n, chunk):
            S = s * q[i:i + chunk] @ k.T
            G = (torch.exp(S - r[i:i + chunk, None]) + torch.exp(S - c[None, :])) / (2 * n)
            rows = torch.arange(G.shape[0], device=q.device)
            G[rows, rows + i] -= 1.0 / n
            dq[i:i + chunk] = s * G @ k
            dk += s * G.T @ q[i:i + chunk]
            dlogs += (G * S).sum()
    else:
        s, b = SIGLIP_SCALE, SIGLIP_BIAS
        loss = torch.zeros((), **f64)
        for i in range(0, n, chunk):
            Z = s * q[i:i + chunk] @ k.T + b
            L = -torch.ones_like(Z)
            rows = torch.arange(Z.shape[0], device=q.device)
            L[rows, rows + i] = 1.0
            loss -= torch.nn.functional.logsigmoid(L * Z).sum()
            G = -L * torch.sigmoid(-L * Z) / n
            dq[i:i + chunk] = s * G @ k
            dk += s * G.T @ q[i:i + chunk]
            dlogs += (G * (Z - b)).sum()
            db += G.sum()
        loss = loss / n
    return {"loss": float(loss), "img": dq, "txt": dk, "log_s": float(dlogs), "bias": float(db)}


def reference_self_check(torch, device):
    """The chunked float64 reference against autograd through the eager form, at a small N (chunks that do not
    divide it): the largest normwise difference."""
    g = torch.Generator(device=device).manual_seed(1)
    F = torch.nn.functional
    img = F.normalize(torch.randn(100, 24, generator=g, device=device, dtype=torch.float64), dim=1)
    txt = F.normalize(torch.randn(100, 24, generator=g, device=device, dtype=torch.float64), dim=1)
    worst = 0.0
    for objective, scale in (("clip", CLIP_SCALE), ("siglip", SIGLIP_SCALE)):
        ref = reference(torch, img, txt, objective, 32)
        leaves = [img.clone().requires_grad_(), txt.clone().requires_grad_(),
                  torch.tensor(math.log(scale), dtype=torch.float64, device=device, requires_grad=True),
                  torch.tensor(SIGLIP_BIAS, dtype=torch.float64, device=device, requires_grad=True)]
        loss = eager_fn(torch, objective)(*leaves)
        loss.backward()
        worst = max(worst, abs(float(loss.detach()) - ref["loss"]) / abs(ref["loss"]),
                    rel_max(torch, leaves[0].grad, ref["img"]), rel_max(torch, leaves[1].grad, ref["txt"]),
                    abs(float(leaves[2].grad) - ref["log_s"]) / abs(ref["log_s"]))
        if objective == "siglip":
            worst = max(worst, abs(float(leaves[3].grad) - ref["bias"]) / abs(ref["bias"]))
    return worst


def rel_max(torch, got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


# --- the worker ----------------------------------------------------------------------------------------------------


class Skip(Exception):
    pass


class Worker:
    def __init__(self, args):
        self.args = args
        self.records = read_records(args.json)
        self.done = {r["key"] for r in self.records if r.get("kind") == "row"}
        self.ready = next((r for r in self.records if r.get("kind") == "env"), None)
        self.cuda = args.device == "cuda"

    def log(self, *what):
        print(*what, flush=True)

    def setup(self):
        heartbeat(self.args.json, "setup", self.args.setup_timeout)
        t0 = time.time()
        sys.path.insert(0, PACKAGE_DIR)
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch-extensions"))
        import torch

        self.torch = torch
        self.dev = torch.device(self.args.device)
        if self.cuda and not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible to this torch (use --device cpu or --dry-run on a CPU)")
        if self.cuda:  # the extension for this card (9.0 on an H200, as scripts/gpu_torch_check.sh builds it)
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "%d.%d" % torch.cuda.get_device_capability())
        env = {"kind": "env", "torch": torch.__version__, "cuda": torch.version.cuda, "device": self.args.device,
               "python": sys.version.split()[0]}
        if self.cuda:
            env["card"] = torch.cuda.get_device_name()
            env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
            free, total = torch.cuda.mem_get_info()
            env["memory_total"], env["memory_free"] = total, free
            env["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
        else:
            env["card"] = cpu_name()
        try:
            import triton

            env["triton"] = triton.__version__
        except Exception as e:  # noqa: BLE001 - a torch without Triton: the peers say so
            env["triton"] = f"absent ({type(e).__name__})"
        self.ours_error = None
        try:
            import contrastive_torch as ct
            import contrastive_torch.functional as CF

            self.CF = CF
            env["contrastive_torch"] = ct.__version__
            previous = [r["reason"] for r in self.records if r.get("kind") == "ours_disabled"]
            if previous:
                raise RuntimeError(previous[-1])
            t = time.time()
            ct.cuda_extension() if self.cuda else ct.extension()
            env["extension_s"] = round(time.time() - t, 1)
        except Exception as e:  # noqa: BLE001 - every other contender still runs
            self.ours_error = f"{type(e).__name__}: {first_line(e)}"
            env["ours_error"] = self.ours_error
            self.log("contrastive_torch unavailable:", self.ours_error, "\n" + traceback.format_exc()[-3000:])
        self.peers = {name: self.import_peer(name) for name in PEERS.values()}
        for name, (fn, version, why) in self.peers.items():
            env[name] = version or why
        env["setup_s"] = round(time.time() - t0, 1)
        if self.ready is None:
            env["t_ready"] = time.time()
            append_record(self.args.json, env)
            self.ready = env
            self.log(f"ready after {env['setup_s']} s: {json.dumps(env)}")
            if self.args.dry_run or self.args.check:
                worst = reference_self_check(torch, self.dev)
                append_record(self.args.json, {"kind": "self_check", "worst": worst, "ok": worst < 1e-10})
                self.log(f"float64 reference against autograd: largest relative difference {worst:.2e}")
        self.deadline = self.ready["t_ready"] + self.args.budget
        run = next((r for r in self.records if r.get("kind") == "run"), {})
        if self.args.wall_limit and "t0" in run:
            self.deadline = min(self.deadline, run["t0"] + self.args.wall_limit)

    def import_peer(self, name):
        """(loss function, version, why not)."""
        import importlib.metadata
        import importlib.util

        if importlib.util.find_spec(name) is None:
            return None, None, "not installed"
        try:
            version = importlib.metadata.version(name.replace("_", "-"))
        except Exception:  # noqa: BLE001
            version = "?"
        if not self.cuda:
            return None, version, f"{name} {version} installed; needs CUDA (Triton kernels)"
        try:
            if name == "inf_cl":
                stub = None
                try:
                    import numpy  # noqa: F401 - inf_cl imports it (it uses it in its __main__ demos only)
                except ImportError:
                    import types

                    stub = sys.modules["numpy"] = types.ModuleType("numpy")
                try:
                    from inf_cl import cal_inf_loss
                finally:
                    if stub is not None and sys.modules.get("numpy") is stub:
                        del sys.modules["numpy"]
                return cal_inf_loss, version, None
            from siglip_kernel import fused_siglip_loss

            return fused_siglip_loss, version, None
        except Exception as e:  # noqa: BLE001
            return None, None, f"import failed: {type(e).__name__}: {first_line(e)}"

    # -- the plan --

    def contenders(self, objective):
        a = self.args
        out = []
        if "eager" in a.contenders:
            out.append("eager")
        if "ours" in a.contenders:
            out += ["ours" if alg == "None" else f"ours:{alg}" for alg in a.ours]
            if a.groups > 0:
                out += ["ours+ids" if alg == "None" else f"ours:{alg}+ids" for alg in a.ours]
        if "peers" in a.contenders:
            out.append(PEERS[objective])
        if "compile" in a.contenders:
            out.append("compile")
        return out

    def plan(self):
        a = self.args
        return [(mode, objective, n, c) for mode in a.modes for objective in a.objectives for n in a.n
                for c in self.contenders(objective)]

    # -- one row --

    def make_fn(self, objective, contender, mode):
        """(loss function of (img, txt, log_s, bias), note)."""
        torch = self.torch
        if contender == "eager":
            return eager_fn(torch, objective), ""
        if contender == "compile":
            torch._dynamo.reset()  # a fresh compile per row; no cache limit falls back to eager
            return torch.compile(eager_fn(torch, objective), fullgraph=True, dynamic=False), ""
        if contender.startswith("ours"):
            if self.ours_error:
                raise RuntimeError(f"contrastive_torch: {self.ours_error}")
            plus = contender.endswith("+ids")
            alg = contender[:len(contender) - 4 if plus else None].partition(":")[2] or None
            ids = {}
            if plus:
                group = self.ids_for(self.current_n)
                ids = {"image_groups": group, "text_groups": group}
                from contrastive_torch import _checks

                try:  # the library's own rule: whether this device's step takes group ids
                    _checks.groups(group, group, self.current_n, self.current_n, self.dev,
                                   names=("image_groups", "text_groups"))
                except NotImplementedError as e:
                    raise Skip(first_line(e)) from None
            tiles = alg == "chunked_tiles"
            alg = "chunked" if tiles else alg
            CF = self.CF
            if objective == "siglip" and not tiles:
                from contrastive_torch import _checks

                try:  # the library's own rule: which algorithms the sigmoid loss has on this device
                    _checks.sigmoid_algorithm(alg, self.dev)
                except ValueError as e:
                    raise Skip(first_line(e)) from None
            if objective == "clip":
                def fn(img, txt, log_s, bias):
                    return CF.clip_loss(img, txt, log_s.exp(), algorithm=alg, fused_tiles=tiles, **ids)
            else:
                if tiles:
                    raise Skip("fused_tiles is an option of the softmax losses only")

                def fn(img, txt, log_s, bias):
                    return CF.siglip_loss(img, txt, log_s.exp(), bias, algorithm=alg, **ids)
            note = f"None: {self.resolved(objective)}" if alg is None else ""
            if plus:
                note = (note + "; " if note else "") + f"ids: {self.args.groups} pairs per group"
                if self.dev.type == "cuda":  # the device step takes one positive per row
                    note += ", PyTorch composition (_grouped.py) whatever the algorithm"
            if mode == "autocast":
                cast = "cast to bf16 (its autocast rule)" if self.ours_casts() else "float32"
                note = (note + "; " if note else "") + cast
            return fn, note
        fn, version, why = self.peers[contender]
        if fn is None:
            raise Skip(why)
        if contender == "inf_cl":
            head = next(h for h in (256, 128, 64, 32, 16, 1) if self.args.d % h == 0)
            if head < 16:
                raise Skip(f"D = {self.args.d} has no head_dim in 16..256 dividing it")

            def inf(img, txt, log_s, bias):
                s = log_s.exp()
                return (fn(s * img, txt, head_dim=head) + fn(s * txt, img, head_dim=head)) / 2
            return inf, f"head_dim {head}"
        note = "auto router"
        try:
            from siglip_kernel.gpu_config import get_gpu_arch

            arch = get_gpu_arch()
            note = ("auto: chunked_bf16" if mode == "bf16" else
                    f"auto: float32 input, {'hopper' if arch >= 89 else 'fused'} kernel")
        except Exception:  # noqa: BLE001
            pass
        return (lambda img, txt, log_s, bias: fn(img, txt, log_s, bias)), note

    def ids_for(self, n):
        """Group ids of n pairs, --groups consecutive pairs per group, on the device (int64)."""
        return self.torch.arange(n, device=self.dev) // self.args.groups

    def ours_casts(self):
        """Whether our operators cast float32 features under autocast (their autocast rule)."""
        try:
            from contrastive_torch import _ops

            return hasattr(_ops, "autocast_features")
        except Exception:  # noqa: BLE001
            return False

    def resolved(self, objective):
        """What algorithm None runs here (contrastive_torch's choice; '?' where it cannot be read)."""
        try:
            from contrastive_torch import _checks

            if objective == "clip":
                return _checks.resolve_algorithm(None, self.dev)
            return _checks.sigmoid_algorithm(None, self.dev)
        except Exception:  # noqa: BLE001
            return "?"

    def skip_reason(self, mode, objective, n, contender):
        a, torch = self.args, self.torch
        alg = contender.removesuffix("+ids").partition(":")[2] if contender.startswith("ours") else None
        if contender.startswith("ours") and not alg:
            alg = self.resolved(objective)
        if alg == "fused" and a.fused_max_n and n > a.fused_max_n:
            what = "None runs fused here; " if contender == "ours" else ""
            return f"{what}fused above N = {a.fused_max_n} (--fused-max-n)"
        if self.cuda:
            elem = 2 if mode == "bf16" or self.ours_casts() else 4
            need, what = 0, ""
            if contender in ("eager", "compile"):
                need, what = 4 * n * n, "2 N^2 x 2 B: the bf16 logits and their gradient"
            elif alg == "materialized":
                need, what = elem * n * n, f"N^2 x {elem} B: the logits in the features' dtype"
            free, total = torch.cuda.mem_get_info()
            if need > total:
                return f"needs >= {need / 2**30:.0f} GiB ({what}); the device has {total / 2**30:.0f} GiB"
        prior = self.prior.get((mode, objective, contender))
        if prior:
            n0, step_s, overhead_s = prior
            step = step_s * (n / n0) ** 2
            cost = overhead_s + (2 + min(a.warmup, 2) + min(a.reps, 3)) * step  # first, warm-up, R, memory
            left = self.deadline - time.time()
            if cost > left:
                return (f"predicted {cost:.0f} s ({step * 1e3:.0f} ms a step: N^2 from N = {n0}), "
                        f"{max(left, 0):.0f} s of the budget left")
            if overhead_s + 4 * step > a.row_timeout:
                return f"predicted {step:.1f} s a step (N^2 from N = {n0}): over --row-timeout"
        return None

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def timed(self, step):
        if self.cuda:
            start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t = time.perf_counter()
        step()
        return time.perf_counter() - t

    def run_row(self, mode, objective, n, contender, inputs, ref):
        torch, a = self.torch, self.args
        row = {}
        self.current_n = n
        if contender.endswith("+ids"):
            ref = None  # the float64 reference has one positive per row
        fn, row["note"] = self.make_fn(objective, contender, mode)
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        img = inputs[0].to(dtype, copy=True).requires_grad_()
        txt = inputs[1].to(dtype, copy=True).requires_grad_()
        scale = CLIP_SCALE if objective == "clip" else SIGLIP_SCALE
        log_s = torch.tensor(math.log(scale), device=self.dev, dtype=torch.float32, requires_grad=True)
        bias = torch.tensor(SIGLIP_BIAS, device=self.dev, dtype=torch.float32, requires_grad=True)
        leaves = [img, txt, log_s] + ([bias] if objective == "siglip" else [])

        def context():
            if mode == "autocast":
                return torch.autocast(self.dev.type, dtype=torch.bfloat16)
            return contextlib.nullcontext()

        out = {}

        def step():
            for t in leaves:
                t.grad = None
            with context():
                loss = fn(img, txt, log_s, bias)
            loss.backward()
            out["loss"] = loss.detach()

        t0 = time.perf_counter()
        step()
        self.sync()
        row["first_call_s"] = time.perf_counter() - t0
        budget_s = a.row_timeout * 0.6 - row["first_call_s"]
        warm = [self.timed(step)]
        # At least --warmup steps, more until two agree within 5%; a third of the row's time at most.
        while sum(warm) + warm[-1] <= budget_s / 3 and (len(warm) < a.warmup or (
                2 <= len(warm) < a.max_warmup and abs(warm[-1] - warm[-2]) > 0.05 * warm[-1])):
            warm.append(self.timed(step))
        reps = max(1, min(a.reps, int((budget_s - sum(warm)) / max(warm[-1], 1e-9))))
        times = [self.timed(step) for _ in range(reps)]
        row.update(median_ms=statistics.median(times) * 1e3, min_ms=min(times) * 1e3, max_ms=max(times) * 1e3,
                   reps=reps, warmup=len(warm) + 1)
        if self.cuda:
            for t in leaves:
                t.grad = None
            out.clear()
            gc.collect()
            self.sync()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            self.sync()
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        if ref is not None:
            loss = float(out["loss"])
            row["loss_value"] = loss
            row["loss_err"] = abs(loss - ref["loss"]) / abs(ref["loss"])
            errs = []
            for name, leaf in (("img", img), ("txt", txt)):
                if leaf.grad is None:
                    raise RuntimeError(f"no gradient reached the {name} features")
                errs.append(rel_max(torch, leaf.grad, ref[name]))
            row["grad_err"] = max(errs)
            row["grad_err_img"], row["grad_err_txt"] = errs
            if log_s.grad is not None:
                row["dlogs_err"] = abs(float(log_s.grad) - ref["log_s"]) / abs(ref["log_s"])
            if objective == "siglip" and bias.grad is not None:
                row["db_err"] = abs(float(bias.grad) - ref["bias"]) / abs(ref["bias"])
        overhead = max(row["first_call_s"] - warm[0], 0.0)
        self.prior[(mode, objective, contender)] = (n, row["median_ms"] / 1e3, overhead)
        return row

    def fault(self, key):
        """--fault KEY=hang|crash|lost: that row hangs, kills its process, or loses the (CUDA) context."""
        target, _, kind = (self.args.fault or "").partition("=")
        if target != key:
            return
        if kind == "hang":
            time.sleep(1e6)
        if kind == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        if kind == "lost":
            self.context_alive = lambda: False
            raise RuntimeError("CUDA error: an illegal memory access was encountered (--fault)")

    def context_alive(self):
        if not self.cuda:
            return True
        try:
            self.torch.cuda.synchronize()
            return float((self.torch.ones(1, device=self.dev) + 1).item()) == 2.0
        except Exception:  # noqa: BLE001
            return False

    def free(self):
        gc.collect()
        if self.cuda:
            try:
                self.torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass

    def inputs_for(self, n):
        torch = self.torch
        g = torch.Generator(device=self.dev).manual_seed(self.args.seed * 1000003 + n)
        F = torch.nn.functional
        return tuple(F.normalize(torch.randn(n, self.args.d, generator=g, device=self.dev), dim=1)
                     .to(torch.bfloat16) for _ in range(2))

    def run(self):
        self.setup()
        torch, a = self.torch, self.args
        self.prior = {}
        for r in self.records:
            if r.get("kind") == "row" and r.get("status") == "ok":
                self.prior[(r["mode"], r["objective"], r["contender"])] = (r["n"], r["median_ms"] / 1e3,
                                                                           r.get("overhead_s", 0.0))
        plan = self.plan()
        inputs, refs, current_n = None, {}, None
        for i, (mode, objective, n, contender) in enumerate(plan):
            key = row_key(mode, objective, n, contender)
            if key in self.done:
                continue
            if time.time() > self.deadline:
                left = [row_key(*p) for p in plan[i:] if row_key(*p) not in self.done]
                append_record(a.json, {"kind": "stop", "reason": f"budget of {a.budget:.0f} s spent",
                                       "not_run": left})
                self.log(f"budget of {a.budget:.0f} s spent: {len(left)} rows not run")
                return 0
            row = {"kind": "row", "key": key, "mode": mode, "objective": objective, "n": n, "d": a.d,
                   "contender": contender}
            t0 = time.time()
            heartbeat(a.json, key, a.row_timeout)
            try:
                reason = self.skip_reason(mode, objective, n, contender)
                if reason:
                    raise Skip(reason)
                if n != current_n:
                    inputs, refs, current_n = None, {}, None
                    self.free()
                    inputs, current_n = self.inputs_for(n), n
                ref = None
                if n == a.accuracy_n:
                    if objective not in refs:
                        refs[objective] = reference(torch, inputs[0], inputs[1], objective, a.ref_chunk)
                    ref = refs[objective]
                self.fault(key)
                row.update(self.run_row(mode, objective, n, contender, inputs, ref))
                row["status"] = "ok"
            except Skip as e:
                row.update(status="skip", reason=str(e))
            except Exception as e:  # noqa: BLE001 - a row's failure is its result
                oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()
                row.update(status="OOM" if oom else "error", reason=f"{type(e).__name__}: {first_line(e)}")
                if not oom:
                    self.log(traceback.format_exc()[-4000:])
            row["wall_s"] = round(time.time() - t0, 2)
            if row.get("status") == "ok":
                key3 = (mode, objective, contender)
                row["overhead_s"] = self.prior[key3][2] if key3 in self.prior else 0.0
            self.free()
            alive = self.context_alive()
            if not alive:
                row["reason"] = row.get("reason", "") + " (the CUDA context is lost: a fresh worker goes on)"
            append_record(a.json, row)
            self.done.add(key)
            self.log(format_line(row))
            render(a, read_records(a.json), write=True, quiet=True)
            if not alive:
                return CONTEXT_LOST
        append_record(a.json, {"kind": "stop", "reason": "done", "not_run": []})
        return 0


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} logical cores)"
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def first_line(e):
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:300]


def format_line(r):
    what = f"{r['mode']:8} {r['objective']:6} N={r['n']:<7} {r['contender']:18}"
    if r.get("status") != "ok":
        return f"{what} {r.get('status')}: {r.get('reason', '')}"
    extra = f" peak {r['peak_mib']:.0f} MiB" if "peak_mib" in r else ""
    if "grad_err" in r:
        extra += f" loss err {r['loss_err']:.1e} grad err {r['grad_err']:.1e}"
    return f"{what} {r['median_ms']:.2f} ms (R={r['reps']}){extra} [{r['wall_s']:.0f} s]"


# --- the table -----------------------------------------------------------------------------------------------------


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def render(args, records, write=True, quiet=False):
    run = next((r for r in records if r.get("kind") == "run"), {})
    env = next((r for r in records if r.get("kind") == "env"), {})
    rows = [r for r in records if r.get("kind") == "row"]
    stops = [r for r in records if r.get("kind") == "stop"]
    checks = [r for r in records if r.get("kind") == "self_check"]
    lines = [f"## Side by side: {env.get('card', '?')}", ""]
    versions = [f"PyTorch {env.get('torch', '?')}", f"CUDA {env.get('cuda')}", f"Triton {env.get('triton', '?')}",
                f"contrastive_torch {env.get('contrastive_torch', '?')}", f"inf_cl: {env.get('inf_cl', '?')}",
                f"siglip_kernel: {env.get('siglip_kernel', '?')}", f"Python {env.get('python', '?')}"]
    lines.append("- " + ", ".join(versions))
    if env.get("capability"):
        lines.append(f"- compute capability {env['capability']}, {env.get('memory_total', 0) / 2**30:.1f} GiB; "
                     f"float32 matmul allow_tf32 = {env.get('allow_tf32')}")
    lines.append(f"- command: `{run.get('command', '?')}`")
    lines.append(f"- setup {env.get('setup_s', '?')} s (extension load/build {env.get('extension_s', '-')} s); "
                 f"D = {args.d}; CLIP s = {CLIP_SCALE:g}; SigLIP s = {SIGLIP_SCALE:g}, b = {SIGLIP_BIAS:g}")
    clock = "CUDA events" if args.device == "cuda" else "wall clock"
    lines.append(f"- time: median of R forward+backward steps after warm-up ({clock}); memory: peak of one step "
                 f"above the inputs; errors at N = {args.accuracy_n} "
                 "against float64 from the same inputs: loss |L - L64| / |L64|, gradients max|g - g64| / max|g64| "
                 "(the worse of the two feature tensors), d log s relative")
    if env.get("ours_error"):
        lines.append(f"- contrastive_torch could not run: {env['ours_error']}")
    for c in checks:
        lines.append(f"- float64 reference vs autograd (N = 100): {c['worst']:.1e} ({'ok' if c['ok'] else 'FAIL'})")
    lines += ["", "| mode | loss | N | contender | time | x eager | R | peak memory | x eager | loss err | grad err "
                  "| d log s err | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    eager = {(r["mode"], r["objective"], r["n"]): r for r in rows if r["contender"] == "eager"
             and r.get("status") == "ok"}
    for r in rows:
        e = eager.get((r["mode"], r["objective"], r["n"]))
        if r.get("status") == "ok":
            t = f"{r['median_ms']:.2f} ms"
            tx = fmt(r["median_ms"] / e["median_ms"], ".2f") if e else "-"
            mem = f"{r['peak_mib']:.0f} MiB" if "peak_mib" in r else "-"
            mx = (fmt(r["peak_mib"] / e["peak_mib"], ".3f") if e and "peak_mib" in r and e.get("peak_mib")
                  else "-")
            note = r.get("note", "")
            if r.get("first_call_s", 0) > 2:
                note = (note + "; " if note else "") + f"first call {r['first_call_s']:.1f} s"
            cells = [t, tx, str(r["reps"]), mem, mx, fmt(r.get("loss_err"), ".1e"), fmt(r.get("grad_err"), ".1e"),
                     fmt(r.get("dlogs_err"), ".1e"), note]
        else:
            cells = [r.get("status", "?"), "", "", "", "", "", "", "", r.get("reason", "").replace("|", "/")]
        lines.append("| " + " | ".join([r["mode"], r["objective"], str(r["n"]), r["contender"]] + cells) + " |")
    for s in stops:
        if s.get("not_run"):
            lines.append("")
            lines.append(f"Not run ({s['reason']}): {len(s['not_run'])} rows: {', '.join(s['not_run'][:40])}"
                         + (" ..." if len(s["not_run"]) > 40 else ""))
    text = "\n".join(lines) + "\n"
    if write and args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out)
    if not quiet:
        print(text, flush=True)
    return text


# --- the supervisor ------------------------------------------------------------------------------------------------


def supervise(args, argv):
    if not args.json:
        args.json = os.path.join(tempfile.mkdtemp(prefix="side-by-side-"), "side_by_side.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    open(args.json, "w").close()
    t0 = time.time()
    command = " ".join(shlex.quote(x) for x in [os.path.relpath(sys.argv[0], ROOT)] + argv)
    append_record(args.json, {"kind": "run", "command": f"python3 {command}", "argv": argv, "t0": t0})
    print(f"records: {args.json}" + (f"; table: {args.out}" if args.out else ""), flush=True)
    base = [sys.executable, os.path.abspath(__file__)] + argv + ["--worker", "--json", args.json]
    if args.out:
        base += ["--out", args.out]
    for _ in range(8):
        with contextlib.suppress(OSError):
            os.remove(args.json + ".current")  # a fresh worker starts with no row
        proc = subprocess.Popen(base, start_new_session=True)
        status, key = watch(args, proc, t0)
        if status == "done":
            break
        records = read_records(args.json)
        env = next((r for r in records if r.get("kind") == "env"), None)
        if status == "context lost":
            print("the worker lost its CUDA context; a fresh one goes on", flush=True)
        elif key in (None, "setup"):
            if env is None and status == "timeout" and not any(r.get("kind") == "ours_disabled" for r in records):
                reason = f"imports and extension build over --setup-timeout ({args.setup_timeout:.0f} s)"
                print(f"{reason}: the other contenders go on without contrastive_torch", flush=True)
                append_record(args.json, {"kind": "ours_disabled", "reason": reason})
                remove_build_lock()
                continue
            print(f"the worker failed before its first row ({status}); stopping", flush=True)
            append_record(args.json, {"kind": "stop", "reason": f"setup: {status}", "not_run": []})
            break
        elif key not in {r.get("key") for r in records if r.get("kind") == "row"}:
            mode, objective, n, contender = key.split("/")
            append_record(args.json, {"kind": "row", "key": key, "mode": mode, "objective": objective,
                                      "n": int(n), "d": args.d, "contender": contender,
                                      "status": "timeout" if "timeout" in status else "crash",
                                      "reason": f"the worker: {status}"})
        late = args.wall_limit and time.time() > t0 + args.wall_limit
        if late or (env and time.time() > env["t_ready"] + args.budget):
            done = {r.get("key") for r in read_records(args.json) if r.get("kind") == "row"}
            left = [row_key(*p) for p in Worker(args).plan() if row_key(*p) not in done]
            append_record(args.json, {"kind": "stop", "reason": "wall limit" if late else "budget spent",
                                      "not_run": left})
            break
    with contextlib.suppress(OSError):
        os.remove(args.json + ".current")
    records = read_records(args.json)
    render(args, records)
    return check(args, records)


def check(args, records):
    """--check: 1 when a row failed (error, crash, timeout), the reference's self-check did, or setup did."""
    if not args.check:
        return 0
    bad = [r["key"] for r in records if r.get("kind") == "row" and r.get("status") in ("error", "crash", "timeout")]
    bad += ["reference self-check" for r in records if r.get("kind") == "self_check" and not r["ok"]]
    if not any(r.get("kind") == "env" for r in records):
        bad.append("setup")
    if bad:
        print(f"--check: failed: {', '.join(bad)}", flush=True)
        return 1
    return 0


def remove_build_lock():
    """torch's extension build waits for its lock file: one left by the killed worker would hold every later build
    (this script's next worker, scripts/gpu_torch_check.sh) forever."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch-extensions"))
    # The host build's name carries its CPU's tag (contrastive_torch._extension.host_build_name).
    for lock in glob.glob(os.path.join(root, "contrastive_torch*_ext*", "lock")):
        with contextlib.suppress(OSError):
            os.remove(lock)


def watch(args, proc, t0):
    """Waits for the worker: ('done' | 'context lost' | 'exit N' | 'timeout' | 'wall limit', the row it was on).
    Kills it (its process group: inductor's compile workers too) when its row overruns."""
    current = args.json + ".current"
    while True:
        try:
            rc = proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            rc = None
        try:
            with open(current) as f:
                beat = json.load(f)
        except (OSError, ValueError):
            beat = {}
        if rc is not None:
            if rc == 0:
                return "done", beat.get("key")
            return ("context lost" if rc == CONTEXT_LOST else f"exit {rc}"), beat.get("key")
        over = beat and time.time() - beat["start"] > beat["limit"]
        late = args.wall_limit and time.time() > t0 + args.wall_limit
        if over or late:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            what = f"over its {beat['limit']:.0f} s" if over else f"at the wall limit ({args.wall_limit:.0f} s)"
            print(f"{beat.get('key', 'the worker')}: {what}: the worker was killed", flush=True)
            return ("timeout" if over else "wall limit timeout"), beat.get("key")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        return Worker(args).run()
    clean = []
    skip = 0
    for i, x in enumerate(argv):  # the worker gets --json and --out as resolved here
        if skip:
            skip -= 1
            continue
        if x in ("--json", "--out"):
            skip = 1
            continue
        if x.startswith(("--json=", "--out=")):
            continue
        clean.append(x)
    if args.no_supervisor:
        if not args.json:
            args.json = os.path.join(tempfile.mkdtemp(prefix="side-by-side-"), "side_by_side.jsonl")
        open(args.json, "w").close()
        append_record(args.json, {"kind": "run", "command": "python3 " + " ".join(map(shlex.quote, argv)),
                                  "t0": time.time()})
        rc = Worker(args).run()
        records = read_records(args.json)
        render(args, records)
        return rc or check(args, records)
    return supervise(args, clean)


if __name__ == "__main__":
    sys.exit(main())
