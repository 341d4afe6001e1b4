"""Quarantine of dishonest workers: the pure policy at its edges, then the consumer end to end on
both store backends (real encoder, real keys, real re-scoring with the synthetic task)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from slime_stoa.cli import main
from slime_stoa.cli.fleet_cmd import COLUMNS, fleet_rows
from slime_stoa.protocol.heartbeat import Heartbeat
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import Store, open_store
from slime_stoa.trainer.consumer import ConsumerConfig, ConsumerState
from slime_stoa.trainer.consumer.quarantine import (
    MEDIAN_MIN_WORKERS,
    Quarantine,
    QuarantineConfig,
    WorkerRecord,
    decide,
    fleet_median_gap,
    records_from_json,
    records_to_json,
)
from tests.conftest import async_wait_until
from tests.test_consumer import ITEMS, RUN, Tiny, make_group, now_ms, open_consumer, setup_run, tiny, upload  # noqa: F401

# A small window so the tests' tallies are easy to reason about; no decay within these tests
# matters except where a test says so.
CFG = QuarantineConfig(min_samples=10, window_samples=1_000_000, max_disagreement_rate=0.1, min_gap_tokens=100,
                       window_tokens=1_000_000, max_logprob_gap=0.5, max_gap_ratio=10.0, gap_floor=0.05,
                       canary_strikes=2)


# -- the pure policy --------------------------------------------------------------------------------
def test_disagreement_rate_is_judged_only_after_min_samples_and_strictly_above_the_limit() -> None:
    q = Quarantine(CFG)
    assert q.observe_scored("w", samples=9, disagreements=9) == []  # 100% but under min_samples
    assert not q.is_quarantined("w")
    assert q.observe_scored("w", samples=1, disagreements=0) == ["w"]  # 10 samples, 90%
    assert q.quarantined() == {"w": "reward_disagreement"}

    q = Quarantine(CFG)
    assert q.observe_scored("edge", samples=100, disagreements=10) == []  # exactly the limit: allowed
    assert q.observe_scored("edge", samples=1, disagreements=1) == ["edge"]  # 11/101 > 0.1
    assert q.observe_scored("edge", samples=100, disagreements=100) == []  # already quarantined: no new verdict


def test_disagreement_rate_follows_recent_behaviour() -> None:
    """A worker honest for a long time that starts lying is caught within about one window."""
    cfg = QuarantineConfig(min_samples=10, window_samples=200, max_disagreement_rate=0.1)
    q = Quarantine(cfg)
    for _ in range(100):
        assert q.observe_scored("w", samples=100, disagreements=0) == []  # 10,000 honest samples
    caught_after = None
    for i in range(1, 20):
        if q.observe_scored("w", samples=4, disagreements=4):
            caught_after = 4 * i
            break
    # About 0.1 x the window of lying samples shift the weighted rate past 10% (a cumulative
    # rate would need ~1,100); the weighted tally stays bounded near the window, whatever the history.
    assert caught_after is not None and caught_after <= 32, caught_after
    r = q.records["w"]
    assert r.samples == 10_000 + caught_after and 200 < r.w_samples < 300
    assert r.disagreement_rate > 0.1 > math.fsum([caught_after]) / r.samples


def test_logprob_gap_absolute_limit_needs_min_tokens() -> None:
    q = Quarantine(CFG)
    assert q.observe_gap("w", 3.0, 99) == []
    assert q.observe_gap("w", 3.0, 1) == ["w"]
    assert q.quarantined() == {"w": "logprob_gap"}
    q = Quarantine(CFG)
    assert q.observe_gap("w", 0.5, 1000) == []  # at the limit: allowed
    with pytest.raises(ValueError):
        q.observe_gap("w", -1.0, 10)
    with pytest.raises(ValueError):
        q.observe_gap("w", float("nan"), 10)
    with pytest.raises(ValueError):
        q.observe_gap("w", 0.1, -3)


def test_logprob_gap_relative_to_the_fleet_median() -> None:
    q = Quarantine(CFG)
    for w, gap in (("a", 0.010), ("b", 0.012), ("c", 0.011)):
        assert q.observe_gap(w, gap, 500) == []
    assert fleet_median_gap(q.records, CFG) == pytest.approx(0.011)
    # 0.10 is under the absolute limit but above max(10 x 0.011, 0.05).
    assert q.observe_gap("d", 0.10, 500) == []  # 0.10 < 0.11: still fine
    assert q.observe_gap("e", 0.2, 500) == ["e"]
    assert q.quarantined() == {"e": "logprob_gap_relative"}
    # The quarantined worker does not count towards the median.
    assert fleet_median_gap(q.records, CFG) == pytest.approx((0.011 + 0.012) / 2)


def test_relative_limit_needs_enough_workers_and_respects_the_floor() -> None:
    q = Quarantine(CFG)
    for w in [f"w{i}" for i in range(MEDIAN_MIN_WORKERS - 2)]:
        q.observe_gap(w, 0.001, 500)
    assert q.observe_gap("odd", 0.4, 500) == []  # two workers: no median yet, under the absolute limit
    assert fleet_median_gap(q.records, CFG) is None
    assert q.observe_gap("third", 0.001, 500) == ["odd"]  # a third worker measured: the outlier stands out
    q = Quarantine(CFG)
    for w in ("a", "b", "c"):
        q.observe_gap(w, 0.001, 500)
    assert q.observe_gap("noisy", 0.04, 500) == []  # 40x the median, but under the floor 0.05
    assert q.observe_gap("bad", 0.06, 500) == ["bad"]


def test_canary_strikes() -> None:
    q = Quarantine(CFG)
    assert q.observe_canary("w", passed=True) == []
    assert q.observe_canary("w", passed=False) == []
    assert q.observe_canary("w", passed=True) == []
    assert q.observe_canary("w", passed=False, now_ms=1234) == ["w"]
    assert q.records["w"].reason == "canary" and q.records["w"].since_ms == 1234


def test_disabled_policy_gathers_evidence_but_quarantines_nobody() -> None:
    q = Quarantine(QuarantineConfig(enabled=False, min_samples=1))
    assert q.observe_scored("w", samples=100, disagreements=100) == []
    assert q.observe_canary("w", passed=False) == [] and q.observe_canary("w", passed=False) == []
    assert q.records["w"].samples == 100 and q.records["w"].strikes == 2 and not q.is_quarantined("w")


def test_release_lifts_only_a_quarantine_older_than_the_release() -> None:
    q = Quarantine(CFG)
    assert q.apply_releases({"w": 3}) == []  # released three times before; not quarantined now
    q.observe_scored("w", samples=10, disagreements=10)
    assert q.is_quarantined("w")
    assert q.apply_releases({"w": 3}) == []  # an old release does not lift a new quarantine
    assert q.is_quarantined("w")
    assert q.apply_releases({"w": 4, "other": 1}) == ["w"]
    r = q.records["w"]
    assert not r.quarantined and r.samples == 0 and r.w_disagreements == 0 and r.releases == 4  # fresh stats
    assert q.observe_scored("w", samples=9, disagreements=9) == []  # judged again only after min_samples
    with pytest.raises(ValueError):
        q.apply_releases({"w": -1})


def test_decide_order_and_config_checks() -> None:
    r = WorkerRecord(samples=100, w_samples=100, w_disagreements=100, strikes=5)
    assert decide(r, CFG) == "canary"  # strikes first
    assert decide(WorkerRecord(reason="canary"), CFG) is None  # already quarantined
    for bad in (dict(min_samples=-1), dict(max_disagreement_rate=1.5), dict(max_logprob_gap=0), dict(canary_strikes=0),
                dict(window_samples=0), dict(enabled="yes"), dict(gap_floor=float("inf"))):
        with pytest.raises(ValueError):
            QuarantineConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ConsumerConfig\.quarantine must be a QuarantineConfig"):
        ConsumerConfig(store_url="file:///x", run="r", quarantine={"min_samples": 5})  # type: ignore[arg-type]


def test_records_json_round_trip_and_back_compat() -> None:
    q = Quarantine(CFG)
    q.observe_scored("a", samples=10, disagreements=10, now_ms=77)
    q.observe_gap("b", 0.01, 300)
    doc = records_to_json(q.records)
    assert records_from_json(doc) == q.records
    state = ConsumerState(run="r", quarantine=q.records)
    assert ConsumerState.from_json(state.to_json()).quarantine == q.records
    old = state.to_json()
    del old["quarantine"]  # a state written before quarantines existed
    assert ConsumerState.from_json(old).quarantine == {}
    assert records_from_json({"a": {"samples": 3, "future_field": 1}})["a"] == WorkerRecord(samples=3)
    for bad in ([], {"a": []}, {"a": {"samples": -1}}, {"a": {"w_gap": "x"}}, {"a": {"reason": 3}}, {"": {}}):
        with pytest.raises(ValueError):
            records_from_json(bad)


# -- the consumer, end to end ------------------------------------------------------------------------
def wrong(i: int) -> str:
    return "x" if ITEMS[i].label != "x" else "y"


def lying_group(tiny: Tiny, worker: str, seq: int, i: int):  # noqa: F811
    """Every answer wrong, every reward claimed 1.0."""
    return make_group(tiny, worker=worker, seq=seq, prompt_index=i, answers=[wrong(i)] * 4, worker_rewards=[1.0] * 4)


QUICK = dict(quarantine=QuarantineConfig(min_samples=8), download_concurrency=1, wait_timeout_s=5.0)


async def test_lying_worker_is_quarantined_and_its_groups_are_not_used(
    store: Store, store_url: str, tiny: Tiny  # noqa: F811
) -> None:
    await setup_run(store, tiny)
    base = now_ms() - 10_000
    ts = iter(range(base, base + 100))
    for i in range(4):
        await upload(store, make_group(tiny, worker="mac-h", seq=i, prompt_index=i), next(ts))
    for i in range(2):  # the liar starts honest: these enter the pool
        await upload(store, make_group(tiny, worker="mac-l", seq=i, prompt_index=10 + i), next(ts))
    await upload(store, lying_group(tiny, "mac-l", 2, 12), next(ts))  # 4 of 12 samples disagree: > 5%
    for i in range(3, 5):  # later groups of the liar, honest-looking: never downloaded
        await upload(store, make_group(tiny, worker="mac-l", seq=i, prompt_index=10 + i), next(ts))
    for i in range(4, 8):
        await upload(store, make_group(tiny, worker="mac-h", seq=i, prompt_index=i), next(ts))

    consumer = await open_consumer(store, tiny, store_url, **QUICK)
    batch = await consumer.next_batch(8, trainer_version=0)
    assert {g.worker for g in batch.groups} == {"mac-h"} and len(batch.groups) == 8
    assert consumer.quarantined == {"mac-l": "reward_disagreement"}
    c = consumer.counters
    assert c["rejected/quarantined"] == 3  # the lying record and the two after it
    assert c["quarantine_dropped"] == 2  # its two honest groups already in the pool
    assert c["get_requests"] == 11  # 13 records, the two after the verdict not downloaded
    m = batch.metrics
    assert m["rollout/stoa_quarantined_workers"] == 1.0
    assert m["worker/mac-l/quarantined"] == 1.0 and m["worker/mac-h/quarantined"] == 0.0
    assert m["rollout/stoa_quarantine_rejected"] == 3.0 and m["rollout/stoa_quarantine_dropped"] == 2.0
    assert m["rollout/stoa_rejected/quarantined"] == 3.0

    # A restart keeps the quarantine; the release lifts it.
    await consumer.save_state()
    await consumer.close()
    again = await open_consumer(store, tiny, store_url, restore=True, **QUICK)
    assert again.quarantined == {"mac-l": "reward_disagreement"}
    await upload(store, make_group(tiny, worker="mac-l", seq=5, prompt_index=20), next(ts))
    await upload(store, make_group(tiny, worker="mac-h", seq=8, prompt_index=8), next(ts))
    b2 = await again.next_batch(1, trainer_version=0)
    assert [g.worker for g in b2.groups] == ["mac-h"]
    assert again.counters["rejected/quarantined"] == 4
    assert again.apply_releases({"mac-l": 1}) == ["mac-l"]
    assert again.quarantined == {}
    await upload(store, make_group(tiny, worker="mac-l", seq=6, prompt_index=21), next(ts))
    b3 = await again.next_batch(1, trainer_version=0)
    assert [g.worker for g in b3.groups] == ["mac-l"]
    assert b3.metrics["worker/mac-l/quarantined"] == 0.0 and b3.metrics["rollout/stoa_quarantined_workers"] == 0.0
    await again.close()


async def test_honest_workers_are_not_quarantined(store: Store, store_url: str, tiny: Tiny) -> None:  # noqa: F811
    """A normal synthetic run: three honest workers, mixed answers, small logprob gaps that
    differ between workers (different chips) -- default thresholds, min samples lowered."""
    await setup_run(store, tiny)
    base = now_ms() - 10_000
    workers = ["mac-a", "mac-b", "mac-c"]
    for n in range(24):
        w = workers[n % 3]
        i = n % len(ITEMS)
        answers = [ITEMS[i].label if (n + k) % 3 else wrong(i) for k in range(4)]
        await upload(store, make_group(tiny, worker=w, seq=n // 3, prompt_index=i, answers=answers), base + n)
    consumer = await open_consumer(store, tiny, store_url, quarantine=QuarantineConfig(min_samples=8, min_gap_tokens=64),
                                   filter_all_equal=False)
    batch = await consumer.next_batch(24, trainer_version=0)
    for g in batch.groups:  # the learner's per-group measurement
        gap = {"mac-a": 2e-3, "mac-b": 4e-3, "mac-c": 9e-3}[g.worker]
        tokens = sum(len(s.response_tokens) for s in g.group.samples)
        assert consumer.observe_logprob_gap(g.worker, gap, tokens, prompt_index=g.group.prompt_index) == []
    assert consumer.quarantined == {}
    assert consumer.counters["samples_scored"] == 96 and "rejected/quarantined" not in consumer.counters
    await consumer.close()


async def test_logprob_gap_quarantines_and_drops_buffered_groups(store: Store, store_url: str, tiny: Tiny) -> None:  # noqa: F811
    await setup_run(store, tiny)
    base = now_ms() - 10_000
    for i in range(4):
        await upload(store, make_group(tiny, worker="mac-f", seq=i, prompt_index=i), base + i)
    for i in range(4):
        await upload(store, make_group(tiny, worker="mac-h", seq=i, prompt_index=4 + i), base + 4 + i)
    consumer = await open_consumer(store, tiny, store_url, quarantine=QuarantineConfig(min_gap_tokens=100), prefetch_groups=6)
    first = await consumer.next_batch(2, trainer_version=0)
    assert [g.worker for g in first.groups] == ["mac-f", "mac-f"]
    await async_wait_until(lambda: consumer.counters.get("admitted", 0) == 8, message="the prefetch")
    assert consumer.observe_logprob_gap("mac-h", 0.003, 500) == []
    tokens = sum(len(s.response_tokens) for g in first.groups for s in g.group.samples)
    assert consumer.observe_logprob_gap("mac-f", 1.7, 50) == []  # under min_gap_tokens
    assert consumer.observe_logprob_gap("mac-f", 1.7, max(tokens, 50)) == ["mac-f"]  # made-up logprobs
    assert consumer.quarantined == {"mac-f": "logprob_gap"}
    assert consumer.counters["quarantine_dropped"] == 2  # its two groups still in the pool
    rest = await consumer.next_batch(4, trainer_version=0)
    assert [g.worker for g in rest.groups] == ["mac-h"] * 4
    with pytest.raises(ValueError):
        consumer.observe_logprob_gap("mac-h", float("inf"), 10)
    await consumer.close()


def test_quarantine_settings_reach_the_consumer_config() -> None:
    cfg = ConsumerConfig(store_url="file:///x", run="r", quarantine=QuarantineConfig(min_samples=5, max_gap_ratio=None))
    assert cfg.quarantine == QuarantineConfig(min_samples=5, max_gap_ratio=None)
    assert ConsumerConfig(store_url="file:///x", run="r").quarantine == QuarantineConfig()


def test_fleet_shows_quarantined_workers(
    store_url: str, store_env: dict[str, str], tiny: Tiny, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    layout = RunLayout(RUN)

    async def seed() -> None:
        async with open_store(store_url, environ=store_env) as store:
            await setup_run(store, tiny)
            for w in ("mac-h", "mac-f"):
                await store.put(layout.heartbeat(w), Heartbeat(worker_id=w, name=w, status="generating",
                                                               updated_at=time.time()).to_bytes())
            consumer = await open_consumer(store, tiny, store_url, quarantine=QuarantineConfig(min_gap_tokens=100))
            assert consumer.observe_logprob_gap("mac-f", 2.0, 500) == ["mac-f"]
            assert consumer.observe_logprob_gap("mac-gone", 3.0, 500) == ["mac-gone"]  # no heartbeat
            await consumer.save_state()
            await consumer.close()

    asyncio.run(seed())
    for name, value in store_env.items():
        monkeypatch.setenv(name, value)
    assert main(["fleet", "--store", store_url, "--run", RUN]) == 0
    out = capsys.readouterr().out
    assert f"run {RUN} at v0: 2 worker(s), 2 running, 2 quarantined" in out
    header, *rows = [line for line in out.splitlines() if line.startswith(("worker", "mac-"))]
    assert header.split()[-2:] == ["quarantine", "key"]
    by_worker = {r.split()[0]: r for r in rows}
    assert "logprob_gap" in by_worker["mac-f"] and "ago" in by_worker["mac-f"]
    assert "logprob_gap" not in by_worker["mac-h"]
    assert "quarantined, no heartbeat: mac-gone logprob_gap" in out


def test_fleet_rows_quarantine_cell() -> None:
    now = time.time()
    beats = [Heartbeat(worker_id="a", name="a", status="generating", updated_at=now)]
    records = {"a": WorkerRecord(reason="canary", since_ms=int((now - 120) * 1000))}
    cell = COLUMNS.index("quarantine")
    assert fleet_rows(beats, now, None, records)[0][cell] == "canary (2m ago)"
    assert fleet_rows(beats, now)[0][cell] == ""
