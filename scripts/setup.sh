#!/usr/bin/env bash
# Installs what one of the README's two commands needs on Debian 12, and nothing that is already there.
#
#   bash scripts/setup.sh demo   # the main job: compiler, CMake, GoogleTest, Google Benchmark, gnuplot (the figure)
#   bash scripts/setup.sh test   # the test command: the same, plus what the optional test suites need, and the
#                                # PyTorch venv .venv-torch/ (below)
#
# Idempotent: a package is installed (apt-get install -y, with sudo when not root) only when dpkg does not list it as
# installed, so a machine that has everything runs no apt-get at all. The CUDA Toolkit (headers for the 16-bit types,
# nvcc for the device path) is expected at /usr/local/cuda and is not installed here.
#
# `test` also makes a git-ignored virtual environment, .venv-torch/ at the repository root (CONTRASTIVE_TORCH_VENV
# moves it; then configure with -DCONTRASTIVE_TORCH_PYTHON=<venv>/bin/python), with the current PyPI torch, pytest,
# numpy, open-clip-torch and the two packages its training program (open_clip_train) imports beyond it, webdataset and
# pandas (open-clip-torch[training] without transformers, which the tests do not use): the PyTorch extension's tests
# run there
# (tests/CMakeLists.txt finds it). PyPI's default Linux torch wheel brings CUDA's libraries, about 5.5 GB on disk and
# 1-4 minutes to install; a CPU-only wheel index is not used (a machine that reaches only PyPI cannot get it). When the
# venv already imports all of them, nothing is installed. CONTRASTIVE_TORCH_SPEC (default `torch`) picks another torch,
# e.g. CONTRASTIVE_TORCH_SPEC='torch==2.11.*'.
set -euo pipefail

demo_packages=(build-essential cmake libgtest-dev libbenchmark-dev gnuplot-nox)
# Optional for library users; the test command builds and runs these suites when they are present:
#   clang            the libFuzzer target (.ci/run's fuzz stage)
#   libopenblas-dev  the gemm::cblas backend and its tests
#   python3-venv, python3-dev, ninja-build   the PyTorch venv (/usr/bin/python3 -m venv), Python.h (the extension's build
#                    and torch.compile's generated C++ compile against it) and ninja (the on-first-use build)
#                    and torch.compile's C++ code generation (inductor) compile against
#   libopenmpi-dev, openmpi-bin     the MPI tests
#   doxygen          the C++ API reference and its check (scripts/api_reference.sh, ctest docs.api_reference)
test_packages=("${demo_packages[@]}" clang libopenblas-dev python3-venv python3-dev ninja-build libopenmpi-dev openmpi-bin
  doxygen)

case "${1:-}" in
  demo) wanted=("${demo_packages[@]}") ;;
  test) wanted=("${test_packages[@]}") ;;
  *)
    echo "usage: bash scripts/setup.sh demo|test" >&2
    exit 2
    ;;
esac

missing=()
for p in "${wanted[@]}"; do
  if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" != "install ok installed" ]; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "setup.sh $1: all ${#wanted[@]} packages present"
else
  as_root=()
  if [ "$(id -u)" -ne 0 ]; then
    as_root=(sudo)
  fi
  echo "setup.sh $1: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${as_root[@]}" apt-get update
  "${as_root[@]}" apt-get install -y "${missing[@]}"
fi

[ "$1" = test ] || exit 0

# The PyTorch venv. setuptools >= 77 and --no-build-isolation: the install test builds the package against this torch.
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${CONTRASTIVE_TORCH_VENV:-$root/.venv-torch}
probe='import torch, pytest, numpy, open_clip, webdataset, pandas, setuptools
print("torch", torch.__version__, "open_clip", open_clip.__version__)'
if [ -x "$venv/bin/python" ] && have=$("$venv/bin/python" -c "$probe" 2>/dev/null); then
  echo "setup.sh test: $venv present ($have)"
  exit 0
fi
echo "setup.sh test: making $venv (${CONTRASTIVE_TORCH_SPEC:-torch} from PyPI, with pytest, numpy, open-clip-torch," \
  "webdataset, pandas)"
/usr/bin/python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "${CONTRASTIVE_TORCH_SPEC:-torch}" pytest numpy open-clip-torch \
  "webdataset>=0.2.5,<=0.2.86" pandas "setuptools>=77"
echo "setup.sh test: $("$venv/bin/python" -c "$probe")"
