"""`macd run`'s worker loop for real: MLX generation, weight hot-swap, spool and upload."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from macd.config import DaemonConfig
from macd.worker import Worker, WorkerOptions
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import Store
from slime_stoa.protocol.validate import RecordLimits, load_record
from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model
from slime_stoa.trainer.consumer.counting import CountingStore
from tests.conftest import async_wait_until

RUN = "worker-test"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_synthetic_model(tmp_path_factory.mktemp("tiny") / "model")


def daemon_config(store_url: str, data_dir: Path) -> DaemonConfig:
    return DaemonConfig(store=store_url, run=RUN, name="test-mac", worker_id="test-mac-0a1b2c", data_dir=data_dir, batch=3)


async def records(store: Store) -> list:
    layout = RunLayout(RUN)
    limits = RecordLimits(vocab_size=1024, expected_group_size=4)
    return [load_record(await store.get_bytes(i.key), limits) async for i in store.list(layout.rollouts_prefix())]


class PointerPolls(CountingStore):
    """Forwards to a real store and counts the worker's pointer polls: each is one turn of its loop,
    a chance to start a cohort."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.polls = 0

    async def get(self, key: str, **kw):  # type: ignore[override]
        if key == RunLayout(RUN).pointer:
            self.polls += 1
        return await super().get(key, **kw)


async def test_worker_generates_uploads_and_hot_swaps(store: Store, store_url: str, model_dir: Path, tmp_path: Path) -> None:
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6, temperature=1.0)
    pub = await seed_run(store, manifest, model_dir, task_count=50)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), store, WorkerOptions(seed=1, heartbeat_s=0.5))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))

    async def landed(version: int) -> bool:
        return run.done() or any(g.weight_version == version for g in await records(store))

    # Publish v1 once the first groups landed; stop once groups made at v1 landed too.
    await async_wait_until(lambda: landed(0), timeout=300, interval=0.1, message="a v0 group in the bucket")
    assert not run.done(), run
    state = load_hf_state(model_dir)
    rng = np.random.default_rng(0)
    for bits in state.values():
        flat = bits.reshape(-1)
        flat[rng.random(flat.size) < 0.02] ^= 1
    await pub.publish(state)
    await async_wait_until(lambda: landed(1), timeout=300, interval=0.1, message="a v1 group in the bucket")
    stop.set()
    assert await asyncio.wait_for(run, 300) == 0

    got = await records(store)
    assert len(got) == worker.cohorts * 3  # every group of every cohort, exactly once
    assert {g.worker_id for g in got} == {"test-mac-0a1b2c"}
    assert sorted(g.seq for g in got) == list(range(len(got)))
    versions = [g.weight_version for g in sorted(got, key=lambda g: g.seq)]
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    for g in got:
        assert len(g.samples) == 4 and g.task_id == "synthetic"
        assert all(s.finish_reason in ("stop", "length") and len(s.response_tokens) <= 6 for s in g.samples)
    # The live MLX weights are the pointer's version, bit for bit.
    assert worker.sub is not None and worker.sub.digest.root() == pub.state_digest
    assert worker.live.digest_check(worker.sub.state)
    beat = await store.get_bytes(RunLayout(RUN).heartbeat("test-mac-0a1b2c"))
    assert b'"status":"stopped"' in beat.replace(b" ", b"")


async def test_stop_flushes_and_exits_cleanly(store: Store, store_url: str, model_dir: Path, tmp_path: Path) -> None:
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
    await seed_run(store, manifest, model_dir, task_count=50)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), store, WorkerOptions(seed=2))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.cohorts >= 2 or run.done(), timeout=120, message="two cohorts")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert len(await records(store)) == 3 * worker.cohorts


