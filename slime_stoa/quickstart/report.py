"""What `stoa quickstart` shows: live progress lines, the summary, the learning-curve PNG."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

COLUMNS = ("version", "reward", "search", "groups", "lag", "patch", "vs full", "changed", "workers", "lp gap")
WIDTHS = (7, 6, 6, 6, 4, 9, 7, 7, 7, 7)


#: The summary's rows of records the trainer did not use: an honest repeat, then a failed check.
REPEATED_ROW = "groups identical to an admitted group (not used again)"
REFUSED_ROW = "records refused: failed a check (forged, malformed, other run or version)"
#: The refusal reason of a record identical to one already admitted: a worker that happened to
#: generate the same group again, or a replay; either way used once, nothing to act on.
REPEAT_REASON = "duplicate"


def split_refusals(refused: Mapping[str, int]) -> tuple[int, dict[str, int]]:
    """Records the trainer refused, by reason: (identical repeats, {reason: count} of the rest)."""
    return refused.get(REPEAT_REASON, 0), {r: n for r, n in sorted(refused.items()) if r != REPEAT_REASON and n}


def refused_cell(failed: Mapping[str, int]) -> str:
    """"0", or the total and its reasons: "3 (signature 2, prompt 1)"."""
    if not failed:
        return "0"
    reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(failed.items(), key=lambda x: (-x[1], x[0])))
    return f"{sum(failed.values())} ({reasons})"


def batch_search_rate(batch: Any) -> float:
    """Share of the batch's samples that called the tool at least once (0 for a task without one)."""
    calls = [s.tool_calls for g in batch.groups for s in g.group.samples]
    return sum(c > 0 for c in calls) / len(calls) if calls else float("nan")


class ConsoleReport:
    """Prints one line per published version under a header, with rich; the `search` column
    only for a task whose samples can call a tool (`search`)."""

    def __init__(self, console: Console | None = None, *, search: bool = True):
        self.console = console or Console()
        self.search = search
        self._header = False

    def _shown(self, cells: tuple[str, ...]) -> list[tuple[str, int]]:
        return [(c, w) for c, w, name in zip(cells, WIDTHS, COLUMNS, strict=True) if self.search or name != "search"]

    def note(self, text: str) -> None:
        # soft_wrap: a long path or command stays on one line, whole, for copying
        self.console.print(f"[bold cyan]stoa[/] {escape(text)}", soft_wrap=True)

    def version(self, version: int, metrics: dict, batch: Any, result: Any, progress: Any, alive: int) -> None:
        if not self._header:
            self.console.print(" ".join(f"{c:>{w}}" for c, w in self._shown(COLUMNS)), style="bold")
            self._header = True
        lag = batch.metrics.get("rollout/stoa_version_lag_mean", float("nan"))
        gap = progress.gap_by_version.get(version)  # None: this step had no group of its own weights
        ratio = progress.full_bytes / result.patch_bytes if result.patch_bytes else float("inf")
        cells = (
            f"v{version}",
            f"{batch.metrics.get('rollout/stoa_scored_reward_mean', float('nan')):.3f}",
            f"{batch_search_rate(batch):.2f}",
            str(progress.groups_used),
            f"{lag:.2f}",
            f"{result.patch_bytes / 1e3:.1f} KB",
            f"{ratio:.1f}x",
            f"{result.density:.1%}",
            str(alive),
            "-" if gap is None else f"{gap:.0e}",
        )
        self.console.print(" ".join(f"{c:>{w}}" for c, w in self._shown(cells)))

    def summary(self, summary: dict[str, Any]) -> None:
        table = Table(title="stoa quickstart summary", show_header=False)
        # The whole run's figures (a resumed run included), except where "this session" says so.
        rows = [
            (f"reward, first RL version (v{summary['first_version']})", f"{summary['reward_first']:.3f}"),
            (f"reward, last {summary['window']} versions", f"{summary['reward_last']:.3f}"),
            (f"reward, last {summary['window']} learner batches (the target's measure)",
             f"{summary.get('reward_recent_batches', float('nan')):.3f}"
             + (" (target reached)" if summary.get("target_reached") else "")),
            *([(f"search rate, first RL version / last {summary['window']} versions",
                f"{summary['search_rate_first']:.2f} / {summary['search_rate_last']:.2f}")]
              if summary.get("task", "search") == "search" else []),
            (f"eval pass@1, held-out test split ({summary['eval_prompts']} prompts), "
             f"v{summary['first_version']} / v{summary['last_version']}",
             f"{summary['eval_pass1_first']:.3f} / {summary['eval_pass1_last']:.3f}"),
            ("versions published, this session (run)", f"{summary['versions']} ({summary['versions_run']})"),
            ("groups used, this session (run)", f"{summary['groups_used']} ({summary['groups_used_run']})"),
            ("groups lost (set aside: their key held other bytes)", str(summary["groups_lost"])),
            ("groups still in a worker's spool (uploaded when it starts again)", str(summary.get("groups_spooled", 0))),
            (REPEATED_ROW, str(summary.get("groups_repeated", 0))),
            (REFUSED_ROW, refused_cell(summary.get("records_refused", {}))),
            ("worker digests checked / mismatched", f"{summary['digests_checked']} / {summary['digest_mismatches']}"),
            (f"mean |learner - worker| logprob ({summary['logprob_gap_versions']} versions measured)",
             f"{summary['mean_abs_logprob_gap']:.2e}"),
            ("patch bytes per version (mean)", f"{summary['patch_bytes_mean'] / 1e3:.1f} KB"),
            (f"full bf16 sync ({summary.get('tensors', 0)} tensors)", f"{summary['full_bytes'] / 1e3:.1f} KB"),
            ("publish / worker sync to serving, seconds (mean)",
             f"{summary.get('publish_seconds_mean', math.nan):.2f} / {summary.get('worker_sync_seconds_mean', math.nan):.2f}"),
            ("seconds, this session (run)", f"{summary['seconds']:.0f} ({summary['seconds_run']:.0f})"),
        ]
        for k, v in rows:
            table.add_row(k, v)
        self.console.print(table)


