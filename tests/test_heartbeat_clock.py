"""A worker's heartbeat is stamped by the store's clock (`macd.clock.StoreClock`), like its records:
a Mac whose clock is minutes off writes an `updated_at` the trainer and `stoa fleet` read as now,
not as minutes ahead or behind. The folder store gives no date: there the local clock is used."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from macd.clock import StoreClock
from macd.reporting import Reporter
from slime_stoa.protocol.heartbeat import Heartbeat
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import Store, open_store
from tests.s3server import LocalS3Server

RUN = "clocked"
WORKER = "mac-skew"
#: How far the Mac's clock is off in these tests: far past any tolerance of the test's own.
SKEW_S = 600.0
#: The store's date is whole seconds; the test itself takes a few.
CLOSE_S = 5.0


async def written_beat(store: Store, local_offset_s: float) -> Heartbeat:
    """The heartbeat a reporter on a Mac whose clock is `local_offset_s` off writes, read back."""
    clock = StoreClock(store, local=lambda: time.time() + local_offset_s)
    reporter = Reporter(store, RunLayout(RUN), WORKER, "m", repeat_log_s=60.0, clock=clock)
    await store.exists(RunLayout(RUN).run_manifest)  # the worker's first read: the store answers
    await reporter.write()
    return Heartbeat.from_bytes(await store.get_bytes(RunLayout(RUN).heartbeat(WORKER)))


@pytest.mark.parametrize("offset", [SKEW_S, -SKEW_S], ids=["ahead", "behind"])
async def test_a_skewed_macs_heartbeat_is_stamped_by_the_stores_clock(
    s3_server: LocalS3Server, s3_bucket: str, offset: float
) -> None:
    url = f"s3://{s3_bucket}/beat-{uuid.uuid4().hex[:8]}?endpoint={s3_server.endpoint_url}"
    async with open_store(url, credentials=s3_server.credentials()) as store:
        beat = await written_beat(store, offset)
    assert abs(beat.updated_at - time.time()) < CLOSE_S  # the server shares this machine's clock


async def test_without_a_store_date_the_local_clock_stamps_it(tmp_path: Path) -> None:
    async with open_store(f"file://{tmp_path}") as store:
        beat = await written_beat(store, SKEW_S)
    assert abs(beat.updated_at - (time.time() + SKEW_S)) < CLOSE_S


async def test_a_reporter_uses_its_stores_clock_unless_given_one(tmp_path: Path) -> None:
    async with open_store(f"file://{tmp_path}") as store:
        reporter = Reporter(store, RunLayout(RUN), WORKER, "m", repeat_log_s=60.0)
        assert isinstance(reporter.clock, StoreClock) and reporter.clock.store is store
