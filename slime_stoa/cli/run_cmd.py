"""`stoa run`: create a run (its manifest in the bucket) and show it."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import replace
from pathlib import Path

from slime_stoa.protocol.hf.architectures import unsupported_model
from slime_stoa.protocol.run_manifest import DEFAULT_RETAIN_ANCHORS, PLANES, RunManifest, read_run_manifest
from slime_stoa.protocol.signing import SigningKey, read_key_file
from slime_stoa.protocol.store import (
    PreconditionFailed,
    StoreError,
    open_store,
)
from slime_stoa.tasks import TASKS

from .common import REFUSED, add_run_options, require_run_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="create a run or show its manifest", description=__doc__)
    cmds = run.add_subparsers(title="run commands", metavar="COMMAND", required=True)

    create = cmds.add_parser(
        "create",
        help="write a run's manifest: model, task, sampling and limits",
        description="Write runs/<run>/run.json. Workers read everything they need from it.",
    )
    add_run_options(create)
    create.add_argument(
        "--model", required=True,
        help="model reference for people (HF id or folder); a folder must hold a model of a supported family",
    )
    create.add_argument("--task", required=True, help="task name, e.g. gsm8k or synthetic")
    create.add_argument("--task-split", default="train", help="task file workers draw prompts from")
    create.add_argument("--plane", choices=PLANES, default="bf16", help="what workers serve")
    create.add_argument(
        "--planes", default="", metavar="LIST",
        help="quantized planes the trainer publishes beside the bf16 weights, comma-separated (int8, int4): "
        "a Mac on one holds that plane alone, and picks a smaller one when the run's plane does not fit its memory",
    )
    create.add_argument("--temperature", type=float, default=1.0)
    create.add_argument("--max-tokens", type=int, default=512, help="longest response")
    create.add_argument("--max-prompt-tokens", type=int, default=1024)
    create.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    create.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    create.add_argument("--staleness-limit", type=int, default=4, help="versions a group may lag when used")
    create.add_argument("--reuse-limit", type=int, default=1, help="times a group may be used")
    create.add_argument("--vocab-size", type=int, default=0, help="model vocabulary (0: from the anchor)")
    create.add_argument(
        "--retain-anchors", type=int, default=DEFAULT_RETAIN_ANCHORS, metavar="N",
        help="weight versions kept in the bucket: the last N anchors and every version after the oldest of "
        f"them; older ones are deleted (0: keep all; default {DEFAULT_RETAIN_ANCHORS}). A trainer's "
        "stoa_retain_anchors setting overrides it",
    )
    create.add_argument(
        "--dynamic-sampling", action="store_true",
        help="workers do not upload groups whose rewards are all equal (no GRPO signal); they count them",
    )
    create.add_argument(
        "--skip-solved-after", type=int, default=0, metavar="N",
        help="a worker stops drawing a prompt once its last N groups were all correct (0: never)",
    )
    create.add_argument(
        "--key", type=Path, metavar="PATH",
        help="sign the run with this key file (`stoa keys create`): the manifest carries its public key, "
        "workers pin it and refuse weights it did not sign",
    )
    create.set_defaults(handler=_run_create)

    show = cmds.add_parser("show", help="print a run's manifest")
    add_run_options(show)
    show.set_defaults(handler=_run_show)


def manifest_from_args(args: argparse.Namespace) -> RunManifest:
    if args.task not in TASKS:
        raise ValueError(f"unknown task {args.task!r}: choose one of {', '.join(sorted(TASKS))}")
    return RunManifest(
        run=args.run,
        model=args.model,
        task=args.task,
        task_split=args.task_split,
        plane=args.plane,
        planes=tuple(p.strip() for p in args.planes.split(",") if p.strip()),  # checked by RunManifest
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        group_size=args.group_size,
        stop=tuple(args.stop) + tuple(s for s in TASKS[args.task].run_stop if s not in args.stop),
        staleness_limit=args.staleness_limit,
        reuse_limit=args.reuse_limit,
        vocab_size=args.vocab_size,
        retain_anchors=args.retain_anchors,
        dynamic_sampling=args.dynamic_sampling,
        skip_solved_after=args.skip_solved_after,
    )


async def create_run(url: str, manifest: RunManifest, key: SigningKey | None = None) -> None:
    """Write the run manifest (signed by `key`, which must be its run_key, when given)."""
    async with open_store(url) as store:
        await store.put_if_absent(manifest.layout.run_manifest, manifest.to_bytes(key))


async def read_run(url: str, run: str) -> RunManifest:
    async with open_store(url) as store:
        return await read_run_manifest(store, run)  # RunNotFound is a ValueError


def _run_create(args: argparse.Namespace) -> int:
    require_run_options(args)
    # A folder is checked now: a family workers cannot run would be accepted by the bucket and fail
    # on every Mac later. An HF id is only a name here; its weights are checked at publish-anchor.
    folder = Path(args.model).expanduser()
    if folder.is_dir() and (why := unsupported_model(folder)):
        print(f"error: {why}", file=sys.stderr)
        return REFUSED
    try:
        manifest = manifest_from_args(args)
        key = read_key_file(args.key) if args.key is not None else None
        if key is not None:
            manifest = replace(manifest, run_key=key.public.to_text())
        asyncio.run(create_run(args.store, manifest, key))
    except PreconditionFailed:
        print(f"error: run {args.run!r} already exists in {args.store}; pick another name", file=sys.stderr)
        return 1
    except (StoreError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"created run {manifest.run!r} in {args.store}: task {manifest.task}, group size {manifest.group_size}, "
          f"temperature {manifest.temperature}, plane {manifest.plane}; {retention_text(manifest.retain_anchors)}")
    if key is not None:
        print(f"signed with run key {key.key_id} ({key.public.fingerprint}); workers pin it at `macd join`")
    print(SINGLE_BUCKET_NOTE)
    return 0


#: What a worker's token can do when workers and trainer share this one bucket (see docs/protocol.md).
SINGLE_BUCKET_NOTE = (
    "single-bucket mode (workers write to this same bucket): a worker's token can overwrite or delete ANY key of "
    "this run (weights, pointer, registry, trainer state, other workers' records), though it cannot forge them; "
    "the trainer puts back what it signed from its own copies (stoa_keep_dir: by default under slime's --save), "
    "and a separate rollouts bucket (rollouts_url) confines workers to their records"
)


def retention_text(retain_anchors: int) -> str:
    """What the run's weight retention keeps, in words."""
    if retain_anchors == 0:
        return "every weight version kept"
    return f"weights kept from the oldest of the last {retain_anchors} anchor(s) on"


def _run_show(args: argparse.Namespace) -> int:
    try:
        manifest = asyncio.run(read_run(*require_run_options(args)))
    except (StoreError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(manifest.to_bytes().decode())
    return 0
