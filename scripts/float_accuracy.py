#!/usr/bin/env python3
"""float32 accuracy of the loss and its gradients against float64, beside PyTorch's own float32 CLIP loss.

    cd python && ../.venv-torch/bin/python ../scripts/float_accuracy.py --n 1000 --dims 1 16 512 --scale 100

For each shape: random L2-normalised features (seeded), the float64 reference (the same formula in torch.float64),
PyTorch's float32 ClipLoss formula (logits = s * q @ k.T, cross_entropy both ways, autograd) and contrastive_torch's
ClipLoss for each algorithm. Errors are normwise, max |g - g64| / max |g64|, in units of float32's eps (2^-23), for
dQ, dK and d/d(logit_scale); the loss as |l - l64| / |l64|. Medians over --draws random draws.
"""

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

EPS32 = 2.0 ** -23


def clip_loss(q, k, logit_scale):
    logits = logit_scale * q @ k.t()
    labels = torch.arange(q.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def grads(fn, q, k, s):
    q = q.clone().requires_grad_(True)
    k = k.clone().requires_grad_(True)
    s = s.clone().requires_grad_(True)
    loss = fn(q, k, s)
    loss.backward()
    return loss.detach(), q.grad, k.grad, s.grad


def normwise(g, ref):
    return ((g.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item() / EPS32


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--dims", type=int, nargs="+", default=[1, 16, 512])
    ap.add_argument("--scale", type=float, default=100.0, help="logit scale s = 1/tau (open_clip clamps at 100)")
    ap.add_argument("--draws", type=int, default=5)
    ap.add_argument("--algorithms", nargs="+", default=["fused", "chunked", "materialized"])
    args = ap.parse_args()

    sys.path.insert(0, ".")
    import contrastive_torch as ct

    print("torch %s; n = %d, s = %g; normwise errors in float32 eps (median of %d draws)" %
          (torch.__version__, args.n, args.scale, args.draws))
    print("%-5s %-14s %10s %10s %10s %12s" % ("dim", "loss", "loss", "dQ", "dK", "d/d scale"))
    for d in args.dims:
        rows = {}
        for draw in range(args.draws):
            g = torch.Generator().manual_seed(1000 * d + draw)
            q64 = F.normalize(torch.randn(args.n, d, generator=g, dtype=torch.float64), dim=1)
            k64 = F.normalize(torch.randn(args.n, d, generator=g, dtype=torch.float64), dim=1)
            q32, k32 = q64.float(), k64.float()
            s32 = torch.tensor(args.scale, dtype=torch.float32)
            # The reference sees the float32 inputs exactly (converted to float64).
            ref = grads(clip_loss, q32.double(), k32.double(), s32.double())
            cands = {"pytorch": grads(clip_loss, q32, k32, s32)}
            for a in args.algorithms:
                fn = ct.ClipLoss(algorithm=a)
                cands[a] = grads(lambda q, k, s: fn(q, k, s), q32, k32, s32)
            for name, (l, dq, dk, ds) in cands.items():
                r = rows.setdefault(name, [[], [], [], []])
                r[0].append(abs(l.double().item() - ref[0].item()) / abs(ref[0].item()) / EPS32)
                r[1].append(normwise(dq, ref[1]))
                r[2].append(normwise(dk, ref[2]))
                r[3].append(abs(ds.double().item() - ref[3].item()) / max(abs(ref[3].item()), 1e-300) / EPS32)
        for name, r in rows.items():
            print("%-5d %-14s %10.1f %10.1f %10.1f %12.1f" % (d, name, *(statistics.median(x) for x in r)))


if __name__ == "__main__":
    main()
