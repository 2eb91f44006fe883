# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Train an open_clip model with a contrastive batch larger than its plain step can hold: contrastive_torch.CachedStep.

    .venv-torch/bin/python examples/python/cached_open_clip.py                      # batch 4096, chunk 256, 4 steps
    .venv-torch/bin/python examples/python/cached_open_clip.py --batch 16384 --steps 2
    .venv-torch/bin/python examples/python/cached_open_clip.py --groups         # the class as each pair's group id

The model comes from open_clip's own factory (the installed open-clip-torch): a small ViT registered here as a model
config (width 256, 6 layers, 32x32 images, context 16) so that it trains on a CPU. The data are synthetic pairs: each
image is a noisy view of one of --classes prototypes and its text one of that class's five captions (token
sequences), so the loss falls as the towers learn to match them. With one positive per row, the other pairs of a class
in the batch are negatives, false ones, and the loss pushes a class's captions apart; --groups passes the class as
both towers' group ids (several positives per row, docs/multi_positive.md) through CachedStep to the loss, and the
last line compares how close the captions of one class end up. Each step prints the loss, tau = 1/logit_scale, the time and the process's peak
resident memory; at the end, the plain step's activation memory for the same batch, measured on a small batch and
scaled, for comparison (the plain step keeps every sample's activations until its backward)."""

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "python"))
import contrastive_torch as ct  # noqa: E402

CAPTIONS = 5  # captions per class
CONFIG = {"embed_dim": 256,
          "vision_cfg": {"image_size": 32, "layers": 6, "width": 256, "head_width": 64, "patch_size": 16},
          "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 256, "heads": 4, "layers": 6}}


def peak_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return float("nan")


def data(n, classes, generator):
    protos = torch.randn(classes, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    c = torch.randint(0, classes, (n,), generator=generator)
    v = torch.randint(0, CAPTIONS, (n,), generator=generator)
    return protos[c] + 0.5 * torch.randn(n, 3, 32, 32, generator=generator), captions(classes)[c, v], c


def captions(classes):
    """The classes' caption token sequences, classes x CAPTIONS x 16 (fixed)."""
    return torch.randint(1, 49408, (classes, CAPTIONS, 16), generator=torch.Generator().manual_seed(2))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--classes", type=int, default=1024)
    ap.add_argument("--groups", action="store_true", help="the class as each pair's group id (several positives)")
    args = ap.parse_args()
    import open_clip

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "example-vit-w256-l6.json"), "w") as f:
            json.dump(CONFIG, f)
        open_clip.add_model_config(d)
        torch.manual_seed(0)
        model = open_clip.create_model("example-vit-w256-l6")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.1)
    step = ct.CachedStep(model, ct.ClipLoss(), chunk_size=args.chunk)
    gen = torch.Generator().manual_seed(3)
    print(f"batch {args.batch}, chunk {args.chunk}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
          f"parameters; peak memory before training {peak_mib():.0f} MiB")
    for i in range(args.steps):
        images, texts, classes = data(args.batch, args.classes, gen)
        ids = {"image_groups": classes, "text_groups": classes} if args.groups else {}
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = step(images, texts, model.logit_scale.exp(), **ids)
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, 4.6052)  # open_clip's clamp: tau >= 0.01
        print(f"step {i}: loss {float(loss):.4f} (log N = {torch.log(torch.tensor(float(args.batch))):.2f} at "
              f"chance), tau {1 / model.logit_scale.detach().exp().item():.4f}, {time.perf_counter() - t:.1f} s, peak "
              f"{peak_mib():.0f} MiB", flush=True)
    # The false-negative effect: cosine similarity of two captions of one class against two of different classes.
    model.eval()
    with torch.no_grad():
        n = min(args.classes, 256)
        t = model.encode_text(captions(args.classes)[:n].reshape(n * CAPTIONS, 16), normalize=True)
        sim = (t @ t.T).reshape(n, CAPTIONS, n, CAPTIONS)
        same = torch.eye(n, dtype=torch.bool)[:, None, :, None].expand_as(sim)
        other = ~torch.eye(CAPTIONS, dtype=torch.bool)[None, :, None, :].expand_as(sim)
        print(f"text features after training ({'group ids' if args.groups else 'one positive per row'}): two captions "
              f"of one class {float(sim[same & other].mean()):.3f}, of two classes {float(sim[~same].mean()):.3f} "
              "(cosine similarity)")
    model.train()
    # The plain step's activations: the tensors autograd keeps for the backward of a forward on 256 samples (each
    # storage counted once), scaled to the batch.
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    images, texts, _ = data(256, args.classes, gen)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(images, texts)
    per_sample = sum(storages.values()) / 256 / 2**20
    print(f"the plain step would keep about {per_sample:.2f} MiB of activations per sample (counted at 256): about "
          f"{per_sample * args.batch / 1024:.1f} GiB for a batch of {args.batch}")


if __name__ == "__main__":
    main()
