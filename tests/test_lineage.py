"""Weight lineage: each version records where its weights come from; a trainer restarted from an
earlier checkpoint starts a new branch (an epoch in the pointer), and the consumer measures
staleness along the lineage, not by version numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.history import (
    find_manifest,
    read_lineage,
    read_manifest,
    read_pointer,
)
from slime_stoa.protocol.pulse.lineage import Lineage
from slime_stoa.protocol.pulse.manifests import ManifestError, Origin, Pointer, Ref, VersionManifest
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.pulse.rebuild import rebuild
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.store import Store
from tests.conftest import async_wait_until
from tests.test_consumer import (
    RUN,
    Tiny,
    digest_of,
    make_group,
    now_ms,
    open_consumer,
    setup_run,
    tiny,  # noqa: F401 - the session fixture (pytest finds it by name)
    upload,
    weights,
)
from tests.test_pulse_sync import assert_same, random_state, step_state

LAYOUT = RunLayout(RUN)


# -- the pure lineage ------------------------------------------------------------------------------
def forked() -> Lineage:
    """v0..v5 on epoch 0; the trainer restarted from v2's checkpoint and published v6 (= v2) and v7."""
    steps = {7: 3, 6: 2, 2: 2, 1: 1, 0: 0}
    return Lineage(head=7, head_step=3, steps=steps, digests={v: f"{v:032x}" for v in steps}, abandoned=((3, 5),),
                   complete=True)


def test_lag_is_counted_in_training_steps_along_the_lineage() -> None:
    lineage = forked()
    assert lineage.lag(7, 7) == 0 and lineage.lag(7, 6) == 1
    assert lineage.lag(7, 2) == 1  # the restored weights: as fresh as v6, not 5 versions old
    assert lineage.lag(6, 2) == 0 and lineage.lag(7, 0) == 3
    for abandoned in (3, 4, 5):
        assert lineage.lag(7, abandoned) is None and lineage.is_abandoned(abandoned)
    assert lineage.lag(7, 8) == -1 and lineage.lag(9, 8) == 1  # newer than read: the head's line goes on
    assert not lineage.is_abandoned(6) and not lineage.is_abandoned(2)


def test_lag_beyond_what_was_read() -> None:
    partial = Lineage(head=7, head_step=3, steps={7: 3, 6: 2}, digests={}, abandoned=((3, 5),))
    # Older than read and not abandoned: assumed on the line, one step per version (the restore
    # that skipped v3..v5 adds none).
    assert partial.lag(7, 2) == 1 and partial.lag(7, 1) == 2
    assert partial.lag(7, 4) is None
    straight = Lineage.straight({3: "a" * 32, 4: "b" * 32})
    assert straight.lag(4, 3) == 1 and straight.lag(4, 0) == 4 and straight.lag(4, 6) == -2
    assert Lineage.straight({}).lag(5, 2) == 3  # nothing published: version numbers


# -- documents ----------------------------------------------------------------------------------------
def ref(v: int, attempt: str = "aaaaaaaa", digest: str | None = None) -> Ref:
    return Ref(version=v, manifest=LAYOUT.version_manifest(v, attempt), state_digest=digest or f"{v:032x}")


def manifest(v: int, lineage: Origin | None, *, digest: str | None = None, parent: Ref | None = None) -> VersionManifest:
    return VersionManifest(
        run=RUN, version=v, attempt="bbbbbbbb", state_digest=digest or f"{v:032x}",
        parent=parent if parent is not None else (ref(v - 1) if v else None),
        anchor=Ref(version=0, manifest=LAYOUT.anchor_manifest(0, "aaaaaaaa"), state_digest=f"{0:032x}"),
        anchor_bytes=1, since_anchor_bytes=0, patches=(), elements=1, created_at=1.0, lineage=lineage,
    )


def reread(m: VersionManifest) -> VersionManifest:
    return VersionManifest.from_bytes(m.to_bytes(), "test")


def test_manifest_lineage_round_trips_and_old_documents_read_as_a_straight_line() -> None:
    fork = manifest(6, Origin(epoch=1, step=2, parent=ref(2), restored=True), digest=f"{2:032x}")
    assert reread(fork) == fork and fork.origin.parent_step == 2
    trained = manifest(7, Origin(epoch=1, step=3, parent=ref(6)))
    assert reread(trained).origin == trained.origin and trained.origin.parent_step == 2
    old = json.loads(trained.to_bytes())
    del old["lineage"]
    legacy = VersionManifest.from_bytes(json.dumps(old).encode(), "old")
    assert legacy.lineage is None and legacy.origin == Origin(epoch=0, step=7, parent=ref(6))
    pointer = Pointer(run=RUN, version=7, state_digest=f"{7:032x}", manifest=LAYOUT.version_manifest(7, "bbbbbbbb"),
                      anchor=trained.anchor, updated_at=1.0, epoch=1)
    assert Pointer.from_bytes(pointer.to_bytes(), run=RUN) == pointer
    doc = json.loads(pointer.to_bytes())
    del doc["epoch"]
    assert Pointer.from_bytes(json.dumps(doc).encode(), run=RUN).epoch == 0
    doc["epoch"] = 8
    with pytest.raises(ManifestError, match="epoch"):
        Pointer.from_bytes(json.dumps(doc).encode(), run=RUN)


