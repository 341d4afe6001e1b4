"""Apply a PULSE patch in place, with an undo log the size of the patch.

Work is proportional to the patch, not the model: each frame is verified, decoded and scattered
into the live arrays with vectorised numpy indexing. Before each write the old bits at the same
positions are saved, so a failure half-way (corrupt frame, out-of-range index, shape mismatch,
missing tensor or frame) rolls the state back bit for bit before the error propagates, and the
caller can roll back explicitly when the final state digest does not match.

A "rel" patch applied to the wrong base raises nothing: it yields a wrong state. The caller must
compare the base state digest before applying (and the target digest after).

`ChangedIndices` turns the undo logs of one or more applied patches into the sorted, unique flat
indices written per tensor, lazily and in time proportional to the patches: the entries of one
patch are already sorted runs, so one patch costs a concatenation and a check, several a merge
of sorted runs (a stable sort finds the runs) and a mask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .codec import check_bits, from_rel_codes
from .frames import EntryInfo, PatchIndex, decode_frames, frame_number

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
    state: MutableMapping[str, np.ndarray],
    index: PatchIndex,
    frames: Frames,
    *,
    on_done: Callable[[str], None] | None = None,
    threads: int | None = 1,
) -> UndoLog:
    """Apply every frame of a patch to `state` in place and return the undo log.

    `frames` maps frame numbers to frame bytes, or yields (number, bytes) pairs in any order, e.g.
    as ranged GETs complete. Each frame is checked against its digest and the state before it is
    written. On any error the state is rolled back to exactly what it was, then the error is
    raised: PatchCorrupt for a damaged frame, ValueError for a state or frame set that does not
    fit the patch (missing tensor, shape or dtype mismatch, unknown, repeated or missing frame).
    `on_done(name)` is called once the patch's last entry for a tensor is written (so the tensor
    can be hashed while the rest applies); the patch may still fail and roll it back after.
    Frames decode on `threads` threads while this one writes those already decoded, in the
    order they came (`frames.decode_frames`); a patch's frames write disjoint positions, so the
    result does not depend on the order or the thread count.
    """
    left: dict[str, int] = {}
    if on_done is not None:
        for frame in index.frames:
            for entry in frame.entries:
                left[entry.name] = left.get(entry.name, 0) + 1
    written: list[UndoEntry] = []
    seen: set[int] = set()
    try:
        for i, decoded in decode_frames(index, _frame_items(frames), threads):
            i = frame_number(index, i)
            frame = index.frames[i]
            if i in seen:
                raise ValueError(f"frame {i} given twice")
            seen.add(i)
            targets = [_target(state, entry, i) for entry in frame.entries]
            for (name, indices, values), flat in zip(decoded, targets, strict=True):
                old = flat[indices]
                written.append(UndoEntry(name, indices, old))
                flat[indices] = values if index.mode == "abs" else from_rel_codes(old, values)
                if on_done is not None:
                    left[name] -= 1
                    if not left[name]:
                        on_done(name)
        missing = sorted(set(range(len(index.frames))) - seen)
        if missing:
            raise ValueError(f"patch incomplete: frames {missing} missing")
    except BaseException:
        UndoLog(tuple(written)).rollback(state)
        raise
    return UndoLog(tuple(written))


class ChangedIndices(Mapping[str, np.ndarray]):
    """Read-only mapping: tensor name -> sorted unique flat indices (int64, or int32 from staged
    patches) that `logs` wrote.

    Names are known at once; each tensor's indices are computed on first access (then cached),
    so a receiver that needs only some of them pays only for those, on whichever thread reads
    them. Equal to `np.unique` over each tensor's written indices. The arrays are read-only.
    """

    def __init__(self, logs: Sequence[UndoLog]) -> None:
        self._runs: dict[str, list[list[np.ndarray]]] = {}
        for undo in logs:
            seen: set[str] = set()
            for entry in undo.entries:
                runs = self._runs.setdefault(entry.name, [])
                if entry.name not in seen:
                    runs.append([])
                    seen.add(entry.name)
                runs[-1].append(entry.indices)
        self._done: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        found = self._done.get(name)
        if found is None:
            found = self._done[name] = _union(self._runs[name])
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self._runs)

    def __len__(self) -> int:
        return len(self._runs)


def _strictly_increasing(x: np.ndarray) -> bool:
    return x.size < 2 or bool(np.all(x[1:] > x[:-1]))


def _union(patches: list[list[np.ndarray]]) -> np.ndarray:
    """Sorted unique union of the index arrays of one tensor, grouped per patch.

    Each array is strictly increasing, and one patch's arrays do not overlap (a tensor split
    across frames), so ordering them by first index usually yields the answer; otherwise (several
    patches, or an odd producer) a stable sort merges the sorted runs and a mask drops repeats.
    """
    runs = [run for patch in patches for run in patch if run.size]
    if len(patches) == 1:
        runs.sort(key=lambda run: int(run[0]))
    out = np.concatenate(runs) if runs else np.empty(0, dtype=np.int64)
    if len(runs) > 1 and not _strictly_increasing(out):
        out = np.sort(out, kind="stable")  # finds and merges the sorted runs
        keep = np.empty(out.size, dtype=bool)
        keep[:1] = True
        np.not_equal(out[1:], out[:-1], out=keep[1:])
        out = out[keep]
    out = out.view()
    out.flags.writeable = False
    return out
