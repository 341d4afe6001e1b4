"""Verify PULSE patches against a state without writing it; write them later in one short step.

`apply_patch` writes a patch into the state in place and the caller checks the state digest
afterwards. A worker whose state *is* its model's live weights (one copy, the memory shared
with MLX) cannot let anything write while the model generates. `stage_patches` does all the
work that does not need the state to change, beside the running model: decode and verify every
frame, compute the final bits at every written index and check that the resulting state digest
is the target's. Staging only reads the state (a worker lends its weights read-only for the
length of a sync). What remains for the safe point is `StagedPatch.commit`, called by whoever
owns the state's bytes: scatter the final bits into the state, work proportional to the patch.
A deferred `subscriber.Subscriber` syncs this way and hands the staged patch to the owner of the
bytes (a worker's `macd.weights.LiveWeights.install_version`).

Extra memory while staging, about 6 bytes per change (an int32 index and the bf16 bits, held as
decoded and kept as the staged writes), the decoding buffers of one frame per thread (frames
are ~16 MiB of raw patch) and one 8 MiB chunk per thread, never a copy of a tensor: each
touched tensor is hashed chunk by chunk with its staged bits laid over a copy of the chunk. The
result equals applying the patches in order with `apply_patch` (the tests check it bit for bit).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from .apply import Frames, UndoEntry, UndoLog
from .codec import check_bits, from_rel_codes
from .digest import StateDigest, tensor_hasher
from .frames import PatchIndex, decode_frames, frame_number
from .parallel import ordered_map

HASH_CHUNK = 1 << 22  # elements of a tensor copied at a time to hash its staged bits (8 MiB of bf16)


class StageError(ValueError):
    """The patches do not lead to the expected state from this one (nothing was written)."""


@dataclass(frozen=True, slots=True)
class TensorWrite:
    """The final bits of one tensor at the flat indices a staged patch writes (sorted, unique)."""

    name: str
    indices: np.ndarray  # int32 (int64 for a tensor of 2**31 elements or more)
    bits: np.ndarray  # uint16


@dataclass(frozen=True, slots=True)
class StagedPatch:
    """Verified writes, ready to commit; `digest` is the state's digest once they are written.
    What staging cost, for a receiver's speed estimates (`route.SpeedMeter`): `changes` elements
    decoded and merged in `apply_s` seconds, `hashed` elements re-hashed in `hash_s` (seconds
    summed over the threads)."""

    writes: tuple[TensorWrite, ...]
    digest: StateDigest
    changes: int = 0
    apply_s: float = 0.0
    hashed: int = 0
    hash_s: float = 0.0

    @property
    def touched(self) -> tuple[str, ...]:
        return tuple(w.name for w in self.writes)

    @property
    def written(self) -> Mapping[str, np.ndarray]:
        """The sorted unique flat indices written per tensor (read-only views)."""
        out = {}
        for w in self.writes:
            view = w.indices.view()
            view.flags.writeable = False
            out[w.name] = view
        return MappingProxyType(out)

    def commit(self, state: MutableMapping[str, np.ndarray]) -> UndoLog:
        """Write into `state` (the one staged from, unchanged since) in place; the undo log of
        what was overwritten. ValueError, nothing written, when a tensor is missing or cannot
        be written in place; on any other error the state is restored before it propagates."""
        flats = []
        for w in self.writes:
            if w.name not in state:
                raise ValueError(f"{w.name}: not in the state this patch was staged on")
            bits = check_bits(w.name, state[w.name])
            if w.indices.size and bits.size <= w.indices[-1]:
                raise ValueError(f"{w.name}: {bits.size} elements, the patch writes index {w.indices[-1]}")
            if not (bits.flags.c_contiguous and bits.flags.writeable):
                raise ValueError(f"{w.name}: must be a writeable C-contiguous array to commit in place")
            flats.append(bits.reshape(-1))
        entries: list[UndoEntry] = []
        try:
            for w, flat in zip(self.writes, flats, strict=True):
                entries.append(UndoEntry(w.name, w.indices, flat[w.indices]))
                flat[w.indices] = w.bits
        except BaseException:
            UndoLog(tuple(entries)).rollback(state)
            raise
        return UndoLog(tuple(entries))


def stage_patches(
    state: Mapping[str, np.ndarray],
    digest: StateDigest,
    patches: Sequence[tuple[PatchIndex, Frames]],
    expected: str,
    *,
    threads: int | None = 1,
) -> StagedPatch:
    """Stage `patches` (applied in order, each with all its frames) onto `state`, whose digest is
    `digest`, and check that they reach the state digest `expected`. `state` is only read.
    Frames decode on `threads` threads as they come (`frames.decode_frames`: an iterable of
    frames may still be downloading), then each tensor's writes merge and hash on `threads`
    threads; the result does not depend on the thread count.

    Raises PatchCorrupt for a damaged frame, ValueError for frames that do not fit the state or
    the patch (as `apply_patch` does), StageError when the result's digest is not `expected`.
    """
    writes: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {}  # name -> (mode, indices, values)
    start = time.perf_counter()
    for index, frames in patches:
        seen: set[int] = set()
        items = frames.items() if isinstance(frames, Mapping) else frames
        for i, decoded in decode_frames(index, items, threads):
            i = frame_number(index, i)
            if i in seen:
                raise ValueError(f"frame {i} given twice")
            seen.add(i)
            for entry in index.frames[i].entries:
                _check_target(state, entry.name, entry.shape, i)
            for name, indices, values in decoded:  # compact indices held, not int64
                writes.setdefault(name, []).append((index.mode, indices.astype(_index_dtype(state[name])), values))
        missing = sorted(set(range(len(index.frames))) - seen)
        if missing:
            raise ValueError(f"patch incomplete: frames {missing} missing")
    changes = sum(int(indices.size) for parts in writes.values() for _, indices, _ in parts)
    hashed = sum(int(state[name].size) for name in writes)
    decode_s = time.perf_counter() - start

    def merged(name: str) -> tuple[TensorWrite, bytes, float, float]:
        bits = state[name]
        tic = time.perf_counter()
        at, final = _merge(bits.reshape(-1), writes.pop(name))  # decoded parts freed as they merge
        toc = time.perf_counter()
        found = _digest_with(name, bits, at, final, digest.dtype)
        return TensorWrite(name, at, final), found, toc - tic, time.perf_counter() - toc

    done = ordered_map(merged, sorted(writes), threads)
    digests = dict(digest.digests) | {w.name: found for w, found, _, _ in done}
    result = StateDigest(digests, digest.dtype)
    if result.root() != expected:
        raise StageError(f"state digest {result.root()} != {expected} after staging {len(patches)} patch(es)")
    return StagedPatch(tuple(w for w, _, _, _ in done), result, changes=changes,
                       apply_s=decode_s + sum(m for _, _, m, _ in done), hashed=hashed,
                       hash_s=sum(h for _, _, _, h in done))


def _index_dtype(bits: np.ndarray) -> type[np.signedinteger]:
    """int32 flat indices for a tensor of fewer than 2**31 elements, int64 beyond."""
    return np.int32 if bits.size <= np.iinfo(np.int32).max else np.int64


def _merge(flat: np.ndarray, parts: list[tuple[str, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The sorted unique flat indices that `parts` (mode, indices, values) write and the final
    bits there, the parts applied in order."""
    if len(parts) == 1:  # one frame of one patch: its indices are already sorted and unique
        mode, at, values = parts[0]
        return at, (values if mode == "abs" else from_rel_codes(flat[at], values))
    at = np.unique(np.concatenate([indices for _, indices, _ in parts]))
    final = flat[at]  # a copy: the bits at every written index, then each write in order
    for mode, indices, values in parts:
        pos = np.searchsorted(at, indices)
        final[pos] = values if mode == "abs" else from_rel_codes(final[pos], values)
    return at, final


def _digest_with(name: str, bits: np.ndarray, at: np.ndarray, final: np.ndarray, dtype: str) -> bytes:
    """`tensor_digest` of `bits` with `final` at flat indices `at` (sorted), hashing it in
    chunks so that no copy of the whole tensor is made."""
    flat = bits.reshape(-1)
    h = tensor_hasher(name, bits.shape, dtype)
    for start in range(0, max(flat.size, 1), HASH_CHUNK):
        stop = min(start + HASH_CHUNK, flat.size)
        chunk = flat[start:stop].copy()
        lo, hi = np.searchsorted(at, (start, stop))
        chunk[at[lo:hi] - start] = final[lo:hi]
        h.update(chunk.astype(chunk.dtype.newbyteorder("<"), copy=False).data)
    return h.digest()


def _check_target(state: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...], i: int) -> None:
    """The tensor an entry stages onto is in the state, of its shape (only read here: `commit`
    checks that it can be written)."""
    where = f"frame {i}, tensor {name!r}"
    if name not in state:
        raise ValueError(f"{where}: not in the state")
    bits = check_bits(name, state[name])
    if bits.shape != shape:
        raise ValueError(f"{where}: state shape {bits.shape} != patch shape {shape}")
