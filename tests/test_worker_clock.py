"""A Mac whose clock is off: with the store's clock (macd/clock.py) every record it makes is
admitted, found by the tail like a punctual worker's; without a store date (the folder store) the
limits discovery.py documents hold, and what is refused for the clock is counted for the worker
and shown by `stoa fleet`.

`skew_report` is the measurement the security report takes (`skew_rejected`: records of the
corrected workers refused, 0 within the tolerance)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from macd.clock import DATE_RESOLUTION_S, StoreClock, corrected_now
from macd.spool import Spool
from macd.uploader import Uploader
from slime_stoa.cli import fleet_cmd
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.records import encode_group
from slime_stoa.protocol.store import ServerDate, Store, open_store
from slime_stoa.trainer.consumer import RolloutConsumer
from tests.s3server import LocalS3Server
from tests.test_consumer import RUN, Tiny, config, make_group, setup_run, tiny, upload

__all__ = ["tiny"]  # the session fixture

SKEWED = "mac-skew"
PUNCTUAL = "mac-ok"
MINUTE = 60.0
SKEWS = {"+10min": 10 * MINUTE, "-10min": -10 * MINUTE, "-40min": -40 * MINUTE}
PER_WORKER = 6
# The deep sweep often, so a late record is found within a few polls; every batch waits at most
# this long (a bound on a failure, never a measure of speed).
CONSUMER = dict(late_sweep_interval_s=0.3, wait_timeout_s=60.0)


async def skewed_worker(
    worker_store: Store, spool_dir: Path, tiny: Tiny, offset_s: float, n: int = PER_WORKER, *, after_s: float = 0.0
) -> None:
    """A worker whose local clock is `offset_s` off makes `n` records the way macd does (the
    spool's clock stamps the key and the record's times) and uploads them. Its first reads go on
    until the store's date (whole seconds) is past `after_s`: a key stamped from a date read in
    the same second as the trainer's last listing may sort up to half a second behind it."""
    clock = StoreClock(worker_store, local=lambda: time.time() + offset_s)
    await worker_store.exists(RunLayout(RUN).run_manifest)  # a worker's first reads: the store answers
    while (date := worker_store.server_date()) is not None and date.server_s <= after_s:  # the folder store: none
        await worker_store.exists(RunLayout(RUN).run_manifest)
    with Spool(spool_dir, worker_id=SKEWED, run=RUN, max_bytes=1 << 30, max_items=1000, clock=clock) as spool:
        for _ in range(n):

            def build(seq: int, _ts_ms: int) -> bytes:
                finished = spool.clock()  # as `recording.Recorder` does
                group = make_group(
                    tiny, worker=SKEWED, seq=seq, prompt_index=(3 * seq + 1) % 32, started_at=finished - 1.0,
                    finished_at=finished,
                )
                return encode_group(group)

            spool.add(build)
        await Uploader(worker_store, spool, retry_delay=0.05).drain()
        assert spool.depth == 0


async def punctual_wave(store: Store, tiny: Tiny, first_seq: int, n: int = 3) -> None:
    for seq in range(first_seq, first_seq + n):
        await upload(store, make_group(tiny, worker=PUNCTUAL, seq=seq, prompt_index=(5 * seq + 2) % 32))


def admitted_of(consumer: RolloutConsumer, worker: str) -> int:
    """Groups of `worker` handed to training."""
    return consumer.counters.get(f"worker/{worker}/groups", 0)


async def scenario(
    trainer_store: Store, trainer_url: str, worker_store: Store, spool_dir: Path, tiny: Tiny, offset_s: float,
    *, trainer_ahead_s: float = 0.0,
) -> tuple[RolloutConsumer, int]:
    """A punctual worker's wave, a batch (the cursor reaches the trainer's now), the skewed
    worker's records, a second punctual wave; then batches until everything findable was used.
    `trainer_ahead_s`: the trainer's clock that much ahead (time passed: keys stamped ahead
    come within its horizon). Returns the consumer and the skewed worker's records found."""
    await setup_run(trainer_store, tiny)
    consumer = await RolloutConsumer.open(
        trainer_store, config(trainer_url, **CONSUMER), decode=tiny.decode, eos_ids=frozenset({tiny.eos}),
        prompt_of=tiny.prompt, restore=False, clock=lambda: time.time() + trainer_ahead_s,
    )
    await punctual_wave(trainer_store, tiny, 0)
    await consumer.next_batch(3, trainer_version=0)
    await skewed_worker(worker_store, spool_dir, tiny, offset_s, after_s=time.time() + trainer_ahead_s)
    await punctual_wave(trainer_store, tiny, 3)
    await consumer.next_batch(3, trainer_version=0)  # the punctual wave: the tail passed the skewed keys too
    # Whatever of the skewed worker's records a deep sweep over the whole late window finds.
    found = consumer.counters.get("late_keys", 0)
    await consumer._filler.poll_sweep(consumer.config.late_window_ms)
    found = consumer.counters.get("late_keys", 0) - found
    ready = consumer._downloads.waiting() + len(consumer._pool)
    if ready:
        await consumer.next_batch(ready, trainer_version=0)
    return consumer, found


async def _s3_pair(server: LocalS3Server, bucket: str) -> tuple[Store, Store, str]:
    url = f"s3://{bucket}/clock-{uuid.uuid4().hex[:8]}?endpoint={server.endpoint_url}"
    creds = server.credentials()
    return open_store(url, credentials=creds), open_store(url, credentials=creds), url


# -- the pure rule ---------------------------------------------------------------------------------


