"""The object-store interface every backend implements, and its errors.

Keys are relative to the store's root (the bucket prefix or the local folder): slash-separated,
no leading slash, no empty or dot segments. ETags are opaque strings without quotes.

Commit rules the rest of stoa builds on:
- `put_if_absent` creates an object only if the key is free (S3 `If-None-Match: *`).
- `put(..., if_match=etag)` replaces an object only if it still has that ETag (compare-and-swap).
- A reader never sees a partially written object, however large: the S3 backend uploads a
  payload above its multipart threshold (bytes or a stream) as a multipart upload, several parts
  in parallel, and aborts it if the upload fails; the local backend streams it to a temp file.
  A write interrupted half-way leaves nothing visible and the key free.
"""

from __future__ import annotations

import abc
import re
from collections.abc import AsyncGenerator, AsyncIterable
from dataclasses import dataclass

Payload = bytes | bytearray | memoryview | AsyncIterable[bytes]

_KEY_SEGMENT = re.compile(r"^[A-Za-z0-9._=+@,:~-]+$")


class StoreError(Exception):
    """Base class of every store error. The message says what to do about it."""


class NotFound(StoreError):
    """The key does not exist."""


class PreconditionFailed(StoreError):
    """A conditional write lost: the key already exists (put-if-absent) or its ETag moved (CAS)."""


class StoreConfigError(StoreError):
    """The store is misconfigured (bucket, credentials, endpoint, clock). Retrying will not help."""


class StoreUnavailable(StoreError):
    """The store could not be reached or kept failing after every retry."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    etag: str
    last_modified: float | None = None  # seconds since the epoch, when the backend knows it


@dataclass(frozen=True, slots=True)
class ServerDate:
    """The store's own clock as one of its answers told it: its `Date` header (seconds since the
    epoch; HTTP dates are whole seconds) and `time.monotonic()` when that answer arrived, so a
    reader can carry it forward without trusting the local wall clock."""

    server_s: float
    monotonic_s: float


@dataclass(frozen=True, slots=True)
class GetResult:
    data: bytes
    etag: str
    size: int  # size of the whole object, also for a ranged get


def check_key(key: str) -> str:
    """Return `key` if it is a valid object key, else raise ValueError saying why."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty string, got {key!r}")
    if key.startswith("/") or key.endswith("/"):
        raise ValueError(f"object key {key!r} must not start or end with '/'")
    for segment in key.split("/"):
        if segment in ("", ".", "..") or segment.startswith(".stoa"):
            raise ValueError(f"object key {key!r} has an invalid segment {segment!r}")
        if not _KEY_SEGMENT.match(segment):
            raise ValueError(
                f"object key {key!r}: segment {segment!r} may only hold letters, digits and ._=+@,:~-"
            )
    return key


def check_prefix(prefix: str) -> str:
    """A listing prefix: empty, or any key start (it may end with '/')."""
    if prefix:
        check_key(prefix.rstrip("/") or "x")
    return prefix


def check_range(offset: int, length: int | None) -> None:
    """A byte range of `get`: offset >= 0 and, if given, length >= 0."""
    if offset < 0 or (length is not None and length < 0):
        raise ValueError(f"invalid byte range offset={offset} length={length}")


class Store(abc.ABC):
    """Async object store. Use as `async with open_store(url) as store:`."""

    url: str

    @abc.abstractmethod
    async def get(
        self,
        key: str,
        *,
        offset: int = 0,
        length: int | None = None,
        if_none_match: str | None = None,
    ) -> GetResult | None:
        """Read an object, or `length` bytes of it from `offset`.

        Returns None when `if_none_match` equals the current ETag (HTTP 304: nothing changed).
        Raises NotFound when the key is missing.
        """

    @abc.abstractmethod
    async def put(self, key: str, data: Payload, *, if_match: str | None = None) -> str:
        """Write an object (whole or streamed) and return its ETag.

        With `if_match`, write only if the object's current ETag equals it (compare-and-swap);
        raises PreconditionFailed otherwise, also when the object does not exist.
        """

    @abc.abstractmethod
    async def put_if_absent(self, key: str, data: Payload) -> str:
        """Create an object only if the key is free; raises PreconditionFailed if it exists."""

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectInfo:
        """Size and ETag of an object; raises NotFound when missing."""

    @abc.abstractmethod
    def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncGenerator[ObjectInfo, None]:
        """Objects whose key starts with `prefix`, in key order, strictly after `start_after`."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove an object. Deleting a missing key is not an error."""

    def server_date(self) -> ServerDate | None:
        """The `Date` of the store's last answer; None when it has not answered yet or has no
        clock of its own (the folder store: the local clock is the store's)."""
        return None

    async def close(self) -> None:  # noqa: B027 - a no-op unless the backend holds connections
        """Release connections."""

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def cas(self, key: str, data: Payload, etag: str | None) -> str:
        """Move a pointer: create it when `etag` is None, else replace it only if unchanged."""
        if etag is None:
            return await self.put_if_absent(key, data)
        return await self.put(key, data, if_match=etag)

    async def get_bytes(self, key: str) -> bytes:
        """The whole object's bytes (raises NotFound)."""
        result = await self.get(key)
        assert result is not None
        return result.data

    async def exists(self, key: str) -> bool:
        try:
            await self.head(key)
        except NotFound:
            return False
        return True