async def test_worker_waits_for_a_new_version_once_its_budget_is_spent(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6, worker_groups_per_version=1)
    pub = await seed_run(store, manifest, model_dir, task_count=50)
    options = WorkerOptions(seed=4, budget_patience_s=60.0, heartbeat_s=0.2)
    polled = PointerPolls(store)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), polled, options)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    # Until one group with a reward signal was made at v0.
    await async_wait_until(lambda: worker.beat.status == "waiting" or run.done(), timeout=120, message="status waiting")
    assert not run.done(), run
    cohorts, polls = worker.cohorts, polled.polls
    # Budget spent: three more turns of the loop (three pointer polls), and no new cohort.
    await async_wait_until(lambda: polled.polls >= polls + 3 or run.done(), timeout=30, message="three pointer polls")
    assert worker.beat.status == "waiting" and worker.cohorts == cohorts
    v0 = await records(store)
    assert v0 and {g.weight_version for g in v0} == {0}
    assert any(len({s.reward for s in g.samples}) > 1 for g in v0)  # the budget counts signal groups
    state = load_hf_state(model_dir)
    state["model.norm.weight"][0] ^= 1
    await pub.publish(state)
    await async_wait_until(lambda: worker.cohorts > cohorts or run.done(), timeout=120, message="a cohort at v1")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert max(g.weight_version for g in await records(store)) == 1


async def test_a_pointer_to_missing_objects_keeps_the_last_good_version(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    from slime_stoa.protocol.pulse.manifests import Pointer

    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
    await seed_run(store, manifest, model_dir, task_count=50)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), store, WorkerOptions(seed=5))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
    layout = RunLayout(RUN)
    got = await store.get(layout.pointer)
    pointer = Pointer.from_bytes(got.data)
    broken = Pointer(
        run=RUN, version=1, state_digest="ab" * 16, manifest=layout.version_manifest(1, "0badf00d"),
        anchor=pointer.anchor, updated_at=0.0,
    )
    await store.put(layout.pointer, broken.to_bytes(), if_match=got.etag)
    seen = worker.cohorts
    # The worker notices at its next pointer poll and keeps generating.
    await async_wait_until(
        lambda: (worker.beat.errors and worker.cohorts > seen + 1) or run.done(),
        timeout=60,
        message=lambda: f"an error and two more cohorts (errors {worker.beat.errors}, cohorts {worker.cohorts - seen})",
    )
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert worker.sub.version == 0 and worker.live.digest_check(worker.sub.state)
    assert {g.weight_version for g in await records(store)} == {0}
    assert worker.beat.errors >= 1 and "manifest is unreadable" in worker.beat.last_error


async def test_int8_plane_serves_quantized_weights_from_the_bf16_master(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6, plane="int8")
    pub = await seed_run(store, manifest, model_dir, task_count=50)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), store, WorkerOptions(seed=6))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
    state = load_hf_state(model_dir)
    state["model.layers.0.mlp.up_proj.weight"].reshape(-1)[:100] ^= 1
    await pub.publish(state)
    # Stop once the int8 weights were swapped to v1 and a cohort was made with them.
    await async_wait_until(lambda: worker.beat.swaps >= 1 or run.done(), timeout=120, message="the swap to v1")
    swapped_at = worker.cohorts
    await async_wait_until(lambda: worker.cohorts > swapped_at or run.done(), timeout=120, message="a cohort at v1")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert worker.sub.version == 1
    assert worker.live.plane == "int8" and worker.live.digest_check(worker.sub.state)
    got = await records(store)
    assert len(got) == 3 * worker.cohorts and {g.weight_version for g in got} == {0, 1}


