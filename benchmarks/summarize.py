#!/usr/bin/env python3
# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Turns contrastive_bench JSON output into the Markdown tables of docs/performance.md.

    contrastive_bench --benchmark_format=json --benchmark_out=run.json ...
    python3 benchmarks/summarize.py [--compact] run.json [more.json ...]

Per benchmark: the median over repetitions of the time per call (and of every counter), then the ratios the
performance targets are stated in: fused vs materialized (time and peak memory) on the same configuration, and each
16-bit type vs float on the same configuration. Several files may be given (e.g. one per filter); a later file's
result for the same benchmark replaces an earlier one.
"""

import json
import re
import statistics
import sys
from collections import defaultdict

NAME = re.compile(r"^host/(?P<obj>[^/]+)/(?P<pass>[^/]+)/(?P<type>[^/]+)/(?P<algo>[^/]+)/N:(?P<n>\d+)/D:(?P<d>\d+)")
TO_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
COUNTERS = ("flops", "useful_flops", "exec_flops", "fma_peak_frac", "bytes_per_second", "bw_peak_frac", "mem_call",
            "mem_total", "bytes_held", "rss_hwm", "cpu_busy", "fma_peak_frac_cpu", "threads")


def load(paths):
    runs = defaultdict(list)   # run_name -> list of iteration entries
    medians = {}               # run_name -> median aggregate entry (when only aggregates were reported)
    errors = {}
    context = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        context.update(doc.get("context", {}))
        file_runs = defaultdict(list)
        for b in doc["benchmarks"]:
            name = b.get("run_name", b["name"])
            if b.get("error_occurred"):
                errors[name] = b.get("error_message", "error")
                continue
            if b.get("run_type") == "aggregate":
                if b.get("aggregate_name") == "median":
                    medians[name] = b
                continue
            file_runs[name].append(b)
        for name, entries in file_runs.items():
            runs[name] = entries  # a later file replaces an earlier one
    return runs, medians, errors, context


def summarize(runs, medians):
    out = {}
    for name in set(runs) | set(medians):
        entries = runs.get(name)
        if entries:
            row = {"seconds": statistics.median(e["real_time"] * TO_SECONDS[e["time_unit"]] for e in entries),
                   "reps": len(entries)}
            for c in COUNTERS:
                vals = [e[c] for e in entries if c in e]
                if vals:
                    row[c] = statistics.median(vals)
        else:
            e = medians[name]
            row = {"seconds": e["real_time"] * TO_SECONDS[e["time_unit"]], "reps": e.get("repetitions", 0)}
            for c in COUNTERS:
                if c in e:
                    row[c] = e[c]
        out[name] = row
    return out


def gib(x):
    return f"{x / 2**30:.3f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def fmt_time(s):
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.2f} ms"


def main(args):
    compact = "--compact" in args
    paths = [a for a in args if a != "--compact"]
    runs, medians, errors, context = load(paths)
    rows = summarize(runs, medians)
    print(f"FMA peak {context.get('fma_peak_gflops', '?')} GFLOP/s on {context.get('contrastive_threads', '?')} "
          f"threads ({context.get('fma_peak_gflops_1thread', '?')} on one), memcpy "
          f"{context.get('copy_peak_gbytes_per_s', '?')} GB/s (read + write).\n")
    for name in sorted(n for n in rows if n.startswith("roofline/")):
        r = rows[name]
        val = f"{r['flops'] * 1e-9:.1f} GFLOP/s" if "flops" in r else f"{r.get('bytes_per_second', 0) * 1e-9:.2f} GB/s"
        print(f"- `{name}`: {val} (median of {r['reps']})")
    print()
    keyed = {}
    for name, r in rows.items():
        m = NAME.match(name)
        if m:
            keyed[(m["obj"], m["pass"], m["type"], m["algo"], int(m["n"]), int(m["d"]))] = (name, r)
    if compact:
        print("| objective | pass | type | algorithm | N | D | time/call | exec GFLOP/s | of FMA peak per CPU-s | CPU busy "
              "| peak mem: call | fused speedup | fused mem: call | time vs float |")
        print("|" + "---|" * 14)
    else:
        print("| objective | pass | type | algorithm | N | D | reps | time/call (median) | exec GFLOP/s | of FMA peak "
              "| of FMA peak per CPU-s | CPU busy | CPU s/call | useful GFLOP/s | GB/s (of memcpy) | peak mem: call "
              "| peak mem: + inputs, outputs | fused speedup | fused mem: call (+ in/out) | time vs float |")
        print("|" + "---|" * 20)
    order = {"symmetric": 0, "info_nce": 1, "fwd_bwd": 0, "fwd": 1, "float": 0, "bfloat16": 1, "half": 2,
             "materialized": 0, "fused": 1}
    # An algorithm may carry a GEMM backend suffix ("fused+cblas"): it sorts after the built-in one and is compared
    # with the materialized run of the same backend.
    def algo_order(a):
        base, _, backend = a.partition("+")
        return (order.get(base, 9), backend)

    for key in sorted(keyed, key=lambda k: (k[4], k[5], order[k[0]], order[k[1]], order[k[2]], algo_order(k[3]))):
        obj, ps, ty, algo, n, d = key
        name, r = keyed[key]
        speed = memr = vs_float = ""
        base_algo, plus, backend = algo.partition("+")
        materialized = "materialized" + plus + backend
        if base_algo == "fused" and (obj, ps, ty, materialized, n, d) in keyed:
            base = keyed[(obj, ps, ty, materialized, n, d)][1]
            speed = f"{base['seconds'] / r['seconds']:.2f}x"
            if "mem_call" in r and "mem_call" in base:
                memr = f"{r['mem_call'] / base['mem_call'] * 100:.1f}% ({r['mem_total'] / base['mem_total'] * 100:.1f}%)"
        if ty != "float" and (obj, ps, "float", algo, n, d) in keyed:
            vs_float = f"{r['seconds'] / keyed[(obj, ps, 'float', algo, n, d)][1]['seconds']:.2f}"
        if compact:
            print(f"| {obj} | {ps} | {ty} | {algo} | {n} | {d} | {fmt_time(r['seconds'])} "
                  f"| {r.get('exec_flops', 0) * 1e-9:.1f} | {r.get('fma_peak_frac_cpu', 0) * 100:.1f}% "
                  f"| {r.get('cpu_busy', 0):.2f} | {gib(r.get('mem_call', 0))} | {speed} | {memr.split(' ')[0]} "
                  f"| {vs_float} |")
            continue
        print(f"| {obj} | {ps} | {ty} | {algo} | {n} | {d} | {r['reps']} | {fmt_time(r['seconds'])} "
              f"| {r.get('exec_flops', 0) * 1e-9:.1f} | {r.get('fma_peak_frac', 0) * 100:.1f}% "
              f"| {r.get('fma_peak_frac_cpu', 0) * 100:.1f}% | {r.get('cpu_busy', 0):.2f} "
              f"| {r['seconds'] * r.get('cpu_busy', 0) * r.get('threads', 0):.3g} "
              f"| {r.get('useful_flops', 0) * 1e-9:.1f} "
              f"| {r.get('bytes_per_second', 0) * 1e-9:.2f} ({r.get('bw_peak_frac', 0) * 100:.1f}%) "
              f"| {gib(r.get('mem_call', 0))} | {gib(r.get('mem_total', 0))} | {speed} | {memr} | {vs_float} |")
    for name, msg in sorted(errors.items()):
        print(f"\n- `{name}`: {msg}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
