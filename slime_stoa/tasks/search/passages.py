"""Passage texts on disk, compact and memory-mapped: one UTF-8 file plus an offsets array.

    passages.txt           every passage's UTF-8 bytes, back to back
    passages.offsets.npy   int64, n + 1 entries: passage i is bytes [off[i], off[i + 1])

Opening maps both files read-only and checks that the offsets start at 0, never decrease and end
at the text file's size, so a damaged pair fails at open with ValueError, not at a query.
"""

from __future__ import annotations

import array
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

TEXT_FILE = "passages.txt"
OFFSETS_FILE = "passages.offsets.npy"


class PassageWriter:
    """Appends passages to the two files of `folder` one at a time (bounded memory: 8 bytes of
    offset per passage); `close` writes the offsets and returns the passage count."""

    def __init__(self, folder: Path):
        self._folder = folder
        self._text = open(folder / TEXT_FILE, "wb")  # noqa: SIM115 (closed in close)
        self._offsets = array.array("q", [0])

    def add(self, text: str) -> None:
        if not isinstance(text, str):
            raise ValueError(f"passage {len(self._offsets) - 1} must be str, got {type(text).__name__}")
        self._offsets.append(self._offsets[-1] + self._text.write(text.encode("utf-8", "replace")))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def close(self) -> int:
        self._text.close()
        np.save(self._folder / OFFSETS_FILE, np.frombuffer(self._offsets, dtype=np.int64), allow_pickle=False)
        return len(self)


def write_passages(passages: Iterable[str], folder: Path) -> int:
    """Write the two passage files into `folder` (which must exist); returns the passage count."""
    writer = PassageWriter(folder)
    try:
        for text in passages:
            writer.add(text)
    finally:
        count = writer.close()
    return count


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
