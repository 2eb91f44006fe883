# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The fp16 temperature collapse in PyTorch, on open_clip's own model and loss, and its remedies.

    .venv-torch/bin/python examples/python/collapse.py                   # seed 5, every run: about 8 minutes on 2 cores
    .venv-torch/bin/python examples/python/collapse.py --seeds 1-6       # docs/collapse.md's counts (about 30 minutes)
    gnuplot -e "dir='out/torch'; png='docs/collapse_torch.png'" scripts/plot_demo.gp     # the figure

Each run trains a small CLIP built by open_clip's own factory (the installed open-clip-torch; a ViT and a text
transformer of width 64, registered here as a model config) on synthetic pairs: an image is a noisy view of one of
--classes prototypes and its text is that class's token sequence, so the towers learn to match them and a learnable
tau keeps falling. Runs (--runs):

    float        float32, no autocast, no scaler
    fp16         torch.autocast(float16) + torch.amp.GradScaler, open_clip's ClipLoss, learnable tau: the collapse
    fp16_clamp   the same, with open_clip's clamp of logit_scale to [0, ln 100] after every step (its default)
    fp16_guard   the same, with contrastive_torch.temperature.RangeGuard instead of the clamp
    fp16_fused   the same, with contrastive_torch.ClipLoss (fused: the logits stay in float32) instead of open_clip's
    bf16         torch.autocast(bfloat16), no scaler, open_clip's ClipLoss (open_clip's advice)

float16 autocast is slow on a CPU without float16 arithmetic (this model: 104 ms per step against 9 ms in float32),
which is what sets the run time. --device cuda (the default where a GPU is present) trains there instead.

tau's optimiser is ACCELERATED, as in the C++ demo (docs/demo.md): logit_scale has its own Adam parameter group (lr
--tau-lr, default 1.0, betas 0.9/0.9) so that tau falls within a few hundred steps instead of many thousands; the
towers use AdamW (lr --lr). Everything else is open_clip's: its model classes, its ClipLoss, PyTorch's GradScaler
with its defaults (2^16, x2 after 2000 finite steps, x0.5 on every skipped one, no floor). Every run of a seed starts
from the same weights and sees the same batches. A CollapseMonitor follows each run (its CSV: out/torch/<run>-<seed>
.csv, the C++ demo's columns); the table gives per run: the last loss, held-out top-1 retrieval among --eval-pairs
pairs (both directions), tau at the end and its smallest value, the smallest and last loss scale, skipped steps, the
collapse step (the first of >= 20 skipped steps that last to the end) and the first non-finite site then, and the
guard's overflow events. Over several seeds it counts outcomes per run as scripts/demo_seeds.py does for the C++ demo:
collapsed, degraded (top-1 more than 5 points below the float run of the seed, or >= 20 skipped steps), through.
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "python"))
import contrastive_torch as ct  # noqa: E402
from contrastive_torch.temperature import CollapseMonitor, CollapseWarning, RangeGuard  # noqa: E402

MODEL = "collapse-demo-vit-w64"
CONFIG = {"embed_dim": 64,
          "vision_cfg": {"image_size": 16, "layers": 1, "width": 64, "head_width": 32, "patch_size": 8},
          "text_cfg": {"context_length": 8, "vocab_size": 1024, "width": 64, "heads": 2, "layers": 1}}
RUNS = ["float", "fp16", "fp16_clamp", "fp16_guard", "fp16_fused", "bf16"]
COLLAPSE_RUN = 20  # skipped steps that last to the end (the C++ demo, 1200 steps: 50)


def seeds_of(text):
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


