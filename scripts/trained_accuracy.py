#!/usr/bin/env python3
"""CLIP gradients on batches from random to trained, against float64, per algorithm (CPU tensors).

    PYTHONPATH=python .venv-torch/bin/python scripts/trained_accuracy.py [--dtype bfloat16|float32] [--n 256]
        [--dim 64] [--draws 5]

Each batch: unit queries q, keys k = normalize(q + noise * randn) (noise 1: a random batch; 0.3, 0.1 and 0.03:
batches the model has learned, each key next to its query), in --dtype; medians over --draws batches. The reference
is the symmetric loss in float64 on the same values; errors are normwise, max |dQ - dQ64| / max |dQ64|, for the
default algorithm (automatic), fused, materialized, and PyTorch's own loss: under CPU autocast for bfloat16 (bfloat16
logits, as materialized rounds them), in float32 for float32 (softmax minus one-hot in float32, as materialized
forms the positive's gradient), at logit scales 30 and 100. The loss column is the float64 loss (its median); a
draw whose loss is below 1e-14 is left out ("-" when all are): the float64 reference's own softmax - one-hot keeps
too few digits there to measure against.
"""

import argparse

import torch
import torch.nn.functional as F

from contrastive_torch import functional as fn


def clip_loss(q, k, s):
    logits = s * q @ k.t()
    labels = torch.arange(q.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def dq_error(loss, q, k, s, reference):
    a, b = q.clone().requires_grad_(), k.clone().requires_grad_()
    loss(a, b, s).backward()
    return float((a.grad.double() - reference).abs().max() / reference.abs().max())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--draws", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)

    def autocast_loss(a, b, s):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return clip_loss(a, b, s)

    losses = [("default", lambda a, b, s: fn.clip_loss(a, b, s)),
              ("fused", lambda a, b, s: fn.clip_loss(a, b, s, algorithm="fused")),
              ("materialized", lambda a, b, s: fn.clip_loss(a, b, s, algorithm="materialized")),
              ("PyTorch autocast", autocast_loss) if dtype == torch.bfloat16 else ("PyTorch float32", clip_loss)]
    print("| noise | s | loss | " + " | ".join(name for name, _ in losses) + " |")
    print("|---|---|---|" + "---|" * len(losses))
    for noise in (1.0, 0.3, 0.1, 0.03):
        for s in (30.0, 100.0):
            errors, values = [], []
            for _ in range(args.draws):
                q = F.normalize(torch.randn(args.n, args.dim), dim=1)
                k = F.normalize(q + noise * torch.randn(args.n, args.dim), dim=1)
                q, k = q.to(dtype), k.to(dtype)
                q64 = q.double().requires_grad_()
                value = clip_loss(q64, k.double(), s)
                value.backward()
                values.append(float(value))
                if float(value) < 1e-14:
                    # The reference forms softmax - one-hot in float64 too: below ~1e-14 its positive's gradient
                    # keeps fewer than 2 digits (none below 1e-16), so there is nothing exact to compare with.
                    errors.append([float("nan")] * len(losses))
                    continue
                errors.append([dq_error(loss, q, k, s, q64.grad) for _, loss in losses])
            medians = torch.tensor(errors).nanmedian(0).values.tolist()
            loss = torch.tensor(values).median().item()
            cells = ["-" if e != e else f"{e:.2g}" for e in medians]  # -: no draw the reference resolves
            print(f"| {noise:g} | {s:g} | {loss:.2g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
