"""A run's task objects: each split's encoded task data (`encode_task_data`), built from source
files or generated, and written to the bucket put-if-absent (tasks are immutable within a run)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import PreconditionFailed, Store
from slime_stoa.protocol.task_manifest import write_task_manifest
from slime_stoa.tasks.base import encode_task_data
from slime_stoa.tasks.gsm8k import load_gsm8k_jsonl
from slime_stoa.tasks.math_data import load_math, split_name
from slime_stoa.tasks.synthetic import generate_items


def task_objects(
    task: str, files: list[Path], *, split: str | None, count: int, seed: int, limit: int | None,
    on_file: Callable[[int], None] | None = None,
) -> dict[str, bytes]:
    """{split: encoded task data} of `stoa task prepare` for gsm8k (one split per file, named
    after it), math (one split per MATH folder or JSON-lines file, named after it) or synthetic
    (generated; pure but for reading `files`). `on_file(n)` after each of the `n` files read."""
    if task == "synthetic":
        if files:
            raise ValueError("the synthetic task is generated: give no files (use --count and --seed)")
        return {split or "train": encode_task_data(task, generate_items(count, seed=seed), meta={"seed": seed})}
    if not files:
        raise ValueError(f"give the {task} files to prepare, e.g. train.jsonl test.jsonl")
    if split and len(files) > 1:
        raise ValueError("--split names one file's split; give one file or drop --split")
    out = {}
    for path in files:
        items = load_math(path, limit=limit) if task == "math" else load_gsm8k_jsonl(path, limit=limit)
        name = split or split_name(path)
        if name in out:
            raise ValueError(f"two sources give the split {name!r}; give them one at a time with --split")
        out[name] = encode_task_data(task, items, meta={"source": path.name})
        if on_file is not None:
            on_file(len(out))
    return out


async def put_task_objects(
    store: Store, run: str, task: str, objects: dict[str, bytes], *, key: SigningKey | None = None,
    trust: RunTrust | None = None,
) -> list[str]:
    """Write each split with put-if-absent; an identical existing object is fine. The keys written,
    in the order of `objects`. With the run key `key` (a signed run), the task manifest signing
    them is written after them (`protocol.task_manifest`); `trust`: the run keys an existing
    manifest may be signed by (default: `key`)."""
    layout = RunLayout(run)
    written = []
    for split, data in objects.items():
        where = layout.task_data(task, split)
        try:
            await store.put_if_absent(where, data)
        except PreconditionFailed:
            if await store.get_bytes(where) != data:
                raise ValueError(f"{where} already holds different data; tasks are immutable within a run") from None
        written.append(where)
    if key is not None:
        await write_task_manifest(store, run, task, objects, key, trust or RunTrust(run, key.public))
    return written


__all__ = ["put_task_objects", "task_objects"]
