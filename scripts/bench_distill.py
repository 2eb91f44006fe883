# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""CPU: DistillClipLoss forward + backward (both terms; the teacher frozen, as open_clip_train's), ours against
open_clip's, median of 5 after a warm-up, and the growth of the process's peak resident set over one step (each
implementation in its own process). Usage:
    PYTHONPATH=python .venv-torch/bin/python scripts/bench_distill.py [N] [D] [D_teacher]"""
import json
import subprocess
import sys

CHILD = r'''
import json, resource, statistics, sys, time, torch, torch.nn.functional as F
impl, n, d, dt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if impl == "ours":
    import contrastive_torch as ct
    fn = ct.DistillClipLoss()
else:
    from open_clip import loss as L
    fn = L.DistillClipLoss()
g = torch.Generator().manual_seed(0)
img, txt = (F.normalize(torch.randn(n, d, generator=g), dim=1).requires_grad_() for _ in range(2))
t_img, t_txt = (F.normalize(torch.randn(n, dt, generator=g), dim=1) for _ in range(2))
s, t = torch.tensor(20.0, requires_grad=True), torch.tensor(30.0)
def step():
    c, dl = fn(img, txt, s, t_img, t_txt, t)
    (c + dl).backward()
    img.grad = txt.grad = s.grad = None
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
step()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
times = []
for _ in range(5):
    t0 = time.perf_counter(); step(); times.append(time.perf_counter() - t0)
print(json.dumps({"ms": 1e3 * statistics.median(times), "peak_mib": peak / 1024}))
'''


def main():
    n, d, dt = (int(a) for a in (sys.argv[1:] + ["4096", "512", "768"][len(sys.argv) - 1:])[:3])
    got = {}
    for impl in ("open_clip", "ours"):
        out = subprocess.run([sys.executable, "-c", CHILD, impl, str(n), str(d), str(dt)], capture_output=True,
                             text=True, check=True)
        got[impl] = json.loads(out.stdout.strip().splitlines()[-1])
    for impl, r in got.items():
        print(f"{impl:9s} N={n} D={d} D_teacher={dt}: {r['ms']:.1f} ms, peak growth {r['peak_mib']:.0f} MiB")
    print(f"ours / open_clip: time {got['ours']['ms'] / got['open_clip']['ms']:.2f}, "
          f"memory {got['ours']['peak_mib'] / max(got['open_clip']['peak_mib'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
