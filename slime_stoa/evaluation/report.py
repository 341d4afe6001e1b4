"""Eval results per version and their files: CSV, JSON and a learning-curve PNG.

A `VersionResult` holds, per prompt, the k kept samples' trainer rewards, truncation flags and
(tool tasks) tool calls. Its `row` is what every writer prints:

    version, split, k, n_prompts, pass@1, pass@k, reward_mean, search_rate, match

`search_rate` (the share of samples with at least one observation, invalid-action feedback
included) is None for a single-turn task (no tool format: its results count no tool calls). `match` is the
answer match mode the rewards were scored with (a search task's "em", "cover_em" or "subem",
`task_match`); the row has it only when the result was given one (CSV: empty otherwise).

pass@1 and pass@k are of the task's reward (for a search task: its `match` mode, strict EM
under the `papersearchqa` preset). A search task's rows also carry `pass@1_em` and
`pass@1_cover_em`, the pass@1 of exact match and of cover-EM whatever the reward's mode
(`Search.answer_matches`), so runs scored differently compare; empty for other tasks.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .passk import DEFAULT_PASS_THRESHOLD, mean_pass_at_k

COLUMNS = ("version", "split", "k", "n_prompts", "pass@1", "pass@k", "reward_mean", "search_rate", "match",
           "pass@1_em", "pass@1_cover_em")
REPORTED_MATCHES = ("em", "cover_em")


def answer_matches(task: Any, text: str, label: str) -> dict[str, float] | None:
    """EM and cover-EM of one sample when `task` reports them (a search task), else None."""
    fn = getattr(task, "answer_matches", None)
    return fn(text, label) if fn is not None else None


def task_match(task: Any) -> str | None:
    """The match mode of `task`'s reward (a search task's `config.match`), None if it has none."""
    match = getattr(getattr(task, "config", None), "match", None)
    return match if isinstance(match, str) else None


@dataclass(frozen=True)
class PromptResult:
    prompt_index: int
    rewards: tuple[float, ...]
    truncated: tuple[bool, ...]
    tool_calls: tuple[int, ...] | None = None  # None: single-turn samples
    matches: tuple[dict[str, float], ...] | None = None  # per sample, `answer_matches` (None: not reported)


@dataclass(frozen=True)
class VersionResult:
    version: int
    split: str
    k: int
    prompts: tuple[PromptResult, ...]
    threshold: float = DEFAULT_PASS_THRESHOLD  # a sample passes with reward >= this
    match: str | None = None  # the reward's answer match mode (`task_match`)

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError(f"v{self.version}: no prompt was evaluated")
        short = [p.prompt_index for p in self.prompts if len(p.rewards) < self.k]
        if short:
            raise ValueError(f"v{self.version}: prompts {short[:10]} have fewer than k={self.k} samples")

    def row(self) -> dict[str, Any]:
        rewards = [p.rewards for p in self.prompts]
        calls = [c for p in self.prompts if p.tool_calls is not None for c in p.tool_calls]
        flat = [r for rs in rewards for r in rs]
        row = {
            "version": self.version,
            "split": self.split,
            "k": self.k,
            "n_prompts": len(self.prompts),
            "pass@1": mean_pass_at_k(rewards, 1, self.threshold),
            "pass@k": mean_pass_at_k(rewards, self.k, self.threshold),
            "reward_mean": sum(flat) / len(flat),
            "search_rate": sum(1 for c in calls if c > 0) / len(calls) if calls else None,
        }
        if self.match is not None:
            row["match"] = self.match
        if all(p.matches is not None for p in self.prompts):
            for kind in REPORTED_MATCHES:
                scores = [tuple(m[kind] for m in p.matches or ()) for p in self.prompts]
                row[f"pass@1_{kind}"] = mean_pass_at_k(scores, 1, self.threshold)
        return row


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: "" if row.get(c) is None else row[c] for c in COLUMNS})
    return path


def write_json(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """`{"versions": [row, ...]}`, one row per version (see the module doc)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"versions": list(rows)}, indent=2, sort_keys=True) + "\n")
    return path


def plot_curve(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """pass@1, pass@k (and the search rate, when known) against the weight version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r["version"])
    versions = [r["version"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(versions, [r["pass@1"] for r in rows], marker="o", label="pass@1")
    if rows:
        ax.plot(versions, [r["pass@k"] for r in rows], marker="s", label=f"pass@{rows[0]['k']}")
    searched = [(r["version"], r["search_rate"]) for r in rows if r.get("search_rate") is not None]
    if searched:
        ax.plot(*zip(*searched, strict=True), marker="^", linestyle="--", label="search rate")
    ax.set_xlabel("weight version")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    split = rows[0]["split"] if rows else ""
    ax.set_title(f"held-out eval ({split}, {rows[0]['n_prompts'] if rows else 0} prompts)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
