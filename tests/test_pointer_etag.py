"""The pointer's ETag: a subscriber polls with the ETag of the last pointer that VERIFIED, never
with one an answer that failed carried (a truncated answer may name the genuine object's ETag:
caching it would skip the genuine pointer until the next publish); an S3 answer without an
ETag is one retried error, never a raw KeyError."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.publisher import Publisher
from slime_stoa.protocol.pulse.subscriber import Subscriber, SyncError, WeightsRefused
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import StoreUnavailable, open_store
from slime_stoa.protocol.store.retry import RetryPolicy
from slime_stoa.protocol.store.s3 import S3Store
from tests.faultproxy import FaultyProxy
from tests.s3server import LocalS3Server

from .forged_weights import random_state, step_state

RUN = "etag-test"


async def test_a_truncated_pointer_answer_carrying_the_genuine_etag_does_not_poison_the_poll(tmp_path: Path) -> None:
    root = tmp_path / "bucket"
    root.mkdir()
    key = SigningKey.generate()
    rng = np.random.default_rng(3)
    async with open_store(f"file://{root}") as store:
        pub = Publisher(store, RUN, key=key)
        await pub.publish(random_state(rng))
        sub = Subscriber(store, RUN, trust=RunTrust(RUN, key.public))
        path = root / RunLayout(RUN).pointer
        genuine = path.read_bytes()
        etag = (await store.head(RunLayout(RUN).pointer)).etag
        # The answer is cut short but names the genuine ETag (the folder store keeps an object's
        # ETag beside its bytes: rewriting the bytes in place keeps it, as a cache serving a
        # truncated body under the object's ETag would).
        path.write_bytes(genuine[: len(genuine) // 2])
        assert (await store.head(RunLayout(RUN).pointer)).etag == etag
        with pytest.raises((SyncError, WeightsRefused)):
            await sub.sync()
        assert await sub.sync() is None  # the same failed answer is reported once
        assert sub.version is None
        path.write_bytes(genuine)  # the whole answer again, still under the same ETag
        result = await sub.sync()  # polled without the failed answer's ETag: read, verified, applied
        assert result is not None and sub.version == 0


def _s3_store(server: LocalS3Server, bucket: str, endpoint: str, attempts: int) -> S3Store:
    return S3Store(
        bucket=bucket, prefix=f"etag-{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, region=server.region,
        credentials=server.credentials(), url="s3://etag",
        retry=RetryPolicy(attempts=attempts, base_delay=0.01, max_delay=0.01),
    )


async def test_an_answer_without_an_etag_is_retried_then_one_line(s3_server: LocalS3Server, s3_bucket: str) -> None:
    upstream = int(s3_server.endpoint_url.rsplit(":", 1)[1])
    rng = np.random.default_rng(4)
    async with FaultyProxy(upstream) as proxy, _s3_store(s3_server, s3_bucket, proxy.endpoint, 3) as store:
        pub = Publisher(store, RUN)
        states = [random_state(rng)]
        await pub.publish(states[0])
        pointer_get = proxy.strip_etag(lambda m, path: m == "GET" and path.split("?")[0].endswith("/current.json"))
        sub = Subscriber(store, RUN)
        result = await sub.sync()  # the first answer had no ETag: tried again, and synced
        assert pointer_get.hits == 1 and proxy.faults_injected["strip_etag"] == 1
        assert result is not None and sub.version == 0
        # An answer that never carries one: every try fails, then one StoreError line naming why.
        states.append(step_state(states[0], rng))
        await pub.publish(states[1])
        proxy.strip_etag(lambda m, path: m == "GET" and path.split("?")[0].endswith("/current.json"), times=3)
        with pytest.raises(StoreUnavailable) as raised:
            await sub.sync()
        message = str(raised.value)
        assert "without an ETag" in message and "\n" not in message
        assert proxy.faults_injected["strip_etag"] == 4 and sub.version == 0
        assert (await sub.sync()) is not None and sub.version == 1  # answers with ETags again: synced

