"""One conformance suite for every store backend: the local folder and a real S3 server."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from pathlib import Path

import pytest

from slime_stoa.protocol.store import (
    NotFound,
    PreconditionFailed,
    Store,
    StoreConfigError,
    open_store,
)

pytestmark = pytest.mark.both_backends  # the store itself: every test on both backends


async def keys_of(store: Store, prefix: str = "", start_after: str | None = None) -> list[str]:
    return [info.key async for info in store.list(prefix, start_after=start_after)]


async def test_put_get_head_round_trip(store: Store) -> None:
    etag = await store.put("a/b/object.bin", b"hello world")
    got = await store.get("a/b/object.bin")
    assert got is not None
    assert (got.data, got.etag, got.size) == (b"hello world", etag, 11)
    info = await store.head("a/b/object.bin")
    assert (info.key, info.size, info.etag) == ("a/b/object.bin", 11, etag)
    assert '"' not in etag


async def test_overwrite_changes_etag(store: Store) -> None:
    first = await store.put("k", b"one")
    second = await store.put("k", b"two")
    assert first != second
    assert await store.get_bytes("k") == b"two"


async def test_missing_objects(store: Store) -> None:
    with pytest.raises(NotFound):
        await store.get("missing/key")
    with pytest.raises(NotFound):
        await store.head("missing/key")
    assert not await store.exists("missing/key")
    await store.delete("missing/key")  # deleting a missing key is fine


async def test_ranged_get(store: Store) -> None:
    payload = bytes(range(256)) * 4
    await store.put("r", payload)
    part = await store.get("r", offset=10, length=20)
    assert part is not None and part.data == payload[10:30] and part.size == len(payload)
    tail = await store.get("r", offset=1000)
    assert tail is not None and tail.data == payload[1000:]


async def test_conditional_get_is_not_modified_until_changed(store: Store) -> None:
    etag = await store.put("pointer.json", b'{"v": 1}')
    assert await store.get("pointer.json", if_none_match=etag) is None
    new_etag = await store.put("pointer.json", b'{"v": 2}')
    got = await store.get("pointer.json", if_none_match=etag)
    assert got is not None and got.data == b'{"v": 2}' and got.etag == new_etag


async def test_put_if_absent_refuses_second_write(store: Store) -> None:
    await store.put_if_absent("once", b"first")
    with pytest.raises(PreconditionFailed):
        await store.put_if_absent("once", b"second")
    assert await store.get_bytes("once") == b"first"


async def test_compare_and_swap(store: Store) -> None:
    with pytest.raises(PreconditionFailed):
        await store.put("ptr", b"x", if_match="0123456789abcdef")  # missing key
    e1 = await store.cas("ptr", b"v1", None)
    with pytest.raises(PreconditionFailed):
        await store.cas("ptr", b"again", None)
    e2 = await store.cas("ptr", b"v2", e1)
    with pytest.raises(PreconditionFailed):
        await store.cas("ptr", b"stale", e1)
    got = await store.get("ptr")
    assert got is not None and (got.data, got.etag) == (b"v2", e2)


async def test_streamed_put(store: Store) -> None:
    async def chunks():
        for i in range(5):
            yield bytes([i]) * 1000

    etag = await store.put_if_absent("streamed", chunks())
    got = await store.get("streamed")
    assert got is not None and got.etag == etag
    assert got.data == b"".join(bytes([i]) * 1000 for i in range(5))


# Above the S3 backend's multipart threshold (16 MiB): uploaded in parallel parts there.
LARGE = 17 << 20


async def test_large_payload_round_trips_whole(store: Store) -> None:
    data = os.urandom(LARGE)

    async def chunks():
        for start in range(0, LARGE, 3 << 20):  # chunks that do not line up with the parts
            yield data[start : start + (3 << 20)]

    etag = await store.put_if_absent("big/bytes", data)
    streamed = await store.put_if_absent("big/streamed", chunks())
    for key, tag in (("big/bytes", etag), ("big/streamed", streamed)):
        info = await store.head(key)
        assert (info.size, info.etag) == (LARGE, tag)
        got = await store.get(key)
        assert got is not None and got.etag == tag and got.data == data
    edge = await store.get("big/bytes", offset=(8 << 20) - 3, length=6)  # across a part boundary
    assert edge is not None and edge.data == data[(8 << 20) - 3 : (8 << 20) + 3]
    with pytest.raises(PreconditionFailed):
        await store.put_if_absent("big/bytes", os.urandom(LARGE))
    assert await store.get_bytes("big/bytes") == data


async def test_interrupted_large_upload_leaves_nothing(store: Store) -> None:
    """A crash mid-upload (the stream fails after several parts) publishes nothing, and the
    key stays free for the next attempt."""

    class Crash(Exception):
        pass

    async def failing():
        for _ in range(3):
            yield os.urandom(8 << 20)
        raise Crash

    with pytest.raises(Crash):
        await store.put_if_absent("big/crash", failing())
    assert not await store.exists("big/crash")
    assert await keys_of(store, "big/") == []
    await store.put_if_absent("big/crash", b"second attempt")
    assert await store.get_bytes("big/crash") == b"second attempt"


async def test_list_order_prefix_and_start_after(store: Store) -> None:
    # No key shares a folder's name followed by a character below '/' ("p/a" and "p/a-b"): some
    # S3-compatible servers list such folders first, and the run layout never creates them.
    keys = ["p/a/b", "p/a/c/d", "p/b-1", "p/b.2", "p/b0", "p/c/x", "q/x", "p0"]
    await asyncio.gather(*(store.put(k, k.encode()) for k in keys))
    assert await keys_of(store) == sorted(keys)
    assert await keys_of(store, "p/") == sorted(k for k in keys if k.startswith("p/"))
    assert await keys_of(store, "p/a/") == ["p/a/b", "p/a/c/d"]
    assert await keys_of(store, "p/b") == ["p/b-1", "p/b.2", "p/b0"]
    assert await keys_of(store, "p", start_after="p/a/b") == ["p/a/c/d", "p/b-1", "p/b.2", "p/b0", "p/c/x", "p0"]
    assert await keys_of(store, "p/", start_after="p/b-1") == ["p/b.2", "p/b0", "p/c/x"]
    assert await keys_of(store, "p/", start_after="p/z") == []
    infos = [i async for i in store.list("q/")]
    assert [(i.key, i.size) for i in infos] == [("q/x", 3)]


async def test_list_paginates_past_one_page(store: Store) -> None:
    keys = [f"many/{i:05d}" for i in range(1050)]
    sem = asyncio.Semaphore(32)

    async def put(key: str) -> None:
        async with sem:
            await store.put(key, b"")

    await asyncio.gather(*(put(k) for k in keys))
    assert await keys_of(store, "many/") == keys
    assert await keys_of(store, "many/", start_after="many/01000") == keys[1001:]


async def test_delete(store: Store) -> None:
    await store.put("d/x", b"1")
    await store.put("d/y", b"2")
    await store.delete("d/x")
    assert await keys_of(store, "d/") == ["d/y"]
    with pytest.raises(NotFound):
        await store.get("d/x")


async def test_invalid_keys_are_rejected(store: Store) -> None:
    for bad in ["", "/abs", "a//b", "a/../b", "trailing/", "sp ace", ".stoa-tmp/x"]:
        with pytest.raises(ValueError):
            await store.put(bad, b"x")


async def test_racing_put_if_absent_has_one_winner(store: Store) -> None:
    async def attempt(i: int) -> int | None:
        try:
            await store.put_if_absent("race/once", f"writer-{i}".encode())
            return i
        except PreconditionFailed:
            return None

    results = await asyncio.gather(*(attempt(i) for i in range(16)))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    assert await store.get_bytes("race/once") == f"writer-{winners[0]}".encode()


async def test_racing_cas_has_one_winner(store: Store) -> None:
    base = await store.put_if_absent("race/ptr", b"v0")

    async def attempt(i: int) -> int | None:
        try:
            await store.put("race/ptr", f"v1-{i}".encode(), if_match=base)
            return i
        except PreconditionFailed:
            return None

    results = await asyncio.gather(*(attempt(i) for i in range(16)))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    assert await store.get_bytes("race/ptr") == f"v1-{winners[0]}".encode()


async def test_missing_bucket_or_folder_is_a_config_error(store_url: str, store_env: dict[str, str]) -> None:
    if store_url.startswith("file://"):
        url = store_url + "-does-not-exist"
    else:
        bucket = store_url.split("/")[2]
        url = store_url.replace(bucket, bucket + "-nope", 1)
    async with open_store(url, environ=store_env) as missing:
        with pytest.raises(StoreConfigError, match="does not exist"):
            await missing.get("anything")


def _cas_worker(url: str, base: str, i: int, queue: multiprocessing.Queue) -> None:
    async def run() -> bool:
        async with open_store(url) as store:
            try:
                await store.put("proc/ptr", f"proc-{i}".encode(), if_match=base)
                return True
            except PreconditionFailed:
                return False

    queue.put((i, asyncio.run(run())))


@pytest.mark.file_only
async def test_local_cas_across_processes_has_one_winner(store: Store, store_url: str) -> None:
    base = await store.put_if_absent("proc/ptr", b"v0")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_cas_worker, args=(store_url, base, i, queue)) for i in range(6)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    winners = [i for i, won in results if won]
    assert len(winners) == 1
    assert await store.get_bytes("proc/ptr") == f"proc-{winners[0]}".encode()


@pytest.mark.file_only
async def test_local_store_leaves_no_temp_files_visible(store: Store, store_url: str) -> None:
    await store.put_if_absent("x/y", b"1")
    with pytest.raises(PreconditionFailed):
        await store.put_if_absent("x/y", b"2")
    root = Path(store_url.removeprefix("file://"))
    assert os.listdir(root / ".stoa-tmp") == []
    assert await keys_of(store) == ["x/y"]
