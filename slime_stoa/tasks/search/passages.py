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
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import zstandard

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


# -- compressed passages: zstd blocks with random access ---------------------------------------
#
#     passages.zst          zstd frames, one per block of whole passages (about BLOCK_BYTES of text
#                           each): a block is a uint32 count c, c uint32 byte lengths, the texts
#     passages.blocks.npy   int64 (blocks + 1, 2): row j = (first passage of block j, its byte
#                           offset in passages.zst); the last row = (passages, file size)
#
# A passage is read by decompressing its one block (the table's binary search finds it).

ZST_FILE = "passages.zst"
BLOCKS_FILE = "passages.blocks.npy"
BLOCK_BYTES = 64 << 10
ZSTD_LEVEL = 9
MAX_BLOCK_BYTES = 64 << 20  # a block decompresses to no more (one passage may exceed BLOCK_BYTES)


class BlockPassageWriter:
    """Appends passages to the compressed files of `folder`, one block held at a time."""

    def __init__(self, folder: Path, *, block_bytes: int = BLOCK_BYTES, level: int = ZSTD_LEVEL):
        self._folder, self._block_bytes = folder, block_bytes
        self._out = open(folder / ZST_FILE, "wb")  # noqa: SIM115 (closed in close)
        self._zstd = zstandard.ZstdCompressor(level=level)
        self._texts: list[bytes] = []
        self._pending = 0
        self._count = 0
        self._rows = array.array("q", [0, 0])

    def add(self, text: str) -> None:
        if not isinstance(text, str):
            raise ValueError(f"passage {self._count} must be str, got {type(text).__name__}")
        data = text.encode("utf-8", "replace")
        if len(data) > MAX_BLOCK_BYTES // 2:
            raise ValueError(f"passage {self._count} is {len(data)} bytes, over {MAX_BLOCK_BYTES // 2}")
        self._texts.append(data)
        self._pending += len(data)
        self._count += 1
        if self._pending >= self._block_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._texts:
            return
        head = np.array([len(self._texts), *map(len, self._texts)], dtype="<u4").tobytes()
        written = self._out.write(self._zstd.compress(head + b"".join(self._texts)))
        self._rows.extend((self._count, self._rows[-1] + written))
        self._texts, self._pending = [], 0

    def __len__(self) -> int:
        return self._count

    def close(self) -> int:
        self._flush()
        self._out.close()
        np.save(self._folder / BLOCKS_FILE, np.frombuffer(self._rows, dtype=np.int64).reshape(-1, 2), allow_pickle=False)
        return self._count


class BlockPassageStore:
    """Read-only compressed passages by position (the format above). Opening checks the block
    table against the file; a block that does not decode to its passages fails the read with
    ValueError."""

    def __init__(self, folder: Path):
        rows = np.load(folder / BLOCKS_FILE, mmap_mode="r", allow_pickle=False)
        size = os.path.getsize(folder / ZST_FILE)
        if rows.ndim != 2 or rows.shape[1:] != (2,) or rows.dtype != np.int64 or len(rows) < 1:
            raise ValueError(f"{BLOCKS_FILE}: expected an int64 (blocks + 1, 2) array, got {rows.dtype} {rows.shape}")
        if tuple(rows[0]) != (0, 0) or rows[-1, 1] != size or bool(np.any(np.diff(rows, axis=0) <= 0)):
            raise ValueError(f"{BLOCKS_FILE} does not describe {ZST_FILE} ({size} bytes)")
        self._first, self._at = np.ascontiguousarray(rows[:, 0]), np.ascontiguousarray(rows[:, 1])
        with open(folder / ZST_FILE, "rb") as f:
            self._data: mmap.mmap | bytes = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        # zstandard's decompressor objects are not thread-safe, and queries run on several threads
        # (`Retriever.asearch`): one per thread.
        self._local = threading.local()

    def __len__(self) -> int:
        return int(self._first[-1])

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        zstd = getattr(self._local, "zstd", None)
        if zstd is None:
            zstd = self._local.zstd = zstandard.ZstdDecompressor()
        return zstd

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < len(self):
            raise IndexError(f"passage {i} out of range ({len(self)} passages)")
        j = int(np.searchsorted(self._first, i, side="right")) - 1
        frame = self._data[int(self._at[j]):int(self._at[j + 1])]
        try:
            if not 0 <= zstandard.frame_content_size(frame) <= MAX_BLOCK_BYTES:  # -1: not recorded
                raise ValueError(f"{ZST_FILE}: block {j} does not record a size up to {MAX_BLOCK_BYTES}")
            block = self._decompressor().decompress(frame)
        except zstandard.ZstdError as exc:
            raise ValueError(f"{ZST_FILE}: block {j} does not decompress: {exc}") from None
        count = int(self._first[j + 1] - self._first[j])
        if len(block) < 4 * (count + 1) or int.from_bytes(block[:4], "little") != count:
            raise ValueError(f"{ZST_FILE}: block {j} does not hold its {count} passages")
        lengths = np.frombuffer(block, dtype="<u4", count=count, offset=4).astype(np.int64)
        start = 4 * (count + 1) + int(lengths[: i - int(self._first[j])].sum())
        end = start + int(lengths[i - int(self._first[j])])
        if 4 * (count + 1) + int(lengths.sum()) != len(block):
            raise ValueError(f"{ZST_FILE}: block {j} does not hold its {count} passages")
        return block[start:end].decode("utf-8", "replace")
