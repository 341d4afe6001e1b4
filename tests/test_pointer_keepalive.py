"""Live trainers keep their pointers fresh, and a worker's first join is bounded by the pointer's
signed time (`pulse.freshness`, `pulse.keepalive`).

The trainer side: the slime publisher (`SyncPublisher`) and the quickstart's keeper re-sign the
pointers of a publisher resumed from the bucket (every chain it serves) without publishing, and
publishes in between do not conflict with the refreshes. The worker side (`macd.following`): a
worker that never installed the run's weights refuses an old genuine pointer put back and says
why, then installs once the trainer re-signs; a worker with a head kept is not bound by time.
Intervals are made tiny by parameters; every wait is for work done (a refresh, an install)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from macd.clock import StoreClock
from macd.config import DaemonConfig
from macd.run_pin import remember_head
from macd.worker import Worker, WorkerOptions
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.freshness import FIRST_POINTER_MAX_AGE_S, Head
from slime_stoa.protocol.pulse.keepalive import refresh_all
from slime_stoa.protocol.pulse.manifests import Pointer
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store
from slime_stoa.protocol.worker_keys import WorkerKeyFile, write_worker_key_file
from slime_stoa.quickstart.run import pointer_keeper
from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model
from slime_stoa.trainer.slime.publish import SyncPublisher
from tests.conftest import async_wait_until
from tests.forged_weights import honest_run, step_state
from tests.test_planes import bf16_state, nudged

RUN = "keepalive"
HOUR = 3600.0


async def pointer_in(store: Store, plane: str | None = None, trust: RunTrust | None = None) -> Pointer:
    layout = RunLayout(RUN, plane)  # type: ignore[arg-type]
    return Pointer.from_bytes(await store.get_bytes(layout.pointer), layout.pointer, run=RUN, trust=trust,
                              plane=layout.plane)


async def versions_listed(store: Store) -> int:
    return len([info async for info in store.list(RunLayout(RUN).versions_prefix)])


async def re_signed(store: Store, before: Pointer, plane: str | None = None) -> bool:
    return (await pointer_in(store, plane)).updated_at > before.updated_at


# -- the trainer side ---------------------------------------------------------------------------
async def test_the_slime_publisher_keeps_its_resumed_pointer_fresh_between_publishes(
    store: Store, store_url: str, store_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    h = await honest_run(store, RUN, np.random.default_rng(31))  # v0..v2 by an earlier trainer process
    before, listed = await pointer_in(store), await versions_listed(store)
    pub = SyncPublisher(store_url, RUN, key=h.key, environ=store_env, refresh_s=0.01)
    try:
        assert await asyncio.to_thread(pub.open) == 2
        # this process has published nothing: it keeps the pointer it resumed from fresh
        await async_wait_until(lambda: re_signed(store, before), timeout=60, message="the pointer re-signed")
        after = await pointer_in(store, trust=h.trust())  # the run key's signature, checked
        assert (after.version, after.manifest, after.state_digest, after.epoch) == (
            before.version, before.manifest, before.state_digest, before.epoch)
        assert await versions_listed(store) == listed and pub.version == 2  # nothing published

        # publishes while the keeper runs: each commits (no refresh takes its ETag), and the
        # keeper then keeps the new version fresh
        state = h.states[2]
        with caplog.at_level(logging.WARNING, logger="stoa.pulse"):
            for _ in range(3):
                state = step_state(state, np.random.default_rng(pub.version))
                assert (await asyncio.to_thread(pub.publish, state)).version == pub.version
        assert pub.version == 5
        assert not [r for r in caplog.records if "writing v" in r.getMessage()]  # no lost CAS, nothing written over
        published = await pointer_in(store, trust=h.trust())
        await async_wait_until(lambda: re_signed(store, published), timeout=60, message="v5 re-signed")
        assert (await pointer_in(store, trust=h.trust())).version == 5
    finally:
        await asyncio.to_thread(pub.close)


async def test_the_quickstart_keeper_re_signs_every_chain_of_a_resumed_publisher_at_once(store: Store) -> None:
    """A quickstart rerun after a long stop: its first round is at once (the interval is an hour
    here), so workers started after seeding find a fresh pointer."""
    key = SigningKey.generate()
    trust = RunTrust(RUN, key.public)
    planes = PublisherConfig(planes=("int8",))
    first = Publisher(store, RUN, planes, key=key)
    state = bf16_state()
    for seed in range(2):
        await first.publish(state)
        state = nudged(state, seed + 1)
    bf16, int8 = await pointer_in(store, trust=trust), await pointer_in(store, "int8", trust)
    resumed = Publisher(store, RUN, planes, key=key)  # the quickstart rerun: resumed, not publishing
    assert await resumed.open() == 1
    keeper = pointer_keeper(resumed, every_s=HOUR)
    keeper.start()
    try:
        await async_wait_until(lambda: re_signed(store, bf16), timeout=60, message="the bf16 pointer re-signed")
        await async_wait_until(lambda: re_signed(store, int8, "int8"), timeout=60, message="the int8 one re-signed")
        async with keeper.lock:  # as the train phase publishes
            assert (await resumed.publish(state)).version == 2
    finally:
        await keeper.stop()
    assert not keeper.running
    for plane, old in ((None, bf16), ("int8", int8)):
        now = await pointer_in(store, plane, trust)
        assert now.version == 2 and now.plane == old.plane and now.updated_at > old.updated_at


def test_a_keeper_needs_a_positive_interval() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        pointer_keeper(None, every_s=0)  # type: ignore[arg-type]


# -- the worker side ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_synthetic_model(tmp_path_factory.mktemp("tiny") / "model")


async def signed_run(store: Store, model_dir: Path) -> tuple[SigningKey, Publisher]:
    """A signed run at v0 of the tiny model, and its trainer's publisher."""
    key = SigningKey.generate()
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
    return key, await seed_run(store, manifest, model_dir, task_count=50, key=key)


