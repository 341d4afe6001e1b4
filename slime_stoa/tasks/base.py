"""Tasks: prompts with labels, the chat messages built from them, and a pure reward.

A task is a fixed, indexed list of `TaskItem`s (prompt text and label) plus two pure functions:
`Task.messages(item)` (what the tokenizer's chat template renders) and
`Task.reward(completion, label)` (a float in [0, 1]). Workers score their samples with it and the
trainer re-scores every sample with the same code, so a reward depends on nothing but the
completion text and the label, never raises, and runs in time linear in its input.

Task data travels through the bucket as one object (`encode_task_data` / `decode_task_data`):

    one zstd frame (content size and checksum present) of UTF-8 JSON lines:
    {"format": "stoa.task/1", "task": <name>, "count": <n>, ...meta}      header, keys sorted
    {"index": 0, "prompt": ..., "label": ...}                              n item lines
    ...

Item `i` has index `i`, so a record's `prompt_index` finds its item without a search. Encoding
is deterministic (same items and meta, same bytes), so re-uploading is idempotent. `meta` holds
JSON values that travel with the data; `system_prompt` (a string or null) is the one key tasks
read, the rest (source, seed, ...) is informational.

This module imports neither torch, mlx nor slime.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import zstandard

from slime_stoa.tasks.tool_format import ToolFormat

FORMAT = "stoa.task/1"
RESERVED_KEYS = frozenset({"format", "task", "count"})
DEFAULT_MAX_TASK_BYTES = 256 * 1024 * 1024  # cap on the object and on its decompressed size
ZSTD_LEVEL = 9  # task data is written once and read by every worker: favour size

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ITEM_KEYS = frozenset({"index", "prompt", "label"})


def check_task_name(name: object) -> str:
    """`name` if it is a valid task name (as in bucket keys), else ValueError."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"invalid task name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskItem:
    """One prompt of a task: its position `index`, the `prompt` text and the `label`."""

    index: int
    prompt: str
    label: str

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"TaskItem.index must be an int >= 0, got {self.index!r}")
        for field in ("prompt", "label"):
            value = getattr(self, field)
            if not isinstance(value, str):
                raise ValueError(f"TaskItem.{field} must be str, got {type(value).__name__}")


def check_items(items: Iterable[TaskItem]) -> tuple[TaskItem, ...]:
    """`items` as a tuple, checking that item `i` is a TaskItem with index `i`."""
    out = tuple(items)
    for i, item in enumerate(out):
        if not isinstance(item, TaskItem):
            raise ValueError(f"item {i} must be a TaskItem, got {type(item).__name__}")
        if item.index != i:
            raise ValueError(
                f"item at position {i} has index {item.index}: indices must be 0..n-1 in order "
                "(renumber a subset with dataclasses.replace(item, index=i))"
            )
    return out


def _check_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(meta, Mapping):
        raise ValueError(f"meta must be a mapping, got {type(meta).__name__}")
    clash = RESERVED_KEYS & set(meta)
    if clash:
        raise ValueError(f"meta may not set {sorted(clash)}: the header fills those in")
    if not all(isinstance(k, str) for k in meta):
        raise ValueError("meta keys must be strings")
    sp = meta.get("system_prompt")
    if sp is not None and not isinstance(sp, str):
        raise ValueError(f"meta['system_prompt'] must be a str or None, got {type(sp).__name__}")
    return dict(meta)


class Task(ABC):
    """A named list of items with chat messages and a pure reward.

    Subclasses set `name` and `default_system_prompt` and implement `reward`; they may override
    `messages`. `meta["system_prompt"]`, when present, replaces the default (None: no system
    message).
    """

    name: ClassVar[str]
    default_system_prompt: ClassVar[str | None] = None
    tool_format: ToolFormat | None = None
    """A tool task's episode format (`macd.episodes` runs multi-turn episodes); None: single-turn."""
    run_stop: ClassVar[tuple[str, ...]] = ()
    """Stop strings a run of this task needs (`stoa run create` adds them): a tool task's answer tag."""

    def __init__(self, items: Iterable[TaskItem], *, meta: Mapping[str, Any] | None = None):
        self.items: tuple[TaskItem, ...] = check_items(items)
        self.meta: Mapping[str, Any] = MappingProxyType(_check_meta(meta or {}))
        self.system_prompt: str | None = self.meta.get(
            "system_prompt", type(self).default_system_prompt
        )

    def __len__(self) -> int:
        return len(self.items)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.items)} items)"

    def item(self, index: int) -> TaskItem:
        """The item with this index (e.g. a record's prompt_index); ValueError if there is none."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"item index must be an int, got {type(index).__name__}")
        if not 0 <= index < len(self.items):
            raise ValueError(f"task {self.name!r} has no item {index} ({len(self.items)} items)")
        return self.items[index]

    def messages(self, item: TaskItem) -> list[dict[str, str]]:
        """Chat messages for the tokenizer's chat template: optional system, then the prompt."""
        msgs = []
        if self.system_prompt is not None:
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs.append({"role": "user", "content": item.prompt})
        return msgs

    @abstractmethod
    def reward(self, completion: str, label: str) -> float:
        """Score `completion` against `label` in [0, 1]. Pure; never raises; linear time."""

    def encode(self) -> bytes:
        """This task's data as a bucket object (see `encode_task_data`)."""
        return encode_task_data(self.name, self.items, meta=self.meta)


