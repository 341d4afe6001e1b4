"""Rollout-group records (schemas v1 and v2): the in-memory types and their wire encoding.

A record is one prompt group: the prompt tokens and G sampled responses, with the per-token
logprobs the worker saw, its rewards, and the weight version it sampled from. Workers upload one
record per object; the trainer decodes it with `decode_group` and checks it with
`slime_stoa.protocol.validate`.

Schemas. v1 is single-turn: every response token was sampled by the model. v2 adds multi-turn
tool episodes: a response is the whole continuation after the prompt, model turns interleaved
with tool observations, and each sample also carries

    mask        uint8 per response token: 1 = sampled by the model, 0 = a tool/observation token
    turns       model turns (the runs of 1s in `mask`)
    tool_calls  tool observations appended (the runs of 0s in `mask`)

`logprobs` keeps one entry per response token (the same length check as v1, and slime's
`rollout_log_probs` layout); at a tool position it is +0.0 and means nothing. The record's
`schema_version` chooses the layout: 1 writes the v1 map (so single-turn bytes are unchanged; a
sample with a tool token cannot be written as v1), 2 the v2 map. A worker writes v2 for every
group of a tool task, tool call or not, so one run has one layout. In memory every `Sample` has
a mask: a v1 sample's is all ones (turns 1, tool calls 0).

Wire format (format 1):

    MAGIC (7 bytes) | FORMAT (1 byte) | one zstd frame (content size and checksum present)

The frame holds one msgpack map: the fields of `RolloutGroup` in order, its samples and sampling
parameters as nested maps (see "Wire types"). Token ids travel as raw little-endian int32 bytes
and logprobs as raw little-endian float32 bytes, so every float32 bit pattern (-0.0, subnormals,
NaN payloads) round-trips exactly.

`decode_group` trusts nothing: any malformed input raises `RecordError` with a stable `reason`
code (and nothing else: no `RecursionError`, no `MemoryError` from a declared length), and memory
stays within a small multiple of `max_bytes` (the decompressed size is checked against the frame
header before anything is allocated, and the frame must decompress to exactly that size). The
frame must carry its checksum and need no dictionary. The payload must be the canonical encoding
of its fields (the one `encode_payload` writes): a map with a duplicate key, reordered keys or a
non-minimal encoding is refused, so a record has exactly one byte form. Nesting is bounded by the
schema: the typed decoder refuses a value of the wrong type where it starts, however deep it
goes.
Decoding checks structure only; value checks (vocabulary, finite logprobs, limits) are
`slime_stoa.protocol.validate`'s job.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from dataclasses import dataclass, fields
from types import GenericAlias
from typing import Annotated, Any, get_args, get_origin, get_type_hints

import msgspec
import numpy as np
import zstandard

SCHEMA_V1 = 1  # single-turn: every response token is the model's
SCHEMA_V2 = 2  # multi-turn tool episodes: a per-token mask, turns and tool calls per sample
SCHEMA_VERSION = SCHEMA_V1  # the default (and the single-turn layout)
SCHEMA_VERSIONS = (SCHEMA_V1, SCHEMA_V2)
MAGIC = b"\x89STOARG"  # non-ASCII first byte: a text file never looks like a record
FORMAT = 1
HEADER_LEN = len(MAGIC) + 1
ZSTD_LEVEL = 3
DEFAULT_MAX_RECORD_BYTES = 32 * 1024 * 1024  # cap on the object and on its decompressed payload
_MAX_WINDOW = 1 << 27  # zstd's own default limit, checked before the decompressor sees the frame

KINDS = ("train", "eval")
#: The weight planes a worker samples with (`RolloutGroup.plane`).
PLANES = ("bf16", "int8", "int4")
FINISH_REASONS = ("stop", "length")
#: v2 adds "turns": the episode's last allowed model turn called a tool (the tool was not run).
FINISH_REASONS_V2 = (*FINISH_REASONS, "turns")

# Stable reason codes of RecordError, for counting rejects.
DECODE_REASONS = frozenset(
    {
        "not_bytes",  # input is not bytes-like
        "bad_magic",  # not a stoa rollout-group record
        "bad_format",  # right magic, unknown format byte
        "too_large",  # object or declared decompressed size over max_bytes
        "decompress",  # corrupt, truncated or trailing zstd data, no content size or checksum, a dictionary
        "msgpack",  # payload is not exactly one well-formed msgpack value in canonical form (duplicate keys)
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
_MASK_WIRE = np.dtype("u1")


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


def as_mask_array(value: Any, name: str = "mask") -> np.ndarray:
    """A loss mask as a read-only 1-D uint8 array (values are checked by the validator)."""
    a = np.asarray(value)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iub":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.size and a.dtype.kind != "b" and (a.min() < 0 or a.max() > 255):
        raise ValueError(f"{name} has values outside uint8")
    return _frozen(a, _MASK_WIRE)


#: Token ids in memory: a read-only int32 array; on the wire, its little-endian int32 bytes.
TokenArray = Annotated[np.ndarray, _TOKEN_WIRE]
#: Logprobs in memory: a read-only float32 array; on the wire, its little-endian float32 bytes.
LogprobArray = Annotated[np.ndarray, _LOGPROB_WIRE]
#: A loss mask in memory: a read-only uint8 array; on the wire (v2 only), its bytes.
MaskArray = Annotated[np.ndarray, _MASK_WIRE]
_DEFAULT_MASK = np.zeros(0, dtype=np.uint8)  # sentinel: "every token is the model's"


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
    """One sampled response. `logprobs[i]` is the logprob of `response_tokens[i]` (v2: +0.0 at a
    tool token). `mask` defaults to all ones (every token the model's)."""

    response_tokens: TokenArray  # int32 [n], read-only
    logprobs: LogprobArray  # float32 [n], read-only, at the sampling temperature
    finish_reason: str  # "stop" | "length" | v2: "turns" (checked by the validator)
    reward: float  # the worker's reward; the trainer recomputes its own
    mask: MaskArray = dataclasses.field(default_factory=lambda: _DEFAULT_MASK)  # uint8 [n]: 1 model, 0 tool
    turns: int = 1  # model turns (runs of 1s in mask)
    tool_calls: int = 0  # tool observations (runs of 0s in mask)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "response_tokens", as_token_array(self.response_tokens, "response_tokens")
        )
        object.__setattr__(self, "logprobs", as_logprob_array(self.logprobs, "logprobs"))
        object.__setattr__(self, "finish_reason", _check_str(self.finish_reason, "finish_reason"))
        object.__setattr__(self, "reward", _check_float(self.reward, "reward"))
        if self.mask is _DEFAULT_MASK:
            mask = np.ones(len(self.response_tokens), dtype=np.uint8)
            mask.setflags(write=False)
            object.__setattr__(self, "mask", mask)
        else:
            object.__setattr__(self, "mask", as_mask_array(self.mask, "mask"))
        for name in ("turns", "tool_calls"):
            object.__setattr__(self, name, _check_int(getattr(self, name), name))

    @property
    def single_turn(self) -> bool:
        """Whether the v1 layout can hold this sample: one turn, no tool call, no tool token.

        The v1 wire has no mask (it is implied all ones), so its length is not looked at: a
        sample `dataclasses.replace`d with other tokens keeps its old mask."""
        return self.turns == 1 and self.tool_calls == 0 and bool(np.all(self.mask == 1))

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
    plane: str = "bf16"  # the weight plane sampled with (`PLANES`); on the wire only when not bf16

    def __post_init__(self) -> None:
        if self.plane not in PLANES:
            raise ValueError(f"plane must be one of {PLANES}, got {self.plane!r}")
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


