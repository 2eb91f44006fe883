# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""CPU: clip_loss and siglip_loss forward + backward with group ids against the one-positive call, median of 7
(prints times and ratios). Usage: PYTHONPATH=python .venv-torch/bin/python scripts/bench_groups.py [clip|siglip]"""
import sys, time, torch, torch.nn.functional as F
import contrastive_torch.functional as CF
torch.manual_seed(0)
def med(f, reps=7):
    ts=[]
    for _ in range(reps):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    ts.sort(); return ts[len(ts)//2]
losses = {
    "clip": (lambda i, t, alg, **g: CF.clip_loss(i, t, 20.0, algorithm=alg, **g), ("fused", "chunked")),
    "siglip": (lambda i, t, alg, **g: CF.siglip_loss(i, t, 10.0, -10.0, algorithm=alg, **g),
               ("fused", "chunked", "materialized")),
}
for name in sys.argv[1:] or list(losses):
  loss, algorithms = losses[name]
  for dtype in (torch.float32, torch.bfloat16):
    n, d = 4096, 256
    img = F.normalize(torch.randn(n, d), dim=1).to(dtype).requires_grad_()
    txt = F.normalize(torch.randn(n, d), dim=1).to(dtype).requires_grad_()
    ids = torch.randint(0, n // 2, (n,))
    for alg in algorithms:
      one = lambda: loss(img, txt, alg).backward()
      grp = lambda: loss(img, txt, alg, image_groups=ids, text_groups=ids).backward()
      one(); grp()
      a, b = med(one), med(grp)
      print(f"{name} {dtype} {alg} N={n} D={d}: one positive {a*1e3:.1f} ms, group ids {b*1e3:.1f} ms,"
            f" ratio {b/a:.2f}", flush=True)