class Data:
    """Synthetic pairs: class c's image is prototype c plus noise, its text is class c's tokens."""

    def __init__(self, classes, seed, latent=0):
        g = torch.Generator().manual_seed(1000 + seed)
        if latent:  # prototypes on a latent-dimensional subspace: near neighbours, small margins (the C++ demo's z)
            z = torch.randn(classes, latent, generator=g)
            m = torch.randn(latent, 3 * 16 * 16, generator=g) / latent ** 0.5
            self.protos = (z @ m).reshape(classes, 3, 16, 16)
        else:
            self.protos = torch.randn(classes, 3, 16, 16, generator=g)
        self.words = torch.randint(1, 1024, (classes, 8), generator=g)
        self.classes = classes

    def batch(self, n, g, noise):
        c = torch.randperm(self.classes, generator=g)[:n]
        return self.protos[c] + noise * torch.randn(n, 3, 16, 16, generator=g), self.words[c]


def top1(model, images, texts, autocast):
    with torch.no_grad(), autocast():
        f_img, f_txt, _ = model(images, texts)
    sim = f_img.float() @ f_txt.float().T
    target = torch.arange(sim.shape[0], device=sim.device)
    return 50.0 * float((sim.argmax(1) == target).float().mean() + (sim.argmax(0) == target).float().mean())


def train(run, seed, args, open_clip, out_dir):
    torch.manual_seed(seed)
    device = args.device
    model = open_clip.create_model(MODEL).to(device)
    data = Data(args.classes, seed, args.latent)
    g = torch.Generator().manual_seed(seed)
    eval_images, eval_texts = (t.to(device) for t in data.batch(args.eval_pairs,
                                                                  torch.Generator().manual_seed(10_000 + seed),
                                                                  args.noise))
    towers = [p for n, p in model.named_parameters() if n != "logit_scale"]
    opt = torch.optim.AdamW([{"params": towers, "lr": args.lr, "weight_decay": args.wd},
                             {"params": [model.logit_scale], "lr": args.tau_lr, "betas": (0.9, 0.9),
                              "weight_decay": 0.0}])
    half = run.startswith("fp16")
    dtype = torch.float16 if half else (torch.bfloat16 if run == "bf16" else torch.float32)
    scaler = torch.amp.GradScaler(device, enabled=half)
    loss_fn = ct.ClipLoss() if run == "fp16_fused" else open_clip.ClipLoss()

    def autocast():
        return torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32)

    guard = RangeGuard(model.logit_scale, opt, scaler, dtype=torch.float16) if run == "fp16_guard" else None
    monitor = CollapseMonitor(scaler, model.logit_scale, dtype=dtype, warn=False)
    rows, warmup = [], args.warmup
    for step in range(args.steps):
        for group, lr, decay in zip(opt.param_groups, (args.lr, args.tau_lr), (args.cosine, False)):
            ramp = min(1.0, (step + 1) / warmup)
            if decay and step >= warmup:  # open_clip's cosine schedule after the warm-up (the towers only)
                ramp = 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))
            group["lr"] = lr * ramp
        images, texts = (t.to(device) for t in data.batch(args.batch, g, args.noise))
        with autocast():
            f_img, f_txt, logit_scale = model(images, texts)
            loss = loss_fn(f_img, f_txt, logit_scale)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        report = loss_fn.last_step if run == "fp16_fused" else None
        if run == "fp16_clamp":
            ct.clamp_logit_scale(model.logit_scale)
        if guard is not None:
            guard.step(loss=loss, report=report)
        rec = monitor.step(loss=loss, report=report)
        acc = top1(model, eval_images, eval_texts, autocast) if (step + 1) % args.eval_every == 0 else None
        rows.append((rec, acc))
    acc = top1(model, eval_images, eval_texts, autocast)
    name = f"{run}-{seed}"
    with open(os.path.join(out_dir, name + ".csv"), "w") as f:
        f.write("step,loss,tau,loss_scale,skipped,accuracy,max_logit,first_nonfinite\n")
        for rec, a in rows:
            f.write(f"{rec['step']},{rec['loss']:.6g},{rec['tau']:.6g},{rec['next_loss_scale']:.6g},"
                    f"{int(rec['skipped'])},{'' if a is None else f'{a:.2f}'},{rec['max_logit']:.6g},"
                    f"{rec['first_nonfinite']}\n")
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump({"top1": acc, "events": guard.events if guard is not None else None}, f)
    return summarize(run, seed, [r for r, _ in rows], acc, guard.events if guard is not None else None)


