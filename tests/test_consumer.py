"""The rollout consumer end to end, on both store backends, with records written by the real
encoder under real layout keys and re-scored with the real synthetic task and a tiny tokenizer."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import math
import sys
import time
import types
import zlib
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from slime_stoa.judging.scoring import tokenizer_decode
from slime_stoa.protocol.heartbeat import Heartbeat
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.digest import state_digest
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.records import (
    RolloutGroup,
    Sample,
    SamplingParams,
    encode_group,
)
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store
from slime_stoa.quickstart.tiny_model import IM_END, build_tiny_model
from slime_stoa.tasks import generate_items, make_task
from slime_stoa.tasks.prompting import prompt_tokens
from slime_stoa.trainer.consumer import (
    ConsumerConfig,
    ConsumerState,
    ConsumerTimeout,
    RolloutConsumer,
    StateConflict,
    sample_fields,
)
from slime_stoa.trainer.consumer.counting import CountingStore
from slime_stoa.trainer.consumer.discovery import advance_cursor, cursor_cap, prune_seen
from slime_stoa.trainer.consumer.policy import Candidate, all_equal, select
from tests.conftest import async_wait_until

RUN = "consume"
G = 4
MAX_TOKENS = 16
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, stop=())
ITEMS = generate_items(32, seed=3)
FAST = dict(poll_interval_s=0.02, sweep_interval_s=0.2, wait_timeout_s=3.0, progress_interval_s=60.0)


# -- fixtures and builders -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Tiny:
    folder: Path
    tokenizer: Any
    vocab: int
    eos: int
    chat: Any  # the transformers tokenizer of the same folder, with the chat template

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def prompt(self, item: Any) -> list[int]:
        """The prompt tokens a worker builds for `item` (the chat template)."""
        return prompt_tokens(self.chat, make_task("synthetic", ITEMS), item)

    def decode(self, tokens) -> str:
        return tokenizer_decode(self.tokenizer)(tokens)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    return Tiny(folder, tok, vocab, tok.token_to_id(IM_END), AutoTokenizer.from_pretrained(folder))


def now_ms() -> int:
    return int(time.time() * 1000)


def weights(version: int) -> dict[str, np.ndarray]:
    """The tiny state the tests publish as `version` (records claim its digest by default)."""
    return {"w": np.full((4, 4), version, dtype=np.uint16)}


def digest_of(version: int) -> str:
    return state_digest(weights(version))


async def publish_versions(store: Store, upto: int, *, key: SigningKey | None = None) -> None:
    """Publish `weights(v)` as each version after the pointer's, up to `upto` (signed with `key`)."""
    publisher = Publisher(store, RUN, PublisherConfig(catchup=False), key=key)
    at = await publisher.open()
    for v in range(-1 if at is None else at, upto):
        result = await publisher.publish(weights(v + 1))
        assert result.version == v + 1


async def setup_run(
    store: Store, tiny: Tiny, *, staleness: int = 2, reuse: int = 1, published: int | None = 0
) -> RunManifest:
    """The run manifest and task, and weights published up to version `published` (None: none)."""
    layout = RunLayout(RUN)
    manifest = RunManifest(
        run=RUN, model="tiny", task="synthetic", group_size=G, temperature=1.0, max_tokens=MAX_TOKENS,
        max_prompt_tokens=64, staleness_limit=staleness, reuse_limit=reuse, vocab_size=tiny.vocab,
    )
    await store.put_if_absent(layout.run_manifest, manifest.to_bytes())
    task = make_task("synthetic", ITEMS)
    await store.put_if_absent(layout.task_file("synthetic", "train.jsonl.zst"), task.encode())
    if published is not None:
        await publish_versions(store, published)
    return manifest


def make_group(
    tiny: Tiny,
    *,
    worker: str,
    seq: int,
    prompt_index: int = 0,
    answers: list[str] | None = None,
    weight_version: int = 0,
    worker_rewards: list[float] | None = None,
    finish: list[str] | None = None,
    **overrides: Any,
) -> RolloutGroup:
    """A group whose answers default to two right and two wrong (mixed rewards)."""
    item = ITEMS[prompt_index]
    wrong = "x" if item.label != "x" else "y"
    answers = answers if answers is not None else [item.label, wrong, item.label, wrong]
    finish = finish or ["stop"] * len(answers)
    samples = []
    # Each (worker, seq) gets its own logprobs, as real sampling would: the consumer refuses a
    # second record with the same prompt and samples as a replay.
    lp = -0.5 - 1e-3 * seq - 1e-6 * (zlib.crc32(worker.encode()) % 1000)
    for i, (text, fin) in enumerate(zip(answers, finish, strict=True)):
        tokens = tiny.encode(text) + ([tiny.eos] if fin == "stop" else [])
        reward = worker_rewards[i] if worker_rewards else float(text == item.label)
        samples.append(Sample(response_tokens=tokens, logprobs=[lp] * len(tokens), finish_reason=fin, reward=reward))
    t = time.time()
    fields: dict[str, Any] = dict(
        kind="train", run=RUN, task_id="synthetic", prompt_index=prompt_index,
        prompt_tokens=tiny.prompt(item), samples=tuple(samples), weight_version=weight_version,
        state_digest=digest_of(weight_version), sampling=SAMPLING, worker_id=worker, seq=seq, started_at=t - 1, finished_at=t,
    )
    fields.update(overrides)
    return RolloutGroup(**fields)


