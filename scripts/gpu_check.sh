#!/usr/bin/env bash
# On a machine with a CUDA GPU: the bundle's run (gpu-bundle/run.sh: device tests, ceilings, the bf16 table,
# N = 2^20, NCCL, memcheck; one summary line per step in $OUT/summary.txt, about 6 minutes at most), built first with
# scripts/gpu_bundle.sh when gpu-bundle/ is missing or REBUILD=1 (that needs GoogleTest and Google Benchmark, which
# the H200 image lacks: build the bundle on a CPU machine and carry it). TORCH=1 adds PyTorch's ClipLoss beside the
# table (scripts/torch_reference.py, about 60 s more) when python3's torch sees a GPU.
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # OUT_DIR: the argument, else $OUT, else ./gpu-out
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${1:-${OUT:-./gpu-out}}
if [ "${REBUILD:-0}" = 1 ] || [ ! -x gpu-bundle/run.sh ]; then
  bash scripts/gpu_bundle.sh || exit 1
fi
bash gpu-bundle/run.sh "$out"
rc=$?
if [ "${TORCH:-0}" = 1 ] && python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  s=$SECONDS
  PYTHONUNBUFFERED=1 timeout 90 python3 scripts/torch_reference.py --sizes 16384 65536 --repeats 5 >"$out/torch.log" 2>&1
  r=$?
  printf '%s %-10s %-4s %4ss %s\n' "$(date +%s)" torch "$([ "$r" -eq 0 ] && echo PASS || echo FAIL)" \
    $((SECONDS - s)) "rc $r: $(grep -c '^torch/' "$out/torch.log") rows (torch.log)" | tee -a "$out/summary.txt"
  python3 gpu-bundle/gpu_table.py "$out/bench.json" "$out/torch.log" >"$out/table.txt" 2>&1
  cat "$out/table.txt"
fi
exit "$rc"
