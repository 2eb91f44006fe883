#!/usr/bin/env bash
# Build, on a machine without a GPU, everything the first GPU run needs, so that run spends its minutes on the card:
# the device tests and the device benchmark for sm_90 (H100/H200), GoogleTest linked statically, the libraries the
# GPU image may lack carried in gpu-bundle/lib, scripts/gpu_table.py, and gpu-bundle/run.sh (scripts/gpu_run.sh).
#
#   bash scripts/gpu_bundle.sh            # build dir build-gpu-bundle/, bundle gpu-bundle/ (both git-ignored)
#   JOBS=8 CUDA_ARCH=90 bash scripts/gpu_bundle.sh
#   FROM_BUILD=build bash scripts/gpu_bundle.sh  # configure and build nothing: bundle the device binaries an existing
#                                                # build folder holds (CI's rehearsal reuses the README build's)
#
# Fails loudly when a binary needs a library outside the list the GPU image has (libc, libstdc++, libm, libgcc_s,
# libdl, libpthread, librt, the loader, libcudart, libcublas(Lt), libnccl) that is not carried in gpu-bundle/lib, or
# when the bundle is over 48 MiB. Then, on the GPU machine: bash gpu-bundle/run.sh [OUT_DIR] (see docs/performance.md).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=${BUILD_DIR:-build-gpu-bundle}
bundle=${BUNDLE_DIR:-gpu-bundle}
arch=${CUDA_ARCH:-90}
jobs=${JOBS:-2}
limit_mib=48
t0=$SECONDS
die() {
  echo "gpu_bundle.sh: FAILED: $*" >&2
  exit 1
}

from=${FROM_BUILD:-}
targets=(device_test device_chunked_test contrastive_device_bench)
if [ -n "$from" ]; then
  [ -f "$from/CMakeCache.txt" ] || die "FROM_BUILD=$from is not a configured build folder (no CMakeCache.txt)"
  build=$from
  grep -q '^CONTRASTIVE_ENABLE_CUDA:BOOL=ON' "$from/CMakeCache.txt" ||
    die "FROM_BUILD=$from was configured without CUDA (CONTRASTIVE_ENABLE_CUDA is not ON)"
  # The architectures the device test was compiled for, from its flags (the project sets its default in CMakeLists).
  # (Makefiles keep them in flags.make, Ninja in build.ninja.)
  arch=$(cat "$from"/tests/CMakeFiles/device_test.dir/flags.make "$from"/build.ninja 2>/dev/null |
    grep -o 'arch=compute_[0-9]*' | sed 's/.*_//' | sort -un | tr '\n' ' ' | sed 's/ $//' || true)
  [ -n "$arch" ] || arch="(not found in $from's build files)"
  echo "== the device binaries already built in $from (CUDA architectures $arch): nothing configured or built"
else
  generator=()
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  [ -f "$build/CMakeCache.txt" ] && generator=() # keep the generator the folder was made with
  echo "== configure $build (CUDA architectures $arch)"
  # PRE_TEST discovery: the test binaries are not run at build time (no GPU here; the lists are read when ctest runs).
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCONTRASTIVE_ENABLE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" -DCONTRASTIVE_BUILD_TESTS=ON -DCONTRASTIVE_BUILD_BENCHMARKS=ON \
    -DCONTRASTIVE_BUILD_EXAMPLES=OFF -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST >"$build.configure.log" 2>&1 ||
    {
      tail -30 "$build.configure.log"
      die "configure (log: $build.configure.log)"
    }
  rm -f "$build.configure.log"
fi

# The device targets only (not the host suite, not the examples). The NCCL test exists where CMake found NCCL.
if cmake --build "$build" --target help 2>/dev/null | grep -q 'device_distributed_test'; then
  targets+=(device_distributed_test)
else
  echo "note: device_distributed_test is not a target (no NCCL found at configure): the bundle's NCCL step will SKIP"
fi
if [ -z "$from" ]; then
  echo "== build ${targets[*]} (-j$jobs)"
  cmake --build "$build" -j"$jobs" --target "${targets[@]}" || die "build"
fi

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib"
for t in "${targets[@]}"; do
  f=$(find "$build" -type f -name "$t" -perm -u+x | head -1)
  [ -n "$f" ] || die "$t is a target but no built $t is under $build${from:+ (build it there first)}"
  cp "$f" "$bundle/bin/"