def summarize(run, seed, recs, top1_value, events):
    """One run's row of the table from its per-step records (those a CollapseMonitor returns, or a CSV's)."""
    tail = 0
    for r in reversed(recs):
        if not r["skipped"]:
            break
        tail += 1
    collapsed = recs[-tail]["step"] if tail >= COLLAPSE_RUN else None
    skipped = [r for r in recs if r["skipped"]]
    return {"run": run, "seed": seed, "loss": recs[-1]["loss"], "top1": top1_value, "tau": recs[-1]["tau"],
            "min_tau": min(r["tau"] for r in recs), "max_tau": max(r["tau"] for r in recs),
            "late_max_tau": max(r["tau"] for r in recs[100:] or recs),
            "min_scale": min(r["next_loss_scale"] for r in recs), "scale": recs[-1]["next_loss_scale"],
            "skipped": len(skipped), "collapsed": collapsed,
            "site": recs[-tail]["first_nonfinite"] if collapsed is not None else
            (skipped[0]["first_nonfinite"] if skipped else "-"), "events": events}


def from_csv(run, seed, out_dir):
    """A finished run's row, re-read from its CSV (and the .json beside it) instead of training again."""
    name = os.path.join(out_dir, f"{run}-{seed}")
    recs, top1_value = [], None
    with open(name + ".csv") as f:
        next(f)
        for line in f:
            step, loss, tau, scale, skipped, acc, max_logit, site = line.strip().split(",")
            recs.append({"step": int(step), "loss": float(loss), "tau": float(tau), "next_loss_scale": float(scale),
                         "skipped": skipped == "1", "max_logit": float(max_logit), "first_nonfinite": site})
            top1_value = float(acc) if acc else top1_value
    extra = {}
    if os.path.exists(name + ".json"):
        with open(name + ".json") as f:
            extra = json.load(f)
    r = summarize(run, seed, recs, extra.get("top1", top1_value), extra.get("events"))
    r["time"] = 0.0
    return r


def one_run(work):
    """One (run, seed) in this process (a pool worker with --jobs): registers the model config, trains, times."""
    run, seed, args = work
    import logging

    import open_clip

    logging.getLogger().setLevel(logging.ERROR)  # open_clip's "no pretrained weights" line, once per run
    torch.set_num_threads(args.threads)
    start = time.time()
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, MODEL + ".json"), "w") as f:
            json.dump(CONFIG, f)
        open_clip.add_model_config(d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CollapseWarning)
            r = train(run, seed, args, open_clip, args.out)
    r["time"] = time.time() - start
    return r


def show(r):
    events = ("?" if r["run"] == "fp16_guard" else "-") if r["events"] is None else r["events"]
    print(f"{r['run']:<11} {r['seed']:>4} {r['loss']:>9.4g} {r['top1']:>5.1f}% {r['tau']:>9.3g} {r['min_tau']:>9.3g} "
          f"{r['min_scale']:>9.3g} {r['scale']:>9.3g} {r['skipped']:>7} "
          f"{'no' if r['collapsed'] is None else 'step ' + str(r['collapsed']):>9}  {r['site']:<16}  "
          f"{events:>12}  {r['max_tau']:>7.3g}  {r['time']:.0f} s", flush=True)
    return r


