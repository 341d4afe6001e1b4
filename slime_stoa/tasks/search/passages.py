"""Passage texts on disk, compact and memory-mapped: one UTF-8 file plus an offsets array.

    passages.txt           every passage's UTF-8 bytes, back to back
    passages.offsets.npy   int64, n + 1 entries: passage i is bytes [off[i], off[i + 1])

Opening maps both files read-only and checks that the offsets start at 0, never decrease and end
at the text file's size, so a damaged pair fails at open with ValueError, not at a query.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

TEXT_FILE = "passages.txt"
OFFSETS_FILE = "passages.offsets.npy"


def write_passages(passages: Iterable[str], folder: Path) -> int:
    """Write the two passage files into `folder` (which must exist); returns the passage count."""
    offsets = [0]
    with open(folder / TEXT_FILE, "wb") as f:
        for text in passages:
            if not isinstance(text, str):
                raise ValueError(f"passage {len(offsets) - 1} must be str, got {type(text).__name__}")
            offsets.append(offsets[-1] + f.write(text.encode("utf-8", "replace")))
    np.save(folder / OFFSETS_FILE, np.asarray(offsets, dtype=np.int64), allow_pickle=False)
    return len(offsets) - 1


class PassageStore:
    """Read-only, memory-mapped passages by position (see the module doc for the format)."""

    def __init__(self, folder: Path):
        offsets = np.load(folder / OFFSETS_FILE, mmap_mode="r", allow_pickle=False)
        size = os.path.getsize(folder / TEXT_FILE)
        if offsets.ndim != 1 or offsets.dtype != np.int64 or len(offsets) < 1:
            raise ValueError(f"{OFFSETS_FILE}: expected a 1-D int64 array, got {offsets.dtype} {offsets.shape}")
        if offsets[0] != 0 or offsets[-1] != size or bool(np.any(np.diff(offsets) < 0)):
            raise ValueError(f"{OFFSETS_FILE} does not describe {TEXT_FILE} ({size} bytes)")
        self._offsets = offsets
        with open(folder / TEXT_FILE, "rb") as f:
            # mmap cannot map an empty file; an empty corpus reads from an empty buffer instead
            self._text: mmap.mmap | bytes = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < len(self):
            raise IndexError(f"passage {i} out of range ({len(self)} passages)")
        start, end = int(self._offsets[i]), int(self._offsets[i + 1])
        return self._text[start:end].decode("utf-8", "replace")
