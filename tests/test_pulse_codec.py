"""Tests of the PULSE codec: diff, frames, in-place apply with rollback, digests."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import math
import pickle

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_stoa.protocol.pulse.apply import ChangedIndices, UndoEntry, UndoLog, apply_patch
from slime_stoa.protocol.pulse.codec import (
    PatchCorrupt,
    bf16_bits_to_float32,
    changed_indices,
    diff,
    float32_to_bf16_bits,
    from_rel_codes,
    merge_deltas,
    rel_codes,
    shapes_of,
)
from slime_stoa.protocol.pulse.digest import StateDigest, state_digest, tensor_digest
from slime_stoa.protocol.pulse.frames import (
    FORMAT,
    PatchIndex,
    decode_frame,
    encode_delta,
    encode_patch,
    frame_slice,
    verify_frame,
)
from slime_stoa.protocol.pulse.manifests import ManifestError, PatchRef
from slime_stoa.protocol.pulse.patch_index import MAX_INDEX_BYTES, validate_index

# ±0, ±inf, NaNs with various payloads and signs, denormals, ±1.
SPECIAL = np.array(
    [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x7FFF, 0xFFFF, 0xFF81, 0x7FA5,
     0x0001, 0x8001, 0x007F, 0x807F, 0x0040, 0x3F80, 0xBF80],
    dtype=np.uint16,
)
SHAPES = [(), (0,), (3, 0), (1,), (7,), (17, 33), (5, 4, 3), (300, 70)]


def random_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    n = math.prod(shape)
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    special = rng.random(n) < 0.3
    bits[special] = rng.choice(SPECIAL, int(special.sum()))
    return bits.reshape(shape)


def random_state(rng: np.random.Generator, shapes=SHAPES) -> dict[str, np.ndarray]:
    return {f"layer.{i}.w": random_bits(rng, s) for i, s in enumerate(shapes)}


def mutate(rng: np.random.Generator, state, density: float) -> dict[str, np.ndarray]:
    """A copy of `state` with about `density` of the elements given new bits: one-ULP moves,
    special values (NaN payloads, signed zeros, infinities, denormals) or random bits."""
    new = {}
    for name, bits in state.items():
        out = bits.copy()
        flat = out.reshape(-1)
        pick = np.flatnonzero(rng.random(flat.size) < density)
        kind = rng.integers(0, 3, pick.size)
        ulp = flat[pick] + rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), pick.size)
        flat[pick] = np.where(kind == 0, ulp, np.where(
            kind == 1, rng.choice(SPECIAL, pick.size), rng.integers(0, 1 << 16, pick.size, dtype=np.uint16)))
        new[name] = out
    return new


def copy_state(state):
    return {name: bits.copy(order="K") for name, bits in state.items()}


def all_frames(index: PatchIndex, body: bytes) -> dict[int, bytes]:
    return {i: frame_slice(index, i, body) for i in range(len(index.frames))}


def assert_same(a, b) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert np.array_equal(a[name], b[name]), name


def json_round_trip(index: PatchIndex) -> PatchIndex:
    return PatchIndex.from_json(json.loads(json.dumps(index.to_json())))


def reindexed(index: PatchIndex, frames) -> PatchIndex:
    """`index` with these frames, offsets recomputed, parsed back (so it is validated)."""
    offset, out = 0, []
    for frame in frames:
        out.append(dataclasses.replace(frame, offset=offset))
        offset += frame.length
    return json_round_trip(dataclasses.replace(index, frames=tuple(out)))


def forge_frame(index: PatchIndex, i: int, blob: bytes, **changes) -> PatchIndex:
    """An index whose frame i matches `blob` (length, digest, later offsets), as an attacker or
    a buggy producer could publish; `changes` overrides fields of that frame's first entry."""
    import xxhash

    frame = index.frames[i]
    entries = (dataclasses.replace(frame.entries[0], **changes), *frame.entries[1:])
    streams = (len(blob) - sum(frame.streams[1:]), *frame.streams[1:])  # blob: a new section-0 stream + the rest
    forged = dataclasses.replace(frame, length=len(blob), digest=xxhash.xxh3_128(blob).hexdigest(),
                                 entries=entries, streams=streams)
    return reindexed(index, [*index.frames[:i], forged, *index.frames[i + 1:]])


def with_section0(index: PatchIndex, i: int, frame: bytes, stream: bytes) -> bytes:
    """Frame i's bytes with its section-0 stream replaced."""
    return stream + frame[index.frames[i].streams[0]:]


# ------------------------------------------------------------------------------------------
# Round trips


shape_st = st.lists(st.integers(0, 12), min_size=0, max_size=3).map(tuple)