def verdict(r, float_top1):
    if r["collapsed"] is not None:
        return "collapsed"
    if r["top1"] < float_top1 - 5.0 or r["skipped"] >= 20:
        return "degraded"
    return "through"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="5",
                    help="seeds, e.g. 1-6 or 1,3,5 (default 5: chosen, the seed of 1-6 whose fp16 run collapses)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {','.join(RUNS)}")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--classes", type=int, default=128, help="classes (prototypes); a batch draws distinct ones")
    ap.add_argument("--lr", type=float, default=3e-3, help="the towers' AdamW learning rate")
    ap.add_argument("--cosine", action="store_true", help="the towers' learning rate decays as open_clip's cosine")
    ap.add_argument("--latent", type=int, default=0,
                    help="prototypes from a latent space of this dimension (0: i.i.d.)")
    ap.add_argument("--wd", type=float, default=0.0, help="the towers' AdamW weight decay")
    ap.add_argument("--noise", type=float, default=0.05, help="std of the noise on an image's prototype")
    ap.add_argument("--tau-lr", type=float, default=1.0, help="logit_scale's Adam learning rate (accelerated)")
    ap.add_argument("--warmup", type=int, default=50, help="linear warm-up of both learning rates, in steps")
    ap.add_argument("--eval-pairs", type=int, default=128, help="held-out pairs (<= classes)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per run (default 1: a run's trajectory depends on its summation order, and "
                         "docs/collapse.md's counts are 1 thread per run)")
    ap.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 6), help="runs in parallel processes "
                    "(default: one per core, at most 6)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where to train (default: cuda where present, else cpu; the documented counts are the CPU's)")
    ap.add_argument("--out", default="out/torch", help="directory of the per-step CSVs")
    ap.add_argument("--from-csv", action="store_true",
                    help="tabulate the runs already in --out (their CSVs) instead of training them again")
    args = ap.parse_args()
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    for r in runs:
        if r not in RUNS:
            ap.error(f"--runs: unknown run {r!r} (choose from {','.join(RUNS)})")
    seeds = seeds_of(args.seeds)
    if args.threads < 1 or args.jobs < 1:
        ap.error("--threads and --jobs must be >= 1")
    os.makedirs(args.out, exist_ok=True)
    import open_clip

    print(f"torch {torch.__version__}, open_clip {open_clip.__version__}, {args.jobs} job(s) x "
          f"{args.threads} thread(s) on {args.device}; "
          f"batch {args.batch}, "
          f"{args.steps} steps, tau's Adam lr {args.tau_lr} (accelerated), seeds {args.seeds}")
    print(f"{'run':<11} {'seed':>4} {'loss':>9} {'top-1':>6} {'tau':>9} {'min tau':>9} {'min scale':>9} "
          f"{'scale':>9} {'skipped':>7} {'collapsed':>9}  first non-finite  guard events  max tau  time")
    work = [(run, seed, args) for seed in seeds for run in runs]
    if args.from_csv:
        results = [show(from_csv(run, seed, args.out)) for run, seed, _ in work]
    elif args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            results = [show(r) for r in pool.imap(one_run, work)]
    else:
        results = [show(one_run(w)) for w in work]
    with open(os.path.join(args.out, "index.txt"), "w") as f:
        f.write("\n".join(f"{run}-{seeds[0]}" for run in runs) + "\n")
    float_top1 = {r["seed"]: r["top1"] for r in results if r["run"] == "float"}
    if len(seeds) > 1:
        print(f"\nover seeds {args.seeds}: collapsed / degraded / through (degraded: top-1 > 5 points below the float "
              f"run of the seed, or >= 20 skipped steps)")
        print("| run | collapsed / degraded / through | top-1 (not collapsed) | smallest tau in any step | "
              "largest tau after step 100 |")
        print("|---|---|---|---|---|")
        for run in runs:
            rs = [r for r in results if r["run"] == run]
            counts = [sum(verdict(r, float_top1.get(r["seed"], 0.0)) == v for r in rs)
                      for v in ("collapsed", "degraded", "through")]
            alive = [r["top1"] for r in rs if r["collapsed"] is None]
            span = f"{min(alive):.1f}-{max(alive):.1f}%" if alive else "-"
            print(f"| {run} | {counts[0]} / {counts[1]} / {counts[2]} | {span} | "
                  f"{min(r['min_tau'] for r in rs):.2g} | {max(r['late_max_tau'] for r in rs):.2g} |")


if __name__ == "__main__":
    main()
