"""Read and write the safetensors format with numpy alone.

Layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the raw tensor bytes.
The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the start of the data section) and may hold ``"__metadata__"``: a str -> str map.
All numbers are little-endian and tensors are C-ordered.

bf16 has no numpy dtype: a ``BF16`` tensor is read and written as ``uint16`` bit patterns, which is
how stoa holds weights everywhere. Files written here load with the ``safetensors`` package,
transformers and MLX. The reader is as strict as the reference implementation (offsets must tile
the data section exactly; unknown fields in an entry are ignored), rejects duplicate JSON keys as
well, and raises ValueError on anything malformed.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from slime_stoa.protocol.fsutil import atomic_file
from slime_stoa.protocol.strict_json import load_json

#: safetensors dtype name -> numpy storage dtype (little-endian). BF16 and the fp8 formats are
#: stored as unsigned integers holding their bit patterns.
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"),
    "U8": np.dtype("<u1"),
    "I8": np.dtype("<i1"),
    "F8_E4M3": np.dtype("<u1"),
    "F8_E5M2": np.dtype("<u1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
}

#: Default safetensors dtype for a numpy dtype when the caller names none. ``uint16`` means bf16
#: bits in stoa; pass ``dtypes={name: "U16"}`` for a genuine unsigned 16-bit tensor.
_DEFAULT_FOR_NUMPY: dict[str, str] = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "BF16",
    "int16": "I16",
    "float16": "F16",
    "uint32": "U32",
    "int32": "I32",
    "float32": "F32",
    "uint64": "U64",
    "int64": "I64",
    "float64": "F64",
}

#: Largest JSON header accepted (the reference implementation's limit).
MAX_HEADER_BYTES = 100 * 1024 * 1024
_METADATA_KEY = "__metadata__"
#: Permissions of written files (readable by the worker processes of other users).
FILE_MODE = 0o644

Source = str | os.PathLike[str] | bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One header entry: where a tensor's bytes lie in the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class Header:
    """A validated header: entries in data order, the optional metadata and where data starts."""

    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str] | None
    data_start: int  # absolute offset of the data section in the file


# ----------------------------------------------------------------------------------- writing


def storage_dtype(st_dtype: str) -> np.dtype:
    """Return the numpy dtype that holds a safetensors dtype; ValueError if unknown."""
    try:
        return DTYPES[st_dtype]
    except KeyError:
        raise ValueError(
            f"unsupported safetensors dtype {st_dtype!r}; expected one of {sorted(DTYPES)}"
        ) from None


def _resolve_dtype(name: str, arr: np.ndarray, declared: str | None) -> str:
    """Pick and check the safetensors dtype for one array."""
    if declared is None:
        st = _DEFAULT_FOR_NUMPY.get(arr.dtype.name)
        if st is None:
            raise ValueError(
                f"tensor {name!r}: numpy dtype {arr.dtype} has no safetensors equivalent; "
                "convert it or name a dtype in `dtypes`"
            )
        return st
    want = storage_dtype(declared)
    ok = arr.dtype.kind == want.kind and arr.dtype.itemsize == want.itemsize
    if declared == "BF16":  # bf16 bits may come as int16 views (e.g. from torch)
        ok = arr.dtype.kind in "iu" and arr.dtype.itemsize == 2
    if not ok:
        raise ValueError(
            f"tensor {name!r}: array dtype {arr.dtype} cannot be written as {declared} "
            f"(expected {want.name} storage)"
        )
    return declared


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise ValueError(f"safetensors metadata must map str to str; bad entries: {bad[:5]}")
    return dict(metadata)


def plan_header(
    tensors: Mapping[str, np.ndarray],
    dtypes: Mapping[str, str] | None,
    metadata: Mapping[str, str] | None,
) -> tuple[bytes, list[np.ndarray]]:
    """The encoded header (length prefix included) and the arrays in data order: the plan
    `safetensors_bytes` and `write_safetensors` write (the anchor writer builds its shards from it)."""
    dtypes = dict(dtypes or {})
    unknown = set(dtypes) - set(tensors)
    if unknown:
        raise ValueError(f"`dtypes` names tensors that are not given: {sorted(unknown)[:5]}")
    entries: list[tuple[int, str, str, np.ndarray]] = []
    for name, arr in tensors.items():
        if not isinstance(name, str) or not name or name == _METADATA_KEY:
            raise ValueError(f"invalid tensor name {name!r}")
        arr = np.asarray(arr)
        st = _resolve_dtype(name, arr, dtypes.get(name))
        entries.append((arr.dtype.itemsize, name, st, arr))
    # Largest items first (then by name, like the reference writer) keeps every tensor aligned.
    entries.sort(key=lambda e: (-e[0], e[1]))
    header: dict[str, object] = {}
    meta = _check_metadata(metadata)
    if meta is not None:
        header[_METADATA_KEY] = meta
    offset = 0
    arrays = []
    for _, name, st, arr in entries:
        nbytes = arr.size * arr.dtype.itemsize
        header[name] = {
            "dtype": st,
            "shape": [int(d) for d in arr.shape],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        arrays.append(arr)
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # pad so the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, arrays


def le_bytes(arr: np.ndarray) -> np.ndarray:
    """A flat, C-ordered, little-endian uint8 view (copy only when needed) of `arr`'s data."""
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and np.little_endian is False):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr.reshape(-1).view(np.uint8)


def _write_to(f: BinaryIO, header: bytes, arrays: list[np.ndarray]) -> None:
    f.write(header)
    for arr in arrays:
        f.write(le_bytes(arr).data)


