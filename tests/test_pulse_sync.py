"""Publisher and subscriber end to end, on both store backends."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.codec import diff
from slime_stoa.protocol.pulse.digest import StateDigest, state_digest
from slime_stoa.protocol.pulse.manifests import Pointer, VersionManifest
from slime_stoa.protocol.pulse.publisher import (
    PublishConflict,
    Publisher,
    PublisherConfig,
)
from slime_stoa.protocol.pulse.route import Route, SpeedMeter, Speeds, chain_guess, estimate_s, rank
from slime_stoa.protocol.pulse.subscriber import Subscriber, SubscriberConfig, SyncError
from slime_stoa.protocol.store import Store

RUN = "sync-test"
# Every due catch-up patch written (at 2, 4, 8, ... versions past the anchor), whatever its size.
CATCHUPS = PublisherConfig(catchup_budget=math.inf)


def random_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = {"embed": (64, 32), "layer.0.w": (48, 48), "norm": (100,), "scalar": (), "empty": (0,)}
    return {name: rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for name, shape in shapes.items()}


def step_state(state: dict[str, np.ndarray], rng: np.random.Generator, density: float = 0.02) -> dict[str, np.ndarray]:
    new = {name: bits.copy() for name, bits in state.items()}
    for bits in new.values():
        flat = bits.reshape(-1)
        if flat.size:
            where = rng.random(flat.size) < density
            flat[where] = rng.integers(0, 1 << 16, size=int(where.sum()), dtype=np.uint16)
    return new


def assert_same(a: dict[str, np.ndarray] | None, b: dict[str, np.ndarray]) -> None:
    assert a is not None and a.keys() == b.keys()
    for name in b:
        assert a[name].shape == b[name].shape and np.array_equal(a[name], b[name]), name


async def publish_versions(pub: Publisher, rng: np.random.Generator, n: int, state=None) -> list[dict[str, np.ndarray]]:
    states = []
    state = state if state is not None else random_state(rng)
    for _ in range(n):
        await pub.publish(state)
        states.append(state)
        state = step_state(state, rng)
    return states


@pytest.mark.both_backends
async def test_follower_steps_through_every_version(store: Store) -> None:
    rng = np.random.default_rng(0)
    pub, sub = Publisher(store, RUN), Subscriber(store, RUN)
    state = random_state(rng)
    previous: dict[str, np.ndarray] | None = None  # the state of version v - 1
    for v in range(5):
        result = await pub.publish(state)
        assert result.version == v and result.anchored == (v == 0)
        synced = await sub.sync()
        assert synced is not None and synced.version == v
        assert synced.path == ("anchor" if v == 0 else "step")
        if previous is not None:
            expected = {n: idx for n, (idx, _) in diff(previous, state).items()}
            assert synced.changed is not None and synced.changed.keys() == expected.keys()
            assert all(np.array_equal(synced.changed[n], expected[n]) for n in expected)
        assert_same(sub.state, state)
        previous = state
        assert sub.digest is not None and sub.digest.root() == state_digest(state) == pub.state_digest
        assert await sub.sync() is None  # unchanged pointer: nothing to do
        state = step_state(state, rng)


async def test_lagging_subscriber_uses_one_catchup_patch(store: Store) -> None:
    rng = np.random.default_rng(1)
    pub, sub = Publisher(store, RUN, CATCHUPS), Subscriber(store, RUN, SubscriberConfig(route_by="time"))
    states = await publish_versions(pub, rng, 2)
    await sub.sync()
    states += await publish_versions(pub, rng, 7, step_state(states[-1], rng))
    result = await sub.sync()
    assert result is not None and result.path == "catchup" and result.version == 8
    assert_same(sub.state, states[-1])


async def test_cold_subscriber_starts_from_the_anchor(store: Store) -> None:
    rng = np.random.default_rng(2)
    pub = Publisher(store, RUN, CATCHUPS)
    states = await publish_versions(pub, rng, 5)
    sub = Subscriber(store, RUN)
    result = await sub.sync()
    assert result is not None and result.path == "anchor+catchup" and result.version == 4
    assert_same(sub.state, states[-1])


async def test_without_catchup_a_lagger_replays_the_chain(store: Store) -> None:
    rng = np.random.default_rng(3)
    pub, sub = Publisher(store, RUN, PublisherConfig(catchup=False)), Subscriber(store, RUN)
    states = await publish_versions(pub, rng, 2)
    await sub.sync()
    states += await publish_versions(pub, rng, 4, step_state(states[-1], rng))
    result = await sub.sync()
    assert result is not None and result.path == "chain"
    assert_same(sub.state, states[-1])


async def test_base_relative_patches(store: Store) -> None:
    rng = np.random.default_rng(4)
    pub = Publisher(store, RUN, CATCHUPS)
    follower, lagger = Subscriber(store, RUN), Subscriber(store, RUN, SubscriberConfig(route_by="time"))
    states = await publish_versions(pub, rng, 2)
    await follower.sync()
    await lagger.sync()
    state = states[-1]
    for _ in range(3):
        state = step_state(state, rng)
        await pub.publish(state)
        result = await follower.sync()
        assert result is not None and result.path == "step"
        assert_same(follower.state, state)
    result = await lagger.sync()
    assert result is not None and result.path == "catchup"
    assert_same(lagger.state, state)


async def test_no_change_version(store: Store) -> None:
    rng = np.random.default_rng(5)
    pub, sub = Publisher(store, RUN), Subscriber(store, RUN)
    state = random_state(rng)
    await pub.publish(state)
    await sub.sync()
    result = await pub.publish(state)
    assert result.changed == 0 and result.density == 0.0
    synced = await sub.sync()
    assert synced is not None and synced.version == 1 and synced.touched == ()
    assert_same(sub.state, state)


async def _manifest(store: Store, version: int) -> VersionManifest:
    pointer = Pointer.from_bytes(await store.get_bytes(RunLayout(RUN).pointer))
    key = pointer.manifest
    while True:
        manifest = VersionManifest.from_bytes(await store.get_bytes(key), key)
        if manifest.version == version:
            return manifest
        assert manifest.parent is not None
        key = manifest.parent.manifest


async def test_corrupt_step_patch_falls_back_and_ends_identical(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(6)
    pub, sub = Publisher(store, RUN, CATCHUPS), Subscriber(store, RUN)
    states = await publish_versions(pub, rng, 4)
    await sub.sync()  # at v3
    await pub.publish(step_state(states[-1], rng))  # v4, with a catch-up
    step = (await _manifest(store, 4)).patch("step")
    assert step is not None
    body = bytearray(await store.get_bytes(step.key))
    body[len(body) // 2] ^= 0x40
    await store.put(step.key, bytes(body))  # tamper with an immutable object
    before = {k: v.copy() for k, v in sub.state.items()}
    with caplog.at_level(logging.WARNING, logger="stoa.pulse"):
        result = await sub.sync()
    assert result is not None and result.path != "step"
    assert "via step failed" in caplog.text and "digest" in caplog.text
    assert sub.digest is not None and sub.digest.root() == pub.state_digest
    assert not all(np.array_equal(before[k], sub.state[k]) for k in before)


async def test_missing_patches_fall_back_to_the_anchor(store: Store) -> None:
    rng = np.random.default_rng(7)
    pub, sub = Publisher(store, RUN, CATCHUPS), Subscriber(store, RUN)
    states = await publish_versions(pub, rng, 2)
    await sub.sync()
    states += await publish_versions(pub, rng, 3, step_state(states[-1], rng))
    manifest = await _manifest(store, 4)
    assert [ref.kind for ref in manifest.patches] == ["step", "catchup"]
    for ref in manifest.patches:
        await store.delete(ref.key)
    with pytest.raises(SyncError):  # the anchor path needs the catch-up patch too
        await sub.sync()
    assert sub.version == 1
    assert_same(sub.state, states[1])  # untouched
    states += await publish_versions(pub, rng, 4, step_state(states[-1], rng))
    result = await sub.sync()  # the next catch-up (v8, from any version since the anchor) reaches it again
    assert result is not None and result.version == 8
    assert_same(sub.state, states[-1])


async def test_wrong_base_is_detected_and_recovered(store: Store) -> None:
    rng = np.random.default_rng(8)
    pub, sub = Publisher(store, RUN), Subscriber(store, RUN)
    states = await publish_versions(pub, rng, 2)
    await sub.sync()
    assert sub.state is not None
    sub.state["norm"][0] ^= 1  # local corruption the subscriber does not know about
    await pub.publish(step_state(states[-1], rng))
    result = await sub.sync()
    assert result is not None and result.path.startswith("anchor")
    assert sub.digest is not None and sub.digest.root() == pub.state_digest


async def test_pointer_ahead_of_its_objects_keeps_the_state(store: Store) -> None:
    rng = np.random.default_rng(9)
    pub, sub = Publisher(store, RUN), Subscriber(store, RUN)
    states = await publish_versions(pub, rng, 2)
    await sub.sync()
    layout = RunLayout(RUN)
    got = await store.get(layout.pointer)
    assert got is not None
    pointer = Pointer.from_bytes(got.data)
    ahead = Pointer(
        run=RUN, version=pointer.version + 1, state_digest="0" * 32,
        manifest=layout.version_manifest(pointer.version + 1, "deadbeef"), anchor=pointer.anchor, updated_at=0.0,
    )
    await store.put(layout.pointer, ahead.to_bytes(), if_match=got.etag)
    with pytest.raises(SyncError, match="manifest is unreadable"):
        await sub.sync()
    assert sub.version == 1
    assert_same(sub.state, states[-1])


async def test_corrupt_anchor_and_patches_leave_the_state_untouched(store: Store) -> None:
    rng = np.random.default_rng(10)
    pub = Publisher(store, RUN, PublisherConfig(catchup=False))
    await publish_versions(pub, rng, 3)
    sub = Subscriber(store, RUN)
    manifest = await _manifest(store, 2)
    anchor_prefix = manifest.anchor.manifest.rsplit("/", 1)[0] + "/"
    async for info in store.list(anchor_prefix):
        if info.key.endswith(".safetensors"):
            data = bytearray(await store.get_bytes(info.key))
            data[-1] ^= 0xFF
            await store.put(info.key, bytes(data))
    with pytest.raises(SyncError, match="could not reach weights v2"):
        await sub.sync()
    assert sub.state is None and sub.version is None


@pytest.mark.both_backends
async def test_racing_publishers_one_commit_per_version(store: Store) -> None:
    rng = np.random.default_rng(11)
    base = random_state(rng)
    first = Publisher(store, RUN)
    await first.publish(base)
    a, b = Publisher(store, RUN), Publisher(store, RUN)
    await asyncio.gather(a.open(), b.open())
    sa, sb = step_state(base, rng), step_state(base, rng)
    results = await asyncio.gather(a.publish(sa), b.publish(sb), return_exceptions=True)
    conflicts = [r for r in results if isinstance(r, PublishConflict)]
    wins = [r for r in results if not isinstance(r, BaseException)]
    assert len(conflicts) == 1 and len(wins) == 1, results
    assert "another publisher" in str(conflicts[0])
    winner_state = sa if not isinstance(results[0], BaseException) else sb
    sub = Subscriber(store, RUN)
    result = await sub.sync()
    assert result is not None and result.version == 1
    assert_same(sub.state, winner_state)


@pytest.mark.both_backends
async def test_resumed_publisher_continues_the_chain(store: Store) -> None:
    rng = np.random.default_rng(12)
    states = await publish_versions(Publisher(store, RUN, CATCHUPS), rng, 4)
    sub = Subscriber(store, RUN)
    await sub.sync()
    resumed = Publisher(store, RUN, CATCHUPS)
    assert await resumed.open() == 3
    nxt = step_state(states[-1], rng)
    result = await resumed.publish(nxt)
    assert result.version == 4 and not result.anchored
    synced = await sub.sync()
    assert synced is not None and synced.path == "step"
    assert_same(sub.state, nxt)
    assert (await _manifest(store, 4)).patch("catchup") is not None  # the union rebuilt on resuming


async def test_anchor_cadence_and_retention(store: Store) -> None:
    rng = np.random.default_rng(13)
    pub = Publisher(store, RUN, PublisherConfig(anchor_every=3, retain_anchors=2, anchor_fraction=100.0, retain_versions=1))
    states = await publish_versions(pub, rng, 8)
    layout = RunLayout(RUN)
    anchors = sorted(
        {layout.weight_object_version(i.key)[0] async for i in store.list(layout.anchors_prefix)}
    )
    assert anchors == [3, 6]  # 0 was deleted when 6 was written
    versions = sorted({layout.weight_object_version(i.key)[0] async for i in store.list(layout.versions_prefix)})
    assert versions == list(range(3, 8))
    sub = Subscriber(store, RUN)
    result = await sub.sync()
    assert result is not None and result.version == 7 and result.path == "anchor+step"
    assert_same(sub.state, states[-1])


async def test_anchor_when_patches_outweigh_it(store: Store) -> None:
    rng = np.random.default_rng(14)
    pub = Publisher(store, RUN, PublisherConfig(anchor_fraction=0.3))
    state = random_state(rng)
    await pub.publish(state)
    anchored = []
    for _ in range(6):
        state = step_state(state, rng, density=0.1)
        anchored.append((await pub.publish(state)).anchored)
    assert any(anchored) and not all(anchored)


async def test_publish_rejects_a_different_model(store: Store) -> None:
    rng = np.random.default_rng(15)
    pub = Publisher(store, RUN)
    state = random_state(rng)
    await pub.publish(state)
    pointer_before = await store.get_bytes(RunLayout(RUN).pointer)
    bad = dict(state)
    bad["norm"] = np.zeros(101, dtype=np.uint16)
    with pytest.raises(ValueError, match="shape"):
        await pub.publish(bad)
    assert await store.get_bytes(RunLayout(RUN).pointer) == pointer_before
    assert pub.version == 0


@pytest.mark.both_backends
async def test_multi_frame_patches_arrive_by_ranged_gets(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    import slime_stoa.protocol.pulse.subscriber as subscriber_module

    monkeypatch.setattr(subscriber_module, "WHOLE_BODY_BYTES", 0)  # force one ranged GET per frame
    rng = np.random.default_rng(16)
    pub = Publisher(store, RUN, PublisherConfig(frame_bytes=256))
    sub = Subscriber(store, RUN)
    gets: list[tuple[int, int | None]] = []
    real_get = store.get

    async def counting_get(key, *, offset=0, length=None, if_none_match=None):
        if key.endswith(".pulse"):
            gets.append((offset, length))
        return await real_get(key, offset=offset, length=length, if_none_match=if_none_match)

    monkeypatch.setattr(store, "get", counting_get)
    states = await publish_versions(pub, rng, 2)
    await sub.sync()
    states.append(step_state(states[-1], rng, density=0.2))
    await pub.publish(states[-1])
    gets.clear()
    result = await sub.sync()
    assert result is not None and result.path == "step"
    manifest = await _manifest(store, 2)
    frames = manifest.patch("step").index.frames
    assert len(frames) > 1 and sorted(gets) == sorted((f.offset, f.length) for f in frames)
    assert_same(sub.state, states[-1])


# ------------------------------------------------------------------------------------------
# Path choice by estimated time


def test_route_estimates_and_ranking():
    speeds = Speeds(download_bytes_s=1e6, request_s=0.1, apply_s_per_change=1e-6, hash_s_per_element=1e-9,
                    load_s_per_element=1e-8)
    step = Route(name="step", requests=1, bytes=50_000, changes=20_000, hashed=2_000_000)
    assert estimate_s(step, speeds) == pytest.approx(0.1 + 0.05 + 0.02 + 0.002)
    anchor = Route(name="anchor", requests=2, bytes=20_000_000, elements=10_000_000)
    assert estimate_s(anchor, speeds) == pytest.approx(0.2 + 20 + 0.1)
    chain = chain_guess(16, step)
    assert (chain.requests, chain.bytes, chain.changes, chain.hashed) == (16, 800_000, 320_000, 2_000_000)
    assert [r.name for r in rank([anchor, chain, step], speeds, "time")] == ["step", "chain", "anchor"]
    # A fast link with slow round trips: one big anchor beats many small patches.
    lan = Speeds(download_bytes_s=1e10, request_s=1.0, apply_s_per_change=1e-6, load_s_per_element=1e-9)
    assert [r.name for r in rank([chain, anchor], lan, "time")] == ["anchor", "chain"]
    # CPU counts too: a chain of dense patches loses to the anchor even on a slow link.
    dense = chain_guess(64, Route(name="step", requests=1, bytes=10_000, changes=5_000_000))
    assert rank([dense, anchor], speeds, "time")[0] is anchor
    tie = Route(name="a", bytes=10), Route(name="b", bytes=5)
    assert [r.name for r in rank(tie, speeds, "time")] == ["b", "a"]  # equal time: fewer bytes first
    # By bytes (the default): the fewest bytes whatever the estimate; equal bytes, the faster.
    assert [r.name for r in rank([chain, anchor], lan)] == ["chain", "anchor"]
    assert rank([dense, anchor], speeds)[0] is dense
    slow = Route(name="slow", bytes=10, requests=9)
    assert [r.name for r in rank([slow, Route(name="fast", bytes=10)], speeds)] == ["fast", "slow"]
    with pytest.raises(ValueError, match="by must be"):
        rank([slow], speeds, "cheapest")  # type: ignore[arg-type]
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="download_bytes_s"):
            Speeds(download_bytes_s=bad)


def test_speed_meter_learns_latency_bandwidth_and_cpu():
    meter = SpeedMeter(Speeds(download_bytes_s=1e6, request_s=0.5), weight=1.0)
    meter.download(1_000, 0.02)  # a small GET measures the latency
    assert meter.speeds.request_s == pytest.approx(0.02) and meter.speeds.download_bytes_s == 1e6
    meter.download(100_000_000, 1.02)  # a large one the bandwidth, less one latency
    assert meter.speeds.download_bytes_s == pytest.approx(1e8)
    # Bandwidth is averaged by bytes: many small slow transfers barely move what a big one showed.
    sized = SpeedMeter(weight=0.3)
    sized.download(200_000_000, 1.0)
    for _ in range(5):
        sized.download(1_000_000, 0.1)  # 10 MB/s on 1 MB objects
    assert sized.speeds.download_bytes_s > 5e7
    meter.apply(1_000_000, 0.05)
    meter.apply(10, 100.0)  # too small to time: ignored
    assert meter.speeds.apply_s_per_change == pytest.approx(5e-8)
    meter.load(50_000_000, 0.5)
    assert meter.speeds.load_s_per_element == pytest.approx(1e-8)
    meter.hash(50_000_000, 0.01)
    meter.hash(10, 5.0)  # too small to time: ignored
    assert meter.speeds.hash_s_per_element == pytest.approx(2e-10)
    meter.download(5_000_000, 0.0)  # no time measured: ignored
    assert meter.speeds.download_bytes_s == pytest.approx(1e8)
    half = SpeedMeter(Speeds(request_s=1.0), weight=0.5)
    half.download(10, 3.0)  # the first measurement replaces the guess ...
    assert half.speeds.request_s == pytest.approx(3.0)
    half.download(10, 1.0)  # ... later ones are averaged in
    assert half.speeds.request_s == pytest.approx(2.0)
    known = SpeedMeter(Speeds(request_s=1.0), weight=0.5, measured=True)  # e.g. saved by a previous run
    known.download(10, 3.0)
    assert known.speeds.request_s == pytest.approx(2.0)
    with pytest.raises(ValueError):
        SpeedMeter(weight=0.0)


async def test_a_lagger_takes_the_faster_of_chain_and_anchor(store: Store) -> None:
    rng = np.random.default_rng(17)
    pub = Publisher(store, RUN, PublisherConfig(anchor_every=4, anchor_fraction=100.0))
    states = await publish_versions(pub, rng, 2)
    by_time = SubscriberConfig(route_by="time")
    slow_link, slow_trips = Subscriber(store, RUN, by_time), Subscriber(store, RUN, by_time)
    for sub in (slow_link, slow_trips):
        await sub.sync()  # at v1; the anchor at v4 will be newer than both
    states += await publish_versions(pub, rng, 5, step_state(states[-1], rng))  # v2..v6
    target = await _manifest(store, 6)
    assert target.anchor.version == 4 and not target.patch("catchup").covers(1)
    # A thin link: five small patches beat an anchor plus a catch-up patch.
    # (Speeds given as measured and barely averaged: the syncs' own measurements do not move them.)
    slow_link.meter = SpeedMeter(Speeds(download_bytes_s=1e3, request_s=1e-3), 1e-9, measured=True)
    result = await slow_link.sync()
    assert result is not None and result.path == "chain" and result.version == 6
    # Fast bytes, slow round trips: two GETs and an anchor beat five GETs.
    slow_trips.meter = SpeedMeter(Speeds(download_bytes_s=1e12, request_s=10.0, load_s_per_element=1e-12), 1e-9,
                                  measured=True)
    result = await slow_trips.sync()
    assert result is not None and result.path == "anchor+catchup" and result.version == 6
    assert result.estimate_s > 20  # three round trips at several seconds each, as ranked
    for sub in (slow_link, slow_trips):
        assert_same(sub.state, states[-1])


async def test_a_chain_reports_the_changed_indices_of_every_version(store: Store) -> None:
    rng = np.random.default_rng(18)
    pub, sub = Publisher(store, RUN, PublisherConfig(catchup=False)), Subscriber(store, RUN)
    states = await publish_versions(pub, rng, 2)
    await sub.sync()
    states += await publish_versions(pub, rng, 4, step_state(states[-1], rng))
    result = await sub.sync()
    assert result is not None and result.path == "chain" and result.changed is not None
    deltas = [diff(a, b) for a, b in itertools.pairwise(states[1:])]
    expected = {
        name: np.unique(np.concatenate([d[name][0] for d in deltas if name in d]))
        for name in {n for d in deltas for n in d}
    }
    assert set(result.changed) == set(expected) and len(result.changed) == len(expected)
    for name, indices in expected.items():
        assert np.array_equal(result.changed[name], indices), name
        assert not result.changed[name].flags.writeable


async def test_a_patch_for_another_base_digest_is_never_applied(store: Store, caplog) -> None:
    rng = np.random.default_rng(19)
    pub = Publisher(store, RUN)
    sub = Subscriber(store, RUN)
    states = await publish_versions(pub, rng, 2)
    await sub.sync()
    assert sub.state is not None
    sub.state["layer.0.w"][0, 0] ^= 1  # the subscriber holds (and knows it holds) another state
    sub.digest = StateDigest.of(sub.state)
    await pub.publish(step_state(states[-1], rng))
    step = (await _manifest(store, 2)).patch("step")
    assert step is not None and step.index.mode == "rel" and step.base_digest != sub.digest.root()
    with caplog.at_level(logging.INFO, logger="stoa.pulse"):
        result = await sub.sync()
    assert result is not None and result.path.startswith("anchor")
    assert "via step" not in caplog.text  # refused before anything was fetched
    assert sub.digest is not None and sub.digest.root() == pub.state_digest


async def test_a_base_relative_catchup_serves_only_its_exact_base(store: Store) -> None:
    from slime_stoa.protocol.pulse.frames import encode_patch
    from slime_stoa.protocol.pulse.manifests import PatchRef

    rng = np.random.default_rng(20)
    pub = Publisher(store, RUN, CATCHUPS)
    by_time = SubscriberConfig(route_by="time")
    at1, at2, tampered = (Subscriber(store, RUN, by_time) for _ in range(3))
    states = await publish_versions(pub, rng, 2)
    for sub in (at1, tampered):
        await sub.sync()
    states += await publish_versions(pub, rng, 1, step_state(states[-1], rng))
    await at2.sync()
    states += await publish_versions(pub, rng, 1, step_state(states[-1], rng))  # v3
    # Replace v3's catch-up patch by a base-relative one from exactly v1 (what a publisher could
    # write for a known base): valid on one state only, named by its digest.
    pointer = Pointer.from_bytes(await store.get_bytes(RunLayout(RUN).pointer))
    manifest = await _manifest(store, 3)
    index, body = encode_patch(states[1], states[3], mode="rel")
    key = RunLayout(RUN).patch(3, manifest.attempt, "catchup", 1)
    await store.put(key, body)
    ref = PatchRef(kind="catchup", key=key, bytes=len(body), count=index.count, base_min=1, base_max=1,
                   base_digest=state_digest(states[1]), index=index)
    patches = tuple(p for p in manifest.patches if p.kind != "catchup") + (ref,)
    await store.put(pointer.manifest, dataclasses.replace(manifest, patches=patches).to_bytes())
    assert tampered.state is not None
    tampered.state["norm"][0] ^= 1
    tampered.digest = StateDigest.of(tampered.state)  # holds (and knows it holds) another v1
    many_trips = Speeds(request_s=1.0, download_bytes_s=1e9)
    for sub in (at1, at2, tampered):
        sub.meter = SpeedMeter(many_trips, 1e-9, measured=True)  # round trips dominate
    results = [await sub.sync() for sub in (at1, at2, tampered)]
    paths = [r.path for r in results if r is not None]
    # The tampered v1 takes a path from the anchor (v2's catch-up or the chain), never v3's catch-up.
    assert paths[:2] == ["catchup", "step"] and paths[2] in ("anchor+chain", "anchor+catchup+chain")
    for sub in (at1, at2, tampered):
        assert_same(sub.state, states[3])


# -- a deferred subscriber: sync stages on lent bytes, their owner installs ---------------------


def copies(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: bits.copy() for name, bits in state.items()}


def read_only(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The owner's bits lent for a sync: views nothing can write through."""
    out = {}
    for name, bits in state.items():
        out[name] = bits.view()
        out[name].flags.writeable = False
    return out


