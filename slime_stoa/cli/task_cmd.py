"""`stoa task prepare`: put a task's prompts and labels in the bucket for workers and trainer."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Iterable, Sized
from pathlib import Path
from typing import Any

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunNotFound, read_run_manifest
from slime_stoa.protocol.run_trust import RunTrust, load_rotations
from slime_stoa.protocol.signing import SigningKey, read_key_file
from slime_stoa.protocol.store import Store, StoreError, open_store
from slime_stoa.quickstart.meter import StepMeter, cli_console
from slime_stoa.tasks import TASKS, TaskItem
from slime_stoa.tasks.objects import put_task_objects, task_objects
from slime_stoa.tasks.search.data import Columns, iter_corpus, load_qa
from slime_stoa.tasks.search.presets import TASK_PRESETS, resolve
from slime_stoa.tasks.search.rewards import MATCH_KINDS
from slime_stoa.tasks.search.synthetic import generate as generate_search
from slime_stoa.tasks.search.synthetic import task_items as search_task_items
from slime_stoa.tasks.search.task import NO_ACTIONS, PROMPT_KINDS
from slime_stoa.tasks.search.tokenizer import PRESETS, Bm25Settings, PresetName
from slime_stoa.tasks.tool_format import LAYOUTS

from .common import add_run_options, os_error_text, require_run_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    task = sub.add_parser("task", help="prepare a run's task data in the bucket", description=__doc__)
    cmds = task.add_subparsers(title="task commands", metavar="COMMAND", required=True)
    prep = cmds.add_parser(
        "prepare",
        help="write task data (GSM8K from its jsonl files; MATH from its folders or jsonl files; the synthetic task generated; search with its index)",
        description=(
            "gsm8k: one object per file, its split named after the file (train.jsonl -> train). "
            "math: one object per MATH folder of problem .json files (MATH/test -> test) or jsonl file "
            "(test.jsonl -> test), each problem with a solution whose last \\boxed{} is the answer, or an answer. "
            "synthetic: --count items generated from --seed into --split. "
            "search: QA_FILE... CORPUS_FILE (the last file is the corpus; jsonl, or parquet with pyarrow), "
            "or --synthetic N generated questions and corpus; builds the BM25 index (streaming the corpus), "
            "uploads it in chunks, then one task object per question file. PaperSearchQA's released files "
            "are read as published: its question parquet files (question, golden_answers) and the "
            "Search-R1-layout corpus pubmed.jsonl (contents: a quoted title line, then the abstract)."
        ),
    )
    prep.add_argument("task", choices=sorted(TASKS), help="task name")
    prep.add_argument("files", nargs="*", type=Path, help="source files (gsm8k: train.jsonl, test.jsonl; math: MATH/train MATH/test, or jsonl files)")
    add_run_options(prep)
    prep.add_argument(
        "--key", type=Path, metavar="PATH",
        help="the run key file of a signed run (`stoa run create --key`): signs the task manifest "
        "(each task object's size and sha256) that the trainer and workers check the task data against",
    )
    prep.add_argument("--split", default=None, help="split name (synthetic: default train)")
    prep.add_argument("--count", type=int, default=2000, help="synthetic: number of items")
    prep.add_argument("--seed", type=int, default=0, help="synthetic: generation seed")
    prep.add_argument("--limit", type=int, default=None, help="gsm8k, math, search: keep only the first N items per file")
    search = prep.add_argument_group("search")
    search.add_argument("--synthetic", type=int, default=None, metavar="N", help="search: generate N questions and their corpus (with --seed)")
    search.add_argument("--question-field", default="question", help="question column (default: question)")
    search.add_argument("--answer-field", default="answer", help="answer column: a string or a list of strings (default: golden_answers when a row has it, else answer)")
    search.add_argument("--contents-field", default="contents", help="corpus passage column (default: contents)")
    search.add_argument("--title-field", default="title", help="corpus title column, used with --text-field when a row has no contents (default: title)")
    search.add_argument("--text-field", default="text", help="corpus text column (default: text)")
    search.add_argument("--preset", choices=sorted(TASK_PRESETS), default=None, help="settings of a published run, each flag below still applying over them: papersearchqa (PaperSearchQA / Search-R1: its prompt, --max-searches 2, top-3 whole passages, 500-token observations and turns, invalid-action feedback, strict EM, --bm25 search-r1)")
    search.add_argument("--match", choices=MATCH_KINDS, default=None, help="answer match of the reward: cover_em (the gold answer as whole words in the answer; default), em (exact) or subem (the gold answer as a substring, as Search-R1 scores)")
    search.add_argument("--top-k", type=int, default=None, help="passages per search (default: 3)")
    search.add_argument("--max-observation-chars", type=int, default=None, help="characters of passages per search, --observation stoa (default: 1500)")
    search.add_argument("--max-searches", type=int, default=None, help="searches per episode (default: 4)")
    search.add_argument("--prompt", choices=PROMPT_KINDS, default=None, help="stoa (a system prompt, then the question; default) or search-r1 (Search-R1's template around the question, one user message)")
    search.add_argument("--observation", choices=LAYOUTS, default=None, help="stoa (passages cut to share --max-observation-chars; default) or search-r1 (the top passages whole, 'Doc i(Title: ...)', cut at --max-observation-tokens)")
    search.add_argument("--max-observation-tokens", type=int, default=None, help="tokens of one observation at most (default: 512)")
    search.add_argument("--max-turn-tokens", type=int, default=None, help="model tokens of one turn at most (default: no limit but the run's --max-tokens)")
    search.add_argument("--no-action", choices=NO_ACTIONS, default=None, help="a turn ending without a search or an answer: end the episode (default) or feedback (Search-R1's invalid-action text, the episode goes on)")
    search.add_argument("--chunk-mb", type=int, default=64, help="size of the index's bucket objects in MiB (default: 64)")
    search.add_argument("--work-dir", type=Path, default=None,
                        help="build the index in this folder (the index and ~12 bytes of scratch a posting; default: $TMPDIR)")
    search.add_argument("--bm25", choices=sorted(PRESETS), default=None, help="BM25 preset: default (Snowball English stemming, k1 1.5, b 0.75) or search-r1 (Porter stemming, k1 0.9, b 0.4, as Search-R1's pyserini)")
    search.add_argument("--k1", type=float, default=None, help="BM25 k1 (default: the preset's)")
    search.add_argument("--b", type=float, default=None, help="BM25 b (default: the preset's)")
    prep.set_defaults(handler=_prepare)


async def run_signing(store: Store, run: str, key: SigningKey | None) -> RunTrust | None:
    """The trust `prepare` signs the task manifest under: None for an unsigned run (without
    `key`); ValueError (one line) for a signed run without `key`, a `key` that is not one of the
    run's keys, or `key` given for an unsigned run. A run not created yet is signed by `key` alone."""
    try:
        manifest = await read_run_manifest(store, run)
    except RunNotFound:
        return None if key is None else RunTrust(run, key.public)
    if manifest.run_key is None:
        if key is not None:
            raise ValueError(f"run {run!r} is unsigned (its run.json names no run key): drop --key")
        return None
    trust = RunTrust.from_text(run, manifest.run_key)
    if key is None:
        raise ValueError(
            f"run {run!r} is signed (run key {trust.pinned.key_id}): give its run key file with --key PATH, "
            f"so the trainer and workers accept the task data"
        )
    await load_rotations(store, trust)
    if not trust.knows(key.key_id):
        raise ValueError(
            f"--key {key.key_id} is not a key of run {run!r} (its run key is {trust.pinned.key_id}): give the run's key file"
        )
    return trust


