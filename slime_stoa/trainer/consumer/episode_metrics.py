"""Per-batch metrics of a tool task's episodes (record schema v2): what the search agent did.

    rollout/stoa_search_rate         share of samples that called the tool at least once
    rollout/stoa_tool_calls_mean     tool calls per sample
    rollout/stoa_turns_mean          model turns per sample
    rollout/stoa_tool_tokens_mean    tool (observation) tokens per sample, the mask's zeros
    rollout/stoa_format_error_rate   share of samples with no final answer: the text never
                                     closes one (`ToolFormat.answer_close`)
    worker/<id>/search_rate, worker/<id>/format_error_rate   the same per worker

Pure: a function of the batch's groups (their records and decoded texts) and the task's format.
Single-turn batches give no such metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from slime_stoa.tasks.tool_format import ToolFormat


def episode_metrics(groups: Sequence[Any], tool_format: ToolFormat | None) -> dict[str, float]:
    """The metrics above for `groups` (each with `.group`, a RolloutGroup, `.texts` and `.worker`);
    empty for a single-turn task."""
    if tool_format is None:
        return {}
    rows: list[tuple[str, int, int, int, bool]] = []  # worker, calls, turns, tool tokens, format error
    for g in groups:
        for sample, text in zip(g.group.samples, g.texts, strict=True):
            tool_tokens = int(np.count_nonzero(np.asarray(sample.mask) == 0))
            rows.append((g.worker, sample.tool_calls, sample.turns, tool_tokens, tool_format.answer_close not in text))
    if not rows:
        return {}
    n = len(rows)
    out = {
        "rollout/stoa_search_rate": sum(r[1] > 0 for r in rows) / n,
        "rollout/stoa_tool_calls_mean": sum(r[1] for r in rows) / n,
        "rollout/stoa_turns_mean": sum(r[2] for r in rows) / n,
        "rollout/stoa_tool_tokens_mean": sum(r[3] for r in rows) / n,
        "rollout/stoa_format_error_rate": sum(r[4] for r in rows) / n,
    }
    for worker in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == worker]
        out[f"worker/{worker}/search_rate"] = sum(r[1] > 0 for r in mine) / len(mine)
        out[f"worker/{worker}/format_error_rate"] = sum(r[4] for r in mine) / len(mine)
    return {k: float(v) for k, v in out.items()}