@settings(max_examples=150, deadline=None)
@given(
    shapes=st.lists(shape_st, min_size=1, max_size=5),
    seed=st.integers(0, 2**32 - 1),
    density=st.sampled_from([0.0, 0.02, 0.3, 1.0]),
    mode=st.sampled_from(["abs", "rel"]),
    frame_bytes=st.sampled_from([16, 300, 16 << 20]),
)
def test_round_trip_is_bit_identical(shapes, seed, density, mode, frame_bytes):
    rng = np.random.default_rng(seed)
    base = random_state(rng, shapes)
    new = mutate(rng, base, density)
    index, body = encode_patch(base, new, mode=mode, frame_bytes=frame_bytes)
    assert json_round_trip(index) == index and index.to_json()["format"] == FORMAT
    assert PatchIndex.from_bytes(index.to_bytes()) == index
    assert all(len(f.streams) == 4 and sum(f.streams) == f.length for f in index.frames)
    assert index.mode == mode and index.body_size == len(body)
    delta = diff(base, new)
    assert index.count == sum(i.size for i, _ in delta.values())
    state = copy_state(base)
    undo = apply_patch(state, index, all_frames(index, body))
    assert_same(state, new)
    assert state_digest(state) == state_digest(new)
    assert undo.touched == index.touched == tuple(sorted(delta))
    undo.rollback(state)
    assert_same(state, base)


@pytest.mark.parametrize("mode", ["abs", "rel"])
def test_special_bit_patterns_are_changes(mode):
    base = {"w": np.array([0x0000, 0x7FC0, 0x7FC0, 0x7F80, 0x0001, 0x3F80, 0xFFC1], dtype=np.uint16)}
    new = {"w": np.array([0x8000, 0x7FC1, 0x7FC0, 0xFF80, 0x0002, 0x3F80, 0xFFC1], dtype=np.uint16)}
    delta = diff(base, new)
    # +0 -> -0, NaN payload, inf sign and a denormal changed; unchanged NaNs are no change.
    assert delta["w"][0].tolist() == [0, 1, 3, 4]
    index, body = encode_patch(base, new, mode=mode)
    state = copy_state(base)
    apply_patch(state, index, all_frames(index, body))
    assert_same(state, new)


def test_no_change_is_an_empty_patch():
    state = random_state(np.random.default_rng(1))
    index, body = encode_patch(state, copy_state(state))
    assert index.frames == () and body == b"" and index.touched == ()
    before = copy_state(state)
    undo = apply_patch(state, json_round_trip(index), {})
    assert undo == UndoLog() and undo.touched == ()
    assert_same(state, before)


@pytest.mark.parametrize("mode", ["abs", "rel"])
def test_multi_frame_patch_applies_in_any_order(mode):
    rng = np.random.default_rng(2)
    base = {"big": random_bits(rng, (400, 300)), "small": random_bits(rng, (5,)), "zero": random_bits(rng, ())}
    new = mutate(rng, base, 0.05)
    new["big"].reshape(-1)[:500] ^= 1  # an all-changed run
    new["zero"] ^= 0x8000
    index, body = encode_patch(base, new, mode=mode, frame_bytes=1000)
    assert len(index.frames) > 5
    big_frames = [f for f in index.frames if any(e.name == "big" for e in f.entries)]
    assert len(big_frames) > 1  # the big tensor was split at index boundaries
    state = copy_state(base)
    frames = all_frames(index, body)
    apply_patch(state, index, ((i, frames[i]) for i in reversed(range(len(frames)))))
    assert_same(state, new)


def test_all_changed_tensor_and_threads_do_not_change_output():
    rng = np.random.default_rng(3)
    base = {"a": random_bits(rng, (64, 64)), "b": random_bits(rng, (1000,))}
    new = {"a": base["a"] ^ np.uint16(1), "b": base["b"].copy()}
    new["b"][::3] += 1
    one = encode_patch(base, new, frame_bytes=2000, threads=1)
    many = encode_patch(base, new, frame_bytes=2000, threads=4)
    assert one == many
    serial, parallel = diff(base, new, threads=1), diff(base, new, threads=None)
    assert serial.keys() == parallel.keys()
    assert all(np.array_equal(serial[n][k], parallel[n][k]) for n in serial for k in (0, 1))
    index, body = one
    assert index.count == 64 * 64 + len(range(0, 1000, 3))
    state = copy_state(base)
    apply_patch(state, index, all_frames(index, body))
    assert_same(state, new)


def test_decode_frame_gives_indices_and_values_or_rel_codes():
    rng = np.random.default_rng(4)
    base = {"w": random_bits(rng, (50, 20))}
    new = mutate(rng, base, 0.1)
    (indices, values), = diff(base, new).values()
    index, body = encode_patch(base, new)
    (name, got_i, got_v), = decode_frame(index, 0, body)
    assert name == "w" and np.array_equal(got_i, indices) and np.array_equal(got_v, values)
    index, body = encode_patch(base, new, mode="rel")
    (_, got_i, got_v), = decode_frame(index, 0, body)
    assert np.array_equal(got_v, rel_codes(base["w"].reshape(-1)[indices], values))


