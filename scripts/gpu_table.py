#!/usr/bin/env python3
"""One table from a GPU check: contrastive_device_bench's JSON (Google Benchmark) and torch_reference.py's output.

    python3 scripts/gpu_table.py build-gpu/device_bench.json [build-gpu/torch.log]

Rows: N; columns: median time, useful TFLOP/s (6 N^2 D) and memory (GiB) of each algorithm, the cuBLAS three-GEMM
baseline and PyTorch's ClipLoss pattern; then chunked's time and memory relative to the baseline.
Standard library only (the GPU machine's python may lack everything else).
"""
import json
import re
import sys

COLUMNS = [
    ("chunked", "step/bf16/chunked"),
    ("chunked fused_tiles", "step/bf16/chunked_tiles"),
    ("fused", "step/bf16/fused"),
    ("materialized", "step/bf16/materialized"),
    ("cuBLAS 3-GEMM", "baseline/cublas_bf16_3gemm"),
]


def load_bench(path):
    rows = {}
    with open(path) as f:
        data = json.load(f)
    for b in data.get("benchmarks", []):
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        m = re.match(r"(.+?)/(\d+)/(\d+)/manual_time", b["name"])
        if not m:
            continue
        key = (m.group(1), int(m.group(2)))
        if "error_occurred" in b and b["error_occurred"]:
            rows[key] = {"error": b.get("error_message", "error")}
            continue
        scale = {"ms": 1.0, "us": 1e-3, "ns": 1e-6, "s": 1e3}[b.get("time_unit", "ms")]
        rows[key] = {"ms": b["real_time"] * scale, "flops": b.get("FLOP/s", 0.0), "mem": b.get("mem_bytes", 0.0)}
    return rows, data.get("context", {})


def load_torch(path):
    out = {}
    try:
        with open(path) as f:
            for line in f:
                m = re.match(r"torch/bfloat16/N=(\d+)/D=512: ([\d.]+) ms\s+([\d.]+) TFLOP/s\s+peak mem ([\d.]+) GiB", line)
                if m:
                    out[int(m.group(1))] = {"ms": float(m.group(2)), "flops": float(m.group(3)) * 1e12,
                                            "mem": float(m.group(4)) * 2**30}
                m = re.match(r"torch/bfloat16/N=(\d+)/D=512: out of memory", line)
                if m:
                    out[int(m.group(1))] = {"error": "out of memory"}
    except OSError:
        pass
    return out


def cell(r):
    if r is None:
        return "-"
    if "error" in r:
        return r["error"][:24]
    return f"{r['ms']:9.2f} ms {r['flops'] * 1e-12:6.1f} TF {r['mem'] / 2**30:7.2f} GiB"


def main():
    bench, ctx = load_bench(sys.argv[1])
    torch = load_torch(sys.argv[2]) if len(sys.argv) > 2 else {}
    sizes = sorted({n for (_, n) in bench})
    names = [c for c, _ in COLUMNS] + ["PyTorch ClipLoss"]
    print("bf16, symmetric, forward+backward, D = 512; median time, useful TFLOP/s (6 N^2 D), memory held")
    print(f"{'N':>8} | " + " | ".join(f"{n:^33}" for n in names))
    for n in sizes:
        cells = [cell(bench.get((key, n))) for _, key in COLUMNS] + [cell(torch.get(n))]
        print(f"{n:>8} | " + " | ".join(f"{c:>33}" for c in cells))
    print()
    for n in sizes:
        b = bench.get(("baseline/cublas_bf16_3gemm", n))
        for label, key in (("chunked", "step/bf16/chunked"), ("chunked fused_tiles", "step/bf16/chunked_tiles")):
            c = bench.get((key, n))
            if c and b and "ms" in c and "ms" in b:
                print(f"N = {n}: {label} / cuBLAS baseline: time {c['ms'] / b['ms']:.2f}x, "
                      f"memory {c['mem'] / b['mem']:.1%}")
    for typ in ("half", "float"):
        for n in sizes:
            r = bench.get((f"step/{typ}/chunked", n))
            if r:
                print(f"{typ} chunked N = {n}: {cell(r)}")
    if ctx:
        print(f"\nhost: {ctx.get('host_name', '?')}, {ctx.get('num_cpus', '?')} CPUs")


if __name__ == "__main__":
    main()
