# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""CPU: clip_loss forward + backward with group ids against the one-positive call, median of 7 (prints ratios).
Usage: PYTHONPATH=python .venv-torch/bin/python scripts/bench_groups.py"""
import time, torch, torch.nn.functional as F
import contrastive_torch.functional as CF
torch.manual_seed(0)
def med(f, reps=7):
    ts=[]
    for _ in range(reps):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort(); return ts[len(ts)//2]
for dtype in (torch.float32, torch.bfloat16):
  n, d = 4096, 256
  img = F.normalize(torch.randn(n, d), dim=1).to(dtype).requires_grad_()
  txt = F.normalize(torch.randn(n, d), dim=1).to(dtype).requires_grad_()
  ids = torch.randint(0, n // 2, (n,))
  for alg in ("fused", "chunked"):
    one = lambda: CF.clip_loss(img, txt, 20.0, algorithm=alg).backward()
    grp = lambda: CF.clip_loss(img, txt, 20.0, algorithm=alg, image_groups=ids, text_groups=ids).backward()
    one(); grp()
    a, b = med(one), med(grp)
    print(f"{dtype} {alg} N={n} D={d}: one positive {a*1e3:.1f} ms, group ids {b*1e3:.1f} ms, ratio {b/a:.2f}")