async def test_a_deferred_sync_stages_on_lent_bytes_and_holds_none(store: Store) -> None:
    """Cold start, a step, a catch-up: each sync reads the owner's bytes (read-only views) and
    returns the verified version staged, writing nothing and standing where it stood; the owner
    commits the patch (or takes the new state) and the subscriber then `advance`s."""
    rng = np.random.default_rng(21)
    pub, sub = Publisher(store, RUN), Subscriber(store, RUN, deferred=True)
    states = await publish_versions(pub, rng, 1)
    result = await sub.sync()
    assert result is not None and result.path == "anchor" and result.staged is not None
    assert sub.state is None and sub.version is None and result.staged.state is not None
    owned = result.staged.state  # the owner's from now on
    sub.advance(result.staged)
    assert sub.version == 0 and sub.digest is not None and sub.digest.root() == pub.state_digest
    assert sub.state is None
    assert_same(owned, states[0])

    for behind in (1, 3):
        states += await publish_versions(pub, rng, behind, step_state(states[-1], rng))
        held, version = copies(owned), sub.version
        result = await sub.sync(read_only(owned))
        assert result is not None and result.staged is not None and result.staged.patch is not None
        assert result.path == ("step" if behind == 1 else result.path) and not result.path.startswith("anchor")
        assert sub.version == version and sub.digest is not None and sub.digest.root() == result.staged.base
        assert sub.state is None
        assert_same(owned, held)  # staging only reads
        assert result.changed is not None and set(result.changed) == set(result.touched)
        for name, at in result.changed.items():
            assert not at.flags.writeable and np.all(np.diff(at) > 0)
            changed = np.flatnonzero(held[name].reshape(-1) != states[-1][name].reshape(-1))
            assert np.isin(changed, at).all(), name  # every changed element is named
        undo = result.staged.patch.commit(owned)
        assert_same(owned, states[-1])
        if behind == 1:
            undo.rollback(owned)  # e.g. the model could not take it: the owner never advances the subscriber
            assert_same(owned, held)
            result.staged.patch.commit(owned)
        sub.advance(result.staged)
        assert sub.version == len(states) - 1 and sub.digest.root() == pub.state_digest
        with pytest.raises(ValueError, match="staged on state"):
            sub.advance(result.staged)  # the subscriber stands past the state it was staged on

    states += await publish_versions(pub, rng, 1, step_state(states[-1], rng))
    with pytest.raises(ValueError, match="owner's bytes"):
        await sub.sync()  # holding a version, a deferred sync stages on the owner's bytes only
    result = await sub.sync_to(await _manifest(store, len(states) - 1), read_only(owned))
    assert result.staged is not None and result.staged.patch is not None
    before = copies(owned)
    for state, problem in (
        ({n: a for n, a in owned.items() if n != result.staged.patch.touched[0]}, "not in the state"),
        (read_only(owned), "writeable"),
    ):
        with pytest.raises(ValueError, match=problem):
            result.staged.patch.commit(state)  # nothing written when a tensor cannot take it
        assert_same(owned, before)