async def _put(url: str, run: str, task: str, objects: dict[str, bytes], key: SigningKey | None) -> list[str]:
    async with open_store(url) as store:
        trust = await run_signing(store, run, key)
        return await put_task_objects(store, run, task, objects, key=key if trust else None, trust=trust)


def search_inputs(args: argparse.Namespace) -> tuple[dict[str, tuple[TaskItem, ...]], Iterable[str], dict[str, Any]]:
    """(items per split, passages, task meta) of `prepare search`; the passages of a corpus file
    are a stream, read once by the index build."""
    meta, _ = search_settings(args)
    if args.synthetic is not None:
        if args.files:
            raise ValueError("--synthetic generates the questions and the corpus: give no files")
        data = generate_search(args.synthetic, seed=args.seed)
        meta.update(source="synthetic", seed=args.seed)
        return {args.split or "train": search_task_items(data)}, list(data.passages), meta
    if len(args.files) < 2:
        raise ValueError("give QA_FILE... CORPUS_FILE (the last file is the corpus), or --synthetic N")
    *qa_files, corpus_file = args.files
    if args.split and len(qa_files) > 1:
        raise ValueError("--split names one file's split; give one question file or drop --split")
    columns = Columns(
        question=args.question_field,
        answer=args.answer_field,
        golden_answers="golden_answers" if args.answer_field == "answer" else None,
        contents=args.contents_field,
        title=args.title_field,
        text=args.text_field,
    )
    splits = {args.split or p.name.split(".")[0]: load_qa(p, columns=columns, limit=args.limit) for p in qa_files}
    if len(splits) != len(qa_files):
        raise ValueError("two question files would give the same split name")
    meta["source"] = {"questions": [p.name for p in qa_files], "corpus": corpus_file.name}
    if not corpus_file.is_file():
        raise ValueError(f"{corpus_file}: no such corpus file")
    return splits, iter_corpus(corpus_file, columns=columns, raw=meta.get("observation") == "search-r1"), meta


