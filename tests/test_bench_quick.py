"""The benchmarks' smoke sizes run to the end and write the JSON keys their reports are built from;
a benchmark whose work cannot finish exits non-zero, says what did not finish and writes no JSON."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.scripts_loader import load_script

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


@pytest.mark.slow  # ~20 s: python -m pytest --slow tests/test_bench_quick.py
def test_bench_worker_smoke_reports_both_ratios_with_the_load(tmp_path: Path) -> None:
    """Tokens per decode step and wall tokens/s, macd over mlx-lm, with the load of every
    contender's run; the bf16 worker installed every version published to it."""
    pytest.importorskip("mlx_lm")
    doc = run_bench("bench_worker.py", tmp_path)
    check_load(doc)
    assert finite(doc["tokens_per_step_ratio"]) and doc["tokens_per_step_ratio"] > 0
    assert finite(doc["ratio_vs_mlx_lm_median"]) and doc["ratio_vs_mlx_lm_median"] > 0
    assert len(doc["load_average_rounds"]) == 3 * doc["rounds"]  # after each contender's run
    check_spread(doc["load_average_throughput"])
    for name in ("mlx_lm", "macd", "macd_drained"):
        check_spread(doc["tok_s_spread"][name])
        check_spread(doc["tokens_per_step_spread"][name])
    assert doc["workers"]["bf16"]["published"] == 1 and len(doc["bf16_swaps"]) >= 1
    assert finite(doc["swap_stall_s"])


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:  # gone meanwhile
        return []


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the worker's process through /proc")
def test_bench_worker_whose_worker_dies_exits_non_zero_and_writes_nothing(tmp_path: Path) -> None:
    """The plane worker's child process killed while versions are still to come: the run ends
    with status 1 naming the worker, not with "0 swaps, stall nan" and status 0."""
    pytest.importorskip("mlx_lm")
    out = tmp_path / "bench_worker.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bench = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "bench_worker.py"), "--smoke", "--no-throughput", "--swaps", "50",
         "--json", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        worker = None
        while worker is None:  # until the bench started its worker (the test's timeout bounds it)
            assert bench.poll() is None, bench.communicate()
            worker = next((c for c in _children(bench.pid) if "--child" in _cmdline(c)), None)
            time.sleep(0.1)
        os.kill(worker, signal.SIGKILL)
        stdout, stderr = bench.communicate(timeout=300)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 1, stdout[-2000:] + stderr[-2000:]
    assert f"the bf16 worker exited with {-signal.SIGKILL}" in stderr, stderr[-2000:]
    assert "Traceback" not in stderr
    assert not out.exists()


def test_write_json_refuses_a_figure_that_is_not_a_number(tmp_path: Path) -> None:
    benchlib = load_script("benchlib")
    out = tmp_path / "run.json"
    with pytest.raises(benchlib.Incomplete, match=r"cells\.10/steady\.median, ratio"):
        benchlib.write_json(out, {"cells": {"10/steady": {"median": math.nan, "n": 0}}, "ratio": math.inf, "ok": 1.5})
    assert not out.exists()
    benchlib.write_json(out, {"ratio": 1.5, "rows": [{"seconds": 0.25}]})
    assert json.loads(out.read_text()) == {"ratio": 1.5, "rows": [{"seconds": 0.25}]}


def test_a_stalled_piece_of_work_is_incomplete_and_the_run_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    benchlib = load_script("benchlib")
    watch = benchlib.StallWatch("the int4 worker", limit_s=0.05)
    watch.check("1 of 3 versions")  # within the limit: nothing
    time.sleep(0.1)  # no progress past the limit
    with pytest.raises(benchlib.Incomplete, match=r"the int4 worker made no progress for 0.05 s \(1 of 3 versions\)"):
        watch.check("1 of 3 versions")
    watch.progressed()
    watch.check()

    def stalled() -> int:
        watch.last -= 1.0
        watch.check("v2 not installed")
        return 0

    assert benchlib.exit_code(stalled, "bench_x") == 1
    assert capsys.readouterr().err == "error: bench_x did not finish: the int4 worker made no progress for 0.05 s (v2 not installed)\n"
