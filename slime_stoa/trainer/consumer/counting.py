"""`CountingStore`: a thin proxy that forwards every call to a real store and counts requests.

Instrumentation for benchmarks and tests (how many GETs, LIST pages and keys listed a consumer
needed); it changes nothing about what the wrapped store does.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncGenerator

from slime_stoa.protocol.store import GetResult, ObjectInfo, Store
from slime_stoa.protocol.store.base import Payload

from .discovery import pages


class CountingStore(Store):
    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url
        self.calls: Counter[str] = Counter()  # get, put, put_if_absent, head, delete, list, list_pages, listed

    @property
    def requests(self) -> int:
        """Requests made: every call, a listing counted by its pages."""
        c = self.calls
        return c["get"] + c["put"] + c["put_if_absent"] + c["head"] + c["delete"] + c["list_pages"]

    def reset(self) -> None:
        self.calls.clear()

    async def get(
        self, key: str, *, offset: int = 0, length: int | None = None, if_none_match: str | None = None
    ) -> GetResult | None:
        self.calls["get"] += 1
        return await self.inner.get(key, offset=offset, length=length, if_none_match=if_none_match)

    async def put(self, key: str, data: Payload, *, if_match: str | None = None) -> str:
        self.calls["put"] += 1
        return await self.inner.put(key, data, if_match=if_match)

    async def put_if_absent(self, key: str, data: Payload) -> str:
        self.calls["put_if_absent"] += 1
        return await self.inner.put_if_absent(key, data)

    async def head(self, key: str) -> ObjectInfo:
        self.calls["head"] += 1
        return await self.inner.head(key)

    async def delete(self, key: str) -> None:
        self.calls["delete"] += 1
        await self.inner.delete(key)

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncGenerator[ObjectInfo, None]:
        self.calls["list"] += 1
        n = 0
        listing = self.inner.list(prefix, start_after=start_after)
        try:
            async with contextlib.aclosing(listing):
                async for info in listing:
                    n += 1
                    yield info
        finally:
            self.calls["list_pages"] += pages(n)
            self.calls["listed"] += n

    async def close(self) -> None:
        await self.inner.close()
