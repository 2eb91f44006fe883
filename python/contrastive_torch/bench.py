# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Side by side: contrastive_torch.ClipLoss, open_clip's own ClipLoss (open_clip.loss, where open-clip-torch is
installed) and a plain PyTorch ClipLoss on the same tensors (CPU).

    cd python && ../.venv-torch/bin/python -m contrastive_torch.bench [--n 4096] [--d 512] [--dtype float32] [--steps 5]

Each measurement runs in a fresh subprocess: the median time of a forward+backward step after one warm-up, and the
step's memory as the growth of the process's resident high-water mark (VmHWM) over the steps. glibc's malloc raises
its mmap threshold after the first large free, so later 8 MiB gradient tensors come from the heap and the resident
mark grows by more than either loss holds; `--malloc-mmap-threshold BYTES` fixes the threshold (MALLOC_MMAP_THRESHOLD_)
for both children alike, which shows each loss's working set. The plain loss is
open_clip's form with one product: logits = s * img @ txt.T, cross-entropy over rows and columns, backward() to img,
txt and logit_scale; open_clip's own ClipLoss (one process) forms both logits products, image @ text.T and
text @ image.T. The ratios are against open_clip's ClipLoss where it is installed, else against the plain loss.
"""

import argparse
import importlib.util
import os
import platform
import statistics
import subprocess
import sys

CHILD = r"""
import math, statistics, sys, time
import torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[7])
import contrastive_torch as ct
which, n, d, dtype, steps, algorithm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6]
dev = sys.argv[8]
dtype = getattr(torch, dtype)
g = torch.Generator().manual_seed(0)
img = F.normalize(torch.randn(n, d, generator=g), dim=1).to(dtype).to(dev).requires_grad_()
txt = F.normalize(torch.randn(n, d, generator=g), dim=1).to(dtype).to(dev).requires_grad_()
log_scale = torch.tensor(math.log(1 / 0.07), device=dev).requires_grad_()
labels = torch.arange(n, device=dev)
if which == "contrastive":
    ct.cuda_extension() if dev == "cuda" else ct.extension()
    fn = ct.ClipLoss(algorithm=algorithm)
elif which == "open_clip":
    import open_clip.loss
    fn = open_clip.loss.ClipLoss()
else:
    def fn(a, b, s):
        logits = s * a @ b.t()
        return 0.5 * (F.cross_entropy(logits.float(), labels) + F.cross_entropy(logits.t().float(), labels))
def hwm():
    if dev == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
def step():
    img.grad = txt.grad = log_scale.grad = None
    fn(img, txt, log_scale.exp()).backward()
def sync():
    if dev == "cuda":
        torch.cuda.synchronize()
if dev == "cuda":
    torch.cuda.reset_peak_memory_stats()
base = hwm()
step()
times = []
for _ in range(steps):
    sync(); t0 = time.perf_counter(); step(); sync(); times.append(time.perf_counter() - t0)
print(statistics.median(times), hwm() - base, torch.__version__)
"""


def measure(which, n, d, dtype, steps, algorithm, threads, mmap_threshold=0, device="cpu"):
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", CHILD, which, str(n), str(d), dtype, str(steps), algorithm, here, device],
                         check=True, capture_output=True, text=True, env=env).stdout.split()
    return float(out[0]), int(out[1]), out[2]


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[4096])
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--algorithm", default="fused", choices=["fused", "materialized", "chunked"])
    ap.add_argument("--malloc-mmap-threshold", type=int, default=0,
                    help="bytes; fixes glibc's mmap threshold in both children (0: glibc's dynamic default)")
    ap.add_argument("--threads", type=int, default=0, help="0: all cores")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: both losses on the GPU (memory: torch.cuda.max_memory_allocated growth)")
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} logical cores; dtype {args.dtype}; "
          f"D = {args.d}; {args.rounds} interleaved rounds (medians); malloc mmap threshold: "
          f"{args.malloc_mmap_threshold or 'glibc default (dynamic)'}; device {args.device}")
    contenders = ["pytorch"] + (["open_clip"] if importlib.util.find_spec("open_clip") else []) + ["contrastive"]
    base = "open_clip" if "open_clip" in contenders else "pytorch"
    base_name = "open_clip" if base == "open_clip" else "PyTorch"
    print(f"| N | loss | time / step | memory / step | time vs {base_name} | memory vs {base_name} |")
    print("|---|---|---|---|---|---|")
    for n in args.n:
        res = {which: ([], []) for which in contenders}
        version = "?"
        for _ in range(args.rounds):
            for which in contenders:
                t, m, version = measure(which, n, args.d, args.dtype, args.steps, args.algorithm, args.threads,
                                        args.malloc_mmap_threshold, args.device)
                res[which][0].append(t)
                res[which][1].append(m)
        bt, bm = statistics.median(res[base][0]), statistics.median(res[base][1])
        labels = {"pytorch": f"plain PyTorch {version}", "open_clip": f"open_clip.loss.ClipLoss (torch {version})",
                  "contrastive": f"contrastive_torch {args.algorithm}"}
        for which in contenders:
            t, m = statistics.median(res[which][0]), statistics.median(res[which][1])
            print(f"| {n} | {labels[which]} | {t * 1e3:.0f} ms | {m / 2**20:.1f} MiB | {t / bt:.2f}x | "
                  f"{100 * m / bm if bm else float('nan'):.1f}% |")


if __name__ == "__main__":
    main()
