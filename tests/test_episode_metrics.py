"""The consumer's per-batch metrics of tool episodes (trainer/consumer/metrics.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from slime_stoa.tasks.tool_format import ToolFormat
from slime_stoa.trainer.consumer.metrics import episode_metrics


def sample(mask: list[int], calls: int, turns: int) -> SimpleNamespace:
    return SimpleNamespace(mask=np.array(mask, dtype=np.uint8), tool_calls=calls, turns=turns)


def group(worker: str, *samples_texts: tuple[SimpleNamespace, str]) -> SimpleNamespace:
    return SimpleNamespace(worker=worker, group=SimpleNamespace(samples=[s for s, _ in samples_texts]),
                           texts=tuple(t for _, t in samples_texts))


def test_search_rate_turns_tool_tokens_and_format_errors_per_batch_and_worker() -> None:
    searched = sample([1, 1, 0, 0, 0, 1], calls=1, turns=2), "<search>q</search><information>x</information><answer>a</answer>"
    direct = sample([1, 1], calls=0, turns=1), "<answer>b</answer>"
    unfinished = sample([1, 0, 0, 1], calls=1, turns=2), "<search>q</search><information>y</information> and then"
    got = episode_metrics([group("mac-a", searched, direct), group("mac-b", unfinished, direct)], ToolFormat())
    assert got["rollout/stoa_search_rate"] == 0.5
    assert got["rollout/stoa_tool_calls_mean"] == 0.5 and got["rollout/stoa_turns_mean"] == pytest.approx(1.5)
    assert got["rollout/stoa_tool_tokens_mean"] == pytest.approx((3 + 0 + 2 + 0) / 4)
    assert got["rollout/stoa_format_error_rate"] == 0.25
    assert got["worker/mac-a/search_rate"] == 0.5 and got["worker/mac-a/format_error_rate"] == 0.0
    assert got["worker/mac-b/search_rate"] == 0.5 and got["worker/mac-b/format_error_rate"] == 0.5


def test_a_single_turn_task_or_an_empty_batch_gives_none() -> None:
    assert episode_metrics([group("mac-a", (sample([1], 0, 1), "4"))], None) == {}
    assert episode_metrics([], ToolFormat()) == {}