def safetensors_bytes(
    tensors: Mapping[str, np.ndarray],
    *,
    dtypes: Mapping[str, str] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """Encode `tensors` as one safetensors blob (see `write_safetensors` for the arguments)."""
    header, arrays = plan_header(tensors, dtypes, metadata)
    parts = [header] + [le_bytes(a).tobytes() for a in arrays]
    return b"".join(parts)


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, np.ndarray],
    *,
    dtypes: Mapping[str, str] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write `tensors` to `path` atomically (temp file in the same folder, fsync, rename).

    `dtypes` maps tensor names to safetensors dtypes; a name left out gets the default for its
    numpy dtype, where ``uint16`` means bf16 bits (``"BF16"``). `metadata` is a str -> str map
    stored under ``__metadata__`` (transformers wants ``{"format": "pt"}``).
    """
    path = Path(path)
    header, arrays = plan_header(tensors, dtypes, metadata)
    with atomic_file(path, mode=FILE_MODE) as f:
        _write_to(f, header, arrays)
    return path


# ----------------------------------------------------------------------------------- reading


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_entry(name: str, spec: object) -> TensorInfo:
    """Validate one tensor entry of the header."""
    where = f"corrupt safetensors header: tensor {name!r}"
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
        raise ValueError(f"{where}: expected an object with dtype, shape and data_offsets")
    dtype, shape, offs = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"{where}: unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ValueError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(_is_int(o) and o >= 0 for o in offs)
        or offs[0] > offs[1]
    ):
        raise ValueError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if offs[1] - offs[0] != expected:
        raise ValueError(
            f"{where}: holds {offs[1] - offs[0]} bytes but {dtype} x {shape} needs {expected}"
        )
    return TensorInfo(name, dtype, tuple(shape), offs[0], offs[1])


def parse_header(prefix: bytes | memoryview, total_size: int) -> Header:
    """Validate the header at the start of a safetensors file of `total_size` bytes.

    `prefix` must hold at least the length field and the JSON header. Raises ValueError when the
    header is malformed or the tensors do not tile the data section exactly.
    """
    if total_size < 8 or len(prefix) < 8:
        raise ValueError(
            f"corrupt safetensors data: {total_size} bytes, shorter than the 8-byte length"
        )
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if n > MAX_HEADER_BYTES:
        raise ValueError(
            f"corrupt safetensors header: length {n} exceeds the {MAX_HEADER_BYTES} limit"
        )
    if 8 + n > total_size or 8 + n > len(prefix):
        raise ValueError(
            f"corrupt safetensors data: header claims {n} bytes but only {total_size - 8} follow"
        )
    try:
        obj = load_json(bytes(prefix[8 : 8 + n]), max_bytes=MAX_HEADER_BYTES)
    except ValueError as e:
        raise ValueError(f"corrupt safetensors header: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("corrupt safetensors header: top level is not a JSON object")
    metadata = obj.pop(_METADATA_KEY, None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise ValueError("corrupt safetensors header: __metadata__ must map str to str")
    infos = sorted((_parse_entry(k, v) for k, v in obj.items()), key=lambda t: (t.begin, t.end))
    data_len = total_size - 8 - n
    pos = 0
    for t in infos:
        if t.begin != pos:
            kind = "overlaps the previous tensor" if t.begin < pos else "leaves a gap before it"
            raise ValueError(
                f"corrupt safetensors header: tensor {t.name!r} at offset {t.begin} {kind} "
                f"(expected {pos})"
            )
        pos = t.end
    if pos != data_len:
        raise ValueError(
            f"corrupt safetensors data: tensors cover {pos} bytes but the data section has "
            f"{data_len} (truncated or trailing bytes)"
        )
    return Header(tuple(infos), metadata, 8 + n)


def _native(arr: np.ndarray) -> np.ndarray:
    return arr.astype(arr.dtype.newbyteorder("="), copy=False)


def read_header(src: Source) -> Header:
    """Read and validate only the header of a safetensors file or blob."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        view = memoryview(src).cast("B")
        return parse_header(view, len(view))
    with open(src, "rb") as f:
        return _read_file_header(f)


def _read_file_header(f: BinaryIO) -> Header:
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) == 8:
        (n,) = struct.unpack("<Q", head)
        if n <= MAX_HEADER_BYTES:
            head += f.read(n)
    return parse_header(head, size)


def read_safetensors(src: Source) -> dict[str, tuple[str, np.ndarray]]:
    """Read a safetensors file (path) or blob (bytes) into ``{name: (dtype, array)}``.

    Arrays are fresh, writable and in native byte order; ``BF16`` (and fp8) come back as unsigned
    integer bit patterns. Raises ValueError on a malformed or truncated input.
    """
    out: dict[str, tuple[str, np.ndarray]] = {}
    if isinstance(src, (bytes, bytearray, memoryview)):
        view = memoryview(src).cast("B")
        header = parse_header(view, len(view))
        for t in header.tensors:
            dt = DTYPES[t.dtype]
            count = (t.end - t.begin) // dt.itemsize
            arr = np.frombuffer(view, dt, count, header.data_start + t.begin).copy()
            out[t.name] = (t.dtype, _native(arr.reshape(t.shape)))
        return out
    with open(src, "rb") as f:
        header = _read_file_header(f)
        for t in header.tensors:
            arr = np.empty(t.shape, DTYPES[t.dtype])
            f.seek(header.data_start + t.begin)
            buf = arr.reshape(-1).view(np.uint8).data
            if f.readinto(buf) != len(buf):
                raise ValueError(f"safetensors file {src} changed while being read")
            out[t.name] = (t.dtype, _native(arr))
    return out
