"""The S3 backend's connection: one aiobotocore client per store, and requests through it.

botocore's own retries are off: every request goes through `RetryPolicy` (`S3Connection._call`),
and its errors come out as the store's (`StoreConfigError`, `PreconditionFailed`, `NotFound`,
`StoreError`) with advice that names the endpoint, the bucket and the credentials.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

import aiohttp
from aiobotocore.client import AioBaseClient
from aiobotocore.config import AioConfig
from aiobotocore.httpsession import AIOHTTPSession
from aiobotocore.session import get_session
from botocore.exceptions import ClientError, SSLError

from . import s3_list
from .base import NotFound, PreconditionFailed, ServerDate, StoreConfigError, StoreError
from .credentials import Credentials, default_env_file
from .retry import RetryPolicy, describe_error, with_retries
from .s3_errors import (
    CREDENTIAL_CODES,
    ClientClosedInFlight,
    error_code,
    error_message,
    error_status,
    failure_advice,
    is_retryable,
)

T = TypeVar("T")
log = logging.getLogger(__name__)


def parse_http_date(value: object) -> float | None:
    """Seconds since the epoch of an HTTP `Date` header; None when absent or unreadable."""
    if not isinstance(value, str):
        return None
    try:
        parsed = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return parsed.timestamp() if parsed.tzinfo is not None else None


def unquote_etag(etag: str) -> str:
    return etag.strip().removeprefix("W/").strip('"')


def quote_etag(etag: str) -> str:
    return f'"{unquote_etag(etag)}"'


class _ObservedRequest(aiohttp.ClientRequest):
    """aiohttp's request, whose body-writing task never ends with an exception nobody retrieves.

    aiohttp sends a request body (every PUT: botocore asks for `100-continue`) from a task of
    its own. When the connection is already closing as that task starts (a store outage: the
    endpoint accepts and drops), the task fails with "Cannot write to closing transport" after
    closing the connection, and nothing awaits it: asyncio then logs "Task exception was never
    retrieved" with a traceback, once per request. The request itself fails on the closed
    connection (and goes through `RetryPolicy`), so the writer's error is observed here, at
    debug level, and nowhere else."""

    async def write_bytes(self, *args: Any, **kwargs: Any) -> None:
        try:
            await super().write_bytes(*args, **kwargs)
        except Exception as exc:  # not a cancellation: that one must go on
            log.debug("request body to %s not sent: %r", self.url.host, exc)


class _OneShotHTTPSession(AIOHTTPSession):
    """aiobotocore's HTTP session, minus aiohttp's hidden resend of idempotent requests, with
    `_ObservedRequest` for requests.

    aiohttp silently resends a PUT once when the connection drops before the answer. For a
    conditional PUT that resend can meet our own landed write and turn success into a 412 that
    `S3Writer._conditional` cannot tell from a lost race. Every retry must go through `RetryPolicy`.
    """

    async def _get_session(self, proxy_url: str | None) -> aiohttp.ClientSession:
        session = await super()._get_session(proxy_url)
        if hasattr(session, "_retry_connection"):  # aiohttp >= 3.9 (private flag)
            session._retry_connection = False
        session._request_class = _ObservedRequest
        return session


class S3Connection:
    """The client for `bucket` at `endpoint_url` (None: AWS S3 in `region`), opened on first use.

    `max_concurrency` (requests in flight at once) sizes the connection pool.
    """

    def __init__(
        self,
        *,
        bucket: str,
        endpoint_url: str | None,
        region: str,
        credentials: Credentials | None,
        url: str,
        retry: RetryPolicy,
        max_concurrency: int,
        connect_timeout: float,
        read_timeout: float,
        request_deadline_s: float = 60.0,
        min_rate_bytes_s: float = 64 << 10,
    ) -> None:
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.region = region
        self.credentials = credentials
        self.url = url
        self.retry = retry
        self.max_concurrency = max_concurrency
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        # The per-read timeout restarts with every byte: a server (or proxy) trickling one byte
        # every few seconds never trips it. Each try also has an overall deadline: this long,
        # plus its payload's bytes at `min_rate_bytes_s` (a slow uplink still finishes).
        self.request_deadline_s = request_deadline_s
        self.min_rate_bytes_s = min_rate_bytes_s
        self._client: AioBaseClient | None = None
        self._stack: AsyncExitStack | None = None
        self._lock = asyncio.Lock()
        self.last_date: ServerDate | None = None  # the Date of the newest answer (errors too)

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

    async def _s3(self) -> AioBaseClient:
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
            client = await stack.enter_async_context(
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
        client.meta.events.register("after-call.s3", self._saw_answer)
        client.meta.events.register(s3_list.EVENT, s3_list.read_list_answer)  # LIST pages read in one C pass
        self._client, self._stack = client, stack

    def _saw_answer(self, http_response: Any = None, **_: Any) -> None:
        """Keep the `Date` of every answer (an error's too): the workers' clock correction."""
        date = parse_http_date(getattr(http_response, "headers", {}).get("Date"))
        if date is not None:
            self.last_date = ServerDate(server_s=date, monotonic_s=time.monotonic())

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    # -- calls and errors --------------------------------------------------------------------
    def _where(self, action: str, key: str | None) -> str:
        target = f"{key!r} in {self.url}" if key is not None else self.url
        return f"{action} {target} (endpoint {self._endpoint})"

    def _advice(self, exc: BaseException) -> str:
        return failure_advice(exc, endpoint=self._endpoint, url=self.url)

    async def _call(
        self,
        action: str,
        key: str | None,
        fn: Callable[[AioBaseClient], Awaitable[T]],
        *,
        cas: bool = False,
        size: int | None = 0,
    ) -> T:
        """Run one S3 request with retries, mapping its errors onto the store's.

        Each try must finish within `deadline(size)` (`size`: the bytes it moves; None: unknown,
        no deadline), else it is cancelled and counts as a timeout (retried like one).

        Every try takes the current client: a try that failed because `close()` closed its client
        meanwhile fails as `ClientClosedInFlight` (a server's answer stays what it is), and the next
        try opens a fresh client, as any call after `close()` does."""

        limit = self.deadline(size)

        async def attempt() -> T:
            client = await self._s3()
            try:
                async with asyncio.timeout(limit):
                    return await fn(client)
            except Exception as exc:
                if client is not self._client and not isinstance(exc, ClientError):  # closed under the request
                    raise ClientClosedInFlight(
                        f"the store's client was closed while the request was in flight ({describe_error(exc)})"
                    ) from exc
                raise

        try:
            return await with_retries(
                attempt,
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

    def deadline(self, size: int | None) -> float | None:
        """The most seconds one try of a request moving `size` bytes may take (None: no limit)."""
        return None if size is None else self.request_deadline_s + size / self.min_rate_bytes_s

    def _map_error(self, exc: ClientError, action: str, key: str | None, *, cas: bool) -> StoreError:
        code, status, where = error_code(exc), error_status(exc), self._where(action, key)
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
        if code in CREDENTIAL_CODES or status in (401, 403):
            creds = str(self.credentials) if self.credentials else "no credentials"
            return StoreConfigError(
                f"{where}: access refused ({code or status}); check the credentials ({creds}): "
                f"the access key id, the secret key, and that they may read and write bucket "
                f"{self.bucket!r} (if they are right, check this machine's clock)"
            )
        if code in ("NoSuchKey", "NotFound", "404") or status == 404:
            return NotFound(f"{key!r} not found in {self.url}")
        return StoreError(f"{where}: {code or 'error'} (HTTP {status}): {error_message(exc)}")
