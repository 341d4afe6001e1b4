"""Rollout-group records (schema v1): the in-memory types and their wire encoding.

A record is one prompt group: the prompt tokens and G sampled responses, with the per-token
logprobs the worker saw, its rewards, and the weight version it sampled from. Workers upload one
record per object; the trainer decodes it with `decode_group` and checks it with
`slime_stoa.protocol.validate`.

Wire format (format 1):

    MAGIC (7 bytes) | FORMAT (1 byte) | one zstd frame (content size and checksum present)

The frame holds one msgpack map: the fields of `RolloutGroup` in order, its samples and sampling
parameters as nested maps (see "Wire types"). Token ids travel as raw little-endian int32 bytes
and logprobs as raw little-endian float32 bytes, so every float32 bit pattern (-0.0, subnormals,
NaN payloads) round-trips exactly.

`decode_group` trusts nothing: any malformed input raises `RecordError` with a stable `reason`
code, and memory stays within a small multiple of `max_bytes` (the decompressed size is checked
against the frame header before anything is allocated, and the frame must decompress to exactly
that size).
Decoding checks structure only; value checks (vocabulary, finite logprobs, limits) are
`slime_stoa.protocol.validate`'s job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, fields
from types import GenericAlias
from typing import Annotated, Any, get_args, get_origin, get_type_hints

import msgspec
import numpy as np
import zstandard

SCHEMA_VERSION = 1
MAGIC = b"\x89STOARG"  # non-ASCII first byte: a text file never looks like a record
FORMAT = 1
HEADER_LEN = len(MAGIC) + 1
ZSTD_LEVEL = 3
DEFAULT_MAX_RECORD_BYTES = 32 * 1024 * 1024  # cap on the object and on its decompressed payload

KINDS = ("train", "eval")
FINISH_REASONS = ("stop", "length")

# Stable reason codes of RecordError, for counting rejects.
DECODE_REASONS = frozenset(
    {
        "not_bytes",  # input is not bytes-like
        "bad_magic",  # not a stoa rollout-group record
        "bad_format",  # right magic, unknown format byte
        "too_large",  # object or declared decompressed size over max_bytes
        "decompress",  # corrupt, truncated or trailing zstd data, or no content size
        "msgpack",  # payload is not exactly one well-formed msgpack value
        "type",  # field missing, unknown, out of int64 range or of the wrong type
        "schema",  # types fine but structurally inconsistent (e.g. token bytes not a multiple of 4)
        "group_size",  # more samples than the decoder's max_samples (same code as the validator's)
        "schema_version",  # a map of another schema version (same code as the validator's)
    }
)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INT32 = np.iinfo(np.int32)
_TOKEN_WIRE = np.dtype("<i4")
_LOGPROB_WIRE = np.dtype("<f4")


class RecordError(Exception):
    """A record could not be decoded. `reason` is a stable code from DECODE_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)  # args kept as (reason, detail) so it pickles
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


# ---------------------------------------------------------------------------------------------
# In-memory types


def _check_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be str, got {type(value).__name__}")
    return value


def _check_int(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be int, got {type(value).__name__}")
    value = int(value)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"{name} must fit in int64, got {value}")
    return value


