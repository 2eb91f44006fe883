# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""A/B of two contrastive_torch checkouts on the CPU, alternating, each in its own processes and extension cache:
the forward + backward of ClipLoss at one shape (torch_bench.py's child: time and resident-memory growth per step) and
the per-call time of a small call.

    git worktree add /tmp/before <commit>
    .venv-torch/bin/python scripts/torch_ab.py /tmp/before/python python [--rounds 3] [--n 4096] [--d 512]

Prints each round and the medians; the order alternates A, B, A, B, ... so that a machine's drift hits both."""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_bench  # noqa: E402

SMALL = r"""
import statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch, torch.nn.functional as F
import contrastive_torch as ct
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
img = F.normalize(torch.randn(256, 64, generator=g), dim=1).requires_grad_()
txt = F.normalize(torch.randn(256, 64, generator=g), dim=1).requires_grad_()
s = torch.tensor(14.0, requires_grad=True)
fn = ct.ClipLoss(threads=1)
ts = []
for i in range(3000):
    t = time.perf_counter()
    fn(img, txt, s).backward()
    ts.append(time.perf_counter() - t)
print(statistics.median(ts[200:]))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="package directory A (holds contrastive_torch/)")
    ap.add_argument("b", help="package directory B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    caches = {p: tempfile.mkdtemp(prefix="torch-ext-") for p in (args.a, args.b)}
    results = {}
    for dtype in args.dtypes:
        for r in range(args.rounds):
            for label, pkg in (("A", args.a), ("B", args.b)):
                os.environ["TORCH_EXTENSIONS_DIR"] = caches[pkg]
                torch_bench.PACKAGE_DIR = os.path.abspath(pkg)
                t, m, _ = torch_bench.measure("contrastive", args.n, args.d, dtype, 5, "fused", 0, 1 << 20, "cpu")
                results.setdefault((dtype, label), []).append((t, m))
                print(f"round {r} {dtype} {label}: {t * 1e3:.0f} ms, {m / 2**20:.1f} MiB", flush=True)
    for r in range(args.rounds + 2):
        for label, pkg in (("A", args.a), ("B", args.b)):
            env = dict(os.environ, TORCH_EXTENSIONS_DIR=caches[pkg], CONTRASTIVE_TORCH_QUIET="1")
            out = subprocess.run([sys.executable, "-c", SMALL, os.path.abspath(pkg)], capture_output=True, text=True,
                                 env=env, check=True).stdout.split()[-1]
            results.setdefault(("small", label), []).append((float(out), 0))
            print(f"round {r} N=256 D=64 one thread {label}: {float(out) * 1e6:.0f} us per call", flush=True)
    for (what, label), v in results.items():
        t = statistics.median(x[0] for x in v)
        m = statistics.median(x[1] for x in v)
        print(f"{what} {label}: median {t * 1e3:.3f} ms" + (f", {m / 2**20:.1f} MiB" if what != "small" else ""))


if __name__ == "__main__":
    main()
