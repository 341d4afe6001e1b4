"""The index of a PULSE patch (format `stoa-pulse/2`): where every frame and entry lies.

A frame holds one zstd stream per section (`FrameInfo.streams`), so each section gets its own
Huffman tables even when the whole frame fits one zstd block; the index is a compact binary
document (a name table with shapes, then varint fields per frame and entry, zstd-compressed),
carried in JSON as base64. Any other format (the retired verbose-JSON `stoa-pulse/1` included)
is refused. `PatchIndex.from_json` and `from_bytes` validate everything (a hostile index is a
`PatchCorrupt`, never a crash or an unbounded allocation).
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import zstandard

from .codec import INDEX_WIDTHS, PatchCorrupt, entry_nbytes, section_sizes

FORMAT = "stoa-pulse/2"  # the one format written and read
#: How a patch carries values: the new bits ("abs") or codes relative to the exact base ("rel").
Mode = Literal["abs", "rel"]
MODES: tuple[Mode, ...] = get_args(Mode)
SECTIONS = 4
DIGEST = "xxh3-128"
MAX_INDEX_BYTES = 64 << 20  # an inflated binary index larger than this is refused
_MAGIC = b"SPI2"
_MAX_NDIM = 64


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
    """One frame: its byte range in the body, payload size, digest and entries.

    `streams` gives the compressed length of each of its four section streams (0: that section
    is empty, no stream).
    """

    offset: int
    length: int
    raw_size: int
    digest: str  # xxh3-128 hex of the frame's bytes
    entries: tuple[EntryInfo, ...]
    streams: tuple[int, ...]

    def section_totals(self) -> tuple[int, ...]:
        """Payload bytes of each section over all entries."""
        sizes = [section_sizes(e.count, e.width, e.high) for e in self.entries]
        return tuple(sum(s[k] for s in sizes) for k in range(SECTIONS))


@dataclass(frozen=True, slots=True)
class PatchIndex:
    """Where every frame and entry of a patch body lies. JSON round trip via to_json/from_json,
    binary via to_bytes/from_bytes.

    A "rel" patch is only valid on the exact base state it was made from: the caller must check
    the base state digest before applying it (and the target digest after).
    """

    mode: Mode
    frames: tuple[FrameInfo, ...]

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
        """A JSON-serialisable dict (the binary form in base64); see `from_json`."""
        return {"format": FORMAT, "digest": DIGEST, "index": base64.b64encode(self.to_bytes()).decode()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PatchIndex:
        """Parse and validate an index; PatchCorrupt if malformed or of another format."""
        try:
            if data.get("digest") != DIGEST:
                raise PatchCorrupt(f"unsupported digest {data.get('digest')!r}")
            if data.get("format") != FORMAT:
                raise PatchCorrupt(f"unsupported patch format {data.get('format')!r} (expected {FORMAT!r})")
            if data.keys() != {"format", "digest", "index"} or not isinstance(data["index"], str):
                raise PatchCorrupt(f"a {FORMAT} index holds exactly format, digest and a base64 index")
            raw = base64.b64decode(data["index"], validate=True)
        except PatchCorrupt:
            raise
        except (binascii.Error, ValueError) as exc:
            raise PatchCorrupt(f"patch index: bad base64 ({exc})") from None
        except (TypeError, AttributeError) as exc:
            raise PatchCorrupt(f"malformed patch index: {exc!r}") from exc
        return cls.from_bytes(raw)

    def to_bytes(self) -> bytes:
        """The compact binary form of the index (zstd-compressed)."""
        raw = _encode_binary(self)
        return zstandard.ZstdCompressor(level=19, write_content_size=True).compress(raw)

    @classmethod
    def from_bytes(cls, data: bytes) -> PatchIndex:
        """Parse and validate a binary index; PatchCorrupt if malformed."""
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise PatchCorrupt(f"patch index: not a zstd frame ({exc})") from None
        if not 0 <= declared <= MAX_INDEX_BYTES:
            raise PatchCorrupt(f"patch index: declared size {declared} (limit {MAX_INDEX_BYTES})")
        try:
            raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_INDEX_BYTES)
        except zstandard.ZstdError as exc:
            raise PatchCorrupt(f"patch index: zstd decompression failed ({exc})") from None
        if len(raw) != declared:
            raise PatchCorrupt(f"patch index: inflated to {len(raw)} bytes, header says {declared}")
        index = _decode_binary(raw)
        validate_index(index)
        return index


# ---------------------------------------------------------------------------------------------
# Validation


def _validate_entry(entry: EntryInfo, where: str) -> None:
    where = f"{where}, tensor {entry.name!r}"
    if entry.width not in INDEX_WIDTHS:
        raise PatchCorrupt(f"{where}: index width {entry.width}")
    if not 0 < entry.count <= entry.size:
        raise PatchCorrupt(f"{where}: count {entry.count} for shape {entry.shape}")
    if entry.high > (0 if entry.width == 1 else entry.count):
        raise PatchCorrupt(f"{where}: {entry.high} long index codes of {entry.count}")


def _validate_streams(frame: FrameInfo, where: str) -> None:
    totals = frame.section_totals()
    if len(frame.streams) != SECTIONS or sum(frame.streams) != frame.length:
        raise PatchCorrupt(f"{where}: section streams {frame.streams} do not tile {frame.length} bytes")
    for k, (length, total) in enumerate(zip(frame.streams, totals, strict=True)):
        if (length > 0) != (total > 0):
            raise PatchCorrupt(f"{where}: section {k} holds {total} bytes but its stream is {length} bytes")


def validate_index(index: PatchIndex) -> None:
    """Raise PatchCorrupt unless frames tile the body and entries tile each frame's payload."""
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
        _validate_streams(frame, where)


