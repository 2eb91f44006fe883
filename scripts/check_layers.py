#!/usr/bin/env python3
# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Fails when a header in include/contrastive includes one from a higher layer (docs/design.md draws the layers).

Usage: python3 scripts/check_layers.py [repo root]. Every header must belong to a layer below, through its folder (a
top-level header through its own name); a new folder or top-level header must be given one here.
"""
import pathlib
import re
import sys

# Lower numbers are lower layers; a header may include its own layer or lower ones. Folders are named, never single
# headers inside them: every header of a folder (and of its subfolders) is in that folder's layer. Only the
# top-level headers are named one by one.
LAYERS = {
    "detail": 0, "status.hpp": 0, "tags.hpp": 0,
    "numeric": 1, "objectives": 1, "record.hpp": 1, "problem.hpp": 1,
    "policy": 2, "checks.hpp": 2,
    "comm": 3,
    "host": 4,
    "step": 5,
    "device": 6,
    "distributed": 7,
    "loss.hpp": 8, "core.hpp": 8,
    "contrastive.hpp": 9,
}


def layer(rel):
    top = rel.split("/")[0]
    if top in LAYERS and (top == rel) == top.endswith((".hpp", ".cuh", ".h")):
        return LAYERS[top]
    raise KeyError(rel)


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".") / "include" / "contrastive"
    bad, headers = [], sorted(p for p in root.rglob("*") if p.suffix in (".hpp", ".cuh", ".h"))
    bad += [f"{name}: the table names a header inside a folder; give the whole folder one layer" for name in LAYERS
            if "/" in name]
    for path in headers:
        rel = path.relative_to(root).as_posix()
        try:
            mine = layer(rel)
        except KeyError:
            bad.append(f"{rel}: not in any layer (add it to scripts/check_layers.py)")
            continue
        for inc in re.findall(r"#include <contrastive/([^>]+)>", path.read_text()):
            try:
                theirs = layer(inc)
            except KeyError:
                bad.append(f"{rel} includes {inc}, which is not in any layer")
                continue
            if theirs > mine:
                bad.append(f"{rel} (layer {mine}) includes {inc} (layer {theirs})")
    for b in bad:
        print("layers:", b)
    print(f"layers: {len(headers)} headers, {len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
