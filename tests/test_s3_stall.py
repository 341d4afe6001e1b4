"""S3 requests whose client or connection goes away under them, and what a failure is called.

aiobotocore fails every request on a closed client with `HTTPClientError: An HTTP Client raised
an unhandled exception: 'NoneType' object has no attribute 'get'` (its HTTP session is gone): a
request in flight when its store is closed is retried on a fresh client, never on the closed one.
A kept-alive connection the server reset (botocore: "Could not connect to the endpoint URL") is
named a dropped connection and retried on a fresh one; only a connection that could not be made
at all advises checking the endpoint URL.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    HTTPClientError,
    ReadTimeoutError,
)

from slime_stoa.protocol.store.base import StoreUnavailable
from slime_stoa.protocol.store.retry import RetryPolicy
from slime_stoa.protocol.store.s3 import S3Store
from slime_stoa.protocol.store.s3_errors import (
    ClientClosedInFlight,
    failure_advice,
    failure_kind,
    is_retryable,
)
from tests.faultproxy import FaultyProxy
from tests.s3server import LocalS3Server, random_bucket_name

ENDPOINT = "http://127.0.0.1:9000"
URL = f"s3://b/p?endpoint={ENDPOINT}"
CLOSED_SESSION = AttributeError("'NoneType' object has no attribute 'get'")


@pytest.fixture
async def proxied(s3_server: LocalS3Server, s3_bucket: str) -> AsyncIterator[tuple[FaultyProxy, S3Store]]:
    """A store on a fresh prefix of the session bucket, through a `FaultyProxy`."""
    port = int(s3_server.endpoint_url.rsplit(":", 1)[1])
    async with FaultyProxy(port) as proxy:
        prefix = f"t/{random_bucket_name('stall')}"
        store = S3Store(
            bucket=s3_bucket, prefix=prefix, endpoint_url=proxy.endpoint, region=s3_server.region,
            credentials=s3_server.credentials(), url=f"s3://{s3_bucket}/{prefix}?endpoint={proxy.endpoint}",
            retry=RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.01),
        )
        async with store:
            yield proxy, store


async def test_a_request_in_flight_when_the_store_closes_is_retried_on_a_fresh_client(
    proxied: tuple[FaultyProxy, S3Store],
) -> None:
    proxy, store = proxied
    await store.put("k", b"payload")
    held = proxy.hold(lambda method, _path: method == "GET")
    get = asyncio.create_task(store.get("k"))
    await asyncio.wait_for(held.hit.wait(), timeout=10)  # the GET is at the proxy, unanswered
    await store.close()  # its client goes away under it
    held.release()
    result = await asyncio.wait_for(get, timeout=10)
    assert result is not None and result.data == b"payload"
    assert proxy.requests["GET"] >= 2  # the held GET, then the retry through a fresh client


async def test_a_kept_alive_connection_the_server_reset_is_named_so_and_retried(
    proxied: tuple[FaultyProxy, S3Store],
) -> None:
    """A connection reset while it idled in the pool (as a server's keep-alive timeout does while
    the client's event loop is blocked) and reused before the loop saw the reset: botocore calls
    that "Could not connect to the endpoint URL"; the store says what it is, and the next try
    takes a fresh connection. Deterministic: nothing yields to the event loop between the reset
    and the reuse."""
    proxy, store = proxied
    once = S3Store(
        bucket=store.bucket, prefix=store.prefix, endpoint_url=proxy.endpoint, region=store.region,
        credentials=store.credentials, url=store.url, retry=RetryPolicy(attempts=1),
    )
    async with once:
        await once.put("k", b"x")  # leaves its connection in the pool
        proxy.set_down()  # resets every open connection (the pooled one too)...
        proxy.set_up()  # ...and accepts new ones
        with pytest.raises(StoreUnavailable) as info:
            await once.get("k")
        message = str(info.value)
        assert "closed or reset the connection" in message and "check the endpoint URL" not in message, message
        assert (await once.get("k")) is not None  # the reset connection left the pool
    await store.get("k")  # warm the pool of the store with retries
    proxy.set_down()
    proxy.set_up()
    result = await store.get("k")  # its second try takes a fresh connection
    assert result is not None and result.data == b"x"


async def test_a_closed_store_answers_again(proxied: tuple[FaultyProxy, S3Store]) -> None:
    _, store = proxied
    await store.put("k", b"x")
    await store.close()
    result = await store.get("k")
    assert result is not None and result.data == b"x"


# -- what a failure is called -----------------------------------------------------------------------
def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


@pytest.mark.parametrize(
    ("exc", "kind", "says", "never"),
    [
        (
            ClientClosedInFlight("closed"),
            "client_closed",
            "closed (close()) while the request was in flight",
            "endpoint URL",
        ),
        (
            ConnectionClosedError(endpoint_url=ENDPOINT, error=aiohttp.ServerDisconnectedError(), request=None),
            "dropped",
            "closed or reset the connection before a whole answer",
            "endpoint URL",
        ),
        (  # a kept-alive connection the server reset: botocore says "Could not connect"
            EndpointConnectionError(endpoint_url=ENDPOINT, error=aiohttp.ClientOSError(104, "Connection reset by peer")),
            "dropped",
            "closed or reset the connection",
            "endpoint URL",
        ),
        (HTTPClientError(error=CLOSED_SESSION), "http_client", "the HTTP client failed", "endpoint URL"),
        (
            EndpointConnectionError(endpoint_url=ENDPOINT, error=ConnectionRefusedError(111, "refused")),
            "unreachable",
            "check the endpoint URL",
            "kept",
        ),
        (EndpointConnectionError(endpoint_url=ENDPOINT, error=OSError("no route")), "unreachable", "check the endpoint URL", "kept"),
        (ConnectionRefusedError(111, "refused"), "unreachable", "could not reach", "kept"),
        (ReadTimeoutError(endpoint_url=ENDPOINT, error=TimeoutError()), "timeout", "did not answer in time", "closed"),
        (ConnectTimeoutError(endpoint_url=ENDPOINT, error=TimeoutError()), "timeout", "did not answer in time", "closed"),
        (TimeoutError(), "timeout", "did not answer in time", "closed"),
        (_client_error("SlowDown", 503), "answered", "kept answering SlowDown", "endpoint URL"),
    ],
)
def test_each_failure_is_retried_and_named_for_what_it_is(exc: Exception, kind: str, says: str, never: str) -> None:
    assert is_retryable(exc)
    assert failure_kind(exc) == kind
    advice = failure_advice(exc, endpoint=ENDPOINT, url=URL)
    assert says in advice and never not in advice, advice
