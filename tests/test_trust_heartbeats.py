"""Signed heartbeats: in a signed run a worker signs its heartbeat with its worker key; `stoa fleet`
and the trainer's metrics show an unsigned, unknown, revoked or forged heartbeat as such, never as
a running worker. A revoked worker is told by the registry and stops uploading."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import replace
from pathlib import Path

import pytest

from macd.config import DaemonConfig
from macd.revocation import RevocationWatch
from macd.worker import Worker, WorkerOptions
from slime_stoa.cli.fleet_cmd import COLUMNS, fleet_rows, read_trusted_registry
from slime_stoa.protocol.heartbeat import Heartbeat, judge_heartbeat, read_fleet, shown_status, worker_metrics
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.registry import (
    Registry,
    add_worker,
    registry_bytes,
    revocation,
    revoke_worker,
    update_registry,
)
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import NotFound, Store
from slime_stoa.protocol.worker_keys import WorkerKeyFile, write_worker_key_file
from slime_stoa.tasks import generate_items, make_task
from slime_stoa.tasks.objects import put_task_objects
from slime_stoa.trainer.tracking import UNTRUSTED_TOTAL, fleet_metrics, read_fleet_metrics
from tests.conftest import async_wait_until

RUN = "beat-run"
KEYS = {w: SigningKey.generate() for w in ("mac-a", "mac-b", "mac-c")}


def registry() -> Registry:
    reg = Registry(run=RUN)
    for worker, key in KEYS.items():
        reg = add_worker(reg, worker=worker, name=worker, key=key.public, now=1.0)
    return revoke_worker(reg, "mac-c", now=2.0)


def beat(worker: str, **kw: object) -> Heartbeat:
    fields: dict = {"status": "generating", "version": 3, "pointer_version": 3, "tokens_per_s": 500.0,
                    "updated_at": time.time(), **kw}
    return Heartbeat(worker_id=worker, name=worker, **fields)


def judged(data: bytes, worker: str) -> str:
    return judge_heartbeat(data, Heartbeat.from_bytes(data, worker=worker), registry())


def test_a_heartbeat_is_judged_against_the_registry() -> None:
    a = beat("mac-a")
    assert judged(a.to_bytes(KEYS["mac-a"], run=RUN), "mac-a") == "signed"
    assert Heartbeat.from_bytes(a.to_bytes(KEYS["mac-a"], run=RUN)) == a  # the signature is not a field
    assert judged(a.to_bytes(), "mac-a") == "unsigned"
    assert judged(a.to_bytes(SigningKey.generate(), run=RUN), "mac-a") == "unknown"
    assert judged(a.to_bytes(KEYS["mac-b"], run=RUN), "mac-a") == "forged"  # another worker's key
    assert judged(a.to_bytes(KEYS["mac-a"], run="other-run"), "mac-a") == "forged"  # signed for another run
    tampered = a.to_bytes(KEYS["mac-a"], run=RUN).replace(b'"tokens_per_s": 500.0', b'"tokens_per_s": 1000000000.0')
    assert b"1000000000.0" in tampered and judged(tampered, "mac-a") == "forged"
    # A revoked worker is revoked whatever its heartbeat says or who signed it.
    for data in (beat("mac-c").to_bytes(KEYS["mac-c"], run=RUN), beat("mac-c").to_bytes(), beat("mac-c").to_bytes(KEYS["mac-a"], run=RUN)):
        assert judged(data, "mac-c") == "revoked"


def test_untrusted_heartbeats_never_show_as_running() -> None:
    now = time.time()
    rows = fleet_rows([(beat("mac-a"), "signed"), (beat("mac-b"), "forged"), (beat("mac-c", tokens_per_s=1e9), "revoked"),
                       (beat("mac-d"), "unsigned"), (beat("mac-e"), "unknown")], now, 3)
    cells = [dict(zip(COLUMNS, r, strict=True)) for r in rows]
    # an unverified heartbeat's counters are not shown: its version cell says why
    assert [(c["status"], c["key"], c["tok/s"], c["version"], c["lag"]) for c in cells] == [
        ("generating", "signed", "500", "v3", "0"),
        ("forged", "forged", "-", "unverified", "-"),
        ("revoked", "revoked", "-", "unverified", "-"),
        ("unsigned", "unsigned", "-", "unverified", "-"),
        ("unknown", "unknown", "-", "unverified", "-"),
    ]
    # An unsigned run's heartbeats are shown as they say, with no verdict.
    plain = dict(zip(COLUMNS, fleet_rows([beat("mac-a")], now, 3)[0], strict=True))
    assert (plain["status"], plain["key"], plain["tok/s"]) == ("generating", "-", "500")
    assert shown_status(beat("mac-a"), now, "revoked") == "revoked"
    m = worker_metrics(beat("mac-c", tokens_per_s=1e9), now, prefix="w", trust="revoked")
    assert m["w/running"] == 0.0 and m["w/tokens_per_s"] == 0.0 and m["w/revoked"] == 1.0 and "w/version" not in m
    assert "w/untrusted" not in worker_metrics(beat("mac-a"), now, prefix="w")
    totals = fleet_metrics([beat("mac-a"), beat("mac-c", tokens_per_s=1e9)], now, head=3,
                           trust={"mac-a": "signed", "mac-c": "revoked"})
    assert totals["rollout/stoa_fleet_running"] == 1.0 and totals["rollout/stoa_fleet_tokens_per_s"] == 500.0
    assert totals[UNTRUSTED_TOTAL] == 1.0


async def put_forgeries(store: Store) -> None:
    """An honest signed heartbeat, and what a bucket writer can put beside it."""
    layout = RunLayout(RUN)
    await store.put(layout.heartbeat("mac-a"), beat("mac-a").to_bytes(KEYS["mac-a"], run=RUN))
    await store.put(layout.heartbeat("mac-b"), beat("mac-b", tokens_per_s=1e9).to_bytes())  # unsigned, claims a lot
    await store.put(layout.heartbeat("mac-c"), beat("mac-c", tokens_per_s=1e9).to_bytes(KEYS["mac-c"], run=RUN))  # revoked


async def test_the_trainer_metrics_and_fleet_judge_heartbeats_in_the_bucket(store: Store) -> None:
    run_key = SigningKey.generate()
    await store.put(RunLayout(RUN).registry, registry_bytes(replace(registry(), serial=4), run_key))
    await put_forgeries(store)
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", run_key=run_key.public.to_text())
    reg, problem = await read_trusted_registry(store, manifest)
    assert problem is None and reg is not None and reg.serial == 4
    found, bad = await read_fleet(store, RUN, reg)
    assert bad == 0 and sorted((b.worker_id, t) for b, t in found) == [
        ("mac-a", "signed"), ("mac-b", "unsigned"), ("mac-c", "revoked")]
    metrics = await read_fleet_metrics(store, RUN, time.time(), head=3, registry=reg)
    assert metrics["rollout/stoa_fleet_running"] == 1.0 and metrics["rollout/stoa_fleet_tokens_per_s"] == 500.0
    assert metrics[UNTRUSTED_TOTAL] == 2.0 and metrics["worker/mac-c/revoked"] == 1.0
    unsigned = await read_fleet_metrics(store, RUN, time.time(), head=3)  # an unsigned run: today's view
    assert unsigned["rollout/stoa_fleet_running"] == 3.0 and UNTRUSTED_TOTAL not in unsigned
    # A registry the run key did not sign trusts nobody.
    await store.put(RunLayout(RUN).registry, registry_bytes(registry(), SigningKey.generate()))
    reg, problem = await read_trusted_registry(store, manifest)
    assert problem and reg is not None and not reg.workers
    assert {t for _, t in (await read_fleet(store, RUN, reg))[0]} == {"unsigned", "unknown"}


async def test_a_worker_learns_its_revocation_and_ignores_an_old_registry(store: Store) -> None:
    run_key = SigningKey.generate()
    trust = RunTrust(RUN, run_key.public)
    watch = RevocationWatch(store, RUN, "mac-c", KEYS["mac-c"].key_id, poll_s=0.01)
    before = functools.reduce(lambda r, w: add_worker(r, worker=w, name=w, key=KEYS[w].public, now=1.0), KEYS, Registry(run=RUN))
    await store.put(RunLayout(RUN).registry, registry_bytes(before, run_key))
    assert await watch.check(trust) is None and watch.serial == 3
    revoked = revoke_worker(before, "mac-c", now=5.0)
    assert revocation(revoked, "mac-c", KEYS["mac-c"].key_id) is not None
    assert revocation(revoked, "mac-a", KEYS["mac-c"].key_id) is not None  # the key, under any worker id
    assert revocation(revoked, "mac-a", KEYS["mac-a"].key_id) is None
    stop = asyncio.Event()
    watching = asyncio.create_task(watch.watch(trust, stop))
    await store.put(RunLayout(RUN).registry, registry_bytes(revoked, run_key))
    entry = await asyncio.wait_for(watching, 10)
    assert entry is not None and entry.revoked_at == 5.0
    # Another watcher that read the revocation ignores the old copy put back.
    again = RevocationWatch(store, RUN, "mac-c", KEYS["mac-c"].key_id, poll_s=0.01)
    assert await again.check(trust) is not None
    again.revoked = None
    await store.put(RunLayout(RUN).registry, registry_bytes(before, run_key))
    assert await again.check(trust) is None and again.serial == 4


async def test_a_revoked_worker_stops_at_start_and_says_so(
    store: Store, store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_key = SigningKey.generate()
    layout = RunLayout(RUN)
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6, run_key=run_key.public.to_text())
    await store.put(layout.run_manifest, manifest.to_bytes(run_key))
    await put_task_objects(store, RUN, "synthetic", {"train": make_task("synthetic", generate_items(8, seed=1)).encode()}, key=run_key)
    config = DaemonConfig(store=store_url, run=RUN, name="mac", worker_id="mac-c", data_dir=tmp_path / "data", batch=2,
                          run_key=run_key.public.to_text())
    path = write_worker_key_file(tmp_path / "key.json", WorkerKeyFile(run=RUN, worker="mac-c", key=KEYS["mac-c"]))
    config = replace(config, worker_key=str(path))
    await update_registry(store, RUN, run_key, lambda r: registry())
    worker = Worker(config, store, WorkerOptions(idle_poll_s=0.05, heartbeat_s=0.1, registry_poll_s=0.05))
    stop = asyncio.Event()
    with caplog.at_level(logging.WARNING, logger="macd"):
        run = asyncio.create_task(worker.run(stop))

        async def revoked_in_the_bucket() -> bool:
            try:
                data = await store.get_bytes(layout.heartbeat("mac-c"))
            except NotFound:
                return False
            return Heartbeat.from_bytes(data).status == "revoked"

        await async_wait_until(revoked_in_the_bucket, timeout=30, message=lambda: f"a revoked heartbeat ({worker.beat})")
        assert not run.done()  # it stays up, idle, saying so
        stop.set()
        assert await asyncio.wait_for(run, 30) == 0
    lines = [r.getMessage() for r in caplog.records if "revoked" in r.getMessage()]
    assert len(lines) == 1 and "uploads nothing more" in lines[0], lines
    data = await store.get_bytes(layout.heartbeat("mac-c"))
    beat_now = Heartbeat.from_bytes(data)
    assert beat_now.status == "revoked" and judge_heartbeat(data, beat_now, registry()) == "revoked"
    assert worker.live is None and (worker.sub is None or worker.sub.version is None)  # no weights taken


async def test_a_registered_worker_signs_its_heartbeat(store: Store, store_url: str, tmp_path: Path) -> None:
    """The heartbeat a worker writes verifies against the registry (the worker stays in setup:
    the run has no weights yet)."""
    run_key = SigningKey.generate()
    layout = RunLayout(RUN)
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6, run_key=run_key.public.to_text())
    await store.put(layout.run_manifest, manifest.to_bytes(run_key))
    await put_task_objects(store, RUN, "synthetic", {"train": make_task("synthetic", generate_items(8, seed=1)).encode()}, key=run_key)
    path = write_worker_key_file(tmp_path / "key.json", WorkerKeyFile(run=RUN, worker="mac-a", key=KEYS["mac-a"]))
    config = DaemonConfig(store=store_url, run=RUN, name="mac", worker_id="mac-a", data_dir=tmp_path / "data", batch=2,
                          run_key=run_key.public.to_text(), worker_key=str(path))
    await update_registry(store, RUN, run_key, lambda r: registry())
    worker = Worker(config, store, WorkerOptions(idle_poll_s=0.05, heartbeat_s=0.1, registry_poll_s=0.05))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))

    async def signed_beat() -> bool:
        try:
            data = await store.get_bytes(layout.heartbeat("mac-a"))
        except NotFound:
            return False
        return judge_heartbeat(data, Heartbeat.from_bytes(data), registry()) == "signed"

    await async_wait_until(signed_beat, timeout=30, message="a signed heartbeat")
    stop.set()
    assert await asyncio.wait_for(run, 30) == 0
    assert not worker.revoked


@pytest.mark.slow
async def test_a_worker_revoked_while_generating_stops_uploading_and_keeps_its_spool(
    store: Store, store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model

    run_key = SigningKey.generate()
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
    await seed_run(store, manifest, tiny_synthetic_model(tmp_path / "model"), task_count=50, key=run_key)
    path = write_worker_key_file(tmp_path / "key.json", WorkerKeyFile(run=RUN, worker="mac-a", key=KEYS["mac-a"]))
    config = DaemonConfig(store=store_url, run=RUN, name="mac", worker_id="mac-a", data_dir=tmp_path / "data", batch=2,
                          run_key=run_key.public.to_text(), worker_key=str(path))
    await update_registry(store, RUN, run_key, lambda r: registry())
    worker = Worker(config, store, WorkerOptions(seed=3, heartbeat_s=0.2, registry_poll_s=0.1))
    stop = asyncio.Event()
    layout = RunLayout(RUN)

    async def uploaded() -> int:
        return len([info async for info in store.list(layout.rollouts_prefix())])

    with caplog.at_level(logging.WARNING, logger="macd"):
        run = asyncio.create_task(worker.run(stop))
        await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
        await update_registry(store, RUN, run_key, functools.partial(revoke_worker, worker="mac-a", now=9.0))
        await async_wait_until(lambda: worker.beat.status == "revoked" or run.done(), timeout=30, message="the revocation")
        assert not run.done()
        spooled, count = worker.reporter.beat.groups_spooled, await uploaded()
        beats: list[Heartbeat] = []
        worker.on_heartbeat = beats.append
        await async_wait_until(lambda: len(beats) >= 3, timeout=30, message="three more heartbeats")
        # nothing more is uploaded while it stays up
        assert await uploaded() == count and worker.beat.status == "revoked"
        stop.set()
        assert await asyncio.wait_for(run, 60) == 0
    assert await uploaded() == count  # no flush at stop either: the spool is kept
    assert worker.beat.groups_spooled >= spooled
    assert len([r for r in caplog.records if "uploads nothing more" in r.getMessage()]) == 1
