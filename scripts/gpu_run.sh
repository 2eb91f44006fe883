#!/usr/bin/env bash
# gpu-bundle/run.sh: the first GPU run from a bundle built elsewhere (bash scripts/gpu_bundle.sh copies this file).
#
#   bash gpu-bundle/run.sh [OUT_DIR]        # OUT_DIR: the argument, else $OUT, else ./gpu-out
#   bash gpu-bundle/run.sh --dry-run [DIR]  # everything up to the first CUDA call, with a fake nvidia-smi; exits 0
#
# Answers first, in at most 8 files: OUT_DIR/summary.txt gets one line after every step
#   <unix time> <step> PASS|FAIL|SKIP <seconds>s <one-line result>
# so a run killed at its limit still reports every step done. Steps, each under its own timeout (the estimates and
# limits are in docs/performance.md, "Device"): libraries, nvidia-smi, device tests, the ceilings (cuBLAS bf16
# matmul, device copy), the bf16 table at N = 16384 and 65536, one N = 2^20 chunked step, the NCCL test, a narrow
# compute-sanitizer memcheck. The whole run is held to GPU_RUN_BUDGET seconds (default 360): a step gets at most what
# is left, and is skipped when under 5 s are left.
# Files: summary.txt, tests.log, bench.json (one Google Benchmark document per benchmark step, appended), bench.log
# (the benchmarks' stderr), table.txt (scripts/gpu_table.py), nccl.log, memcheck.log.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dry=0
out_arg=""
for a in "$@"; do
  case $a in
    --dry-run) dry=1 ;;
    -h | --help)
      sed -n '2,16p' "$0"
      exit 0
      ;;
    *) out_arg=$a ;;
  esac
done
out=${out_arg:-${OUT:-./gpu-out}}
mkdir -p "$out" || exit 1
out=$(cd "$out" && pwd)
summary=$out/summary.txt
budget=${GPU_RUN_BUDGET:-360}
reserve=5 # seconds kept for the last table and the closing line
t0=$SECONDS
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bin=$here/bin
: >"$summary"

# One summary line, also printed (the device tool returns the end of stdout).
note() { # step status seconds result
  local line
  line=$(printf '%s %-10s %-4s %4ss %s' "$(date +%s)" "$1" "$2" "$3" "$4")
  echo "$line" >>"$summary"
  echo "$line"
}
on_signal() {
  note run FAIL $((SECONDS - t0)) "run.sh stopped by a signal during step '${current:-?}'"
  exit 143
}
trap on_signal TERM INT HUP
note start PASS 0 "$(head -1 "$here/MANIFEST" 2>/dev/null || echo 'no MANIFEST') $([ "$dry" = 1 ] && echo '(dry run)') budget ${budget}s out $out"

# The time a step may take: its own limit, cut to what is left of the budget.
limit_for() {
  local left=$((budget - (SECONDS - t0) - reserve))
  [ "$1" -lt "$left" ] && left=$1
  echo "$left"
}

# run_step NAME LIMIT LOG CMD...: CMD under timeout, stdout and stderr appended to LOG (stderr to $errlog instead
# when that is set). Sets rc and secs.
# In a dry run it prints the command instead (rc 0). rc 124/137: the step ran out of time.
run_step() {
  local name=$1 lim=$2 log=$3
  shift 3
  current=$name
  rc=0
  secs=0
  if [ "$dry" = 1 ]; then
    printf 'would run (timeout %ss, log %s):' "$lim" "${log#"$out"/}"
    printf ' %q' "$@"
    echo
    return 0
  fi
  local s=$SECONDS
  if [ -n "${errlog:-}" ]; then
    timeout -k 5 "$lim" "$@" >>"$log" 2>>"$errlog"
  else
    timeout -k 5 "$lim" "$@" >>"$log" 2>&1
  fi
  rc=$?
  secs=$((SECONDS - s))
}

# ---- libraries: libcudart/libcublas(Lt)/libnccl from the toolkit or the pip wheels (nvidia/*/lib), carried ones
# (gpu-bundle/lib) first.
s=$SECONDS
dirs=("$here/lib")
cands=()
for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-13.0 /usr/local/cuda-13; do
  [ -n "$d" ] && cands+=("$d/lib64" "$d/targets/x86_64-linux/lib" "$d/lib")
done
for py in python3 /usr/bin/python3 /opt/torch/.venv/bin/python3; do
  command -v "$py" >/dev/null 2>&1 || continue
  while read -r sp; do
    for d in "$sp"/nvidia/*/lib "$sp"/nvidia/*/lib64; do [ -d "$d" ] && cands+=("$d"); done
  done < <("$py" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>/dev/null | sort -u)