# ---------------------------------------------------------------------------------------------
# The binary form
#
# MAGIC, mode byte (0 abs, 1 rel), then varints: the name table (count; per name its UTF-8
# length and bytes, rank and dimensions, in first-use order), the frame count, and per frame
# its length, raw size, 16 digest bytes, stream count (4) and stream lengths, entry count,
# and per entry its name number, count, width and high. Frame offsets are implied (frames tile
# the body in order).


def _varint(out: bytearray, value: int) -> None:
    assert value >= 0
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _encode_binary(index: PatchIndex) -> bytes:
    names: dict[str, int] = {}
    table = bytearray()
    body = bytearray()
    _varint(body, len(index.frames))
    for frame in index.frames:
        _varint(body, frame.length)
        _varint(body, frame.raw_size)
        body += bytes.fromhex(frame.digest)
        _varint(body, len(frame.streams))
        for length in frame.streams:
            _varint(body, length)
        _varint(body, len(frame.entries))
        for e in frame.entries:
            number = names.get(e.name)
            if number is None:
                number = names[e.name] = len(names)
                raw = e.name.encode("utf-8")
                _varint(table, len(raw))
                table += raw
                _varint(table, len(e.shape))
                for d in e.shape:
                    _varint(table, d)
            _varint(body, number)
            _varint(body, e.count)
            _varint(body, e.width)
            _varint(body, e.high)
    head = bytearray(_MAGIC)
    head.append(MODES.index(index.mode))
    _varint(head, len(names))
    return bytes(head + table + body)


class _Reader:
    """A bounds-checked cursor over a binary index."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise PatchCorrupt(f"patch index truncated in {what}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def varint(self, what: str, limit: int = 1 << 63) -> int:
        value = shift = 0
        while True:
            if self.pos >= len(self.data) or shift > 63:
                raise PatchCorrupt(f"patch index: bad varint in {what}")
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        if value >= limit:
            raise PatchCorrupt(f"patch index: {what} {value} is too large")
        return value

    def count(self, what: str, min_bytes: int) -> int:
        """A count of items of at least `min_bytes` each, bounded by what is left."""
        return self.varint(what, self.left() // min_bytes + 1)


def _decode_binary(data: bytes) -> PatchIndex:
    r = _Reader(data)
    if r.take(len(_MAGIC), "magic") != _MAGIC:
        raise PatchCorrupt("patch index: not a stoa-pulse/2 binary index")
    mode_byte = r.take(1, "mode")[0]
    if mode_byte >= len(MODES):
        raise PatchCorrupt(f"patch index: unknown mode {mode_byte}")
    table: list[tuple[str, tuple[int, ...]]] = []
    for _ in range(r.count("name count", 2)):
        raw = r.take(r.varint("name length", r.left() + 1), "a name")
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise PatchCorrupt("patch index: a tensor name is not UTF-8") from None
        ndim = r.varint("rank", _MAX_NDIM + 1)
        table.append((name, tuple(r.varint("shape dimension") for _ in range(ndim))))
    frames, offset = [], 0
    for _ in range(r.count("frame count", 20)):
        length, raw_size = r.varint("frame length"), r.varint("frame raw size")
        digest = r.take(16, "a frame digest").hex()
        streams = tuple(r.varint("stream length") for _ in range(r.varint("stream count", SECTIONS + 1)))
        entries = []
        for _ in range(r.count("entry count", 4)):
            number = r.varint("name number", len(table))
            count, width, high = r.varint("count"), r.varint("width"), r.varint("high")
            entries.append(EntryInfo(table[number][0], table[number][1], count, width, high))
        frames.append(FrameInfo(offset, length, raw_size, digest, tuple(entries), streams))
        offset += length
    if r.left():
        raise PatchCorrupt(f"patch index: {r.left()} trailing bytes")
    return PatchIndex(mode=MODES[mode_byte], frames=tuple(frames))
