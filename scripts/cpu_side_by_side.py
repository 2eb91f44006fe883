#!/usr/bin/env python3
# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The host library beside PyTorch's CPU CLIP loss, same N, D, dtype and thread count, interleaved in one run.

    .venv-torch/bin/python scripts/cpu_side_by_side.py [--bench build/benchmarks/contrastive_bench] [--n 4096 8192]
        [--d 512] [--threads 0] [--rounds 3] [--dtypes float half bfloat16] [--objective symmetric|sigmoid]
        [--torch-dtypes float bfloat16] [--algorithms materialized fused automatic]

--objective sigmoid puts the library's sigmoid objective beside open_clip's own SigLipLoss (from the open-clip-torch
package, not a copy) at SigLIP's initialisation (t = 10, b = -10): logits = t img @ txt.T + b, -logsigmoid(labels *
logits).sum() / N, backward() to img, txt, t and b.

PyTorch (the Python running this script: the venv of scripts/setup.sh test) runs the loss as the issue describes open_clip's ClipLoss:
logits = s * img @ txt.T, cross-entropy over rows and over columns (logits.T), backward() to img, txt and s; its
bfloat16 row (--torch-dtypes) takes bfloat16 features and forms the logits in bfloat16 (oneDNN's bf16 matmul, on the
CPU's bf16 dot-product instructions where it has them), cross-entropy in float32, as autocast does. Each
PyTorch measurement runs in a fresh subprocess: time per step (median of several steps after a warm-up) and memory as
the process's resident high-water mark (VmHWM) during the steps minus the mark after the inputs exist. The library is
timed by contrastive_bench (Google Benchmark, manual time per call) for the same shape; its memory is `mem_call`, the
peak heap the call allocates above the caller's buffers. Rounds alternate library and PyTorch so both see the same
machine state; the table gives medians over rounds and the ratios library / PyTorch.
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

TORCH_CHILD = r"""
import os, sys, time, statistics
import torch
import torch.nn.functional as F
n, d, threads, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dtype = getattr(torch, sys.argv[6])
torch.set_num_threads(threads)
g = torch.Generator().manual_seed(0)
img = F.normalize(torch.randn(n, d, generator=g), dim=1).to(dtype).requires_grad_()
txt = F.normalize(torch.randn(n, d, generator=g), dim=1).to(dtype).requires_grad_()
logit_scale = torch.tensor(1.0 / 0.07).log().requires_grad_()
labels = torch.arange(n)
objective = sys.argv[5]
if objective == "sigmoid":
    import open_clip.loss
    siglip = open_clip.loss.SigLipLoss()
    logit_scale = torch.tensor(10.0).log().requires_grad_()
    logit_bias = torch.tensor(-10.0).requires_grad_()

def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0

def step():
    img.grad = txt.grad = logit_scale.grad = None
    if objective == "sigmoid":
        logit_bias.grad = None
        loss = siglip(img, txt, logit_scale.exp(), logit_bias)
    else:
        logits = (logit_scale.exp() * img @ txt.t()).float()
        loss = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))
    loss.backward()
    return loss

base = hwm()
step()  # warm-up
times = []
for _ in range(steps):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
print(statistics.median(times), hwm() - base, torch.__version__, torch.get_num_threads())
"""


def cpu_description():
    model, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model.strip():
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = "avx512f" if "avx512f" in flags else ("avx2+fma" if "avx2" in flags and "fma" in flags else "sse")
    return model, isa, os.cpu_count()


TORCH_DTYPES = {"float": "float32", "bfloat16": "bfloat16", "half": "float16"}


def run_torch(n, d, threads, steps, objective, dtype="float"):
    out = subprocess.run([sys.executable, "-c", TORCH_CHILD, str(n), str(d), str(threads), str(steps), objective,
                          TORCH_DTYPES[dtype]], check=True, capture_output=True, text=True).stdout.split()
    return float(out[0]), int(out[1]), out[2]


def run_library(bench, n, d, dtype, algo, threads, min_time, objective):
    # N >= 16384 runs one iteration per repetition and says so in the name.
    pattern = f"^host/{objective}/fwd_bwd/{dtype}/{algo}/N:{n}/D:{d}(/iterations:1)?/manual_time$"
    name = f"host/{objective}/fwd_bwd/{dtype}/{algo}/N:{n}/D:{d}"
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        cmd = [bench, f"--benchmark_filter={pattern}", f"--contrastive_max_n={n}",
               f"--contrastive_max_d={d}", f"--benchmark_min_time={min_time}", "--benchmark_format=json",
               f"--benchmark_out={tmp.name}", "--contrastive_roofline_seconds=0.02", "--contrastive_copy_mib=16"]
        if threads:
            cmd.append(f"--contrastive_threads={threads}")
        done = subprocess.run(cmd, capture_output=True, text=True)
        try:
            doc = json.load(open(tmp.name))
        except ValueError:
            raise RuntimeError(f"{name}: the benchmark wrote no results:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    runs = [b for b in doc["benchmarks"]
            if re.match(pattern, b.get("run_name", b["name"])) and not b.get("error_occurred")]
    if not runs:
        raise RuntimeError(f"{name} did not run (is N in the benchmark's size axis?)")
    b = runs[0]
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b.get("time_unit", "ns")]
    return b["real_time"] * scale, b.get("mem_call", float("nan")), b.get("threads", threads)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default="build/benchmarks/contrastive_bench")
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="0: all cores (both sides)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch-steps", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.5, help="Google Benchmark min time per library run (s)")
    ap.add_argument("--dtypes", nargs="+", default=["float", "half", "bfloat16"])
    ap.add_argument("--algorithms", nargs="+", default=["materialized", "fused"])
    ap.add_argument("--torch-dtypes", nargs="+", default=["float"], choices=["float", "bfloat16"],
                    help="PyTorch rows; a library row is compared with the PyTorch row of its dtype where there is "
                         "one, else with float's")
    ap.add_argument("--objective", choices=["symmetric", "sigmoid"], default="symmetric")
    args = ap.parse_args()

    threads = args.threads or os.cpu_count()
    model, isa, cores = cpu_description()
    print(f"CPU: {model} ({cores} logical cores), ISA: {isa}; threads: {threads}; D = {args.d}; "
          f"rounds: {args.rounds} (medians); objective: {args.objective}", flush=True)
    rows = []
    for n in args.n:
        torch_runs, lib = {}, {}
        version = "?"
        for r in range(args.rounds):
            for td in args.torch_dtypes:
                t, m, version = run_torch(n, args.d, threads, args.torch_steps, args.objective, td)
                torch_runs.setdefault(td, ([], []))
                torch_runs[td][0].append(t)
                torch_runs[td][1].append(m)
            for dtype in args.dtypes:
                for algo in args.algorithms:
                    t_l, m_l, _ = run_library(args.bench, n, args.d, dtype, algo, args.threads, args.min_time,
                                              args.objective)
                    lib.setdefault((dtype, algo), ([], []))
                    lib[(dtype, algo)][0].append(t_l)
                    lib[(dtype, algo)][1].append(m_l)
            print(f"  N = {n}: round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        baseline = "open_clip SigLipLoss" if args.objective == "sigmoid" else "ClipLoss"
        medians = {}
        for td, (ts, ms) in torch_runs.items():
            medians[td] = (statistics.median(ts), statistics.median(ms))
            rows.append((n, f"PyTorch {version} {baseline} ({td})", medians[td][0], medians[td][1], 1.0, 1.0, td))
        float_fused = None
        for (dtype, algo), (ts, ms) in lib.items():
            t, m = statistics.median(ts), statistics.median(ms)
            if dtype == "float" and algo == "fused":
                float_fused = t
            against = dtype if dtype in medians else ("float" if "float" in medians else next(iter(medians)))
            tt, tm = medians[against]
            rows.append((n, f"contrastive {dtype} {algo}", t, m, t / tt, m / tm if tm else float("nan"), against))
        if float_fused:
            for (dtype, algo), (ts, _) in lib.items():
                if algo == "fused" and dtype != "float":
                    print(f"  N = {n}: {dtype} fused / float fused = {statistics.median(ts) / float_fused:.3f}")
    print()
    print("| N | implementation | time / step | memory / step | time vs PyTorch | memory vs PyTorch | vs |")
    print("|---|---|---|---|---|---|---|")
    for n, what, t, m, rt, rm, against in rows:
        print(f"| {n} | {what} | {t * 1e3:.0f} ms | {m / 2**20:.1f} MiB | {rt:.2f}x | {rm * 100:.1f}% | {against} |")


if __name__ == "__main__":
    main()
