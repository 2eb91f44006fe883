# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Memory and time of a CLIP training step on the CPU: contrastive_torch.CachedStep beside the plain step (open_clip's
ClipLoss and ours) and open_clip's --accum-freq scheme at the same global batch, on an open_clip model built by
open_clip's own factory from the installed open-clip-torch (a small ViT registered as a model config here).

    .venv-torch/bin/python scripts/cached_bench.py [--n 512 1024 2048 4096 8192 16384] [--chunk 256] [--steps 2]

Each (scheme, N) runs in a fresh subprocess: one warm-up step, then the median time of --steps steps (forward and
backward, the optimizer excluded), and the growth of the process's resident high-water mark (VmHWM) from before the
first step to the end: the step's peak memory. A scheme whose estimated memory exceeds --max-gib is not run at that
N (the plain step's activations grow with N). glibc's mmap threshold is fixed (MALLOC_MMAP_THRESHOLD_) so that freed
activations go back to the system in both schemes alike."""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")

CONFIG = {"embed_dim": 256,
          "vision_cfg": {"image_size": 32, "layers": 6, "width": 256, "head_width": 64, "patch_size": 16},
          "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 256, "heads": 4, "layers": 6}}

CHILD = r"""
import json, os, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch, open_clip
import contrastive_torch as ct
scheme, n, chunk, steps, config_dir = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "0")) or torch.get_num_threads())
open_clip.add_model_config(config_dir)
torch.manual_seed(0)
model = open_clip.create_model("bench-vit-w256-l6")
model.train()
images = torch.randn(n, 3, 32, 32)
texts = torch.randint(0, 49408, (n, 16))
oc_loss = open_clip.ClipLoss()

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024

def plain(loss_fn):
    f, g, s = model(images, texts)
    loss = loss_fn(f, g, s)
    loss.backward()

def accum():
    # open_clip's --accum-freq: features of every micro-batch without a graph, then per micro-batch its features
    # again with a graph in place of the cached ones, the loss over the whole batch, and a backward.
    k = n // chunk
    with torch.no_grad():
        cached = [model(images[j * chunk:(j + 1) * chunk], texts[j * chunk:(j + 1) * chunk])[:2] for j in range(k)]
    for j in range(k):
        f, g, s = model(images[j * chunk:(j + 1) * chunk], texts[j * chunk:(j + 1) * chunk])
        fs = torch.cat([c[0] for c in cached[:j]] + [f] + [c[0] for c in cached[j + 1:]])
        gs = torch.cat([c[1] for c in cached[:j]] + [g] + [c[1] for c in cached[j + 1:]])
        oc_loss(fs, gs, s).backward()

step = ct.CachedStep(model, ct.ClipLoss(), chunk_size=chunk)
run = {"cached": lambda: step(images, texts, model.logit_scale.exp()), "plain_open_clip": lambda: plain(oc_loss),
       "plain_ours": lambda: plain(ct.ClipLoss()), "accum_freq": accum}[scheme]
before = hwm()
times = []
for i in range(steps + 1):
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    run()
    times.append(time.perf_counter() - t)
print(json.dumps({"time": statistics.median(times[1:]), "peak": hwm() - before}))
"""

# Bytes of activations per sample of the plain step (measured with this model: about 2.1 MiB per sample), used only to
# skip plain runs that would not fit.
PLAIN_BYTES_PER_SAMPLE = 2.2 * 2**20


def measure(scheme, n, chunk, steps, config_dir):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), CONTRASTIVE_TORCH_QUIET="1")
    out = subprocess.run([sys.executable, "-c", CHILD, PACKAGE_DIR, scheme, str(n), str(chunk), str(steps), config_dir],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return None, out.stderr.strip().splitlines()[-1:] or ["failed"]
    return json.loads(out.stdout.strip().splitlines()[-1]), None


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-gib", type=float, default=16.0, help="skip a plain step estimated above this")
    ap.add_argument("--max-accum-n", type=int, default=4096,
                    help="largest N for --accum-freq (it forms the N x N logits N/chunk times per step)")
    ap.add_argument("--schemes", nargs="+", default=["cached", "plain_ours", "plain_open_clip", "accum_freq"])
    args = ap.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as config_dir:
        with open(os.path.join(config_dir, "bench-vit-w256-l6.json"), "w") as f:
            json.dump(CONFIG, f)
        print(f"CPU: {cpu_name()}, {os.cpu_count()} logical cores; torch {torch.__version__}; model: open_clip ViT "
              f"width 256, 6 layers, 32x32 images (patch 16), text width 256, 6 layers, context 16; chunk {args.chunk}; "
              f"median of {args.steps} steps after one warm-up")
        print("| N | scheme | time / step | time / sample | peak memory (VmHWM growth) |")
        print("|---|---|---|---|---|")
        for n in args.n:
            for scheme in args.schemes:
                if scheme.startswith("plain") and n * PLAIN_BYTES_PER_SAMPLE > args.max_gib * 2**30:
                    print(f"| {n} | {scheme} | not run: about {n * PLAIN_BYTES_PER_SAMPLE / 2**30:.0f} GiB of "
                          "activations | | |", flush=True)
                    continue
                if scheme == "accum_freq" and (n > args.max_accum_n or n % args.chunk):
                    continue
                res, err = measure(scheme, n, args.chunk, args.steps, config_dir)
                if res is None:
                    print(f"| {n} | {scheme} | failed: {err[0][:80]} | | |", flush=True)
                    continue
                print(f"| {n} | {scheme} | {res['time']:.2f} s | {1e3 * res['time'] / n:.2f} ms | "
                      f"{res['peak'] / 2**20:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