async def put_back_old(store: Store, key: SigningKey, pointer: Pointer) -> Pointer:
    """A token holder puts `pointer` back as it was signed two hours ago (genuine bytes of then)."""
    old = replace(pointer, updated_at=pointer.updated_at - 2 * HOUR)
    await store.put(RunLayout(RUN).pointer, old.to_bytes(key))
    return old


def new_worker(store: Store, store_url: str, key: SigningKey, tmp_path: Path) -> Worker:
    config = DaemonConfig(store=store_url, run=RUN, name="test-mac", worker_id="test-mac-0a1b2c",
                          data_dir=tmp_path / "data", batch=3)
    worker_key = write_worker_key_file(
        tmp_path / "worker-key.json", WorkerKeyFile(run=RUN, worker=config.worker_id, key=SigningKey.generate())
    )
    config = replace(config, run_key=key.public.to_text(), worker_key=str(worker_key))
    return Worker(config, store, WorkerOptions(seed=8, heartbeat_s=0.3, idle_poll_s=0.05))


@pytest.mark.both_backends  # the age is judged by the store's clock: the S3 server's Date, the folder's local time
async def test_a_new_worker_refuses_an_old_genuine_pointer_until_the_trainer_re_signs_it(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key, pub = await signed_run(store, model_dir)
    v0 = await pointer_in(store)
    state = load_hf_state(model_dir)
    state["model.norm.weight"][:] ^= 1
    assert (await pub.publish(state)).version == 1
    old = await put_back_old(store, key, v0)  # the v0 pointer of two hours ago

    worker = new_worker(store, store_url, key, tmp_path)
    stop = asyncio.Event()
    caplog.set_level(logging.INFO, logger="macd")
    run = asyncio.create_task(worker.run(stop))
    try:
        await async_wait_until(lambda: "signed 120 min ago" in worker.beat.last_error or run.done(), timeout=120,
                               message=lambda: f"the wait line in the heartbeat ({worker.beat})")
        assert not run.done(), run
        sub = worker.sub
        assert sub is not None and sub.version is None and worker.cohorts == 0
        assert sub.first_pointer_max_age_s == FIRST_POINTER_MAX_AGE_S and sub.floor is None
        why = sub.first_pointer_wait()
        assert why is not None and f"(v{old.version})" in why and "waiting for the trainer to re-sign it" in why
        assert worker.beat.weights_refused == 0  # a wait, not a forgery
        # one line says why (logged once per repeat_log_s), and no other weights warning
        warned = [r.getMessage() for r in caplog.records
                  if r.name == "macd" and r.levelno >= logging.WARNING and r.getMessage().startswith("weights:")]
        assert len(warned) == 1 and "signed 120 min ago" in warned[0], warned

        # the live trainer re-signs: its current pointer (v1) goes back over the old one
        assert await refresh_all([pub.weights.committer]) == 1
        assert (await pointer_in(store)).version == 1
        await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
        assert not run.done(), run
        assert worker.sub is not None and worker.sub.version == 1
        assert worker.sub.first_pointer_wait() is None
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 120) == 0


async def test_a_worker_with_a_kept_head_is_not_bound_by_the_pointers_age(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    """The trainer down for two hours: a worker that installed v0 before takes its pointer still."""
    key, _ = await signed_run(store, model_dir)
    await put_back_old(store, key, await pointer_in(store))
    worker = new_worker(store, store_url, key, tmp_path)
    remember_head(tmp_path / "data", RUN, Head(0, 0))  # installed v0 in an earlier run of this worker
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    try:
        await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
        assert not run.done(), run
        sub = worker.sub
        assert sub is not None and sub.version == 0 and sub.floor == Head(0, 0)
        assert sub.first_pointer_max_age_s is None and "min ago" not in worker.beat.last_error
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 120) == 0


@pytest.fixture
def backend_param() -> None:
    """Opts this module's S3-only tests out of the default backend parametrization (conftest)."""


@pytest.mark.parametrize("store_url", ["s3"], indirect=True)
@pytest.mark.parametrize(("local_off_s", "signed_ago_s", "taken"), [
    (-2 * HOUR, 2 * HOUR, False),  # a Mac two hours behind: the old pointer looks fresh to it, refused still
    (+2 * HOUR, 0.0, True),  # a Mac two hours ahead: a fresh pointer looks old to it, taken still
])
async def test_a_first_join_judges_the_pointers_age_by_the_stores_clock(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, backend_param: None,
    local_off_s: float, signed_ago_s: float, taken: bool,
) -> None:
    key, _ = await signed_run(store, model_dir)
    pointer = await pointer_in(store)
    await store.put(RunLayout(RUN).pointer, replace(pointer, updated_at=time.time() - signed_ago_s).to_bytes(key))
    worker = new_worker(store, store_url, key, tmp_path)
    follower = worker.weights
    assert isinstance(follower.now, StoreClock) and follower.now.store is store
    follower.now.local = lambda: time.time() + local_off_s  # this Mac's clock is off
    sub = follower.subscriber(RunTrust(RUN, key.public))
    assert sub.now is follower.now
    stop = asyncio.Event()
    first = asyncio.create_task(follower.first_sync(sub, stop))
    try:
        await async_wait_until(lambda: first.done() or sub.first_pointer_wait() is not None, timeout=60,
                               message="the pointer taken or waited on")
        assert first.done() is taken
        if taken:
            staged = first.result()
            assert staged is not None and staged.version == 0
        else:
            assert "signed 120 min ago" in worker.beat.last_error and sub.version is None
    finally:
        stop.set()
        await asyncio.wait_for(first, 60)