def search_settings(args: argparse.Namespace) -> tuple[dict[str, Any], PresetName]:
    """(task meta, BM25 preset name) of `prepare search`: --preset's settings, the flags given over them."""
    flags = {"match": args.match, "top_k": args.top_k, "max_observation_chars": args.max_observation_chars,
             "max_searches": args.max_searches, "prompt": args.prompt, "observation": args.observation,
             "max_observation_tokens": args.max_observation_tokens, "max_turn_tokens": args.max_turn_tokens,
             "no_action": args.no_action, "bm25": args.bm25}
    return resolve(args.preset, flags)


def bm25_settings(args: argparse.Namespace) -> Bm25Settings:
    """The BM25 preset (--bm25, else --preset's) with --k1 / --b applied."""
    base = PRESETS[search_settings(args)[1]]
    return dataclasses.replace(base, k1=base.k1 if args.k1 is None else args.k1, b=base.b if args.b is None else args.b)


async def _put_search(
    url: str, run: str, args: argparse.Namespace, key: SigningKey | None
) -> tuple[dict[str, bytes], list[str]]:
    from slime_stoa.tasks.search.prepare import prepare_search  # PyStemmer: only for this command
    from slime_stoa.tasks.search.progress import passage_meter

    splits, passages, meta = search_inputs(args)
    settings = bm25_settings(args)
    if not 1 <= args.chunk_mb <= 512:
        raise ValueError("--chunk-mb must be 1..512")
    total = len(passages) if isinstance(passages, Sized) else None
    async with open_store(url) as store:
        trust = await run_signing(store, run, key)  # refused before the index is built
        with passage_meter(total=total) as advance:
            prepared = await prepare_search(store, run, splits, passages, meta=meta, chunk_bytes=args.chunk_mb << 20,
                                            settings=settings, on_passages=advance, work_dir=args.work_dir)
        keys = await put_task_objects(store, run, "search", dict(prepared.objects), key=key if trust else None,
                                      trust=trust)
    print(f"index: {prepared.passages:,} passages, manifest {RunLayout(run).task_index_file('search', 'manifest.json')} (sha256 {prepared.manifest_sha256[:16]}...)")
    return dict(prepared.objects), keys


def read_task_files(args: argparse.Namespace) -> dict[str, bytes]:
    """{split: task data} of `prepare gsm8k|math|synthetic`, with progress over the files read (stderr)."""
    console = cli_console() if args.files else None  # synthetic: generated, nothing to read
    with StepMeter(console, f"task prepare {args.task}", len(args.files), unit="file") as meter:
        return task_objects(args.task, args.files, split=args.split, count=args.count, seed=args.seed,
                            limit=args.limit, on_file=meter.update)


def _prepare(args: argparse.Namespace) -> int:
    url, run = require_run_options(args)
    try:
        key = read_key_file(args.key) if args.key is not None else None
        if args.task == "search":
            objects, keys = asyncio.run(_put_search(url, run, args, key))
        else:
            objects = read_task_files(args)
            keys = asyncio.run(_put(url, run, args.task, objects, key))
    except OSError as exc:
        print(f"error: {os_error_text(exc)}", file=sys.stderr)
        return 1
    except (StoreError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for written, data in zip(keys, objects.values(), strict=True):
        print(f"wrote {written} ({len(data):,} bytes)")
    if key is not None:
        print(f"signed {RunLayout(run).task_manifest(args.task)} with run key {key.key_id}")
    return 0
