#!/usr/bin/env bash
# On a machine with a CUDA GPU: build the device path, run every device test and the device benchmarks, and print
# one short table. Meant to fit in a few minutes on one GPU.
#
#   bash scripts/gpu_check.sh            # build dir: build-gpu, results also written to $OUT (if set) or build-gpu/
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCONTRASTIVE_ENABLE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}" -DCONTRASTIVE_BUILD_EXAMPLES=OFF >"$out/configure.log" 2>&1 ||
  { tail -30 "$out/configure.log"; exit 1; }
cmake --build build-gpu -j"$(nproc)" --target device_test contrastive_device_bench >"$out/build.log" 2>&1 ||
  { grep -E "error" "$out/build.log" | head -30; exit 1; }

echo "== device tests"
./build-gpu/tests/device_test 2>&1 | tee "$out/device_test.log" | tail -25
test_rc=${PIPESTATUS[0]}

if [ -x build-gpu/benchmarks/contrastive_device_bench ]; then
  echo "== device benchmarks"
  timeout 240 ./build-gpu/benchmarks/contrastive_device_bench --benchmark_format=console \
    --benchmark_out="$out/device_bench.json" --benchmark_out_format=json 2>&1 | tee "$out/device_bench.log" | tail -40
fi

if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "== PyTorch side by side"
  timeout 120 python3 scripts/torch_reference.py --sizes 4096 16384 65536 | tee "$out/torch.log"
fi

echo "== summary"
passed=$(grep -oE '^\[  PASSED  \] [0-9]+' "$out/device_test.log" | grep -oE '[0-9]+$' || echo 0)
failed=$(grep -cE '^\[  FAILED  \] [A-Za-z]' "$out/device_test.log" || true)
printf '%-28s %s\n' "gpu" "$(head -1 "$out/gpu.txt")" "device tests passed" "$passed" "device tests failed" "$failed"
exit "$test_rc"
