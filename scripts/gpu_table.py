#!/usr/bin/env python3
"""One table from a GPU check: contrastive_device_bench's JSON (Google Benchmark) and torch_reference.py's output.

    python3 scripts/gpu_table.py gpu-out/bench.json [gpu-out/torch.log]

Rows: N; columns: time, useful TFLOP/s (6 N^2 D) and memory (GiB) of each algorithm, the cuBLAS three-GEMM
baseline, the sigmoid objective's chunked step (SigLIP; one pass, 6 N^2 D) and PyTorch's ClipLoss pattern; then
chunked's time and memory relative to the baseline, and the measured ceilings.

Nothing here runs faster than one bf16 GEMM: a rate above the measured GEMM ceiling (roofline/cublas_bf16_matmul_8192,
its median after warm-up where the JSON has it) is flagged "TF!" in the table and "(above the ceiling: the ceiling is
wrong)" in the fractions, with a WARNING line: the ceiling, and every fraction of it, is then wrong.

The JSON may hold several Google Benchmark documents one after another (gpu-bundle/run.sh appends one per benchmark
step) and the last may be cut off (a run killed at its time limit): every complete benchmark entry is read. A time
is the median over repetitions where the JSON has repetitions ("med/5": median of 5), else the one run's time
("1 run"; Google Benchmark's time for a run is the mean over its iterations).
Standard library only (the GPU machine's python may lack everything else).
"""
import json
import re
import statistics
import sys

COLUMNS = [
    ("chunked", "step/bf16/chunked"),
    ("chunked fused_tiles", "step/bf16/chunked_tiles"),
    ("fused", "step/bf16/fused"),
    ("materialized", "step/bf16/materialized"),
    ("cuBLAS 3-GEMM", "baseline/cublas_bf16_3gemm"),
    ("sigmoid chunked", "step/bf16/sigmoid_chunked"),
]
# Google Benchmark's name suffixes that are not arguments: /iterations:N, /repeats:N, /threads:N, /min_time:X,
# /min_warmup_time:X, /manual_time, /real_time, /process_time.
SUFFIX = re.compile(r"/(?:iterations|repeats|threads|min_time|min_warmup_time):[^/]+|/(?:manual|real|process)_time")
AGGREGATE = re.compile(r"_(?:mean|median|stddev|cv|BigO|RMS)$")
UNIT = {"s": 1e3, "ms": 1.0, "us": 1e-3, "ns": 1e-6}


def split_name(name):
    """('step/bf16/chunked', 1048576) for 'step/bf16/chunked/1048576/512/iterations:1/manual_time'; the first
    argument is N. Names without numeric arguments (the rooflines) give (base, None)."""
    base = AGGREGATE.sub("", SUFFIX.sub("", name))
    m = re.match(r"(.+?)((?:/\d+)+)$", base)
    if not m:
        return base, None
    return m.group(1), int(m.group(2).split("/")[1])


def repair(text):
    """Parse one Google Benchmark JSON document, or what a killed run left of one: cut after the last complete
    benchmark entry and close the list and the object."""
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
        pass
    start = text.find('"benchmarks"')
    if start < 0:
        return {"context": {}, "benchmarks": [], "truncated": True}
    # Entries are indented objects, '    {' ... '    }' on their own lines (Google Benchmark's JSON reporter); try the
    # candidate ends from the last one backwards.
    ends = [m.end() for m in re.finditer(r"\n    \}", text[start:])]
    for end in reversed(ends):
        try:
            data = json.loads(text[: start + end] + "\n  ]\n}")
            data["truncated"] = True
            return data
        except ValueError:
            continue
    try:
        data = json.loads(text[:start] + '"benchmarks": []\n}')
    except ValueError:
        data = {"context": {}, "benchmarks": []}
    data["truncated"] = True
    return data


def load_documents(text):
    """Every JSON document in the text (one per benchmark process), each parsed or repaired."""
    starts = [m.start() for m in re.finditer(r'(?m)^\{\s*\n\s*"context"', text)]
    if not starts:
        starts = [text.find("{")] if "{" in text else []
    return [repair(text[a:b]) for a, b in zip(starts, starts[1:] + [len(text)])]