def _struct_codec(
    cls: type, *, only: tuple[str, ...] | None = None, nested: dict[str, _Codec] | None = None, tag: str = "",
    optional: tuple[str, ...] = (),
) -> _Codec:
    """The codec of dataclass `cls`: its fields in order (`only`: just those), each by its type
    hint unless `nested` gives its codec. `optional` fields (last, with defaults) travel only
    when they differ from their default, so a record that leaves them at it encodes as before."""
    hints = get_type_hints(cls, include_extras=True)
    nested = nested or {}
    defaults = {f.name: f.default for f in fields(cls)}
    names = [f.name for f in fields(cls) if only is None or f.name in only]
    parts = [(name, nested[name] if name in nested else _codec(hints[name])) for name in names]
    wire = msgspec.defstruct(
        f"_Wire{cls.__name__}{tag}",
        [(name, c.wire, defaults[name]) if name in optional else (name, c.wire) for name, c in parts],
        forbid_unknown_fields=True, omit_defaults=bool(optional),
    )

    def to_wire(obj: Any) -> Any:
        return wire(*[c.to_wire(_as_default(getattr(obj, name), defaults[name], name in optional)) for name, c in parts])

    def from_wire(w: Any, where: str) -> Any:
        prefix = f"{where}." if where else ""
        return cls(**{name: c.from_wire(getattr(w, name), prefix + name) for name, c in parts})

    return _Codec(wire, to_wire, from_wire)


def _as_default(value: Any, default: Any, optional: bool) -> Any:
    """An optional field's value, its default object itself when equal to it: msgspec omits a
    default by identity, and a value equal to it must not travel either (one byte form)."""
    return default if optional and value == default else value


