"""The rollout-group record: one msgspec Struct per part, the same types in memory and on the wire.

A record is one prompt group: the prompt tokens and G sampled responses, with the per-token
logprobs the worker saw, a loss mask, the rewards, and the weight version it sampled from. A
response is everything after the prompt: for a tool task, model turns interleaved with tool
observations; for a single-turn task, model tokens only. Every sample carries

    mask        uint8 per response token: 1 = sampled by the model, 0 = a tool/observation token
    turns       model turns (the runs of 1s in `mask`)
    tool_calls  tool observations appended (the runs of 0s in `mask`)

A single-turn sample leaves them at their defaults: an all-ones mask, one turn, no tool call.
`logprobs` keeps one entry per response token (slime's `rollout_log_probs` layout); at a tool
position it is +0.0 and means nothing.

Token ids, logprobs and the mask travel as raw little-endian int32 / float32 / uint8 bytes (so
every float32 bit pattern, -0.0, subnormals and NaN payloads included, round-trips exactly); in
memory they are read-only numpy arrays (views of the decoded bytes). `__post_init__` turns what
it is given (bytes off the wire, or any array-like) into those arrays, on construction, on
decoding and on `msgspec.structs.replace`. The codec is `slime_stoa.protocol.records`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import numpy as np
from msgspec.structs import force_setattr

KINDS = ("train", "eval")
#: The weight planes a worker samples with (`RolloutGroup.plane`).
PLANES = ("bf16", "int8", "int4")
#: "turns": the episode's last allowed model turn called a tool (the tool was not run).
FINISH_REASONS = ("stop", "length", "turns")
#: Most samples and stop sequences the schema lets a record hold: bounds what decoding builds
#: before any limit of the reader's applies (the validator's limits are tighter).
MAX_SAMPLES = 4096
MAX_STOP_SEQUENCES = 256

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INT32 = np.iinfo(np.int32)
TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
MASK_DTYPE = np.dtype("u1")

Int64 = Annotated[int, msgspec.Meta(ge=_INT64_MIN, le=_INT64_MAX)]

if TYPE_CHECKING:  # in memory: a read-only numpy array
    Array = np.ndarray
    OptionalArray = np.ndarray
else:  # on the wire: its raw bytes (a mask left out is all ones, filled in by __post_init__)
    Array = bytes
    OptionalArray = bytes | msgspec.UnsetType
_ALL_ONES: Any = msgspec.UNSET  # Sample.mask's default: every token the model's


class RecordError(Exception):
    """A record could not be decoded. `reason` is a stable code (`records.DECODE_REASONS`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)  # args kept as (reason, detail) so it pickles
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


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
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _frozen(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`a` as a read-only array of `dtype`. Copies unless `a` already views immutable bytes."""
    if a.dtype != dtype or not isinstance(a.base, bytes):
        a = np.array(a, dtype=dtype)
        a.setflags(write=False)
    return a


def _array(value: Any, dtype: np.dtype, kinds: str, name: str) -> np.ndarray:
    """`value` as a read-only 1-D array of `dtype`: bytes are its wire form (raw little-endian,
    viewed, not copied); anything else must be a 1-D array-like of `kinds` (numpy dtype kinds)
    whose values fit `dtype`."""
    if isinstance(value, bytes):
        if len(value) % dtype.itemsize:
            raise RecordError("schema", f"{name}: {len(value)} bytes, not a multiple of {dtype.itemsize}")
        return np.frombuffer(value, dtype=dtype)  # read-only: a view of immutable bytes
    a = np.asarray(value)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in kinds:
        raise TypeError(f"{name} must hold {'floats' if kinds == 'f' else 'integers'}, got dtype {a.dtype}")
    if a.size and a.dtype.kind in "iu" and a.dtype != dtype:
        info = np.iinfo(dtype)
        if a.min() < info.min or a.max() > info.max:
            raise ValueError(f"{name} has values outside {dtype.name}")
    return _frozen(a, dtype)


def as_token_array(value: Any, name: str = "tokens") -> np.ndarray:
    """Token ids as a read-only 1-D int32 array. Rejects non-integer input and int32 overflow."""
    return _array(value, TOKEN_DTYPE, "iu", name)


def as_logprob_array(value: Any, name: str = "logprobs") -> np.ndarray:
    """Logprobs as a read-only 1-D float32 array (wider floats are rounded to float32)."""
    return _array(value, LOGPROB_DTYPE, "f", name)


def as_mask_array(value: Any, name: str = "mask") -> np.ndarray:
    """A loss mask as a read-only 1-D uint8 array (its values are the validator's to check)."""
    return _array(value, MASK_DTYPE, "iub", name)


def _same_value(a: Any, b: Any) -> bool:
    """Arrays bitwise (-0.0 != 0.0, a NaN equals the same NaN), floats NaN-equal."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    return bool(a == b)


class _Part(msgspec.Struct, frozen=True, kw_only=True, eq=False, forbid_unknown_fields=True):
    """A record part: immutable, strict on the wire, equal field by field (`_same_value`)."""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_same_value(getattr(self, f), getattr(other, f)) for f in self.__struct_fields__)

    def __ne__(self, other: object) -> bool:  # msgspec's own `!=` would compare identities
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal


class SamplingParams(_Part, frozen=True, kw_only=True):
    """Sampling parameters the worker used. Logprobs are taken at `temperature`."""

    temperature: float
    top_p: float
    max_tokens: Int64
    stop: Annotated[tuple[str, ...], msgspec.Meta(max_length=MAX_STOP_SEQUENCES)] = ()

    def __post_init__(self) -> None:
        force_setattr(self, "temperature", _check_float(self.temperature, "temperature"))
        force_setattr(self, "top_p", _check_float(self.top_p, "top_p"))
        force_setattr(self, "max_tokens", _check_int(self.max_tokens, "max_tokens"))
        if isinstance(self.stop, str):
            raise TypeError("stop must be a sequence of str, not a str")
        force_setattr(self, "stop", tuple(_check_str(s, "stop[]") for s in self.stop))

    def __hash__(self) -> int:  # used as a key by callers; consistent with NaN-equal floats
        return hash((self.max_tokens, self.stop))


class Sample(_Part, frozen=True, kw_only=True):
    """One sampled response. `logprobs[i]` is the logprob of `response_tokens[i]` (+0.0 at a
    tool token); `mask` defaults to all ones (every token the model's)."""

    response_tokens: Array  # int32 [n]
    logprobs: Array  # float32 [n], at the sampling temperature
    mask: OptionalArray = _ALL_ONES  # uint8 [n]: 1 model, 0 tool
    finish_reason: str  # "stop" | "length" | "turns" (checked by the validator)
    reward: float  # the worker's reward; the trainer recomputes its own
    turns: Int64 = 1  # model turns (runs of 1s in mask)
    tool_calls: Int64 = 0  # tool observations (runs of 0s in mask)

    def __post_init__(self) -> None:
        tokens = as_token_array(self.response_tokens, "response_tokens")
        force_setattr(self, "response_tokens", tokens)
        force_setattr(self, "logprobs", as_logprob_array(self.logprobs, "logprobs"))
        if self.mask is msgspec.UNSET:
            mask = np.ones(len(tokens), dtype=MASK_DTYPE)
            mask.setflags(write=False)
            force_setattr(self, "mask", mask)
        else:
            force_setattr(self, "mask", as_mask_array(self.mask, "mask"))
        force_setattr(self, "finish_reason", _check_str(self.finish_reason, "finish_reason"))
        force_setattr(self, "reward", _check_float(self.reward, "reward"))
        for name in ("turns", "tool_calls"):
            force_setattr(self, name, _check_int(getattr(self, name), name))


class RolloutGroup(_Part, frozen=True, kw_only=True):
    """One prompt group as uploaded by a worker. Equality is bitwise on the arrays."""

    kind: str  # "train" | "eval"
    run: str  # run name
    task_id: str  # the task (dataset) the prompt came from
    prompt_index: Int64  # index of the prompt within the task
    prompt_tokens: Array  # int32 [p]
    samples: Annotated[tuple[Sample, ...], msgspec.Meta(max_length=MAX_SAMPLES)]  # the G samples
    weight_version: Int64  # weight version the samples were drawn from
    state_digest: str  # hex digest of that weight state
    sampling: SamplingParams
    plane: str = "bf16"  # the weight plane sampled with (`PLANES`; the validator: one the run offers)
    worker_id: str
    seq: Int64  # sequence number of this record within the worker
    started_at: float  # seconds since the epoch
    finished_at: float  # seconds since the epoch

    def __post_init__(self) -> None:
        for name in ("kind", "run", "task_id", "state_digest", "plane", "worker_id"):
            _check_str(getattr(self, name), name)
        if self.plane not in PLANES:  # decoding: a "type" error, like any value outside the schema
            raise ValueError(f"plane must be one of {PLANES}, got {self.plane!r}")
        for name in ("prompt_index", "weight_version", "seq"):
            force_setattr(self, name, _check_int(getattr(self, name), name))
        for name in ("started_at", "finished_at"):
            force_setattr(self, name, _check_float(getattr(self, name), name))
        force_setattr(self, "prompt_tokens", as_token_array(self.prompt_tokens, "prompt_tokens"))
        samples = tuple(self.samples)
        if not all(isinstance(s, Sample) for s in samples):
            raise TypeError("samples must be Sample instances")
        force_setattr(self, "samples", samples)
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError("sampling must be SamplingParams")
