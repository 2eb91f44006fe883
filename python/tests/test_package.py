# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The package's public surface: one version number with CMake, and every name in __all__ importable; the CPU
extension kept to the CPUs it was compiled for."""

import os
import re

import pytest
import torch

import contrastive_torch as ct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_one_version_for_cmake_and_python():
    with open(os.path.join(ROOT, "VERSION")) as f:
        version = f.read().strip()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert ct.__version__ == version
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        cmake = f.read()
    assert 'file(STRINGS "${CMAKE_CURRENT_SOURCE_DIR}/VERSION" contrastive_version' in cmake
    assert "project(contrastive VERSION ${contrastive_version}" in cmake


def test_every_public_name_exists():
    for name in ct.__all__:
        assert getattr(ct, name) is not None, name
    for name in ct.temperature.__all__:
        assert getattr(ct.temperature, name) is not None, name


def test_every_public_name_has_a_docstring():
    # The Python half of the API reference: what a user imports (the package's, functional's and temperature's
    # __all__) and the public methods and properties of its classes say what they do.
    import inspect

    missing = []
    for module in (ct, ct.functional, ct.temperature):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not callable(obj):
                continue
            if not (obj.__doc__ or "").strip():
                missing.append(f"{module.__name__}.{name}")
            if inspect.isclass(obj):
                for attr, value in vars(obj).items():
                    if not attr.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
                        if not (value.__doc__ or "").strip():
                            missing.append(f"{module.__name__}.{name}.{attr}")
    assert not missing, f"public names without a docstring: {missing}"


def test_the_python_reference_is_current(tmp_path):
    # docs/api/python.md is generated from the docstrings: a changed docstring or signature needs
    # `.venv-torch/bin/python scripts/python_api.py`.
    import subprocess
    import sys

    fresh = tmp_path / "python.md"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "python_api.py"), str(fresh)], check=True,
                   capture_output=True)
    with open(os.path.join(ROOT, "docs", "api", "python.md")) as f:
        assert fresh.read_text() == f.read(), "docs/api/python.md is stale: run scripts/python_api.py"


def test_cpu_isa_reads_this_cpu():
    from contrastive_torch import _cpu

    have = _cpu.cpu_isa()
    if have is None:  # not an x86-64 Linux machine: nothing is checked
        assert _cpu.lacking(["avx512f"]) == [] and _cpu.build_tag() == "generic"
        return
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).partition(":")[2].split())
    assert have == flags & _cpu.ISA_FLAGS and "sse4_2" in have


def test_lacking_and_build_tag():
    from contrastive_torch import _cpu

    assert _cpu.lacking(["avx2", "avx512f", "avx512_bf16", "not_an_isa_flag"], frozenset({"avx2"})) == [
        "avx512_bf16", "avx512f"]
    assert _cpu.lacking(["avx2"], frozenset({"avx2", "fma"})) == []
    tags = {_cpu.build_tag(frozenset(s)) for s in ({"avx2"}, {"avx2", "fma"}, {"avx2", "fma", "avx512f"})}
    assert len(tags) == 3 and all(re.fullmatch(r"[0-9a-f]{8}", t) for t in tags)
    assert _cpu.build_tag(frozenset({"fma", "avx2"})) == _cpu.build_tag(frozenset({"avx2", "fma"}))


def test_installed_isa_file_is_read(tmp_path, monkeypatch):
    from contrastive_torch import _cpu, _extension

    monkeypatch.setattr(_cpu, "cpu_isa", lambda cpuinfo=None: frozenset({"avx2", "fma"}))
    path = tmp_path / "NATIVE_ISA"
    path.write_text("avx2 avx512f avx512bw fma\n")
    assert _extension.installed_isa_lacking(str(path)) == ["avx512bw", "avx512f"]
    path.write_text("avx2 fma\n")
    assert _extension.installed_isa_lacking(str(path)) == []
    assert _extension.installed_isa_lacking(str(tmp_path / "absent")) == []  # a portable build or a checkout


def test_an_extension_compiled_for_another_cpu_is_not_loaded(monkeypatch, capsys):
    # Loading it would end the process (SIGILL) at its first instruction this CPU lacks: the package compiles one for
    # this CPU instead, under a name of its own in torch's cache, and says why.
    from contrastive_torch import _extension

    built = []

    def refuse(name):
        raise AssertionError(f"the installed {name} was loaded")

    monkeypatch.setattr(_extension, "_loaded", {})
    monkeypatch.setattr(_extension, "installed_isa_lacking", lambda path=None: ["avx512_bf16", "avx512f"])
    monkeypatch.setattr(_extension, "_prebuilt", refuse)
    monkeypatch.setattr(_extension, "_announce", lambda what, name: None)
    monkeypatch.setattr(_extension, "_build", lambda name, **kw: built.append((name, kw)) or "compiled here")
    monkeypatch.setenv("CONTRASTIVE_NATIVE", "1")
    assert _extension.extension() == "compiled here"
    assert "avx512_bf16, avx512f, which this CPU lacks" in capsys.readouterr().err
    name, kw = built[0]
    assert name == _extension.host_build_name() and name.startswith("contrastive_torch_ext")
    assert "-march=native" in kw["extra_cflags"]
    # A build this CPU runs is loaded as before.
    monkeypatch.setattr(_extension, "_loaded", {})
    monkeypatch.setattr(_extension, "installed_isa_lacking", lambda path=None: [])
    monkeypatch.setattr(_extension, "_prebuilt", lambda name: "installed")
    assert _extension.extension() == "installed"
    # Without -march=native the cached build has one name whatever the CPU.
    monkeypatch.setenv("CONTRASTIVE_NATIVE", "0")
    assert _extension.host_build_name() == "contrastive_torch_ext_" + _extension.checkout_tag()


def test_a_build_on_first_use_is_announced_when_it_compiles(monkeypatch, tmp_path, capsys):
    # Silent where torch's cache holds a build of these headers; one line where it builds, naming a rebuild after the
    # headers changed (a `git pull`), which torch's cache rebuilds as the build's flags carry the headers' digest.
    from contrastive_torch import _extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("CONTRASTIVE_TORCH_QUIET", raising=False)
    name = _extension.host_build_name()
    _extension._announce("host extension", name)
    assert "contrastive_torch: loading the host extension (compiled on first use" in capsys.readouterr().err
    from torch.utils.cpp_extension import _get_build_directory

    folder = _get_build_directory(name, False)
    open(os.path.join(folder, name + ".so"), "w").close()
    for digest, said in (("-DCONTRASTIVE_HEADERS_DIGEST=0123456789abcdef", "rebuilding the host extension (the "
                          "library's headers changed;"), (_extension._digest_flag()[0], "")):
        with open(os.path.join(folder, "build.ninja"), "w") as f:
            f.write(f"cflags = -O3 {digest}\n")
        _extension._announce("host extension", name)
        err = capsys.readouterr().err
        assert (said in err) if said else "contrastive_torch:" not in err
    # Each checkout has its own builds; the CUDA extension's name carries the tag too.
    assert name.endswith("_" + _extension.checkout_tag())
    assert _extension.cuda_build_name().endswith("_" + _extension.checkout_tag())


def test_the_cuda_extension_without_a_gpu_asks_for_the_architectures(monkeypatch):
    # torch picks the architectures from the visible GPUs: with none and no TORCH_CUDA_ARCH_LIST its builder fails
    # with a bare IndexError; ours says what to set.
    from contrastive_torch import _extension

    monkeypatch.setattr(_extension, "_loaded", {})
    monkeypatch.setattr(_extension, "_prebuilt", lambda name: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    with pytest.raises(RuntimeError, match="no GPU is visible .* set TORCH_CUDA_ARCH_LIST"):
        _extension.cuda_extension()


def test_the_source_distribution_carries_what_it_builds_from(tmp_path):
    # python/ builds against the library's headers and VERSION, which live beside it in the repository: the sdist
    # must carry both (setup.py's sdist command copies them in), or it cannot be installed anywhere else.
    import shutil
    import subprocess
    import sys
    import tarfile

    for part in ("include", "VERSION"):
        if not os.path.exists(os.path.join(ROOT, part)):
            pytest.skip(f"no repository around the tests ({part})")
    src = tmp_path / "repo"
    shutil.copytree(os.path.join(ROOT, "python"), src / "python",
                    ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "*.so", "__pycache__", "tests"))
    shutil.copytree(os.path.join(ROOT, "include"), src / "include")
    shutil.copy(os.path.join(ROOT, "VERSION"), src / "VERSION")
    out = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=src / "python",
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, CONTRASTIVE_TORCH_CUDA="0"))
    assert out.returncode == 0, out.stderr[-3000:]
    (archive,) = (tmp_path / "dist").iterdir()
    with tarfile.open(archive) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
        for needed in ("setup.py", "pyproject.toml", "contrastive_torch/VERSION", "contrastive_torch/_cpu.py",
                       "contrastive_torch/include/contrastive/contrastive.hpp",
                       "contrastive_torch/include/contrastive/host/engine.hpp", "contrastive_torch/csrc/binding.cpp"):
            assert needed in members, f"the sdist lacks {needed}"
        assert tar.extractfile(members["contrastive_torch/VERSION"]).read().decode().strip() == ct.__version__


def test_a_header_change_rebuilds_the_extension_compiled_on_first_use(tmp_path):
    # torch's extension cache rebuilds on a changed source or flag; the headers' digest is one of the flags.
    from contrastive_torch import _extension

    include = tmp_path / "include" / "contrastive"
    include.mkdir(parents=True)
    (include / "a.hpp").write_text("int a;\n")
    (include / "b.hpp").write_text("int b;\n")
    first = _extension.headers_digest(str(tmp_path / "include"))
    assert first == _extension.headers_digest(str(tmp_path / "include"))
    (include / "b.hpp").write_text("int b2;\n")
    assert _extension.headers_digest(str(tmp_path / "include")) != first
    assert re.fullmatch(r"-DCONTRASTIVE_HEADERS_DIGEST=[0-9a-f]{16}", _extension._digest_flag()[0])