done
found=()
missing=()
for lib in $(cat "$here/needed.txt" 2>/dev/null); do
  hit=""
  for d in "${dirs[@]}" "${cands[@]}"; do
    if [ -e "$d/$lib" ]; then
      hit=$d
      break
    fi
  done
  if [ -n "$hit" ]; then
    [[ " ${dirs[*]} " == *" $hit "* ]] || dirs+=("$hit")
    found+=("$lib=$hit")
  elif ldconfig -p 2>/dev/null | grep -q "$lib "; then
    found+=("$lib=system")
  else
    missing+=("$lib")
  fi
done
LD_LIBRARY_PATH=$(
  IFS=:
  echo "${dirs[*]}"
)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH
unresolved=$(for b in "$bin"/*; do ldd "$b" 2>&1 | grep -E 'not found' | sed "s|^|$(basename "$b"): |"; done | sort -u | tr '\n' ';')
if [ ${#missing[@]} -eq 0 ] && [ -z "$unresolved" ]; then
  note libs PASS $((SECONDS - s)) "${found[*]}"
else
  note libs FAIL $((SECONDS - s)) "missing: ${missing[*]} ${unresolved} (found: ${found[*]})"
fi
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

# ---- fallback: a test binary that does not start here (a library or symbol version this image lacks) is rebuilt
# from the repository's sources (the folder above gpu-bundle/) with CMake + Ninja and the carried GoogleTest; there is
# no Google Benchmark to build against, so the benchmark binary stays as carried. GPU_RUN_REBUILD=1 forces it.
tbin=$bin
rebuild=${GPU_RUN_REBUILD:-0}
for t in device_test device_chunked_test device_distributed_test; do
  if [ -x "$bin/$t" ] && ! "$bin/$t" --gtest_list_tests >/dev/null 2>&1; then
    rebuild=1
  fi
done
src=$(cd "$here/.." && pwd)
if [ "$rebuild" = 1 ]; then
  lim=$(limit_for 150)
  if [ ! -f "$src/CMakeLists.txt" ] || [ ! -f "$here/src/googletest.tar.gz" ] || ! command -v cmake >/dev/null 2>&1; then
    note rebuild SKIP 0 "a test binary does not start, and no sources, googletest.tar.gz or cmake to rebuild it"
  else
    run_step rebuild "$lim" "$tmp/rebuild.log" bash -c '
      set -e
      w=$1
      mkdir -p "$w" && tar -C "$w" -xzf "$2"
      gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
      cmake -S "$w/googletest" -B "$w/gtest-build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF \
        -DCMAKE_INSTALL_PREFIX="$w/gtest" -DCMAKE_INSTALL_LIBDIR=lib
      cmake --build "$w/gtest-build" -j"$(nproc)" --target install
      cmake -S "$3" -B "$w/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCONTRASTIVE_ENABLE_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DCONTRASTIVE_BUILD_BENCHMARKS=OFF -DCONTRASTIVE_BUILD_EXAMPLES=OFF \
        -DGTest_DIR="$w/gtest/lib/cmake/GTest" -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST
      targets=(device_test device_chunked_test)
      cmake --build "$w/build" --target help | grep -q device_distributed_test && targets+=(device_distributed_test)
      cmake --build "$w/build" -j"$(nproc)" --target "${targets[@]}"
      mkdir -p "$w/bin" && cp "${targets[@]/#/$w/build/tests/}" "$w/bin/"' _ "$tmp/rb" "$here/src/googletest.tar.gz" "$src"
    if [ "$dry" = 1 ]; then
      note rebuild SKIP 0 "dry run"
    elif [ "$rc" -eq 0 ]; then
      tbin=$tmp/rb/bin
      note rebuild PASS "$secs" "test binaries rebuilt here: $(ls "$tbin" | tr '\n' ' ')"
    else
      { echo "=== rebuild (rc $rc)"; tail -40 "$tmp/rebuild.log"; } >>"$out/tests.log"
      note rebuild FAIL "$secs" "rc $rc: $(grep -m1 -iE 'error' "$tmp/rebuild.log" | cut -c1-160) (tests.log)"
    fi
  fi
fi

# ---- the card. A dry run puts a fake nvidia-smi first on PATH (the one command run for real there).
if [ "$dry" = 1 ]; then
  mkdir -p "$tmp/shim"
  cat >"$tmp/shim/nvidia-smi" <<'EOF'
#!/bin/sh
echo "NVIDIA H200 (fake nvidia-smi of run.sh --dry-run), 143771 MiB, 580.159.03, 9.0, 1980 MHz"
EOF
  chmod +x "$tmp/shim/nvidia-smi"
  PATH=$tmp/shim:$PATH
fi
s=$SECONDS
timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,clocks.max.sm --format=csv,noheader \
  >"$tmp/gpu.txt" 2>&1
rc=$?
gpu=$(head -1 "$tmp/gpu.txt")
[ "$rc" -eq 0 ] && note gpu PASS $((SECONDS - s)) "$gpu" || note gpu FAIL $((SECONDS - s)) "nvidia-smi rc $rc: $gpu"

# ---- device tests: every test but the N = 20000 cases (a single-threaded float64 host reference each).
gtest_result() { # log: "P passed, F failed (names), S skipped" or how it stopped
  local log=$1 passed failed skipped last
  passed=$(grep -oE '^\[  PASSED  \] [0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1)
  failed=$(grep -E '^\[  FAILED  \] [A-Za-z]' "$log" | sed 's/^\[  FAILED  \] //; s/ (.*//' | sort -u | tr '\n' ' ')
  skipped=$(grep -oE '^\[  SKIPPED \] [0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1)
  if [ -z "$passed" ]; then
    last=$(grep -E '^\[ RUN      \]' "$log" | tail -1 | sed 's/^\[ RUN      \] //')
    echo "did not finish: $(grep -cE '^\[       OK \]' "$log") ok, failed: ${failed:-none}; last started: ${last:-none}"
  else
    echo "$passed passed, ${skipped:-0} skipped, failed: ${failed:-none}"
  fi
}
preflight() { # name limit binary: prints the step's timeout, or notes SKIP and fails (binary missing, no time left)
  local name=$1 lim
  if [ ! -x "$3" ]; then
    note "$name" SKIP 0 "$(basename "$3") not in the bundle" >&2 # stdout is the timeout
    return 1
  fi
  lim=$(limit_for "$2")
  if [ "$lim" -lt 5 ]; then
    note "$name" SKIP 0 "no time left in the ${budget}s budget" >&2
    return 1
  fi
  echo "$lim"
}
gtest_step() { # name limit log binary args...
  local name=$1 lim=$2 log=$3 b=$4
  shift 4
  lim=$(preflight "$name" "$lim" "$tbin/$b") || return 0
  run_step "$name" "$lim" "$tmp/$name.log" "$tbin/$b" --gtest_color=no "$@"
  [ "$dry" = 1 ] && {
    note "$name" SKIP 0 "dry run"
    return
  }
  echo "=== $b $* (timeout ${lim}s, rc $rc, ${secs}s)" >>"$log"
  cat "$tmp/$name.log" >>"$log"
  local res
  res=$(gtest_result "$tmp/$name.log")
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    note "$name" FAIL "$secs" "timeout ${lim}s: $res"
  elif [ "$rc" -ne 0 ]; then
    note "$name" FAIL "$secs" "rc $rc: $res"
  else
    note "$name" PASS "$secs" "$res"
  fi
}
gtest_step device_test 60 "$out/tests.log" device_test
gtest_step chunked_test 60 "$out/tests.log" device_chunked_test --gtest_filter='-*LargeN*'

# ---- benchmarks: JSON to stdout, line-buffered (stdbuf), appended to bench.json, so a step killed at its limit
# leaves every finished entry (gpu_table.py reads a cut-off document). Setup draws the inputs on the device (a
# counter-based generator kernel, benchmarks/device_loss.cu), on every call of a benchmark function.
sb=()
command -v stdbuf >/dev/null 2>&1 && sb=(stdbuf -oL -eL)
bench_step() { # name limit args...
  local name=$1 lim=$2
  shift 2
  lim=$(preflight "$name" "$lim" "$bin/contrastive_device_bench") || return 0
  local before=0
  [ -f "$out/bench.json" ] && before=$(grep -c '"run_type"' "$out/bench.json")
  [ "$dry" = 1 ] || echo "=== $name $* (timeout ${lim}s)" >>"$out/bench.log"
  errlog=$out/bench.log run_step "$name" "$lim" "$tmp/$name.json" "${sb[@]}" "$bin/contrastive_device_bench" \
    --benchmark_format=json "$@"
  [ "$dry" = 1 ] && {
    note "$name" SKIP 0 "dry run"
    return
  }
  # The JSON from its first '{' line on (a line printed after it is ignored by gpu_table.py); lines before it to
  # the log. A newline ends a document cut off mid-line, so the next one starts on its own line.
  awk 'f || /^\{/ {f=1} f' "$tmp/$name.json" >>"$out/bench.json"
  echo >>"$out/bench.json"
  awk '/^\{/ {exit} {print}' "$tmp/$name.json" >>"$out/bench.log"
  local n errs
  n=$(($(grep -c '"run_type"' "$out/bench.json") - before))
  errs=$(grep -c '"error_occurred": true' "$tmp/$name.json")
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    note "$name" FAIL "$secs" "timeout ${lim}s after $n entries ($errs errors)"
  elif [ "$rc" -ne 0 ]; then
    note "$name" FAIL "$secs" "rc $rc, $n entries ($errs errors)"
  elif [ "$n" -eq 0 ]; then
    note "$name" FAIL "$secs" "no entries: $(grep -m1 -E 'no CUDA device' "$tmp/$name.json" || echo 'see bench.log')"
  else
    note "$name" PASS "$secs" "$n entries ($errs errors)"
  fi
}
table_step() { # name: gpu_table.py over bench.json (also in a dry run: it needs no GPU)
  local s=$SECONDS
  if ! command -v python3 >/dev/null 2>&1; then
    note "$1" SKIP 0 "no python3"
    return
  fi
  timeout 20 python3 "$here/gpu_table.py" "$out/bench.json" >"$out/table.txt" 2>&1
  local r=$? line
  line=$(grep -E '^N = [0-9]+: chunked' "$out/table.txt" | tail -2 | tr '\n' ' ')
  [ "$r" -eq 0 ] && note "$1" PASS $((SECONDS - s)) "${line:-no ratios yet} (table.txt)" ||
    note "$1" FAIL $((SECONDS - s)) "gpu_table.py rc $r: $(tail -1 "$out/table.txt")"
}
bench_step ceilings 30 --benchmark_filter='^roofline/'
# GPU_RUN_TABLE_FILTER narrows the table (a short lease); GPU_RUN_NO_2POW20=1 leaves the N = 2^20 step out.
bench_step table 120 "--benchmark_filter=${GPU_RUN_TABLE_FILTER:-^(step/bf16/[a-z_]+|baseline/cublas_bf16_3gemm)/(16384|65536)/}" \
  --benchmark_repetitions=5 --benchmark_min_time=0.05 --benchmark_min_warmup_time=0.02
table_step table.txt
if [ "${GPU_RUN_NO_2POW20:-0}" != 1 ]; then
  bench_step n_2pow20 75 '--benchmark_filter=^step/bf16/chunked/1048576/'
  table_step table.txt
fi

# ---- then: NCCL on one GPU, and compute-sanitizer memcheck of two small tests (the tile kernels' cases, and the
# sigmoid objective's chunked cases: the newest kernel).
gtest_step nccl_test 30 "$out/nccl.log" device_distributed_test
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ ! -x "$cs" ] && [ "$dry" = 0 ]; then
  note memcheck SKIP 0 "no compute-sanitizer"