def test_the_store_date_is_carried_forward_on_the_monotonic_clock() -> None:
    date = ServerDate(server_s=1_800_000_000.0, monotonic_s=50.0)
    # 30 s after the answer, whatever the local wall clock says (here: 40 minutes slow).
    assert corrected_now(date, local_s=1_800_000_000.0 - 2400, monotonic_s=80.0) == 1_800_000_030.0 + DATE_RESOLUTION_S / 2
    assert corrected_now(None, local_s=123.0, monotonic_s=80.0) == 123.0  # no store date: the local clock
    assert corrected_now(date, local_s=0.0, monotonic_s=10.0) == 1_800_000_000.0 + DATE_RESOLUTION_S / 2  # never backwards


def test_a_spool_follows_a_clock_corrected_backwards_but_not_its_jitter(tmp_path: Path) -> None:
    now = [2_000_000_600.0]  # ran 10 minutes ahead, then corrected
    with Spool(tmp_path, worker_id="w", run=RUN, max_bytes=1 << 20, max_items=10, clock=lambda: now[0]) as spool:
        first = spool.reserve()
        now[0] -= 1.0  # a second-resolution date's jitter: held
        assert spool.reserve().timestamp_ms == first.timestamp_ms
        now[0] = 2_000_000_000.0  # the correction: followed
        assert spool.reserve().timestamp_ms == 2_000_000_000_000


async def test_the_s3_store_exposes_its_servers_date(s3_server: LocalS3Server, s3_bucket: str) -> None:
    store, other, _ = await _s3_pair(s3_server, s3_bucket)
    async with store, other:
        assert store.server_date() is None  # no answer yet
        await store.exists("nothing/here")  # a 404 is an answer too
        date = store.server_date()
        assert date is not None and abs(date.server_s - time.time()) < 5.0  # the server shares this machine's clock
        local = open_store(f"file://{Path(__file__).parent}")
        assert local.server_date() is None  # the folder store: the local clock


# -- with the store's clock: every skew within the tolerance is admitted ------------------------------


@pytest.mark.parametrize("skew", list(SKEWS))
async def test_a_corrected_worker_is_admitted_whatever_its_clock(
    s3_server: LocalS3Server, s3_bucket: str, tmp_path: Path, tiny: Tiny, skew: str
) -> None:
    trainer_store, worker_store, url = await _s3_pair(s3_server, s3_bucket)
    async with trainer_store, worker_store:
        consumer, late = await scenario(trainer_store, url, worker_store, tmp_path / "spool", tiny, SKEWS[skew])
        counters = consumer.counters
        await consumer.close()
    assert admitted_of(consumer, SKEWED) == PER_WORKER, counters
    assert admitted_of(consumer, PUNCTUAL) == 6
    assert late == 0 and counters.get("late_keys", 0) == 0  # found by the tail, like the punctual worker's
    assert counters.get(f"worker/{SKEWED}/clock_refused", 0) == 0 and counters.get(f"worker/{SKEWED}/rejected", 0) == 0


async def skew_report(server: LocalS3Server, bucket: str, tmp: Path, tiny: Tiny) -> dict[str, int]:
    """For the security report: records of corrected workers at every skew of `SKEWS`, and how
    many of them the trainer refused (`skew_rejected`, 0 within the tolerance) or never used."""
    tried = refused = unused = 0
    for name, offset in SKEWS.items():
        trainer_store, worker_store, url = await _s3_pair(server, bucket)
        async with trainer_store, worker_store:
            consumer, _ = await scenario(trainer_store, url, worker_store, tmp / f"spool{name}", tiny, offset)
            await consumer.close()
        counters = consumer.counters
        tried += PER_WORKER
        refused += counters.get(f"worker/{SKEWED}/rejected", 0)
        unused += PER_WORKER - admitted_of(consumer, SKEWED)
    return {"skew_tried": tried, "skew_rejected": refused, "skew_unused": unused}


# -- without a store date: the documented limits ------------------------------------------------------


async def test_without_a_store_date_a_clock_ahead_past_the_tolerance_is_refused_and_shown(
    tmp_path: Path, tiny: Tiny, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "bucket"
    root.mkdir()
    url = f"file://{root}"
    async with open_store(url) as store:
        # The trainer's clock 6 minutes on (time passed): the +10 min keys come within its horizon.
        consumer, _ = await scenario(store, url, store, tmp_path / "spool", tiny, 10 * MINUTE, trainer_ahead_s=6 * MINUTE)
        counters = consumer.counters
        await consumer.save_state()
        await consumer.close()
        assert admitted_of(consumer, SKEWED) == 0 and admitted_of(consumer, PUNCTUAL) == 6
        assert counters[f"worker/{SKEWED}/clock_refused"] == PER_WORKER, counters
        assert counters["rejected/future_key"] == PER_WORKER
        capsys.readouterr()
        await fleet_cmd._show(url, RUN, False, 1.0)
    out = capsys.readouterr().out
    assert "records refused for the worker's clock" in out and f"{SKEWED} {PER_WORKER}" in out, out


async def test_without_a_store_date_a_clock_behind_is_found_by_the_deep_sweep_up_to_its_window(
    tmp_path: Path, tiny: Tiny
) -> None:
    for offset, found in ((-10 * MINUTE, PER_WORKER), (-40 * MINUTE, 0)):
        root = tmp_path / f"bucket{offset:.0f}"
        root.mkdir()
        url = f"file://{root}"
        async with open_store(url) as store:
            consumer, _ = await scenario(store, url, store, tmp_path / f"spool{offset:.0f}", tiny, offset)
            counters = consumer.counters
            await consumer.close()
        # -10 min: behind the cursor, inside the 30 min late window: the deep sweep finds them all.
        # -40 min: past it: never found (the documented limit), and nothing of it is refused.
        assert admitted_of(consumer, SKEWED) == found, (offset, counters)
        assert counters.get("late_keys", 0) == found
        assert counters.get(f"worker/{SKEWED}/clock_refused", 0) == 0
