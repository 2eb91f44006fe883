#!/usr/bin/env python3
"""bfloat16 CLIP gradients on batches from random to trained, against float64, per algorithm (CPU tensors).

    PYTHONPATH=python .venv-torch/bin/python scripts/bf16_trained_accuracy.py [--n 256] [--dim 64]

Each batch: unit queries q, keys k = normalize(q + noise * randn) (noise 1: a random batch; 0.3 and 0.1: batches
the model has learned, each key next to its query), rounded to bfloat16; medians over --draws batches. The reference
is the symmetric loss in float64 on the same bfloat16 values; errors are normwise, max |dQ - dQ64| / max |dQ64|, for the default algorithm
(automatic), fused, materialized (logits rounded to bfloat16, as autocast rounds them), and PyTorch's own loss under
CPU autocast (bfloat16 logits), at logit scales 30 and 100.
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
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--draws", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)

    def autocast_loss(a, b, s):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return clip_loss(a, b, s)

    losses = [("default", lambda a, b, s: fn.clip_loss(a, b, s)),
              ("fused", lambda a, b, s: fn.clip_loss(a, b, s, algorithm="fused")),
              ("materialized", lambda a, b, s: fn.clip_loss(a, b, s, algorithm="materialized")),
              ("PyTorch autocast", autocast_loss)]
    print("| noise | s | " + " | ".join(name for name, _ in losses) + " |")
    print("|---|---|" + "---|" * len(losses))
    for noise in (1.0, 0.3, 0.1):
        for s in (30.0, 100.0):
            errors = []
            for _ in range(args.draws):
                q = F.normalize(torch.randn(args.n, args.dim), dim=1)
                k = F.normalize(q + noise * torch.randn(args.n, args.dim), dim=1)
                q, k = q.bfloat16(), k.bfloat16()
                q64 = q.double().requires_grad_()
                clip_loss(q64, k.double(), s).backward()
                errors.append([dq_error(loss, q, k, s, q64.grad) for _, loss in losses])
            medians = torch.tensor(errors).median(0).values.tolist()
            print(f"| {noise:g} | {s:g} | " + " | ".join(f"{e:.2g}" for e in medians) + " |")


if __name__ == "__main__":
    main()
