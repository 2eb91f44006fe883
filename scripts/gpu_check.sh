#!/usr/bin/env bash
# On a machine with a CUDA GPU: build the device path, run every device test, the device benchmarks and PyTorch's
# ClipLoss beside them, print one table, then rerun the device tests under compute-sanitizer. Budget: under 8 minutes
# on an H200 (each phase has its own timeout; a phase that runs out is reported and the script goes on).
#
#   bash scripts/gpu_check.sh            # build dir: build-gpu; logs and JSON in $OUT (if set) or build-gpu/
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build-gpu}
mkdir -p "$out"
t0=$SECONDS
phase() { echo "== $1 ($((SECONDS - t0)) s)"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')

phase build
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCONTRASTIVE_ENABLE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}" -DCONTRASTIVE_BUILD_EXAMPLES=OFF >"$out/configure.log" 2>&1 ||
  { tail -30 "$out/configure.log"; exit 1; }
timeout 300 cmake --build build-gpu -j"$(nproc)" --target device_test device_chunked_test contrastive_device_bench \
  >"$out/build.log" 2>&1 || { grep -E "error" "$out/build.log" | head -30; tail -5 "$out/build.log"; exit 1; }
# The NCCL test only where CMake found NCCL (contrastive::nccl); its absence is reported, not fatal.
timeout 120 cmake --build build-gpu -j"$(nproc)" --target device_distributed_test >>"$out/build.log" 2>&1 ||
  echo "device_distributed_test not built (no NCCL found?): see $out/build.log"

phase "device tests"
test_rc=0
for t in device_test device_chunked_test device_distributed_test; do
  [ -x "./build-gpu/tests/$t" ] || { echo "$t: not built" | tee "$out/$t.log"; continue; }
  limit=120
  [ "$t" = device_chunked_test ] && limit=180 # float64 references at N = 20000 on the host
  timeout "$limit" "./build-gpu/tests/$t" 2>&1 | tee "$out/$t.log" | grep -E '^\[  (FAILED|PASSED|SKIPPED) ' | head -30
  rc=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] && test_rc=$rc && echo "$t exited with $rc"
done

phase "device benchmarks"
timeout 200 ./build-gpu/benchmarks/contrastive_device_bench --benchmark_format=console \
  --benchmark_out="$out/device_bench.json" --benchmark_out_format=json 2>&1 | tee "$out/device_bench.log" | tail -30
[ "${PIPESTATUS[0]}" -ne 0 ] && echo "device benchmarks did not finish (timeout or error); the table shows what ran"

py=""
for p in python3 /usr/bin/python3; do
  if "$p" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then py=$p; break; fi
done
if [ -n "$py" ]; then
  phase "PyTorch ClipLoss side by side"
  timeout 90 "$py" scripts/torch_reference.py --sizes 4096 16384 65536 --repeats 5 | tee "$out/torch.log"
fi

phase table
python3 scripts/gpu_table.py "$out/device_bench.json" "$out/torch.log" | tee "$out/table.txt"

if [ -n "$py" ]; then
  phase "PyTorch extension on CUDA tensors (first use compiles it with nvcc)"
  (cd python && timeout 240 "$py" -m pytest -q -p no:cacheprovider tests -k cuda 2>&1 | tail -5) | tee "$out/torch_ext.log"
  (cd python && timeout 120 "$py" -m contrastive_torch.bench --device cuda --n 16384 --dtype bfloat16 \
    --algorithm chunked --rounds 1 --steps 3 2>&1 | tail -4) | tee -a "$out/torch_ext.log"
fi

if command -v compute-sanitizer >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  phase "compute-sanitizer memcheck (the chunked tests without the large cases, then the device tests)"
  timeout 120 "$cs" --tool memcheck --error-exitcode 9 ./build-gpu/tests/device_chunked_test \
    --gtest_filter='-*LargeN*:*AgreeWithTheCublasPath*' >"$out/sanitizer_chunked.log" 2>&1
  echo "memcheck device_chunked_test: rc $? ($(grep -c 'ERROR SUMMARY: 0' "$out/sanitizer_chunked.log") clean summaries)"
  timeout 150 "$cs" --tool memcheck --error-exitcode 9 ./build-gpu/tests/device_test >"$out/sanitizer_device.log" 2>&1
  echo "memcheck device_test: rc $?"
  tail -3 "$out/sanitizer_device.log"
fi

phase summary
passed=$(cat "$out"/device_test.log "$out"/device_chunked_test.log "$out"/device_distributed_test.log | grep -oE '^\[  PASSED  \] [0-9]+' |
  grep -oE '[0-9]+$' | paste -sd+ | bc 2>/dev/null || echo "?")
failed=$(cat "$out"/device_test.log "$out"/device_chunked_test.log "$out"/device_distributed_test.log | grep -cE '^\[  FAILED  \] [A-Za-z]' || true)
printf '%-28s %s\n' "gpu" "$(head -1 "$out/gpu.txt")" "device tests passed" "$passed" "device tests failed" "$failed" \
  "wall seconds" "$((SECONDS - t0))"
exit "$test_rc"
