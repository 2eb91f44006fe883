#!/usr/bin/env python3
# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""Fails when a header in include/contrastive includes one from a higher layer (docs/design.md draws the layers).

Usage: python3 scripts/check_layers.py [repo root]. Every header must belong to a layer below; a new folder or
top-level header must be given one here.
"""
import pathlib
import re
import sys

# Lower numbers are lower layers; a header may include its own layer or lower ones.
LAYERS = {
    "detail": 0, "status.hpp": 0, "tags.hpp": 0,
    "numeric": 1, "record.hpp": 1, "problem.hpp": 1,
    "policy": 2, "checks.hpp": 2,
    "step/logic.hpp": 3, "step/checkpoint.hpp": 3,
    "host": 4, "distributed/communicator.hpp": 4, "distributed/agreement.hpp": 4, "distributed/mpi.hpp": 4, "distributed/nccl_comm.cuh": 4,
    "device": 5, "step/driver.hpp": 5, "step/front.hpp": 5, "step/phases.hpp": 5,
    "step/loss.hpp": 6, "distributed/nccl.cuh": 6, "distributed/nccl_kernels.cuh": 6,
    "loss.hpp": 7, "core.hpp": 7, "distributed/loss.hpp": 7,
    "contrastive.hpp": 8,
}


def layer(rel):
    if rel in LAYERS:
        return LAYERS[rel]
    top = rel.split("/")[0]
    if top in LAYERS:
        return LAYERS[top]
    raise KeyError(rel)


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".") / "include" / "contrastive"
    bad, headers = [], sorted(p for p in root.rglob("*") if p.suffix in (".hpp", ".cuh", ".h"))
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
