#!/usr/bin/env bash
# contrastive_torch on a GPU machine (a second command after gpu-bundle/run.sh, when the lease has the minutes): builds
# both extensions against that machine's PyTorch (on first use, with ninja, for TORCH_CUDA_ARCH_LIST, default 9.0) and
# runs python/tests' CUDA tests: parity with the reference, the operators (opcheck, torch.compile), the float16 rerun,
# and the gather exchange over a one-rank NCCL group. Nothing is installed; the image's python3 and pytest are used.
#
#   bash scripts/gpu_torch_check.sh [OUT_DIR]     # OUT_DIR: the argument, else $OUT, else ./gpu-out
#
# Limits (seconds): TORCH_BUILD_LIMIT (default 360) for both builds, TORCH_TEST_LIMIT (default 180) for the tests.
# Output: OUT_DIR/torch.log, and one summary line per stage on stdout.
#
# TORCH_SIDE_BY_SIDE=1 adds a third stage, scripts/gpu_side_by_side.py (the losses beside eager PyTorch, torch.compile,
# Inf-CL and siglip-kernel) on the extension just built, with the peers' wheels from .whl/ where present (installed
# into a temporary --target, nothing else touched): at most TORCH_SIDE_BY_SIDE_LIMIT seconds (default 300; its
# --wall-limit), extra arguments in TORCH_SIDE_BY_SIDE_ARGS; OUT_DIR/side_by_side.md, .jsonl and .log.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-./gpu-out}}
mkdir -p "$out"
log=$out/torch.log
py=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$root/.torch-extensions} CONTRASTIVE_TORCH_QUIET=1
cd "$root/python" || exit 1
: >"$log"
if ! "$py" -c 'import torch, pytest; assert torch.cuda.is_available()' >>"$log" 2>&1; then
  echo "torch-check SKIP: $py has no torch with a visible GPU, or no pytest ($log)"
  exit 0
fi
s=$SECONDS
timeout "${TORCH_BUILD_LIMIT:-360}" "$py" - >>"$log" 2>&1 <<'PY'
import time, torch
import contrastive_torch as ct
print("torch", torch.__version__, "GPU", torch.cuda.get_device_name())
for name, load in (("host", ct.extension), ("CUDA", ct.cuda_extension)):
    t = time.time()
    load()
    print(f"{name} extension built/loaded in {time.time() - t:.0f} s", flush=True)
PY
rc=$?
echo "torch-build $([ $rc -eq 0 ] && echo PASS || echo FAIL) $((SECONDS - s))s rc $rc: $(grep -E 'extension built|Error' "$log" | tail -2 | tr '\n' ';')"
[ $rc -eq 0 ] || exit 1
s=$SECONDS
timeout "${TORCH_TEST_LIMIT:-180}" "$py" -m pytest -q -p no:cacheprovider -rs -k "cuda or nccl" tests >>"$log" 2>&1
rc=$?
echo "torch-tests $([ $rc -eq 0 ] && echo PASS || echo FAIL) $((SECONDS - s))s rc $rc: $(grep -E '[0-9]+ (passed|failed)' "$log" | tail -1)"
grep -E '^(FAILED|ERROR)' "$log" | head -20
if [ "${TORCH_SIDE_BY_SIDE:-0}" = 1 ]; then
  s=$SECONDS
  if compgen -G "$root/.whl/*.whl" >/dev/null; then
    site=$(mktemp -d)
    if "$py" -m pip install -q --no-index --no-deps --target "$site" "$root"/.whl/*.whl >>"$log" 2>&1; then
      export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    fi
  fi
  limit=${TORCH_SIDE_BY_SIDE_LIMIT:-300}
  # shellcheck disable=SC2086 # TORCH_SIDE_BY_SIDE_ARGS: words on purpose
  timeout $((limit + 60)) "$py" "$root/scripts/gpu_side_by_side.py" --out "$out/side_by_side.md" \
    --wall-limit "$limit" ${TORCH_SIDE_BY_SIDE_ARGS:-} >"$out/side_by_side.log" 2>&1
  rc=$?
  rows=$(grep -cE '^\| (bf16|autocast) ' "$out/side_by_side.md" 2>/dev/null)
  echo "side-by-side $([ $rc -eq 0 ] && echo PASS || echo FAIL) $((SECONDS - s))s rc $rc: ${rows:-0} rows" \
       "($out/side_by_side.md)"
fi
exit 0