def _canonical_wire(wire: Any) -> Any:
    """A decoded group's wire struct with an optional field that spelled out its default put back
    to the default object, so the canonical check refuses it (the field must be omitted)."""
    if getattr(wire, "plane", None) == _PLANE_DEFAULT:
        return msgspec.structs.replace(wire, plane=_PLANE_DEFAULT)
    return wire


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


V1_SAMPLE_FIELDS = ("response_tokens", "logprobs", "finish_reason", "reward")
_SAMPLE_V1 = _struct_codec(Sample, only=V1_SAMPLE_FIELDS, tag="V1")
_SAMPLE_V2 = _struct_codec(Sample, nested={"mask": _array_codec(_MASK_WIRE)}, tag="V2")
_GROUPS = {
    SCHEMA_V1: _struct_codec(RolloutGroup, nested={"samples": _tuple_codec(_SAMPLE_V1)}, tag="V1", optional=("plane",)),
    SCHEMA_V2: _struct_codec(RolloutGroup, nested={"samples": _tuple_codec(_SAMPLE_V2)}, tag="V2", optional=("plane",)),
}


def _layout(version: int | None) -> int:
    """The wire layout of a schema version: v2's for 2, v1's for any other (an unknown version
    that fits v1's layout decodes, and the validator refuses it)."""
    return SCHEMA_V2 if version == SCHEMA_V2 else SCHEMA_V1


_PLANE_DEFAULT = next(f.default for f in fields(RolloutGroup) if f.name == "plane")
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {v: msgspec.msgpack.Decoder(c.wire) for v, c in _GROUPS.items()}


# ---------------------------------------------------------------------------------------------
# Encode / decode


def encode_payload(group: RolloutGroup) -> bytes:
    """The uncompressed msgpack payload of `group` (no header), in its schema's layout.

    ValueError when a v1 (or unknown-version) group holds a sample only v2 can carry."""
    layout = _layout(group.schema_version)
    if layout == SCHEMA_V1:
        for i, s in enumerate(group.samples):
            if not s.single_turn:
                raise ValueError(
                    f"samples[{i}] has tool tokens, turns or tool calls: schema v1 cannot hold them "
                    f"(use schema_version={SCHEMA_V2})"
                )
    return _ENCODER.encode(_GROUPS[layout].to_wire(group))


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
    if not params.has_checksum:
        raise RecordError("decompress", "frame has no checksum")
    if params.window_size > _MAX_WINDOW:
        raise RecordError("decompress", f"frame window {params.window_size} over {_MAX_WINDOW}")
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


def _type_reason(version: int | None) -> str:
    """"schema_version" when a mistyped payload declares an unknown schema (its layout may differ)."""
    return "type" if version is None or version in SCHEMA_VERSIONS else "schema_version"


#: Deepest msgpack nesting walked when looking for `schema_version` (the schema's is 4: the record
#: map, the samples array, a sample map, its values). The typed decoder itself never descends
#: below the schema: a value of the wrong type is refused where it starts.
MAX_DEPTH = 8
_PEEK_ITEMS = 1 << 16  # most items walked before giving up

# msgpack type bytes (besides the fix ranges): kind and big-endian length/value format, or size.
_SIZED = {
    0xC4: ("bin", ">B"), 0xC5: ("bin", ">H"), 0xC6: ("bin", ">I"),
    0xC7: ("ext", ">B"), 0xC8: ("ext", ">H"), 0xC9: ("ext", ">I"),
    0xCC: ("int", ">B"), 0xCD: ("int", ">H"), 0xCE: ("int", ">I"), 0xCF: ("int", ">Q"),
    0xD0: ("int", ">b"), 0xD1: ("int", ">h"), 0xD2: ("int", ">i"), 0xD3: ("int", ">q"),
    0xD9: ("str", ">B"), 0xDA: ("str", ">H"), 0xDB: ("str", ">I"),
    0xDC: ("array", ">H"), 0xDD: ("array", ">I"),
    0xDE: ("map", ">H"), 0xDF: ("map", ">I"),
}  # fmt: skip
_FIXED = {0xCA: 4, 0xCB: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}  # floats, fixext (with type)


def _peek_schema_version(payload: bytes) -> int | None:
    """The integer `schema_version` of a top-level msgpack map, or None.

    A bounded walk (no recursion, at most `MAX_DEPTH` levels and `_PEEK_ITEMS` items): the
    payload already failed typed decoding, so it may be anything, e.g. a value nested a million
    levels deep that msgspec would only skip by recursing."""
    buf = memoryview(payload)
    try:
        pos, (kind, count) = _header(buf, 0)
        if kind != "map":
            return None
        for _ in range(min(count, _PEEK_ITEMS)):
            key_pos = pos
            pos, (key_kind, key_len) = _header(buf, pos)
            if key_kind == "str" and bytes(buf[pos : pos + key_len]) == b"schema_version":
                _, (value_kind, value) = _header(buf, pos + key_len)
                return value if value_kind == "int" else None
            pos = _skip(buf, _skip(buf, key_pos))  # the key, then its value
    except (IndexError, ValueError, struct.error):
        return None
    return None


