"""Apply a PULSE patch in place, with an undo log the size of the patch.

Work is proportional to the patch, not the model: each frame is verified, decoded and scattered
into the live arrays with vectorised numpy indexing. Before each write the old bits at the same
positions are saved, so a failure half-way (corrupt frame, out-of-range index, shape mismatch,
missing tensor or frame) rolls the state back bit for bit before the error propagates, and the
caller can roll back explicitly when the final state digest does not match.

A "rel" patch applied to the wrong base raises nothing: it yields a wrong state. The caller must
compare the base state digest before applying (and the target digest after).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .codec import check_bits, from_rel_codes
from .frames import EntryInfo, PatchIndex, decode_frame, frame_number

Frames = Mapping[int, bytes] | Iterable[tuple[int, bytes]]


class UndoEntry(NamedTuple):
    """The bits at `indices` of tensor `name` before a patch wrote them."""

    name: str
    indices: np.ndarray
    old: np.ndarray


@dataclass(frozen=True, slots=True)
class UndoLog:
    """What `apply_patch` overwrote, in write order; `rollback` restores it."""

    entries: tuple[UndoEntry, ...] = ()

    @property
    def touched(self) -> tuple[str, ...]:
        """Sorted names of the tensors written (for `StateDigest.update`)."""
        return tuple(sorted({e.name for e in self.entries}))

    @property
    def nbytes(self) -> int:
        return sum(e.indices.nbytes + e.old.nbytes for e in self.entries)

    def rollback(self, state: MutableMapping[str, np.ndarray]) -> None:
        """Restore the old bits, newest write first, so the state is as before the apply."""
        for entry in reversed(self.entries):
            state[entry.name].reshape(-1)[entry.indices] = entry.old


def _target(state: Mapping[str, np.ndarray], entry: EntryInfo, i: int) -> np.ndarray:
    """The flat, writeable view of the tensor an entry patches; ValueError if it does not fit."""
    where = f"frame {i}, tensor {entry.name!r}"
    if entry.name not in state:
        raise ValueError(f"{where}: not in the state")
    bits = check_bits(entry.name, state[entry.name])
    if bits.shape != entry.shape:
        raise ValueError(f"{where}: state shape {bits.shape} != patch shape {entry.shape}")
    if not (bits.flags.c_contiguous and bits.flags.writeable):
        raise ValueError(f"{where}: must be a writeable C-contiguous array to patch in place")
    return bits.reshape(-1)


def _frame_items(frames: Frames) -> Iterable[tuple[int, bytes]]:
    return frames.items() if isinstance(frames, Mapping) else frames


def apply_patch(
    state: MutableMapping[str, np.ndarray], index: PatchIndex, frames: Frames
) -> UndoLog:
    """Apply every frame of a patch to `state` in place and return the undo log.

    `frames` maps frame numbers to frame bytes, or yields (number, bytes) pairs in any order, e.g.
    as ranged GETs complete. Each frame is checked against its digest and the state before it is
    written. On any error the state is rolled back to exactly what it was, then the error is
    raised: PatchCorrupt for a damaged frame, ValueError for a state or frame set that does not
    fit the patch (missing tensor, shape or dtype mismatch, unknown, repeated or missing frame).
    """
    written: list[UndoEntry] = []
    seen: set[int] = set()
    try:
        for i, data in _frame_items(frames):
            i = frame_number(index, i)
            frame = index.frames[i]
            if i in seen:
                raise ValueError(f"frame {i} given twice")
            seen.add(i)
            targets = [_target(state, entry, i) for entry in frame.entries]
            decoded = decode_frame(index, i, data)
            for (name, indices, values), flat in zip(decoded, targets, strict=True):
                old = flat[indices]
                written.append(UndoEntry(name, indices, old))
                flat[indices] = values if index.mode == "abs" else from_rel_codes(old, values)
        missing = sorted(set(range(len(index.frames))) - seen)
        if missing:
            raise ValueError(f"patch incomplete: frames {missing} missing")
    except BaseException:
        UndoLog(tuple(written)).rollback(state)
        raise
    return UndoLog(tuple(written))
