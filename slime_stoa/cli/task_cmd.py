"""`stoa task prepare`: put a task's prompts and labels in the bucket for workers and trainer."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import PreconditionFailed, Store, StoreError, open_store
from slime_stoa.tasks import TASKS, encode_task_data, generate_items, load_gsm8k_jsonl

from .common import add_run_options, os_error_text, require_run_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    task = sub.add_parser("task", help="prepare a run's task data in the bucket", description=__doc__)
    cmds = task.add_subparsers(title="task commands", metavar="COMMAND", required=True)
    prep = cmds.add_parser(
        "prepare",
        help="write task data (GSM8K from its jsonl files; the synthetic task generated)",
        description=(
            "gsm8k: one object per file, its split named after the file (train.jsonl -> train). "
            "synthetic: --count items generated from --seed into --split."
        ),
    )
    prep.add_argument("task", choices=sorted(TASKS), help="task name")
    prep.add_argument("files", nargs="*", type=Path, help="source files (gsm8k: train.jsonl, test.jsonl)")
    add_run_options(prep)
    prep.add_argument("--split", default=None, help="split name (synthetic: default train)")
    prep.add_argument("--count", type=int, default=2000, help="synthetic: number of items")
    prep.add_argument("--seed", type=int, default=0, help="synthetic: generation seed")
    prep.add_argument("--limit", type=int, default=None, help="gsm8k: keep only the first N items per file")
    prep.set_defaults(handler=_prepare)


def task_objects(task: str, files: list[Path], *, split: str | None, count: int, seed: int, limit: int | None) -> dict[str, bytes]:
    """{split: encoded task data} for the `prepare` command (pure but for reading `files`)."""
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
        items = load_gsm8k_jsonl(path, limit=limit)
        out[split or path.name.split(".")[0]] = encode_task_data(task, items, meta={"source": path.name})
    return out


async def put_task_objects(store: Store, run: str, task: str, objects: dict[str, bytes]) -> list[str]:
    """Write each split with put-if-absent; an identical existing object is fine."""
    layout = RunLayout(run)
    written = []
    for split, data in objects.items():
        key = layout.task_data(task, split)
        try:
            await store.put_if_absent(key, data)
        except PreconditionFailed:
            if await store.get_bytes(key) != data:
                raise ValueError(f"{key} already holds different data; tasks are immutable within a run") from None
        written.append(key)
    return written


async def _put(url: str, run: str, task: str, objects: dict[str, bytes]) -> list[str]:
    async with open_store(url) as store:
        return await put_task_objects(store, run, task, objects)


def _prepare(args: argparse.Namespace) -> int:
    url, run = require_run_options(args)
    try:
        objects = task_objects(args.task, args.files, split=args.split, count=args.count, seed=args.seed, limit=args.limit)
        keys = asyncio.run(_put(url, run, args.task, objects))
    except OSError as exc:
        print(f"error: {os_error_text(exc)}", file=sys.stderr)
        return 1
    except (StoreError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for key, data in zip(keys, objects.values(), strict=True):
        print(f"wrote {key} ({len(data):,} bytes)")
    return 0
