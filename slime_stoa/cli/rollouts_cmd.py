"""`stoa rollouts`: look inside a run's rollout records.

`show` prints records, newest first: the prompt and label, each sample with its model turns and
tool observations marked, the trainer's reward (and the worker's when it differs), a logprob
summary, and why the trainer refuses a record (or what its saved state says of it). `stats`
prints, per weight version, the trainer's mean reward, response lengths and the search rate.
Records are judged as the trainer judges them; one that cannot be read is reported and skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from slime_stoa.protocol.store import StoreError, open_store

from .common import add_run_options, os_error_text, require_run_options
from .rollouts_read import RecordFilter, RecordView, RunRecords
from .rollouts_show import record_lines, reward_condition, stats_table, version_stats

DEFAULT_SCAN = 10_000  # records read at most by one command


def add_parser(sub: argparse._SubParsersAction) -> None:
    rollouts = sub.add_parser("rollouts", help="look inside a run's rollout records", description=__doc__)
    cmds = rollouts.add_subparsers(title="rollouts commands", metavar="COMMAND", required=True)
    show = cmds.add_parser("show", help="print records: prompt, samples (tool turns marked), rewards, refusals")
    _common(show)
    show.add_argument("--limit", type=int, default=5, help="records to print (default: 5)")
    show.set_defaults(handler=_show)
    stats = cmds.add_parser("stats", help="per weight version: reward, response lengths, search rate")
    _common(stats)
    stats.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    stats.set_defaults(handler=_stats)


def _common(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser)
    parser.add_argument("--version", type=int, default=None, help="only records sampled from this weight version")
    parser.add_argument("--worker", default=None, help="only this worker's records")
    parser.add_argument("--task", default=None, help="only records of this task")
    parser.add_argument("--reward", default=None, metavar="COND", help="only records with a sample whose reward matches: 1, >0.5, <=0.2, !=0")
    parser.add_argument("--scan", type=int, default=DEFAULT_SCAN, help=f"read at most this many records, newest first (default: {DEFAULT_SCAN})")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a local model folder with tokenizer.json (default: the run's latest anchor's)")


def _filter(args: argparse.Namespace) -> RecordFilter:
    if args.scan < 1:
        raise ValueError("--scan must be >= 1")
    condition = None if args.reward is None else reward_condition(args.reward)
    return RecordFilter(version=args.version, worker=args.worker, task=args.task, reward=condition)


def _report_unreadable(records: RunRecords) -> None:
    for key, why in records.unreadable:
        print(f"skipped {key}: {why}", file=sys.stderr)


async def _show_records(url: str, run: str, args: argparse.Namespace) -> int:
    record_filter = _filter(args)
    if args.limit < 1:
        raise ValueError("--limit must be >= 1")
    async with open_store(url) as store:
        records = await RunRecords.open(store, run, tokenizer_dir=args.tokenizer)
        if records.state_problem:
            print(f"note: {records.state_problem}", file=sys.stderr)
        shown = 0
        async for view in records.records(record_filter, newest_first=True, scan=args.scan):
            print("\n".join(record_lines(view)) + "\n")
            shown += 1
            if shown >= args.limit:
                break
    _report_unreadable(records)
    if not shown:
        print("no records match")
    return 0


async def _collect(url: str, run: str, args: argparse.Namespace) -> tuple[list[RecordView], RunRecords]:
    record_filter = _filter(args)
    async with open_store(url) as store:
        records = await RunRecords.open(store, run, tokenizer_dir=args.tokenizer)
        views = [view async for view in records.records(record_filter, newest_first=True, scan=args.scan)]
    return views, records


def _run(handler: Callable[[str, str, argparse.Namespace], Coroutine[Any, Any, int]], args: argparse.Namespace) -> int:
    url, run = require_run_options(args)
    try:
        return asyncio.run(handler(url, run, args))
    except OSError as exc:
        print(f"error: {os_error_text(exc)}", file=sys.stderr)
    except (StoreError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
    return 1


def _show(args: argparse.Namespace) -> int:
    return _run(_show_records, args)


async def _print_stats(url: str, run: str, args: argparse.Namespace) -> int:
    views, records = await _collect(url, run, args)
    _report_unreadable(records)
    rows, undecoded = version_stats(views)
    if not rows:
        print("no records match")
    else:
        print("\n".join(stats_table(rows)))
    if undecoded:
        print(f"{undecoded} record(s) did not decode (no version): see `stoa rollouts show`")
    if args.json is not None:
        args.json.write_text(json.dumps({"run": run, "versions": rows, "undecoded": undecoded}, indent=2) + "\n")
    return 0


def _stats(args: argparse.Namespace) -> int:
    return _run(_print_stats, args)
