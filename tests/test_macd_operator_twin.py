"""One live process per worker id (`macd.twin`): a second worker started with the id of a live one
is refused with one line and writes nothing; a restart after a crash goes on; in a signed run a
heartbeat not signed by the worker's own key never refuses it; `macd join` warns."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

from macd import cli
from macd.twin import TwinWatch, TwinWorker, check_no_twin, counts, previous_instance, remember_instance
from macd.worker import Worker, WorkerOptions
from slime_stoa.protocol.heartbeat import Heartbeat, read_heartbeat
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import NotFound, Store, open_store
from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model
from tests.conftest import async_wait_until
from tests.test_worker import RUN, daemon_config, records

WORKER = "test-mac-0a1b2c"  # daemon_config's
KEY = RunLayout(RUN).heartbeat(WORKER)
MANIFEST = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_synthetic_model(tmp_path_factory.mktemp("tiny") / "model")


async def heartbeat(store: Store) -> Heartbeat | None:
    try:
        return await read_heartbeat(store, RUN, WORKER)
    except NotFound:
        return None


def left_behind(instance: str, **kw: object) -> Heartbeat:
    """The last heartbeat of a process that is gone: it said it was generating, just now."""
    return Heartbeat(worker_id=WORKER, name="other-mac", status="generating", updated_at=time.time(), instance=instance, **kw)


@contextlib.asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[asyncio.Task[int]]:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 120)


async def test_a_second_worker_with_the_id_of_a_live_one_is_refused(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    await seed_run(store, MANIFEST, model_dir, task_count=40)
    first = Worker(daemon_config(store_url, tmp_path / "mac-a"), store, WorkerOptions(seed=1, heartbeat_s=0.1))
    async with running(first) as task_a:
        mine = first.reporter.instance
        await async_wait_until(lambda: task_a.done() or _said(store, mine, "generating"), timeout=120,
                               message="the first worker's heartbeat, generating")
        assert not task_a.done(), task_a
        # Another Mac, the same worker id: it watches the fresh heartbeat (up to 2 x 2 s), sees
        # it rewritten by the first worker (every 0.1 s) and refuses before writing anything.
        second = Worker(daemon_config(store_url, tmp_path / "mac-b"), store, WorkerOptions(seed=2, heartbeat_s=2.0))
        with pytest.raises(TwinWorker) as refused:
            await asyncio.wait_for(second.run(asyncio.Event()), 60)
        line = str(refused.value)
        assert "\n" not in line and f"worker {WORKER!r}" in line and "--worker-id" in line and mine in line
        assert not task_a.done()
        beat = await heartbeat(store)
        assert beat is not None and beat.instance == mine  # the second never wrote one
        assert previous_instance(tmp_path / "mac-b", RUN) == ""  # nor claimed the id
        assert all(g.worker_id == WORKER for g in await records(store))
    assert await task_a == 0


async def _said(store: Store, instance: str, status: str) -> bool:
    beat = await heartbeat(store)
    return beat is not None and beat.instance == instance and beat.status == status


async def test_a_restart_after_a_crash_goes_on(store: Store, store_url: str, model_dir: Path, tmp_path: Path) -> None:
    await seed_run(store, MANIFEST, model_dir, task_count=40)
    # Elsewhere (another data folder): the crashed process's heartbeat is watched, is not rewritten, and the worker starts.
    await store.put(KEY, left_behind("deadbeef00000000").to_bytes())
    moved = Worker(daemon_config(store_url, tmp_path / "moved"), store, WorkerOptions(seed=1, heartbeat_s=0.2, max_cohorts=1))
    assert await asyncio.wait_for(moved.run(asyncio.Event()), 120) == 0
    assert previous_instance(tmp_path / "moved", RUN) == moved.reporter.instance
    # In the same data folder: the heartbeat is its own previous process's, so no watch at all
    # (a watch would take 2 x 100 s here).
    data = tmp_path / "same"
    remember_instance(data, RUN, "0123456789abcdef")
    await store.put(KEY, left_behind("0123456789abcdef").to_bytes())
    again = Worker(daemon_config(store_url, data), store, WorkerOptions(seed=2, heartbeat_s=100.0, max_cohorts=1))
    assert await asyncio.wait_for(again.run(asyncio.Event()), 60) == 0
    assert (await heartbeat(store)).instance == again.reporter.instance  # type: ignore[union-attr]


async def rewriting(store: Store, make: Callable[[], bytes], stop: asyncio.Event) -> None:
    """Rewrite the worker id's heartbeat every 20 ms until `stop` (a process that keeps running)."""
    while not stop.is_set():
        await store.put(KEY, make())
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("forgery", ["unsigned", "other key", "other run"])
async def test_a_forged_heartbeat_never_refuses_a_signed_worker(store: Store, tmp_path: Path, forgery: str) -> None:
    """A signed run's worker counts only heartbeats signed by its own key for its run: anyone who
    can write the bucket could forge the rest, to lock it out."""
    own = SigningKey.generate()

    def forged() -> bytes:
        beat = left_behind("f0f0f0f0f0f0f0f0")
        beat = replace(beat, updated_at=time.time())
        if forgery == "unsigned":
            return beat.to_bytes()
        return beat.to_bytes(SigningKey.generate(), run=RUN) if forgery == "other key" else beat.to_bytes(own, run="other")

    stop_forging = asyncio.Event()
    forger = asyncio.create_task(rewriting(store, forged, stop_forging))
    try:
        await async_wait_until(lambda: heartbeat(store), message="the forged heartbeat")
        await check_no_twin(store, RUN, WORKER, instance="mine", data_dir=tmp_path, signer=own, every_s=0.5,
                            stop=asyncio.Event())  # returns: nothing counted
        assert not counts(forged(), RUN, own)
    finally:
        stop_forging.set()
        await forger


