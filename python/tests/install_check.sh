#!/usr/bin/env bash
# The README's install line, checked: pip-installs contrastive_torch from this checkout into a fresh virtual
# environment that sees the system's torch, then runs the test suite from outside the source tree against the
# installed package (its prebuilt extension, its packaged headers).
#
#   bash python/tests/install_check.sh /usr/bin/python3 <scratch dir>
#
# Offline: --no-deps --no-index (torch comes from the system site-packages, nothing is downloaded).
set -euo pipefail
py=${1:?python with torch and pytest}
work=${2:?scratch directory}
src=$(cd "$(dirname "$0")/.." && pwd)

# Build from a copy (python/ and include/ side by side, as in the repository), so setuptools' build/ and egg-info land
# in the scratch directory, never in the checkout, and every run compiles afresh against the current headers.
rm -rf "$work/venv" "$work/src"
mkdir -p "$work/src"
cp -r "$src" "$work/src/python"
cp -r "$src/../include" "$work/src/include"
rm -rf "$work/src/python/build" "$work/src/python"/*.egg-info
"$py" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-build-isolation --no-deps --no-index "$work/src/python"
cd "$work"
"$work/venv/bin/python" - "$work/venv" <<'PY'
import os, sys
import contrastive_torch as ct
venv = os.path.realpath(sys.argv[1])
assert os.path.realpath(ct.__file__).startswith(venv), f"imported {ct.__file__}, not the installed package"
ext = ct.extension()
assert ext.__name__ == "contrastive_torch._C", f"extension {ext.__name__}: not the one pip built"
assert os.path.isfile(os.path.join(os.path.dirname(ct.__file__), "include", "contrastive", "contrastive.hpp"))
for src in ("binding.cpp", "binding_cuda.cu", "problem_of.hpp"):  # the on-first-use build's sources
    assert os.path.isfile(os.path.join(os.path.dirname(ct.__file__), "csrc", src)), f"csrc/{src} not installed"
print(f"installed: {ct.__file__}; extension {ext.__file__}")
PY
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider "$src/tests"
