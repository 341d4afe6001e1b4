"""Benchmark the trainer's rollout ingestion against a real S3 server on loopback (SeaweedFS).

Workload: a simulated fleet of W workers (10, 100 and 1000 by default) of a run whose task is
the synthetic one, groups of 8 samples (48 prompt tokens; half the responses are the right or a
wrong answer and stop, half are 64 random tokens cut at max_tokens), so every group has mixed
rewards. Records are written by the real encoder under real layout keys, concurrently and
untimed; the consumer (`slime_stoa.trainer.consumer.RolloutConsumer`, default settings) then assembles
batches of 256 groups, validating and re-scoring every record with the tiny test tokenizer. Its
store is wrapped in a counting proxy, so every request it makes is counted (a listing counts
one request per 1,000 keys).

The run is real: its manifest and task, and anchor v0 of the tiny model published by the
project's publisher; every record claims v0 with v0's published state digest, and its
"length" responses end on a token that is not EOS, so the consumer admits them all.

Per W (each fleet in its own bucket, with its own consumer), timed batches:
  first    a fresh consumer, the whole fleet's records (at least 256, one or more per worker)
           waiting in the bucket (once per W);
  steady   the consumer has consumed everything, then 256 new records land (from all workers);
  steady+  the same after a further pile of old records landed and was consumed, so the
           bucket holds many more records in total: the request count must not change.
The steady and steady+ batches run in `--rounds` interleaved rounds (one batch of every W per
round); each is reported as min / median / max over the rounds.

`requests_per_new_record` = requests of the batch / records that landed since the consumer's
previous batch. Expect ~1 (one GET each, plus one LIST per 1,000 keys) whatever W and the total.
Headlines (medians): `requests_ratio_pile` = steady+ / steady requests (1.0: the pile costs
nothing), `seconds_ratio_workers` = the largest fleet's steady seconds / the smallest's.

Bounded by work: every batch of every round is assembled however long it takes; a batch that
gets no groups for `--stall-s` (900 s by default: the consumer's wait limit for that call) ends
the run with exit 1, naming the fleet and the batch, and no JSON is written.

The S3 server is stopped on any exit, SIGTERM and SIGHUP included (not on SIGKILL).

Usage: python scripts/bench_ingest.py [--quick | --smoke] [--workers 10,100,1000] [--pile N] [--rounds N]
       [--stall-s S] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (
    STALL_S,
    Incomplete,
    Session,
    exit_code,
    exit_on_signals,
    on_signal_exit,
    print_spreads,
    ratio,
    require,
    spread,
    write_json,
)

from slime_stoa.judging.scoring import tokenizer_decode
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.records import (
    RolloutGroup,
    Sample,
    SamplingParams,
    encode_group,
)
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import Store
from slime_stoa.quickstart.tiny_model import IM_END, build_tiny_model
from slime_stoa.tasks import generate_items, make_task
from slime_stoa.trainer.consumer import ConsumerConfig, ConsumerTimeout, RolloutConsumer
from slime_stoa.trainer.consumer.counting import CountingStore
from tests.s3server import LocalS3Server

RUN = "bench"
G = 8
PROMPT_TOKENS = 48
RESPONSE_TOKENS = 64
BATCH = 256  # groups per timed batch (--smoke: 64)
RATE = 50  # records per second the simulated fleet produces (key timestamps)
ITEMS = generate_items(1024, seed=7)
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=RESPONSE_TOKENS, stop=())


class Fleet:
    """Makes and uploads records of W workers, each with its own sequence numbers, all on the
    published version `version` (state digest `digest`)."""

    def __init__(self, tokenizer: Any, vocab: int, workers: int, version: int, digest: str, seed: int = 0) -> None:
        self.tok, self.vocab, self.eos = tokenizer, vocab, tokenizer.token_to_id(IM_END)
        self.version, self.digest = version, digest
        self.workers = [f"mac-{i:04d}" for i in range(workers)]
        self.seq = dict.fromkeys(self.workers, 0)
        self.rng = random.Random(seed)
        # Keys stamped in the past, strictly increasing, as a fleet producing `RATE` records/s
        # would stamp them (the skew-window sweep re-lists the keys of one window).
        self.clock_ms = int(time.time() * 1000) - 3_600_000

    def random_token(self) -> int:
        """Any token but EOS: a "length" response never ends on (or holds) one."""
        token = self.rng.randrange(self.vocab - 1)
        return token + 1 if token >= self.eos else token

    def group(self, worker: str) -> RolloutGroup:
        index = self.rng.randrange(len(ITEMS))
        item = ITEMS[index]
        prompt = (self.tok.encode(item.prompt).ids * PROMPT_TOKENS)[:PROMPT_TOKENS]
        samples = []
        for i in range(G):
            if i % 2 == 0:
                text = item.label if i % 4 == 0 else "x"
                tokens, finish = self.tok.encode(text).ids + [self.eos], "stop"
            else:
                tokens, finish = [self.random_token() for _ in range(RESPONSE_TOKENS)], "length"
            reward = float(i % 4 == 0)
            samples.append(Sample(response_tokens=tokens, logprobs=[-1.25] * len(tokens), finish_reason=finish, reward=reward))
        now = time.time()
        seq = self.seq[worker]
        self.seq[worker] += 1
        return RolloutGroup(
            kind="train", run=RUN, task_id="synthetic", prompt_index=index, prompt_tokens=prompt,
            samples=tuple(samples), weight_version=self.version, state_digest=self.digest, sampling=SAMPLING,
            worker_id=worker, seq=seq, started_at=now - 5, finished_at=now,
        )

    async def upload(self, store: Store, count: int, concurrency: int = 64) -> None:
        """`count` records, round-robin over the workers, concurrently."""
        layout = RunLayout(RUN)
        jobs = []
        for i in range(count):
            worker = self.workers[i % len(self.workers)]
            group = self.group(worker)
            self.clock_ms += 1000 // RATE
            jobs.append((layout.rollout(worker, self.clock_ms, group.seq), encode_group(group)))
        limit = asyncio.Semaphore(concurrency)

        async def put(key: str, data: bytes) -> None:
            async with limit:
                await store.put_if_absent(key, data)

        await asyncio.gather(*(put(k, d) for k, d in jobs))


async def setup_run(store: Store, vocab: int, model_dir: Path) -> tuple[int, str]:
    """The run's manifest and task, and anchor v0 of `model_dir` through the publisher; returns
    (version, state digest) as published."""
    layout = RunLayout(RUN)
    manifest = RunManifest(
        run=RUN, model="tiny", task="synthetic", group_size=G, temperature=1.0, max_tokens=RESPONSE_TOKENS,
        max_prompt_tokens=256, vocab_size=vocab, staleness_limit=4, reuse_limit=1,
    )
    await store.put_if_absent(layout.run_manifest, manifest.to_bytes())
    await store.put_if_absent(layout.task_data("synthetic", "train"), make_task("synthetic", ITEMS).encode())
    pub = Publisher(store, RUN, PublisherConfig(extras_dir=model_dir))
    result = await pub.publish(load_hf_state(model_dir))
    require(pub.state_digest is not None, "the publisher gave anchor v0 no state digest")
    return result.version, pub.state_digest or ""


class Bench:
    """One fleet of W workers, its bucket and its consumer."""

    def __init__(self, server: LocalS3Server, tok: Any, vocab: int, workers: int, model_dir: Path, batch: int,
                 stall_s: float) -> None:
        self.server, self.tok, self.vocab, self.workers, self.model_dir = server, tok, vocab, workers, model_dir
        self.batch, self.stall_s = batch, stall_s
        bucket = server.create_bucket()
        self.uploader = server.store(bucket, "b", max_concurrency=32)
        self.reader = server.store(bucket, "b")
        self.counting = CountingStore(self.reader)
        self.consumer: RolloutConsumer | None = None
        self.total = 0
        self.version = 0

    async def open(self) -> None:
        self.version, digest = await setup_run(self.uploader, self.vocab, self.model_dir)
        self.fleet = Fleet(self.tok, self.vocab, self.workers, self.version, digest)
        self.total = self.workers * math.ceil(self.batch / self.workers)
        await self.fleet.upload(self.uploader, self.total)
        config = ConsumerConfig(store_url=self.reader.url, run=RUN, poll_interval_s=0.05)
        self.consumer = await RolloutConsumer.open(
            self.counting, config, decode=tokenizer_decode(self.tok), eos_ids=frozenset({self.fleet.eos}),
            restore=False,
        )

    async def close(self) -> None:
        try:
            if self.consumer is not None:
                await self.consumer.close()
        finally:
            await self.uploader.close()
            await self.reader.close()

    async def next_batch(self, n: int, what: str) -> Any:
        """The consumer's next `n` groups; `Incomplete` when none come for the stall limit."""
        assert self.consumer is not None  # open() first
        try:
            batch = await self.consumer.next_batch(n, trainer_version=self.version, timeout_s=self.stall_s)
        except ConsumerTimeout as exc:
            raise Incomplete(f"the {self.workers}-worker fleet's {what}: {exc}") from exc
        require(len(batch.groups) == n, f"the {self.workers}-worker fleet's {what} held {len(batch.groups)} of {n} groups")
        return batch

    async def timed_batch(self, phase: str, new: int) -> dict[str, Any]:
        self.counting.reset()
        start = time.perf_counter()
        await self.next_batch(self.batch, f"{phase} batch")
        seconds = time.perf_counter() - start
        calls = dict(self.counting.calls)
        requests = self.counting.requests
        return {
            "workers": self.workers, "phase": phase, "total_records": self.total, "new_records": new,
            "groups": self.batch, "seconds": round(seconds, 4), "requests": requests,
            "list_pages": calls.get("list_pages", 0), "gets": calls.get("get", 0),
            "requests_per_new_record": round(requests / new, 4),
        }

    async def consume(self, count: int) -> None:
        """Consume `count` groups (untimed)."""
        while count > 0:
            n = min(count, 1024)
            await self.next_batch(n, "untimed consumption")
            count -= n

    async def first(self) -> dict[str, Any]:
        row = await self.timed_batch("first", self.total)
        await self.consume(self.total - self.batch)
        return row

    async def steady(self, phase: str) -> dict[str, Any]:
        await self.fleet.upload(self.uploader, self.batch)
        self.total += self.batch
        return await self.timed_batch(phase, self.batch)

    async def add_pile(self, pile: int) -> None:
        await self.fleet.upload(self.uploader, pile)
        self.total += pile
        await self.consume(pile)


