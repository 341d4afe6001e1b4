"""scripts/bench_worker.py --vs-transformers: macd's generation against transformers' `generate`
runs to the end on a tiny model and writes the keys its report is built from; a side that cannot
run makes it exit non-zero."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("transformers")

from slime_stoa.quickstart.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def run_vs(tmp_path: Path, model: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "vs.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_worker.py"), "--vs-transformers", "--model", str(model),
         "--new-tokens", "4", "--rounds", "2", "--hf-threads", "1", "--json", str(out), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    return proc, out


@pytest.mark.slow  # ~11 s: both sides' processes load a model and generate
def test_both_sides_generate_the_same_tokens_and_the_report_has_its_keys(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny", family="llama")
    proc, out = run_vs(tmp_path, model)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(out.read_text())
    assert doc["batch"] == 16 and doc["new_tokens"] == 4 and doc["rounds"] == 2
    for name in ("macd", "transformers"):
        s = doc["tok_s_spread"][name]
        assert s["n"] == 2 and 0 < s["min"] <= s["median"] <= s["max"]
    assert math.isfinite(doc["ratio_vs_transformers_median"]) and doc["ratio_vs_transformers_median"] > 0
    assert doc["transformers_setting"]["threads"] == 1 and len(doc["transformers_calibration"]) == 2
    assert len(doc["load_average_rounds"]) == 4 and math.isfinite(doc["load_average_start"])
    assert doc["macd"]["rss_bytes"] > doc["macd"]["weight_bytes"] > 0 and "blas" in doc["macd"]
    assert "ratio of medians macd / transformers" in proc.stdout


def test_a_side_that_cannot_run_fails_the_run(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    proc, out = run_vs(tmp_path, broken)
    assert proc.returncode == 1 and not out.exists()
    assert "contender exited" in proc.stderr
