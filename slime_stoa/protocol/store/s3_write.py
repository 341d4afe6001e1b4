"""The S3 backend's writes: single PUTs and multipart uploads, both maybe conditional.

- Put-if-absent sends `If-None-Match: *` and compare-and-swap sends `If-Match: "<etag>"`, on
  PutObject and on CompleteMultipartUpload.
- A payload above `multipart_threshold` goes up in parts of `part_size`, `max_concurrency` at a
  time; a failed upload is aborted.
- A conditional write that was retried and then loses is checked against the object's ETag (md5
  of the body, or of the part md5s for a multipart upload): if the object holds exactly our
  bytes, the write is reported as done.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from .base import NotFound, Payload, PreconditionFailed, StoreError
from .s3_connection import S3Connection, quote_etag, unquote_etag
from .s3_errors import error_code

log = logging.getLogger(__name__)

MIN_PART_SIZE = 5 << 20  # S3's minimum for every part but the last
MAX_PARTS = 10_000
_HASH_IN_THREAD = 1 << 20  # hash payloads above this off the event loop


def _md5(data: bytes) -> bytes:
    return hashlib.md5(data, usedforsecurity=False).digest()


async def _md5_async(data: bytes) -> bytes:
    if len(data) > _HASH_IN_THREAD:
        return await asyncio.to_thread(_md5, data)  # hashlib releases the GIL
    return _md5(data)


@dataclass(frozen=True, slots=True)
class _Part:
    number: int
    etag: str
    md5: bytes


def _multipart_etag(parts: Iterable[_Part]) -> str:
    """The ETag S3 gives a completed multipart upload: md5 of the part md5s, dash, part count."""
    digests = [p.md5 for p in parts]
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"


class _UploadGone(StoreError):
    """CompleteMultipartUpload answered NoSuchUpload (maybe because an earlier try completed it)."""


async def _slices(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def _blocks(stream: AsyncIterable[bytes], size: int) -> AsyncIterator[bytes]:
    """Re-cut a stream of arbitrary chunks into blocks of `size` bytes (the last may be short)."""
    buffer = bytearray()
    async for chunk in stream:
        buffer += chunk
        while len(buffer) >= size:
            yield bytes(buffer[:size])
            del buffer[:size]
    if buffer:
        yield bytes(buffer)


async def _chain(first: list[bytes], rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    for block in first:
        yield block
    async for block in rest:
        yield block


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The error that broke a task group (not the cancellations it caused)."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    real = [e for e in leaves if not isinstance(e, asyncio.CancelledError)]
    return (real or leaves)[0]


class S3Writer(S3Connection):
    """Writes of whole objects to `bucket`, by full key, with or without a condition."""

    def __init__(self, *, multipart_threshold: int, part_size: int, max_concurrency: int, **connection: Any) -> None:
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least 5 MiB (S3's minimum part), got {part_size}")
        if multipart_threshold < 0 or max_concurrency < 1:
            raise ValueError("multipart_threshold must be >= 0 and max_concurrency >= 1")
        super().__init__(max_concurrency=max_concurrency, **connection)
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size

    async def _write(self, key: str, full: str, data: Payload, conditions: dict[str, str]) -> str:
        if isinstance(data, (bytes, bytearray, memoryview)):
            body = bytes(data)
            if len(body) <= self.multipart_threshold:
                return await self._put_single(key, full, body, conditions)
            return await self._put_multipart(key, full, _slices(body, self.part_size), conditions)
        blocks = _blocks(data, self.part_size)
        head: list[bytes] = []
        size = 0
        async for block in blocks:
            head.append(block)
            size += len(block)
            if size > self.multipart_threshold:
                return await self._put_multipart(key, full, _chain(head, blocks), conditions)
        return await self._put_single(key, full, b"".join(head), conditions)

    async def _conditional(
        self,
        action: str,
        key: str,
        full: str,
        send: Callable[[Any], Awaitable[str]],
        conditions: dict[str, str],
        expected_etag: str,
        size: int | None = None,
    ) -> str:
        """Send a (maybe conditional) write; settle a retried write that then seems to lose."""
        tries = 0

        async def attempt(client: Any) -> str:
            nonlocal tries
            tries += 1
            return await send(client)

        try:
            return await self._call(action, key, attempt, cas="IfMatch" in conditions, size=size)
        except (PreconditionFailed, _UploadGone):
            if tries > 1 and await self._holds(key, full, expected_etag):
                return expected_etag
            raise

    async def _holds(self, key: str, full: str, etag: str) -> bool:
        try:
            resp = await self._call("HEAD", key, lambda c: c.head_object(Bucket=self.bucket, Key=full))
        except NotFound:
            return False
        return unquote_etag(resp["ETag"]) == etag

    async def _put_single(self, key: str, full: str, body: bytes, conditions: dict[str, str]) -> str:
        digest = await _md5_async(body)
        content_md5 = base64.b64encode(digest).decode()

        async def send(client: Any) -> str:
            resp = await client.put_object(
                Bucket=self.bucket, Key=full, Body=body, ContentMD5=content_md5, **conditions
            )
            return unquote_etag(resp["ETag"])

        return await self._conditional("PUT", key, full, send, conditions, digest.hex(), size=len(body))

    async def _put_multipart(
        self, key: str, full: str, blocks: AsyncIterator[bytes], conditions: dict[str, str]
    ) -> str:
        created = await self._call(
            "start multipart upload of",
            key,
            lambda c: c.create_multipart_upload(Bucket=self.bucket, Key=full),
        )
        upload_id = created["UploadId"]
        try:
            parts = await self._upload_parts(key, full, upload_id, blocks)
            return await self._complete(key, full, upload_id, parts, conditions)
        except BaseException:
            await self._abort(key, full, upload_id)
            raise

    async def _upload_parts(
        self, key: str, full: str, upload_id: str, blocks: AsyncIterator[bytes]
    ) -> list[_Part]:
        """Upload blocks as parts, at most `max_concurrency` in flight (and in memory)."""
        done: list[_Part] = []
        gate = asyncio.Semaphore(self.max_concurrency)

        async def upload(number: int, block: bytes) -> None:
            try:
                done.append(await self._upload_part(key, full, upload_id, number, block))
            finally:
                gate.release()

        try:
            async with asyncio.TaskGroup() as group:
                number = 0
                async for block in blocks:
                    number += 1
                    if number > MAX_PARTS:
                        raise ValueError(
                            f"{key!r} needs more than {MAX_PARTS} parts of {self.part_size} bytes; "
                            f"raise part_size"
                        )
                    await gate.acquire()
                    group.create_task(upload(number, block))
        except BaseExceptionGroup as errors:
            raise _first_error(errors) from None
        return sorted(done, key=lambda p: p.number)

    async def _upload_part(self, key: str, full: str, upload_id: str, number: int, block: bytes) -> _Part:
        digest = await _md5_async(block)
        content_md5 = base64.b64encode(digest).decode()

        async def send(client: Any) -> str:
            resp = await client.upload_part(
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
                PartNumber=number,
                Body=block,
                ContentMD5=content_md5,
            )
            return unquote_etag(resp["ETag"])

        etag = await self._call(f"upload part {number} of", key, send, size=len(block))
        return _Part(number=number, etag=etag, md5=digest)

    async def _complete(
        self, key: str, full: str, upload_id: str, parts: list[_Part], conditions: dict[str, str]
    ) -> str:
        manifest = {"Parts": [{"PartNumber": p.number, "ETag": quote_etag(p.etag)} for p in parts]}

        async def send(client: Any) -> str:
            try:
                resp = await client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload=manifest, **conditions
                )
            except ClientError as exc:
                if error_code(exc) == "NoSuchUpload":
                    raise _UploadGone(f"multipart upload of {key!r} in {self.url} vanished") from exc
                raise
            return unquote_etag(resp["ETag"])

        expected = _multipart_etag(parts)
        return await self._conditional("complete multipart upload of", key, full, send, conditions, expected)

    async def _abort(self, key: str, full: str, upload_id: str) -> None:
        """Best effort: a failed abort is logged, the original error is what matters."""
        try:
            await self._call(
                "abort multipart upload of",
                key,
                lambda c: c.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id),
            )
        except Exception as exc:
            log.warning("could not abort the multipart upload of %r in %s: %s", key, self.url, exc)
