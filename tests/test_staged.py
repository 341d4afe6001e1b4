"""pulse.staged: verify patches without writing the state, then commit them; equal to apply_patch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from slime_stoa.protocol.pulse import staged as staged_module
from slime_stoa.protocol.pulse.apply import apply_patch
from slime_stoa.protocol.pulse.codec import PatchCorrupt, diff, merge_deltas, shapes_of
from slime_stoa.protocol.pulse.digest import StateDigest, state_digest
from slime_stoa.protocol.pulse.frames import encode_delta, encode_patch
from slime_stoa.protocol.pulse.staged import StageError, stage_patches

State = dict[str, np.ndarray]


def make_state(rng: np.random.Generator) -> State:
    return {
        "a.weight": rng.integers(0, 1 << 16, size=(64, 48), dtype=np.uint16),
        "b.bias": rng.integers(0, 1 << 16, size=(300,), dtype=np.uint16),
        "c.weight": rng.integers(0, 1 << 16, size=(7, 5, 3), dtype=np.uint16),
    }


def step(state: State, rng: np.random.Generator, density: float = 0.05, skip: str | None = None) -> State:
    """A copy with ~`density` of each tensor (but `skip`) changed."""
    new = {name: bits.copy() for name, bits in state.items()}
    for name, bits in new.items():
        if name == skip:
            continue
        flat = bits.reshape(-1)
        at = np.flatnonzero(rng.random(flat.size) < density)
        flat[at] = rng.integers(0, 1 << 16, size=at.size, dtype=np.uint16)
    return new


def copy(state: State) -> State:
    return {name: bits.copy() for name, bits in state.items()}


def same(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def frames_of(index, body: bytes) -> dict[int, bytes]:
    return {i: body[f.offset : f.offset + f.length] for i, f in enumerate(index.frames)}


@pytest.mark.parametrize("mode", ["abs", "rel"])
@pytest.mark.parametrize("frame_bytes", [1 << 20, 64], ids=["one-frame", "many-frames"])
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "hashed-in-7-element-chunks"])
def test_a_chain_stages_to_what_apply_patch_writes(mode: str, frame_bytes: int, chunk: int | None, monkeypatch) -> None:
    if chunk is not None:
        monkeypatch.setattr(staged_module, "HASH_CHUNK", chunk)
    rng = np.random.default_rng(1)
    states = [make_state(rng)]
    for i in range(3):  # overlapping writes across patches; one patch leaves a tensor alone
        states.append(step(states[-1], rng, skip="b.bias" if i == 1 else None))
    patches = []
    for base, new in itertools.pairwise(states):
        index, body = encode_patch(base, new, mode=mode, frame_bytes=frame_bytes, threads=1)
        patches.append((index, frames_of(index, body)))
    live = copy(states[0])
    before = copy(live)
    staged = stage_patches(live, StateDigest.of(live), patches, state_digest(states[-1]))
    assert same(live, before)  # staging only reads
    assert staged.digest.root() == state_digest(states[-1])
    undo = staged.commit(live)
    assert same(live, states[-1])
    reference = copy(states[0])
    for index, frames in patches:
        apply_patch(reference, index, frames)
    assert same(live, reference)
    for w in staged.writes:  # sorted unique indices, exactly the elements any patch wrote
        assert np.all(np.diff(w.indices) > 0)
    # what it cost, for the receiver's path choice: every patch's changes, every touched tensor hashed
    assert staged.changes == sum(index.count for index, _ in patches)
    assert staged.hashed == sum(live[w.name].size for w in staged.writes) and staged.touched == tuple(sorted(live))
    assert staged.apply_s > 0 and staged.hash_s > 0
    assert all(w.indices.dtype == np.int32 for w in staged.writes)  # 6 bytes a change held, not 10
    undo.rollback(live)
    assert same(live, before)


def test_a_merged_catchup_patch_stages_like_its_chain() -> None:
    rng = np.random.default_rng(2)
    s0 = make_state(rng)
    s1 = step(s0, rng)
    s2 = step(s1, rng)
    merged = merge_deltas([diff(s0, s1), diff(s1, s2)])
    index, body = encode_delta(merged, shapes_of(s2), threads=1)
    live = copy(s0)
    staged = stage_patches(live, StateDigest.of(live), [(index, frames_of(index, body))], state_digest(s2))
    staged.commit(live)
    assert same(live, s2)


def test_a_wrong_target_or_a_damaged_frame_writes_nothing() -> None:
    rng = np.random.default_rng(3)
    s0 = make_state(rng)
    s1 = step(s0, rng)
    index, body = encode_patch(s0, s1, frame_bytes=64, threads=1)
    frames = frames_of(index, body)
    live = copy(s0)
    digest = StateDigest.of(live)
    with pytest.raises(StageError, match="state digest"):
        stage_patches(live, digest, [(index, frames)], state_digest(s0))
    bad = dict(frames)
    bad[0] = bytes([bad[0][0] ^ 1]) + bad[0][1:]
    with pytest.raises(PatchCorrupt):
        stage_patches(live, digest, [(index, bad)], state_digest(s1))
    with pytest.raises(ValueError, match="missing"):
        stage_patches(live, digest, [(index, {0: frames[0]})], state_digest(s1))
    with pytest.raises(ValueError, match="not in the state"):
        stage_patches({n: b for n, b in live.items() if n != "a.weight"}, digest, [(index, frames)], state_digest(s1))
    assert same(live, s0)


def test_a_failed_commit_restores_the_state() -> None:
    rng = np.random.default_rng(4)
    s0 = make_state(rng)
    s1 = step(s0, rng)
    index, body = encode_patch(s0, s1, threads=1)
    live = copy(s0)
    staged = stage_patches(live, StateDigest.of(live), [(index, frames_of(index, body))], state_digest(s1))
    live["c.weight"] = live["c.weight"][:1].copy()  # the last tensor no longer takes its writes
    with pytest.raises(ValueError, match=r"c\.weight"):
        staged.commit(live)  # found before anything is written
    assert same({n: b for n, b in live.items() if n != "c.weight"}, {n: b for n, b in s0.items() if n != "c.weight"})
    lent = copy(s0)
    for bits in lent.values():
        bits.flags.writeable = False  # bytes lent for staging only
    again = stage_patches(lent, StateDigest.of(lent), [(index, frames_of(index, body))], state_digest(s1))
    with pytest.raises(ValueError, match="writeable"):
        again.commit(lent)
    assert same(lent, s0)