def load_bench(path):
    """{(name, N): row}, the context, and whether a document was cut off. A row holds ms (median of repetitions, or
    the single run), the number of runs, FLOP/s (recomputed from the chosen time when the JSON's counter is a rate)
    and mem_bytes; or an error."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return {}, {}, False
    runs, aggregates, errors, context, truncated = {}, {}, {}, {}, False
    for doc in load_documents(text):
        context = context or doc.get("context", {})
        truncated = truncated or doc.get("truncated", False)
        for b in doc.get("benchmarks", []):
            key = split_name(b.get("run_name") or b.get("name", ""))
            if b.get("error_occurred"):
                errors[key] = b.get("error_message", "error")
                continue
            if "real_time" not in b:
                continue
            entry = dict(b, ms=b["real_time"] * UNIT.get(b.get("time_unit", "ns"), 1e-6))
            if b.get("run_type") == "aggregate":
                aggregates.setdefault(key, {})[b.get("aggregate_name", "")] = entry
            else:
                runs.setdefault(key, []).append(entry)
    rows = {}
    for key in set(runs) | set(aggregates) | set(errors):
        if key in errors and key not in runs:
            rows[key] = {"error": errors[key]}
            continue
        reps = runs.get(key, [])
        if len(reps) >= 2:
            ms = statistics.median(r["ms"] for r in reps)
            row = {"ms": ms, "runs": len(reps), "ref": reps[0]}
        elif "median" in aggregates.get(key, {}):
            med = aggregates[key]["median"]
            row = {"ms": med["ms"], "runs": int(med.get("repetitions", 0)) or None, "ref": med}
        elif reps:
            row = {"ms": reps[0]["ms"], "runs": 1, "ref": reps[0]}
        else:
            continue
        ref = row.pop("ref")
        flops = ref.get("FLOP/s", 0.0)
        # FLOP/s is an iteration-invariant rate over the entry's own time: rescale it to the chosen time.
        if flops and ref["ms"] > 0:
            flops *= ref["ms"] / row["ms"]
        row.update(flops=flops, mem=ref.get("mem_bytes", 0.0), bytes_rate=ref.get("bytes/s", 0.0))
        # The ceilings (roofline/*) also give their rate at the median of their timed calls after a warm-up.
        for field, counter in (("median_flops", "median_FLOP/s"), ("median_bytes_rate", "median_bytes/s"),
                               ("warmup_rounds", "warmup_rounds"), ("settled", "settled")):
            if counter in ref:
                row[field] = ref[counter]
        rows[key] = row
    return rows, context, truncated


def load_torch(path):
    out = {}
    try:
        with open(path) as f:
            for line in f:
                m = re.match(r"torch/bfloat16/N=(\d+)/D=512: ([\d.]+) ms\s+([\d.]+) TFLOP/s\s+peak mem ([\d.]+) GiB", line)
                if m:
                    out[int(m.group(1))] = {"ms": float(m.group(2)), "flops": float(m.group(3)) * 1e12,
                                            "mem": float(m.group(4)) * 2**30, "runs": None, "label": "median"}
                m = re.match(r"torch/bfloat16/N=(\d+)/D=512: out of memory", line)
                if m:
                    out[int(m.group(1))] = {"error": "out of memory"}
    except OSError:
        pass
    return out


ABOVE_CEILING = "(above the ceiling: the ceiling is wrong)"


def ceiling(r):
    """A roofline row's rate: its median after warm-up (median_FLOP/s) where the benchmark reports one, else the
    FLOP/s of the row's time."""
    return r.get("median_flops") or r.get("flops", 0.0)


def warmup_note(r):
    if "warmup_rounds" not in r:
        return ""
    settled = "settled" if r.get("settled") else "NOT settled: clocks still moving at the warm-up's time bound"
    return f", median after {int(r['warmup_rounds'])} warm-up rounds, {settled}"


def stat_label(r):
    if r.get("label"):
        return r["label"]
    if r.get("runs") == 1:
        return "1 run"
    if r.get("runs"):
        return f"med/{r['runs']}"
    return "median"


