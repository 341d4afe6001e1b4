"""S3-backend specifics against a real S3 server (SeaweedFS on loopback), plus the retry policy.

The behaviour shared with the local backend is covered by the conformance suite; these tests pin
what only the S3 path has: HTTP status mapping, multipart uploads, signatures, endpoints.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import sys
from collections.abc import AsyncIterator

import pytest

from slime_stoa.protocol.store.base import (
    NotFound,
    PreconditionFailed,
    StoreConfigError,
    StoreUnavailable,
)
from slime_stoa.protocol.store.credentials import Credentials
from slime_stoa.protocol.store.retry import RetryPolicy, with_retries
from slime_stoa.protocol.store.s3 import S3Store
from tests.s3server import LocalS3Server, free_ports, random_bucket_name

MiB = 1 << 20
FAST_RETRY = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.01)
MULTIPART = {"multipart_threshold": 5 * MiB + 1, "part_size": 5 * MiB}


# `s3_server` and `s3_bucket` (session-wide) come from conftest.py.
@pytest.fixture
async def s3store(s3_server: LocalS3Server, s3_bucket: str) -> AsyncIterator[S3Store]:
    """A fresh prefix in the session bucket; small multipart threshold; fast retries."""
    async with s3_server.store(s3_bucket, f"t/{random_bucket_name('p')}", retry=FAST_RETRY, **MULTIPART) as s:
        yield s


def _payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


async def _stream(data: bytes, chunk: int = 3 * MiB + 17) -> AsyncIterator[bytes]:
    for start in range(0, len(data), chunk):
        yield data[start : start + chunk]
        await asyncio.sleep(0)


def _http_status(exc: BaseException) -> int | None:
    cause = exc.__cause__
    response = getattr(cause, "response", None)
    return response["ResponseMetadata"]["HTTPStatusCode"] if response else None


# -- retry policy (pure) -----------------------------------------------------------------------
def test_retry_delays_are_bounded_and_jittered() -> None:
    policy = RetryPolicy(attempts=8, base_delay=0.1, max_delay=1.0)
    runs = [list(policy.delays(random.Random(seed))) for seed in range(50)]
    assert all(len(run) == 7 for run in runs)
    for n in range(7):
        column = [run[n] for run in runs]
        cap = min(1.0, 0.1 * 2**n)
        assert all(0.0 <= d <= cap for d in column)
        assert len(set(column)) > 40  # jittered, not a fixed schedule
    assert max(d for run in runs for d in run) <= 1.0
    assert sum(min(1.0, 0.1 * 2**n) for n in range(7)) == pytest.approx(policy.worst_case_seconds())
    assert list(RetryPolicy(attempts=1).delays(random.Random(0))) == []
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


async def test_with_retries_retries_only_retryable_errors() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise TimeoutError("slow")
        return "ok"

    policy = RetryPolicy(attempts=3, base_delay=0.0, max_delay=0.0)

    def retry_timeouts(exc: BaseException) -> bool:
        return isinstance(exc, TimeoutError)

    assert await with_retries(flaky, policy=policy, is_retryable=retry_timeouts, describe="op") == "ok"

    async def failing() -> None:
        raise TimeoutError("still slow")

    with pytest.raises(StoreUnavailable, match=r"GET x failed after 3 attempts.*still slow.*check it"):
        await with_retries(
            failing, policy=policy, is_retryable=retry_timeouts, describe="GET x", advice=lambda e: "check it"
        )

    async def broken() -> None:
        raise KeyError("not retryable")

    calls = 0
    with pytest.raises(KeyError):
        await with_retries(broken, policy=policy, is_retryable=retry_timeouts, describe="op")


# -- the server itself -------------------------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
async def test_server_stays_on_loopback(s3_server: LocalS3Server, s3store: S3Store) -> None:
    await s3store.put("probe", b"x")  # some traffic first
    listening = s3_server.listening_addresses()
    assert listening, "found no listening sockets"
    assert {ip for ip, _ in listening} == {"127.0.0.1"}
    assert set(s3_server.remote_addresses()) <= {"127.0.0.1"}
    assert s3_server.startup_seconds is not None


# -- conditional writes ------------------------------------------------------------------------
async def test_second_put_if_absent_is_refused_with_412(s3store: S3Store) -> None:
    etag = await s3store.put_if_absent("runs/r/run.json", b'{"a":1}')
    with pytest.raises(PreconditionFailed) as info:
        await s3store.put_if_absent("runs/r/run.json", b'{"a":2}')
    assert _http_status(info.value) == 412
    assert (await s3store.get_bytes("runs/r/run.json")) == b'{"a":1}'
    assert (await s3store.head("runs/r/run.json")).etag == etag


async def test_if_match_on_a_missing_key_is_precondition_failed(s3store: S3Store) -> None:
    with pytest.raises(PreconditionFailed):
        await s3store.put("nothing/here", b"x", if_match="0123456789abcdef0123456789abcdef")
    with pytest.raises(PreconditionFailed):
        await s3store.put("nothing/big", _payload(6 * MiB), if_match="0123456789abcdef0123456789abcdef")
    assert not await s3store.exists("nothing/here")
    assert not await s3store.exists("nothing/big")


async def test_concurrent_cas_has_exactly_one_winner(s3store: S3Store) -> None:
    base = await s3store.put("current.json", b"v0")
    results = await asyncio.gather(
        *(s3store.put("current.json", f"v1-{i}".encode(), if_match=base) for i in range(6)),
        return_exceptions=True,
    )
    winners = [r for r in results if isinstance(r, str)]
    assert len(winners) == 1
    assert all(isinstance(r, PreconditionFailed) for r in results if not isinstance(r, str))
    assert (await s3store.head("current.json")).etag == winners[0]


async def test_multipart_put_if_absent_and_cas(
    s3_server: LocalS3Server, s3_bucket: str, s3store: S3Store
) -> None:
    first = _payload(2 * 5 * MiB + 123, seed=1)
    etag = await s3store.put_if_absent("anchors/1/shard.bin", _stream(first))
    assert etag.endswith("-3")  # three parts, and the ETag S3 computes for them
    assert (await s3store.head("anchors/1/shard.bin")).etag == etag
    assert await s3store.get_bytes("anchors/1/shard.bin") == first

    with pytest.raises(PreconditionFailed) as info:
        await s3store.put_if_absent("anchors/1/shard.bin", _payload(6 * MiB, seed=2))
    assert _http_status(info.value) == 412

    second = _payload(6 * MiB, seed=3)
    with pytest.raises(PreconditionFailed):
        await s3store.put("anchors/1/shard.bin", second, if_match="0" * 32 + "-3")
    new_etag = await s3store.put("anchors/1/shard.bin", second, if_match=etag)
    assert new_etag != etag and new_etag.endswith("-2")
    assert await s3store.get_bytes("anchors/1/shard.bin") == second

    # Refused uploads were aborted, not left behind.
    pending = s3_server.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u for u in pending if u["Key"].startswith(s3store.prefix)] == []


async def test_small_stream_is_a_single_put(s3store: S3Store) -> None:
    data = _payload(MiB + 5, seed=4)
    etag = await s3store.put_if_absent("records/small", _stream(data, chunk=100_000))
    assert "-" not in etag
    assert await s3store.get_bytes("records/small") == data
    assert await s3store.put_if_absent("records/empty", _stream(b"")) == "d41d8cd98f00b204e9800998ecf8427e"


class _LosingProxy:
    """A TCP proxy that forwards the first connection's request but loses the server's answer.

    It stands in for a network that drops a response after the server applied the request.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.dropped = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> _LosingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(self._serve(reader, writer))
        self._tasks.add(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        drop = self.dropped == 0
        self.dropped += drop
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer, drop=drop))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            up_writer.close()

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, drop: bool = False) -> None:
        while chunk := await src.read(1 << 16):
            if drop and not chunk.startswith(b"HTTP/1.1 100"):  # the answer: lose it, hang up
                dst.close()
                return
            dst.write(chunk)
            await dst.drain()
        dst.close()


