"""The publisher's pure parts on their own: the anchor policy, the retention order, the
diff/digest seam, the patches of one version; and the seam swapped in a real publisher."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.anchor_policy import anchor_due
from slime_stoa.protocol.pulse.catchup_union import patch_delta
from slime_stoa.protocol.pulse.codec import diff
from slime_stoa.protocol.pulse.digest import StateDigest
from slime_stoa.protocol.pulse.history import find_manifest
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.pulse.retention import deletion_order
from slime_stoa.protocol.pulse.step_diff import StepDiff, diff_step
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.pulse.version_patches import encode_patches
from slime_stoa.protocol.store import Store
from tests.test_pulse_sync import assert_same, random_state, step_state


# -- the anchor policy ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("version", "anchor_version", "since", "anchor_bytes", "forced", "due"),
    [
        (5, 0, 100, 1000, False, False),  # short, cheap chain
        (10, 0, 100, 1000, False, True),  # anchor_every versions from the anchor
        (19, 10, 100, 1000, False, False),
        (20, 10, 100, 1000, False, True),
        (5, 0, 500, 1000, False, False),  # exactly the fraction: not over it
        (5, 0, 501, 1000, False, True),  # the steps since the anchor cost over half of it
        (1, 0, 0, 1000, True, True),  # forced (a union that could not be rebuilt)
    ],
)
def test_an_anchor_is_due_by_distance_bytes_or_force(
    version: int, anchor_version: int, since: int, anchor_bytes: int, forced: bool, due: bool
) -> None:
    assert (
        anchor_due(
            version=version, anchor_version=anchor_version, since_anchor_bytes=since, anchor_bytes=anchor_bytes,
            forced=forced, anchor_every=10, anchor_fraction=0.5,
        )
        is due
    )


# -- retention -------------------------------------------------------------------------------------
@pytest.mark.parametrize("plane", [None, "int8"])
def test_retention_deletes_only_older_weight_objects_manifests_first(plane: str | None) -> None:
    layout = RunLayout("r", plane)  # type: ignore[arg-type]
    old = [
        layout.patch(3, "a0000003", "step", 2),
        layout.anchor_manifest(0, "a0000000"),
        layout.version_manifest(3, "a0000003"),
        f"{layout.anchor_prefix(0, 'a0000000')}model-00001.safetensors",
        layout.version_manifest(0, "a0000000"),
    ]
    kept = [
        layout.version_manifest(4, "a0000004"),
        layout.anchor_manifest(4, "a0000004"),
        layout.patch(5, "a0000005", "catchup", 4),
        layout.pointer,
        RunLayout("r", "int4" if plane else "int8").version_manifest(0, "b0000000"),  # another chain's
        "runs/r/run.json",
    ]
    doomed = deletion_order(layout, [*old, *kept], keep_from=4)
    assert sorted(doomed) == sorted(old)
    manifests = [k for k in doomed if k.startswith(layout.versions_prefix)]
    assert doomed[: len(manifests)] == manifests and len(manifests) == 2  # no manifest outlives its objects
    assert deletion_order(layout, [*old, *kept], keep_from=0) == []


# -- the diff/digest seam --------------------------------------------------------------------------
def test_diff_step_is_the_bit_diff_and_the_new_states_digest() -> None:
    rng = np.random.default_rng(3)
    before = random_state(rng)
    after = step_state(before, rng)
    step = diff_step(before, StateDigest.of(before), after, threads=2)
    expected = diff(before, after)
    assert step.delta.keys() == expected.keys() and step.delta
    for name, (indices, values) in expected.items():
        assert np.array_equal(step.delta[name][0], indices) and np.array_equal(step.delta[name][1], values)
    assert step.digest.root() == StateDigest.of(after).root() != StateDigest.of(before).root()
    with pytest.raises(ValueError, match="tensor names"):
        diff_step(before, StateDigest.of(before), {**after, "extra": after["norm"]})


# -- the patches of one version -------------------------------------------------------------------
async def test_a_due_catchup_carries_the_union_since_the_anchor_and_the_budget_can_skip_it() -> None:
    rng = np.random.default_rng(5)
    states = [random_state(rng)]
    for _ in range(2):
        states.append(step_state(states[-1], rng))
    layout = RunLayout("r")
    config = PublisherConfig(catchup_budget=float("inf"))  # v2: two past the anchor, a catch-up is due
    first = diff(states[0], states[1])

    async def v2(config: PublisherConfig):
        return await encode_patches(
            layout, config, version=2, attempt="00000002", anchor=0, since_anchor_bytes=1000,
            delta=diff(states[1], states[2]), state=states[2], base=states[1],
            base_digest=StateDigest.of(states[1]).root(), union=first, catchup_bytes=0,
        )

    written = await v2(config)
    assert [p.kind for p in written.patches] == ["step", "catchup"]
    assert written.since_anchor_bytes == 1000 + written.step.bytes
    assert written.catchup_bytes == written.patches[1].bytes == len(written.bodies[1])
    catchup = written.patches[1]
    assert catchup.base_min == 0 and catchup.base_max == 1 and catchup.key == layout.patch(2, "00000002", "catchup", 0)
    union = patch_delta(catchup.index, written.bodies[1], states[2])
    for name in states[0]:
        changed = np.flatnonzero((states[0][name] != states[1][name]) | (states[1][name] != states[2][name]))
        got = union[name][0] if name in union else np.empty(0, dtype=np.int64)
        assert np.array_equal(np.sort(got), changed)
    skipped = await v2(PublisherConfig(catchup_budget=0.0))
    assert [p.kind for p in skipped.patches] == ["step"] and skipped.catchup_bytes == 0
    assert skipped.bodies[0] == written.bodies[0]  # the step patch does not depend on the catch-up
    without = await v2(PublisherConfig(catchup=False))
    assert [p.kind for p in without.patches] == ["step"] and without.union == {}


# -- the seam in a publisher -----------------------------------------------------------------------
async def test_a_publisher_computes_each_version_through_its_diff_step(store: Store) -> None:
    calls: list[int] = []

    def counted(
        previous: Mapping[str, np.ndarray], digest: StateDigest, new: Mapping[str, np.ndarray], *, threads: int | None = 1
    ) -> StepDiff:
        calls.append(len(new))
        return diff_step(previous, digest, new, threads=threads)

    rng = np.random.default_rng(8)
    states = [random_state(rng)]
    pub = Publisher(store, "seam", PublisherConfig(anchor_every=100, anchor_fraction=1e9), diff_step=counted)
    await pub.publish(states[0])
    assert calls == []  # the first version is an anchor: nothing to diff against
    for _ in range(3):
        states.append(step_state(states[-1], rng))
        await pub.publish(states[-1])
    assert len(calls) == 3
    sub = Subscriber(store, "seam")
    await sub.sync_to(await find_manifest(store, "seam", 3))
    assert_same(sub.state, states[-1])