elif [ ! -x "$tbin/device_chunked_test" ]; then
  note memcheck SKIP 0 "device_chunked_test not in the bundle"
else
  lim=$(limit_for 60)
  if [ "$lim" -lt 5 ]; then
    note memcheck SKIP 0 "no time left in the ${budget}s budget"
  else
    run_step memcheck "$lim" "$out/memcheck.log" "$cs" --tool memcheck --error-exitcode 9 \
      "$tbin/device_chunked_test" --gtest_color=no --gtest_filter='DeviceChunked.MatchesFloat64AndTheHostPath:DeviceChunked.FusedTilesMatchFloat64AndTheHostPath:DeviceChunkedSigmoid.MatchesFloat64AndTheHostPath:DeviceAutomatic.*:DeviceCore.*'
    if [ "$dry" = 1 ]; then
      note memcheck SKIP 0 "dry run"
    else
      res="$(grep -m1 -oE 'ERROR SUMMARY: [0-9]+ errors?' "$out/memcheck.log" || echo 'no error summary'); $(gtest_result "$out/memcheck.log")"
      case $rc in
        0) note memcheck PASS "$secs" "$res" ;;
        124 | 137) note memcheck FAIL "$secs" "timeout ${lim}s: $res" ;;
        *) note memcheck FAIL "$secs" "rc $rc: $res" ;;
      esac
    fi
  fi
fi

files=$(find "$out" -type f | wc -l)
note "done" "$([ "$files" -le 8 ] && echo PASS || echo FAIL)" $((SECONDS - t0)) "$files files in $out (at most 8 come back)"
[ -s "$out/table.txt" ] && [ "$dry" = 0 ] && cat "$out/table.txt"
exit 0
