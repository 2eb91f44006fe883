#!/usr/bin/env bash
# The README's install line, checked: pip-installs contrastive_torch from this checkout into a fresh virtual
# environment that sees the given Python's torch, then runs the tests of what installing can break (below) from outside
# the source tree against the installed package (its prebuilt extension(s), its packaged headers).
#
#   bash python/tests/install_check.sh .venv-torch/bin/python <scratch dir>
#
# The fresh venv is made from the given Python's base interpreter; a .pth file puts the given Python's site-packages
# (torch, pytest, open_clip, setuptools) after its own, so the package installed there is the one imported. Offline:
# --no-deps --no-index (nothing is downloaded). CONTRASTIVE_TORCH_CUDA=1 (tests/CMakeLists.txt sets it where nvcc
# and a CUDA torch exist) makes the install build the CUDA extension too, with PyTorch's flags for the architectures in
# TORCH_CUDA_ARCH_LIST; it is then imported (loading it needs no GPU) but not run.
set -euo pipefail
py=${1:?python with torch and pytest}
work=${2:?scratch directory}
src=$(cd "$(dirname "$0")/.." && pwd)

# Build from a copy (python/, include/ and VERSION side by side, as in the repository), so setuptools' build/ and egg-info land
# in the scratch directory, never in the checkout, and every run compiles afresh against the current headers.
rm -rf "$work/venv" "$work/src"
mkdir -p "$work/src"
cp -r "$src" "$work/src/python"
cp -r "$src/../include" "$work/src/include"
cp "$src/../VERSION" "$work/src/VERSION"
rm -rf "$work/src/python/build" "$work/src/python"/*.egg-info
"$py" -m venv --without-pip "$work/venv"   # pip and setuptools come from the given Python, through the .pth
site_of() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
site_of "$py" >"$(site_of "$work/venv/bin/python")/contrastive-torch-deps.pth"
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
for src in ("binding.cpp", "binding_cuda.cu", "errors.hpp", "problem_of.hpp", "torch_comm.hpp"):  # the on-first-use build's sources
    assert os.path.isfile(os.path.join(os.path.dirname(ct.__file__), "csrc", src)), f"csrc/{src} not installed"
# -march=native (the default): the building CPU's instruction sets recorded beside the extension, which this CPU has.
from contrastive_torch import _cpu, _extension
isa_file = os.path.join(os.path.dirname(ct.__file__), "NATIVE_ISA")
if os.environ.get("CONTRASTIVE_NATIVE", "1") != "0" and _cpu.cpu_isa() is not None:
    with open(isa_file) as f:
        assert frozenset(f.read().split()) == _cpu.cpu_isa(), "NATIVE_ISA is not this CPU's set"
    assert _extension.installed_isa_lacking() == []
if os.environ.get("CONTRASTIVE_TORCH_CUDA") == "1":
    import importlib
    cuda = importlib.import_module("contrastive_torch._C_cuda")  # built by pip (with nvcc), loads without a GPU
    for fn in ("step", "sigmoid_step"):
        assert hasattr(cuda, fn), f"contrastive_torch._C_cuda has no {fn}()"
    print(f"CUDA extension built and loaded: {cuda.__file__}")
print(f"installed: {ct.__file__}; extension {ext.__file__}; torch {ct.torch.__version__}")
PY
# Against the installed package, the tests of what installing can break: its prebuilt extension(s), its packaged
# headers, the operators (opcheck, values, refusals, autocast), the modules, open_clip's loss and 2 gloo ranks. The
# build tree's run covers the rest on the same sources: 4 ranks, the torch.compile training steps (inductor compiles
# C++ for each: about a minute), open_clip's training program (about 70 s) and the GPU side-by-side script's dry run.
# (The whole suite a second time would make this the longest test in CI.)
CONTRASTIVE_TORCH_DIST_WORLDS=${CONTRASTIVE_TORCH_DIST_WORLDS:-2} "$work/venv/bin/python" -m pytest -q \
  -p no:cacheprovider -k "not compiled" --ignore="$src/tests/test_open_clip_train.py" \
  --ignore="$src/tests/test_side_by_side.py" "$src/tests"
