"""The S3 backend (`s3://`, `r2://`): any S3-compatible service through aiobotocore.

- Conditional writes: put-if-absent sends `If-None-Match: *` and compare-and-swap sends
  `If-Match: "<etag>"`, on PutObject and on CompleteMultipartUpload (AWS S3, Cloudflare R2 and
  SeaweedFS honour both; a lost race answers 412, a race still in flight 409, which is retried).
- Large payloads (above `multipart_threshold`) go up as a multipart upload, `max_concurrency`
  parts at a time; a failed upload is aborted. S3 needs parts of at least 5 MiB.
- botocore's own retries are off: `RetryPolicy` retries throttling, 5xx, timeouts, dropped
  connections and 409 ConditionalRequestConflict; other 4xx surface at once as store errors.
- A conditional write that was retried after an ambiguous failure (the first try may have landed
  before its answer was lost) and then loses is checked against the object's ETag: if the object
  holds exactly our bytes, the write is reported as done.

A bucket lifecycle rule that aborts incomplete multipart uploads after a day is recommended: an
upload interrupted by a crash cannot abort itself.
"""

from __future__ import annotations

import asyncio
import base64
import builtins  # `list` is also a method of S3Store
import hashlib
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.httpsession import AIOHTTPSession
from aiobotocore.session import get_session
from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    SSLError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from .base import (
    GetResult,
    NotFound,
    ObjectInfo,
    Payload,
    PreconditionFailed,
    Store,
    StoreConfigError,
    StoreError,
    check_key,
    check_prefix,
    check_range,
)
from .credentials import Credentials, default_env_file
from .retry import RetryPolicy, with_retries

log = logging.getLogger(__name__)

T = TypeVar("T")
MIN_PART_SIZE = 5 << 20  # S3's minimum for every part but the last
MAX_PARTS = 10_000
_HASH_IN_THREAD = 1 << 20  # hash payloads above this off the event loop

_RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestThrottled",
        "BandwidthLimitExceeded",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "RequestTimeoutException",
        "ConditionalRequestConflict",
    }
)
_CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "Unauthorized",
        "Forbidden",
        "403",
        "401",
    }
)


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _message(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Message", "")) or str(exc)


def is_retryable(exc: BaseException) -> bool:
    """Throttling, 5xx, timeouts and dropped connections: worth another try."""
    if isinstance(exc, ClientError):
        code, status = _code(exc), _status(exc)
        if status == 409:
            return code == "ConditionalRequestConflict"
        return code in _RETRY_CODES or status == 429 or status >= 500
    if isinstance(exc, SSLError):
        return False  # a TLS setup problem does not heal by retrying
    return isinstance(
        exc,
        (
            BotoConnectionError,
            HTTPClientError,
            IncompleteReadError,
            aiohttp.ClientError,
            asyncio.TimeoutError,
            ConnectionError,
        ),
    )


def _unquote(etag: str) -> str:
    return etag.strip().removeprefix("W/").strip('"')


def _quote(etag: str) -> str:
    return f'"{_unquote(etag)}"'


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


class _OneShotHTTPSession(AIOHTTPSession):
    """aiobotocore's HTTP session, minus aiohttp's hidden resend of idempotent requests.

    aiohttp silently resends a PUT once when the connection drops before the answer. For a
    conditional PUT that resend can meet our own landed write and turn success into a 412 that
    `_conditional` cannot tell from a lost race. Every retry must go through `RetryPolicy`.
    """

    async def _get_session(self, proxy_url: str | None) -> aiohttp.ClientSession:
        session = await super()._get_session(proxy_url)
        if hasattr(session, "_retry_connection"):  # aiohttp >= 3.9 (private flag)
            session._retry_connection = False
        return session


class S3Store(Store):
    """Objects under `prefix` in `bucket` at `endpoint_url` (None: AWS S3 in `region`)."""

    def __init__(
        self,
        *,
        bucket: str,
        prefix: str,
        endpoint_url: str | None,
        region: str,
        credentials: Credentials | None,
        url: str,
        retry: RetryPolicy = RetryPolicy(),
        multipart_threshold: int = 16 << 20,
        part_size: int = 8 << 20,
        max_concurrency: int = 8,
        connect_timeout: float = 5,
        read_timeout: float = 60,
    ) -> None:
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least 5 MiB (S3's minimum part), got {part_size}")
        if multipart_threshold < 0 or max_concurrency < 1:
            raise ValueError("multipart_threshold must be >= 0 and max_concurrency >= 1")
        root = prefix.strip("/")
        if root:
            check_key(root)
        self.bucket = bucket
        self.prefix = root
        self.endpoint_url = endpoint_url
        self.region = region
        self.credentials = credentials
        self.url = url
        self.retry = retry
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._root = f"{root}/" if root else ""
        self._list_page_size = 1000
        self._client: Any = None
        self._stack: AsyncExitStack | None = None
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    # -- client ------------------------------------------------------------------------------
    @property
    def _endpoint(self) -> str:
        return self.endpoint_url or f"AWS S3 ({self.region})"

    def _config(self) -> AioConfig:
        return AioConfig(
            region_name=self.region,
            signature_version="s3v4",
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            max_pool_connections=max(10, 2 * self.max_concurrency),
            s3={"addressing_style": "path" if self.endpoint_url else "auto"},
            # Checksums only where the API demands them: not every S3-compatible service takes
            # the newer flexible checksums; PutObject/UploadPart carry Content-MD5 instead.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            http_session_cls=_OneShotHTTPSession,
        )

    def _missing_credentials(self) -> StoreConfigError:
        scheme = self.url.partition("://")[0] or "s3"
        where = default_env_file(scheme, os.environ)
        return StoreConfigError(
            f"no credentials for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            f"(or STOA_ACCESS_KEY_ID / STOA_SECRET_ACCESS_KEY) in the environment, or write them "
            f"to {where} (chmod 600), or point STOA_ENV_FILE at such a file"
        )

    async def _s3(self) -> Any:
        """The aiobotocore client, created on first use."""
        if self._client is not None:
            return self._client
        async with self._lock:
            if self._client is None:
                await self._open()
        return self._client

    async def _open(self) -> None:
        creds = self.credentials
        if creds is None:
            raise self._missing_credentials()
        stack = AsyncExitStack()
        try:
            self._client = await stack.enter_async_context(
                get_session().create_client(
                    "s3",
                    endpoint_url=self.endpoint_url,
                    region_name=self.region,
                    aws_access_key_id=creds.access_key_id,
                    aws_secret_access_key=creds.secret_access_key,
                    aws_session_token=creds.session_token,
                    config=self._config(),
                )
            )
        except ValueError as exc:  # botocore rejects a malformed endpoint URL
            await stack.aclose()
            raise StoreConfigError(
                f"invalid endpoint URL {self.endpoint_url!r} for {self.url}: {exc}"
            ) from None
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    # -- calls and errors --------------------------------------------------------------------
    def _full(self, key: str) -> str:
        return self._root + check_key(key)

    def _where(self, action: str, key: str | None) -> str:
        target = f"{key!r} in {self.url}" if key is not None else self.url
        return f"{action} {target} (endpoint {self._endpoint})"

    def _advice(self, exc: BaseException) -> str:
        if isinstance(exc, ClientError):
            answer = _code(exc) or _status(exc)
            return f"{self._endpoint} kept answering {answer}: it is overloaded or failing; try again later"
        if isinstance(exc, asyncio.TimeoutError) or "timeout" in type(exc).__name__.lower():
            return f"{self._endpoint} did not answer in time: check the network and the endpoint URL"
        return f"could not reach {self._endpoint}: check the endpoint URL in {self.url} and the network"

    async def _call(
        self, action: str, key: str | None, fn: Callable[[Any], Awaitable[T]], *, cas: bool = False
    ) -> T:
        """Run one S3 request with retries, mapping its errors onto the store's."""
        client = await self._s3()
        try:
            return await with_retries(
                lambda: fn(client),
                policy=self.retry,
                is_retryable=is_retryable,
                describe=self._where(action, key),
                advice=self._advice,
            )
        except ClientError as exc:
            raise self._map_error(exc, action, key, cas=cas) from exc
        except SSLError as exc:
            raise StoreConfigError(
                f"{self._where(action, key)}: TLS failed ({exc}); check the endpoint URL (https vs http)"
            ) from exc

    def _map_error(self, exc: ClientError, action: str, key: str | None, *, cas: bool) -> StoreError:
        code, status, where = _code(exc), _status(exc), self._where(action, key)
        if code == "RequestTimeTooSkewed":
            return StoreConfigError(
                f"{where}: this machine's clock differs too much from the server's "
                f"(RequestTimeTooSkewed); synchronise it with NTP (e.g. `timedatectl set-ntp true`)"
            )
        if code == "NoSuchBucket":
            return StoreConfigError(
                f"{where}: bucket {self.bucket!r} does not exist at {self._endpoint}; create it or "
                f"fix the bucket name in {self.url}"
            )
        if code == "PreconditionFailed" or status == 412:
            reason = "its ETag moved" if cas else "the key exists"
            return PreconditionFailed(f"{where}: precondition failed ({reason})")
        if cas and status == 404:
            return PreconditionFailed(f"{where}: the object does not exist, so its ETag cannot match")
        if code in _CREDENTIAL_CODES or status in (401, 403):
            creds = str(self.credentials) if self.credentials else "no credentials"
            return StoreConfigError(
                f"{where}: access refused ({code or status}); check the credentials ({creds}): "
                f"the access key id, the secret key, and that they may read and write bucket "
                f"{self.bucket!r} (if they are right, check this machine's clock)"
            )
        if code in ("NoSuchKey", "NotFound", "404") or status == 404:
            return NotFound(f"{key!r} not found in {self.url}")
        return StoreError(f"{where}: {code or 'error'} (HTTP {status}): {_message(exc)}")

    # -- reading -----------------------------------------------------------------------------
    async def get(
        self,
        key: str,
        *,
        offset: int = 0,
        length: int | None = None,
        if_none_match: str | None = None,
    ) -> GetResult | None:
        check_range(offset, length)
        full = self._full(key)
        if length == 0:
            return await self._empty_read(key, offset, if_none_match)
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": full}
        if offset or length is not None:
            end = "" if length is None else str(offset + length - 1)
            params["Range"] = f"bytes={offset}-{end}"
        if if_none_match:
            params["IfNoneMatch"] = _quote(if_none_match)

        async def fetch(client: Any) -> GetResult | bool | None:
            try:
                resp = await client.get_object(**params)
            except ClientError as exc:
                if _status(exc) == 304:
                    return None
                if _status(exc) == 416:
                    return False  # the range starts past the end
                raise
            async with resp["Body"] as body:
                data = await body.read()
            return GetResult(data=data, etag=_unquote(resp["ETag"]), size=_total_size(resp, len(data)))

        result = await self._call("GET", key, fetch)
        if result is False:
            return await self._empty_read(key, offset, if_none_match)
        assert result is None or isinstance(result, GetResult)
        return result

    async def _empty_read(self, key: str, offset: int, if_none_match: str | None) -> GetResult | None:
        """A read of zero bytes (or starting past the end): only the ETag and size matter."""
        info = await self.head(key)
        if if_none_match is not None and _unquote(if_none_match) == info.etag:
            return None
        return GetResult(data=b"", etag=info.etag, size=info.size)

    async def head(self, key: str) -> ObjectInfo:
        full = self._full(key)
        resp = await self._call("HEAD", key, lambda c: c.head_object(Bucket=self.bucket, Key=full))
        modified = resp.get("LastModified")
        return ObjectInfo(
            key=key,
            size=int(resp["ContentLength"]),
            etag=_unquote(resp["ETag"]),
            last_modified=modified.timestamp() if modified else None,
        )

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncGenerator[ObjectInfo, None]:
        check_prefix(prefix)
        full_prefix = self._root + prefix
        params: dict[str, Any] = {
            "Bucket": self.bucket,
            "Prefix": full_prefix,
            "MaxKeys": self._list_page_size,
        }
        if start_after:
            after = self._root + start_after
            if after.startswith(full_prefix):
                params["StartAfter"] = after
            elif after > full_prefix:
                return  # every key with the prefix sorts before `start_after`
            # else `start_after` sorts before every key with the prefix: no cutoff needed
        while True:
            page = await self._call("LIST", prefix or None, _list_objects_v2(dict(params)))
            for obj in page.get("Contents", ()):
                yield self._info(obj)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            params.pop("StartAfter", None)
            params["ContinuationToken"] = token

    def _info(self, obj: dict[str, Any]) -> ObjectInfo:
        modified = obj.get("LastModified")
        return ObjectInfo(
            key=obj["Key"][len(self._root) :],
            size=int(obj["Size"]),
            etag=_unquote(obj.get("ETag", "")),
            last_modified=modified.timestamp() if modified else None,
        )

    async def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            await self._call("DELETE", key, lambda c: c.delete_object(Bucket=self.bucket, Key=full))
        except NotFound:
            return

    # -- writing -----------------------------------------------------------------------------
    async def put(self, key: str, data: Payload, *, if_match: str | None = None) -> str:
        conditions = {"IfMatch": _quote(if_match)} if if_match is not None else {}
        return await self._write(key, data, conditions)

    async def put_if_absent(self, key: str, data: Payload) -> str:
        return await self._write(key, data, {"IfNoneMatch": "*"})

    async def _write(self, key: str, data: Payload, conditions: dict[str, str]) -> str:
        full = self._full(key)
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
        send: Callable[[Any], Awaitable[str]],
        conditions: dict[str, str],
        expected_etag: str,
    ) -> str:
        """Send a (maybe conditional) write; settle a retried write that then seems to lose."""
        tries = 0

        async def attempt(client: Any) -> str:
            nonlocal tries
            tries += 1
            return await send(client)

        try:
            return await self._call(action, key, attempt, cas="IfMatch" in conditions)
        except (PreconditionFailed, _UploadGone):
            if tries > 1 and await self._holds(key, expected_etag):
                return expected_etag
            raise

    async def _holds(self, key: str, etag: str) -> bool:
        try:
            return (await self.head(key)).etag == etag
        except NotFound:
            return False

    async def _put_single(self, key: str, full: str, body: bytes, conditions: dict[str, str]) -> str:
        digest = await _md5_async(body)
        content_md5 = base64.b64encode(digest).decode()

        async def send(client: Any) -> str:
            resp = await client.put_object(
                Bucket=self.bucket, Key=full, Body=body, ContentMD5=content_md5, **conditions
            )
            return _unquote(resp["ETag"])

        return await self._conditional("PUT", key, send, conditions, digest.hex())

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
    ) -> builtins.list[_Part]:
        """Upload blocks as parts, at most `max_concurrency` in flight (and in memory)."""
        done: builtins.list[_Part] = []
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
            return _unquote(resp["ETag"])

        etag = await self._call(f"upload part {number} of", key, send)
        return _Part(number=number, etag=etag, md5=digest)

    async def _complete(
        self, key: str, full: str, upload_id: str, parts: builtins.list[_Part], conditions: dict[str, str]
    ) -> str:
        manifest = {"Parts": [{"PartNumber": p.number, "ETag": _quote(p.etag)} for p in parts]}

        async def send(client: Any) -> str:
            try:
                resp = await client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload=manifest, **conditions
                )
            except ClientError as exc:
                if _code(exc) == "NoSuchUpload":
                    raise _UploadGone(f"multipart upload of {key!r} in {self.url} vanished") from exc
                raise
            return _unquote(resp["ETag"])

        expected = _multipart_etag(parts)
        return await self._conditional("complete multipart upload of", key, send, conditions, expected)

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


def _total_size(resp: dict[str, Any], read: int) -> int:
    """The whole object's size: from Content-Range (`bytes a-b/total`) on a ranged read."""
    content_range = resp.get("ContentRange")
    if content_range and "/" in content_range:
        total = content_range.rsplit("/", 1)[1]
        if total.isdigit():
            return int(total)
    return int(resp.get("ContentLength", read))


def _list_objects_v2(params: dict[str, Any]) -> Callable[[Any], Awaitable[Any]]:
    """One ListObjectsV2 page request, bound to its own copy of the parameters."""
    return lambda client: client.list_objects_v2(**params)
