# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""The x86 instruction-set extensions a -march=native build of the host extension may use, as Linux's /proc/cpuinfo
names them. A build compiled where the CPU has one of them and loaded where it has not dies at its first such
instruction (SIGILL: the process ends without a Python traceback). That happens with a venv or a torch extension cache
shared between machines (a cluster's login and compute nodes). So the package keeps apart what each CPU needs:
`pip install` records the building CPU's set (setup.py writes NATIVE_ISA), the host extension checks it against this
CPU before loading (contrastive_torch._extension), and the compile-on-first-use cache names each build by its CPU's
set (build_tag). This module imports nothing of the package: setup.py loads it from the source tree."""

import hashlib
import platform

# The extensions a compiler may emit under -march=native (vector, bit-manipulation and matrix instructions), by their
# /proc/cpuinfo names (SSE3 is 'pni' there).
ISA_FLAGS = frozenset((
    "pni", "ssse3", "sse4_1", "sse4_2", "sse4a", "popcnt", "cx16", "avx", "avx2", "fma", "fma4", "xop", "f16c", "bmi1",
    "bmi2", "abm", "movbe", "3dnowprefetch",
    "adx", "aes", "pclmulqdq", "sha_ni", "gfni", "vaes", "vpclmulqdq", "avx_vnni", "avx512f", "avx512bw", "avx512cd",
    "avx512dq", "avx512vl", "avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_vnni", "avx512_bitalg",
    "avx512_vpopcntdq", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"))


def cpu_isa(cpuinfo="/proc/cpuinfo"):
    """The ISA_FLAGS this CPU has (a frozenset), or None where that cannot be told: not an x86-64 machine, or no
    readable /proc/cpuinfo (then nothing is checked)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split()) & ISA_FLAGS
    except OSError:
        return None
    return None


def lacking(required, have=None):
    """The names in `required` (the ISA_FLAGS a build was compiled for) that this CPU lacks (`have`: its set, default
    cpu_isa()), sorted; [] where this CPU's set is unknown."""
    have = cpu_isa() if have is None else have
    if have is None:
        return []
    return sorted(set(required) & ISA_FLAGS - have)


def build_tag(have=None):
    """A name for this CPU's set (8 hex digits of its hash; 'generic' where unknown): machines whose sets differ get
    different compile-on-first-use builds."""
    have = cpu_isa() if have is None else have
    if have is None:
        return "generic"
    return hashlib.sha1(" ".join(sorted(have)).encode()).hexdigest()[:8]
