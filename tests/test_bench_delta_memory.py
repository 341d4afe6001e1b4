"""The host-memory bench of the two weight paths, at its smoke size: it runs both paths in child
processes, checks they published the same state, and writes the figures its docs table is built from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.scripts_loader import SCRIPTS


def test_the_smoke_run_measures_both_paths(tmp_path: Path) -> None:
    out = tmp_path / "mem.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_delta_memory.py"), "--smoke", "--rounds", "2", "--versions", "2",
         "--json", str(out)], capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["rounds"] == 2 and doc["model_mib"] > 0 and "load_average_start" in doc
    for path in ("full", "delta"):
        figures = doc["paths"][path]
        for key in ("weights_mib", "first_mib", "start_mib", "steady_mib", "changed_fraction"):
            s = figures[key]
            assert s["n"] == 2 and 0 <= s["min"] <= s["median"] <= s["max"]
        assert 0.01 < figures["changed_fraction"]["median"] < 0.03
    assert doc["paths"]["delta"]["previous_mib"]["median"] == doc["model_mib"]
    assert doc["paths"]["full"]["previous_mib"]["median"] == 0


def test_bad_layers_are_one_line() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_delta_memory.py"), "--smoke", "--layers", "99"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no such layers" in proc.stderr
