# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The compiled parts: the host extension (contrastive_torch._C, or built on first use from csrc/binding.cpp) and the
CUDA extension (contrastive_torch._C_cuda, or built with nvcc on first use from csrc/binding_cuda.cu).

`pip install --no-build-isolation ./python` builds both at install time. From a source checkout on sys.path they are
compiled on first use with torch.utils.cpp_extension and cached in torch's extension directory (TORCH_EXTENSIONS_DIR);
on 2 cores the host extension's first build takes about two minutes, and again after the library's headers changed
(the builds carry their digest, `headers_digest`). Processes that build at once (the ranks of a
torchrun job with a cold cache) wait for one build under torch's lock file; the distributed losses build in their
constructor, before their first collective, so no rank sits in a collective while another compiles.
"""

import os
import re
import sys
import threading

import torch

from . import _cpu

_HERE = os.path.dirname(os.path.abspath(__file__))
# An installed package carries the headers (setup.py copies them); a source checkout has them two levels up.
_PACKAGED_INCLUDE = os.path.join(_HERE, "include")
_REPO_INCLUDE = os.path.normpath(os.path.join(_HERE, "..", "..", "include"))
_loaded = {}
_lock = threading.Lock()


def torch_version():
    """(major, minor) of the running PyTorch."""
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


# torch.library.custom_op / register_fake / register_autograd / register_kernel appeared in PyTorch 2.4. The loss runs
# through those operators only: older PyTorch (Debian's 1.13) can import the package but not run a loss.
HAS_CUSTOM_OPS = torch_version() >= (2, 4) and all(
    hasattr(torch.library, f) for f in ("custom_op", "register_fake", "register_autograd"))


def require_custom_ops():
    if not HAS_CUSTOM_OPS:
        raise RuntimeError(f"contrastive_torch needs PyTorch >= 2.4 (torch.library.custom_op); this is "
                           f"{torch.__version__}")


def _std_flags():
    """The C++ standard is PyTorch's builder's choice (C++17 from PyTorch 2.1, C++20 from 2.13, whose headers need
    it); only older PyTorch, whose builder passes -std=c++14, is given the library's C++17."""
    return ["-std=c++17"] if torch_version() < (2, 1) else []


def _include_dir():
    if "CONTRASTIVE_INCLUDE" in os.environ:
        return os.environ["CONTRASTIVE_INCLUDE"]
    if os.path.isfile(os.path.join(_PACKAGED_INCLUDE, "contrastive", "contrastive.hpp")):
        return _PACKAGED_INCLUDE
    return _REPO_INCLUDE


def _prebuilt(name):
    """The extension `pip install` built (contrastive_torch._C / _C_cuda), or None in a source checkout.
    CONTRASTIVE_TORCH_JIT=1 ignores it and compiles on first use instead."""
    if os.environ.get("CONTRASTIVE_TORCH_JIT") == "1":
        return None
    import importlib

    try:
        return importlib.import_module(f"contrastive_torch.{name}")
    except ImportError:
        return None


def installed_isa_lacking(path=None):
    """The instruction-set extensions the installed CPU extension was compiled for (-march=native where pip built it:
    the NATIVE_ISA file setup.py writes beside this module) that this CPU lacks; [] where there is no such file (a
    portable build, a source checkout) or this CPU's set is unknown."""
    try:
        with open(path or os.path.join(_HERE, "NATIVE_ISA")) as f:
            required = f.read().split()
    except OSError:
        return []
    return _cpu.lacking(required)


def headers_digest(include_dir=None):
    """A digest of the library's headers (names and contents; default: those the builds include). The builds compiled
    on first use carry it as a define: torch's extension cache rebuilds when the sources or the flags change, and the
    headers are neither, so a checkout whose headers changed (a `git pull`) would otherwise keep loading a build of the
    old ones."""
    import hashlib

    root = include_dir or _include_dir()
    h = hashlib.sha1()
    for folder, subfolders, files in os.walk(root):
        subfolders.sort()
        for name in sorted(files):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def _digest_flag():
    return [f"-DCONTRASTIVE_HEADERS_DIGEST={headers_digest()}"]


def _native():
    return os.environ.get("CONTRASTIVE_NATIVE", "1") != "0"


def checkout_tag():
    """A digest of where the headers the builds include live: each checkout (or installed copy) of the library has
    its own builds in torch's extension cache, so two on one machine do not rebuild over each other (and wait on
    each other's lock)."""
    import hashlib

    return hashlib.sha1(os.path.realpath(_include_dir()).encode()).hexdigest()[:8]