# ---------------------------------------------------------------------------------------------
# Task data (de)serialisation


def _dumps(obj: Any) -> str:
    # ASCII output: any str (lone surrogates included) encodes; sorted keys: deterministic bytes.
    return json.dumps(
        obj, ensure_ascii=True, allow_nan=False, sort_keys=True, separators=(",", ":")
    )


def encode_task_data(
    task_name: str, items: Iterable[TaskItem], *, meta: Mapping[str, Any]
) -> bytes:
    """Serialise items (indices 0..n-1) and JSON `meta` as one zstd frame of JSON lines."""
    check_task_name(task_name)
    items = check_items(items)
    header = {**_check_meta(meta), "format": FORMAT, "task": task_name, "count": len(items)}
    try:
        lines = [_dumps(header)]
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must hold JSON values only (no NaN): {e}") from None
    lines.extend(_dumps({"index": i.index, "prompt": i.prompt, "label": i.label}) for i in items)
    text = "\n".join(lines) + "\n"
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True)
    return cctx.compress(text.encode("ascii"))


def _decompress(data: bytes | bytearray | memoryview, max_bytes: int) -> bytes:
    """The frame's content, never allocating more than `max_bytes`; ValueError if malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"task data must be bytes, got {type(data).__name__}")
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > max_bytes:
        raise ValueError(f"task data is {size} bytes, over the limit of {max_bytes} (max_bytes)")
    data = bytes(data)
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise ValueError(f"task data is not a zstd frame: {e}") from None
    declared = params.content_size
    if declared == zstandard.CONTENTSIZE_UNKNOWN or declared == 0:
        raise ValueError("task data frame declares no content size; write it with encode_task_data")
    if declared > max_bytes:
        raise ValueError(f"task data declares {declared} bytes, over the limit of {max_bytes}")
    if params.dict_id:
        raise ValueError("task data frame needs a zstd dictionary; write it with encode_task_data")
    try:
        out = zstandard.ZstdDecompressor().decompress(
            data, max_output_size=max_bytes, allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise ValueError(f"task data is corrupt: {e}") from None
    if len(out) != declared:
        raise ValueError(f"task data frame gave {len(out)} bytes, declared {declared}")
    return out


def _loads(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested input
        raise ValueError(f"task data {where} is not valid JSON: {str(e)[:200]}") from None


def decode_task_data(
    data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_TASK_BYTES
) -> tuple[dict[str, Any], tuple[TaskItem, ...]]:
    """Parse `encode_task_data` output into (header, items); ValueError on anything malformed.

    The header dict holds "format", "task" and "count" plus the meta it was encoded with.
    `max_bytes` caps the object and its decompressed size.
    """
    raw = _decompress(data, max_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"task data is not UTF-8: {e}") from None
    if not text.endswith("\n"):
        raise ValueError("task data must end with a newline (truncated?)")
    lines = text[:-1].split("\n")
    header = _loads(lines[0], "header")
    if not isinstance(header, dict):
        raise ValueError("task data header must be a JSON object")
    if header.get("format") != FORMAT:
        raise ValueError(f"task data format is {header.get('format')!r}, expected {FORMAT!r}")
    check_task_name(header.get("task"))
    count = header.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count != len(lines) - 1:
        raise ValueError(f"task data header count {count!r} != {len(lines) - 1} item lines")
    _check_meta({k: v for k, v in header.items() if k not in RESERVED_KEYS})
    items = []
    for i, line in enumerate(lines[1:]):
        obj = _loads(line, f"item {i}")
        if not isinstance(obj, dict) or set(obj) != _ITEM_KEYS:
            raise ValueError(f"task data item {i} must be an object with keys {sorted(_ITEM_KEYS)}")
        if type(obj["index"]) is not int or obj["index"] != i:
            raise ValueError(f"task data item {i} has index {obj['index']!r}, expected {i}")
        try:
            items.append(TaskItem(index=i, prompt=obj["prompt"], label=obj["label"]))
        except ValueError as e:
            raise ValueError(f"task data item {i}: {e}") from None
    return header, tuple(items)