async def run_benches(server: LocalS3Server, tok: Any, vocab: int, model_dir: Path, workers: list[int], pile: int,
                      rounds: int, batch: int, stall_s: float) -> list[dict[str, Any]]:
    """first per W, then `rounds` rounds of steady batches (every W in each round), the piles,
    then `rounds` rounds of steady+ batches."""
    benches = [Bench(server, tok, vocab, w, model_dir, batch, stall_s) for w in workers]
    rows: list[dict[str, Any]] = []
    try:
        for bench in benches:
            await bench.open()
            rows.append(await bench.first())
        for r in range(rounds):
            for bench in benches:
                rows.append(await bench.steady("steady") | {"round": r})
        if pile:
            for bench in benches:
                await bench.add_pile(pile)
            for r in range(rounds):
                for bench in benches:
                    rows.append(await bench.steady("steady+") | {"round": r})
    finally:
        for bench in benches:
            await bench.close()
    return rows


def summarize(rows: list[dict[str, Any]], workers: list[int]) -> dict[str, Any]:
    """min / median / max per (W, phase), and the headline ratios of medians."""
    cells: dict[str, dict[str, Any]] = {}
    for w in workers:
        for phase in ("first", "steady", "steady+"):
            mine = [r for r in rows if r["workers"] == w and r["phase"] == phase]
            if mine:
                cells[f"{w}/{phase}"] = {
                    "workers": w, "phase": phase,
                    **{f: spread([r[f] for r in mine]) for f in ("seconds", "requests", "requests_per_new_record")},
                }
    out: dict[str, Any] = {"cells": cells}

    def median(w: int, phase: str, field: str) -> float:
        cell = cells.get(f"{w}/{phase}")
        return cell[field]["median"] if cell else math.nan

    small, large = min(workers), max(workers)
    out["requests_per_new_record_median"] = max(median(w, "steady", "requests_per_new_record") for w in workers)
    if any(f"{w}/steady+" in cells for w in workers):
        out["requests_ratio_pile"] = max(ratio(median(w, "steady+", "requests"), median(w, "steady", "requests"))
                                         for w in workers)
    out["seconds_ratio_workers"] = ratio(median(large, "steady", "seconds"), median(small, "steady", "seconds"))
    out["steady_seconds_median"] = max(median(w, "steady", "seconds") for w in workers)
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["workers", "phase", "total_records", "new_records", "groups", "seconds", "requests", "list_pages", "gets", "requests_per_new_record"]
    heads = ["workers", "phase", "total", "new", "groups", "seconds", "requests", "LIST pages", "GETs", "req/new record"]
    table = [heads] + [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    for j, line in enumerate(table):
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


async def run(workers: list[int], pile: int, rounds: int, batch: int, stall_s: float) -> list[dict[str, Any]]:
    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory(prefix="stoa-bench-") as tmp:
        on_signal_exit(lambda: shutil.rmtree(tmp, ignore_errors=True))
        folder = build_tiny_model(Path(tmp) / "tiny", hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        with LocalS3Server() as server:
            on_signal_exit(server.stop)
            return await run_benches(server, tok, vocab, folder, workers, pile, rounds, batch, stall_s)


def pile_note(summary: dict[str, Any]) -> str:
    ratio_ = summary.get("requests_ratio_pile")
    return "not measured (--pile 0)" if ratio_ is None else f"{ratio_:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fleets of 10 and 1000, a smaller pile (under a minute)")
    size.add_argument("--smoke", action="store_true", help="fleets of 10 and 100, batches of 64, a small pile, 2 rounds (the test's size)")
    parser.add_argument("--workers", default=None, help="comma-separated fleet sizes (default 10,100,1000)")
    parser.add_argument("--pile", type=int, default=None, help="old records added before the steady+ batches")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds of steady batches (default 5, quick 3)")
    parser.add_argument("--stall-s", type=float, default=STALL_S, help="a batch that gets no groups for this long "
                        f"ends the run with exit 1 (default {STALL_S:.0f})")
    parser.add_argument("--json", type=Path, help="write the rows and the summary as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    default_workers = "10,100" if args.smoke else "10,1000" if args.quick else "10,100,1000"
    workers = [int(w) for w in (args.workers or default_workers).split(",") if w]
    pile = args.pile if args.pile is not None else (300 if args.smoke else 1000 if args.quick else 5000)
    rounds = args.rounds or (2 if args.smoke else 3 if args.quick else 5)
    batch = 64 if args.smoke else BATCH
    if not workers or min(workers) < 1 or pile < 0 or rounds < 1 or not args.stall_s > 0:
        parser.error("--workers must be >= 1, --pile >= 0, --rounds >= 1 and --stall-s > 0")
    return exit_code(lambda: bench(args, workers, pile, rounds, batch), "bench_ingest")


def bench(args: argparse.Namespace, workers: list[int], pile: int, rounds: int, batch: int) -> int:
    session = Session()
    with exit_on_signals():
        rows = asyncio.run(run(workers, pile, rounds, batch, args.stall_s))
    summary = summarize(rows, workers)
    print(f"rollout ingestion, SeaweedFS on loopback, batches of {batch} groups of {G} samples, {rounds} rounds")
    print_table(rows)
    print()
    print_spreads("seconds per batch", {k: c["seconds"] for k, c in summary["cells"].items()})
    print_spreads("requests per new record", {k: c["requests_per_new_record"] for k, c in summary["cells"].items()},
                  unit="requests", digits=3)
    print(f"medians: requests per new record {summary['requests_per_new_record_median']:.3f} (steady, worst W); "
          f"steady+ / steady requests {pile_note(summary)}; "
          f"{max(workers)} / {min(workers)} workers, steady seconds {summary['seconds_ratio_workers']:.2f}x")
    session.print_load()
    if args.json:
        doc = {"workers": workers, "pile": pile, "rounds": rounds, "batch": batch, **session.meta(), **summary,
               "rows": rows}
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
