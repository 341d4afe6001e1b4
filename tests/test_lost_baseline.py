"""A chain object spoiled while no trainer ran, which the trainer holds no copy of (an anchor
shard, or any object without a keep folder): a restarted publisher cannot read the head's state
back from the bucket, yet it resumes at the signed head, says what was lost, and publishes the
next version as a fresh anchor from the trainer's own weights (`ChainPublisher.baseline_lost`); a
worker holding an older version syncs forward to it bit for bit, and the versions after it go
by patch again. Quantized planes likewise.

The device path's side of it is in tests/test_device_publish.py:
`test_a_device_path_restarted_over_a_lost_chain_sends_a_full_state`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.chain_keeper import kept_publisher_store
from slime_stoa.protocol.pulse.manifests import VersionManifest
from slime_stoa.protocol.pulse.plane import plane_bits
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig, UntrustedState
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store
from tests.test_chain_keeper import RUN, Live, State, manifest_of, states

LAYOUT = RunLayout(RUN)


def same(got: dict[str, np.ndarray] | None, want: State) -> bool:
    return got is not None and got.keys() == want.keys() and all(
        np.array_equal(got[n], want[n]) and got[n].dtype == want[n].dtype for n in want
    )


def shards_of(store_keys: object, anchor_manifest: str) -> list[str]:
    folder = anchor_manifest.rsplit("/", 1)[0]
    return sorted(k for k in store_keys if k.startswith(folder + "/") and k != anchor_manifest)  # type: ignore[attr-defined]


async def listed(store: Store, prefix: str) -> list[str]:
    return [info.key async for info in store.list(prefix)]


def lost_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "fresh anchor" in r.getMessage()]


@pytest.mark.both_backends
async def test_an_anchor_shard_deleted_while_the_trainer_is_down_makes_the_next_version_an_anchor(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="stoa.pulse")
    chain = states(6)
    keep = tmp_path / "kept"
    first = Live(store, keep)
    await first.publish(chain[:4])
    await first.round()  # the notes a restart checks against
    worker = Subscriber(store, RUN, trust=first.trust())
    assert (await worker.sync_to(manifest_of(first.store, 2))).version == 2  # a worker left at v2
    [shard, *_] = shards_of(first.store.written, first.head.anchor.manifest)
    await store.delete(shard)  # the trainer is down; an anchor shard is large: no copy is kept

    await kept_publisher_store(store, RUN, keep)  # what a restart runs first: nothing it can put back
    again = Live(store, keep, key=first.key)
    assert await again.pub.open() == 3
    weights = again.pub.weights
    assert weights.baseline_lost and weights.anchor_forced and weights.state_digest is None
    [line] = lost_lines(caplog)
    assert RUN in line and "v3" in line and "v4 will be a fresh anchor" in line and shard in line

    result = await again.pub.publish(chain[4])
    assert result.version == 4 and result.anchored and result.changed == 0
    head = again.head
    assert head.patches == () and head.parent is not None and head.parent.version == 3
    assert head.origin.epoch == 0 and head.origin.step == 4 and not head.origin.restored
    assert not weights.baseline_lost and not weights.anchor_forced
    got = await worker.sync()  # forward, same epoch, to the new anchor
    assert got is not None and got.version == 4 and same(worker.state, chain[4])

    result = await again.pub.publish(chain[5])  # the chain goes on by patch
    assert result.version == 5 and not result.anchored and result.changed > 0
    got = await worker.sync()
    assert got is not None and got.version == 5 and got.path == "step" and same(worker.state, chain[5])


async def test_without_a_keep_folder_a_deleted_patch_makes_the_next_version_an_anchor(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="stoa.pulse")
    chain = states(5)
    key = SigningKey.generate()
    config = PublisherConfig(anchor_every=50)  # catch-ups on: resume would rebuild their union
    first = Publisher(store, RUN, config, key=key)
    for state in chain[:4]:
        await first.publish(state)
    assert first.weights.head is not None
    worker = Subscriber(store, RUN, trust=RunTrust(RUN, key.public))
    await worker.sync()
    assert worker.version == 3
    patches = await listed(store, LAYOUT.patches_prefix)
    for patch in patches:  # every patch: no path from the anchor v0 to v3 is left
        await store.delete(patch)

    again = Publisher(store, RUN, config, key=key)
    assert await again.open() == 3 and again.weights.baseline_lost
    [line] = lost_lines(caplog)
    assert "v4 will be a fresh anchor" in line and any(p in line for p in patches)
    result = await again.publish(chain[4])
    assert result.version == 4 and result.anchored
    got = await worker.sync()
    assert got is not None and got.version == 4 and same(worker.state, chain[4])
    fresh = Subscriber(store, RUN, trust=RunTrust(RUN, key.public))
    got = await fresh.sync()
    assert got is not None and got.version == 4 and same(fresh.state, chain[4])


async def test_a_restart_with_the_same_weights_restores_the_head_as_an_anchor(store: Store) -> None:
    """The trainer restarted from the head's checkpoint: the anchor it publishes is a restore of
    the head (its state digest), the lineage step unchanged."""
    chain = states(3)
    key = SigningKey.generate()
    first = Publisher(store, RUN, PublisherConfig(catchup=False), key=key)
    for state in chain:
        await first.publish(state)
    for patch in await listed(store, LAYOUT.patches_prefix):
        await store.delete(patch)
    again = Publisher(store, RUN, PublisherConfig(catchup=False), key=key)
    assert await again.open() == 2
    result = await again.publish(chain[2])
    assert result.version == 3 and result.anchored and result.restored_from == 2
    head = again.weights.head
    assert head is not None and head.origin.restored and head.origin.step == 2


async def test_a_forged_head_still_refuses_to_resume(store: Store) -> None:
    """What the head itself cannot be verified for stops the resume as before: a manifest the
    run key did not sign is not a state to publish after."""
    chain = states(2)
    key = SigningKey.generate()
    first = Publisher(store, RUN, PublisherConfig(catchup=False), key=key)
    for state in chain:
        await first.publish(state)
    assert first.weights.head is not None
    head = first.weights.head
    manifest_key = LAYOUT.version_manifest(head.version, head.attempt)
    forged = VersionManifest.from_bytes(await store.get_bytes(manifest_key), manifest_key, key=manifest_key)
    await store.put(manifest_key, forged.to_bytes(SigningKey.generate()))
    with pytest.raises(UntrustedState):
        await Publisher(store, RUN, PublisherConfig(catchup=False), key=key).open()


def finite_states(count: int) -> list[State]:
    """bf16 states of finite weights (the planes quantize them), each step changing a few."""
    rng = np.random.default_rng(9)
    floats = {"w": rng.standard_normal((32, 128), dtype=np.float32) * 0.02,
              "n": rng.standard_normal((128,), dtype=np.float32)}
    return states(count, {name: (x.view(np.uint32) >> 16).astype(np.uint16) for name, x in floats.items()},
                  changed=7, seed=10)


@pytest.mark.parametrize("lost", ["weights", "int8"])
async def test_a_lost_chain_of_the_weights_or_of_a_plane_resumes_with_an_anchor(
    store: Store, lost: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="stoa.pulse")
    chain = finite_states(5)
    key = SigningKey.generate()
    config = PublisherConfig(catchup=False, planes=("int8",))
    first = Publisher(store, RUN, config, key=key)
    for state in chain[:3]:
        await first.publish(state)
    trust = RunTrust(RUN, key.public)
    workers = {None: Subscriber(store, RUN, trust=trust), "int8": Subscriber(store, RUN, trust=trust, plane="int8")}
    for worker in workers.values():
        await worker.sync()
        assert worker.version == 2
    layout = LAYOUT if lost == "weights" else LAYOUT.on_plane("int8")
    anchors = await listed(store, layout.anchors_prefix)
    await store.delete(next(k for k in anchors if k.endswith(".safetensors")))

    again = Publisher(store, RUN, config, key=key)
    assert await again.open() == 2
    lost_chain = again.weights if lost == "weights" else again.planes["int8"]
    assert lost_chain.baseline_lost and len(lost_lines(caplog)) == 1
    for v in (3, 4):
        result = await again.publish(chain[v])
        assert result.version == v and result.planes == ("int8",)
        assert again.weights.head is not None and again.planes["int8"].head is not None
        assert again.planes["int8"].head.anchor.version == (3 if lost == "int8" else 0)
        assert again.weights.head.anchor.version == (3 if lost == "weights" else 0)
        for plane, worker in workers.items():  # both reach v bit for bit, from the v2 they held
            got = await worker.sync()
            want = chain[v] if plane is None else plane_bits(chain[v], "int8")
            assert got is not None and got.version == v and same(worker.state, want), (plane, v)
