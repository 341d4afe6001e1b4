"""`codec.merge_deltas` as the publisher uses it for its catch-up union each version: two deltas
merged in one pass (`_merge_two`) give what a stable sort of both gives, as do three (a resume's
merge, sorted, in segments), on any thread count; a tensor only one delta changes keeps that
delta's arrays, read-only, with no copy; the inputs are left as they were."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_stoa.protocol.pulse import codec
from slime_stoa.protocol.pulse.codec import Delta, merge_deltas


def sorted_merge(deltas: list[Delta]) -> Delta:
    """The reference: every entry concatenated, stably sorted, the last of each position kept."""
    out: Delta = {}
    for name in sorted({n for d in deltas for n in d}):
        parts = [d[name] for d in deltas if name in d]
        indices = np.concatenate([p[0] for p in parts])
        values = np.concatenate([p[1] for p in parts])
        order = np.argsort(indices, kind="stable")
        indices, values = indices[order], values[order]
        last = np.ones(indices.size, dtype=bool)
        last[:-1] = indices[1:] != indices[:-1]
        out[name] = (indices[last], values[last])
    return out


def entry(rng: np.random.Generator, size: int, density: float) -> tuple[np.ndarray, np.ndarray]:
    indices = np.flatnonzero(rng.random(size) < density).astype(np.int64)
    return indices, rng.integers(0, 1 << 16, indices.size, dtype=np.uint16)


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    size=st.integers(1, 300),
    densities=st.tuples(st.sampled_from([0.0, 0.01, 0.3, 1.0]), st.sampled_from([0.0, 0.01, 0.3, 1.0])),
    segment=st.sampled_from([4, 1 << 20]),
    threads=st.sampled_from([1, 3]),
    three=st.booleans(),
)
def test_deltas_merge_as_the_sorted_merge(
    seed: int, size: int, densities: tuple[float, float], segment: int, threads: int, three: bool
) -> None:
    rng = np.random.default_rng(seed)
    older = {"w": entry(rng, size, densities[0]), "old only": entry(rng, 50, 0.2)}
    newer = {"w": entry(rng, size, densities[1]), "new only": entry(rng, 40, 0.3)}
    deltas = [older, newer] + ([{"w": entry(rng, size, 0.1), "old only": entry(rng, 50, 0.5)}] if three else [])
    copies = [{n: (i.copy(), v.copy()) for n, (i, v) in d.items()} for d in deltas]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "MERGE_SEGMENT", segment)  # ranges of positions of 3+ deltas: separate tasks
        merged = merge_deltas(deltas, threads=threads)
    want = sorted_merge(deltas)
    assert merged.keys() == want.keys()
    for name, (indices, values) in want.items():
        got_i, got_v = merged[name]
        assert got_i.dtype == np.int64 and got_v.dtype == np.uint16, name
        assert np.array_equal(got_i, indices) and np.array_equal(got_v, values), name
    for given_, kept in zip(deltas, copies, strict=True):  # nothing written in place
        for name, (indices, values) in kept.items():
            assert np.array_equal(given_[name][0], indices) and np.array_equal(given_[name][1], values)


def test_edges_of_the_two_way_merge() -> None:
    a = (np.array([2, 5, 9], dtype=np.int64), np.array([1, 2, 3], dtype=np.uint16))
    cases = {
        "disjoint, interleaved": (np.array([0, 3, 10], dtype=np.int64), np.array([7, 8, 9], dtype=np.uint16)),
        "every position shared": (np.array([2, 5, 9], dtype=np.int64), np.array([4, 5, 6], dtype=np.uint16)),
        "all below": (np.array([0, 1], dtype=np.int64), np.array([4, 5], dtype=np.uint16)),
        "all above": (np.array([11, 12], dtype=np.int64), np.array([4, 5], dtype=np.uint16)),
        "some shared, at both ends": (np.array([2, 6, 9], dtype=np.int64), np.array([4, 5, 6], dtype=np.uint16)),
        "empty": (np.empty(0, np.int64), np.empty(0, np.uint16)),
    }
    for what, b in cases.items():
        for pair in ([{"t": a}, {"t": b}], [{"t": b}, {"t": a}]):
            got, want = merge_deltas(pair)["t"], sorted_merge(pair)["t"]
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), what


def test_a_tensor_one_delta_changes_is_shared_read_only_not_copied() -> None:
    """The union's tensors a step leaves alone, and the step's tensors new to the union, cost no
    copy: the merged delta views their arrays, and cannot write them."""
    rng = np.random.default_rng(3)
    union = {"untouched": entry(rng, 1000, 0.2), "both": entry(rng, 1000, 0.2)}
    step = {"both": entry(rng, 1000, 0.01), "new": entry(rng, 1000, 0.05)}
    merged = merge_deltas([union, step])
    for name, source in (("untouched", union), ("new", step)):
        for got, given_ in zip(merged[name], source[name], strict=True):
            assert np.shares_memory(got, given_) and not got.flags.writeable, name
        with pytest.raises(ValueError, match="read-only"):
            merged[name][1][0] = 1
    assert step["new"][1].flags.writeable  # the caller's own arrays stay writable
    for got, given_ in zip(merged["both"], union["both"], strict=True):  # merged: new arrays
        assert not np.shares_memory(got, given_) and got.flags.writeable
