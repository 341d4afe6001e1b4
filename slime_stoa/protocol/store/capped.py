"""Bounded reads of the small documents read from the bucket (pointer, manifests, run manifest,
registry, key rotations, eval requests, consumer state, heartbeats).

Any worker's token can write the bucket, so a document's size is not trusted either:
`read_capped` asks for at most `limit + 1` bytes (a ranged GET), so an object of any size, or
one that grew since it was listed, costs at most that much memory and transfer before it is
refused. Each reader keeps its limit as a named constant beside it.
"""

from __future__ import annotations

from .base import GetResult, Store


class TooLarge(ValueError):
    """An object is larger than its reader's limit; at most `limit + 1` bytes of it were read.
    `etag` names the refused bytes (a poller can skip them until the object changes)."""

    def __init__(self, key: str, size: int, limit: int, etag: str) -> None:
        super().__init__(
            f"{key} is {size:,} bytes, over the limit of {limit:,} for this document: refused without reading it"
        )
        self.key = key
        self.size = size
        self.limit = limit
        self.etag = etag


async def read_capped(store: Store, key: str, limit: int, *, if_none_match: str | None = None) -> GetResult | None:
    """The object at `key` when it holds at most `limit` bytes, read with one GET of at most
    `limit + 1` bytes; None when its ETag is still `if_none_match`. TooLarge (a ValueError) when
    it is larger, NotFound when it is missing, another StoreError when the store fails."""
    if limit < 0:
        raise ValueError(f"a read limit must be >= 0, got {limit}")
    got = await store.get(key, length=limit + 1, if_none_match=if_none_match)
    if got is None:
        return None
    size = max(got.size, len(got.data))  # a backend that ignored the range still gets refused
    if size > limit:
        raise TooLarge(key, size, limit, got.etag)
    return got


async def read_capped_bytes(store: Store, key: str, limit: int) -> bytes:
    """The bytes of `read_capped` (an unconditional read)."""
    got = await read_capped(store, key, limit)
    assert got is not None
    return got.data