def write_json(summary: dict[str, Any], path: Path) -> None:
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        return x

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(summary), indent=2, sort_keys=True) + "\n")


#: A legend to the right of its axes, outside them: it never covers a curve (the constrained
#: layout makes room for it).
LEGEND_BESIDE: dict[str, Any] = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0,
                                 "fontsize": "small"}


def plot_curve(summary: dict[str, Any], path: Path) -> Path:
    """Write `curve_figure(summary)` to `path` (PNG)."""
    import matplotlib.pyplot as plt

    fig = curve_figure(summary)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def curve_figure(summary: dict[str, Any]) -> Any:
    """Reward vs weight version with the chance level and the target, and patch size vs version
    beside the full-sync size: every version of the run (a resumed one included)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rewards = {int(k): v for k, v in summary["reward_by_version"].items() if v is not None}
    searched = {int(k): v for k, v in summary.get("search_rate_by_version", {}).items() if v is not None}
    patches = {int(k): v for k, v in summary["patch_bytes_by_version"].items()}
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]}, layout="constrained"
    )
    top.plot(list(rewards), list(rewards.values()), marker=".", color="tab:blue", label="reward")
    if summary.get("task") == "search":
        top.plot(list(searched), list(searched.values()), marker=".", color="tab:purple", label="search rate")
    top.axhline(summary["target"], color="tab:green", linestyle="--", label=f"target ({summary['target']:g})")
    if summary.get("task", "synthetic") == "synthetic":
        top.axhline(summary["chance"], color="gray", linestyle=":",
                    label=f"chance: a random shown digit ({summary['chance']:.2f})")
    top.set_ylabel("mean of groups\ngenerated at this version")
    top.set_ylim(-0.02, 1.02)
    top.legend(**LEGEND_BESIDE)
    top.grid(alpha=0.3)
    top.set_title(f"stoa quickstart: GRPO on the {summary.get('task', 'synthetic')} task")
    bottom.bar(list(patches), [b / 1e3 for b in patches.values()], color="tab:orange", label="PULSE patch")
    bottom.axhline(summary["full_bytes"] / 1e3, color="gray", linestyle="--", label="full bf16 sync")
    bottom.set_ylabel("KB per version")
    bottom.set_xlabel("weight version")
    bottom.legend(**LEGEND_BESIDE)
    bottom.grid(alpha=0.3)
    return fig