async def test_a_heartbeat_signed_by_the_workers_own_key_refuses_it(store: Store, tmp_path: Path) -> None:
    own = SigningKey.generate()

    def signed() -> bytes:
        return replace(left_behind("a1a1a1a1a1a1a1a1"), updated_at=time.time()).to_bytes(own, run=RUN)

    stop_writing = asyncio.Event()
    other = asyncio.create_task(rewriting(store, signed, stop_writing))
    try:
        await async_wait_until(lambda: heartbeat(store), message="the other process's heartbeat")
        with pytest.raises(TwinWorker, match="signed by this worker's key"):
            await check_no_twin(store, RUN, WORKER, instance="mine", data_dir=tmp_path, signer=own, every_s=2.0,
                                stop=asyncio.Event())
    finally:
        stop_writing.set()
        await other


def test_join_warns_when_the_worker_id_runs_elsewhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"

    async def seed(beat: Heartbeat) -> None:
        async with open_store(url) as store:
            await store.put(RunLayout(RUN).run_manifest, MANIFEST.to_bytes())
            await store.put(KEY, beat.to_bytes())

    join = ["join", url, "--run", RUN, "--worker-id", WORKER, "--data-dir", str(tmp_path / "data"),
            "--config", str(tmp_path / "macd.toml")]
    asyncio.run(seed(left_behind("a1a1a1a1a1a1a1a1")))
    assert cli.main(join) == 0
    [warning] = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith(f"warning: worker {WORKER!r} of run {RUN!r} is running elsewhere") and "--worker-id" in warning
    asyncio.run(seed(replace(left_behind("a1a1a1a1a1a1a1a1"), status="stopped")))
    assert cli.main(join) == 0
    assert capsys.readouterr().err == ""


async def test_a_twin_started_later_is_found_at_its_heartbeats_and_stops(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A copy of a running Mac (its data folder names the first worker's instance, so the start
    check takes the first one's heartbeat for its own previous process's) starts after the first
    has uploaded: the heartbeat re-check finds it; it, the later one, stops naming the first; the
    first says so once and goes on generating."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"
    caplog.set_level("INFO", logger="macd")
    async with open_store(url) as store:
        await seed_run(store, MANIFEST, model_dir, task_count=40)
        first = Worker(daemon_config(url, tmp_path / "mac-a"), store, WorkerOptions(seed=1, heartbeat_s=0.05))
        async with running(first) as task_a:
            await async_wait_until(lambda: task_a.done() or first.reporter.beat.groups_uploaded > 0, timeout=120,
                                   message="the first worker's first upload")
            assert not task_a.done(), task_a
            remember_instance(tmp_path / "mac-b", RUN, first.reporter.instance)  # the copied data folder
            second = Worker(daemon_config(url, tmp_path / "mac-b"), store, WorkerOptions(seed=2, heartbeat_s=0.05))
            with pytest.raises(TwinWorker) as stopped:
                await asyncio.wait_for(second.run(asyncio.Event()), 120)
            line = str(stopped.value)
            assert "\n" not in line and "started before this one" in line and first.reporter.instance in line
            assert f"name {first.config.name!r}" in line and "--worker-id" in line
            assert second.beat.last_error == line and second.beat.status == "stopped"
            recorded = first.groups_recorded + first.groups_filtered
            await async_wait_until(lambda: task_a.done() or first.groups_recorded + first.groups_filtered > recorded,
                                   timeout=120, message="the first worker generating on")
            assert not task_a.done() and first.twin is None
    told = [r.getMessage() for r in caplog.records if "it started after this one, so it stops itself" in r.getMessage()]
    assert len(told) <= 1  # the first may see the twin before it stops: then it says so once


async def test_the_recheck_needs_a_rewrite_and_stops_only_the_later_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`TwinWatch.check` on the folder store: one heartbeat of another instance (a process gone may
    have left it), a "stopped" one or this process's own prove nothing; a rewritten one does, and
    only the worker that started later stops."""
    async with open_store(f"file://{tmp_path}") as store:
        own = Heartbeat(worker_id=WORKER, name="mac", status="generating", started_at=1000.0, instance="bbbb")
        watch = TwinWatch(store, RUN, WORKER, None)
        assert await watch.check(own) is None  # no heartbeat
        await store.put(KEY, own.to_bytes())
        assert await watch.check(own) is None  # its own
        earlier = left_behind("aaaa", started_at=900.0)
        await store.put(KEY, earlier.to_bytes())
        assert await watch.check(own) is None and await watch.check(own) is None  # once, not rewritten: not proof
        await store.put(KEY, replace(earlier, status="stopped", updated_at=earlier.updated_at + 1).to_bytes())
        assert await watch.check(own) is None  # a process that stopped
        await store.put(KEY, replace(earlier, updated_at=earlier.updated_at + 2).to_bytes())
        twin = await watch.check(own)  # rewritten: a live process, started before this one
        assert isinstance(twin, TwinWorker) and "instance aaaa, name 'other-mac'" in str(twin)
        caplog.set_level("INFO", logger="macd")
        later = left_behind("cccc", started_at=1100.0)
        watch = TwinWatch(store, RUN, WORKER, None)
        for n in range(4):  # rewritten again and again by one that started after this one: it stops, not this one
            await store.put(KEY, replace(later, updated_at=later.updated_at + n).to_bytes())
            assert await watch.check(own) is None
        assert watch.twin is not None and watch.twin.instance == "cccc"
        assert len([r for r in caplog.records if "it started after this one, so it stops itself" in r.getMessage()]) == 1
