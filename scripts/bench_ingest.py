"""Benchmark the trainer's rollout ingestion against a real S3 server on loopback (SeaweedFS).

Workload: a simulated fleet of W workers (10, 100 and 1000 by default) of a run whose task is
the synthetic one, groups of 8 samples (48 prompt tokens; half the responses are the right or a
wrong answer and stop, half are 64 random tokens cut at max_tokens), so every group has mixed
rewards. Records are written by the real encoder under real layout keys, concurrently and
untimed; the consumer (`slime_stoa.trainer.consumer.RolloutConsumer`, default settings) then assembles
batches of 256 groups, validating and re-scoring every record with the tiny test tokenizer. Its
store is wrapped in a counting proxy, so every request it makes is counted (a listing counts
one request per 1,000 keys).

Per W, three timed batches:
  first    a fresh consumer, the whole fleet's records (at least 256, one or more per worker)
           waiting in the bucket;
  steady   the consumer has consumed everything, then 256 new records land (from all workers);
  steady+  the same after a further pile of old records landed and was consumed, so the
           bucket holds many more records in total: the request count must not change.

`requests_per_new_record` = requests of the batch / records that landed since the consumer's
previous batch. Expect ~1 (one GET each, plus one LIST per 1,000 keys) whatever W and the total.

Usage: python scripts/bench_ingest.py [--quick] [--workers 10,100,1000] [--pile N] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime_stoa.judging.scoring import tokenizer_decode
from slime_stoa.protocol.layout import RunLayout
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
from slime_stoa.trainer.consumer import ConsumerConfig, RolloutConsumer
from slime_stoa.trainer.consumer.counting import CountingStore
from tests.s3server import LocalS3Server

RUN = "bench"
G = 8
PROMPT_TOKENS = 48
RESPONSE_TOKENS = 64
BATCH = 256
RATE = 50  # records per second the simulated fleet produces (key timestamps)
ITEMS = generate_items(1024, seed=7)
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=RESPONSE_TOKENS, stop=())


class Fleet:
    """Makes and uploads records of W workers, each with its own sequence numbers."""

    def __init__(self, tokenizer: Any, vocab: int, workers: int, seed: int = 0) -> None:
        self.tok, self.vocab, self.eos = tokenizer, vocab, tokenizer.token_to_id(IM_END)
        self.workers = [f"mac-{i:04d}" for i in range(workers)]
        self.seq = dict.fromkeys(self.workers, 0)
        self.rng = random.Random(seed)
        # Keys stamped in the past, strictly increasing, as a fleet producing `RATE` records/s
        # would stamp them (the skew-window sweep re-lists the keys of one window).
        self.clock_ms = int(time.time() * 1000) - 3_600_000

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
                tokens, finish = [self.rng.randrange(self.vocab) for _ in range(RESPONSE_TOKENS)], "length"
            reward = float(i % 4 == 0)
            samples.append(Sample(response_tokens=tokens, logprobs=[-1.25] * len(tokens), finish_reason=finish, reward=reward))
        now = time.time()
        seq = self.seq[worker]
        self.seq[worker] += 1
        return RolloutGroup(
            kind="train", run=RUN, task_id="synthetic", prompt_index=index, prompt_tokens=prompt,
            samples=tuple(samples), weight_version=0, state_digest="cd" * 16, sampling=SAMPLING,
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


async def setup_run(store: Store, vocab: int) -> None:
    layout = RunLayout(RUN)
    manifest = RunManifest(
        run=RUN, model="tiny", task="synthetic", group_size=G, temperature=1.0, max_tokens=RESPONSE_TOKENS,
        max_prompt_tokens=256, vocab_size=vocab, staleness_limit=4, reuse_limit=1,
    )
    await store.put_if_absent(layout.run_manifest, manifest.to_bytes())
    await store.put_if_absent(layout.task_data("synthetic", "train"), make_task("synthetic", ITEMS).encode())


async def timed_batch(consumer: RolloutConsumer, counting: CountingStore, n: int) -> tuple[float, dict[str, int]]:
    counting.reset()
    start = time.perf_counter()
    batch = await consumer.next_batch(n, trainer_version=0)
    seconds = time.perf_counter() - start
    assert len(batch.groups) == n
    calls = dict(counting.calls)
    calls["requests"] = counting.requests
    return seconds, calls


async def consume(consumer: RolloutConsumer, count: int) -> None:
    """Consume `count` groups (untimed)."""
    while count > 0:
        n = min(count, 1024)
        await consumer.next_batch(n, trainer_version=0)
        count -= n


async def bench_fleet(server: LocalS3Server, tok: Any, vocab: int, workers: int, *, pile: int) -> list[dict[str, Any]]:
    bucket = server.create_bucket()
    uploader = server.store(bucket, "b", max_concurrency=32)
    reader = server.store(bucket, "b")
    counting = CountingStore(reader)
    rows = []
    try:
        await setup_run(uploader, vocab)
        fleet = Fleet(tok, vocab, workers)
        total = workers * math.ceil(BATCH / workers)
        await fleet.upload(uploader, total)
        config = ConsumerConfig(store_url=reader.url, run=RUN, poll_interval_s=0.05)
        consumer = await RolloutConsumer.open(
            counting, config, decode=tokenizer_decode(tok), eos_ids=frozenset({fleet.eos}), restore=False
        )

        def row(phase: str, new: int, seconds: float, calls: dict[str, int]) -> dict[str, Any]:
            return {
                "workers": workers, "phase": phase, "total_records": total, "new_records": new, "groups": BATCH,
                "seconds": round(seconds, 4), "requests": calls["requests"], "list_pages": calls.get("list_pages", 0),
                "gets": calls.get("get", 0), "requests_per_new_record": round(calls["requests"] / new, 4),
            }

        seconds, calls = await timed_batch(consumer, counting, BATCH)
        rows.append(row("first", total, seconds, calls))
        await consume(consumer, total - BATCH)
        await fleet.upload(uploader, BATCH)
        total += BATCH
        seconds, calls = await timed_batch(consumer, counting, BATCH)
        rows.append(row("steady", BATCH, seconds, calls))
        if pile:
            await fleet.upload(uploader, pile)
            total += pile
            await consume(consumer, pile)
            await fleet.upload(uploader, BATCH)
            total += BATCH
            seconds, calls = await timed_batch(consumer, counting, BATCH)
            rows.append(row("steady+", BATCH, seconds, calls))
        await consumer.close()
    finally:
        await uploader.close()
        await reader.close()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["workers", "phase", "total_records", "new_records", "groups", "seconds", "requests", "list_pages", "gets", "requests_per_new_record"]
    heads = ["workers", "phase", "total", "new", "groups", "seconds", "requests", "LIST pages", "GETs", "req/new record"]
    table = [heads] + [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    for j, line in enumerate(table):
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


async def run(workers: list[int], pile: int) -> list[dict[str, Any]]:
    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory(prefix="stoa-bench-") as tmp:
        folder = build_tiny_model(Path(tmp) / "tiny", hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        rows: list[dict[str, Any]] = []
        with LocalS3Server() as server:
            for w in workers:
                rows += await bench_fleet(server, tok, vocab, w, pile=pile)
        return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fleets of 10 and 1000, a smaller pile (under a minute)")
    parser.add_argument("--workers", default=None, help="comma-separated fleet sizes (default 10,100,1000)")
    parser.add_argument("--pile", type=int, default=None, help="old records added before the steady+ batch")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    default_workers = "10,1000" if args.quick else "10,100,1000"
    workers = [int(w) for w in (args.workers or default_workers).split(",") if w]
    pile = args.pile if args.pile is not None else (1000 if args.quick else 5000)
    rows = asyncio.run(run(workers, pile))
    print(f"rollout ingestion, SeaweedFS on loopback, batches of {BATCH} groups of {G} samples")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