async def test_conditional_write_whose_answer_was_lost_still_succeeds(
    s3_server: LocalS3Server, s3_bucket: str, s3store: S3Store
) -> None:
    """The retry of a landed put-if-absent / CAS sees 412 on its own write: that is a success."""
    upstream = int(s3_server.endpoint_url.rsplit(":", 1)[1])
    for conditional in ("absent", "cas"):
        key = f"lost-answer/{conditional}"
        etag = None if conditional == "absent" else await s3store.put(key, b"old")
        async with _LosingProxy(upstream) as proxy:
            lossy = S3Store(
                bucket=s3_bucket, prefix=s3store.prefix, endpoint_url=f"http://127.0.0.1:{proxy.port}",
                region=s3_server.region, credentials=s3_server.credentials(), url="s3://lossy",
                retry=RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.01),
            )
            async with lossy:
                new = await lossy.cas(key, b"new", etag)
        assert proxy.dropped == 1
        assert (await s3store.head(key)).etag == new
        assert await s3store.get_bytes(key) == b"new"


# -- reads -------------------------------------------------------------------------------------
async def test_ranged_get(s3store: S3Store) -> None:
    data = bytes(range(256)) * 4
    etag = await s3store.put("blob", data)
    part = await s3store.get("blob", offset=10, length=20)
    assert part is not None and part.data == data[10:30] and part.size == len(data) and part.etag == etag
    tail = await s3store.get("blob", offset=1000)
    assert tail is not None and tail.data == data[1000:] and tail.size == len(data)
    past = await s3store.get("blob", offset=5000, length=10)
    assert past is not None and past.data == b"" and past.size == len(data)
    empty = await s3store.get("blob", offset=3, length=0)
    assert empty is not None and empty.data == b"" and empty.etag == etag
    with pytest.raises(NotFound):
        await s3store.get("no-such-blob", offset=1, length=2)