def _header(buf: memoryview, pos: int) -> tuple[int, tuple[str, int]]:
    """(position after the header, (kind, n)) of the msgpack item at `pos`: n is the length of a
    str/bin/ext, the item count of an array/map, the value of an int, 0 for anything else."""
    b = buf[pos]
    if b <= 0x7F:
        return pos + 1, ("int", b)
    if b <= 0x8F:
        return pos + 1, ("map", b & 0x0F)
    if b <= 0x9F:
        return pos + 1, ("array", b & 0x0F)
    if b <= 0xBF:
        return pos + 1, ("str", b & 0x1F)
    if b >= 0xE0:
        return pos + 1, ("int", b - 0x100)
    if b in (0xC0, 0xC2, 0xC3):  # nil, false, true
        return pos + 1, ("atom", 0)
    if b in _SIZED:
        kind, fmt = _SIZED[b]
        (n,) = struct.unpack_from(fmt, buf, pos + 1)
        return pos + 1 + struct.calcsize(fmt), (kind, n)
    if b in _FIXED:
        return pos + 1 + _FIXED[b], ("atom", 0)
    raise ValueError(f"byte 0x{b:02x} starts no msgpack item")


def _skip(buf: memoryview, pos: int) -> int:
    """The position after the msgpack item at `pos` (iterative, bounded depth and item count)."""
    left = [1]  # items still to read at each open level
    items = 0
    while left:
        if left[-1] == 0:
            left.pop()
            continue
        left[-1] -= 1
        items += 1
        if items > _PEEK_ITEMS:
            raise ValueError("too many items")
        pos, (kind, n) = _header(buf, pos)
        if kind in ("str", "bin"):
            pos += n
        elif kind == "ext":
            pos += 1 + n
        elif kind in ("array", "map"):
            if len(left) >= MAX_DEPTH:
                raise ValueError("nested too deep")
            left.append(2 * n if kind == "map" else n)
        if pos > len(buf):
            raise ValueError("truncated")
    return pos


def decode_payload(payload: bytes, *, max_samples: int | None = None) -> RolloutGroup:
    """Decode an msgpack payload into a RolloutGroup (structure only, values unchecked).

    The payload must be exactly the canonical encoding of its fields, the one `encode_payload`
    writes (msgspec's: keys in field order, each once, minimal int, str, bin, array and map
    headers, float64 floats). So a map with a duplicate key (which msgspec alone would read as
    its last value), reordered keys, an int where a float belongs or a float32 are refused
    ("msgpack"), and a record has exactly one byte form. The layout is the declared
    `schema_version`'s (v2 for 2, else v1), found by a bounded peek before decoding."""
    version = _peek_schema_version(payload)
    try:
        wire = _DECODERS[_layout(version)].decode(payload)
    except msgspec.ValidationError as e:
        raise RecordError(_type_reason(version), str(e)) from None
    except msgspec.DecodeError as e:
        raise RecordError("msgpack", str(e)) from None
    except RecursionError:  # not expected: the typed decoder never skips a value
        raise RecordError("msgpack", "nested too deep") from None
    if max_samples is not None and len(wire.samples) > max_samples:
        # Checked before building arrays: a payload of empty samples inflates ~4x when built.
        raise RecordError("group_size", f"{len(wire.samples)} samples, limit {max_samples}")
    if _ENCODER.encode(_canonical_wire(wire)) != payload:
        raise RecordError(
            "msgpack",
            "not the canonical encoding of its fields (a duplicate or reordered key, an int for a "
            "float, a float32, or a non-minimal header)",
        )
    try:
        group: RolloutGroup = _GROUPS[_layout(version)].from_wire(wire, "")
        return group
    except RecordError:
        raise
    except Exception as e:  # TypeError / ValueError from the constructors; anything else alike
        raise RecordError("schema", f"{type(e).__name__}: {e}") from None


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
    "FINISH_REASONS_V2",
    "FORMAT",
    "KINDS",
    "MAGIC",
    "SCHEMA_V1",
    "SCHEMA_V2",
    "SCHEMA_VERSION",
    "SCHEMA_VERSIONS",
    "V1_SAMPLE_FIELDS",
    "RecordError",
    "RolloutGroup",
    "Sample",
    "SamplingParams",
    "as_logprob_array",
    "as_mask_array",
    "as_token_array",
    "decode_group",
    "decode_payload",
    "encode_group",
    "encode_payload",
    "frame_payload",
    "unframe",
]
