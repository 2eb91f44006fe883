#!/usr/bin/env bash
# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#
# Whether a change leaves every device kernel as it was, without a GPU: compiles the device translation units (the
# device tests, the benchmark) to PTX for sm_90 against include/ at REV and against the working tree's include/, and
# compares them with their debug lines and nvcc's per-file hashes taken out. For moves and renames of device code
# (which must change no kernel until it has run on a GPU: docs/design.md).
#
# Usage: scripts/device_ptx_check.sh [REV] [OLD=NEW ...]   (REV defaults to HEAD; exits 1 when any PTX differs)
# Where a TU differs, scripts/ptx_entries.py lists its kernels that changed, were added or were removed (demangled),
# so a change that adds kernels can still show that every existing one is as it was.
# Each OLD=NEW renames a namespace or other identifier in REV's PTX first (its mangled form, length-prefixed), so a
# change that only renames one is proven to change nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-HEAD}
shift $(( $# > 0 ? 1 : 0 ))
renames=("$@")
nvcc=${CUDACXX:-/usr/local/cuda/bin/nvcc}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src" "$work/ptx_old" "$work/ptx_new"
# Both sides compile from the same path ($work/src): nvcc's per-file names hash the source path.
git archive "$rev" include tests benchmarks | tar -x -C "$work/src"
units=(tests/device_test.cu tests/device_chunked_test.cu tests/device_distributed_test.cu tests/device_second_tu.cu
       tests/device_instantiate.cu benchmarks/device_loss.cu)

ptx() { # source root (include/, tests/, benchmarks/), output dir
  local pids=()
  for u in "${units[@]}"; do
    "$nvcc" -I"$1/include" -I"$1/tests" -O3 -DNDEBUG -arch=compute_90 --expt-relaxed-constexpr -std=c++17 -x cu -ptx \
      "$1/$u" -o "$2/$(basename "$u" .cu).ptx" &
    pids+=($!)
    if (( ${#pids[@]} >= 2 )); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for f in "$2"/*.ptx; do
    grep -v '^[[:space:]]*\.loc\|^[[:space:]]*\.file\|^//' "$f" |
      sed -E 's/[0-9a-f]{8}_[0-9]+_[A-Za-z0-9_]+_cu_[0-9a-f]{8}_[0-9]+/H/g' > "$f.clean"
  done
}
ptx "$work/src" "$work/ptx_old"
for r in "${renames[@]}"; do
  old=${r%%=*}
  new=${r#*=}
  sed -i "s/${#old}${old}/${#new}${new}/g" "$work"/ptx_old/*.clean
done
rm -rf "$work/src"
mkdir -p "$work/src"
cp -r include tests benchmarks "$work/src/"
ptx "$work/src" "$work/ptx_new"
status=0
for u in "${units[@]}"; do
  b=$(basename "$u" .cu)
  if cmp -s "$work/ptx_old/$b.ptx.clean" "$work/ptx_new/$b.ptx.clean"; then
    echo "same PTX: $u"
  else
    echo "PTX DIFFERS: $u ($(diff "$work/ptx_old/$b.ptx.clean" "$work/ptx_new/$b.ptx.clean" | grep -c '^[<>]') lines)"
    # Kernel by kernel: which entries (and device functions) changed, were added or removed.
    python3 scripts/ptx_entries.py "$work/ptx_old/$b.ptx.clean" "$work/ptx_new/$b.ptx.clean" || true
    status=1
  fi
done
exit $status
