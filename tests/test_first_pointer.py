"""Trust on first use: a worker with no head (its first join) bounds the pointer by its signed
time (`freshness.stale_first_pointer`, judged by the store's clock), so an old genuine pointer
put back is refused; a live trainer re-signs its pointer (`Committer.refresh`,
`keepalive.keep_pointers_fresh`) so its current pointer stays acceptable."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.freshness import FIRST_POINTER_MAX_AGE_S, Head, stale_first_pointer
from slime_stoa.protocol.pulse.keepalive import keep_pointers_fresh, refresh_all
from slime_stoa.protocol.pulse.manifests import Pointer, Ref
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.pulse.subscriber import Subscriber, SyncError
from slime_stoa.protocol.store import Store

from .forged_weights import Honest, honest_run, step_state

RUN = "first-pointer"
HOUR = 3600.0


def first_time_reader(h: Honest, now: float) -> Subscriber:
    """A signed subscriber with no head, judging pointer age at `now` (as a worker's first join)."""
    sub = Subscriber(h.store, RUN, trust=h.trust())
    sub.first_pointer_max_age_s = FIRST_POINTER_MAX_AGE_S
    sub.now = lambda: now
    return sub


async def pointer_in(store: Store) -> Pointer:
    return Pointer.from_bytes(await store.get_bytes(RunLayout(RUN).pointer))


def test_the_age_bound_is_the_signed_time_against_the_clock() -> None:
    pointer = replace(_any_pointer(), updated_at=10_000.0)
    assert stale_first_pointer(pointer, 10_000.0 + FIRST_POINTER_MAX_AGE_S) is None
    why = stale_first_pointer(pointer, 10_001.0 + FIRST_POINTER_MAX_AGE_S)
    assert why is not None and "waiting for the trainer to re-sign it" in why and "\n" not in why


def _any_pointer() -> Pointer:
    layout = RunLayout(RUN)
    return Pointer(run=RUN, version=3, state_digest="ab" * 8, manifest=layout.version_manifest(3, "a" * 8),
                   anchor=Ref(version=0, manifest=layout.anchor_manifest(0, "a" * 8), state_digest="ab" * 8),
                   updated_at=0.0)


async def test_a_fresh_worker_refuses_an_old_genuine_pointer_and_takes_a_current_one(store: Store) -> None:
    h = await honest_run(store, RUN, np.random.default_rng(21))
    current = await pointer_in(store)
    layout = RunLayout(RUN)
    # a token holder puts back the genuine v2 pointer as it was signed two hours before now
    old = replace(current, updated_at=current.updated_at - 2 * HOUR)
    await store.put(layout.pointer, old.to_bytes(h.key))
    fresh = first_time_reader(h, now=current.updated_at)
    with pytest.raises(SyncError, match="signed 120 min ago"):
        await fresh.sync()
    assert fresh.version is None and fresh.state is None
    assert await fresh.sync() is None  # said once: polled on until the pointer changes

    # a worker that holds weights is not bound by the time (its head is its check)
    assert await h.victim.sync() is not None and h.victim.version == 2

    # the live trainer re-signs: the first-time worker takes it
    assert await refresh_all([h.publisher.weights.committer]) == 1
    refreshed = await pointer_in(store)
    assert refreshed.version == 2 and refreshed.updated_at > old.updated_at + HOUR
    late = first_time_reader(h, now=time.time())
    result = await late.sync()
    assert result is not None and late.version == 2
    assert await fresh.sync() is not None and fresh.version == 2  # the waiting one too, at its next poll


async def test_a_remembering_reader_is_not_held_by_the_time(store: Store) -> None:
    """The trainer down for hours: a restarted worker (its head kept) still takes the pointer,
    while a first-time one waits."""
    h = await honest_run(store, RUN, np.random.default_rng(22))
    far = time.time() + 10 * HOUR
    remembering = first_time_reader(h, now=far)
    remembering.floor = Head(0, 1)  # a restarted worker: its head bounds it, not the time
    assert await remembering.sync() is not None and remembering.version == 2
    with pytest.raises(SyncError, match="the trainer is down or an old pointer was put back"):
        await first_time_reader(h, now=far).sync()


async def test_a_live_trainer_keeps_its_pointer_fresh_and_repairs_a_put_back_pointer(store: Store) -> None:
    h = await honest_run(store, RUN, np.random.default_rng(23))
    layout = RunLayout(RUN)
    committer = h.publisher.weights.committer
    before = await pointer_in(store)
    rounds = 0
    stop = asyncio.Event()

    def committers() -> list:
        nonlocal rounds
        rounds += 1
        if rounds == 3:
            stop.set()  # bounded by work: two refreshes, then stop
        return [committer]

    await keep_pointers_fresh(committers, stop, every_s=0.01)
    after = await pointer_in(store)
    assert rounds == 3 and after.version == before.version and after.updated_at >= before.updated_at
    assert after.manifest == before.manifest and after.state_digest == before.state_digest
    Pointer.from_bytes(await store.get_bytes(layout.pointer), trust=h.trust())  # still the run key's signature

    # a token holder puts back the v1 pointer: the next refresh writes the current one over it
    v1 = replace(after, version=1, manifest=layout.version_manifest(1, "b" * 8), updated_at=after.updated_at - HOUR)
    await store.put(layout.pointer, v1.to_bytes(h.key))
    assert await committer.refresh()
    assert (await pointer_in(store)).version == 2

    # a newer commit by another publisher is never written over by a refresh
    other = Publisher(store, RUN, PublisherConfig(anchor_every=50), key=h.key)
    assert await other.open() == 2
    assert (await other.publish(step_state(h.states[2], np.random.default_rng(1)))).version == 3
    assert not await committer.refresh()
    assert (await pointer_in(store)).version == 3
