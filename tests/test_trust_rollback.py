"""Rollback: old genuine signed objects put back into the bucket are refused. A subscriber never
goes back in (epoch, version); a publisher resumes from the highest signed version the bucket
lists and never writes a second manifest for a version number."""

from __future__ import annotations

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.freshness import Head, pointer_regression
from slime_stoa.protocol.pulse.manifests import Pointer, Ref
from slime_stoa.protocol.pulse.publisher import PublishConflict, Publisher, PublisherConfig
from slime_stoa.protocol.pulse.subscriber import Subscriber, WeightsRefused
from slime_stoa.protocol.store import Store

from .forged_weights import honest_run, step_state

RUN = "rollback"


def _pointer(version: int, epoch: int) -> Pointer:
    layout, digest = RunLayout(RUN), "ab" * 8
    return Pointer(
        run=RUN, version=version, state_digest=digest, manifest=layout.version_manifest(version, "a" * 8),
        anchor=Ref(version=0, manifest=layout.anchor_manifest(0, "a" * 8), state_digest=digest), updated_at=1.0,
        epoch=epoch,
    )


def test_a_pointer_may_only_go_forward_in_epoch_then_version() -> None:
    held = Head(1, 5)
    assert pointer_regression(None, _pointer(0, 0)) is None
    assert pointer_regression(held, _pointer(5, 1)) is None
    assert pointer_regression(held, _pointer(6, 1)) is None
    assert pointer_regression(held, _pointer(3, 2)) is None  # a signed restore opened a new epoch
    assert "went back" in (pointer_regression(held, _pointer(4, 1)) or "")
    assert "went back" in (pointer_regression(held, _pointer(9, 0)) or "")


async def test_a_subscriber_refuses_an_old_genuine_pointer_and_keeps_its_weights(store: Store) -> None:
    h = await honest_run(store, RUN, np.random.default_rng(11))
    layout = RunLayout(RUN)
    assert await h.victim.sync() is not None and h.victim.version == 2
    v1 = h.victim._manifests  # the victim read v1's manifest on its way: rebuild v1's pointer from it
    manifest = next(m for m in v1.values() if m.version == 1)
    old = Pointer(run=RUN, version=1, state_digest=manifest.state_digest,
                  manifest=layout.version_manifest(1, manifest.attempt), anchor=manifest.anchor, updated_at=1.0)
    await store.put(layout.pointer, old.to_bytes(h.key))  # genuinely signed, and older
    state = {k: v.copy() for k, v in (h.victim.state or {}).items()}
    with pytest.raises(WeightsRefused, match="went back from v2"):
        await h.victim.sync()
    assert await h.victim.sync() is None  # refused once: skipped until the pointer changes
    assert h.victim.version == 2 and h.victim.refused == 1 and "rollback" in h.victim.last_refusal
    assert all(np.array_equal(state[k], h.victim.state[k]) for k in state)  # type: ignore[index]
    # A restarted reader that remembers v2 refuses it too; one that remembers nothing cannot know.
    remembering = Subscriber(store, RUN, trust=h.trust())
    remembering.floor = Head(0, 2)
    with pytest.raises(WeightsRefused, match="went back"):
        await remembering.sync()
    assert remembering.state is None


async def _signed_versions(store: Store, run: str) -> list[int]:
    layout = RunLayout(run)
    versions = []
    async for info in store.list(layout.versions_prefix):
        parsed = layout.parse_version_manifest(info.key)
        assert parsed is not None
        versions.append(parsed[0])
    return versions


async def test_a_publisher_resumes_from_the_highest_signed_version_not_an_old_pointer(store: Store) -> None:
    h = await honest_run(store, RUN, np.random.default_rng(12))
    layout = RunLayout(RUN)
    assert await h.victim.sync() is not None  # the victim read v1 and v2's manifests
    manifest = next(m for m in h.victim._manifests.values() if m.version == 1)
    old = Pointer(run=RUN, version=1, state_digest=manifest.state_digest,
                  manifest=layout.version_manifest(1, manifest.attempt), anchor=manifest.anchor, updated_at=1.0)
    await store.put(layout.pointer, old.to_bytes(h.key))
    resumed = Publisher(store, RUN, PublisherConfig(), key=h.key)
    assert await resumed.open() == 2  # not v1: the bucket lists a signed v2
    assert Pointer.from_bytes(await store.get_bytes(layout.pointer)).version == 2  # the pointer moved back to it
    assert (await resumed.publish(step_state(h.states[2], np.random.default_rng(0)))).version == 3
    assert sorted(await _signed_versions(store, RUN)) == [0, 1, 2, 3]  # one manifest per version


async def test_a_publisher_never_writes_a_second_manifest_for_a_version(store: Store) -> None:
    h = await honest_run(store, RUN, np.random.default_rng(13))
    layout = RunLayout(RUN)
    stale = Publisher(store, RUN, PublisherConfig(), key=h.key)
    assert await stale.open() == 2
    v2 = await store.get_bytes(layout.pointer)
    rng = np.random.default_rng(1)
    assert (await h.publisher.publish(step_state(h.states[2], rng))).version == 3
    await store.put(layout.pointer, v2)  # the v2 pointer put back: the stale publisher's ETag matches again
    with pytest.raises(PublishConflict, match="already a signed manifest of v3"):
        await stale.publish(step_state(h.states[2], rng))
    assert sorted(await _signed_versions(store, RUN)) == [0, 1, 2, 3]
