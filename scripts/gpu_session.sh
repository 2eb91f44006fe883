#!/usr/bin/env bash
# One short GPU lease, prepared here and run there as one command: the bundle's device tests, ceilings, a narrowed
# benchmark table and compute-sanitizer memcheck (gpu-bundle/run.sh) while both PyTorch extensions build in the
# background; then the PyTorch CUDA tests and the side-by-side table (scripts/gpu_side_by_side.py). Every log goes
# into OUT_DIR/logs.tgz; summary.txt, table.txt and side_by_side.md are copied beside it (at most 8 files come back).
#
#   bash scripts/gpu_bundle.sh                         # here, first (build-gpu-bundle/, gpu-bundle/)
#   bash scripts/gpu_session.sh [OUT_DIR]              # there; carry gpu-bundle and .whl (the peers' wheels)
#
# Budgets (seconds): GPU_RUN_BUDGET (bundle, default 170), SIDE_BUDGET (side by side, default 170),
# TORCH_TEST_LIMIT (PyTorch CUDA tests, default 150). SIDE_ARGS adds arguments to the side-by-side script.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-./gpu-out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs=$(mktemp -d)
t0=$SECONDS
say() { echo "[session $((SECONDS - t0))s] $*" | tee -a "$logs/session.txt"; }
cd "$root" || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used,memory.total --format=csv \
  >"$logs/nvidia-smi.txt" 2>&1
say "$(tail -1 "$logs/nvidia-smi.txt")"

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$logs/wheels.txt" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  say "wheels: $(ls .whl | tr '\n' ' ') rc $?"
fi

export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} TORCH_EXTENSIONS_DIR=$root/.torch-extensions
export CONTRASTIVE_TORCH_QUIET=1 PYTHONUNBUFFERED=1
(
  cd python && MAX_JOBS=${MAX_JOBS:-12} timeout 400 python3 - <<'PY'
import time
import torch
import contrastive_torch as ct
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), flush=True)
for name, load in (("CUDA", ct.cuda_extension), ("host", ct.extension)):
    t = time.time()
    load()
    print(f"{name} extension built in {time.time() - t:.0f} s", flush=True)
PY
) >"$logs/extensions.txt" 2>&1 &
ext=$!

if [ -x gpu-bundle/run.sh ]; then
  GPU_RUN_BUDGET=${GPU_RUN_BUDGET:-170} GPU_RUN_NO_2POW20=1 \
    GPU_RUN_TABLE_FILTER=${GPU_RUN_TABLE_FILTER:-'^(step/bf16/(chunked|sigmoid_chunked|materialized)|step/float/chunked|baseline/cublas_bf16_3gemm)/(16384|65536)/'} \
    bash gpu-bundle/run.sh "$logs/bundle" >"$logs/bundle.txt" 2>&1
  say "bundle: $(grep -E ' (PASS|FAIL|SKIP) ' "$logs/bundle/summary.txt" | awk '{print $2, $3}' | tr '\n' ' ')"
else
  say "bundle: gpu-bundle/run.sh missing (carry gpu-bundle)"
fi

wait "$ext"
say "extensions rc $?: $(grep -E 'built in|Error|error:' "$logs/extensions.txt" | tail -3 | tr '\n' ';')"

if [ -f scripts/gpu_side_by_side.py ]; then
  # shellcheck disable=SC2086
  timeout $((${SIDE_BUDGET:-170} + 60)) python3 scripts/gpu_side_by_side.py --budget "${SIDE_BUDGET:-170}" \
    --out "$logs/side_by_side.md" ${SIDE_ARGS:-} >"$logs/side_by_side.txt" 2>&1
  say "side by side rc $?"
fi

(cd python && timeout "${TORCH_TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -rs -k "cuda or nccl" \
  tests >"$logs/torch_tests.txt" 2>&1)
say "torch tests rc $?: $(grep -E '[0-9]+ (passed|failed)' "$logs/torch_tests.txt" | tail -1)"
grep -E '^(FAILED|ERROR)' "$logs/torch_tests.txt" | head -20

cp "$logs/bundle/summary.txt" "$out/summary.txt" 2>/dev/null
cp "$logs/bundle/table.txt" "$out/table.txt" 2>/dev/null
cp "$logs/side_by_side.md" "$out/side_by_side.md" 2>/dev/null
tar -C "$logs" -czf "$out/logs.tgz" .
cat "$out/summary.txt" 2>/dev/null
cat "$out/table.txt" 2>/dev/null | head -40
tail -60 "$logs/side_by_side.txt" 2>/dev/null
say "done"
