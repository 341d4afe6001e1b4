"""What an S3 error says: its code, HTTP status and message, whether another try may help, and
what went wrong in words (`failure_kind`, `failure_advice`)."""

from __future__ import annotations

import asyncio
import socket
from typing import Literal

import aiohttp
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    HTTPClientError,
    IncompleteReadError,
    ResponseStreamingError,
    SSLError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

FailureKind = Literal["answered", "timeout", "client_closed", "dropped", "unreachable", "http_client"]

RETRY_CODES = frozenset(
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
CREDENTIAL_CODES = frozenset(
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


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def error_status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def error_message(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Message", "")) or str(exc)


class ClientClosedInFlight(Exception):
    """A request failed because the store's client was closed (`close()`) while it was in flight.

    aiobotocore then fails every request on that client with `HTTPClientError: ... 'NoneType'
    object has no attribute 'get'` (its HTTP session is gone); another try on a fresh client helps.
    """


class AnswerWithoutETag(Exception):
    """A 200 answer without an ETag header (a proxy or a broken gateway stripped it): without
    it a poller cannot tell the object changed, nor a writer compare-and-swap. Retried like a
    dropped connection: the next answer usually carries it."""


def answer_etag(resp: dict, where: str) -> str:
    """The unquoted ETag of an S3 answer; AnswerWithoutETag when it has none."""
    etag = resp.get("ETag")
    if not isinstance(etag, str) or not etag.strip().removeprefix("W/").strip('"'):
        raise AnswerWithoutETag(f"{where}: the store answered without an ETag (a proxy between here and the store may strip it)")
    return etag.strip().removeprefix("W/").strip('"')


def is_retryable(exc: BaseException) -> bool:
    """Throttling, 5xx, timeouts, dropped connections, an answer without an ETag and a client
    closed under the request: worth another try."""
    if isinstance(exc, (ClientClosedInFlight, AnswerWithoutETag)):
        return True
    if isinstance(exc, ClientError):
        code, status = error_code(exc), error_status(exc)
        if status == 409:
            return code == "ConditionalRequestConflict"
        return code in RETRY_CODES or status == 429 or status >= 500
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


# What a dropped connection looks like: a clean close (botocore's ConnectionClosedError around
# aiohttp's ServerDisconnectedError), a reset (aiohttp's ClientOSError 104, which botocore wraps
# in EndpointConnectionError although the connection existed), or a body cut short.
_DROPPED = (
    ConnectionClosedError,
    ResponseStreamingError,
    IncompleteReadError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientPayloadError,
    aiohttp.ClientOSError,
    ConnectionResetError,
    BrokenPipeError,
    ConnectionAbortedError,
)
# No connection at all: refused, no route, no such host (checked first: aiohttp's
# ClientConnectorError is a ClientOSError too).
_NOT_CONNECTED = (aiohttp.ClientConnectorError, ConnectionRefusedError, socket.gaierror)


def _wrapped(exc: BaseException) -> BaseException | None:
    """The error botocore wrapped (its `error` argument), if any."""
    kwargs = getattr(exc, "kwargs", None)
    inner = kwargs.get("error") if isinstance(kwargs, dict) else None
    return inner if isinstance(inner, BaseException) else None


def failure_kind(exc: BaseException) -> FailureKind:
    """What a failed request met: an error answer, no answer in time, its client closed under it,
    a connection dropped before the whole answer (a kept-alive one the server had closed, say),
    an endpoint it could not connect to, or another failure of the HTTP client."""
    if isinstance(exc, ClientError):
        return "answered"
    if isinstance(exc, asyncio.TimeoutError) or "timeout" in type(exc).__name__.lower():
        return "timeout"  # botocore's ReadTimeoutError and ConnectTimeoutError too
    if isinstance(exc, ClientClosedInFlight):
        return "client_closed"
    for err in (_wrapped(exc), exc):
        if isinstance(err, _NOT_CONNECTED):
            return "unreachable"
        if isinstance(err, _DROPPED):
            return "dropped"
    if isinstance(exc, (BotoConnectionError, aiohttp.ClientConnectionError, ConnectionError)):
        return "unreachable"
    return "http_client"


def failure_advice(exc: BaseException, *, endpoint: str, url: str) -> str:
    """What the user can do about a request to `endpoint` (of store `url`) that kept failing with `exc`."""
    kind = failure_kind(exc)
    if kind == "answered":
        assert isinstance(exc, ClientError)
        answer = error_code(exc) or error_status(exc)
        return f"{endpoint} kept answering {answer}: it is overloaded or failing; try again later"
    if kind == "timeout":
        return f"{endpoint} did not answer in time: check the network and the endpoint URL"
    if kind == "client_closed":
        return (
            "the store's client was closed (close()) while the request was in flight, at every try: "
            "close a store only after its requests have finished"
        )
    if kind == "dropped":
        return (
            f"{endpoint} closed or reset the connection before a whole answer (a kept-alive connection "
            f"it had already dropped, a restart, or a cut on the way): the server or the network is "
            f"failing; try again later"
        )
    if kind == "unreachable":
        return f"could not reach {endpoint}: check the endpoint URL in {url} and the network"
    return f"the HTTP client failed on a request to {endpoint} before any answer; the last error says how"