def _check_float(value: Any, name: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _frozen(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`a` as a read-only array of `dtype`. Copies unless `a` already views immutable bytes."""
    if a.dtype != dtype or not isinstance(a.base, bytes):
        a = np.array(a, dtype=dtype)
        a.setflags(write=False)
    return a


def as_token_array(value: Any, name: str = "tokens") -> np.ndarray:
    """Token ids as a read-only 1-D int32 array. Rejects non-integer input and int32 overflow."""
    a = np.asarray(value)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.size and a.dtype != np.int32 and (a.min() < _INT32.min or a.max() > _INT32.max):
        raise ValueError(f"{name} has ids outside int32")
    return _frozen(a, np.dtype(np.int32))


def as_logprob_array(value: Any, name: str = "logprobs") -> np.ndarray:
    """Logprobs as a read-only 1-D float32 array (wider floats are rounded to float32)."""
    a = np.asarray(value)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind != "f":
        raise TypeError(f"{name} must hold floats, got dtype {a.dtype}")
    return _frozen(a, np.dtype(np.float32))


#: Token ids in memory: a read-only int32 array; on the wire, its little-endian int32 bytes.
TokenArray = Annotated[np.ndarray, _TOKEN_WIRE]
#: Logprobs in memory: a read-only float32 array; on the wire, its little-endian float32 bytes.
LogprobArray = Annotated[np.ndarray, _LOGPROB_WIRE]


def _same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (so -0.0 != 0.0 and a NaN equals the same NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _same_float(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return _same_array(a, b)
    if isinstance(a, float) and isinstance(b, float):
        return _same_float(a, b)
    return bool(a == b)


def _same_fields(a: Any, b: Any) -> bool:
    """Field-by-field equality of two records' parts: arrays bitwise, floats NaN-equal."""
    return all(_same_value(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SamplingParams:
    """Sampling parameters the worker used. Logprobs are taken at `temperature`."""

    temperature: float
    top_p: float
    max_tokens: int
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", _check_float(self.temperature, "temperature"))
        object.__setattr__(self, "top_p", _check_float(self.top_p, "top_p"))
        object.__setattr__(self, "max_tokens", _check_int(self.max_tokens, "max_tokens"))
        if isinstance(self.stop, str):
            raise TypeError("stop must be a sequence of str, not a str")
        stop = tuple(_check_str(s, "stop[]") for s in self.stop)
        object.__setattr__(self, "stop", stop)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplingParams):
            return NotImplemented
        return _same_fields(self, other)

    def __hash__(self) -> int:
        return hash((self.max_tokens, self.stop))  # consistent with NaN-equal floats


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Sample:
    """One sampled response. `logprobs[i]` is the logprob of `response_tokens[i]`."""

    response_tokens: TokenArray  # int32 [n], read-only
    logprobs: LogprobArray  # float32 [n], read-only, at the sampling temperature
    finish_reason: str  # "stop" | "length" (checked by the validator)
    reward: float  # the worker's reward; the trainer recomputes its own

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "response_tokens", as_token_array(self.response_tokens, "response_tokens")
        )
        object.__setattr__(self, "logprobs", as_logprob_array(self.logprobs, "logprobs"))
        object.__setattr__(self, "finish_reason", _check_str(self.finish_reason, "finish_reason"))
        object.__setattr__(self, "reward", _check_float(self.reward, "reward"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        return _same_fields(self, other)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RolloutGroup:
    """One prompt group as uploaded by a worker. Equality is bitwise on the arrays."""

    schema_version: int = SCHEMA_VERSION
    kind: str  # "train" | "eval"
    run: str  # run name
    task_id: str  # the task (dataset) the prompt came from
    prompt_index: int  # index of the prompt within the task
    prompt_tokens: TokenArray  # int32 [p], read-only
    samples: tuple[Sample, ...]  # the G samples
    weight_version: int  # weight version the samples were drawn from
    state_digest: str  # hex digest of that weight state
    sampling: SamplingParams
    worker_id: str
    seq: int  # sequence number of this record within the worker
    started_at: float  # seconds since the epoch
    finished_at: float  # seconds since the epoch

    def __post_init__(self) -> None:
        for name in ("schema_version", "prompt_index", "weight_version", "seq"):
            object.__setattr__(self, name, _check_int(getattr(self, name), name))
        for name in ("kind", "run", "task_id", "state_digest", "worker_id"):
            _check_str(getattr(self, name), name)
        for name in ("started_at", "finished_at"):
            object.__setattr__(self, name, _check_float(getattr(self, name), name))
        object.__setattr__(
            self, "prompt_tokens", as_token_array(self.prompt_tokens, "prompt_tokens")
        )
        samples = tuple(self.samples)
        if not all(isinstance(s, Sample) for s in samples):
            raise TypeError("samples must be Sample instances")
        object.__setattr__(self, "samples", samples)
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError("sampling must be SamplingParams")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RolloutGroup):
            return NotImplemented
        return _same_fields(self, other)


# ---------------------------------------------------------------------------------------------
# Wire types (msgpack map layout), derived from the in-memory types: one map per dataclass, its
# fields the map keys in field order. ints travel as int64, arrays (`TokenArray`, `LogprobArray`)
# as their little-endian bytes, tuples as arrays, nested dataclasses as nested maps.

Int64 = Annotated[int, msgspec.Meta(ge=_INT64_MIN, le=_INT64_MAX)]


@dataclass(frozen=True, slots=True)
class _Codec:
    """How one in-memory type travels: its msgspec wire type and the two conversions."""

    wire: Any
    to_wire: Callable[[Any], Any]
    from_wire: Callable[[Any, str], Any]  # (wire value, field path for error messages)


def _same(value: Any) -> Any:
    return value


def _kept(value: Any, where: str) -> Any:
    return value


def _array_codec(dtype: np.dtype) -> _Codec:
    return _Codec(
        bytes,
        lambda a: a.astype(dtype).tobytes(),
        lambda raw, where: _wire_array(raw, dtype, where),
    )


def _tuple_codec(item: _Codec) -> _Codec:
    return _Codec(
        GenericAlias(list, (item.wire,)),  # list[item.wire], built at run time
        lambda xs: [item.to_wire(x) for x in xs],
        lambda xs, where: tuple(item.from_wire(x, f"{where}[{i}]") for i, x in enumerate(xs)),
    )


def _struct_codec(cls: type) -> _Codec:
    hints = get_type_hints(cls, include_extras=True)
    parts = [(f.name, _codec(hints[f.name])) for f in fields(cls)]
    wire = msgspec.defstruct(
        f"_Wire{cls.__name__}", [(name, c.wire) for name, c in parts], forbid_unknown_fields=True
    )

    def to_wire(obj: Any) -> Any:
        return wire(*[c.to_wire(getattr(obj, name)) for name, c in parts])

    def from_wire(w: Any, where: str) -> Any:
        prefix = f"{where}." if where else ""
        return cls(**{name: c.from_wire(getattr(w, name), prefix + name) for name, c in parts})

    return _Codec(wire, to_wire, from_wire)


def _codec(hint: Any) -> _Codec:
    if get_origin(hint) is Annotated:
        base, dtype = get_args(hint)[:2]
        if base is np.ndarray and isinstance(dtype, np.dtype):
            return _array_codec(dtype)
    if hint is int:
        return _Codec(Int64, _same, _kept)
    if hint in (float, str):
        return _Codec(hint, _same, _kept)
    if get_origin(hint) is tuple and len(get_args(hint)) == 2 and get_args(hint)[1] is Ellipsis:
        return _tuple_codec(_codec(get_args(hint)[0]))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _struct_codec(hint)
    raise TypeError(f"no wire form for {hint!r}")


def _wire_array(raw: bytes, dtype: np.dtype, name: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise RecordError("schema", f"{name}: {len(raw)} bytes, not a multiple of {dtype.itemsize}")
    return np.frombuffer(raw, dtype=dtype)  # read-only view; the Sample converts if not native


_GROUP = _struct_codec(RolloutGroup)


class _WireVersion(msgspec.Struct):  # any map with a schema_version; other fields ignored
    schema_version: Int64


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_GROUP.wire)
_VERSION_DECODER = msgspec.msgpack.Decoder(_WireVersion)


# ---------------------------------------------------------------------------------------------
# Encode / decode


def encode_payload(group: RolloutGroup) -> bytes:
    """The uncompressed msgpack payload of `group` (no header)."""
    return _ENCODER.encode(_GROUP.to_wire(group))


def frame_payload(payload: bytes) -> bytes:
    """Header + zstd frame around an msgpack payload (content size and checksum included)."""
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True)
    return MAGIC + bytes([FORMAT]) + cctx.compress(payload)


def encode_group(group: RolloutGroup) -> bytes:
    """Encode `group` as a record. Deterministic; does not validate (see validate_group)."""
    return frame_payload(encode_payload(group))


def _short(x: object, n: int = 80) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


def unframe(data: bytes | bytearray | memoryview, *, max_bytes: int) -> bytes:
    """Check the header and decompress the frame, never producing more than `max_bytes`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordError("not_bytes", f"record must be bytes, got {type(data).__name__}")
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > max_bytes:
        raise RecordError("too_large", f"object is {size} bytes, limit {max_bytes}")
    data = bytes(data)  # no copy for bytes; bounded by max_bytes otherwise
    if len(data) < HEADER_LEN or data[: len(MAGIC)] != MAGIC:
        raise RecordError("bad_magic", f"starts with {_short(bytes(data[:HEADER_LEN]))}")
    if data[len(MAGIC)] != FORMAT:
        raise RecordError("bad_format", f"format {data[len(MAGIC)]}, expected {FORMAT}")
    body = memoryview(data)[HEADER_LEN:]
    try:
        params = zstandard.get_frame_parameters(body)
    except zstandard.ZstdError as e:
        raise RecordError("decompress", f"bad frame header: {e}") from None
    size = params.content_size
    if size == zstandard.CONTENTSIZE_UNKNOWN or size == 0:
        raise RecordError("decompress", "frame declares no (or a zero) content size")
    if size > max_bytes:
        raise RecordError("too_large", f"declares {size} decompressed bytes, limit {max_bytes}")
    if params.dict_id:
        raise RecordError("decompress", "frame needs a dictionary")
    try:
        # With a declared content size, the output buffer is exactly that size; a frame that
        # produces more or less, or bytes after the frame, is an error.
        out = zstandard.ZstdDecompressor().decompress(
            body, max_output_size=max_bytes, allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise RecordError("decompress", str(e)) from None
    if len(out) != size:
        raise RecordError("decompress", f"frame gave {len(out)} bytes, declared {size}")
    return out


def _type_reason(payload: bytes) -> str:
    """"schema_version" when a mistyped payload declares another schema (its layout may differ)."""
    try:
        version = _VERSION_DECODER.decode(payload).schema_version
    except msgspec.MsgspecError:
        return "type"
    return "type" if version == SCHEMA_VERSION else "schema_version"


def decode_payload(payload: bytes, *, max_samples: int | None = None) -> RolloutGroup:
    """Decode an msgpack payload into a RolloutGroup (structure only, values unchecked)."""
    try:
        wire = _DECODER.decode(payload)
    except msgspec.ValidationError as e:
        raise RecordError(_type_reason(payload), str(e)) from None
    except msgspec.DecodeError as e:
        raise RecordError("msgpack", str(e)) from None
    if max_samples is not None and len(wire.samples) > max_samples:
        # Checked before building arrays: a payload of empty samples inflates ~4x when built.
        raise RecordError("group_size", f"{len(wire.samples)} samples, limit {max_samples}")
    try:
        return _GROUP.from_wire(wire, "")
    except (TypeError, ValueError) as e:
        raise RecordError("schema", str(e)) from None


def decode_group(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    max_samples: int | None = None,
) -> RolloutGroup:
    """Decode a record. Raises RecordError (and nothing else) for any malformed input.

    `max_bytes` caps both the object's size and its decompressed payload size; `max_samples`,
    when given, caps the number of samples before any array is built. Peak memory stays within
    a small multiple of `max_bytes`: the worst case, a payload of empty samples, reaches ~3x with
    `max_samples` set and ~8x without.
    """
    return decode_payload(unframe(data, max_bytes=max_bytes), max_samples=max_samples)


__all__ = [
    "DECODE_REASONS",
    "DEFAULT_MAX_RECORD_BYTES",
    "FINISH_REASONS",
    "FORMAT",
    "KINDS",
    "MAGIC",
    "SCHEMA_VERSION",
    "RecordError",
    "RolloutGroup",
    "Sample",
    "SamplingParams",
    "as_logprob_array",
    "as_token_array",
    "decode_group",
    "decode_payload",
    "encode_group",
    "encode_payload",
    "frame_payload",
    "unframe",
]