@pytest.mark.parametrize(
    "bad, match",
    [
        (manifest(6, Origin(epoch=1, step=2, parent=ref(2))), "must be a restore"),
        (manifest(6, Origin(epoch=1, step=2, parent=ref(2), restored=True)), "parent's state digest"),
        (manifest(6, Origin(epoch=0, step=7, parent=ref(5))), "past version"),
        (manifest(6, Origin(epoch=0, step=5, parent=ref(5, attempt="cccccccc"))), "not the chain parent"),
        (manifest(6, Origin(epoch=0, step=5, parent=ref(6))), "not before"),
        (manifest(6, Origin(epoch=0, step=0, parent=None)), "only the first version"),
        (manifest(0, Origin(epoch=0, step=0, parent=ref(0))), "cannot have a lineage parent|not before"),
        (manifest(6, Origin(epoch=0, step=0, parent=ref(5))), "at least step 1"),
    ],
)
def test_inconsistent_lineage_is_a_manifest_error(bad: VersionManifest, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        reread(bad)


def test_lineage_parent_key_must_be_the_runs() -> None:
    doc = json.loads(manifest(6, Origin(epoch=1, step=2, parent=ref(2), restored=True), digest=f"{2:032x}").to_bytes())
    doc["lineage"]["parent"]["manifest"] = "runs/other/versions/000000000002-aaaaaaaa.json"
    with pytest.raises(ManifestError, match=r"lineage\.parent"):
        VersionManifest.from_bytes(json.dumps(doc).encode(), "hostile")
    doc["lineage"]["restored"] = "yes"
    with pytest.raises(ManifestError, match="restored"):
        VersionManifest.from_bytes(json.dumps(doc).encode(), "hostile")


# -- the publisher ----------------------------------------------------------------------------------
async def test_restart_from_an_earlier_checkpoint_starts_a_new_branch(store: Store) -> None:
    rng = np.random.default_rng(11)
    states = [random_state(rng)]
    for _ in range(5):
        states.append(step_state(states[-1], rng))
    pub = Publisher(store, RUN, PublisherConfig(anchor_every=100))
    for s in states:
        await pub.publish(s)
    follower = Subscriber(store, RUN)
    await follower.sync()
    assert follower.version == 5

    restarted = Publisher(store, RUN, PublisherConfig(anchor_every=100))  # the trainer restarted from v2's checkpoint
    assert await restarted.open() == 5
    result = await restarted.publish({n: b.copy() for n, b in states[2].items()})
    assert (result.version, result.restored_from, result.epoch) == (6, 2, 1)
    pointer = await read_pointer(store, RUN)
    assert pointer.version == 6 and pointer.epoch == 1
    v6 = await read_manifest(store, pointer.manifest)
    assert v6.parent is not None and v6.parent.version == 5  # the patch chain goes on from v5
    assert v6.origin.restored and v6.origin.parent is not None and v6.origin.parent.version == 2
    assert (v6.origin.step, v6.origin.epoch) == (2, 1)
    trained = step_state(states[2], rng)
    assert (await restarted.publish(trained)).restored_from is None
    v7 = await find_manifest(store, RUN, 7)
    assert v7.origin == Origin(epoch=1, step=3, parent=v7.parent)

    # Workers on the abandoned branch step onto the new one; the history rebuilds every version.
    await follower.sync()
    assert follower.version == 7
    assert_same(follower.state, trained)
    assert_same((await rebuild(store, RUN, 6)).state, states[2])
    assert_same((await rebuild(store, RUN, 4)).state, states[4])

    lineage = await read_lineage(store, RUN, depth=10)
    assert lineage.steps == {7: 3, 6: 2, 2: 2, 1: 1, 0: 0} and lineage.abandoned == ((3, 5),) and lineage.complete
    assert lineage.digests[6] == lineage.digests[2] == v6.state_digest
    short = await read_lineage(store, RUN, depth=2)
    assert short.steps == {7: 3, 6: 2, 2: 2}  # a restore adds no step: v2 is as recent as v6


async def test_restart_at_the_pointer_or_with_new_weights_keeps_the_branch(store: Store) -> None:
    rng = np.random.default_rng(12)
    states = [random_state(rng)]
    states.append(step_state(states[-1], rng))
    pub = Publisher(store, RUN)
    for s in states:
        await pub.publish(s)
    same = Publisher(store, RUN)  # restarted from v1's checkpoint: the pointer's own weights
    result = await same.publish(states[1])
    assert (result.version, result.restored_from, result.epoch, result.changed) == (2, 1, 0, 0)
    v2 = await find_manifest(store, RUN, 2)
    assert v2.origin.step == 1 and v2.origin.restored  # the same weights: the same step
    assert (await same.publish(step_state(states[1], rng))).restored_from is None  # only the first publish looks
    fresh = Publisher(store, RUN)  # restarted with weights the run never published
    result = await fresh.publish(step_state(states[0], rng))
    assert (result.version, result.restored_from, result.epoch) == (4, None, 0)
    v4 = await find_manifest(store, RUN, 4)
    assert v4.origin.step == 3 and not v4.origin.restored


async def test_lineage_walk_survives_retention_of_the_restored_version(store: Store) -> None:
    rng = np.random.default_rng(13)
    states = [random_state(rng)]
    for _ in range(4):
        states.append(step_state(states[-1], rng))
    config = PublisherConfig(anchor_every=2, retain_anchors=2, anchor_fraction=100.0, retain_versions=1)
    pub = Publisher(store, RUN, config)
    for s in states:  # anchors at v0, v2, v4: v0 and v1 are deleted
        await pub.publish(s)
    restarted = Publisher(store, RUN, config)
    assert (await restarted.publish(states[2])).restored_from == 2
    await restarted.publish(step_state(states[2], rng))  # v6 anchors: v2 and v3 go
    lineage = await read_lineage(store, RUN, depth=10)
    # v5 (the restore) names v2, whose manifest is gone: its step and digest come from the reference.
    assert lineage.steps == {6: 3, 5: 2, 2: 2} and lineage.abandoned == ((3, 4),) and not lineage.complete


# -- the consumer -----------------------------------------------------------------------------------
KEEP_ALL = PublisherConfig(catchup=False, anchor_fraction=1e9, retain_anchors=0)  # tiny states: no anchor per version


async def publish_upto(store: Store, upto: int) -> None:
    publisher = Publisher(store, RUN, KEEP_ALL)
    for v in range(upto + 1):
        await publisher.publish(weights(v))


async def restart_from(store: Store, version: int) -> None:
    """A trainer restarted from `version`'s checkpoint publishes its weights again."""
    publisher = Publisher(store, RUN, KEEP_ALL)
    await publisher.open()
    result = await publisher.publish(weights(version))
    assert result.restored_from == version


async def test_consumer_measures_staleness_along_the_lineage(store: Store, store_url: str, tiny: Tiny) -> None:  # noqa: F811
    await setup_run(store, tiny, staleness=1, reuse=1, published=None)
    await publish_upto(store, 5)
    await restart_from(store, 2)  # v6 = v2's weights; v3..v5 abandoned
    base = now_ms() - 10_000
    versions = [0, 1, 2, 3, 4, 5, 6]
    for i, v in enumerate(versions):
        digest = digest_of(2) if v == 6 else digest_of(v)
        await upload(store, make_group(tiny, worker="w", seq=i, prompt_index=i, weight_version=v, state_digest=digest),
                     base + i)
    consumer = await open_consumer(store, tiny, store_url, wait_timeout_s=1.0)
    batch = await consumer.next_batch(3, trainer_version=6)
    # v2 and v6 are the same weights (lag 0), v1 lags one step; v0 two (stale); v3-v5 are off the lineage.
    assert sorted((g.weight_version, g.version_lag) for g in batch.groups) == [(1, 1), (2, 0), (6, 0)]
    await async_wait_until(
        lambda: consumer.counters.get("off_lineage") == 3 and consumer.counters.get("stale") == 1,
        message=lambda: f"every record judged (counters {consumer.counters})",
    )
    assert not any(k.startswith("rejected/") and v for k, v in consumer.counters.items())
    await consumer.close()


async def test_pool_groups_of_an_abandoned_branch_are_dropped(store: Store, store_url: str, tiny: Tiny) -> None:  # noqa: F811
    await setup_run(store, tiny, staleness=3, reuse=2, published=None)
    await publish_upto(store, 4)
    for i, v in enumerate((3, 4)):
        await upload(store, make_group(tiny, worker="w", seq=i, prompt_index=i, weight_version=v), now_ms() - 1000 + i)
    consumer = await open_consumer(store, tiny, store_url, wait_timeout_s=0.5)
    first = await consumer.next_batch(2, trainer_version=4)
    assert sorted(g.weight_version for g in first.groups) == [3, 4]  # in the pool again (reuse 2)
    await restart_from(store, 3)  # v5 = v3: v4 abandoned
    await upload(store, make_group(tiny, worker="w", seq=5, prompt_index=5, weight_version=5, state_digest=digest_of(3)))
    batch = await consumer.next_batch(2, trainer_version=5)
    assert sorted((g.weight_version, g.version_lag, g.use) for g in batch.groups) == [(3, 0, 2), (5, 0, 1)]
    assert consumer.counters["off_lineage"] == 1 and batch.metrics["rollout/stoa_off_lineage_dropped"] == 1
    await consumer.close()

