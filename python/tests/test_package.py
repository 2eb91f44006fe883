# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The package's public surface: one version number with CMake, and every name in __all__ importable."""

import os
import re

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
