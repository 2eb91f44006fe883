#!/usr/bin/env bash
# Installs what one of the README's two commands needs on Debian 12, and nothing that is already there.
#
#   bash scripts/setup.sh demo   # the main job: compiler, CMake, GoogleTest, Google Benchmark, gnuplot (the figure)
#   bash scripts/setup.sh test   # the test command: the same, plus what the optional test suites need
#
# Idempotent: a package is installed (apt-get install -y, with sudo when not root) only when dpkg does not list it as
# installed, so a machine that has everything runs no apt-get at all. The CUDA Toolkit (headers for the 16-bit types,
# nvcc for the device path) is expected at /usr/local/cuda and is not installed here.
set -euo pipefail

demo_packages=(build-essential cmake libgtest-dev libbenchmark-dev gnuplot-nox)
# Optional for library users; the test command builds and runs these suites when they are present:
#   clang            the libFuzzer target (.ci/run's fuzz stage)
#   libopenblas-dev  the gemm::cblas backend and its tests
#   python3-torch, python3-pytest   the PyTorch extension's tests (python/tests)
#   python3-venv, python3-setuptools, python3-wheel   the extension's install test (pip install into a fresh venv
#                    that sees the system's torch; --no-build-isolation builds with the system's setuptools and wheel)
#   libopenmpi-dev, openmpi-bin     the MPI tests
test_packages=("${demo_packages[@]}" clang libopenblas-dev python3-torch python3-pytest python3-venv python3-setuptools python3-wheel
  libopenmpi-dev openmpi-bin)

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
  exit 0
fi

as_root=()
if [ "$(id -u)" -ne 0 ]; then
  as_root=(sudo)
fi
echo "setup.sh $1: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update
"${as_root[@]}" apt-get install -y "${missing[@]}"
