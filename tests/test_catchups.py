"""Bounded catch-ups: the schedule, the trainer's upload bound, and laggers that never download more
than the cheapest path the manifests offer."""

from __future__ import annotations

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.catchup import catchup_due, within_budget
from slime_stoa.protocol.pulse.history import read_manifest
from slime_stoa.protocol.pulse.manifests import Pointer, VersionManifest
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.store import Store

RUN = "catchups"
HEAD = 33  # lags 1..32 from v1..v32; v0 is the anchor


def test_the_schedule_and_the_budget():
    due = [d for d in range(70) if catchup_due(d)]
    assert due == [2, 4, 8, 16, 32, 64]  # one past the anchor never: the step patch is that change
    assert within_budget(100, 50, 100, 1.5) and not within_budget(100, 51, 100, 1.5)
    assert not within_budget(0, 100, 100, 1.5) and within_budget(0, 99, 100, 1.5)  # no cheaper than the chain
    with pytest.raises(ValueError, match="catchup_budget"):
        PublisherConfig(catchup_budget=-1.0)


def tiny_states(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """bf16 states of a tiny model: each step rewrites ~2% of the weights, half of them among a
    hot set (elements that training keeps changing), so unions grow slower than sums."""
    rng = np.random.default_rng(seed)
    state = {
        "embed": rng.integers(0, 1 << 15, (64, 32), dtype=np.uint16),
        "layer.0.w": rng.integers(0, 1 << 15, (32, 32), dtype=np.uint16),
        "norm": rng.integers(0, 1 << 15, (32,), dtype=np.uint16),
    }
    hot = {name: rng.choice(a.size, a.size // 20, replace=False) for name, a in state.items()}
    states = [state]
    for _ in range(n - 1):
        state = {name: a.copy() for name, a in state.items()}
        for name, a in state.items():
            flat = a.reshape(-1)
            at = np.concatenate([rng.choice(hot[name], max(1, a.size // 100)), rng.integers(0, a.size, max(1, a.size // 100))])
            flat[at] = rng.integers(0, 1 << 15, at.size, dtype=np.uint16)
        states.append(state)
    return states


async def manifests_by_version(store: Store) -> dict[int, VersionManifest]:
    pointer = Pointer.from_bytes(await store.get_bytes(RunLayout(RUN).pointer))
    out: dict[int, VersionManifest] = {}
    key: str | None = pointer.manifest
    while key is not None:
        m = await read_manifest(store, key)
        out[m.version] = m
        key = m.parent.manifest if m.parent else None
    return out


def cheapest_bytes(ms: dict[int, VersionManifest], base: int, head: int) -> int:
    """The fewest bytes from version `base` to `head`, from the manifests alone: the chain of step
    patches, a catch-up covering `base` plus the steps after it, or the anchor (plus the cheapest
    of those from it)."""

    def from_state(b: int) -> float:
        best = float(sum(ms[v].patch("step").bytes for v in range(b + 1, head + 1)))  # type: ignore[union-attr]
        for c in range(b + 1, head + 1):
            cu = ms[c].patch("catchup")
            if cu is not None and cu.covers(b):
                best = min(best, cu.bytes + sum(ms[v].patch("step").bytes for v in range(c + 1, head + 1)))  # type: ignore[union-attr]
        return best

    target = ms[head]
    anchor = target.anchor_bytes + (from_state(target.anchor.version) if target.anchor.version < head else 0)
    return int(min(from_state(base), anchor))


async def test_a_lagger_at_every_lag_downloads_the_cheapest_path_and_the_upload_stays_bounded(store: Store) -> None:
    states = tiny_states(HEAD + 1, seed=5)
    pub = Publisher(store, RUN, PublisherConfig(anchor_every=1000, anchor_fraction=1e9))
    follower = Subscriber(store, RUN)
    laggers: dict[int, Subscriber] = {}
    results = []
    for v, state in enumerate(states):
        results.append(await pub.publish(state))
        await follower.sync()
        if 1 <= v < HEAD:  # a subscriber left at each of v1..v32
            sub = Subscriber(store, RUN)
            assert follower.state is not None
            sub.state = {n: a.copy() for n, a in follower.state.items()}
            sub.version, sub.digest, sub.current = follower.version, follower.digest, follower.current
            laggers[HEAD - v] = sub
    ms = await manifests_by_version(store)
    # Catch-ups only at powers of two from the anchor, within 1.5x the step bytes over the interval.
    assert [v for v in range(1, HEAD + 1) if ms[v].patch("catchup")] == [2, 4, 8, 16, 32]
    step_bytes = sum(r.patch_bytes for r in results[1:])
    catchup_bytes = sum(r.catchup_bytes for r in results[1:])
    assert 0 < catchup_bytes <= 1.5 * step_bytes
    chosen = set()
    for lag, sub in sorted(laggers.items()):
        result = await sub.sync()
        assert result is not None and result.version == HEAD, lag
        assert result.bytes <= cheapest_bytes(ms, HEAD - lag, HEAD), (lag, result.path)
        assert sub.digest is not None and sub.digest.root() == ms[HEAD].state_digest == pub.state_digest
        for name, bits in states[HEAD].items():
            assert np.array_equal(sub.state[name], bits), (lag, name)  # type: ignore[index]
        chosen.add(result.path)
    assert {"step", "chain", "catchup+chain"} <= chosen  # the catch-ups serve some lags


async def test_a_resumed_publisher_writes_the_catchup_an_uninterrupted_one_writes(store: Store) -> None:
    states = tiny_states(9, seed=6)
    uninterrupted = Publisher(store, "whole", PublisherConfig(anchor_every=1000, anchor_fraction=1e9))
    for state in states:
        whole = await uninterrupted.publish(state)
    first = Publisher(store, RUN, PublisherConfig(anchor_every=1000, anchor_fraction=1e9))
    for state in states[:7]:  # v0..v6: the union since the anchor is the catch-up at v4 and two steps
        await first.publish(state)
    resumed = Publisher(store, RUN, PublisherConfig(anchor_every=1000, anchor_fraction=1e9))
    assert await resumed.open() == 6
    await resumed.publish(states[7])
    last = await resumed.publish(states[8])
    assert last.version == 8 and last.catchup_bytes == whole.catchup_bytes > 0
    ms = await manifests_by_version(store)
    cu = ms[8].patch("catchup")
    assert cu is not None and cu.covers(0) and cu.covers(7)
    lagger = Subscriber(store, RUN)  # cold: anchor + the catch-up at v8
    got = await lagger.sync()
    assert got is not None and got.path == "anchor+catchup" and lagger.digest is not None
    assert lagger.digest.root() == ms[8].state_digest