async def test_heartbeat_reports_quarantined_groups(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    """A group set aside in the spool for good shows in the heartbeat, the final one included
    (the quickstart counts lost groups from it); old heartbeats without the field still parse."""
    from macd.spool import Spool
    from slime_stoa.protocol.heartbeat import Heartbeat

    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
    await seed_run(store, manifest, model_dir, task_count=50)
    config = daemon_config(store_url, tmp_path / "data")
    spool = Spool(config.data_dir / "spool" / RUN, worker_id=config.worker_id, run=RUN,
                  max_bytes=1 << 20, max_items=10, verify=False)
    spool.quarantine(spool.add(b"not a record"), "test: the key held other bytes")
    spool.close()
    worker = Worker(config, store, WorkerOptions(seed=7, max_cohorts=1))
    assert await asyncio.wait_for(worker.run(asyncio.Event()), 120) == 0
    data = await store.get_bytes(RunLayout(RUN).heartbeat(config.worker_id))
    beat = Heartbeat.from_bytes(data)
    assert (beat.status, beat.groups_spooled, beat.groups_quarantined, beat.groups_uploaded) == ("stopped", 0, 1, 3)
    old = data.replace(b'"groups_quarantined": 1, ', b"")
    assert b"groups_quarantined" not in old and Heartbeat.from_bytes(old).groups_quarantined == 0


@pytest.mark.parametrize("ticks", [0, 1, 2, 3])
async def test_wait_never_swallows_a_cancellation(ticks: int) -> None:
    """A cancel that lands just as the stop event fires still cancels (a 3.11 wait_for pitfall)."""
    from macd.worker import _wait

    stop = asyncio.Event()
    waiting = asyncio.create_task(_wait(stop, 30))
    await asyncio.sleep(0)
    stop.set()
    for _ in range(ticks):
        await asyncio.sleep(0)
    if not waiting.cancel():
        assert waiting.done()  # it returned before the cancel: nothing to swallow
        return
    with pytest.raises(asyncio.CancelledError):
        await waiting


# -- malformed objects and outages: reported, skipped, never fatal ----------------------------------


async def test_a_malformed_pointer_mid_run_keeps_the_last_good_version_until_a_good_one(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    """Garbage in current.json while the worker runs: it says so once (log and heartbeat), keeps
    generating with v0, and moves to v1 as soon as a good pointer names it."""
    from slime_stoa.protocol.heartbeat import Heartbeat
    from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig

    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
    await seed_run(store, manifest, model_dir, task_count=50)
    config = daemon_config(store_url, tmp_path / "data")
    worker = Worker(config, store, WorkerOptions(seed=8, heartbeat_s=0.3))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
    layout = RunLayout(RUN)
    good = await store.get(layout.pointer)
    assert good is not None
    bad_etag = await store.put(layout.pointer, b'{"format": "stoa.pointer/1", "version": "soon"', if_match=good.etag)
    seen = worker.cohorts
    await async_wait_until(
        lambda: (worker.beat.errors and worker.cohorts >= seen + 2) or run.done(),
        timeout=120,
        message=lambda: f"an error and two more cohorts (errors {worker.beat.errors}, cohorts {worker.cohorts - seen})",
    )
    assert not run.done(), run
    assert worker.beat.errors == 1  # reported once, not at every poll
    assert "malformed pointer" in worker.beat.last_error and "keeping weights v0" in worker.beat.last_error
    assert worker.sub is not None and worker.sub.version == 0

    async def beat_says_so() -> bool:
        beat = Heartbeat.from_bytes(await store.get_bytes(layout.heartbeat(config.worker_id)))
        return beat.errors >= 1 and "malformed pointer" in beat.last_error

    await async_wait_until(beat_says_so, timeout=30, message="the error in the worker's heartbeat")
    # A good pointer again, then v1: the worker follows.
    await store.put(layout.pointer, good.data, if_match=bad_etag)
    pub = Publisher(store, RUN, PublisherConfig(extras_dir=model_dir))
    assert await pub.open() == 0
    state = load_hf_state(model_dir)
    state["model.norm.weight"][:4] ^= 1
    await pub.publish(state)

    async def v1_landed() -> bool:
        return run.done() or any(g.weight_version == 1 for g in await records(store))

    await async_wait_until(v1_landed, timeout=120, interval=0.1, message="a v1 group in the bucket")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert worker.sub.version == 1 and worker.sub.digest.root() == pub.state_digest
    assert worker.live.digest_check(worker.sub.state)
    versions = [g.weight_version for g in sorted(await records(store), key=lambda g: g.seq)]
    assert versions == sorted(versions) and versions.count(0) >= seen + 2 and versions[-1] == 1


async def test_a_malformed_run_manifest_at_start_is_reported_until_a_good_one(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    """A run.json that does not parse: the worker does not exit; it reports it in its heartbeat
    (written from the start) and joins once the manifest is good."""
    from slime_stoa.protocol.heartbeat import Heartbeat

    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
    await seed_run(store, manifest, model_dir, task_count=50)
    layout = RunLayout(RUN)
    good = await store.get_bytes(layout.run_manifest)
    await store.put(layout.run_manifest, good[: len(good) // 2])
    config = daemon_config(store_url, tmp_path / "data")
    worker = Worker(config, store, WorkerOptions(seed=9, heartbeat_s=0.2, idle_poll_s=0.2, setup_retry_max_s=0.5))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))

    async def reported() -> bool:
        if run.done():
            return True
        try:
            beat = Heartbeat.from_bytes(await store.get_bytes(layout.heartbeat(config.worker_id)))
        except Exception:
            return False
        return beat.status == "starting" and beat.errors >= 1 and beat.last_error.startswith("run:")

    await async_wait_until(reported, timeout=60, message="the run manifest's error in the heartbeat")
    assert not run.done(), run
    await store.put(layout.run_manifest, good)
    await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert worker.cohorts >= 1 and len(await records(store)) == 3 * worker.cohorts


async def test_a_store_outage_mid_run_only_delays_uploads(
    s3_server, s3_bucket: str, model_dir: Path, tmp_path: Path
) -> None:
    """The network to the bucket goes away while the worker runs: it keeps generating into its
    spool (pointer polls and heartbeats fail, and are reported), and the spool drains once the
    bucket is reachable again."""
    import random as stdlib_random

    from slime_stoa.protocol.store.retry import RetryPolicy
    from slime_stoa.protocol.store.s3 import S3Store
    from tests.test_spool_uploader import TcpGate

    prefix = f"outage-{stdlib_random.randrange(1 << 30):x}"
    gate = TcpGate(s3_server.endpoint_url)
    await gate.open()
    url = f"s3://{s3_bucket}/{prefix}?endpoint={gate.url}"
    through_gate = S3Store(
        bucket=s3_bucket, prefix=prefix, endpoint_url=gate.url, region=s3_server.region,
        credentials=s3_server.credentials(), url=url,
        retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02), connect_timeout=1,
    )
    async with through_gate, s3_server.store(s3_bucket, prefix) as direct:
        manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
        await seed_run(direct, manifest, model_dir, task_count=50)
        worker = Worker(daemon_config(url, tmp_path / "data"), through_gate, WorkerOptions(seed=10, heartbeat_s=0.3))
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run(stop))
        try:
            await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
            await gate.close()  # the bucket is unreachable from here on
            seen = worker.cohorts
            spool = tmp_path / "data" / "spool" / RUN

            def spooled() -> int:
                return len(list(spool.glob("*.rec")))

            await async_wait_until(
                lambda: (worker.cohorts >= seen + 3 and worker.beat.errors and spooled() >= 6) or run.done(),
                timeout=120,
                message=lambda: f"three cohorts spooled during the outage (cohorts {worker.cohorts - seen}, "
                f"errors {worker.beat.errors}, spooled {spooled()})",
            )
            assert not run.done(), run
            assert "StoreUnavailable" in worker.beat.last_error
            await gate.open()  # back
            await async_wait_until(lambda: spooled() == 0 or run.done(), timeout=120, message="the spool drained")
        finally:
            stop.set()
            code = await asyncio.wait_for(run, 120)
            await gate.close()
        assert code == 0
        got = await records(direct)
        assert len(got) == 3 * worker.cohorts  # every group, generated online or offline, once
        assert sorted(g.seq for g in got) == list(range(len(got)))