def cell(r, peak=0.0):
    """One table cell; `!` after the rate marks a rate above the measured GEMM ceiling `peak`."""
    if r is None:
        return "-"
    if "error" in r:
        return r["error"][:30]
    flag = "!" if peak and r.get("flops", 0.0) > peak else " "
    return f"{r['ms']:9.2f} ms {stat_label(r):>6} {r['flops'] * 1e-12:6.1f} TF{flag}{r['mem'] / 2**30:7.2f} GiB"


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    bench, ctx, truncated = load_bench(argv[1])
    torch = load_torch(argv[2]) if len(argv) > 2 else {}
    sizes = sorted({n for (_, n) in bench if n is not None} | set(torch))
    names = [c for c, _ in COLUMNS] + ["PyTorch ClipLoss"]
    width = 40
    print("bf16, symmetric, forward+backward, D = 512; time (med/k: median of k repetitions; 1 run: one run, the mean "
          "of its iterations), useful TFLOP/s (6 N^2 D), memory held")
    if truncated:
        print("(the benchmark JSON was cut off: a step ran out of time; complete entries only)")
    print(f"{'N':>8} | " + " | ".join(f"{n:^{width}}" for n in names))
    peak = ceiling(bench.get(("roofline/cublas_bf16_matmul_8192", None), {}))
    flagged = False
    for n in sizes:
        rows = [bench.get((key, n)) for _, key in COLUMNS] + [torch.get(n)]
        flagged = flagged or any(r and peak and r.get("flops", 0.0) > peak for r in rows)
        cells = [cell(r, peak) for r in rows]
        print(f"{n:>8} | " + " | ".join(f"{c:>{width}}" for c in cells))
    if flagged:
        print(f"TF!: a rate above the measured bf16 GEMM ceiling ({peak * 1e-12:.0f} TFLOP/s): the ceiling is wrong")
    print()
    for n in sizes:
        b = bench.get(("baseline/cublas_bf16_3gemm", n))
        for label, key in (("chunked", "step/bf16/chunked"), ("chunked fused_tiles", "step/bf16/chunked_tiles")):
            c = bench.get((key, n))
            if c and b and "ms" in c and "ms" in b and b["ms"] > 0:
                mem = f", memory {c['mem'] / b['mem']:.1%}" if b.get("mem") else ""
                print(f"N = {n}: {label} / cuBLAS baseline: time {c['ms'] / b['ms']:.2f}x{mem}")
    if peak:
        above = []
        for n in sizes:
            rates = [(label, bench.get((key, n), {}).get("flops")) for label, key in COLUMNS]
            rates.append(("PyTorch ClipLoss", torch.get(n, {}).get("flops")))
            fracs = []
            for label, rate in rates:
                if not rate:
                    continue
                fracs.append(f"{label} {rate / peak:.0%}" + (f" {ABOVE_CEILING}" if rate > peak else ""))
                if rate > peak:
                    above.append(f"N = {n} {label} {rate * 1e-12:.0f} TFLOP/s")
            if fracs:
                print(f"N = {n}: fraction of the measured bf16 GEMM rate ({peak * 1e-12:.0f} TFLOP/s): " + ", ".join(fracs))
        if above:
            print(f"WARNING: {len(above)} rate(s) above the measured bf16 GEMM ceiling of {peak * 1e-12:.0f} TFLOP/s "
                  f"({'; '.join(above)}): nothing here runs faster than one bf16 GEMM, so the ceiling is wrong and "
                  "the fractions above are not meaningful")
    for typ in ("half", "float"):
        for n in sizes:
            r = bench.get((f"step/{typ}/chunked", n))
            if r:
                print(f"{typ} chunked N = {n}: {cell(r, peak)}")
    for (name, n), r in sorted(bench.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        if name.startswith("roofline/"):
            if "error" in r:
                print(f"{name}: {r['error']}")
            elif r.get("flops"):
                # The time of one call at the rate shown (the median's where there is one).
                ms = r["ms"] * r["flops"] / ceiling(r)
                print(f"{name}: {ceiling(r) * 1e-12:.1f} TFLOP/s ({ms:.2f} ms, {stat_label(r)}{warmup_note(r)})")
            else:
                rate = r.get("median_bytes_rate") or r["bytes_rate"]
                ms = r["ms"] * r["bytes_rate"] / rate if rate else r["ms"]
                print(f"{name}: {rate * 1e-12:.2f} TB/s ({ms:.2f} ms, {stat_label(r)}{warmup_note(r)})")
    if ctx:
        print(f"\nhost: {ctx.get('host_name', '?')}, {ctx.get('num_cpus', '?')} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
