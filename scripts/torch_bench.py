# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Side by side: contrastive_torch.ClipLoss, open_clip's own ClipLoss (open_clip.loss, where open-clip-torch is
installed) and a plain PyTorch ClipLoss on the same tensors (CPU).

    .venv-torch/bin/python scripts/torch_bench.py [--n 4096] [--d 512] [--dtype float32] [--steps 5]

Each measurement runs in a fresh subprocess: the median time of a forward+backward step after one warm-up, and the
step's memory as the growth of the process's resident high-water mark (VmHWM) over the steps. glibc's malloc raises
its mmap threshold after the first large free, so later 8 MiB gradient tensors come from the heap and the resident
mark grows by more than either loss holds; `--malloc-mmap-threshold BYTES` fixes the threshold (MALLOC_MMAP_THRESHOLD_)
for both children alike, which shows each loss's working set. The plain loss is
open_clip's form with one product: logits = s * img @ txt.T, cross-entropy over rows and columns, backward() to img,
txt and logit_scale; open_clip's own ClipLoss (one process) forms both logits products, image @ text.T and
text @ image.T. The ratios are against open_clip's ClipLoss where it is installed, else against the plain loss.

`--world W [W ...]` (W > 1) runs W ranks over torch.distributed (gloo, 127.0.0.1), each with `--n` rows (the global
batch is N = n W), beside open_clip's own ClipLoss(local_loss=True, gather_with_grad=True, rank, world_size), the
setting its maintainers scale with: per rank, the median time of the step (forward + backward, collectives included;
ranks start each step together, after a barrier) and the growth of its resident high-water mark; the table shows the
slowest rank's time and the largest rank's memory. Each rank uses --threads threads (0: the cores divided by W).

    .venv-torch/bin/python scripts/torch_bench.py --world 2 4 --n 4096 --d 512
"""

import argparse
import importlib.util
import os
import platform
import statistics
import subprocess
import sys

# The package from this checkout (python/), for this process and its children.
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
sys.path.insert(0, PACKAGE_DIR)

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


RANK_CHILD = r"""
import datetime, math, statistics, sys, time, warnings
import torch, torch.nn.functional as F, torch.distributed as dist
which, n, d, dtype, steps, algorithm, here = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6], sys.argv[7]
rank, world, port, threads = int(sys.argv[8]), int(sys.argv[9]), int(sys.argv[10]), int(sys.argv[11])
sys.path.insert(0, here)
import contrastive_torch as ct
warnings.filterwarnings("ignore", category=FutureWarning)  # open_clip's torch.distributed.nn.all_gather
torch.set_num_threads(threads)
dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                        timeout=datetime.timedelta(seconds=1800))
dtype = getattr(torch, dtype)
g = torch.Generator().manual_seed(1 + rank)
img = F.normalize(torch.randn(n, d, generator=g), dim=1).to(dtype).requires_grad_()
txt = F.normalize(torch.randn(n, d, generator=g), dim=1).to(dtype).requires_grad_()
log_scale = torch.tensor(math.log(1 / 0.07)).requires_grad_()
if which == "contrastive":
    ct.extension()
    fn = ct.ClipLoss(True, True, rank=rank, world_size=world, algorithm=algorithm, threads=threads)
else:
    import open_clip.loss
    fn = open_clip.loss.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
def step():
    img.grad = txt.grad = log_scale.grad = None
    fn(img, txt, log_scale.exp()).backward()
dist.barrier()
base = hwm()
step()
times = []
for _ in range(steps):
    dist.barrier(); t0 = time.perf_counter(); step(); times.append(time.perf_counter() - t0)
grow = hwm() - base
dist.barrier()
dist.destroy_process_group()
print(statistics.median(times), grow, torch.__version__)
"""


def measure_ranks(which, n, d, dtype, steps, algorithm, world, threads, mmap_threshold=0):
    """W ranks of RANK_CHILD over gloo: (slowest rank's median step time, largest rank's memory growth, torch)."""
    import socket

    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = PACKAGE_DIR
    procs = [subprocess.Popen([sys.executable, "-c", RANK_CHILD, which, str(n), str(d), dtype, str(steps), algorithm,
                               here, str(r), str(world), str(port), str(threads)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    outs = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"{which} rank failed ({p.returncode}): {err[-2000:]}")
        outs.append(out.split())
    return max(float(o[0]) for o in outs), max(int(o[1]) for o in outs), outs[0][2]


def measure(which, n, d, dtype, steps, algorithm, threads, mmap_threshold=0, device="cpu"):
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    here = PACKAGE_DIR
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
    ap.add_argument("--world", type=int, nargs="+", default=[1],
                    help="ranks over torch.distributed (gloo) beside open_clip's local_loss + gather_with_grad loss; "
                         "1: the one-process comparison above")
    args = ap.parse_args()
    if any(w > 1 for w in args.world):
        return main_ranks(args)
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



def main_ranks(args):
    if not importlib.util.find_spec("open_clip"):
        sys.exit("--world > 1 compares with open_clip's distributed ClipLoss: install open-clip-torch")
    from contrastive_torch import extension

    extension()  # compiled once here, before the ranks load it
    print(f"CPU: {cpu_name()}, {os.cpu_count()} logical cores; dtype {args.dtype}; D = {args.d}; {args.n[0]} rows per "
          f"rank; {args.rounds} interleaved rounds (medians); gloo on 127.0.0.1; malloc mmap threshold: "
          f"{args.malloc_mmap_threshold or 'glibc default (dynamic)'}")
    print("| W | N | loss | threads / rank | time / step (slowest rank) | memory / step (largest rank) | "
          "time vs open_clip | memory vs open_clip |")
    print("|---|---|---|---|---|---|---|---|")
    for world in (w for w in args.world if w > 1):
        threads = args.threads or max(1, (os.cpu_count() or 1) // world)
        res = {which: ([], []) for which in ("open_clip", "contrastive")}
        version = "?"
        for _ in range(args.rounds):
            for which in res:
                t, m, version = measure_ranks(which, args.n[0], args.d, args.dtype, args.steps, args.algorithm, world,
                                              threads, args.malloc_mmap_threshold)
                res[which][0].append(t)
                res[which][1].append(m)
        bt, bm = statistics.median(res["open_clip"][0]), statistics.median(res["open_clip"][1])
        labels = {"open_clip": f"open_clip ClipLoss(local_loss, gather_with_grad) (torch {version})",
                  "contrastive": f"contrastive_torch {args.algorithm}"}
        for which in res:
            t, m = statistics.median(res[which][0]), statistics.median(res[which][1])
            print(f"| {world} | {args.n[0] * world} | {labels[which]} | {threads} | {t * 1e3:.0f} ms | "
                  f"{m / 2**20:.1f} MiB | {t / bt:.2f}x | {100 * m / bm if bm else float('nan'):.1f}% |", flush=True)


if __name__ == "__main__":
    main()
