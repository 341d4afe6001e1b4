"""The fault-injecting proxy itself (`tests.faultproxy`), against the real local S3 server: each
kind of fault does to a real S3 client what it says, and is counted."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from slime_stoa.protocol.store import StoreUnavailable
from slime_stoa.protocol.store.retry import RetryPolicy
from slime_stoa.protocol.store.s3 import S3Store
from tests.conftest import async_wait_until
from tests.faultproxy import Faults, FaultyProxy

ONCE = RetryPolicy(attempts=1)  # no retry: each fault reaches the caller


def port_of(server: Any) -> int:
    return int(server.endpoint_url.rsplit(":", 1)[1])


def through(server: Any, bucket: str, prefix: str, proxy: FaultyProxy) -> S3Store:
    """An S3 client of the server that reaches it through `proxy`, with no retry of its own."""
    return S3Store(
        bucket=bucket, prefix=prefix, endpoint_url=proxy.endpoint, region=server.region,
        credentials=server.credentials(), url=f"s3://{bucket}/{prefix}?endpoint={proxy.endpoint}", retry=ONCE,
    )  # fmt: skip


async def test_each_fault_does_what_it_says(s3_server: Any, s3_bucket: str) -> None:
    prefix = f"proxy-{uuid.uuid4().hex[:8]}"
    direct = s3_server.store(s3_bucket, prefix)
    async with direct, FaultyProxy(port_of(s3_server), seed=1) as proxy:
        async with through(s3_server, s3_bucket, prefix, proxy) as store:
            await store.put("a", b"plain")  # no faults: a plain proxy
            assert await store.get_bytes("a") == b"plain" and proxy.requests["PUT"] == 1

            proxy.faults = Faults(reset_response=1.0)  # the write lands, its answer is cut
            with pytest.raises(StoreUnavailable):
                await store.put_if_absent("b", b"landed")
            assert await direct.get_bytes("b") == b"landed"

            proxy.faults = Faults(reset_request=1.0)  # cut before the server has the whole request
            with pytest.raises(StoreUnavailable):
                await store.put_if_absent("c", b"x" * 5000)
            assert not await direct.exists("c")

            proxy.faults = Faults(status_503=1.0)  # answered by the proxy, never forwarded
            forwarded = proxy.requests["GET"]
            with pytest.raises(StoreUnavailable, match=r"SlowDown|503"):
                await store.get_bytes("a")
            assert proxy.requests["GET"] == forwarded

            proxy.faults = Faults(delay=1.0, delay_s=(0.2, 0.2))
            started = asyncio.get_running_loop().time()
            assert await store.get_bytes("a") == b"plain"
            assert asyncio.get_running_loop().time() - started >= 0.2

            proxy.faults = Faults()
            proxy.set_busy(True)  # a 503 burst
            with pytest.raises(StoreUnavailable):
                await store.get_bytes("a")
            proxy.set_busy(False)
            proxy.set_down()  # a full outage
            with pytest.raises(StoreUnavailable):
                await store.get_bytes("a")
            proxy.set_up()
            assert await store.get_bytes("a") == b"plain"
        counted = proxy.faults_injected
        for kind in ("reset_response", "reset_request", "503", "delay", "burst", "outage"):
            assert counted[kind] >= 1, (kind, counted)
        assert proxy.dropped >= 1


async def test_a_hold_stops_one_request_until_it_is_released_or_dropped(s3_server: Any, s3_bucket: str) -> None:
    prefix = f"proxy-{uuid.uuid4().hex[:8]}"
    direct = s3_server.store(s3_bucket, prefix)
    async with direct, FaultyProxy(port_of(s3_server)) as proxy, through(s3_server, s3_bucket, prefix, proxy) as store:
        trap = proxy.hold(lambda method, path: method == "PUT" and path.split("?")[0].endswith("/held"))
        write = asyncio.ensure_future(store.put("held", b"late"))
        await async_wait_until(trap.hit.is_set, message="the PUT reaching the proxy")
        await store.put("other", b"not held")  # one request is held, not the proxy
        assert not write.done() and not await direct.exists("held")
        trap.release()
        await asyncio.wait_for(write, 30)
        assert await direct.get_bytes("held") == b"late" and trap.done.is_set()

        cut = proxy.hold(lambda method, path: method == "PUT")
        write = asyncio.ensure_future(store.put("dropped", b"never"))
        await async_wait_until(cut.hit.is_set, message="the PUT reaching the proxy")
        cut.drop()
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(write, 30)
        assert not await direct.exists("dropped")

        lost = proxy.hold(lambda method, path: method == "PUT")
        write = asyncio.ensure_future(store.put("answer-lost", b"landed"))
        await async_wait_until(lost.hit.is_set, message="the PUT reaching the proxy")
        lost.lose_answer(then_down=True)  # it lands; the answer and every retry are cut
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(write, 30)
        assert proxy.down and await direct.get_bytes("answer-lost") == b"landed"
