"""`stoa rollouts show` and `stoa rollouts stats` on a real run's bucket: a short quickstart's
records (real workers, real trainer state, a signed run), found, judged admitted and counted
per weight version."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from slime_stoa.cli import main

VERSIONS = 3
GROUP_SIZE = 8  # the quickstart's default samples per prompt
MAX_TOKENS = 4  # the synthetic task's default longest response


@pytest.mark.slow  # a short quickstart (about a minute on two cores): python -m pytest --slow tests/test_rollouts_quickstart.py
def test_rollouts_show_and_stats_read_a_quickstart_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "qs"
    summary_path = tmp_path / "summary.json"
    assert main(["quickstart", "--out", str(out), "--minutes", "30", "--max-versions", str(VERSIONS), "--target", "2",
                 "--warmup-steps", "50", "--json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    capsys.readouterr()
    where = ["--store", f"file://{out / 'bucket'}", "--run", "quickstart"]

    # stats: a row per version the workers sampled from, every record admitted, k samples each
    stats_path = tmp_path / "stats.json"
    assert main(["rollouts", "stats", *where, "--json", str(stats_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["version", "records", "refused", "samples"]
    doc = json.loads(stats_path.read_text())
    rows = {row["version"]: row for row in doc["versions"]}
    assert doc["run"] == "quickstart" and doc["undecoded"] == 0
    sampled = {int(v) for v in summary["reward_by_version"]}
    assert sampled and sampled <= set(rows) and set(rows) <= set(range(VERSIONS + 1))
    assert [line.split()[0] for line in table[1:]] == [str(v) for v in sorted(rows)]
    for row in rows.values():
        assert row["records"] >= 1 and row["refused"] == 0 and row["samples"] == row["records"] * GROUP_SIZE
        assert 0.0 <= row["reward_mean"] <= 1.0 and row["search_rate"] in (None, 0.0)  # synthetic: no tool
        assert 1 <= row["length_max"] <= MAX_TOKENS
    assert sum(row["records"] for row in rows.values()) >= summary["groups_used_run"]

    # show: the newest records, each admitted, with its prompt, label and every sample's reward
    assert main(["rollouts", "show", *where, "--limit", "4"]) == 0
    shown = capsys.readouterr().out
    blocks = shown.split("== ")[1:]
    assert len(blocks) == 4 and "REFUSED" not in shown
    for block in blocks:
        assert re.search(r"worker quickstart-\d+ seq \d+", block)
        assert "  task synthetic prompt " in block and f"{GROUP_SIZE} samples" in block
        assert "\n  prompt:\n" in block and "\n  label: " in block
        assert len(re.findall(r"\n  sample \d+: reward [01](\.\d+)?\b", block)) == GROUP_SIZE
    # ... and its filters select from the same records
    first = min(rows)
    assert main(["rollouts", "show", *where, "--version", str(first), "--limit", "50"]) == 0
    versions = re.findall(r"weights v(\d+)", capsys.readouterr().out)
    assert versions and set(versions) == {str(first)} and len(versions) == min(50, rows[first]["records"])
    assert main(["rollouts", "show", *where, "--worker", "quickstart-1", "--limit", "3"]) == 0
    workers = re.findall(r"worker (\S+) seq", capsys.readouterr().out)
    assert workers and set(workers) == {"quickstart-1"}
