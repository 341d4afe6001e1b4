"""Rollout-group records on the wire: `encode_group` and `decode_group`.

The types are `slime_stoa.protocol.record_types` (one msgspec Struct per part, the same in memory
and on the wire). Workers upload one record per object; the trainer decodes it with
`decode_group` and checks its values with `slime_stoa.protocol.validate`.

Wire format:

    MAGIC (7 bytes) | FORMAT (1 byte) | one zstd frame (content size and checksum present)

The frame holds one msgpack map: `RolloutGroup`'s fields in order, its samples and sampling
parameters as nested maps, token ids / logprobs / masks as raw little-endian bytes. A change of
layout bumps FORMAT, so a reader refuses it by name ("bad_format").

`decode_group` trusts nothing: any malformed input raises `RecordError` with a stable `reason`
code (and nothing else: no `RecursionError`, no `MemoryError` from a declared length), and memory
stays within a small multiple of `max_bytes` (the decompressed size is checked against the frame
header before anything is allocated, and the frame must decompress to exactly that size; the
schema caps the samples and stop sequences, so what decoding builds is bounded too). The frame
must carry its checksum and need no dictionary. A record has exactly one byte form: the typed
decoder refuses a missing, unknown or mistyped field where it starts (so nesting is bounded by
the schema), and the payload must re-encode to itself (a duplicate or reordered key, an int for a
float, a float32 or a non-minimal header is refused). Decoding checks structure only; value
checks (vocabulary, finite logprobs, limits) are `slime_stoa.protocol.validate`'s job.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import zstandard

from slime_stoa.protocol.record_types import (
    FINISH_REASONS,
    KINDS,
    MAX_SAMPLES,
    PLANES,
    RecordError,
    RolloutGroup,
    Sample,
    SamplingParams,
    as_logprob_array,
    as_mask_array,
    as_token_array,
)

MAGIC = b"\x89STOARG"  # non-ASCII first byte: a text file never looks like a record
FORMAT = 2  # 1 was the two-schema layout of before the first deployment
HEADER_LEN = len(MAGIC) + 1
ZSTD_LEVEL = 3
DEFAULT_MAX_RECORD_BYTES = 32 * 1024 * 1024  # cap on the object and on its decompressed payload
_MAX_WINDOW = 1 << 27  # zstd's own default limit, checked before the decompressor sees the frame

# Stable reason codes of RecordError, for counting rejects.
DECODE_REASONS = frozenset(
    {
        "not_bytes",  # input is not bytes-like
        "bad_magic",  # not a stoa rollout-group record
        "bad_format",  # right magic, unknown format byte
        "too_large",  # object or declared decompressed size over max_bytes
        "decompress",  # corrupt, truncated or trailing zstd data, no content size or checksum, a dictionary
        "msgpack",  # payload is not exactly one well-formed msgpack value in canonical form
        "type",  # field missing, unknown, out of int64 range, of the wrong type, or over a schema cap
        "schema",  # types fine but structurally inconsistent (token bytes not a multiple of 4)
        "group_size",  # more samples than the decoder's max_samples (same code as the validator's)
    }
)


def _array_bytes(value: Any) -> bytes:
    """msgspec's hook for the arrays: their raw bytes (the types keep them little-endian)."""
    if isinstance(value, np.ndarray):
        return value.tobytes()
    raise NotImplementedError(f"no wire form for {type(value).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_array_bytes)
_DECODER = msgspec.msgpack.Decoder(RolloutGroup)


def encode_payload(group: RolloutGroup) -> bytes:
    """The uncompressed msgpack payload of `group` (no header)."""
    return _ENCODER.encode(group)


def frame_payload(payload: bytes) -> bytes:
    """Header + zstd frame around an msgpack payload (content size and checksum included)."""
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True)
    return MAGIC + bytes([FORMAT]) + cctx.compress(payload)


def encode_group(group: RolloutGroup, *, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
    """Encode `group` as a record. Deterministic; does not validate (see validate_group).

    ValueError when the payload or the record is over `max_bytes`: a reader with that limit
    would refuse it as "too_large", so it is never written."""
    payload = encode_payload(group)
    if len(payload) > max_bytes:
        raise ValueError(f"record payload is {len(payload)} bytes, over the record limit {max_bytes}")
    record = frame_payload(payload)
    if len(record) > max_bytes:
        raise ValueError(f"record is {len(record)} bytes, over the record limit {max_bytes}")
    return record


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
        out = zstandard.ZstdDecompressor().decompress(body, max_output_size=max_bytes, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise RecordError("decompress", str(e)) from None
    if len(out) != size:
        raise RecordError("decompress", f"frame gave {len(out)} bytes, declared {size}")
    return out


def decode_payload(payload: bytes, *, max_samples: int | None = None) -> RolloutGroup:
    """Decode an msgpack payload into a RolloutGroup (structure only, values unchecked).

    The payload must be exactly the canonical encoding of its fields, the one `encode_payload`
    writes (msgspec's: keys in field order, each once, minimal int, str, bin, array and map
    headers, float64 floats). So a map with a duplicate key (which msgspec alone would read as
    its last value), reordered keys, a field left at its default by omission, an int where a
    float belongs or a float32 are refused ("msgpack"), and a record has exactly one byte form."""
    try:
        group = _DECODER.decode(payload)
    except msgspec.ValidationError as e:
        raise RecordError("type", str(e)) from None
    except msgspec.DecodeError as e:
        raise RecordError("msgpack", str(e)) from None
    except RecursionError:  # not expected: the typed decoder never descends below the schema
        raise RecordError("msgpack", "nested too deep") from None
    if max_samples is not None and len(group.samples) > max_samples:
        raise RecordError("group_size", f"{len(group.samples)} samples, limit {max_samples}")
    if _ENCODER.encode(group) != payload:
        raise RecordError(
            "msgpack",
            "not the canonical encoding of its fields (a duplicate, reordered or omitted key, an int for "
            "a float, a float32, or a non-minimal header)",
        )
    return group


def decode_group(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    max_samples: int | None = None,
) -> RolloutGroup:
    """Decode a record. Raises RecordError (and nothing else) for any malformed input.

    `max_bytes` caps both the object's size and its decompressed payload size; `max_samples`,
    when given, caps the number of samples (the schema caps them at MAX_SAMPLES while decoding).
    """
    return decode_payload(unframe(data, max_bytes=max_bytes), max_samples=max_samples)


__all__ = [
    "DECODE_REASONS",
    "DEFAULT_MAX_RECORD_BYTES",
    "FINISH_REASONS",
    "FORMAT",
    "KINDS",
    "MAGIC",
    "MAX_SAMPLES",
    "PLANES",
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
