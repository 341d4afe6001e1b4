"""Parallel publish and receive: the bytes published and the state reached do not depend on the
thread count, and a worker decodes a patch's first frames while later ones are still downloading."""

from __future__ import annotations

import asyncio
import math
import threading
from dataclasses import replace

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse import codec, frames, subscriber
from slime_stoa.protocol.pulse.codec import diff, merge_deltas
from slime_stoa.protocol.pulse.digest import StateDigest
from slime_stoa.protocol.pulse.history import read_manifest, read_pointer
from slime_stoa.protocol.pulse.manifests import VersionManifest
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.pulse.subscriber import Subscriber, SubscriberConfig, WeightsRefused
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store

# Small frames (several per patch), every due catch-up written, and big tensors split in segments.
CONFIG = PublisherConfig(frame_bytes=1500, catchup_budget=math.inf)
SHAPES = {"embed": (96, 64), "layer.0.w": (64, 64), "norm": (100,), "scalar": (), "empty": (0,)}


@pytest.fixture(autouse=True)
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "DIFF_SEGMENT", 1000)  # every matrix is diffed in several segments
    monkeypatch.setattr(codec, "MERGE_SEGMENT", 50)  # and merged in several ranges


def random_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {name: rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for name, shape in SHAPES.items()}


def step_state(state: dict[str, np.ndarray], rng: np.random.Generator, density: float = 0.05) -> dict[str, np.ndarray]:
    new = {name: bits.copy() for name, bits in state.items()}
    for bits in new.values():
        flat = bits.reshape(-1)
        where = rng.random(flat.size) < density
        flat[where] ^= rng.integers(1, 8, size=int(where.sum()), dtype=np.uint16)
    return new


