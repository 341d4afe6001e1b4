"""What `stoa rollouts show` and `stoa rollouts stats` print: pure functions of judged records.

`show` marks a sample's parts: ``[model]`` text the model sampled, ``[tool]`` an observation a tool
returned (a tool episode: the sample's mask is 0 there). `stats` groups samples by weight version: the trainer's mean
reward, response lengths and the search rate (samples that called a tool at least once).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from .rollouts_read import RecordView, SampleView

MAX_SHOWN_CHARS = 2000  # of one text part; the rest is elided with a count
_CONDITION = re.compile(r"\s*(>=|<=|==|!=|>|<|=)?\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))\s*")
_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b,
    "=": lambda a, b: a == b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
}


def reward_condition(text: str) -> Callable[[float], bool]:
    """`--reward`: "1", "=0", ">0.5", "<=0.2", "!=0" as a test on one sample's reward; ValueError."""
    m = _CONDITION.fullmatch(text)
    if not m:
        raise ValueError(f"--reward takes a number with an optional comparison (1, >0.5, <=0.2, !=0), got {text!r}")
    op, bound = _OPS[m.group(1) or "="], float(m.group(2))
    return lambda reward: op(reward, bound)


def _clip(text: str) -> str:
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return f"{text[:MAX_SHOWN_CHARS]}... [{len(text) - MAX_SHOWN_CHARS:,} more characters]"


def _indent(text: str, prefix: str = "      ") -> str:
    return "\n".join(prefix + line for line in _clip(text).splitlines() or [""])


def _number(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def sample_lines(i: int, s: SampleView) -> list[str]:
    reward = "refused" if s.reward is None else f"{s.reward:g}"
    worker = "" if s.reward is not None and s.worker_reward == s.reward else f" (worker said {s.worker_reward:g})"
    head = (
        f"  sample {i}: reward {reward}{worker}, {s.finish_reason}, {s.tokens} tokens"
        + (f" ({s.model_tokens} sampled, {s.turns} turns, {s.tool_calls} tool calls)" if s.tool_calls else "")
        + f", logprob mean {_number(s.logprob_mean)} min {_number(s.logprob_min)}"
    )
    lines = [head]
    for kind, text in s.segments:
        lines.append(f"    [{kind}]")
        lines.append(_indent(text))
    return lines


def record_lines(view: RecordView) -> list[str]:
    """The text block of one record."""
    key, g = view.key, view.group
    when = datetime.fromtimestamp(key.timestamp_ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [f"== {view.name}  worker {key.worker} seq {key.seq}  {when}"]
    if g is not None:
        lines.append(f"  task {g.task_id} prompt {g.prompt_index}, weights v{g.weight_version}, {len(g.samples)} samples, plane {g.plane}")
    if view.refused is not None:
        lines.append(f"  REFUSED ({view.refused[0]}): {view.refused[1]}")
    if view.consumer:
        lines.append(f"  trainer: {view.consumer}")
    if view.prompt is not None:
        lines.append("  prompt:")
        lines.append(_indent(view.prompt, "    "))
        lines.append(f"  label: {view.label}")
    for i, s in enumerate(view.samples):
        lines.extend(sample_lines(i, s))
    return lines


@dataclass
class VersionStats:
    """Totals of one weight version's records."""

    version: int
    records: int = 0
    refused: int = 0
    samples: int = 0
    rewards: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    searched: int = 0

    def add(self, view: RecordView) -> None:
        self.records += 1
        if view.refused is not None:
            self.refused += 1
            return
        for s in view.samples:
            self.samples += 1
            if s.reward is not None:
                self.rewards.append(s.reward)
            self.lengths.append(s.model_tokens)
            self.searched += s.tool_calls > 0

    def row(self) -> dict[str, float | int | None]:
        lengths = sorted(self.lengths)
        return {
            "version": self.version,
            "records": self.records,
            "refused": self.refused,
            "samples": self.samples,
            "reward_mean": sum(self.rewards) / len(self.rewards) if self.rewards else None,
            "length_mean": sum(lengths) / len(lengths) if lengths else None,
            "length_median": float(lengths[len(lengths) // 2]) if lengths else None,
            "length_max": lengths[-1] if lengths else None,
            "search_rate": self.searched / self.samples if self.samples else None,
        }


def version_stats(views: Iterable[RecordView]) -> tuple[list[dict[str, float | int | None]], int]:
    """(one row per weight version, ascending; records that did not decode, so have no version)."""
    by_version: dict[int, VersionStats] = {}
    undecoded = 0
    for view in views:
        if view.group is None:
            undecoded += 1
            continue
        v = view.group.weight_version
        by_version.setdefault(v, VersionStats(v)).add(view)
    return [by_version[v].row() for v in sorted(by_version)], undecoded


STATS_COLUMNS = ("version", "records", "refused", "samples", "reward_mean", "length_mean", "length_median", "length_max", "search_rate")


def stats_table(rows: list[dict[str, float | int | None]]) -> list[str]:
    """The rows as an aligned text table (response lengths in sampled tokens)."""
    header = ("version", "records", "refused", "samples", "reward", "len mean", "len median", "len max", "search")
    cells: list[tuple[str, ...]] = [header]
    for r in rows:
        cells.append(tuple(
            "-" if r[c] is None else (f"{r[c]:.3f}" if isinstance(r[c], float) and c in ("reward_mean", "search_rate") else
                                     f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]))
            for c in STATS_COLUMNS
        ))
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in cells]


__all__ = ["STATS_COLUMNS", "record_lines", "reward_condition", "stats_table", "version_stats"]