async def upload(store: Store, group: RolloutGroup, ts_ms: int | None = None, *, worker: str | None = None, seq: int | None = None) -> str:
    key = RunLayout(RUN).rollout(worker or group.worker_id, now_ms() if ts_ms is None else ts_ms, group.seq if seq is None else seq)
    await store.put_if_absent(key, encode_group(group))
    return key


def config(store_url: str, **kw: Any) -> ConsumerConfig:
    return ConsumerConfig(store_url=store_url, run=RUN, **{**FAST, **kw})


async def open_consumer(store: Store, tiny: Tiny, store_url: str, *, restore: bool = False, **kw: Any) -> RolloutConsumer:
    return await RolloutConsumer.open(
        store, config(store_url, **kw), decode=tiny.decode, eos_ids=frozenset({tiny.eos}), prompt_of=tiny.prompt,
        restore=restore,
    )


# -- batches -------------------------------------------------------------------------------------
@pytest.mark.both_backends
async def test_batch_across_workers(store: Store, store_url: str, tiny: Tiny) -> None:
    await setup_run(store, tiny)
    base = now_ms() - 10_000
    workers = ["mac-a", "mac-b", "mac-c"]
    for i in range(12):
        w = workers[i % 3]
        await upload(store, make_group(tiny, worker=w, seq=i // 3, prompt_index=i), base + i)
    # A wait bounded by what is there, not by the machine's load: the batches have all their
    # records in the bucket, so only a loaded machine would hit a short limit.
    consumer = await open_consumer(store, tiny, store_url, wait_timeout_s=60.0)
    first = await consumer.next_batch(6, trainer_version=0)
    second = await consumer.next_batch(6, trainer_version=0)
    keys = [g.key for g in first.groups + second.groups]
    assert len(set(keys)) == 12  # every record exactly once
    assert {g.worker for g in first.groups} == set(workers)
    for g in first.groups:
        assert g.rewards == tuple(float(t == g.label) for t in g.texts) == (1.0, 0.0, 1.0, 0.0)
        assert g.version_lag == 0 and g.use == 1
    m = first.metrics
    assert m["rollout/stoa_groups"] == 6 and m["rollout/stoa_workers"] == 3
    assert sum(v for k, v in m.items() if k.startswith("worker/") and k.endswith("/groups")) == 6
    assert m["rollout/stoa_rejected"] == 0 and m["rollout/stoa_reward_mean"] == 0.5
    with pytest.raises(ConsumerTimeout):  # nothing left: a limit of this call alone ends the wait
        await consumer.next_batch(1, trainer_version=0, timeout_s=0.1)
    with pytest.raises(ValueError, match="timeout_s"):
        await consumer.next_batch(1, trainer_version=0, timeout_s=0)
    # A new record lands: the next batch has it.
    await upload(store, make_group(tiny, worker="mac-d", seq=0, prompt_index=20))
    third = await consumer.next_batch(1, trainer_version=0, timeout_s=5.0)
    assert third.groups[0].worker == "mac-d"
    await consumer.close()


async def test_staleness_reuse_and_version_ahead(store: Store, store_url: str, tiny: Tiny) -> None:
    await setup_run(store, tiny, staleness=2, reuse=2, published=6)
    base = now_ms() - 10_000
    for v in range(8):  # weight versions 0..7 from one worker; the trainer is at v5
        await upload(store, make_group(tiny, worker="w", seq=v, prompt_index=v, weight_version=v), base + v)
    consumer = await open_consumer(store, tiny, store_url, wait_timeout_s=1.0)
    batch = await consumer.next_batch(4, trainer_version=5)
    # v0-v2 lag 5..3 > 2: stale. v7 is 2 ahead (slack 1): rejected. v3..v6 (lag 2..-1) usable.
    assert sorted(g.weight_version for g in batch.groups) == [3, 4, 5, 6]
    assert [g.weight_version for g in batch.groups] == [3, 4, 5, 6]  # oldest version first
    assert batch.metrics["rollout/stoa_version_lag_max"] == 2
    # reuse_limit 2: the same groups once more, now marked as a second use...
    again = await consumer.next_batch(4, trainer_version=5)
    assert {g.key for g in again.groups} == {g.key for g in batch.groups} and {g.use for g in again.groups} == {2}
    assert again.metrics["rollout/stoa_reused_groups"] == 4
    # ... and never a third time.
    with pytest.raises(ConsumerTimeout):
        await consumer.next_batch(1, trainer_version=5)
    assert consumer.counters["stale"] == 3 and consumer.counters["rejected/version_ahead"] == 1
    await consumer.close()


async def test_pool_groups_expire_when_the_trainer_moves(store: Store, store_url: str, tiny: Tiny) -> None:
    await setup_run(store, tiny, staleness=1, reuse=3, published=2)
    for v in (0, 1):
        await upload(store, make_group(tiny, worker="w", seq=v, weight_version=v), now_ms() - 1000 + v)
    consumer = await open_consumer(store, tiny, store_url, wait_timeout_s=0.5)
    assert len((await consumer.next_batch(2, trainer_version=1)).groups) == 2
    batch = await consumer.next_batch(1, trainer_version=2)  # v0 now lags 2 > 1: expired
    assert batch.groups[0].weight_version == 1 and batch.metrics["rollout/stoa_stale_dropped"] == 1
    await consumer.close()


def test_admission_order_policy() -> None:
    cands = [Candidate("3-new-old-version", 1, 0), Candidate("1-old-new-version", 5, 0), Candidate("0-used", 0, 1)]
    assert select(cands, 3, "oldest_version") == ["3-new-old-version", "1-old-new-version", "0-used"]
    with pytest.raises(ValueError, match="unknown admission order 'fifo'"):
        select(cands, 2, "fifo")  # type: ignore[arg-type]
    assert select(cands, 3, "newest_version") == ["1-old-new-version", "3-new-old-version", "0-used"]
    assert all_equal([1.0, 1.0]) and not all_equal([1.0, 0.0]) and all_equal([])


def test_cursor_never_passes_the_clock_and_seen_set_is_bounded() -> None:
    now = 1_700_000_000_000
    future = f"{now + 3_600_000:013d}-fast-clock-0000000001.rec"
    assert advance_cursor("", future, now) == cursor_cap(now)
    past = f"{now - 5:013d}-w-0000000001.rec"
    assert advance_cursor(cursor_cap(now), past, now) == cursor_cap(now)  # only forward
    seen = {f"{now - d:013d}-w-{d:010d}.rec" for d in (0, 10, 70_000)}
    prune_seen(seen, cursor_cap(now), 60_000)
    assert len(seen) == 2


# -- discovery cost ------------------------------------------------------------------------------
@pytest.mark.both_backends
async def test_listing_cost_grows_with_new_records_only(store: Store, store_url: str, tiny: Tiny) -> None:
    await setup_run(store, tiny)
    base = now_ms() - 20_000
    await asyncio.gather(*(
        upload(store, make_group(tiny, worker=f"w{w:02d}", seq=s, prompt_index=(w + s) % 32), base + w * 10 + s)
        for w in range(30) for s in range(4)
    ))  # 120 records from 30 workers
    counting = CountingStore(store)
    # Batches wait for their groups however slow the machine (the limit only turns a hang into
    # an error), and no sweep falls due on the clock: every count below is what the records cost.
    consumer = await open_consumer(
        counting, tiny, store_url, sweep_interval_s=3600.0, late_sweep_interval_s=3600.0, wait_timeout_s=300.0
    )
    counting.reset()
    await consumer.next_batch(120, trainer_version=0)
    # The records, and the published versions: the pointer and v0's manifest.
    assert counting.calls["get"] == 120 + 2
    assert counting.calls["list_pages"] <= 2  # one tail listing of 120 keys (+ at most one empty poll)
    # Five new records land (among 120 old ones): the next batch lists and downloads those only.
    t = now_ms() - 100
    for i in range(5):
        await upload(store, make_group(tiny, worker="late", seq=i, prompt_index=i), t + i)
    counting.reset()
    await consumer.next_batch(5, trainer_version=0)
    assert counting.calls["get"] == 5 + 1  # + the pointer (it did not move: no manifest read)
    assert counting.calls["listed"] == 5
    assert counting.calls["list_pages"] <= 2
    # An idle poll with nothing new lists nothing old.
    counting.reset()
    consumer.config = dataclasses.replace(consumer.config, wait_timeout_s=0.2)
    with pytest.raises(ConsumerTimeout):
        await consumer.next_batch(1, trainer_version=0)
    assert counting.calls["listed"] == 0 and counting.calls["get"] == 1  # the pointer
    await consumer.close()


@pytest.mark.both_backends
async def test_sweep_finds_late_keys_and_future_clocks_do_not_hide_others(store: Store, store_url: str, tiny: Tiny) -> None:
    await setup_run(store, tiny)
    t = now_ms()
    # Two minutes ahead: within the future window (`max_clock_skew_s`); further ahead is junk
    # (tests/test_discovery_junk.py).
    await upload(store, make_group(tiny, worker="fast-clock", seq=0), t + 120_000)
    await upload(store, make_group(tiny, worker="a", seq=0), t - 1000)
    consumer = await open_consumer(store, tiny, store_url, skew_window_ms=30_000)
    got = await consumer.next_batch(2, trainer_version=0)
    assert {g.worker for g in got.groups} == {"fast-clock", "a"}
    # A record stamped before the cursor (slow upload) but inside the window: found by a sweep.
    await upload(store, make_group(tiny, worker="slow", seq=0), t - 5000)
    # A normal record after the cursor, from another worker: found although a key from the
    # future was listed (the cursor never passed the clock).
    await upload(store, make_group(tiny, worker="b", seq=0), now_ms())
    got = await consumer.next_batch(2, trainer_version=0)
    assert {g.worker for g in got.groups} == {"slow", "b"}
    assert consumer.counters["late_keys"] == 1
    await consumer.close()


@pytest.mark.parametrize("late_window_ms", [0, 1_200_000])
async def test_late_sweep_finds_a_backlog_uploaded_long_after_it_was_made(
    store: Store, store_url: str, tiny: Tiny, late_window_ms: int
) -> None:
    await setup_run(store, tiny)
    await upload(store, make_group(tiny, worker="a", seq=0), now_ms() - 1000)
    consumer = await open_consumer(
        store, tiny, store_url, skew_window_ms=30_000, late_window_ms=late_window_ms, late_sweep_interval_s=0.3
    )
    await consumer.next_batch(1, trainer_version=0)
    # A Mac back online after 10 minutes uploads its spool: keys stamped when the groups were
    # made, far behind the cursor; one beyond even the late window.
    await upload(store, make_group(tiny, worker="offline", seq=0), now_ms() - 600_000)
    await upload(store, make_group(tiny, worker="offline", seq=1), now_ms() - 3_600_000)
    consumer.config = dataclasses.replace(consumer.config, wait_timeout_s=1.5)
    if late_window_ms:
        got = await consumer.next_batch(1, trainer_version=0)
        assert [(g.worker, g.group.seq) for g in got.groups] == [("offline", 0)]
    with pytest.raises(ConsumerTimeout):
        await consumer.next_batch(1, trainer_version=0)
    assert consumer.counters.get("late_keys", 0) == (1 if late_window_ms else 0)
    await consumer.close()


# -- persistence ---------------------------------------------------------------------------------
@pytest.mark.both_backends
async def test_restart_neither_reconsumes_nor_skips(store: Store, store_url: str, tiny: Tiny) -> None:
    await setup_run(store, tiny, reuse=2)
    base = now_ms() - 30_000
    for i in range(10):
        await upload(store, make_group(tiny, worker=f"w{i % 2}", seq=i, prompt_index=i), base + i)
    a = await open_consumer(store, tiny, store_url, download_concurrency=4)
    used = [g.key for g in (await a.next_batch(3, trainer_version=0)).groups]
    await a.save_state()
    snapshot = a.state_dict()
    assert json.loads(json.dumps(snapshot)) == snapshot  # JSON-serialisable
    await a.close()

    b = await open_consumer(store, tiny, store_url, restore=True, wait_timeout_s=1.0)
    assert b.state_dict()["cursor"] == snapshot["cursor"]
    uses: dict[str, int] = dict.fromkeys(used, 1)
    while True:
        try:
            batch = await b.next_batch(1, trainer_version=0)
        except ConsumerTimeout:
            break
        for g in batch.groups:
            uses[g.key] = uses.get(g.key, 0) + 1
    assert len(uses) == 10 and set(uses.values()) == {2}  # every group, each exactly reuse_limit times
    await b.save_state()
    # A second trainer that did not resume from the bucket cannot overwrite the state.
    c = await open_consumer(store, tiny, store_url)
    with pytest.raises(StateConflict):
        await c.save_state()
    await b.close()
    await c.close()


def test_state_json_round_trip_and_rejects_garbage() -> None:
    state = ConsumerState(
        run=RUN, cursor="1700000000000-w-0000000001.rec", seen={"1700000000000-w-0000000001.rec"},
        pending={"1700000000001-w-0000000002.rec": 123}, ledger={"1700000000000-w-0000000001.rec": 1},
        counters={"rejected/bad_magic": 2}, last_seen={"w": 1700000000001},
    )
    assert ConsumerState.from_json(json.loads(json.dumps(state.to_json()))) == state
    for bad in ({}, {**state.to_json(), "seen": ["../x"]}, {**state.to_json(), "counters": {"a": -1}}):
        with pytest.raises(ValueError):
            ConsumerState.from_json(bad)


# -- hostile and lying workers -------------------------------------------------------------------
async def test_hostile_records_are_rejected_and_counted(store: Store, store_url: str, tiny: Tiny) -> None:
    manifest = await setup_run(store, tiny)
    layout = RunLayout(RUN)
    t = now_ms() - 10_000
    good = encode_group(make_group(tiny, worker="evil", seq=0))
    bad_token = make_group(tiny, worker="evil", seq=1, prompt_tokens=[tiny.vocab + 5])
    nan_lp = make_group(tiny, worker="evil", seq=2)
    s0 = nan_lp.samples[0]
    nan_lp = msgspec.structs.replace(nan_lp, samples=(msgspec.structs.replace(s0, logprobs=[math.nan] * len(s0.logprobs)),) + nan_lp.samples[1:])
    objects = {
        layout.rollout("evil", t + 0, 0): b"not a record at all",
        layout.rollout("evil", t + 1, 1): good[: len(good) // 2],  # truncated
        layout.rollout("evil", t + 2, 2): encode_group(bad_token),
        layout.rollout("evil", t + 3, 3): encode_group(nan_lp),
        layout.rollout("evil", t + 4, 4): good[:8] + bytes(6000),  # oversized (limit below)
        layout.rollout("evil", t + 5, 5): encode_group(make_group(tiny, worker="someone-else", seq=5)),
        layout.rollout("evil", t + 6, 6): encode_group(make_group(tiny, worker="evil", seq=6, task_id="gsm8k")),
        layout.rollout("evil", t + 7, 7): encode_group(make_group(tiny, worker="evil", seq=7, prompt_index=0, samples=())),
        # item 1's label (answers) with item 2's prompt: rewards would teach the wrong mapping
        layout.rollout("evil", t + 8, 8): encode_group(
            make_group(tiny, worker="evil", seq=8, prompt_index=1, prompt_tokens=tiny.prompt(ITEMS[2]))
        ),
        layout.rollouts_prefix() + "not-a-record-key": b"x",
    }
    for key, data in objects.items():
        await store.put_if_absent(key, data)
    await upload(store, make_group(tiny, worker="honest", seq=0), t + 100)
    from slime_stoa.trainer.consumer import limits_for_run

    limits = dataclasses.replace(limits_for_run(manifest, vocab_size=tiny.vocab), max_record_bytes=4096)
    counting = CountingStore(store)
    consumer = await open_consumer(counting, tiny, store_url, record_limits=limits)
    counting.reset()
    batch = await consumer.next_batch(1, trainer_version=0)
    assert batch.groups[0].worker == "honest"
    expected = {
        "bad_magic": 1, "decompress": 1, "token_range": 1, "logprob_not_finite": 1, "too_large": 1,
        "key_mismatch": 1, "task": 1, "group_size": 1, "bad_key": 1, "prompt": 1,
    }
    got = {k.removeprefix("rejected/"): v for k, v in consumer.counters.items() if k.startswith("rejected/")}
    assert got == expected
    # The oversized object was never downloaded; + the pointer and v0's manifest.
    assert counting.calls["get"] == 9 + 2
    assert consumer.counters["worker/evil/rejected"] == 9
    assert batch.metrics["rollout/stoa_rejected"] == 10
    assert batch.metrics["rollout/stoa_rejected/too_large"] == 1
    await consumer.close()


async def test_records_must_claim_weights_the_trainer_published(
    store: Store, store_url: str, tiny: Tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slime_stoa.trainer.consumer import admission

    decoded: list[int] = []  # the weight version of every record decoded

    def load_record(*args: Any, **kw: Any) -> RolloutGroup:
        group = real_load_record(*args, **kw)
        decoded.append(group.weight_version)
        return group

    real_load_record = admission.load_record
    monkeypatch.setattr(admission, "load_record", load_record)
    await setup_run(store, tiny, published=1)
    t = now_ms() - 10_000
    await upload(store, make_group(tiny, worker="liar", seq=0, weight_version=2), t)  # never published
    await upload(store, make_group(tiny, worker="liar", seq=1, state_digest=digest_of(7)), t + 1)  # v0, not v0's
    await upload(store, make_group(tiny, worker="ok", seq=0, weight_version=1), t + 2)
    consumer = await open_consumer(store, tiny, store_url, wait_timeout_s=1.0)
    batch = await consumer.next_batch(1, trainer_version=1)
    assert [g.worker for g in batch.groups] == ["ok"]
    await async_wait_until(lambda: consumer.counters.get("worker/liar/rejected") == 2, message="the liar's rejects")
    assert consumer.counters["rejected/version"] == 1 and consumer.counters["rejected/digest"] == 1
    # A record for v2 listed before v2 is published, judged after: the consumer reads the
    # published versions again (v2 is within the slack of the pointer's v1) and admits it.
    await upload(store, make_group(tiny, worker="fast", seq=0, weight_version=2, prompt_index=3), t + 3)
    await consumer._filler.poll_tail()  # listed (queued), not yet downloaded
    assert len(consumer.state_dict()["pending"]) == 1
    await publish_versions(store, 2)
    admitted = consumer.counters["admitted"]
    consumer._downloads.launch(1)  # downloaded and judged without next_batch's own look at the pointer
    await async_wait_until(lambda: consumer.counters["admitted"] == admitted + 1, message="the v2 record admitted")
    batch = await consumer.next_batch(1, trainer_version=1)  # the trainer has not moved on
    assert [(g.worker, g.weight_version) for g in batch.groups] == [("fast", 2)]
    assert consumer.counters["rejected/version"] == 1
    assert decoded.count(2) == 2  # the liar's v2 record and the fast one: each decoded once, judged after a read
    await consumer.close()


async def test_lying_worker_rewards_are_replaced_and_counted(store: Store, store_url: str, tiny: Tiny) -> None:
    await setup_run(store, tiny)
    item = ITEMS[0]
    wrong = "x"
    liar = make_group(tiny, worker="liar", seq=0, answers=[item.label, wrong, wrong, wrong], worker_rewards=[1.0] * 4)
    await upload(store, liar, now_ms() - 100)
    await upload(store, make_group(tiny, worker="honest", seq=0, prompt_index=1), now_ms() - 50)
    consumer = await open_consumer(store, tiny, store_url)
    batch = await consumer.next_batch(2, trainer_version=0)
    lied = next(g for g in batch.groups if g.worker == "liar")
    assert lied.rewards == (1.0, 0.0, 0.0, 0.0)
    assert [f["reward"] for f in sample_fields(lied)] == [1.0, 0.0, 0.0, 0.0]
    assert [f["metadata"]["stoa_worker_reward"] for f in sample_fields(lied)] == [1.0] * 4
    assert batch.metrics["worker/liar/reward_disagreements"] == 3
    assert "worker/honest/reward_disagreements" not in batch.metrics
    assert batch.metrics["rollout/stoa_reward_disagreements"] == 3
    assert batch.metrics["rollout/stoa_reward_disagreement_rate"] == 3 / 8
    await consumer.close()


@pytest.mark.parametrize("filter_on", [True, False])
async def test_all_equal_groups_filtered_and_counted(store: Store, store_url: str, tiny: Tiny, filter_on: bool) -> None:
    await setup_run(store, tiny)
    label = ITEMS[0].label
    await upload(store, make_group(tiny, worker="w", seq=0, answers=[label] * 4), now_ms() - 300)
    await upload(store, make_group(tiny, worker="w", seq=1, answers=["x"] * 4), now_ms() - 200)
    await upload(store, make_group(tiny, worker="w", seq=2), now_ms() - 100)
    consumer = await open_consumer(store, tiny, store_url, filter_all_equal=filter_on)
    batch = await consumer.next_batch(1 if filter_on else 3, trainer_version=0)
    if filter_on:
        assert batch.groups[0].rewards == (1.0, 0.0, 1.0, 0.0)
        assert batch.metrics["rollout/stoa_filtered_all_equal"] == 2
    else:
        assert batch.metrics["rollout/stoa_filtered_all_equal"] == 0
    # The scored reward covers every group that arrived, filtered or not: (4 + 0 + 2) / 12.
    assert batch.metrics["rollout/stoa_scored_samples"] == 12
    assert batch.metrics["rollout/stoa_scored_reward_mean"] == pytest.approx(0.5)
    assert batch.metrics["rollout/stoa_reward_mean"] == pytest.approx(0.5)
    await consumer.close()


# -- waiting -------------------------------------------------------------------------------------
async def test_wait_timeout_names_last_seen_workers_and_rejects(store: Store, store_url: str, tiny: Tiny) -> None:
    await setup_run(store, tiny)
    layout = RunLayout(RUN)
    consumer = await open_consumer(store, tiny, store_url, wait_timeout_s=0.3)
    with pytest.raises(ConsumerTimeout, match="no worker seen"):
        await consumer.next_batch(2, trainer_version=0)
    await store.put(layout.heartbeat("mac-heartbeat"), b'{"not": "a heartbeat"}')  # named, not parsed
    beat = Heartbeat(worker_id="mac-paused", name="desk", status="paused", version=3, pointer_version=5,
                     groups_spooled=40, errors=1, last_error="upload: 503")
    await store.put(layout.heartbeat("mac-paused"), beat.to_bytes())
    await store.put_if_absent(layout.rollout("mac-garbage", now_ms(), 0), b"garbage")
    with pytest.raises(ConsumerTimeout) as info:
        await consumer.next_batch(2, trainer_version=0)
    text = str(info.value)
    assert "mac-heartbeat" in text and "mac-garbage" in text and "heartbeat" in text
    assert "mac-paused (heartbeat " in text
    assert "s ago, paused, v3 of v5, 40 groups spooled, 1 errors, last: upload: 503)" in text
    assert "bad_magic=1" in text and "have 0" in text
    assert info.value.rejects == {"bad_magic": 1} and info.value.needed == 2
    await consumer.close()


# -- samples -------------------------------------------------------------------------------------
async def test_sample_fields_field_by_field(store: Store, store_url: str, tiny: Tiny) -> None:
    await setup_run(store, tiny, published=4)
    item = ITEMS[4]
    group = make_group(tiny, worker="w", seq=0, prompt_index=4, answers=[item.label, "x", item.label, "12345"],
                       finish=["stop", "stop", "length", "length"], weight_version=3)
    # A "length" sample is cut at exactly max_tokens, as a worker cuts it (a shorter one is refused).
    cut = [(tiny.encode(text) * MAX_TOKENS)[:MAX_TOKENS] for text in (item.label, "12345")]
    group = msgspec.structs.replace(group, samples=(*group.samples[:2], *(
        msgspec.structs.replace(group.samples[2 + i], response_tokens=t, logprobs=[-0.5] * MAX_TOKENS, mask=[1] * MAX_TOKENS, reward=0.0)
        for i, t in enumerate(cut))))
    key = await upload(store, group)
    consumer = await open_consumer(store, tiny, store_url)
    consumed = (await consumer.next_batch(1, trainer_version=4)).groups[0]
    fields = sample_fields(consumed, group_index=7, indices=[28, 29, 30, 31])
    assert len(fields) == G
    prompt = tiny.prompt(item)
    for i, (f, s) in enumerate(zip(fields, group.samples, strict=True)):
        response = s.response_tokens.tolist()
        assert f["group_index"] == 7 and f["index"] == 28 + i  # one group, contiguous
        assert f["tokens"] == prompt + response
        assert f["response_length"] == len(response)
        assert len(f["loss_mask"]) == len(f["rollout_log_probs"]) == f["response_length"]
        assert f["loss_mask"] == [1] * len(response)
        assert f["rollout_log_probs"] == [float(x) for x in s.logprobs]
        assert f["status"] == ("truncated" if s.finish_reason == "length" else "completed")
        assert f["prompt"] == item.prompt and f["label"] == item.label
        assert isinstance(f["response"], str) and isinstance(f["reward"], float)
        assert f["weight_versions"] == ["3"]
        meta = f["metadata"]
        assert meta["stoa_worker"] == "w" and meta["stoa_weight_version"] == 3 and meta["stoa_version_lag"] == 1
        assert meta["stoa_key"] == key and meta["stoa_use"] == 1 and meta["stoa_finish_reason"] == s.finish_reason
    assert [f["reward"] for f in fields] == [1.0, 0.0, 0.0, 0.0]
    assert fields[0]["response"] == item.label  # the final EOS is not part of the text
    assert fields[2]["response"] == tiny.decode(cut[0])  # truncated: no EOS to strip
    with pytest.raises(ValueError):
        sample_fields(consumed, indices=[1, 2])
    await consumer.close()


def test_sample_fields_clamp_positive_logprobs(tiny: Tiny) -> None:
    from slime_stoa.trainer.consumer import ConsumedGroup

    g = make_group(tiny, worker="w", seq=0)
    s0 = msgspec.structs.replace(g.samples[0], logprobs=[5e-5] * len(g.samples[0].logprobs))
    g = msgspec.structs.replace(g, samples=(s0,) + g.samples[1:])
    cg = ConsumedGroup(key="k", group=g, prompt="p", label="l", texts=("",) * G, rewards=(0.0,) * G, version_lag=0, use=1)
    assert sample_fields(cg)[0]["rollout_log_probs"] == [0.0] * len(s0.logprobs)


# -- the run's own tokenizer, from the anchor -----------------------------------------------------
async def test_open_reads_tokenizer_from_the_anchor(store: Store, store_url: str, tiny: Tiny) -> None:
    await setup_run(store, tiny, published=None)
    publisher = Publisher(store, RUN, PublisherConfig(extras_dir=tiny.folder, catchup=False))
    await publisher.open()
    await publisher.publish(load_hf_state(tiny.folder))
    assert publisher.state_digest is not None
    await upload(store, make_group(tiny, worker="w", seq=0, state_digest=publisher.state_digest))
    consumer = await RolloutConsumer.open(store, config(store_url))  # no decoder injected
    assert tiny.eos in consumer.rescorer.eos_ids
    batch = await consumer.next_batch(1, trainer_version=0)
    assert batch.groups[0].rewards == (1.0, 0.0, 1.0, 0.0)
    await consumer.close()


# -- slime glue (slime itself is not installed here: its two types are stood in) -------------------
def config_from_args(args: types.SimpleNamespace) -> ConsumerConfig:
    """The consumer's part of the plugin's settings object, parsed from slime's args."""
    from slime_stoa.trainer.slime.settings import StoaSettings

    return StoaSettings.from_args(args).consumer


def test_config_from_args_names_missing_and_bad_settings() -> None:

    with pytest.raises(ValueError, match="stoa_bucket"):
        config_from_args(types.SimpleNamespace(stoa_run="r"))
    with pytest.raises(ValueError, match="stoa_run"):
        config_from_args(types.SimpleNamespace(stoa_bucket="file://bucket-dir"))
    with pytest.raises(ValueError, match="stoa_staleness_limit"):
        config_from_args(types.SimpleNamespace(stoa_bucket="file://bucket-dir", stoa_run="r", stoa_staleness_limit="x"))
    cfg = config_from_args(types.SimpleNamespace(
        stoa_bucket="file://bucket-dir", stoa_run="r", stoa_staleness_limit=3, stoa_filter_all_equal="false",
        stoa_wait_timeout_s="12.5", stoa_admission_order="newest_version",
    ))
    assert (cfg.staleness_limit, cfg.filter_all_equal, cfg.wait_timeout_s, cfg.admission_order) == (3, False, 12.5, "newest_version")
    assert cfg.reuse_limit is None  # the run manifest's
    assert (cfg.run_key, cfg.rollouts_url) == (None, None)


def test_config_from_args_takes_the_run_key_file_and_a_rollouts_bucket(tmp_path: Path) -> None:
    from slime_stoa.protocol.signing import write_key_file

    key = SigningKey.generate()
    path = write_key_file(tmp_path / "run.key", key)
    cfg = config_from_args(types.SimpleNamespace(
        stoa_bucket="file://weights", stoa_run="r", stoa_run_key=str(path), stoa_rollouts_bucket="file://rollouts",
    ))
    assert cfg.run_key == key.public.to_text() and cfg.rollouts_url == "file://rollouts"
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        config_from_args(types.SimpleNamespace(stoa_bucket="file://weights", stoa_run="r", stoa_run_key=str(path)))


class _StandInSample:
    """The fields of slime's `Sample` that the glue passes (slime is not installed here)."""

    class Status(enum.Enum):
        COMPLETED = "completed"
        TRUNCATED = "truncated"

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


class _DataSource:
    """slime's data source without --prompt-data: blank samples carrying checkpointed ids."""

    def __init__(self, n_per_prompt: int) -> None:
        self.n, self.group_index, self.index, self.metadata = n_per_prompt, 0, 0, {}

    def get_samples(self, num: int) -> list[list[Any]]:
        groups = []
        for _ in range(num):
            group = []
            for _ in range(self.n):
                group.append(types.SimpleNamespace(prompt="", group_index=self.group_index, index=self.index))
                self.index += 1
            self.group_index += 1
            groups.append(group)
        return groups


async def test_generate_rollout_end_to_end(store: Store, store_url: str, tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    from slime_stoa.trainer.slime import rollout

    await setup_run(store, tiny)
    for i in range(6):
        await upload(store, make_group(tiny, worker=f"w{i % 2}", seq=i, prompt_index=i), now_ms() - 1000 + i)
    types_mod = types.ModuleType("slime.utils.types")
    types_mod.Sample = _StandInSample
    base_mod = types.ModuleType("slime.rollout.base_types")
    base_mod.RolloutFnTrainOutput = lambda samples, metrics=None: types.SimpleNamespace(samples=samples, metrics=metrics)
    for name in ("slime", "slime.utils", "slime.rollout"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "slime.utils.types", types_mod)
    monkeypatch.setitem(sys.modules, "slime.rollout.base_types", base_mod)
    args = types.SimpleNamespace(
        stoa_bucket=store_url, stoa_run=RUN, stoa_tokenizer_dir=str(tiny.folder), stoa_poll_interval_s=0.02,
        stoa_wait_timeout_s=3, rollout_batch_size=3, n_samples_per_prompt=G,
    )
    source = _DataSource(G)
    try:
        out = await asyncio.to_thread(rollout.generate_rollout, args, 0, source)
        assert len(out.samples) == 3 and all(len(g) == G for g in out.samples)
        assert [s.index for g in out.samples for s in g] == list(range(12))
        assert [g[0].group_index for g in out.samples] == [0, 1, 2]
        assert out.samples[0][0].status is _StandInSample.Status.COMPLETED
        assert out.metrics["rollout/stoa_groups"] == 3
        state = source.metadata[rollout.METADATA_KEY]
        assert state["run"] == RUN and state["cursor"]
        # A restarted process resumes from the checkpointed state: the other three groups.
        await asyncio.to_thread(rollout._SESSION.close)
        rollout._SESSION = None
        out2 = await asyncio.to_thread(rollout.generate_rollout, args, 1, source)
        firsts = {s.metadata["stoa_key"] for g in out.samples for s in g}
        seconds = {s.metadata["stoa_key"] for g in out2.samples for s in g}
        assert len(firsts | seconds) == 6 and not firsts & seconds
        with pytest.raises(ValueError, match="n-samples-per-prompt"):
            await asyncio.to_thread(
                rollout.generate_rollout, types.SimpleNamespace(**{**vars(args), "n_samples_per_prompt": 2}), 2, source
            )
    finally:
        if rollout._SESSION is not None:
            await asyncio.to_thread(rollout._SESSION.close)
            rollout._SESSION = None


def test_no_numpy_arrays_leak_into_fields(tiny: Tiny) -> None:
    from slime_stoa.trainer.consumer import ConsumedGroup

    g = make_group(tiny, worker="w", seq=0)
    cg = ConsumedGroup(key="k", group=g, prompt="p", label="l", texts=("",) * G, rewards=(0.0,) * G, version_lag=0, use=1)
    for f in sample_fields(cg):
        assert all(type(t) is int for t in f["tokens"]) and all(type(x) is float for x in f["rollout_log_probs"])
        assert not any(isinstance(v, np.ndarray) for v in f.values())


# -- background prefetch and flaky stores -----------------------------------------------------------
async def test_prefetch_downloads_the_next_batch_in_the_background(store: Store, store_url: str, tiny: Tiny) -> None:
    await setup_run(store, tiny)
    await upload(store, make_group(tiny, worker="w", seq=0), now_ms() - 500)
    consumer = await open_consumer(store, tiny, store_url, prefetch_groups=3)
    await consumer.next_batch(1, trainer_version=0)
    for i in range(1, 4):
        await upload(store, make_group(tiny, worker="w", seq=i, prompt_index=i), now_ms() - 400 + i)
    # The prefetch admits them while the "trainer" is busy.
    await async_wait_until(
        lambda: len(consumer.state_dict()["ledger"]) == 3,
        timeout=30,
        message=lambda: f"3 groups in the ledger (have {len(consumer.state_dict()['ledger'])})",
    )
    batch = await consumer.next_batch(3, trainer_version=0)
    assert batch.metrics["rollout/stoa_groups"] == 3 and batch.metrics["rollout/stoa_get_requests"] == 3
    await consumer.close()


class _FlakyStore(CountingStore):
    """Forwards to a real store, but the first `failures` GETs of each record fail as unavailable."""

    def __init__(self, inner: Store, failures: int) -> None:
        super().__init__(inner)
        self.failures = failures
        self.failed: dict[str, int] = {}

    async def get(self, key: str, **kw: Any):
        from slime_stoa.protocol.store import StoreUnavailable

        if "/rollouts/" in key and self.failed.get(key, 0) < self.failures:
            self.failed[key] = self.failed.get(key, 0) + 1
            raise StoreUnavailable(f"{key}: injected failure")
        return await super().get(key, **kw)


@pytest.mark.parametrize("attempts", [1, 3])
async def test_download_failures_are_retried_then_rejected(store: Store, store_url: str, tiny: Tiny, attempts: int) -> None:
    await setup_run(store, tiny)
    await upload(store, make_group(tiny, worker="w", seq=0), now_ms() - 100)
    flaky = _FlakyStore(store, failures=2)
    consumer = await open_consumer(flaky, tiny, store_url, max_download_attempts=attempts, wait_timeout_s=0.5)
    if attempts == 3:
        batch = await consumer.next_batch(1, trainer_version=0)
        assert batch.groups[0].worker == "w" and consumer.counters["get_requests"] == 3
    else:
        with pytest.raises(ConsumerTimeout, match="download=1"):
            await consumer.next_batch(1, trainer_version=0)
    await consumer.close()
