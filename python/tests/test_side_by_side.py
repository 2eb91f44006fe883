# Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
"""scripts/gpu_side_by_side.py on the CPU (--dry-run: small N, the CUDA-only peers skipped with the reason), so that
the script a GPU lease runs once works the first time: every row of ours and of the eager form runs, checks itself
against the float64 reference (ours with group ids, --groups, is timed only), and the table and JSON records are
written."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_gpu_side_by_side_dry_run(tmp_path):
    md, jsonl = tmp_path / "side_by_side.md", tmp_path / "side_by_side.jsonl"
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_side_by_side.py"), "--dry-run", "--n", "96", "--contenders",
           "eager", "ours", "peers", "--groups", "2", "--out", str(md), "--json", str(jsonl)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=800, env=dict(os.environ), cwd=ROOT)
    assert run.returncode == 0, (run.stdout[-4000:], run.stderr[-4000:])
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    assert any(r["kind"] == "self_check" and r["ok"] for r in records)
    rows = [r for r in records if r["kind"] == "row"]
    ran = {(r["mode"], r["objective"], r["contender"]) for r in rows if r["status"] == "ok"}
    for mode in ("bf16", "autocast"):
        for objective in ("clip", "siglip"):
            for contender in ("eager", "ours", "ours:chunked", "ours+ids", "ours:chunked+ids"):
                assert (mode, objective, contender) in ran, (mode, objective, contender)
    for r in rows:
        if r["status"] == "ok" and r["contender"].endswith("+ids"):  # timed only: the reference has one positive
            assert r["median_ms"] > 0 and "loss_err" not in r and "ids: 2 pairs per group" in r["note"], r
        elif r["status"] == "ok":
            assert r["median_ms"] > 0 and r["loss_err"] < 1e-2, r
    assert "| contender |" in md.read_text()
