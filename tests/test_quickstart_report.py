"""What the quickstart reports means what its labels say: the progress rows' logprob gap, the
summary and the learning curve of a resumed run (fast: no workers, no training)."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

pytest.importorskip("rich")
pytest.importorskip("matplotlib")
pytest.importorskip("torch")

from rich.console import Console

from slime_stoa.protocol.pulse.publisher import PublishResult
from slime_stoa.quickstart.config import QuickstartConfig
from slime_stoa.quickstart.progress import Progress, load_progress, save_progress
from slime_stoa.quickstart.report import COLUMNS, ConsoleReport, curve_figure
from slime_stoa.quickstart.run import summarize
from slime_stoa.trainer.consumer import Batch

RUN = "quickstart"


def rows_of(console: Console) -> list[list[str]]:
    text = console.file.getvalue()  # type: ignore[attr-defined]
    return [line.split() for line in text.splitlines()[1:]]


def test_the_lp_gap_shows_only_on_rows_where_it_was_measured() -> None:
    """A step whose batch holds no group of the learner's own weights measures no gap: its row
    says "-", not the last value measured some versions before."""
    console = Console(file=io.StringIO(), width=200)
    report = ConsoleReport(console)
    progress = Progress(full_bytes=1000)
    result = PublishResult(1, False, 10, 100, 400, 0, 0, 0.1)
    batch = Batch(groups=(), metrics={"rollout/stoa_scored_reward_mean": 0.5}, trainer_version=0)
    progress.record_gaps(1, [1e-3, 3e-3])
    report.version(1, {}, batch, result, progress, 2)
    progress.record_gaps(2, [])  # nothing of v1 in the next batch
    report.version(2, {}, batch, result, progress, 2)
    progress.record_gaps(3, [5e-3])
    report.version(3, {}, batch, result, progress, 2)
    gap = COLUMNS.index("lp gap")
    assert [(r[0], r[gap + 1]) for r in rows_of(console)] == [("v1", "2e-03"), ("v2", "-"), ("v3", "5e-03")]
    # ("patch" is two cells: "0.4 KB", hence + 1)
    assert progress.gap_by_version == {1: 2e-3, 3: 5e-3} and progress.gaps == [1e-3, 3e-3, 5e-3]


def test_the_search_column_and_row_show_only_for_a_tool_task() -> None:
    result = PublishResult(1, False, 10, 100, 400, 0, 0, 0.1)
    batch = Batch(groups=(), metrics={"rollout/stoa_scored_reward_mean": 0.5}, trainer_version=0)
    for search in (True, False):
        console = Console(file=io.StringIO(), width=200)
        ConsoleReport(console, search=search).version(1, {}, batch, result, Progress(full_bytes=1000), 2)
        header = console.file.getvalue().splitlines()[0].split()  # type: ignore[attr-defined]
        assert ("search" in header) is search
        assert len(rows_of(console)[0]) == len(COLUMNS) - (not search) + 1  # "patch" is two cells
    progress = Progress(full_bytes=1000)
    progress.first_version = progress.run_first_version = 0
    progress.last_version, progress.patch_bytes[1] = 1, 100
    progress.rewards.update({0: [0.5], 1: [1.0]})
    summary = summarize(progress, QuickstartConfig(window=2), lost=0, groups_used_run=16)
    for task, shown in (("search", True), ("synthetic", False)):
        console = Console(file=io.StringIO(), width=200)
        ConsoleReport(console).summary({**summary, "task": task})
        assert ("search rate" in console.file.getvalue()) is shown  # type: ignore[attr-defined]


def first_session(tmp_path: Path) -> tuple[Progress, Path]:
    """A session that seeded v0 and published v1..v4, as `run_quickstart` records it."""
    path = tmp_path / "progress.json"
    p = Progress(full_bytes=1000, warm_start="supervised warm start on the answer format: 600 steps")
    p.run_first_version = p.first_version = 0
    for v in range(1, 5):
        p.last_version = v
        p.patch_bytes[v] = 100 * v
        p.digests[v] = f"d{v}"
        p.record_gaps(v, [0.001 * v] if v % 2 else [])
        p.seen_states[("quickstart-0", v)] = f"d{v}"
        save_progress(p, path, run=RUN)
    return p, path


def test_a_resumed_run_knows_its_whole_history(tmp_path: Path) -> None:
    before, path = first_session(tmp_path)
    resumed = Progress()
    assert load_progress(resumed, path, run=RUN, version=4)
    resumed.first_version = resumed.last_version = 4
    assert resumed.run_first_version == 0
    assert resumed.patch_bytes == before.patch_bytes and resumed.digests == before.digests
    assert resumed.seen_states == before.seen_states and resumed.gaps == before.gaps
    assert resumed.gap_by_version == {1: 0.001, 3: 0.003}
    assert resumed.warm_start == before.warm_start
    assert resumed.seconds() >= resumed.seconds_before > 0
    # The rerun publishes v5, v6; its rewards (from the bucket) hold every version of the run.
    for v in (5, 6):
        resumed.last_version, resumed.patch_bytes[v] = v, 100 * v
        resumed.groups_used += 16
    resumed.rewards.update({0: [0.0, 0.5], 1: [0.5], 4: [1.0], 5: [1.0], 6: [1.0]})
    summary = summarize(resumed, QuickstartConfig(window=2), lost=0, groups_used_run=96)
    assert summary["first_version"] == 0 and summary["reward_first"] == 0.25  # v0's, not v4's
    assert (summary["versions"], summary["versions_run"]) == (2, 6)
    assert (summary["groups_used"], summary["groups_used_run"]) == (32, 96)
    assert sorted(summary["patch_bytes_by_version"]) == [1, 2, 3, 4, 5, 6]
    assert summary["mean_abs_logprob_gap"] == pytest.approx(0.002) and summary["logprob_gap_versions"] == 2
    assert summary["chance"] == 0.25 and summary["target"] == 0.9
    console = Console(file=io.StringIO(), width=200)
    ConsoleReport(console).summary(summary)
    text = console.file.getvalue()
    assert "reward, first RL version (v0)" in text and "versions published, this session (run)" in text
    assert "2 (6)" in text and "32 (96)" in text and "reward, last 2 versions" in text


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"run": "other"}, "not 'quickstart'"),
        ({"last_version": 9}, "not a run at v4"),  # ahead of the bucket: another bucket's run
        ({"format": "x"}, "not a stoa.quickstart-progress/1"),
        ({"gaps": ["x"]}, "malformed"),
        ({"patch_bytes": {"1": -5}}, "malformed"),
    ],
)
def test_a_foreign_or_damaged_progress_file_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: dict, reason: str
) -> None:
    _, path = first_session(tmp_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    resumed = Progress()
    with caplog.at_level(logging.WARNING):
        assert not load_progress(resumed, path, run=RUN, version=4)
    assert reason in caplog.text and resumed.patch_bytes == {} and resumed.gaps == []


def test_entries_past_the_buckets_version_are_left_out(tmp_path: Path) -> None:
    _, path = first_session(tmp_path)
    doc = json.loads(path.read_text())
    doc["last_version"] = 2
    path.write_text(json.dumps(doc))
    resumed = Progress()
    assert load_progress(resumed, path, run=RUN, version=2)
    assert sorted(resumed.patch_bytes) == [1, 2] and sorted(resumed.digests) == [1, 2]
    assert sorted(v for _, v in resumed.seen_states) == [1, 2] and resumed.gap_by_version == {1: 0.001}


def test_the_learning_curve_draws_chance_and_target_over_the_whole_run() -> None:
    import matplotlib.pyplot as plt

    summary = {
        "reward_by_version": {str(v): 0.25 + 0.07 * v for v in range(10)},
        "patch_bytes_by_version": {str(v): 1000 * v for v in range(1, 10)},
        "full_bytes": 20_000, "chance": 0.25, "target": 0.9,
    }
    fig = curve_figure(summary)
    try:
        top, bottom = fig.axes
        flat = {line.get_label(): set(line.get_ydata()) for line in top.get_lines()}
        assert flat["target (0.9)"] == {0.9}
        assert flat["chance: a random shown digit (0.25)"] == {0.25}
        assert list(top.get_lines()[0].get_xdata()) == list(range(10))
        legend = [t.get_text() for t in top.get_legend().get_texts()]
        assert "target (0.9)" in legend and "chance: a random shown digit (0.25)" in legend
        assert sorted(round(p.get_x() + p.get_width() / 2) for p in bottom.patches) == list(range(1, 10))
    finally:
        plt.close(fig)