# ------------------------------------------------------------------------------------------
# Merged (catch-up) deltas


def test_merge_keeps_the_newest_value():
    older = {"a": (np.array([1, 3, 5]), np.array([10, 30, 50], dtype=np.uint16))}
    newer = {"a": (np.array([3, 4]), np.array([33, 44], dtype=np.uint16)),
             "b": (np.array([0]), np.array([7], dtype=np.uint16))}
    merged = merge_deltas([older, newer])
    assert merged["a"][0].tolist() == [1, 3, 4, 5]
    assert merged["a"][1].tolist() == [10, 33, 44, 50]
    assert merged["b"][0].tolist() == [0] and merged["b"][1].tolist() == [7]


@pytest.mark.parametrize("mode", ["abs", "rel"])
def test_merged_patch_equals_applying_the_chain(mode):
    rng = np.random.default_rng(5)
    chain = [random_state(rng)]
    for density in (0.05, 0.2, 0.0, 0.05):
        chain.append(mutate(rng, chain[-1], density))
    deltas = [diff(a, b) for a, b in itertools.pairwise(chain)]
    replayed = copy_state(chain[0])
    for a, b in itertools.pairwise(chain):
        index, body = encode_patch(a, b)
        apply_patch(replayed, index, all_frames(index, body))
    index, body = encode_delta(merge_deltas(deltas), shapes_of(chain[-1]), base=chain[0], mode=mode,
                               frame_bytes=500)
    merged = copy_state(chain[0])
    apply_patch(merged, index, all_frames(index, body))
    assert_same(merged, replayed)
    assert_same(merged, chain[-1])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 6))
def test_merge_of_random_deltas_equals_sequential_application(seed, length):
    rng = np.random.default_rng(seed)
    state = random_state(rng, [(9,), (4, 5), ()])
    expected = copy_state(state)
    deltas = []
    for _ in range(length):
        delta = {}
        for name, bits in state.items():
            if bits.size and rng.random() < 0.7:
                indices = np.flatnonzero(rng.random(bits.size) < 0.5).astype(np.int64)
                values = rng.integers(0, 1 << 16, indices.size, dtype=np.uint16)
                delta[name] = (indices, values)
                expected[name].reshape(-1)[indices] = values
        deltas.append(delta)
    merged = merge_deltas(deltas)
    for indices, _ in merged.values():
        assert np.all(np.diff(indices) > 0)
    for name, (indices, values) in merged.items():
        state[name].reshape(-1)[indices] = values
    assert_same(state, expected)


def test_rollback_restores_overlapping_writes():
    # Two patches' frames under one index (as a careless producer could publish): the same
    # positions are written twice, and rollback must still restore the first bits.
    rng = np.random.default_rng(14)
    v0 = random_state(rng)
    v1 = mutate(rng, v0, 0.5)
    v2 = mutate(rng, v1, 0.5)
    first, body1 = encode_patch(v0, v1)
    second, body2 = encode_patch(v1, v2)
    both = reindexed(first, first.frames + second.frames)
    state = copy_state(v0)
    undo = apply_patch(state, both, all_frames(both, body1 + body2))
    assert_same(state, v2)
    undo.rollback(state)
    assert_same(state, v0)


# ------------------------------------------------------------------------------------------
# Failures leave the state untouched


def patched_setup(seed=6, frame_bytes=200):
    rng = np.random.default_rng(seed)
    base = {"a": random_bits(rng, (40, 30)), "b": random_bits(rng, (900,)), "c": random_bits(rng, (3,))}
    new = mutate(rng, base, 0.1)
    new["c"][0] ^= 1
    index, body = encode_patch(base, new, frame_bytes=frame_bytes)
    assert len(index.frames) >= 3
    return base, new, index, all_frames(index, body)


def assert_apply_fails(base, index, frames, error, match):
    state = copy_state(base)
    with pytest.raises(error, match=match):
        apply_patch(state, index, frames)
    assert_same(state, base)


