# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Builds contrastive_torch ahead of time: the CPU extension (contrastive_torch._C), the CUDA extension
(contrastive_torch._C_cuda) when torch has CUDA, and the library's headers as package data (for the on-first-use
fallback and for users who compile against them).

    pip install --no-build-isolation ./python
    CONTRASTIVE_NATIVE=0 pip wheel --no-build-isolation --no-deps ./python -w dist     # portable wheel
    python setup.py sdist     # a source distribution carrying the headers and VERSION: it installs on its own

Options: see README.md beside this file (CUDA_HOME, CONTRASTIVE_NATIVE, CONTRASTIVE_TORCH_CUDA).
"""

import importlib.util
import os
import re
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("contrastive_torch: setup.py needs torch installed first, and pip's --no-build-isolation so that the "
             "extension is built against it (pip install --no-build-isolation ./python)")

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGED_INCLUDE = os.path.join(HERE, "contrastive_torch", "include")
REPO_INCLUDE = os.path.normpath(os.path.join(HERE, "..", "include"))
REPO_VERSION = os.path.normpath(os.path.join(HERE, "..", "VERSION"))
PACKAGED_VERSION = os.path.join(HERE, "contrastive_torch", "VERSION")


def version():
    """The project's one version number: the repository's VERSION file (CMake reads it too), else an sdist's copy."""
    for path in (REPO_VERSION, PACKAGED_VERSION):
        if os.path.isfile(path):
            with open(path) as f:
                return f.read().strip()
    sys.exit(f"contrastive_torch: no VERSION file at {REPO_VERSION} or {PACKAGED_VERSION}")


def headers_dir():
    """The library's include/ (repository checkout), else the copy an sdist carries."""
    for d in (REPO_INCLUDE, PACKAGED_INCLUDE):
        if os.path.isfile(os.path.join(d, "contrastive", "contrastive.hpp")):
            return d
    sys.exit(f"contrastive_torch: the library's headers are neither in {REPO_INCLUDE} nor in {PACKAGED_INCLUDE}")


def native():
    """Whether the CPU extension is compiled with -march=native (CONTRASTIVE_NATIVE, default 1)."""
    return os.environ.get("CONTRASTIVE_NATIVE", "1") != "0"


def building_cpu_isa():
    """This CPU's instruction-set extensions, as contrastive_torch/_cpu.py reads them (loaded from the source tree:
    the package itself is not importable before it is built)."""
    path = os.path.join(HERE, "contrastive_torch", "_cpu.py")
    spec = importlib.util.spec_from_file_location("_contrastive_cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cpu_isa()


def cuda_home():
    home = os.environ.get("CUDA_HOME") or cpp_extension.CUDA_HOME or "/usr/local/cuda"
    if not os.path.isfile(os.path.join(home, "include", "cuda_fp16.h")):
        sys.exit(f"contrastive_torch: no cuda_fp16.h under {home}/include: the 16-bit types come from the CUDA "
                 "Toolkit's headers, also for the CPU extension; set CUDA_HOME")
    return home


def want_cuda():
    mode = os.environ.get("CONTRASTIVE_TORCH_CUDA", "auto")
    if mode not in ("auto", "0", "1"):
        sys.exit(f"contrastive_torch: CONTRASTIVE_TORCH_CUDA={mode!r}: expected auto, 0 or 1")
    if mode == "0":
        return False
    has = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if mode == "1" and not has:
        sys.exit("contrastive_torch: CONTRASTIVE_TORCH_CUDA=1 but torch has no CUDA or nvcc was not found")
    if has and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # torch picks the architectures from the visible GPUs: with none, its builder fails (an IndexError).
        if mode == "1":
            sys.exit("contrastive_torch: CONTRASTIVE_TORCH_CUDA=1 on a machine without a visible GPU: set "
                     "TORCH_CUDA_ARCH_LIST to the architectures to compile for (e.g. 9.0 for H100/H200)")
        print("contrastive_torch: no GPU visible and TORCH_CUDA_ARCH_LIST unset: building the CPU extension only "
              "(the CUDA one compiles on first use on a GPU machine; set TORCH_CUDA_ARCH_LIST, e.g. 9.0, to build it "
              "here)", file=sys.stderr)
        return False
    return has


class build_py_with_headers(build_py):
    """Copies include/contrastive and VERSION into the package, so an installed contrastive_torch carries the headers
    and knows its version."""

    def run(self):
        super().run()
        src = os.path.join(headers_dir(), "contrastive")
        dst = os.path.join(self.build_lib, "contrastive_torch", "include", "contrastive")
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)
        with open(os.path.join(self.build_lib, "contrastive_torch", "VERSION"), "w") as f:
            f.write(version() + "\n")


