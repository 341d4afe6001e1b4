"""Malformed weight-plane objects never escape the subscriber as anything but `SyncError`, never
move its state off the last verified version, and a good object afterwards is picked up.

(The worker built on it: tests/test_worker.py, `test_a_malformed_pointer_*`.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.manifests import Pointer
from slime_stoa.protocol.pulse.publisher import Publisher
from slime_stoa.protocol.pulse.subscriber import Subscriber, SyncError
from slime_stoa.protocol.store import Store

RUN = "malformed-test"
LAYOUT = RunLayout(RUN)


def random_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = {"embed": (64, 32), "layer.0.w": (48, 48), "norm": (100,)}
    return {name: rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for name, shape in shapes.items()}


def changed(state: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    new = {name: bits.copy() for name, bits in state.items()}
    for bits in new.values():
        flat = bits.reshape(-1)
        flat[rng.random(flat.size) < 0.05] ^= 1
    return new


def same(a: dict[str, np.ndarray] | None, b: dict[str, np.ndarray]) -> bool:
    return a is not None and a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in b)


async def two_versions(store: Store, seed: int) -> tuple[Subscriber, list[dict[str, np.ndarray]], np.random.Generator]:
    """v0 and v1 published, a subscriber synced to v1."""
    rng = np.random.default_rng(seed)
    pub = Publisher(store, RUN)
    states = [random_state(rng)]
    states.append(changed(states[0], rng))
    for state in states:
        await pub.publish(state)
    sub = Subscriber(store, RUN)
    assert (await sub.sync()) is not None and sub.version == 1
    return sub, states, rng


def edited(**fields: object):
    def edit(good: bytes) -> bytes:
        return json.dumps({**json.loads(good), **fields}).encode()

    return edit


BAD_POINTERS = {
    "not json": lambda good: b"\x00garbage{",
    "truncated": lambda good: good[: len(good) // 2],
    "wrong format": lambda good: json.dumps({"format": "stoa.pointer/0", "version": 7}).encode(),
    "wrong types": edited(version="2"),
    "bad digest": edited(version=2, state_digest="not hex"),
    "another run": edited(run="another-run", version=2),
}


@pytest.mark.parametrize("kind", sorted(BAD_POINTERS))
async def test_a_malformed_pointer_is_reported_once_and_skipped_until_a_good_one(store: Store, kind: str) -> None:
    sub, states, rng = await two_versions(store, seed=1)
    got = await store.get(LAYOUT.pointer)
    assert got is not None
    bad = BAD_POINTERS[kind](got.data)
    assert bad != got.data
    bad_etag = await store.put(LAYOUT.pointer, bad, if_match=got.etag)
    with pytest.raises(SyncError, match="malformed pointer") as raised:
        await sub.sync()
    assert "keeping weights v1" in str(raised.value)
    assert sub.version == 1 and same(sub.state, states[1])
    # The same bad object is not reported again: the next polls are 304s.
    assert await sub.sync() is None and await sub.sync() is None
    # A good pointer again (the old one back, then a publisher moving it on): picked up.
    await store.put(LAYOUT.pointer, got.data, if_match=bad_etag)
    assert await sub.sync() is None  # v1 again: nothing to do
    pub = Publisher(store, RUN)
    assert await pub.open() == 1
    states.append(changed(states[1], rng))
    await pub.publish(states[2])
    result = await sub.sync()
    assert result is not None and result.version == 2 and result.path == "step"
    assert same(sub.state, states[2]) and sub.digest is not None and sub.digest.root() == pub.state_digest


async def test_a_malformed_version_manifest_keeps_the_state_and_recovers_when_fixed(store: Store) -> None:
    sub, states, rng = await two_versions(store, seed=2)
    pub = Publisher(store, RUN)
    states.append(changed(states[1], rng))
    await pub.publish(states[2])
    pointer = Pointer.from_bytes(await store.get_bytes(LAYOUT.pointer))
    good = await store.get_bytes(pointer.manifest)
    await store.put(pointer.manifest, good[:-40] + b"}")
    for _ in range(2):  # retried at every poll (a manifest may still be on its way), never fatal
        with pytest.raises(SyncError, match="manifest is unreadable"):
            await sub.sync()
        assert sub.version == 1 and same(sub.state, states[1])
    await store.put(pointer.manifest, good)
    result = await sub.sync()
    assert result is not None and result.version == 2 and same(sub.state, states[2])


async def test_a_malformed_anchor_manifest_leaves_a_new_subscriber_empty_until_fixed(store: Store) -> None:
    _, states, _ = await two_versions(store, seed=3)
    pointer = Pointer.from_bytes(await store.get_bytes(LAYOUT.pointer))
    good = await store.get_bytes(pointer.anchor.manifest)
    await store.put(pointer.anchor.manifest, b'{"format": "stoa.anchor/1"}')
    fresh = Subscriber(store, RUN)
    with pytest.raises(SyncError, match="could not reach weights v1"):
        await fresh.sync()
    assert fresh.version is None and fresh.state is None
    await store.put(pointer.anchor.manifest, good)
    result = await fresh.sync()
    assert result is not None and result.version == 1 and same(fresh.state, states[1])


async def test_a_pointer_naming_an_impossible_key_is_a_sync_error(store: Store) -> None:
    sub, states, _ = await two_versions(store, seed=4)
    got = await store.get(LAYOUT.pointer)
    assert got is not None
    pointer = Pointer.from_bytes(got.data)
    weird = Pointer(
        run=RUN, version=2, state_digest=pointer.state_digest, manifest="runs/../escape.json",
        anchor=pointer.anchor, updated_at=0.0,
    )
    await store.put(LAYOUT.pointer, weird.to_bytes(), if_match=got.etag)
    with pytest.raises(SyncError, match=r"malformed pointer|manifest is unreadable"):
        await sub.sync()
    assert sub.version == 1 and same(sub.state, states[1])