done
cp scripts/gpu_table.py "$bundle/"
cp scripts/gpu_run.sh "$bundle/run.sh"
chmod +x "$bundle/run.sh" "$bundle/gpu_table.py"

# What the GPU image is known to have (KINDS.md, H200.md: CUDA 13.0 toolkit, the nvidia-* pip wheels, glibc).
allowed='^(linux-vdso\.so\.1|ld-linux-x86-64\.so\.2|/lib64/ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libstdc\+\+\.so\.6|libgcc_s\.so\.1|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1|libcudart\.so\.[0-9]+|libcublas\.so\.[0-9]+|libcublasLt\.so\.[0-9]+|libnccl\.so\.[0-9]+)$'
deps() { ldd "$1" | awk '/=>/ {print $1, $3; next} {print $1, "-"}'; }
# First pass: carry what is neither allowed nor a static link (Google Benchmark: Debian ships no libbenchmark.a).
for b in "$bundle"/bin/*; do
  while read -r name path; do
    [[ $name =~ $allowed ]] && continue
    [ "$path" = "not" ] && die "$(basename "$b") needs $name, which is not found here (ldd)"
    if [ -f "$path" ] && [ ! -e "$bundle/lib/$name" ]; then
      echo "carry $name ($path: no static library here) in $bundle/lib"
      cp -L "$path" "$bundle/lib/$name"
    fi
  done < <(deps "$b")
done
# Second pass, loud: every binary and carried library needs only allowed names or carried ones.
bad=0
: >"$bundle/needed.txt"
for b in "$bundle"/bin/* "$bundle"/lib/*; do
  [ -f "$b" ] || continue
  echo "ldd $(basename "$b"):" "$(LD_LIBRARY_PATH="$root/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" deps "$b" |
    awk '{print $1}' | grep -vE '^(linux-vdso|/lib64)' | tr '\n' ' ')"
  while read -r name path; do
    [ "$path" = "not" ] && {
      echo "  MISSING: $name" >&2
      bad=1
      continue
    }
    [[ $name =~ $allowed ]] || [ -e "$bundle/lib/$name" ] || {
      echo "  NOT ALLOWED: $name ($path)" >&2
      bad=1
    }
    case $name in libcudart* | libcublas* | libnccl* | libbenchmark*) echo "$name" >>"$bundle/needed.txt" ;; esac
  done < <(LD_LIBRARY_PATH="$root/$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" deps "$b")
done
sort -u -o "$bundle/needed.txt" "$bundle/needed.txt"
[ "$bad" -eq 0 ] || die "a binary needs a library the GPU image lacks (above)"

# GoogleTest's sources, for a rebuild there if a binary does not start (no GoogleTest on that image). Google
# Benchmark's sources are not on this machine (Debian ships only libbenchmark.so): its library is carried above.
if [ -d /usr/src/googletest ]; then
  mkdir -p "$bundle/src"
  tar -C /usr/src -czf "$bundle/src/googletest.tar.gz" googletest
fi

{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo '+dirty')"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n), $(ldd --version | head -1)"
  echo "cuda $(nvcc --version 2>/dev/null | grep -oE 'release [0-9.]+' || echo '?'), CMAKE_CUDA_ARCHITECTURES=$arch"
  echo "needs GLIBC <= $(for b in "$bundle"/bin/* "$bundle"/lib/*; do objdump -T "$b" 2>/dev/null; done |
    grep -oE 'GLIBC_[0-9.]+' | sort -uV | tail -1), $(for b in "$bundle"/bin/* "$bundle"/lib/*; do
      objdump -T "$b" 2>/dev/null
    done | grep -oE 'GLIBCXX_[0-9.]+' | sort -uV | tail -1)"
} >"$bundle/MANIFEST"

bytes=$(du -sb "$bundle" | cut -f1)
mib=$(((bytes + 1048575) / 1048576))
echo "== $bundle: $(find "$bundle" -type f | wc -l) files, $bytes bytes ($mib MiB of $limit_mib), $((SECONDS - t0)) s"
(cd "$bundle" && find . -type f -printf '%8s  %p\n' | sort -k2)
[ "$bytes" -le $((limit_mib * 1048576)) ] || die "bundle is $mib MiB, over $limit_mib"
echo "on the GPU machine: bash $bundle/run.sh [OUT_DIR]   (rehearse here: bash $bundle/run.sh --dry-run)"