def host_build_name():
    """The compile-on-first-use build's name in torch's extension cache: one per CPU instruction-set set where it is
    compiled with -march=native (a cache shared by machines of different CPUs keeps one build for each), else one;
    and one per checkout (`checkout_tag`)."""
    return "contrastive_torch_ext" + (f"_{_cpu.build_tag()}" if _native() else "") + f"_{checkout_tag()}"


def cuda_build_name():
    """The CUDA extension's compile-on-first-use build's name: one per checkout (`checkout_tag`)."""
    return f"contrastive_torch_cuda_ext_{checkout_tag()}"


def _announce(what, name):
    """One line on stderr before a build that may take minutes: silent when torch's cache holds a build of these
    headers (its build.ninja carries their digest), whose load takes about a second."""
    rebuild = False
    try:
        from torch.utils.cpp_extension import _get_build_directory

        folder = _get_build_directory(name, False)
        if any(f.startswith(name) and f.endswith(".so") for f in os.listdir(folder)):
            with open(os.path.join(folder, "build.ninja")) as f:
                if _digest_flag()[0] in f.read():
                    return
            rebuild = True
    except Exception:  # noqa: BLE001 - a private helper of torch's, or no build yet: say it
        pass
    if os.environ.get("CONTRASTIVE_TORCH_QUIET") != "1":
        why = f"rebuilding the {what} (the library's headers changed; " if rebuild else f"loading the {what} ("
        print(f"contrastive_torch: {why}compiled on first use, then cached; `pip install --no-build-isolation "
              "./python` builds it ahead of time)", file=sys.stderr, flush=True)


def _build(name, **kwargs):
    from torch.utils import cpp_extension

    return cpp_extension.load(name=name, verbose=os.environ.get("CONTRASTIVE_VERBOSE_BUILD") == "1", **kwargs)


def extension():
    """The compiled host extension: the one `pip install` built, else compiled on first call (also where the
    installed one was compiled with -march=native on a CPU with instructions this one lacks)."""
    with _lock:
        if "host" not in _loaded:
            missing = installed_isa_lacking()
            if missing:
                # Loading it would end the process at its first such instruction.
                print(f"contrastive_torch: the installed CPU extension was compiled with -march=native on a CPU with "
                      f"{', '.join(missing)}, which this CPU lacks: compiling one for this CPU instead (reinstall "
                      "here, or install with CONTRASTIVE_NATIVE=0 for a build any x86-64 CPU runs)", file=sys.stderr,
                      flush=True)
            ext = None if missing else _prebuilt("_C")
            if ext is None:
                from torch.utils import cpp_extension

                name = host_build_name()
                _announce("host extension", name)
                cuda = os.environ.get("CUDA_HOME") or cpp_extension.CUDA_HOME or "/usr/local/cuda"
                flags = ["-O3", "-DNDEBUG"] + _std_flags() + _digest_flag()
                if _native():
                    flags.append("-march=native")
                ext = _build(name, sources=[os.path.join(_HERE, "csrc", "binding.cpp")],
                             extra_include_paths=[_include_dir(), os.path.join(cuda, "include")], extra_cflags=flags)
            _loaded["host"] = ext
    return _loaded["host"]


def cuda_extension():
    """The compiled device extension: the one `pip install` built, else built with nvcc on first call (needs PyTorch
    with CUDA)."""
    with _lock:
        if "cuda" not in _loaded:
            ext = _prebuilt("_C_cuda")
            if ext is None:
                if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
                    # torch picks the architectures from the visible GPUs; with none its builder fails (IndexError).
                    raise RuntimeError("contrastive_torch: no GPU is visible to choose the CUDA architectures to "
                                       "compile the CUDA extension for: set TORCH_CUDA_ARCH_LIST (e.g. 9.0)")
                name = cuda_build_name()
                _announce("CUDA extension", name)
                ext = _build(name, sources=[os.path.join(_HERE, "csrc", "binding_cuda.cu")],
                             extra_include_paths=[_include_dir()],
                             extra_cflags=["-O3", "-DNDEBUG"] + _std_flags() + _digest_flag(),
                             extra_cuda_cflags=["-O3", "-DNDEBUG", "--expt-relaxed-constexpr"] + _std_flags()
                             + _digest_flag(),
                             extra_ldflags=["-lcublas"])
            _loaded["cuda"] = ext
    return _loaded["cuda"]

