"""The wait for a batch against a slow store: listings are paced from the end of the previous
one, and the wait's deadline is checked between them, however slow each listing is."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator

import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import ObjectInfo, Store
from slime_stoa.trainer.consumer import ConsumerTimeout, RolloutConsumer
from slime_stoa.trainer.consumer.counting import CountingStore
from tests.test_consumer import RUN, Tiny, make_group, now_ms, open_consumer, setup_run, tiny, upload

__all__ = ["tiny"]  # the session fixture

ROLLOUTS = RunLayout(RUN).rollouts_prefix("train")
NO_SWEEPS = dict(sweep_interval_s=3600.0, late_sweep_interval_s=3600.0)


class SlowListing(CountingStore):
    """A real store whose listings of the run's rollouts take `delay_s` longer; each such
    listing's (start, end) in monotonic seconds is kept in `spans`."""

    def __init__(self, inner: Store, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s = delay_s
        self.spans: list[tuple[float, float]] = []

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncGenerator[ObjectInfo, None]:
        listing = super().list(prefix, start_after=start_after)
        if not prefix.startswith(ROLLOUTS):
            async with contextlib.aclosing(listing):
                async for info in listing:
                    yield info
            return
        started = time.monotonic()
        try:
            await asyncio.sleep(self.delay_s)
            async with contextlib.aclosing(listing):
                async for info in listing:
                    yield info
        finally:
            self.spans.append((started, time.monotonic()))


async def _timed_out_batch(slow: SlowListing, tiny: Tiny, store_url: str, **config: float) -> float:
    """Open a consumer on `slow` and wait for a batch that never comes: the seconds waited
    until `ConsumerTimeout` (an old, unpaced loop never ends: `wait_for` turns that into a
    failure)."""
    consumer = await open_consumer(slow, tiny, store_url, **{**NO_SWEEPS, **config})
    slow.spans.clear()
    started = time.monotonic()
    try:
        with pytest.raises(ConsumerTimeout):
            await asyncio.wait_for(consumer.next_batch(1, trainer_version=0), timeout=10.0)
    finally:
        await consumer.close()
    return time.monotonic() - started


async def test_listings_slower_than_the_poll_interval_are_paced_and_the_wait_times_out(
    store: Store, store_url: str, tiny: Tiny
) -> None:
    await setup_run(store, tiny)
    poll, delay, timeout = 0.02, 0.06, 0.3
    slow = SlowListing(store, delay)
    waited = await _timed_out_batch(slow, tiny, store_url, poll_interval_s=poll, wait_timeout_s=timeout)
    spans = slow.spans
    assert spans, "the wait listed nothing"
    # Each listing starts at least `poll_interval_s` after the previous one ended.
    for (_, ended), (started, _) in itertools.pairwise(spans):
        assert started - ended >= poll - 1e-3, spans
    # Hence at most one listing per (poll + listing) seconds of the wait, and never more than
    # timeout / poll_interval_s + 1 whatever the machine's load.
    assert len(spans) <= waited / (poll + delay) + 1
    assert len(spans) <= timeout / poll + 1
    assert waited >= timeout


async def test_a_listing_slower_than_the_whole_wait_ends_it_after_that_listing(
    store: Store, store_url: str, tiny: Tiny
) -> None:
    await setup_run(store, tiny)
    slow = SlowListing(store, delay_s=0.5)
    waited = await _timed_out_batch(slow, tiny, store_url, poll_interval_s=0.01, wait_timeout_s=0.1)
    assert len(slow.spans) == 1  # the deadline passed during the first listing: no second one
    assert waited >= 0.5


class HeldSweeps(CountingStore):
    """A real store whose listings of the rollouts starting before `before` (a sweep lists
    behind the cursor; the tail lists after it) wait until `release` is set; `held` counts them."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.before = ""
        self.release = asyncio.Event()
        self.held = 0

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncGenerator[ObjectInfo, None]:
        if prefix.startswith(ROLLOUTS) and start_after is not None and start_after < self.before:
            self.held += 1
            await self.release.wait()
        listing = super().list(prefix, start_after=start_after)
        async with contextlib.aclosing(listing):
            async for info in listing:
                yield info


async def consumer_past_one_record(store: Store, store_url: str, tiny: Tiny) -> tuple[HeldSweeps, RolloutConsumer]:
    """A consumer (sweeps due at once) that took one record, on a store holding every sweep
    from now on (sweeps list from before the cursor, the tail after it)."""
    await setup_run(store, tiny)
    held = HeldSweeps(store)
    first = now_ms() - 1000
    await upload(store, make_group(tiny, worker="a", seq=0), first)
    consumer = await open_consumer(held, tiny, store_url, poll_interval_s=0.01, sweep_interval_s=0.01, late_sweep_interval_s=3600.0)
    assert [g.worker for g in (await consumer.next_batch(1, trainer_version=0)).groups] == ["a"]
    held.before = RunLayout(RUN).rollout_after(first)
    return held, consumer


async def test_a_record_landing_during_a_sweep_step_is_admitted_without_waiting_for_it(
    store: Store, store_url: str, tiny: Tiny
) -> None:
    """A sweep step stuck in its listing (millions of junk keys behind the cursor, a slow store)
    holds no new record back: the step is a task beside the tail and the downloads, and the
    consumer's close cancels it."""
    held, consumer = await consumer_past_one_record(store, store_url, tiny)
    try:
        waiting = asyncio.create_task(consumer.next_batch(1, trainer_version=0))
        while not held.held:  # a sweep step is under way, and stuck
            await asyncio.sleep(0.01)
        assert not waiting.done()
        await upload(store, make_group(tiny, worker="b", seq=0), now_ms())
        got = await asyncio.wait_for(waiting, timeout=10.0)
        assert [g.worker for g in got.groups] == ["b"] and held.held == 1 and not held.release.is_set()
    finally:
        await asyncio.wait_for(consumer.close(), timeout=10.0)  # cancels the held step


async def test_a_state_loads_after_a_wait_in_vain_once_its_sweep_step_ended(store: Store, store_url: str, tiny: Tiny) -> None:
    """A wait that times out leaves its sweep step running: a state is loaded only once that
    step ended (it writes into the state)."""
    held, consumer = await consumer_past_one_record(store, store_url, tiny)
    try:
        saved = consumer.state_dict()
        with pytest.raises(ConsumerTimeout):
            await consumer.next_batch(1, trainer_version=0, timeout_s=0.2)
        assert held.held == 1 and consumer._discovery.sweeping
        with pytest.raises(RuntimeError, match="before the consumer's first batch"):
            consumer.load_state_dict(saved)  # the step is still under way
        held.release.set()
        while consumer._filler.discovering:
            await asyncio.sleep(0.01)
        consumer.load_state_dict(saved)
        assert consumer._discovery.state.cursor == saved["cursor"]
    finally:
        await asyncio.wait_for(consumer.close(), timeout=10.0)
