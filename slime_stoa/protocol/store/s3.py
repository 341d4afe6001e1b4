"""The S3 backend (`s3://`, `r2://`): any S3-compatible service through aiobotocore.

- Conditional writes: put-if-absent sends `If-None-Match: *` and compare-and-swap sends
  `If-Match: "<etag>"`, on PutObject and on CompleteMultipartUpload (AWS S3, Cloudflare R2 and
  SeaweedFS honour both; a lost race answers 412, a race still in flight 409, which is retried).
- Large payloads (above `multipart_threshold`) go up as a multipart upload, `max_concurrency`
  parts at a time; a failed upload is aborted. S3 needs parts of at least 5 MiB.
- Every try of a request has an overall deadline (`request_deadline_s`, plus the bytes it moves
  at a slow uplink's rate), not only botocore's per-read timeout, which a trickle never trips.
- botocore's own retries are off: `RetryPolicy` retries throttling, 5xx, timeouts, dropped
  connections and 409 ConditionalRequestConflict; other 4xx surface at once as store errors.
- A conditional write that was retried after an ambiguous failure (the first try may have landed
  before its answer was lost) and then loses is checked against the object's ETag: if the object
  holds exactly our bytes, the write is reported as done.

A bucket lifecycle rule that aborts incomplete multipart uploads after a day is recommended: an
upload interrupted by a crash cannot abort itself.

`S3Store` stands on two parts: `S3Connection` (s3_connection.py: the client, requests with
retries, errors mapped onto the store's) and `S3Writer` (s3_write.py: single and multipart
writes, conditional or not). This module holds the store operations.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from aiobotocore.client import AioBaseClient
from botocore.exceptions import ClientError

from .base import (
    GetResult,
    NotFound,
    ObjectInfo,
    Payload,
    ServerDate,
    Store,
    check_key,
    check_prefix,
    check_range,
)
from .credentials import Credentials
from .retry import RetryPolicy
from .s3_connection import quote_etag, unquote_etag
from .s3_errors import answer_etag, error_status, is_retryable
from .s3_write import MAX_PARTS, MIN_PART_SIZE, S3Writer

__all__ = ["MAX_PARTS", "MIN_PART_SIZE", "S3Store", "is_retryable"]


class S3Store(S3Writer, Store):
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
        request_deadline_s: float = 60,
    ) -> None:
        super().__init__(
            multipart_threshold=multipart_threshold,
            part_size=part_size,
            max_concurrency=max_concurrency,
            bucket=bucket,
            endpoint_url=endpoint_url,
            region=region,
            credentials=credentials,
            url=url,
            retry=retry,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            request_deadline_s=request_deadline_s,
        )
        root = prefix.strip("/")
        if root:
            check_key(root)
        self.prefix = root
        self._root = f"{root}/" if root else ""
        self._list_page_size = 1000

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    def server_date(self) -> ServerDate | None:
        return self.last_date

    def _full(self, key: str) -> str:
        return self._root + check_key(key)

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
            params["IfNoneMatch"] = quote_etag(if_none_match)

        where = f"GET {key}"

        async def fetch(client: AioBaseClient) -> GetResult | bool | None:
            try:
                resp = await client.get_object(**params)
            except ClientError as exc:
                if error_status(exc) == 304:
                    return None
                if error_status(exc) == 416:
                    return False  # the range starts past the end
                raise
            # A read of unknown length gets its deadline once the answer names its length: the
            # headers within `request_deadline_s` (the call's own limit), the body at the slow
            # uplink's rate from there, so a trickled whole-object GET ends like a ranged one.
            body_limit = None if length is not None else self.deadline(_content_length(resp))
            async with resp["Body"] as body, asyncio.timeout(body_limit):
                data = await body.read()
            return GetResult(data=data, etag=answer_etag(resp, where), size=_total_size(resp, len(data)))

        # a ranged read's deadline covers its bytes; an unknown length's covers the headers here
        result = await self._call("GET", key, fetch, size=length if length is not None else 0)
        if result is False:
            return await self._empty_read(key, offset, if_none_match)
        assert result is None or isinstance(result, GetResult)
        return result

    async def _empty_read(self, key: str, offset: int, if_none_match: str | None) -> GetResult | None:
        """A read of zero bytes (or starting past the end): only the ETag and size matter."""
        info = await self.head(key)
        if if_none_match is not None and unquote_etag(if_none_match) == info.etag:
            return None
        return GetResult(data=b"", etag=info.etag, size=info.size)

    async def head(self, key: str) -> ObjectInfo:
        full = self._full(key)

        async def ask(client: AioBaseClient) -> dict[str, Any]:
            resp = await client.head_object(Bucket=self.bucket, Key=full)
            answer_etag(resp, f"HEAD {key}")  # inside the try: an answer without one is retried
            return resp

        resp = await self._call("HEAD", key, ask)
        modified = resp.get("LastModified")
        return ObjectInfo(
            key=key,
            size=int(resp["ContentLength"]),
            etag=answer_etag(resp, f"HEAD {key}"),
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
            etag=unquote_etag(obj.get("ETag", "")),
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
        conditions = {"IfMatch": quote_etag(if_match)} if if_match is not None else {}
        return await self._write(key, self._full(key), data, conditions)

    async def put_if_absent(self, key: str, data: Payload) -> str:
        return await self._write(key, self._full(key), data, {"IfNoneMatch": "*"})


def _content_length(resp: dict[str, Any]) -> int:
    """The bytes an answer says its body holds (S3 always sends Content-Length on a GET; an
    answer without one gets the deadline of an empty body)."""
    value = resp.get("ContentLength")
    return int(value) if isinstance(value, int) and value >= 0 else 0


def _total_size(resp: dict[str, Any], read: int) -> int:
    """The whole object's size: from Content-Range (`bytes a-b/total`) on a ranged read."""
    content_range = resp.get("ContentRange")
    if content_range and "/" in content_range:
        total = content_range.rsplit("/", 1)[1]
        if total.isdigit():
            return int(total)
    return int(resp.get("ContentLength", read))


def _list_objects_v2(params: dict[str, Any]) -> Callable[[AioBaseClient], Awaitable[Any]]:
    """One ListObjectsV2 page request, bound to its own copy of the parameters."""
    return lambda client: client.list_objects_v2(**params)
