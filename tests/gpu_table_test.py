#!/usr/bin/env python3
"""scripts/gpu_table.py on what a GPU run can leave behind (ctest: gpu_table.truncated_json):
- two Google Benchmark JSON documents in one file (gpu-bundle/run.sh appends one per benchmark step), the second cut
  off in the middle of an entry (the step was killed at its time limit);
- names with /iterations:N and /repeats:N suffixes (the N = 2^20 rows are registered with Iterations(1));
- repetitions: the time shown is their median (not the mean), labelled med/k; a lone run is labelled "1 run".

    python3 tests/gpu_table_test.py [path/to/gpu_table.py]
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "scripts", "gpu_table.py")


def entry(name, ms, run_type="iteration", rep=0, reps=1, aggregate=None, flops_per_iter=0.0, mem=0.0):
    run_name = name
    e = {"name": name + (f"_{aggregate}" if aggregate else ""), "run_name": run_name, "run_type": run_type,
         "repetitions": reps, "repetition_index": rep, "threads": 1, "iterations": 3, "real_time": ms,
         "cpu_time": 0.01, "time_unit": "ms"}
    if aggregate:
        e["aggregate_name"] = aggregate
    if flops_per_iter:
        e["FLOP/s"] = flops_per_iter / (ms * 1e-3)
    if mem:
        e["mem_bytes"] = mem
    return e


def document(benchmarks):
    return {"context": {"date": "2026-01-01T00:00:00+00:00", "host_name": "gpu-test", "num_cpus": 16,
                        "library_build_type": "release"}, "benchmarks": benchmarks}


def main():
    n, flop = 16384, 6.0 * 16384 * 16384 * 512
    chunked = "step/bf16/chunked/16384/512/manual_time"
    baseline = "baseline/cublas_bf16_3gemm/16384/512/manual_time"
    times = [1.0, 2.0, 3.0, 10.0, 11.0]  # median 3, mean 5.4
    first = [entry("roofline/cublas_bf16_matmul_8192/iterations:20/manual_time", 1.4, flops_per_iter=2.0 * 8192**3)]
    for i, t in enumerate(times):
        first.append(entry(chunked, t, rep=i, reps=5, flops_per_iter=flop, mem=2**30))
    first += [entry(chunked, 5.4, "aggregate", reps=5, aggregate="mean", flops_per_iter=flop, mem=2**30),
              entry(chunked, 3.0, "aggregate", reps=5, aggregate="median", flops_per_iter=flop, mem=2**30)]
    # The baseline only as aggregates (--benchmark_report_aggregates_only): its median is taken as is.
    first += [entry(baseline + "/repeats:5", 4.0, "aggregate", reps=5, aggregate="mean", flops_per_iter=flop, mem=2**31),
              entry(baseline + "/repeats:5", 2.5, "aggregate", reps=5, aggregate="median", flops_per_iter=flop, mem=2**31)]
    big = "step/bf16/chunked/1048576/512/iterations:1/manual_time"
    second = [entry(big, 12345.0, flops_per_iter=6.0 * 2.0**40 * 512, mem=8 * 2**30),
              entry("step/bf16/chunked_tiles/1048576/512/iterations:1/manual_time", 9999.0)]
    text2 = json.dumps(document(second), indent=2)
    cut = text2.index("step/bf16/chunked_tiles") + 30  # in the middle of the second entry
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench.json")
        with open(path, "w") as f:
            f.write(json.dumps(document(first), indent=2) + "\nmeasured bf16 matmul peak: 785.0 TFLOP/s\n")
            f.write(text2[:cut])
        res = subprocess.run([sys.executable, SCRIPT, path], capture_output=True, text=True)
    out = res.stdout
    print(out)
    print(res.stderr, file=sys.stderr)
    failures = []

    def expect(cond, what):
        if not cond:
            failures.append(what)

    expect(res.returncode == 0, f"exit status {res.returncode}")
    rows = {line.split("|")[0].strip(): line for line in out.splitlines() if "|" in line}
    expect(str(n) in rows, "no row for N = 16384")
    expect("1048576" in rows, "the N = 2^20 row (an /iterations:1 name) was dropped")
    if str(n) in rows:
        cells = [c.strip() for c in rows[str(n)].split("|")]
        expect(cells[1].startswith("3.00 ms") and "med/5" in cells[1],
               f"chunked at 16384 should be the median of 5 (3.00 ms, med/5): {cells[1]!r}")
        expect(cells[5].startswith("2.50 ms") and "med/5" in cells[5],
               f"the baseline (aggregates only, /repeats:5) should be its median 2.50 ms: {cells[5]!r}")
    if "1048576" in rows:
        cells = [c.strip() for c in rows["1048576"].split("|")]
        expect(cells[1].startswith("12345.00 ms") and "1 run" in cells[1], f"2^20 chunked: {cells[1]!r}")
        expect(cells[2] == "-", f"the cut-off chunked_tiles entry should be absent: {cells[2]!r}")
    expect("cut off" in out, "the table does not say the JSON was cut off")
    expect("N = 16384: chunked / cuBLAS baseline: time 1.20x" in out, "chunked/baseline ratio from medians")
    expect("roofline/cublas_bf16_matmul_8192" in out, "the matmul roofline is missing")
    expect("N = 16384: fraction of the measured bf16 GEMM rate (785 TFLOP/s): chunked 35%, cuBLAS 3-GEMM 42%" in out,
           "fractions of the measured GEMM rate")
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    print("gpu_table.truncated_json:", "FAILED" if failures else "passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
