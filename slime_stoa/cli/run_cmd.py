"""`stoa run`: create a run (its manifest in the bucket) and show it."""

from __future__ import annotations

import argparse
import asyncio
import sys

from slime_stoa.protocol.run_manifest import PLANES, RunManifest, read_run_manifest
from slime_stoa.protocol.store import (
    PreconditionFailed,
    StoreError,
    open_store,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="create a run or show its manifest", description=__doc__)
    cmds = run.add_subparsers(title="run commands", metavar="COMMAND", required=True)

    create = cmds.add_parser(
        "create",
        help="write a run's manifest: model, task, sampling and limits",
        description="Write runs/<run>/run.json. Workers read everything they need from it.",
    )
    create.add_argument("store", help="bucket URL, e.g. file:///tmp/bucket or r2://<account>/<bucket>")
    create.add_argument("--run", required=True, help="run name")
    create.add_argument("--model", required=True, help="model reference for people (HF id or folder)")
    create.add_argument("--task", required=True, help="task name, e.g. gsm8k or synthetic")
    create.add_argument("--task-split", default="train", help="task file workers draw prompts from")
    create.add_argument("--plane", choices=PLANES, default="bf16", help="what workers serve")
    create.add_argument("--temperature", type=float, default=1.0)
    create.add_argument("--max-tokens", type=int, default=512, help="longest response")
    create.add_argument("--max-prompt-tokens", type=int, default=1024)
    create.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    create.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    create.add_argument("--staleness-limit", type=int, default=4, help="versions a group may lag when used")
    create.add_argument("--reuse-limit", type=int, default=1, help="times a group may be used")
    create.add_argument("--vocab-size", type=int, default=0, help="model vocabulary (0: from the anchor)")
    create.set_defaults(handler=_run_create)

    show = cmds.add_parser("show", help="print a run's manifest")
    show.add_argument("store", help="bucket URL")
    show.add_argument("--run", required=True, help="run name")
    show.set_defaults(handler=_run_show)


def manifest_from_args(args: argparse.Namespace) -> RunManifest:
    return RunManifest(
        run=args.run,
        model=args.model,
        task=args.task,
        task_split=args.task_split,
        plane=args.plane,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        group_size=args.group_size,
        stop=tuple(args.stop),
        staleness_limit=args.staleness_limit,
        reuse_limit=args.reuse_limit,
        vocab_size=args.vocab_size,
    )


async def create_run(url: str, manifest: RunManifest) -> None:
    async with open_store(url) as store:
        await store.put_if_absent(manifest.layout.run_manifest, manifest.to_bytes())


async def read_run(url: str, run: str) -> RunManifest:
    async with open_store(url) as store:
        return await read_run_manifest(store, run)  # RunNotFound is a ValueError


def _run_create(args: argparse.Namespace) -> int:
    try:
        manifest = manifest_from_args(args)
        asyncio.run(create_run(args.store, manifest))
    except PreconditionFailed:
        print(f"error: run {args.run!r} already exists in {args.store}; pick another name", file=sys.stderr)
        return 1
    except (StoreError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"created run {manifest.run!r} in {args.store}: task {manifest.task}, group size {manifest.group_size}, "
          f"temperature {manifest.temperature}, plane {manifest.plane}")
    return 0


def _run_show(args: argparse.Namespace) -> int:
    try:
        manifest = asyncio.run(read_run(args.store, args.run))
    except (StoreError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(manifest.to_bytes().decode())
    return 0
