"""Tasks: prompts, labels, chat messages and pure rewards, shared by workers and the trainer.

The run's task data lives in the bucket (`encode_task_data`); workers and the trainer read it
back with `load_task`, which looks the task class up in `TASKS` by the name in the header.
Pure Python: imports neither torch, mlx nor slime.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from slime_stoa.tasks.base import (
    DEFAULT_MAX_TASK_BYTES,
    FORMAT,
    RESERVED_KEYS,
    Task,
    TaskItem,
    check_task_name,
    decode_task_data,
    encode_task_data,
)
from slime_stoa.tasks.gsm8k import (
    GSM8K,
    answers_equal,
    extract_answer,
    load_gsm8k_jsonl,
)
from slime_stoa.tasks.math_task import MathTask
from slime_stoa.tasks.search import Search
from slime_stoa.tasks.synthetic import Synthetic, generate_items, warmup_pairs

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (GSM8K, MathTask, Synthetic)}
TASKS[Search.name] = Search  # questions answered by searching a corpus (tasks/search/)


def make_task(name: str, items: Iterable[TaskItem], meta: Mapping[str, Any] | None = None) -> Task:
    """An instance of the registered task `name` over `items`.

    `meta` may be a decoded header: its "format", "task" and "count" keys are dropped.
    """
    cls = TASKS.get(name)
    if cls is None:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    meta = {k: v for k, v in (meta or {}).items() if k not in RESERVED_KEYS}
    return cls(items, meta=meta)


def load_task(data: bytes, *, max_bytes: int = DEFAULT_MAX_TASK_BYTES) -> Task:
    """Decode task data (see `decode_task_data`) into its registered task."""
    header, items = decode_task_data(data, max_bytes=max_bytes)
    return make_task(header["task"], items, header)


__all__ = [
    "DEFAULT_MAX_TASK_BYTES",
    "FORMAT",
    "GSM8K",
    "TASKS",
    "MathTask",
    "Synthetic",
    "Task",
    "TaskItem",
    "answers_equal",
    "check_task_name",
    "decode_task_data",
    "encode_task_data",
    "extract_answer",
    "generate_items",
    "load_gsm8k_jsonl",
    "load_task",
    "make_task",
    "warmup_pairs",
]