async def test_if_none_match_answers_304_as_none(s3store: S3Store) -> None:
    etag = await s3store.put("current.json", b'{"version": 1}')
    assert await s3store.get("current.json", if_none_match=etag) is None
    changed = await s3store.get("current.json", if_none_match="0" * 32)
    assert changed is not None and changed.data == b'{"version": 1}'
    await s3store.put("current.json", b'{"version": 2}', if_match=etag)
    moved = await s3store.get("current.json", if_none_match=etag)
    assert moved is not None and moved.data == b'{"version": 2}'


async def test_list_pages_in_key_order_relative_to_prefix(s3store: S3Store) -> None:
    s3store._list_page_size = 2  # force several ListObjectsV2 pages
    keys = [f"rollouts/w{w}/{seq:04d}.bin" for w in range(2) for seq in range(3)]
    for key in reversed(keys):
        await s3store.put(key, key.encode())
    await s3store.put("other/x", b"x")
    listed = [info.key async for info in s3store.list("rollouts/")]
    assert listed == sorted(keys)
    after = [info.key async for info in s3store.list("rollouts/", start_after="rollouts/w0/0001.bin")]
    assert after == sorted(keys)[2:]
    assert [i.key async for i in s3store.list("rollouts/w1/", start_after="rollouts/")] == sorted(keys)[3:]
    assert [i.key async for i in s3store.list("rollouts/w0/", start_after="rollouts/w1")] == []
    (info,) = [i async for i in s3store.list("rollouts/w1/0002")]
    assert info.size == len(keys[-1]) and info.etag == (await s3store.head(keys[-1])).etag
    await s3store.delete("other/x")
    await s3store.delete("other/x")  # deleting a missing key is fine
    assert [i.key async for i in s3store.list("other/")] == []


# -- misconfiguration --------------------------------------------------------------------------
async def test_wrong_secret_is_a_config_error_naming_credentials(
    s3_server: LocalS3Server, s3_bucket: str
) -> None:
    bad = Credentials(s3_server.access_key, "not-the-secret-" + "x" * 20, source="test env file")
    async with s3_server.store(s3_bucket, "p", credentials=bad, retry=FAST_RETRY) as s:
        for attempt in (lambda: s.get("k"), lambda: s.put("k", b"x"), lambda: s.head("k")):
            with pytest.raises(StoreConfigError) as info:
                await attempt()
            message = str(info.value)
            assert "credentials" in message and "test env file" in message
            assert bad.secret_access_key not in message and s3_server.secret_key not in message


async def test_missing_bucket_is_a_config_error(s3_server: LocalS3Server) -> None:
    missing = random_bucket_name("missing")
    async with s3_server.store(missing, "p", retry=FAST_RETRY) as s:
        for attempt in (lambda: s.get("k"), lambda: s.put_if_absent("k", b"x"), lambda: s.delete("k")):
            with pytest.raises(StoreConfigError, match=f"bucket '{missing}' does not exist"):
                await attempt()
        with pytest.raises(StoreConfigError, match="does not exist"):
            [i async for i in s.list()]


async def test_unreachable_endpoint_is_unavailable_quickly() -> None:
    (port,) = free_ports(1)  # nothing listens there
    endpoint = f"http://127.0.0.1:{port}"
    creds = Credentials("AKIDEXAMPLE", "secret-example", source="test")
    s = S3Store(
        bucket="some-bucket", prefix="", endpoint_url=endpoint, region="us-east-1", credentials=creds,
        url=f"s3://some-bucket?endpoint={endpoint}", retry=FAST_RETRY, connect_timeout=1,
    )
    async with s:
        with pytest.raises(StoreUnavailable) as info:
            await s.get("k")
    message = str(info.value)
    assert endpoint in message and "2 attempts" in message and "check the endpoint URL" in message
    assert "secret-example" not in message


async def test_missing_credentials_are_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOA_ENV_FILE", os.devnull)
    s = S3Store(
        bucket="b-b-b", prefix="", endpoint_url="http://127.0.0.1:9", region="us-east-1",
        credentials=None, url="s3://b-b-b", retry=FAST_RETRY,
    )
    async with s:
        with pytest.raises(StoreConfigError, match="AWS_ACCESS_KEY_ID"):
            await s.head("k")


def test_parts_must_be_at_least_5_mib() -> None:
    with pytest.raises(ValueError, match="5 MiB"):
        S3Store(
            bucket="b-b-b", prefix="", endpoint_url=None, region="us-east-1", credentials=None,
            url="s3://b-b-b", part_size=MiB,
        )


def test_free_ports_are_loopback_and_distinct() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