def trajectory(seed: int, versions: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    states = [random_state(rng)]
    while len(states) < versions:
        states.append(step_state(states[-1], rng))
    return states


def test_diff_merge_and_digest_do_not_depend_on_the_thread_count() -> None:
    a, b, c = trajectory(1, 3)
    serial = diff(a, b, threads=1)
    expected = {n: np.flatnonzero(a[n] != b[n]) for n in a if np.any(a[n] != b[n])}
    assert serial.keys() == expected.keys()
    for threads in (2, 4, None):
        parallel = diff(a, b, threads=threads)
        assert parallel.keys() == serial.keys()
        for name, (indices, values) in serial.items():
            assert np.array_equal(indices, expected[name]) and np.array_equal(values, b[name].reshape(-1)[indices])
            assert np.array_equal(parallel[name][0], indices) and np.array_equal(parallel[name][1], values)
    deltas = [serial, diff(b, c, threads=1)]
    merged = merge_deltas(deltas, threads=1)
    for threads in (3, None):
        other = merge_deltas(deltas, threads=threads)
        assert other.keys() == merged.keys()
        assert all(np.array_equal(other[n][0], merged[n][0]) and np.array_equal(other[n][1], merged[n][1]) for n in merged)
    for name in merged:  # both steps' changes, with the newest bits
        both = np.union1d(*(d[name][0] for d in deltas if name in d))
        assert np.array_equal(merged[name][0], both) and np.array_equal(merged[name][1], c[name].reshape(-1)[both])
    assert merged["embed"][0].size > 4 * codec.MERGE_SEGMENT
    assert StateDigest.of(c, threads=4).root() == StateDigest.of(c, threads=1).root()
    updated = StateDigest.of(b).update(c, merged.keys(), threads=4)
    assert updated.root() == StateDigest.of(c).root() != StateDigest.of(b).root()


def test_thread_counts_must_be_positive() -> None:
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            PublisherConfig(threads=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            SubscriberConfig(threads=bad)  # type: ignore[arg-type]


async def published(store: Store, run: str) -> list[tuple[VersionManifest, list[bytes]]]:
    """Every version manifest of `run`, oldest first, with its patch bodies."""
    manifest = await read_manifest(store, (await read_pointer(store, run)).manifest)
    out = []
    while True:
        out.append((manifest, [await store.get_bytes(p.key) for p in manifest.patches]))
        if manifest.parent is None:
            return out[::-1]
        manifest = await read_manifest(store, manifest.parent.manifest)


def same_bytes(a: VersionManifest, b: VersionManifest) -> None:
    """Two publishes of one version wrote the same content (keys differ by run and attempt)."""
    assert (a.version, a.state_digest, a.anchor.version, a.anchor.state_digest) == (
        b.version, b.state_digest, b.anchor.version, b.anchor.state_digest)
    assert (a.anchor_bytes, a.since_anchor_bytes, a.elements) == (b.anchor_bytes, b.since_anchor_bytes, b.elements)
    assert len(a.patches) == len(b.patches)
    for p, q in zip(a.patches, b.patches, strict=True):
        assert replace(p, key=q.key) == q


async def test_a_publish_is_byte_identical_whatever_the_thread_count(store: Store) -> None:
    states = trajectory(2, 6)
    for run, threads in (("t1", 1), ("t4", 4)):
        pub = Publisher(store, run, replace(CONFIG, threads=threads, anchor_every=4))
        for state in states:
            await pub.publish(state)
    one, four = await published(store, "t1"), await published(store, "t4")
    assert [m.version for m, _ in one] == [0, 1, 2, 3, 4, 5]
    assert any(len(p.index.frames) > 1 for m, _ in one for p in m.patches)  # frames built on the pool
    kinds = [[p.kind for p in m.patches] for m, _ in one]
    assert kinds[1:] == [["step"], ["step", "catchup"], ["step"], ["step", "catchup"], ["step"]]  # v4 is an anchor too
    assert one[4][0].anchor.version == 4
    for (a, bodies_a), (b, bodies_b) in zip(one, four, strict=True):
        same_bytes(a, b)
        assert bodies_a == bodies_b
        assert a.state_digest == StateDigest.of(states[a.version]).root()


class Holder:
    """A subscriber and the bytes it reaches: its own, or (deferred) held here and lent to each
    sync, installed here as a worker's live weights install them."""

    def __init__(self, sub: Subscriber) -> None:
        self.sub = sub
        self.owned: dict[str, np.ndarray] | None = None

    @property
    def state(self) -> dict[str, np.ndarray] | None:
        return self.owned if self.sub.deferred else self.sub.state

    async def sync(self) -> subscriber.SyncResult | None:
        result = await self.sub.sync(self.owned)
        staged = None if result is None else result.staged
        if staged is not None:
            assert self.sub.state is None  # a deferred subscriber holds no bytes
            if staged.patch is not None:
                assert self.owned is not None
                staged.patch.commit(self.owned)
            else:
                self.owned = staged.state
            self.sub.advance(staged)
        return result


@pytest.mark.parametrize("deferred", [False, True])
async def test_a_sync_reaches_the_same_state_whatever_the_thread_count(
    store: Store, deferred: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(subscriber, "WHOLE_BODY_BYTES", 0)  # every frame by its own ranged GET
    states = trajectory(3, 6)
    pub = Publisher(store, "run", replace(CONFIG, anchor_every=100))
    subs = {t: Holder(Subscriber(store, "run", SubscriberConfig(threads=t), deferred=deferred)) for t in (1, 4)}
    for v, state in enumerate(states):
        await pub.publish(state)
        if v in (0, 1, 4, 5):  # the anchor, a step, a 3-version path, a step
            results = {t: await holder.sync() for t, holder in subs.items()}
            for t, holder in subs.items():
                result, sub = results[t], holder.sub
                assert result is not None and result.version == v
                assert sub.version == v and sub.digest is not None
                assert sub.digest.root() == StateDigest.of(state).root()
                held = holder.state
                assert held is not None and all(np.array_equal(held[n], state[n]) for n in state)
            one, four = results[1], results[4]
            assert one is not None and four is not None and one.path == four.path
            if v:
                assert one.changed is not None and four.changed is not None and one.changed.keys() == four.changed.keys()
                assert all(np.array_equal(one.changed[n], four.changed[n]) for n in one.changed)


class HoldingStore(Store):
    """The real store, logging ranged GETs; the GET of one held range answers only once a frame
    has been decoded (or after a deadlock guard, logged as such)."""

    def __init__(self, inner: Store) -> None:
        self.inner, self.url = inner, inner.url
        self.log: list[str] = []
        self.held: tuple[str, int] | None = None  # (key, offset) whose GET waits for a decode
        self.decoded = asyncio.Event()

    async def get(self, key, *, offset=0, length=None, if_none_match=None):
        if length is not None and self.held == (key, offset):
            self.log.append(f"hold {offset}")
            try:
                await asyncio.wait_for(self.decoded.wait(), timeout=20)
            except TimeoutError:
                self.log.append("nothing decoded while the frame was held")
        got = await self.inner.get(key, offset=offset, length=length, if_none_match=if_none_match)
        if length is not None:
            self.log.append(f"got {offset}")
        return got

    async def put(self, key, data, *, if_match=None):
        return await self.inner.put(key, data, if_match=if_match)

    async def put_if_absent(self, key, data):
        return await self.inner.put_if_absent(key, data)

    async def head(self, key):
        return await self.inner.head(key)

    def list(self, prefix="", *, start_after=None):
        return self.inner.list(prefix, start_after=start_after)

    async def delete(self, key):
        return await self.inner.delete(key)


@pytest.mark.parametrize("deferred", [False, True])
async def test_frames_are_decoded_while_later_frames_are_still_fetched(
    store: Store, deferred: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(subscriber, "WHOLE_BODY_BYTES", 0)
    held = HoldingStore(store)
    loop = asyncio.get_running_loop()
    decode = frames.decode_frame

    def logged_decode(index, i, data):  # runs on a decoding thread
        entries = decode(index, i, data)
        held.log.append(f"decoded {index.frames[i].offset}")
        loop.call_soon_threadsafe(held.decoded.set)
        return entries

    monkeypatch.setattr(frames, "decode_frame", logged_decode)
    states = trajectory(4, 2)
    pub = Publisher(store, "run", replace(CONFIG, catchup=False, frame_bytes=300))
    sub = Holder(Subscriber(held, "run", SubscriberConfig(threads=2), deferred=deferred))
    await pub.publish(states[0])
    await sub.sync()
    result = await pub.publish(states[1])
    manifest = await read_manifest(store, (await read_pointer(store, "run")).manifest)
    step = manifest.patch("step")
    assert step is not None and len(step.index.frames) >= 3 and result.patch_bytes == step.bytes
    last = step.index.frames[-1].offset
    held.held, held.log[:] = (step.key, last), []
    synced = await sub.sync()
    assert synced is not None and synced.path == "step"
    assert sub.state is not None and all(np.array_equal(sub.state[n], states[1][n]) for n in states[1])
    log = held.log
    assert "nothing decoded while the frame was held" not in log
    assert log.index(f"hold {last}") < log.index(f"got {last}")
    assert any(entry.startswith("decoded") for entry in log[: log.index(f"got {last}")]), log
    assert log.index(f"decoded {last}") > log.index(f"got {last}")
    assert threading.active_count() < 50  # the decoding pools are gone


@pytest.mark.parametrize("deferred", [False, True])
async def test_a_frame_not_matching_its_signed_patch_is_refused_and_nothing_is_kept(
    store: Store, deferred: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frames are decoded as they arrive, before the patch's sha256 can be checked: a damaged
    frame of a signed patch still counts as a refused object, and the held state stays as it was."""
    monkeypatch.setattr(subscriber, "WHOLE_BODY_BYTES", 0)
    key = SigningKey.generate()
    manifest = RunManifest(run="signed", model="tiny", task="synthetic", run_key=key.public.to_text())
    await store.put_if_absent(RunLayout("signed").run_manifest, manifest.to_bytes(key))
    states = trajectory(5, 2)
    pub = Publisher(store, "signed", replace(CONFIG, catchup=False, frame_bytes=300), key=key)
    holder = Holder(
        Subscriber(store, "signed", SubscriberConfig(threads=2), trust=RunTrust("signed", key.public), deferred=deferred)
    )
    sub = holder.sub
    await pub.publish(states[0])
    await holder.sync()
    await pub.publish(states[1])
    step = (await read_manifest(store, (await read_pointer(store, "signed")).manifest)).patch("step")
    assert step is not None and len(step.index.frames) >= 3
    body = bytearray(await store.get_bytes(step.key))
    body[step.index.frames[1].offset + 5] ^= 0x40
    await store.put(step.key, bytes(body))
    with pytest.raises(WeightsRefused, match="does not match"):
        await holder.sync()
    assert sub.refused == 1 and sub.version == 0
    held = holder.state
    assert held is not None and all(np.array_equal(held[n], states[0][n]) for n in states[0])
