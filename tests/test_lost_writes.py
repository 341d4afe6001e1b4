"""Writes acknowledged but never stored (`FaultyProxy.swallow_put`: a 200 for a PUT that never
reached the store) are caught where a read-back is cheap: a worker's record stays in its spool
and is uploaded again (`Uploader`: a HEAD after each put), and the trainer's version manifest
and pointer writes are confirmed by a HEAD and written again (`Committer._confirm`)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import numpy as np
import pytest

from macd.uploader import Uploader
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.manifests import Pointer
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig, PublishError
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store.retry import RetryPolicy
from slime_stoa.protocol.store.s3 import S3Store
from tests.faultproxy import FaultyProxy
from tests.s3server import LocalS3Server
from tests.test_spool_uploader import builder, open_spool

from .forged_weights import random_state, step_state


def _s3_store(server: LocalS3Server, bucket: str, endpoint: str) -> S3Store:
    return S3Store(
        bucket=bucket, prefix=f"lost-{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, region=server.region,
        credentials=server.credentials(), url="s3://lost",
        retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.01),
    )


def _upstream(server: LocalS3Server) -> int:
    return int(server.endpoint_url.rsplit(":", 1)[1])


async def test_a_record_acknowledged_but_not_stored_stays_spooled_and_lands(
    s3_server: LocalS3Server, s3_bucket: str, tmp_path: Path
) -> None:
    async with FaultyProxy(_upstream(s3_server)) as proxy, _s3_store(s3_server, s3_bucket, proxy.endpoint) as store:
        spool = open_spool(tmp_path / "spool")
        entry = spool.add(builder())
        data = entry.read()
        swallowed = proxy.swallow_put(lambda m, path: entry.key in path)
        uploader = Uploader(store, spool, retry_delay=0.01, max_retry_delay=0.02)
        assert await uploader.drain() == 0  # acknowledged, not there: kept, held back
        assert swallowed.hits == 1 and spool.depth == 1 and uploader.stats.uploaded == 0
        assert "acknowledged but the bucket does not hold it" in (uploader.stats.last_error or "")
        for _ in range(200):  # bounded by tries: the held entry's backoff is at most 0.02 s
            if await uploader.drain():
                break
            await asyncio.sleep(0.01)
        assert spool.depth == 0 and uploader.stats.uploaded == 1
        assert await store.get_bytes(entry.key) == data
        assert proxy.faults_injected["swallow_put"] == 1
        spool.close()


@pytest.mark.parametrize("lost", ["pointer", "manifest"])
async def test_a_trainer_write_acknowledged_but_not_stored_is_written_again(
    s3_server: LocalS3Server, s3_bucket: str, lost: str
) -> None:
    run, key, rng = "lost-writes", SigningKey.generate(), np.random.default_rng(5)
    layout = RunLayout(run)
    async with FaultyProxy(_upstream(s3_server)) as proxy, _s3_store(s3_server, s3_bucket, proxy.endpoint) as store:
        pub = Publisher(store, run, PublisherConfig(anchor_every=50), key=key)
        first = random_state(rng)
        assert (await pub.publish(first)).version == 0
        if lost == "pointer":
            swallowed = proxy.swallow_put(lambda m, path: path.split("?")[0].endswith("/current.json"))
        else:
            swallowed = proxy.swallow_put(lambda m, path: f"/{layout.versions_prefix}" in path)
        second = step_state(first, rng)
        with pytest.raises(PublishError, match="acknowledged but the bucket does not hold it"):
            await pub.publish(second)
        assert swallowed.hits == 1
        assert Pointer.from_bytes(await store.get_bytes(layout.pointer)).version == 0  # the bucket never moved
        assert (await pub.publish(second)).version == 1  # the same state again: written again
        pointer = Pointer.from_bytes(await store.get_bytes(layout.pointer))
        assert pointer.version == 1 and await store.exists(pointer.manifest)
        assert (await pub.publish(step_state(second, rng))).version == 2  # and on from there
