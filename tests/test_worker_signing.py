"""macd's side of signed records: the worker signs what it spools, the spool and the uploader
carry the envelope unchanged, and a worker of a signed run without a key stops at start."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from macd.config import DaemonConfig
from macd.spool import Spool
from macd.uploader import Uploader
from macd.worker import Worker, WorkerKeyError, build_group, check_signing, load_worker_key
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.records import decode_group
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.signed_record import open_signed, verify_signed
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store
from slime_stoa.protocol.worker_keys import WorkerKeyFile, write_worker_key_file
from slime_stoa.tasks import generate_items, make_task
from slime_stoa.tasks.objects import put_task_objects
from tests.test_consumer import RUN, Tiny, make_group, now_ms, tiny
from tests.test_signed_records import open_signed_consumer, setup_signed_run, signed

__all__ = ["tiny"]  # the session fixture

MANIFEST = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=2, max_tokens=8)


def test_build_group_signs_the_record_it_builds() -> None:
    key = SigningKey.generate()
    item = generate_items(1, seed=0)[0]
    completions = [SimpleNamespace(tokens=[5, 6], logprobs=[-0.1, -0.2], finish_reason="stop") for _ in range(2)]
    common = dict(
        manifest=MANIFEST, worker_id="mac-a", item=item, prompt=[1, 2, 3], completions=completions, rewards=[1.0, 0.0],
        version=0, digest="ab" * 16, started_at=1.0, finished_at=2.0,
    )
    plain = build_group(**common)(7, 0)  # type: ignore[arg-type]
    data = build_group(**common, signer=key)(7, 0)  # type: ignore[arg-type]
    envelope = open_signed(data)
    assert envelope.key_id == key.key_id and envelope.record == plain
    verify_signed(envelope, key.public, run=RUN)
    group = decode_group(envelope.record, max_bytes=1 << 20)
    assert (group.worker_id, group.seq) == ("mac-a", 7)


async def test_signed_records_spool_upload_unchanged_and_are_admitted(
    store: Store, store_url: str, tiny: Tiny, tmp_path: Path
) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    key = run.workers["mac-a"]
    with Spool(tmp_path / "spool", worker_id="mac-a", run=RUN, max_bytes=1 << 30, max_items=100,
               clock=lambda: now_ms() / 1000 - 5) as spool:
        def build(index: int) -> Callable[[int, int], bytes]:
            return lambda seq, _ts: signed(make_group(tiny, worker="mac-a", seq=seq, prompt_index=index), key)

        entries = [spool.add(build(i)) for i in range(3)]
        spooled = {e.key: e.read() for e in entries}
        assert await Uploader(store, spool).drain() == 3
    for object_key, data in spooled.items():
        assert await store.get_bytes(object_key) == data and open_signed(data).key_id == key.key_id
    consumer = await open_signed_consumer(store, tiny, store_url, run, wait_timeout_s=2.0)
    batch = await consumer.next_batch(3, trainer_version=0)
    assert sorted(g.key for g in batch.groups) == sorted(spooled)
    assert not [k for k in consumer.counters if k.startswith("rejected/")]
    await consumer.close()


def _config(store_url: str, tmp_path: Path, **kw: object) -> DaemonConfig:
    return DaemonConfig(store=store_url, run=RUN, name="mac", worker_id="mac-a", data_dir=tmp_path / "data", batch=1, **kw)  # type: ignore[arg-type]


async def test_a_worker_of_a_signed_run_without_a_key_stops_at_start(store: Store, store_url: str, tmp_path: Path) -> None:
    run_key = SigningKey.generate()
    manifest = dataclasses.replace(MANIFEST, run_key=run_key.public.to_text())
    layout = RunLayout(RUN)
    await store.put_if_absent(layout.run_manifest, manifest.to_bytes(run_key))
    await put_task_objects(store, RUN, "synthetic", {"train": make_task("synthetic", generate_items(4)).encode()}, key=run_key)
    worker = Worker(_config(store_url, tmp_path), store)
    with pytest.raises(WorkerKeyError) as exc:
        await asyncio.wait_for(worker.run(asyncio.Event()), 60)
    message = str(exc.value)
    assert "\n" not in message and "stoa worker add" in message and "macd join --worker-key" in message
    assert [k async for k in store.list(layout.rollouts_prefix())] == []


def test_worker_key_checks(tmp_path: Path) -> None:
    key = SigningKey.generate()
    check_signing(MANIFEST, None)  # an unsigned run needs no key
    signed_run = dataclasses.replace(MANIFEST, run_key=SigningKey.generate().public.to_text())
    check_signing(signed_run, key)
    with pytest.raises(WorkerKeyError, match="no worker key"):
        check_signing(signed_run, None)
    url = f"file://{tmp_path}"
    assert load_worker_key(_config(url, tmp_path)) is None
    mine = write_worker_key_file(tmp_path / "mine.key", WorkerKeyFile(run=RUN, worker="mac-a", key=key))
    loaded = load_worker_key(_config(url, tmp_path, worker_key=str(mine)))
    assert loaded is not None and loaded.key_id == key.key_id
    other = write_worker_key_file(tmp_path / "other.key", WorkerKeyFile(run=RUN, worker="mac-b", key=key))
    with pytest.raises(WorkerKeyError, match="is for worker 'mac-b'"):
        load_worker_key(_config(url, tmp_path, worker_key=str(other)))
    mine.chmod(0o644)
    with pytest.raises(WorkerKeyError, match="chmod 600"):
        load_worker_key(_config(url, tmp_path, worker_key=str(mine)))


def test_a_signed_record_over_the_object_limit_is_never_built() -> None:
    """The trainer caps the whole object (envelope included): the signer refuses past that cap."""
    from slime_stoa.protocol.signed_record import HEADER_LEN, sign_record

    key = SigningKey.generate()
    record = b"r" * 100
    assert len(sign_record(record, key, run=RUN, max_bytes=HEADER_LEN + 100)) == HEADER_LEN + 100
    with pytest.raises(ValueError, match="over the record limit"):
        sign_record(record, key, run=RUN, max_bytes=HEADER_LEN + 99)
