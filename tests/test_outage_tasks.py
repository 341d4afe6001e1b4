"""A store outage leaves no task whose exception nobody retrieves: asyncio would log each one
("Task exception was never retrieved", with a traceback) when it is collected.

The fault proxy runs on a thread of its own, as the network does: the client's connection can
then be dropped before its request goes out (with the proxy on the client's own loop it never
is), which is what a store outage does to every PUT."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from slime_stoa.protocol.store import StoreError
from slime_stoa.protocol.store.retry import RetryPolicy
from slime_stoa.protocol.store.s3 import S3Store
from tests.faultproxy import FaultyProxy

REQUESTS = 20  # each one unobserved with a chance of about 4 in 5 without the fix


class ProxyThread:
    """A `FaultyProxy` to `port`, on its own event loop and thread."""

    def __init__(self, port: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.proxy = FaultyProxy(port)
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True, name="fault-proxy")
        self.thread.start()
        started.wait(10)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.proxy.__aenter__())
        started.set()
        self.loop.run_forever()

    def run(self, fn: Any) -> None:
        """`fn()` on the proxy's loop, waited for."""

        async def call() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(call(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.__aexit__(None, None, None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def proxy(s3_server: Any) -> Iterator[ProxyThread]:
    running = ProxyThread(int(s3_server.endpoint_url.rsplit(":", 1)[1]))
    yield running
    running.close()


async def test_an_outage_leaves_no_unretrieved_task_exception(
    s3_server: Any, s3_bucket: str, proxy: ProxyThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncio")
    endpoint = proxy.proxy.endpoint
    store = S3Store(
        bucket=s3_bucket, prefix="outage-tasks", endpoint_url=endpoint, region=s3_server.region,
        credentials=s3_server.credentials(), url=f"s3://{s3_bucket}/outage-tasks?endpoint={endpoint}",
        retry=RetryPolicy(attempts=1),
    )  # fmt: skip
    async with store:
        await store.put("before", b"up")
        proxy.run(proxy.proxy.set_down)  # every connection accepted, then dropped at once
        failed = 0
        for i in range(REQUESTS):
            try:
                await store.put(f"k{i}", b"x" * 100)
            except StoreError:
                failed += 1
        assert failed == REQUESTS
        proxy.run(proxy.proxy.set_up)
        await store.put("after", b"back")  # the store works again, through the same client
        assert await store.get_bytes("after") == b"back"
    gc.collect()  # asyncio reports an unretrieved exception when its task is collected
    unretrieved = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not unretrieved, f"{len(unretrieved)} of {REQUESTS} requests: {unretrieved[0]}"
