"""SplitStore: worker-written keys in one store, the rest in another (least privilege)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from slime_stoa.protocol.layout import ROLLOUT_KINDS, RunLayout
from slime_stoa.protocol.store import NotFound, PreconditionFailed, Store, StoreConfigError, open_store
from slime_stoa.protocol.store.split import SplitStore, routes_to_rollouts
from tests.s3server import LocalS3Server

pytestmark = pytest.mark.both_backends  # the store itself: every test on both backends

LAYOUT = RunLayout("demo")
RECORD = LAYOUT.rollout("mac-1", 1_700_000_000_000, 3)
EVAL = LAYOUT.rollout("mac-1", 1_700_000_000_000, 4, kind="eval")
BEAT = LAYOUT.heartbeat("mac-1")
POINTER = LAYOUT.pointer


def test_routing_follows_the_layout() -> None:
    for key in (RECORD, EVAL, BEAT, "runs/demo/rollouts/", "runs/other/workers/x.json"):
        assert routes_to_rollouts(key), key
    for kind in ROLLOUT_KINDS:  # every record kind a worker writes, and its listing prefix
        assert routes_to_rollouts(LAYOUT.rollout("mac-1", 1, 1, kind=kind)), kind
        assert routes_to_rollouts(LAYOUT.rollouts_prefix(kind)), kind
    attempt = "0123abcd"
    trainer_written = (
        LAYOUT.registry, LAYOUT.key_rotation(1), LAYOUT.anchor_manifest(1, attempt), LAYOUT.version_manifest(1, attempt),
        LAYOUT.patch(1, attempt, "step", 0), LAYOUT.task_data("t", "train"), LAYOUT.trainer_file("state.json"),
        LAYOUT.eval_request(1, "test"),
    )
    for key in trainer_written:
        assert not routes_to_rollouts(key), key
    for key in (POINTER, LAYOUT.run_manifest, "runs/demo/rollouts", "runs/demo/tasks/x", "a/b", "runs/rollouts/x/y",
                "runs/demo/workersx/y", "rollouts/x/y/z"):
        assert not routes_to_rollouts(key), key


def inside(url: str, folder: str) -> str:
    """The store URL of a sub-folder of `url` (file:// or s3://...?endpoint=)."""
    base, _, query = url.partition("?")
    return f"{base}/{folder}" + (f"?{query}" if query else "")


@pytest.fixture
async def split(store_url: str, store_env: dict[str, str]) -> AsyncIterator[tuple[SplitStore, Store, Store]]:
    w = open_store(inside(store_url, "w"), environ=store_env, create=True)
    r = open_store(inside(store_url, "r"), environ=store_env, create=True)
    async with SplitStore(w, r):
        yield SplitStore(w, r), w, r


async def keys(store: Store, prefix: str = "", start_after: str | None = None) -> list[str]:
    return [i.key async for i in store.list(prefix, start_after=start_after)]


async def test_each_key_lands_in_its_store_and_reads_back(split: tuple[SplitStore, Store, Store]) -> None:
    both, weights, rollouts = split
    for key in (POINTER, LAYOUT.run_manifest, RECORD, EVAL, BEAT):
        await both.put(key, key.encode())
    assert await keys(weights) == sorted([POINTER, LAYOUT.run_manifest])
    assert await keys(rollouts) == sorted([RECORD, EVAL, BEAT])
    for key in (POINTER, RECORD, BEAT):
        assert await both.get_bytes(key) == key.encode() and (await both.head(key)).size == len(key)
    await both.delete(RECORD)
    with pytest.raises(NotFound):
        await rollouts.head(RECORD)


async def test_listings_spanning_both_stores_merge_in_key_order(split: tuple[SplitStore, Store, Store]) -> None:
    both, _, _ = split
    written = [POINTER, LAYOUT.run_manifest, RECORD, EVAL, BEAT, LAYOUT.rollout("mac-2", 1_700_000_000_001, 1),
               "runs/zed/current.json", "runs/zed/workers/w.json"]
    for key in written:
        await both.put(key, b"x")
    assert await keys(both, "runs/") == sorted(written)
    assert await keys(both, "") == sorted(written)
    assert await keys(both, "runs/demo/") == sorted(k for k in written if k.startswith("runs/demo/"))
    assert await keys(both, "runs/demo/w") == [BEAT]
    assert await keys(both, "runs/demo/rollouts/") == sorted(k for k in written if "/rollouts/" in k)
    assert await keys(both, "runs/demo/c") == [POINTER]
    middle = sorted(written)[3]
    assert await keys(both, "runs/", start_after=middle) == sorted(written)[4:]
    listing = both.list("runs/")  # a reader that stops early leaves nothing open
    assert (await anext(listing)).key == sorted(written)[0]
    await listing.aclose()


async def test_conditional_writes_hold_on_both_sides(split: tuple[SplitStore, Store, Store]) -> None:
    both, _, _ = split
    for key in (POINTER, BEAT):
        etag = await both.put_if_absent(key, b"1")
        with pytest.raises(PreconditionFailed):
            await both.put_if_absent(key, b"2")
        assert await both.get(key, if_none_match=etag) is None
        new = await both.cas(key, b"3", etag)
        with pytest.raises(PreconditionFailed):
            await both.cas(key, b"4", etag)
        assert await both.get_bytes(key) == b"3" and new != etag


# -- scoped tokens: what a worker's credentials can and cannot do -------------------------------------

WEIGHTS_BUCKET = f"stoa-weights-{uuid.uuid4().hex[:8]}"
ROLLOUTS_BUCKET = f"stoa-rollouts-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def scoped_server() -> Iterator[LocalS3Server]:
    worker = [f"Read:{WEIGHTS_BUCKET}", f"List:{WEIGHTS_BUCKET}",
              f"Read:{ROLLOUTS_BUCKET}", f"Write:{ROLLOUTS_BUCKET}", f"List:{ROLLOUTS_BUCKET}"]
    with LocalS3Server(scoped={"worker": worker}) as server:
        server.create_bucket(WEIGHTS_BUCKET)
        server.create_bucket(ROLLOUTS_BUCKET)
        yield server


@pytest.mark.file_only
async def test_a_worker_token_reads_weights_and_writes_only_rollouts(scoped_server: LocalS3Server, tmp_path: Path) -> None:
    trainer = SplitStore(scoped_server.store(WEIGHTS_BUCKET), scoped_server.store(ROLLOUTS_BUCKET))
    creds = scoped_server.credentials("worker")
    worker = SplitStore(scoped_server.store(WEIGHTS_BUCKET, credentials=creds),
                        scoped_server.store(ROLLOUTS_BUCKET, credentials=creds))
    try:
        await trainer.put(POINTER, b"trainer's pointer")
        assert await worker.get_bytes(POINTER) == b"trainer's pointer"
        for attack in (worker.put(POINTER, b"forged"), worker.put_if_absent(LAYOUT.run_manifest, b"forged"),
                       worker.delete(POINTER)):
            with pytest.raises(StoreConfigError, match="AccessDenied"):
                await attack
        assert await trainer.get_bytes(POINTER) == b"trainer's pointer"
        await worker.put(RECORD, b"a record")
        await worker.put(BEAT, b"a heartbeat")
        assert await trainer.get_bytes(RECORD) == b"a record"
        assert await keys(trainer, "runs/demo/") == sorted([POINTER, RECORD, BEAT])
    finally:
        await trainer.close()
        await worker.close()


# -- a real worker with a least-privilege token, and its config ------------------------------------


@pytest.mark.file_only
async def test_a_worker_with_a_read_only_weights_token_generates_into_the_rollouts_bucket(
    scoped_server: LocalS3Server, tmp_path: Path
) -> None:
    pytest.importorskip("mlx_lm")
    import asyncio

    from macd.config import DaemonConfig
    from macd.worker import Worker, WorkerOptions
    from slime_stoa.protocol.run_manifest import RunManifest
    from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model
    from tests.conftest import async_wait_until

    run = f"lp-{uuid.uuid4().hex[:6]}"
    layout = RunLayout(run)
    endpoint = scoped_server.endpoint_url
    creds = scoped_server.credentials("worker")
    env = tmp_path / "worker.env"
    env.write_text(f"AWS_ACCESS_KEY_ID={creds.access_key_id}\nAWS_SECRET_ACCESS_KEY={creds.secret_access_key}\n")
    env.chmod(0o600)
    config = DaemonConfig(
        store=f"s3://{WEIGHTS_BUCKET}?endpoint={endpoint}", run=run, name="lp-mac", worker_id="lp-mac-0a1b2c",
        data_dir=tmp_path / "data", batch=2, credentials_file=env,
        rollouts_store=f"s3://{ROLLOUTS_BUCKET}?endpoint={endpoint}", rollouts_credentials_file=env,
    )
    assert DaemonConfig.from_toml(config.to_toml()) == config
    trainer = SplitStore(scoped_server.store(WEIGHTS_BUCKET), scoped_server.store(ROLLOUTS_BUCKET))
    worker_store = config.open_store()
    assert isinstance(worker_store, SplitStore)
    try:
        manifest = RunManifest(run=run, model="tiny", task="synthetic", group_size=2, max_tokens=4)
        await seed_run(trainer, manifest, tiny_synthetic_model(tmp_path / "model"), task_count=20)
        worker = Worker(config, worker_store, WorkerOptions(seed=3, heartbeat_s=0.3))
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))

        async def landed() -> bool:
            return task.done() or bool(await keys(trainer.rollouts, layout.rollouts_prefix()))

        await async_wait_until(landed, timeout=240, interval=0.2, message="a record in the rollouts bucket")
        stop.set()
        assert await asyncio.wait_for(task, 120) == 0
        assert await keys(trainer.rollouts, layout.heartbeat("lp-mac-0a1b2c")) == [layout.heartbeat("lp-mac-0a1b2c")]
        in_weights = await keys(trainer.weights, layout.root)
        assert in_weights and not any(routes_to_rollouts(k) for k in in_weights)  # nothing of the worker's there
        with pytest.raises(StoreConfigError, match="AccessDenied"):  # and it could not have written there
            await worker_store.weights.put(layout.pointer, b"forged")
    finally:
        await trainer.close()
        await worker_store.close()
