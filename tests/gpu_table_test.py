#!/usr/bin/env python3
"""scripts/gpu_table.py on what a GPU run can leave behind (ctest: gpu_table.truncated_json):
- two Google Benchmark JSON documents in one file (gpu-bundle/run.sh appends one per benchmark step), the second cut
  off in the middle of an entry (the step was killed at its time limit);
- names with /iterations:N and /repeats:N suffixes (the N = 2^20 rows are registered with Iterations(1));
- repetitions: the time shown is their median (not the mean), labelled med/k; a lone run is labelled "1 run";
- the GEMM ceiling: its median after warm-up (median_FLOP/s) where the JSON has it; a rate above the ceiling (a cold
  ceiling: 171 TFLOP/s against a baseline of 650) is flagged in the table, in the fractions and by a WARNING line.

    python3 tests/gpu_table_test.py [path/to/gpu_table.py]
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "scripts", "gpu_table.py")


def entry(name, ms, run_type="iteration", rep=0, reps=1, aggregate=None, flops_per_iter=0.0, mem=0.0, extra=None):
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
    e.update(extra or {})
    return e


def document(benchmarks):
    return {"context": {"date": "2026-01-01T00:00:00+00:00", "host_name": "gpu-test", "num_cpus": 16,
                        "library_build_type": "release"}, "benchmarks": benchmarks}


def run_table(text):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench.json")
        with open(path, "w") as f:
            f.write(text)
        res = subprocess.run([sys.executable, SCRIPT, path], capture_output=True, text=True)
    print(res.stdout)
    print(res.stderr, file=sys.stderr)
    return res


def check_ceiling(failures):
    """A ceiling below a baseline's rate is flagged; a ceiling's median_FLOP/s is preferred to its mean's rate."""
    n, flop = 65536, 6.0 * 65536 * 65536 * 512
    roof = "roofline/cublas_bf16_matmul_8192/iterations:20/manual_time"
    baseline = "baseline/cublas_bf16_3gemm/65536/512/manual_time"
    chunked = "step/bf16/chunked/65536/512/manual_time"
    gemm = 2.0 * 8192**3
    rows = [entry(baseline, flop / 650e12 * 1e3, flops_per_iter=flop, mem=2**33),  # 650 TFLOP/s
            entry(chunked, flop / 150e12 * 1e3, flops_per_iter=flop, mem=2**31)]  # 150 TFLOP/s
    # The cold ceiling of the first H200 run: 171 TFLOP/s (its first iteration loaded cuBLAS's kernel).
    cold = run_table(json.dumps(document([entry(roof, gemm / 171e12 * 1e3, flops_per_iter=gemm)] + rows), indent=2))
    out = cold.stdout
    if cold.returncode != 0:
        failures.append(f"cold ceiling: exit status {cold.returncode}")
    table = {line.split("|")[0].strip(): line for line in out.splitlines() if "|" in line}
    cells = [c.strip() for c in table.get(str(n), "").split("|")]
    if len(cells) < 6 or "TF!" not in cells[5] or "TF!" in cells[1]:
        failures.append(f"cold ceiling: the baseline's cell (650 > 171) and only it should read TF!: {cells!r}")
    if "TF!: a rate above the measured bf16 GEMM ceiling (171 TFLOP/s): the ceiling is wrong" not in out:
        failures.append("cold ceiling: no legend for TF!")
    want = ("N = 65536: fraction of the measured bf16 GEMM rate (171 TFLOP/s): chunked 88%, "
            "cuBLAS 3-GEMM 380% (above the ceiling: the ceiling is wrong)")
    if want not in out:
        failures.append("cold ceiling: the baseline's fraction is not flagged (or chunked's is)")
    if "WARNING: 1 rate(s) above the measured bf16 GEMM ceiling of 171 TFLOP/s (N = 65536 cuBLAS 3-GEMM 650" not in out:
        failures.append("cold ceiling: no WARNING line naming the baseline")
    # The same cold mean, but the benchmark's median after warm-up (median_FLOP/s) says 790: that is the ceiling.
    warm_roof = entry(roof, gemm / 171e12 * 1e3, flops_per_iter=gemm,
                      extra={"median_FLOP/s": 790e12, "warmup_rounds": 4, "settled": 1})
    warm = run_table(json.dumps(document([warm_roof] + rows), indent=2))
    out = warm.stdout
    if "fraction of the measured bf16 GEMM rate (790 TFLOP/s): chunked 19%, cuBLAS 3-GEMM 82%\n" not in out:
        failures.append("warm ceiling: median_FLOP/s should be the ceiling, with no flag")
    if "TF!" in out or "WARNING" in out or "above the ceiling" in out:
        failures.append("warm ceiling: nothing is above 790 TFLOP/s, nothing may be flagged")
    if "roofline/cublas_bf16_matmul_8192: 790.0 TFLOP/s (1.39 ms, 1 run, median after 4 warm-up rounds, settled)" \
            not in out:
        failures.append("warm ceiling: the roofline line should give the median and its warm-up")


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
    res = run_table(json.dumps(document(first), indent=2) + "\nmeasured bf16 matmul peak: 785.0 TFLOP/s\n" + text2[:cut])
    out = res.stdout
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
    expect("TF!" not in out and "WARNING" not in out, "nothing runs above the 785 TFLOP/s ceiling: no flag")
    check_ceiling(failures)
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    print("gpu_table.truncated_json:", "FAILED" if failures else "passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
