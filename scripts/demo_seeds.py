#!/usr/bin/env python3
"""Runs the collapse demo over several seeds (and several builds, e.g. one per host ISA) and counts outcomes.

    python3 scripts/demo_seeds.py --seeds 1-6 avx512=build/examples/collapse_demo avx2=build-avx2/examples/collapse_demo

Each LABEL=PATH is one collapse_demo binary (build one per ISA with -DCONTRASTIVE_HOST_ISA=avx512|avx2|portable).
Extra demo options go after `--` (e.g. `-- --steps 800`). For every binary x configuration it prints how many seeds
  collapsed  the demo's own verdict (a run of skipped steps that lasts to the end),
  degraded   not collapsed, but top-1 more than 5 points below the float run of the same seed and binary, or 20 or
             more skipped steps,
  through    the rest (trained through),
with the range of final top-1 and the smallest tau any step reached (from the per-step CSVs). docs/demo.md quotes it.
"""

import argparse
import csv
import os
import subprocess
import sys
import tempfile


def parse_seeds(text):
    seeds = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            seeds.extend(range(int(a), int(b) + 1))
        else:
            seeds.append(int(part))
    return seeds


def run_demo(path, seed, extra, out_dir):
    cmd = [path, "--seed", str(seed), "--quiet", "--out", out_dir] + extra
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = {}
    header_seen = False
    for line in text.splitlines():
        if line.startswith("type "):
            header_seen = True
            # SigLIP runs (--objective sigmoid) print the logit bias and the gradient share lost to underflow after
            # tau: every later column moves by two.
            shift = 2 if " bias " in line else 0
            continue
        if not header_seen or not line.strip() or line.startswith("per-step"):
            continue
        f = line.split()
        # type policy algorithm loss top-1 tau [bias] min-scale scale skipped collapsed(no | step N) ...
        run_id = "%s-%s-%s" % (f[0], f[1], f[2])
        collapsed = f[9 + shift] != "no"
        rows[run_id] = {
            "top1": float(f[4].rstrip("%")),
            "tau": float(f[5]),
            "bias": float(f[6]) if shift else float("nan"),
            "lost": float(f[7].rstrip("%")) if shift and f[7] != "-" else float("nan"),
            "skipped": int(f[8 + shift]),
            "collapsed": collapsed,
        }
    for run_id, r in rows.items():
        taus, logits = [], []
        with open(os.path.join(out_dir, run_id + ".csv")) as fh:
            for rec in csv.DictReader(fh):
                taus.append(float(rec["tau"]))
                logits.append(float(rec["max_logit"]))
        r["min_tau"] = min(taus) if taus else float("nan")
        finite = [x for x in logits if x == x and abs(x) != float("inf")]
        r["max_logit"] = max(finite) if finite else float("nan")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1-6", help="seeds, e.g. 1-6 or 1,3,5 (default 1-6)")
    ap.add_argument("--detail", action="store_true", help="also print every seed's outcome")
    ap.add_argument("builds", nargs="+", help="LABEL=PATH of a collapse_demo binary")
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    args = ap.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    builds = []
    for b in args.builds:
        if "=" not in b:
            sys.exit("expected LABEL=PATH, got %r" % b)
        label, path = b.split("=", 1)
        builds.append((label, path))

    results = {}  # (label, run_id) -> list of (seed, row, float_top1)
    order = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in builds:
            for seed in seeds:
                rows = run_demo(path, seed, extra, os.path.join(tmp, "%s-%d" % (label, seed)))
                ref = rows.get("float-learnable-materialized", {}).get("top1", float("nan"))
                for run_id, r in rows.items():
                    key = (label, run_id)
                    if key not in results:
                        results[key] = []
                        order.append(key)
                    results[key].append((seed, r, ref))
                print("%s seed %d done" % (label, seed), file=sys.stderr)

    print("seeds %s; demo options: %s" % (args.seeds, " ".join(extra) if extra else "(defaults)"))
    sigmoid = any(r["bias"] == r["bias"] for rs in results.values() for _, r, _ in rs)
    print("%-8s %-34s %9s %8s %7s %-16s %-16s %-20s%s" %
          ("build", "configuration", "collapsed", "degraded", "through", "top-1 range", "final tau range",
           "smallest tau (seed)",
           "  final bias range   largest finite logit  most gradient lost" if sigmoid else ""))
    for key in order:
        label, run_id = key
        rs = results[key]
        n_col = sum(1 for _, r, _ in rs if r["collapsed"])
        n_deg = sum(1 for _, r, ref in rs
                    if not r["collapsed"] and (r["top1"] < ref - 5.0 or r["skipped"] >= 20))
        n_ok = len(rs) - n_col - n_deg
        tops = [r["top1"] for _, r, _ in rs]
        taus = [r["tau"] for _, r, _ in rs]
        low_seed, low = min(((s, r["min_tau"]) for s, r, _ in rs), key=lambda x: x[1])
        if args.detail:
            for seed, r, ref in rs:
                verdict = "collapsed" if r["collapsed"] else (
                    "degraded" if r["top1"] < ref - 5.0 or r["skipped"] >= 20 else "through")
                print("    seed %d: %-9s top-1 %.1f%% (float %.1f%%), tau %.3g, smallest tau %.3g, %d skipped" %
                      (seed, verdict, r["top1"], ref, r["tau"], r["min_tau"], r["skipped"]))
        extra_cols = ""
        if sigmoid:
            biases = [r["bias"] for _, r, _ in rs]
            lost = [r["lost"] for _, r, _ in rs if r["lost"] == r["lost"]]
            extra_cols = "  %-18s %-21.3g %s" % ("%.3g to %.3g" % (min(biases), max(biases)),
                                                 max(r["max_logit"] for _, r, _ in rs),
                                                 "%.2g%%" % max(lost) if lost else "-")
        print("%-8s %-34s %9d %8d %7d %-16s %-16s %-20s%s" %
              (label, run_id, n_col, n_deg, n_ok, "%.1f-%.1f%%" % (min(tops), max(tops)),
               "%.3g-%.3g" % (min(taus), max(taus)), "%.3g (%d)" % (low, low_seed), extra_cols))


if __name__ == "__main__":
    main()
