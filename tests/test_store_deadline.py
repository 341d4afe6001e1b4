"""Every S3 request has an overall deadline, not only botocore's per-read timeout: a request the
network holds (a stuck or trickling answer) is cancelled and tried again, so one slow object
never holds its caller for longer than the deadline."""

from __future__ import annotations

import uuid

from slime_stoa.protocol.store.retry import RetryPolicy
from slime_stoa.protocol.store.s3 import S3Store
from tests.faultproxy import FaultyProxy
from tests.s3server import LocalS3Server


def _store(server: LocalS3Server, bucket: str, endpoint: str) -> S3Store:
    return S3Store(
        bucket=bucket, prefix=f"deadline-{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, region=server.region,
        credentials=server.credentials(), url="s3://deadline", retry=RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.01),
        read_timeout=600, request_deadline_s=0.5,
    )


async def test_a_held_get_and_a_held_list_are_cut_at_the_deadline_and_tried_again(
    s3_server: LocalS3Server, s3_bucket: str
) -> None:
    upstream = int(s3_server.endpoint_url.rsplit(":", 1)[1])
    async with FaultyProxy(upstream) as proxy, _store(s3_server, s3_bucket, proxy.endpoint) as store:
        await store.put("a/record", b"payload")
        for method, call in (
            ("GET", lambda: _read(store)),  # a read of known length, as record downloads are
            ("GET", lambda: _listed(store)),  # ListObjectsV2 is a GET of the bucket
        ):
            held = proxy.hold(lambda m, path, method=method: m == method)
            result = await call()
            # The first try was held (never answered: a 600 s read timeout would wait on);
            # the deadline cut it and the second try answered.
            assert held.hit.is_set() and not held.go.is_set()
            assert result in (b"payload", ["a/record"])
            held.drop()


async def test_a_trickled_whole_object_get_is_cut_at_the_deadline_and_tried_again(
    s3_server: LocalS3Server, s3_bucket: str
) -> None:
    """A GET of unknown length (a manifest, a pointer: read whole) has a deadline too: its
    headers within `request_deadline_s`, its body at the slow uplink's rate from there."""
    upstream = int(s3_server.endpoint_url.rsplit(":", 1)[1])
    async with FaultyProxy(upstream) as proxy, _store(s3_server, s3_bucket, proxy.endpoint) as store:
        await store.put("a/manifest", b"payload")
        held = proxy.hold(lambda m, path: m == "GET")
        result = await store.get("a/manifest")
        assert held.hit.is_set() and not held.go.is_set()  # the held try was cut, the next answered
        assert result is not None and result.data == b"payload"
        held.drop()
        # one byte every 0.2 s: the ~300-byte answer would take a minute; the try is cut and the
        # second one, untrickled, answers
        trickle = proxy.trickle(lambda m, path: m == "GET" and path.endswith("/a/manifest"), 0.2)
        result = await store.get("a/manifest")
        assert trickle.hits == 1 and result is not None and result.data == b"payload"


async def _read(store: S3Store) -> bytes:
    result = await store.get("a/record", length=len(b"payload"))
    assert result is not None
    return result.data


async def _listed(store: S3Store) -> list[str]:
    return [info.key async for info in store.list("a/")]


def test_the_deadline_grows_with_the_bytes_a_try_moves(s3_server: LocalS3Server, s3_bucket: str) -> None:
    store = _store(s3_server, s3_bucket, s3_server.endpoint_url)
    assert store.deadline(0) == 0.5
    assert store.deadline(64 << 20) == 0.5 + 1024  # 64 MiB at 64 KiB/s
    assert store.deadline(None) is None  # a read of unknown length: its headers' deadline, then its length's
