#!/usr/bin/env python3
# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Compares two PTX files kernel by kernel: each .entry and .func with its body, by mangled name.

Usage: python3 scripts/ptx_entries.py OLD.ptx NEW.ptx. Prints how many are the same and, demangled (c++filt), those
that changed, were added or were removed; everything outside the entries (module header, globals) is compared as one
more part. Exits 1 when any part changed or was removed (additions alone exit 0). Used by device_ptx_check.sh.
"""
import re
import subprocess
import sys

HEAD = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+|\.extern\s+)*\.(entry|func)\s+(?:\([^)]*\)\s*)?([A-Za-z_$][\w$]*)")


# Names numbered by a function's place in the file (basic-block labels $L__BB<f>_<b>, local depots): an entry added
# before another renumbers it without changing it, so they are compared with the function's number taken out.
PLACE = [(re.compile(r"\$L__BB\d+_"), "$L__BB_"), (re.compile(r"__local_depot\d+"), "__local_depot")]


def normalised(text):
    for pattern, repl in PLACE:
        text = pattern.sub(repl, text)
    return text


def parts(path):
    """{name: text} for every entry and function defined, and '<module>' for the lines outside them (comments left
    out: nvcc lists every entry in a comment)."""
    out, name, lines, outside = {}, None, [], []
    depth, opened = 0, False
    for line in open(path, encoding="utf-8", errors="replace"):
        if name is None:
            m = HEAD.match(line)
            if m:
                name, lines, depth, opened = m.group(2), [], 0, False
            elif not line.lstrip().startswith("//"):
                outside.append(line)
                continue
            else:
                continue
        lines.append(line)
        depth += line.count("{") - line.count("}")
        opened = opened or "{" in line
        if not opened and line.rstrip().endswith(";"):  # a declaration (.extern .func ...;): module text
            outside.extend(lines)
            name = None
        elif opened and depth == 0:
            out[name] = normalised("".join(lines))
            name = None
    if name is not None:
        out[name] = normalised("".join(lines))
    out["<module>"] = "".join(outside)
    return out


def demangle(names):
    if not names:
        return []
    try:
        r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        return r.stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return names


def main():
    old, new = parts(sys.argv[1]), parts(sys.argv[2])
    same = [n for n in old if n in new and old[n] == new[n]]
    changed = [n for n in old if n in new and old[n] != new[n]]
    removed = [n for n in old if n not in new]
    added = [n for n in new if n not in old]
    print(f"  {len(same)} same, {len(changed)} changed, {len(added)} added, {len(removed)} removed")
    for label, names in (("changed", changed), ("added", added), ("removed", removed)):
        for d in demangle(sorted(names)):
            print(f"  {label}: {d}")
    return 1 if changed or removed else 0


if __name__ == "__main__":
    sys.exit(main())