def test_corrupted_byte_in_a_later_frame_rolls_back_earlier_frames():
    base, _, index, frames = patched_setup()
    last = len(frames) - 1
    damaged = bytearray(frames[last])
    damaged[len(damaged) // 2] ^= 0x10
    frames[last] = bytes(damaged)
    with pytest.raises(PatchCorrupt, match=f"frame {last}: digest"):
        verify_frame(index, last, frames[last])
    assert_apply_fails(base, index, frames, PatchCorrupt, f"frame {last}")


def test_truncated_frame_is_corrupt():
    base, _, index, frames = patched_setup()
    frames[1] = frames[1][:-5]
    assert_apply_fails(base, index, frames, PatchCorrupt, "frame 1: got")


def test_wrong_digest_in_index_is_corrupt():
    base, _, index, frames = patched_setup()
    wrong = dataclasses.replace(index.frames[0], digest="0" * 32)
    assert_apply_fails(base, reindexed(index, (wrong, *index.frames[1:])), frames, PatchCorrupt, "frame 0: digest")


def test_garbage_frame_with_matching_digest_is_corrupt_not_a_crash():
    base, _, index, frames = patched_setup()
    garbage = np.random.default_rng(7).integers(0, 256, 300, dtype=np.uint8).tobytes()
    frames[2] = with_section0(index, 2, frames[2], garbage)
    assert_apply_fails(base, forge_frame(index, 2, frames[2]), frames, PatchCorrupt, "frame 2.*: not a zstd")


def test_frame_declaring_another_size_is_rejected_before_decompressing():
    base, _, index, frames = patched_setup()
    expected = index.frames[2].section_totals()[0]
    original = frames[2]
    for blob in (
        zstandard.ZstdCompressor().compress(b"\0" * (expected + 1)),
        zstandard.ZstdCompressor().compress(b"\0" * (1 << 24)),  # a zip bomb
    ):
        frames[2] = with_section0(index, 2, original, blob)
        assert_apply_fails(base, forge_frame(index, 2, frames[2]), frames, PatchCorrupt, "zstd header declares")


def test_truncated_zstd_stream_with_matching_digest_is_corrupt():
    base, _, index, frames = patched_setup()
    first = index.frames[1].streams[0]
    frames[1] = with_section0(index, 1, frames[1], frames[1][: first - 3])
    assert_apply_fails(base, forge_frame(index, 1, frames[1]), frames, PatchCorrupt, "frame 1")


def test_index_out_of_range_is_corrupt_and_rolled_back():
    rng = np.random.default_rng(8)
    base = {"a": random_bits(rng, (20,)), "b": random_bits(rng, (100,))}
    new = copy_state(base)
    new["a"][3] ^= 1
    new["b"][[10, 90]] ^= 1
    index, body = encode_patch(base, new, frame_bytes=1)
    assert [f.entries[0].name for f in index.frames] == ["a", "b", "b"]
    # Claim "b" has 50 elements, and give the state that shape: frame 1 fits, frame 2 does not.
    frames = all_frames(index, body)
    lying = forge_frame(forge_frame(index, 1, frames[1], shape=[50]), 2, frames[2], shape=[50])
    state = copy_state(base)
    state["b"] = state["b"][:50].copy()
    before = copy_state(state)
    with pytest.raises(PatchCorrupt, match=r"frame 2, tensor 'b'.*out of range"):
        apply_patch(state, lying, frames)
    assert_same(state, before)


def test_inconsistent_long_code_count_is_corrupt():
    base = {"w": np.zeros(70000, dtype=np.uint16)}
    new = copy_state(base)
    new["w"][[5, 60000]] = 1
    index, body = encode_patch(base, new)
    entry = index.frames[0].entries[0]
    assert (entry.width, entry.high) == (2, 1)
    # Rewrite the bitmap so it marks both codes as long, keeping every size unchanged.
    s0, s1, s2, s3 = index.frames[0].streams
    upper = bytearray(zstandard.ZstdDecompressor().decompress(body[s0 : s0 + s1]))
    upper[0] = 0b11000000
    blob = body[:s0] + zstandard.ZstdCompressor().compress(bytes(upper)) + body[s0 + s1 :]
    frame = dataclasses.replace(index.frames[0], streams=(s0, len(blob) - len(body) + s1, s2, s3))
    forged = forge_frame(dataclasses.replace(index, frames=(frame,)), 0, blob)
    assert_apply_fails(base, forged, {0: blob}, PatchCorrupt, "bitmap marks 2")


def test_state_that_does_not_fit_is_a_value_error():
    base, _, index, frames = patched_setup()
    missing = copy_state(base)
    del missing["b"]
    assert_apply_fails(missing, index, frames, ValueError, "tensor 'b': not in the state")
    reshaped = copy_state(base)
    reshaped["a"] = reshaped["a"].reshape(30, 40)
    assert_apply_fails(reshaped, index, frames, ValueError, "state shape")
    wrong_dtype = copy_state(base)
    wrong_dtype["c"] = wrong_dtype["c"].astype(np.int32)
    assert_apply_fails(wrong_dtype, index, frames, ValueError, "uint16")
    strided = copy_state(base)
    strided["a"] = np.asfortranarray(strided["a"])
    assert_apply_fails(strided, index, frames, ValueError, "C-contiguous")


def test_missing_repeated_or_unknown_frames_are_value_errors():
    base, _, index, frames = patched_setup()
    partial = {i: frames[i] for i in list(frames)[:-1]}
    assert_apply_fails(base, index, partial, ValueError, "frames \\[.*\\] missing")
    repeated = [(0, frames[0]), (1, frames[1]), (0, frames[0])]
    assert_apply_fails(base, index, repeated, ValueError, "frame 0 given twice")
    assert_apply_fails(base, index, {**frames, 99: b""}, ValueError, "no frame 99")


def test_rel_patch_on_the_wrong_base_is_caught_by_the_digests():
    rng = np.random.default_rng(9)
    base = random_state(rng)
    new = mutate(rng, base, 0.1)
    other = mutate(rng, base, 0.1)  # a different base with the same names and shapes
    index, body = encode_patch(base, new, mode="rel")
    base_digest, target_digest = state_digest(base), state_digest(new)
    # The caller checks the base digest first; this is what it protects against:
    assert state_digest(other) != base_digest
    state = copy_state(other)
    undo = apply_patch(state, index, all_frames(index, body))  # no error: rel codes fit any base
    assert state_digest(state) != target_digest
    undo.rollback(state)
    assert_same(state, other)


def test_index_validation():
    _, _, index, _ = patched_setup()
    frame, entry = index.frames[0], index.frames[0].entries[0]

    def first_frame(**changes):
        return dataclasses.replace(index, frames=(dataclasses.replace(frame, **changes), *index.frames[1:]))

    def first_entry(**changes):
        return first_frame(entries=(dataclasses.replace(entry, **changes), *frame.entries[1:]))

    shifted = dataclasses.replace(index.frames[1], offset=index.frames[1].offset + 1)
    not_encodable = [  # the binary form cannot even say these
        dataclasses.replace(index, mode="xor"),
        dataclasses.replace(index, frames=(frame, shifted, *index.frames[2:])),
        first_frame(digest="abc"),
        first_entry(count=-1),
    ]
    encodable = [
        first_frame(raw_size=1),
        first_frame(entries=()),
        first_entry(width=3),
        first_entry(count=10**6),
        first_entry(count=0),
        first_entry(high=entry.count + 1),
    ]
    for bad in [*not_encodable, *encodable]:
        with pytest.raises(PatchCorrupt):
            validate_index(bad)
    for bad in encodable:  # what a hostile publisher could write is refused on reading
        with pytest.raises(PatchCorrupt):
            PatchIndex.from_json(bad.to_json())
    good = index.to_json()
    for data in ({**good, "format": "stoa-pulse/0"}, {**good, "digest": "sha256"}, {**good, "index": None}, []):
        with pytest.raises(PatchCorrupt):
            PatchIndex.from_json(data)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------
# Bad input to the encoder


def test_diff_and_encode_reject_bad_input():
    a = {"x": np.zeros((2, 3), dtype=np.uint16)}
    with pytest.raises(ValueError, match="names"):
        diff(a, {"y": np.zeros((2, 3), dtype=np.uint16)})
    with pytest.raises(ValueError, match="shape"):
        diff(a, {"x": np.zeros((3, 2), dtype=np.uint16)})
    with pytest.raises(ValueError, match="uint16"):
        diff(a, {"x": np.zeros((2, 3), dtype=np.float32)})
    shapes = {"x": (2, 3)}
    values = np.ones(2, dtype=np.uint16)
    with pytest.raises(ValueError, match="base"):
        encode_delta({"x": (np.array([0, 1]), values)}, shapes, mode="rel")
    with pytest.raises(ValueError, match="mode"):
        encode_delta({}, shapes, mode="xor")
    with pytest.raises(ValueError, match="strictly increasing"):
        encode_delta({"x": (np.array([1, 1]), values)}, shapes)
    with pytest.raises(ValueError, match="out of range"):
        encode_delta({"x": (np.array([1, 6]), values)}, shapes)
    with pytest.raises(ValueError, match="int64"):
        encode_delta({"x": (np.array([1, 2], dtype=np.int32), values)}, shapes)
    with pytest.raises(ValueError, match="no shape"):
        encode_delta({"y": (np.array([1]), values[:1])}, shapes)


# ------------------------------------------------------------------------------------------
# Bit-level helpers


def test_changed_indices_across_chunks():
    rng = np.random.default_rng(10)
    a = rng.integers(0, 4, (3, 300_000), dtype=np.uint16)
    b = rng.integers(0, 4, (3, 300_000), dtype=np.uint16)
    assert np.array_equal(changed_indices(a, b), np.flatnonzero(a != b))
    assert changed_indices(a[:0], b[:0]).dtype == np.int64


def test_rel_codes_are_a_bijection_and_small_for_small_moves():
    every = np.arange(1 << 16, dtype=np.uint64).astype(np.uint16)
    for old in (0x0000, 0x3F80, 0x8000, 0xFFFF, 0x7FC0):
        olds = np.full(every.size, old, dtype=np.uint16)
        codes = rel_codes(olds, every)
        assert np.unique(codes).size == every.size
        assert np.array_equal(from_rel_codes(olds, codes), every)
    x = np.array([0x3F80, 0x0000, 0xFFFF], dtype=np.uint16)
    assert rel_codes(x, x).tolist() == [0, 0, 0]
    assert rel_codes(x, x + np.uint16(1)).tolist() == [2, 2, 2]
    assert rel_codes(x, x - np.uint16(1)).tolist() == [1, 1, 1]


def test_float32_to_bf16_rounds_to_nearest_even():
    cases = {
        0x3F800000: 0x3F80, 0x3F808000: 0x3F80, 0x3F818000: 0x3F82, 0x3F808001: 0x3F81,
        0x7F7FFFFF: 0x7F80, 0xFF800000: 0xFF80, 0x80000000: 0x8000, 0x00000001: 0x0000,
    }
    bits = np.array(list(cases), dtype=np.uint32)
    assert float32_to_bf16_bits(bits.view(np.float32)).tolist() == list(cases.values())
    rng = np.random.default_rng(11)
    raw = rng.integers(0, 1 << 32, 1 << 19, dtype=np.uint64).astype(np.uint32)
    got = float32_to_bf16_bits(raw.view(np.float32))
    nan = np.isnan(raw.view(np.float32))
    low, rest = raw >> 16, raw & 0xFFFF
    up = (rest > 0x8000) | ((rest == 0x8000) & (low & 1 == 1))
    assert np.array_equal(got[~nan], (low + up)[~nan].astype(np.uint16))
    assert np.isnan(bf16_bits_to_float32(got[nan])).all()
    assert np.array_equal(got[nan] >> 15, (raw[nan] >> 31).astype(np.uint16))  # sign kept
    assert float32_to_bf16_bits(np.float32(2.0)).shape == ()


# ------------------------------------------------------------------------------------------
# Digests


def test_tensor_digest_binds_name_shape_dtype_and_every_bit():
    bits = np.arange(24, dtype=np.uint16).reshape(4, 6)
    d = tensor_digest("w", bits)
    assert len(d) == 16 and d == tensor_digest("w", bits.copy())
    flipped = bits.copy()
    flipped[3, 5] ^= 1
    others = [
        tensor_digest("v", bits),
        tensor_digest("w", bits.reshape(6, 4)),
        tensor_digest("w", bits.reshape(24)),
        tensor_digest("w", bits, dtype="float16"),
        tensor_digest("w", flipped),
    ]
    assert len({d, *others}) == 6
    assert tensor_digest("w", bits.astype(">u2")) == d  # bytes hashed little-endian
    assert tensor_digest("w", np.asfortranarray(bits)) == d  # logical order, not memory order
    empty = [tensor_digest("w", np.zeros(s, dtype=np.uint16)) for s in [(0,), (0, 3), (3, 0)]]
    assert len(set(empty)) == 3
    assert tensor_digest("w", np.zeros((), np.uint16)) != tensor_digest("w", np.zeros((1,), np.uint16))
    with pytest.raises(ValueError):
        tensor_digest("w", bits.astype(np.float32))


def test_state_root_binds_names_and_ignores_insertion_order():
    rng = np.random.default_rng(12)
    state = random_state(rng)
    root = state_digest(state)
    assert state_digest(dict(reversed(list(state.items())))) == root
    x, y = random_bits(rng, (3, 4)), random_bits(rng, (3, 4))
    assert state_digest({"a": x, "b": y}) != state_digest({"a": y, "b": x})
    renamed = {("x" + k if k == "layer.0.w" else k): v for k, v in state.items()}
    assert state_digest(renamed) != root
    bit = copy_state(state)
    bit["layer.7.w"][0, 0] ^= 0x8000
    assert state_digest(bit) != root
    assert state_digest({**state, "extra": np.zeros(0, np.uint16)}) != root


def test_incremental_update_equals_full_recompute():
    rng = np.random.default_rng(13)
    base = random_state(rng)
    new = mutate(rng, base, 0.01)
    digest = StateDigest.of(base)
    index, body = encode_patch(base, new)
    state = copy_state(base)
    undo = apply_patch(state, index, all_frames(index, body))
    updated = digest.update(state, undo.touched)
    assert updated == StateDigest.of(state) and updated.root() == state_digest(new)
    assert digest.root() == state_digest(base)  # the old digest is unchanged
    assert pickle.loads(pickle.dumps(updated)) == updated
    del state["layer.0.w"]
    assert updated.update(state, ["layer.0.w"]) == StateDigest.of(state)


# ------------------------------------------------------------------------------------------
# Format: only stoa-pulse/2 is read (the retired stoa-pulse/1 is refused); its binary index is checked


def golden_states() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Two small states: three tensors, one of them large enough for long index codes."""
    a = (np.arange(600, dtype=np.uint32) * 2654435761 % 65536).astype(np.uint16).reshape(20, 30)
    b = (np.arange(70000, dtype=np.uint32) * 40503 % 65536).astype(np.uint16)
    base = {"a": a, "b": b, "c": np.array(0x3F80, dtype=np.uint16)}
    new = copy_state(base)
    new["a"].reshape(-1)[::7] += 1
    new["b"][[3, 4, 5, 300, 60000, 69999]] ^= 0x8001
    new["c"] = np.array(0xBF80, dtype=np.uint16)
    return base, new


# The index of a rel patch of the golden states as the retired stoa-pulse/1 encoder wrote it.
STOA_PULSE_1_INDEX = {
    "format": "stoa-pulse/1", "mode": "rel", "digest": "xxh3-128",
    "frames": [
        {"offset": 0, "length": 22, "raw_size": 198, "digest": "9ab08bb9d7861184799054f399858a62",
         "entries": [{"name": "a", "shape": [20, 30], "count": 66, "width": 1, "high": 0}]},
        {"offset": 22, "length": 26, "raw_size": 64, "digest": "04863a22c95e5dec7d6f4c312357f8db",
         "entries": [{"name": "a", "shape": [20, 30], "count": 20, "width": 2, "high": 1}]},
        {"offset": 48, "length": 34, "raw_size": 25, "digest": "428c60398106854b69234d4cbb11d1b3",
         "entries": [{"name": "b", "shape": [70000], "count": 6, "width": 2, "high": 3},
                     {"name": "c", "shape": [], "count": 1, "width": 1, "high": 0}]},
    ],
}


def test_a_stoa_pulse_1_index_is_refused_as_an_unsupported_format():
    with pytest.raises(PatchCorrupt, match="unsupported patch format 'stoa-pulse/1'"):
        PatchIndex.from_json(STOA_PULSE_1_INDEX)
    # ... and so is a version manifest's patch entry carrying one.
    base, new = golden_states()
    index, body = encode_patch(base, new, mode="rel", frame_bytes=200)
    ref = PatchRef(kind="step", key="k", bytes=len(body), count=index.count, base_min=0, base_max=0,
                   base_digest=state_digest(base), index=index)
    assert PatchRef.from_json(ref.to_json(), "patches[0]") == ref
    with pytest.raises(ManifestError, match=r"patches\[0\]\.index: unsupported patch format 'stoa-pulse/1'"):
        PatchRef.from_json({**ref.to_json(), "index": STOA_PULSE_1_INDEX}, "patches[0]")


@pytest.mark.parametrize("mode", ["abs", "rel"])
def test_round_trip_of_the_golden_states_and_its_compact_index(mode):
    base, new = golden_states()
    index, body = encode_patch(base, new, mode=mode, frame_bytes=200)
    assert set(index.to_json()) == {"format", "digest", "index"} and index.to_json()["format"] == FORMAT
    assert [(f.raw_size, len(f.entries)) for f in index.frames] == [(198, 1), (64, 1), (25, 2)]
    state = copy_state(base)
    apply_patch(state, json_round_trip(index), all_frames(index, body))
    assert_same(state, new)
    # Frames with an empty section (every index code fits one byte) hold no stream for it.
    assert index.frames[0].streams[1] == 0 and all(n > 0 for n in index.frames[1].streams)


def binary(index: PatchIndex) -> bytes:
    return zstandard.ZstdDecompressor().decompress(index.to_bytes())


def packed(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(raw)


def test_hostile_binary_indexes_are_corrupt():
    _, _, index, _ = patched_setup()
    raw = binary(index)
    assert PatchIndex.from_bytes(packed(raw)) == index
    bad = [
        packed(b"XXXX" + raw[4:]),  # magic
        packed(raw[:4] + b"\x07" + raw[5:]),  # mode
        packed(raw[:-1]),  # truncated
        packed(raw + b"\x00"),  # trailing byte
        packed(raw[:5] + b"\xff" * 12),  # a varint that never ends
        packed(raw[:5] + b"\xff\xff\xff\xff\x0f"),  # a name count beyond the bytes left
        packed(raw[:5] + b"\x01\x02\xff\xfe\x00"),  # a name that is not UTF-8
        packed(raw[:5] + b"\x01\x01a\x7f"),  # a rank beyond the limit
        zstandard.ZstdCompressor().compress(b"\0" * (MAX_INDEX_BYTES + 1)),  # an index bomb
        b"not zstd at all",
    ]
    for data in bad:
        with pytest.raises(PatchCorrupt):
            PatchIndex.from_bytes(data)
    doc = index.to_json()
    for broken in (
        {**doc, "index": doc["index"][:-2] + "!!"},  # not base64
        {**doc, "extra": 1},
        {**doc, "index": 5},
        {**doc, "digest": "sha256"},
    ):
        with pytest.raises(PatchCorrupt):
            PatchIndex.from_json(broken)


def test_section_streams_must_tile_the_frame_and_match_the_sections():
    base, _, index, frames = patched_setup()
    frame = index.frames[1]
    s0, s1, s2, s3 = frame.streams
    assert s1 > 0  # this frame has long index codes

    def with_streams(*streams):
        return dataclasses.replace(index, frames=(index.frames[0], dataclasses.replace(frame, streams=streams),
                                                  *index.frames[2:]))

    for streams in ((s0 + s1, 0, s2, s3), (s0, s1, s2 + s3), (s0, s1, s2, s3, 0), (s0 + 1, s1, s2, s3), ()):
        with pytest.raises(PatchCorrupt):
            validate_index(with_streams(*streams))
    # Off by one byte between two streams: the index is consistent and the frame digest still
    # matches, but the streams no longer inflate to their sections.
    assert_apply_fails(base, with_streams(s0 + 1, s1 - 1, s2, s3), frames, PatchCorrupt, "frame 1 section")
    assert base64.b64decode(index.to_json()["index"]) == index.to_bytes()


# ------------------------------------------------------------------------------------------
# Changed-index bookkeeping


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), patches=st.integers(1, 5), frame_bytes=st.sampled_from([40, 400, 1 << 20]))
def test_changed_indices_equal_np_unique_of_everything_written(seed, patches, frame_bytes):
    rng = np.random.default_rng(seed)
    state = random_state(rng, [(300,), (20, 30), (), (0,), (7,)])
    logs, written = [], {}
    for _ in range(patches):
        new = mutate(rng, state, float(rng.choice([0.0, 0.05, 0.5])))
        index, body = encode_patch(state, new, frame_bytes=frame_bytes, mode="rel")
        frames = list(all_frames(index, body).items())
        rng.shuffle(frames)  # frames arrive in any order
        logs.append(apply_patch(state, index, frames))
        for entry in logs[-1].entries:
            written.setdefault(entry.name, []).append(entry.indices)
    changed = ChangedIndices(logs)
    assert set(changed) == set(written) and len(changed) == len(written)
    for name, parts in written.items():
        expected = np.unique(np.concatenate(parts))
        got = changed[name]
        assert got.dtype == np.int64 and np.array_equal(got, expected), (seed, name)
        assert changed[name] is got and not got.flags.writeable
    with pytest.raises(KeyError):
        changed["nope"]


def test_changed_indices_merge_overlapping_and_out_of_order_runs():
    def log(*entries):
        return UndoLog(tuple(UndoEntry(n, np.array(i, dtype=np.int64), np.zeros(len(i), np.uint16))
                             for n, i in entries))

    one = log(("a", [5, 6, 9]), ("a", [0, 2]), ("b", [3]))  # one patch, split tensor out of order
    two = log(("a", [2, 7]), ("c", []))
    odd = log(("a", [1, 4]), ("a", [3, 4]))  # overlapping runs within one patch
    assert ChangedIndices([one])["a"].tolist() == [0, 2, 5, 6, 9]
    merged = ChangedIndices([one, two])
    assert merged["a"].tolist() == [0, 2, 5, 6, 7, 9] and merged["b"].tolist() == [3]
    assert merged["c"].tolist() == [] and merged["c"].dtype == np.int64
    assert ChangedIndices([odd])["a"].tolist() == [1, 3, 4]
    assert dict(ChangedIndices([])) == {}


def test_on_done_reports_each_tensor_once_after_its_last_entry():
    rng = np.random.default_rng(21)
    base = {"big": random_bits(rng, (400, 300)), "small": random_bits(rng, (50,)), "same": random_bits(rng, (9,))}
    new = mutate(rng, base, 0.05)
    new["same"] = base["same"].copy()
    index, body = encode_patch(base, new, frame_bytes=1000)
    assert sum(e.name == "big" for f in index.frames for e in f.entries) > 1  # split over frames
    state = copy_state(base)
    done: list[str] = []

    def on_done(name: str) -> None:
        # Called once the tensor is final: it already holds the new bits.
        assert np.array_equal(state[name], new[name]), name
        done.append(name)

    frames = list(all_frames(index, body).items())
    apply_patch(state, index, reversed(frames), on_done=on_done)
    assert sorted(done) == ["big", "small"]
