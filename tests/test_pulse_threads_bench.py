"""bench_publish reports the receive side per thread count."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_publish_reports_receive_rates_per_thread_count(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_publish.py"), "--smoke", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert "1" in doc["receive"] and doc["wall_s_per_gb"].keys() == doc["cpu_s_per_gb"].keys() >= {"1"}
    for per in doc["wall_s_per_gb"].values():
        assert per["patch"] > 0 and per["anchor"] > 0
    versions = doc["cycles"] * (doc["patch_versions"] + 1) + 1
    for threads, got in doc["receive"].items():
        assert got["syncs"] == versions - 1  # every version after the first anchor, by its step patch
        for key in ("wall_s", "cpu_s", "wall_s_per_gb", "cpu_s_per_gb", "ns_per_change"):
            assert math.isfinite(got[key]) and got[key] > 0, (threads, key)
    assert doc["stage_ns"].keys() == {"diff", "digest", "merge", "encode", "apply", "stage"}
    for stage, per in doc["stage_ns"].items():
        assert per.keys() == doc["receive"].keys() and all(math.isfinite(ns) and ns > 0 for ns in per.values()), stage
    rows = doc["receive_rows"]
    assert [r["path"] for r in rows[: len(doc["receive"])]] == ["anchor"] * len(doc["receive"])
    # interleaved: every thread count reaches a version before any reaches the next
    assert [r["version"] for r in rows] == sorted(r["version"] for r in rows)