class sdist_with_headers(sdist):
    """A source distribution that builds on its own: the library's headers and VERSION, which live beside python/ in
    the repository, go into its contrastive_torch/ (where headers_dir() and version() look when there is no
    repository around)."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        package = os.path.join(base_dir, "contrastive_torch")
        shutil.copytree(os.path.join(headers_dir(), "contrastive"), os.path.join(package, "include", "contrastive"),
                        dirs_exist_ok=True)
        with open(os.path.join(package, "VERSION"), "w") as f:
            f.write(version() + "\n")


class build_ext_recording_isa(cpp_extension.BuildExtension.with_options(use_ninja=False)):
    """PyTorch's extension build, which also writes NATIVE_ISA beside the extensions: the building CPU's
    instruction-set extensions where the CPU extension is compiled with -march=native (absent for a portable build),
    which the package checks before it loads that extension on another machine (contrastive_torch/_cpu.py). setuptools
    keeps an extension newer than its sources, whatever its flags or the CPU that compiled it: so a build directory
    whose last build had another record (another CPU, or CONTRASTIVE_NATIVE changed) is rebuilt, and the record always
    describes the extension beside it."""

    def run(self):
        isa = building_cpu_isa() if native() else None
        record = "" if isa is None else " ".join(sorted(isa)) + "\n"
        stamp = os.path.join(self.build_temp, "contrastive_native_isa")
        try:
            with open(stamp) as f:
                previous = f.read()
        except OSError:
            previous = None
        if previous != "native " + record:
            self.force = True
        super().run()
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as f:
            f.write("native " + record)
        package = os.path.join(HERE, "contrastive_torch") if self.inplace else os.path.join(self.build_lib,
                                                                                            "contrastive_torch")
        isa_file = os.path.join(package, "NATIVE_ISA")
        if isa is None:
            if os.path.exists(isa_file):
                os.remove(isa_file)
        else:
            os.makedirs(package, exist_ok=True)
            with open(isa_file, "w") as f:
                f.write(record)


include = headers_dir()
cuda = cuda_home()
# The C++ standard is PyTorch's builder's choice (C++17 from 2.1, C++20 from 2.13, whose headers need it); only an older
# PyTorch, whose builder passes -std=c++14, is given the library's C++17.
_torch_major_minor = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
std_flags = ["-std=c++17"] if _torch_major_minor < (2, 1) else []
cxx_flags = ["-O3", "-DNDEBUG"] + std_flags
if native():
    cxx_flags.append("-march=native")
ext_modules = [
    cpp_extension.CppExtension(
        "contrastive_torch._C",
        [os.path.join("contrastive_torch", "csrc", "binding.cpp")],
        include_dirs=[include, os.path.join(cuda, "include")],
        extra_compile_args=cxx_flags,
    )
]
if want_cuda():
    ext_modules.append(
        cpp_extension.CUDAExtension(
            "contrastive_torch._C_cuda",
            [os.path.join("contrastive_torch", "csrc", "binding_cuda.cu")],
            include_dirs=[include],
            libraries=["cublas"],
            extra_compile_args={
                "cxx": ["-O3", "-DNDEBUG"] + std_flags,
                "nvcc": ["-O3", "-DNDEBUG", "--expt-relaxed-constexpr"] + std_flags,
            },
        ))

setup(
    version=version(),
    ext_modules=ext_modules,
    cmdclass={"build_py": build_py_with_headers, "build_ext": build_ext_recording_isa, "sdist": sdist_with_headers},
)
