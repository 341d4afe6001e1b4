"""The benchmarks' smoke sizes run to the end and write the JSON keys their reports are built from."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, tmp_path: Path, *args: str, timeout: float = 120) -> dict[str, Any]:
    out = tmp_path / f"{Path(script).stem}.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--smoke", "--json", str(out), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_spread(s: dict[str, Any]) -> None:
    assert s["n"] >= 1
    assert all(finite(s[k]) for k in ("min", "median", "max"))
    assert s["min"] <= s["median"] <= s["max"]


def check_load(doc: dict[str, Any]) -> None:
    assert finite(doc["load_average_start"]) and finite(doc["load_average_end"])


@pytest.mark.slow  # ~16 s: python -m pytest --slow tests/test_bench_quick.py
def test_bench_ingest_smoke(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    try:
        from tests.s3server import find_weed

        find_weed()
    except Exception as exc:
        pytest.skip(f"no S3 server: {exc}")
    doc = run_bench("bench_ingest.py", tmp_path)
    check_load(doc)
    for key in ("requests_per_new_record_median", "requests_ratio_pile", "seconds_ratio_workers",
                "steady_seconds_median"):
        assert finite(doc[key]), key
    # one GET per new record plus a LIST page per 1,000 keys, whatever the pile
    assert 0.9 <= doc["requests_per_new_record_median"] <= 1.1
    assert 0.9 <= doc["requests_ratio_pile"] <= 1.1
    cells = doc["cells"]
    for w in doc["workers"]:
        for phase in ("first", "steady", "steady+"):
            for field in ("seconds", "requests", "requests_per_new_record"):
                check_spread(cells[f"{w}/{phase}"][field])
        assert cells[f"{w}/steady"]["seconds"]["n"] == doc["rounds"]
    # interleaved: every round holds one steady batch of every fleet, in order
    steady = [r["workers"] for r in doc["rows"] if r["phase"] == "steady"]
    assert steady == doc["workers"] * doc["rounds"]


def test_bench_publish_smoke(tmp_path: Path) -> None:
    doc = run_bench("bench_publish.py", tmp_path)
    check_load(doc)
    for key in ("ratio_patch", "ratio_anchor", "sync_s_patch", "sync_s_anchor", "blocked_s_patch",
                "blocked_s_anchor", "background_s_patch", "background_s_anchor", "gather_s", "snapshot_copy_s"):
        assert finite(doc[key]), key
    assert doc["cpu_s_per_gb"]
    for per in doc["cpu_s_per_gb"].values():
        assert finite(per["patch"]) and finite(per["anchor"]) and per["patch"] > 0
    for s in doc["spreads"].values():
        check_spread(s)
    assert doc["spreads"]["sync_s_patch"]["n"] == doc["patch_versions"] * doc["cycles"]
    # interleaved: each version is published by every contender before the next version
    paths = list(dict.fromkeys(r["path"] for r in doc["rows"]))
    assert [r["path"] for r in doc["rows"]] == paths * (len(doc["rows"]) // len(paths))


def test_bench_plane_memory_smoke(tmp_path: Path) -> None:
    """A worker holding a quantized plane: built, installed, patched in place and generating, with
    no master beside the served weights and every stage's memory reported."""
    pytest.importorskip("mlx_lm")
    doc = run_bench("bench_plane_memory.py", tmp_path, "--planes", "int4")
    check_load(doc)
    r = doc["planes"]["int4"]
    assert doc["master_bytes"] == {"int4": 0} and r["master_bytes"] == 0
    assert r["patched_tensors"] > 0 and r["served_bytes"] > 0 and r["cache_bytes"] > 0
    assert finite(doc["rss_over_served"]["int4"]) and doc["rss_over_served"]["int4"] > 0
    assert list(r["rss_stages_bytes"]) == [
        "model built", "plane state held", "installed", "version being applied", "version applied", "generated"
    ]
    assert r["served_bytes"] < r["weights"] * 2 * 0.5  # 4-bit codes plus scales: well under half of bf16
