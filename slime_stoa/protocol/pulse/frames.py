"""PULSE patch objects: tensor-aligned zstd frames plus a JSON index.

A patch is a body (independent zstd frames, concatenated) and a `PatchIndex` saying where each
frame lies in the body, its xxh3-128 digest and which entries it holds, so a receiver can fetch
frame i with a ranged GET of `[offset, offset + length)`, verify it and apply it on arrival.

A frame's payload holds its entries' sections (`codec.encode_entry`) section-major: section 0 of
every entry in order, then section 1 of every entry, and so on, so that zstd's per-block Huffman
tables each see one kind of byte (measured: ~0.8 bits per change less than entry-major on a
model with many small tensors). Entry boundaries follow from (count, width, high). Frames are
packed greedily in sorted tensor-name order up to about `frame_bytes` of payload. A tensor whose
payload alone exceeds `frame_bytes` is split at index boundaries into several entries, each in a
frame of its own; every entry starts with an absolute index, so entries and frames decode
independently. Frames are built and compressed on a thread pool (numpy and python-zstandard
release the GIL); the output does not depend on the number of threads.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, NamedTuple, get_args

import numpy as np
import xxhash
import zstandard

from .codec import (
    INDEX_WIDTHS,
    Delta,
    PatchCorrupt,
    State,
    check_bits,
    check_entry,
    decode_entry,
    diff,
    encode_entry,
    entry_nbytes,
    entry_shape,
    index_codes,
    rel_codes,
    section_sizes,
    shapes_of,
)

FORMAT = "stoa-pulse/1"
#: How a patch carries values: the new bits ("abs") or codes relative to the exact base ("rel").
Mode = Literal["abs", "rel"]
MODES: tuple[Mode, ...] = get_args(Mode)


class DecodedEntry(NamedTuple):
    """One decoded entry: flat indices and the new bits ("abs") or relative codes ("rel")."""

    name: str
    indices: np.ndarray  # int64, strictly increasing
    values: np.ndarray  # uint16


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """A run of changes to one tensor inside a frame.

    `width` is the index code width in bytes and `high` the number of codes >= 256.
    """

    name: str
    shape: tuple[int, ...]
    count: int
    width: int
    high: int

    @property
    def raw_size(self) -> int:
        return entry_nbytes(self.count, self.width, self.high)

    @property
    def size(self) -> int:
        """Number of elements of the tensor."""
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class FrameInfo:
    """One zstd frame: its byte range in the body, payload size, digest and entries."""

    offset: int
    length: int
    raw_size: int
    digest: str  # xxh3-128 hex of the compressed bytes
    entries: tuple[EntryInfo, ...]


@dataclass(frozen=True, slots=True)
class PatchIndex:
    """Where every frame and entry of a patch body lies. JSON round trip via to_json/from_json.

    A "rel" patch is only valid on the exact base state it was made from: the caller must check
    the base state digest before applying it (and the target digest after).
    """

    mode: Mode
    frames: tuple[FrameInfo, ...]
    format: str = FORMAT

    @property
    def body_size(self) -> int:
        return sum(f.length for f in self.frames)

    @property
    def count(self) -> int:
        """Number of changed elements in the patch."""
        return sum(e.count for f in self.frames for e in f.entries)

    @property
    def touched(self) -> tuple[str, ...]:
        """Sorted names of the tensors the patch changes."""
        return tuple(sorted({e.name for f in self.frames for e in f.entries}))

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict; `PatchIndex.from_json` inverts it."""
        return {
            "format": self.format,
            "mode": self.mode,
            "digest": "xxh3-128",
            "frames": [
                {
                    "offset": f.offset,
                    "length": f.length,
                    "raw_size": f.raw_size,
                    "digest": f.digest,
                    "entries": [
                        {"name": e.name, "shape": list(e.shape), "count": e.count,
                         "width": e.width, "high": e.high}
                        for e in f.entries
                    ],
                }
                for f in self.frames
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PatchIndex:
        """Parse and validate an index; raise PatchCorrupt if it is malformed or inconsistent."""
        try:
            if data.get("digest") != "xxh3-128":
                raise PatchCorrupt(f"unsupported digest {data.get('digest')!r}")
            frames = tuple(_frame_from_json(f) for f in data["frames"])
            index = cls(mode=data["mode"], frames=frames, format=data["format"])
        except PatchCorrupt:
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise PatchCorrupt(f"malformed patch index: {exc!r}") from exc
        validate_index(index)
        return index


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise PatchCorrupt(f"patch index: {what} must be a non-negative integer, got {value!r}")
    return value


def _frame_from_json(f: Mapping[str, Any]) -> FrameInfo:
    entries = tuple(
        EntryInfo(
            name=e["name"],
            shape=tuple(_int(d, "shape dimension") for d in e["shape"]),
            count=_int(e["count"], "count"),
            width=_int(e["width"], "width"),
            high=_int(e["high"], "high"),
        )
        for e in f["entries"]
    )
    return FrameInfo(
        offset=_int(f["offset"], "frame offset"),
        length=_int(f["length"], "frame length"),
        raw_size=_int(f["raw_size"], "frame raw_size"),
        digest=f["digest"],
        entries=entries,
    )


def _validate_entry(entry: EntryInfo, where: str) -> None:
    where = f"{where}, tensor {entry.name!r}"
    if entry.width not in INDEX_WIDTHS:
        raise PatchCorrupt(f"{where}: index width {entry.width}")
    if not 0 < entry.count <= entry.size:
        raise PatchCorrupt(f"{where}: count {entry.count} for shape {entry.shape}")
    if entry.high > (0 if entry.width == 1 else entry.count):
        raise PatchCorrupt(f"{where}: {entry.high} long index codes of {entry.count}")


def validate_index(index: PatchIndex) -> None:
    """Raise PatchCorrupt unless frames tile the body and entries tile each frame's payload."""
    if index.format != FORMAT:
        raise PatchCorrupt(f"unsupported patch format {index.format!r} (expected {FORMAT!r})")
    if index.mode not in MODES:
        raise PatchCorrupt(f"unknown patch mode {index.mode!r}")
    offset = 0
    for i, frame in enumerate(index.frames):
        where = f"patch index frame {i}"
        if frame.offset != offset or frame.length <= 0:
            span = f"[{frame.offset}, +{frame.length})"
            raise PatchCorrupt(f"{where}: byte range {span} does not follow the previous frame")
        if not isinstance(frame.digest, str) or len(frame.digest) != 32:
            raise PatchCorrupt(f"{where}: digest must be 32 hex characters")
        offset += frame.length
        raw = 0
        for entry in frame.entries:
            if not isinstance(entry.name, str) or not entry.name:
                raise PatchCorrupt(f"{where}: entry name must be a non-empty string")
            _validate_entry(entry, where)
            raw += entry.raw_size
        if raw != frame.raw_size or not frame.entries:
            raise PatchCorrupt(f"{where}: entries cover {raw} bytes, frame says {frame.raw_size}")


# ---------------------------------------------------------------------------------------------
# Encoding


@dataclass(frozen=True, slots=True)
class _Piece:
    """A slice of one tensor's delta destined for one frame entry."""

    name: str
    shape: tuple[int, ...]
    indices: np.ndarray
    values: np.ndarray  # new bits
    base: np.ndarray | None  # flat base bits, for "rel" mode


def _pieces(
    delta: Delta, shapes: Mapping[str, tuple[int, ...]], base: State | None
) -> list[_Piece]:
    """Validate the delta against the shapes (and base) and list its non-empty entries."""
    pieces = []
    for name in sorted(delta):
        indices, values = delta[name]
        if name not in shapes:
            raise ValueError(f"tensor {name!r}: no shape given")
        shape = tuple(int(d) for d in shapes[name])
        check_entry(name, indices, values, math.prod(shape))
        flat_base = None
        if base is not None:
            if name not in base:
                raise ValueError(f"tensor {name!r}: missing from the base state")
            base_bits = check_bits(name, base[name])
            if base_bits.shape != shape:
                raise ValueError(f"tensor {name!r}: base shape {base_bits.shape} != {shape}")
            flat_base = base_bits.reshape(-1)
        if indices.size:
            pieces.append(_Piece(name, shape, indices, values, flat_base))
    return pieces


def _plan_frames(pieces: list[_Piece], frame_bytes: int) -> list[list[_Piece]]:
    """Greedy tensor-aligned packing; a tensor too big for one frame is split into frames."""
    frames: list[list[_Piece]] = []
    current: list[_Piece] = []
    used = 0
    for piece in pieces:
        count = piece.indices.size
        size = entry_nbytes(count, *entry_shape(index_codes(piece.indices)))
        if size > frame_bytes:
            if current:
                frames.append(current)
                current, used = [], 0
            step = max(1, count * frame_bytes // size)
            for start in range(0, count, step):
                part = slice(start, start + step)
                frames.append([_Piece(piece.name, piece.shape, piece.indices[part],
                                      piece.values[part], piece.base)])
            continue
        if current and used + size > frame_bytes:
            frames.append(current)
            current, used = [], 0
        current.append(piece)
        used += size
    if current:
        frames.append(current)
    return frames


def _build_frame(pieces: list[_Piece], mode: Mode, level: int) -> tuple[bytes, list[EntryInfo]]:
    """Serialise and compress one frame; return the compressed bytes and its entries."""
    entries, sections = [], []
    for piece in pieces:
        values = piece.values
        if mode == "rel":
            assert piece.base is not None  # rel pieces are built with their base
            values = rel_codes(piece.base[piece.indices], values)
        width, high, parts = encode_entry(piece.indices, values)
        entries.append(EntryInfo(piece.name, piece.shape, piece.indices.size, width, high))
        sections.append(parts)
    raw = np.concatenate([parts[k] for k in range(4) for parts in sections])
    blob = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(raw.data)
    return blob, entries


def encode_delta(
    delta: Delta,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    base: State | None = None,
    mode: Mode = "abs",
    frame_bytes: int = 16 << 20,
    level: int = 1,
    threads: int | None = None,
) -> tuple[PatchIndex, bytes]:
    """Encode an already computed delta (e.g. a merged catch-up delta) as (index, body).

    `shapes` gives each delta tensor's shape (`shapes_of(new_state)` will do). "rel" mode needs
    the exact `base` state the patch will be applied to. `threads` bounds the worker pool
    (None: one per CPU; 1: all work on the calling thread).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "rel" and base is None:
        raise ValueError("mode 'rel' needs the base state")
    if frame_bytes < 1:
        raise ValueError(f"frame_bytes must be positive, got {frame_bytes}")
    plan = _plan_frames(_pieces(delta, shapes, base), frame_bytes)
    workers = min(threads or os.cpu_count() or 1, len(plan))
    build = partial(_build_frame, mode=mode, level=level)
    if workers <= 1:
        built = [build(pieces) for pieces in plan]
    else:
        with ThreadPoolExecutor(workers) as pool:
            built = list(pool.map(build, plan))
    frames, offset = [], 0
    for blob, entries in built:
        raw_size = sum(e.raw_size for e in entries)
        digest = xxhash.xxh3_128(blob).hexdigest()
        frames.append(FrameInfo(offset, len(blob), raw_size, digest, tuple(entries)))
        offset += len(blob)
    index = PatchIndex(mode=mode, frames=tuple(frames))
    validate_index(index)
    return index, b"".join(blob for blob, _ in built)


def encode_patch(
    base: State,
    new: State,
    *,
    mode: Mode = "abs",
    frame_bytes: int = 16 << 20,
    level: int = 1,
    threads: int | None = None,
) -> tuple[PatchIndex, bytes]:
    """Diff two states and encode the patch taking `base` to `new` as (index, body).

    `threads` is used for the diff as well as for the frames (see `encode_delta`).
    """
    return encode_delta(
        diff(base, new, threads=threads), shapes_of(new), base=base, mode=mode,
        frame_bytes=frame_bytes, level=level, threads=threads,
    )


# ---------------------------------------------------------------------------------------------
# Decoding


def frame_number(index: PatchIndex, i: int) -> int:
    """`i` as a plain int if the index has a frame i, else ValueError."""
    try:
        number = operator.index(i)
    except TypeError:
        number = -1
    if not 0 <= number < len(index.frames):
        raise ValueError(f"patch has {len(index.frames)} frames, no frame {i!r}")
    return number


def frame_slice(index: PatchIndex, i: int, body: bytes) -> bytes:
    """The bytes of frame i cut out of a whole body."""
    frame = index.frames[frame_number(index, i)]
    return body[frame.offset : frame.offset + frame.length]


def verify_frame(index: PatchIndex, i: int, data: bytes) -> None:
    """Raise PatchCorrupt unless `data` has frame i's length and digest."""
    frame = index.frames[frame_number(index, i)]
    if len(data) != frame.length:
        raise PatchCorrupt(f"frame {i}: got {len(data)} bytes, index says {frame.length}")
    digest = xxhash.xxh3_128(data).hexdigest()
    if digest != frame.digest:
        raise PatchCorrupt(f"frame {i}: digest {digest} != {frame.digest} in the index")


def _decompress(frame: FrameInfo, i: int, data: bytes) -> np.ndarray:
    """The payload of a frame; never allocates more than the index's raw_size."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise PatchCorrupt(f"frame {i}: not a zstd frame ({exc})") from exc
    # Checked first: decompress() trusts a size in the frame header over max_output_size.
    if declared != frame.raw_size:
        raise PatchCorrupt(
            f"frame {i}: zstd header declares {declared} bytes, index says {frame.raw_size}"
        )
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=frame.raw_size)
    except zstandard.ZstdError as exc:
        raise PatchCorrupt(f"frame {i}: zstd decompression failed ({exc})") from exc
    if len(raw) != frame.raw_size:
        raise PatchCorrupt(f"frame {i}: decompressed {len(raw)} bytes, index says {frame.raw_size}")
    return np.frombuffer(raw, dtype=np.uint8)


def decode_frame(index: PatchIndex, i: int, data: bytes) -> list[DecodedEntry]:
    """Verify and decode frame i into entries of (name, flat indices, values or rel codes)."""
    verify_frame(index, i, data)
    frame = index.frames[i]
    raw = _decompress(frame, i, data)
    sizes = np.array([section_sizes(e.count, e.width, e.high) for e in frame.entries])
    # starts[j, k]: where section k of entry j begins (section-major layout).
    starts = np.cumsum(sizes.T.reshape(-1)) - sizes.T.reshape(-1)
    starts = starts.reshape(sizes.shape[1], -1).T
    entries = []
    for j, e in enumerate(frame.entries):
        sections = [raw[starts[j, k] : starts[j, k] + sizes[j, k]] for k in range(sizes.shape[1])]
        where = f"frame {i}, tensor {e.name!r}"
        indices, values = decode_entry(sections, e.count, e.width, e.high, e.size, where)
        entries.append(DecodedEntry(e.name, indices, values))
    return entries
