#!/usr/bin/env python3
"""Side-by-side reference on a GPU machine with PyTorch: open_clip's ClipLoss pattern (logits = s * q @ k.T under
autocast, cross-entropy both ways) timed forward+backward with CUDA events, at the sizes of the device benchmarks.

    python3 scripts/torch_reference.py [--dims 512] [--sizes 4096 16384 65536] [--dtype bfloat16]

Prints one line per size: median milliseconds and useful TFLOP/s counting 6 N^2 D, comparable with
contrastive_device_bench's step/<type>/fused rows.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F


def clip_step(q, k, logit_scale):
    logits = logit_scale.exp() * q @ k.t()
    labels = torch.arange(q.shape[0], device=q.device)
    loss = 0.5 * (F.cross_entropy(logits.float(), labels) + F.cross_entropy(logits.t().float(), labels))
    loss.backward()
    return loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--dims", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    for n in args.sizes:
        d = args.dims
        try:
            q = torch.randn(n, d, device="cuda", dtype=dtype, requires_grad=True)
            k = torch.randn(n, d, device="cuda", dtype=dtype, requires_grad=True)
            logit_scale = torch.tensor(2.659, device="cuda", requires_grad=True)
            clip_step(q, k, logit_scale)  # warm-up
            times = []
            for _ in range(args.repeats):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                clip_step(q, k, logit_scale)
                stop.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(stop))
            ms = statistics.median(times)
            print(f"torch/{args.dtype}/N={n}/D={d}: {ms:.3f} ms  {6 * n * n * d / ms * 1e-9:.1f} TFLOP/s"
                  f"  peak mem {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        except torch.cuda.OutOfMemoryError:
            print(f"torch/{args.dtype}/N={n}/D={d}: out of memory")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