async def test_a_deferred_sync_past_a_corrupt_patch_stages_the_next_path(store: Store) -> None:
    rng = np.random.default_rng(22)
    pub, sub = Publisher(store, RUN), Subscriber(store, RUN, deferred=True)
    states = await publish_versions(pub, rng, 2)
    result = await sub.sync()
    assert result is not None and result.staged is not None and result.staged.state is not None
    owned = result.staged.state
    sub.advance(result.staged)
    await pub.publish(step_state(states[-1], rng))
    step = (await _manifest(store, 2)).patch("step")
    assert step is not None
    body = bytearray(await store.get_bytes(step.key))
    body[len(body) // 2] ^= 0x40
    await store.put(step.key, bytes(body))
    held = copies(owned)
    result = await sub.sync(read_only(owned))
    assert result is not None and result.path != "step" and result.staged is not None
    assert sub.version == 1 and sub.state is None
    assert_same(owned, held)
    if result.staged.patch is not None:
        result.staged.patch.commit(owned)
    else:
        assert result.staged.state is not None
        owned = result.staged.state
    sub.advance(result.staged)
    assert sub.version == 2 and sub.digest is not None and sub.digest.root() == pub.state_digest
    assert StateDigest.of(owned).root() == pub.state_digest  # the owner's bytes are the version


async def test_a_forgotten_version_is_restored_from_the_anchor(store: Store) -> None:
    """The owner's bytes match no version any more (an install stopped half-way): after `forget`
    the same pointer is read again and the sync brings a whole verified state, from the anchor;
    an older pointer than the version left is still refused meanwhile."""
    rng = np.random.default_rng(23)
    pub, sub = Publisher(store, RUN), Subscriber(store, RUN, deferred=True)
    states = await publish_versions(pub, rng, 3)
    result = await sub.sync()
    assert result is not None and result.staged is not None
    sub.advance(result.staged)
    assert await sub.sync(read_only(states[-1])) is None  # nothing new
    sub.forget()
    assert sub.version is None and sub.floor is not None and sub.floor.version == len(states) - 1
    result = await sub.sync()
    assert result is not None and result.path.startswith("anchor") and result.staged is not None
    assert result.staged.state is not None and StateDigest.of(result.staged.state).root() == pub.state_digest
    sub.advance(result.staged)
    assert sub.version == len(states) - 1
