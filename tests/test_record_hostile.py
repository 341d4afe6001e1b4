"""The record decoder against hostile bytes: only RecordError escapes, nothing invalid is accepted.

Two halves:

- a hand-made corpus (`HOSTILE_PAYLOADS`, `HOSTILE_FRAMES`) of the classic attacks on a msgpack +
  zstd format: deep nesting, huge declared lengths, wrong types, duplicate keys, trailing bytes,
  non-canonical encodings, bad zstd frames, decompression bombs, each with the reason it must get;
- property tests (hypothesis) over valid records mutated by bit flips, byte writes, truncations,
  insertions and splices of other valid records, checked against an independent reference
  decoder written here: `decode_group` must accept exactly what the reference accepts, and give
  the same record.
"""

from __future__ import annotations

import struct
import sys
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime_stoa.protocol.record_types import MAX_STOP_SEQUENCES
from slime_stoa.protocol.records import (
    DECODE_REASONS,
    FORMAT,
    MAGIC,
    MAX_SAMPLES,
    RecordError,
    RolloutGroup,
    Sample,
    SamplingParams,
    decode_group,
    encode_group,
    encode_payload,
    frame_payload,
)
from slime_stoa.protocol.validate import REJECT_REASONS, RecordRejected, load_record
from tests.test_records import LIMITS, NOW, decode_reason, episode, make_sample, outcome
from tests.test_records import make_group as base_group

PROPERTY = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_group(n_samples: int = 3, **kw: Any) -> RolloutGroup:
    """`test_records.make_group` with `n_samples` samples of distinct first tokens."""
    samples = [make_sample(response_tokens=[5 + i, 6, 7], reward=float(i)) for i in range(n_samples)]
    fields: dict[str, Any] = dict(samples=samples, state_digest="0123456789abcdef" * 2)
    return base_group(**{**fields, **kw})


GROUP = make_group()
PAYLOAD = encode_payload(GROUP)
VALID = encode_group(GROUP)
OTHER_PAYLOADS = [
    encode_payload(make_group(1, run="other", seq=2**40)),
    encode_payload(make_group(5, sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8, stop=("a", "bb")))),
]


def reason_of(data: Any, **kw: Any) -> str:
    """The reason `decode_group` refuses `data` with; fails the test if it accepts or raises
    anything but a plain RecordError with a documented reason."""
    reason = decode_reason(data, **kw)
    with pytest.raises(RecordRejected) as loaded:
        load_record(data, LIMITS, now=NOW)
    assert loaded.value.reason in REJECT_REASONS
    return reason


# -- a reference msgpack parser (independent of msgspec) ---------------------------------------


class Invalid(Exception):
    pass


class Float64(float):
    pass


class Ext:
    pass


def ref_skip(buf: bytes, pos: int) -> int:
    return ref_parse(buf, pos, 0)[1]


def ref_parse(buf: bytes, pos: int, depth: int) -> tuple[Any, int]:
    """One strict msgpack item at `pos`: (value, next position). Invalid for anything malformed,
    a duplicate map key, or nesting deeper than 16."""
    if depth > 16:
        raise Invalid("deep")
    if pos >= len(buf):
        raise Invalid("truncated")
    b = buf[pos]

    def take(n: int, at: int) -> bytes:
        if at + n > len(buf):
            raise Invalid("truncated")
        return buf[at : at + n]

    def unpack(fmt: str) -> Any:
        return struct.unpack(fmt, take(struct.calcsize(fmt), pos + 1))[0]

    def container(n: int, at: int, is_map: bool) -> tuple[Any, int]:
        if is_map:
            out: dict[Any, Any] = {}
            for _ in range(n):
                k, at = ref_parse(buf, at, depth + 1)
                key = (type(k).__name__, k) if not isinstance(k, (list, dict)) else ("x", repr(k))
                v, at = ref_parse(buf, at, depth + 1)
                if key in {(type(x).__name__, x) for x in out}:
                    raise Invalid("duplicate key")
                out[k] = v
            return out, at
        items = []
        for _ in range(n):
            v, at = ref_parse(buf, at, depth + 1)
            items.append(v)
        return items, at

    def text(n: int, at: int) -> tuple[str, int]:
        try:
            return take(n, at).decode("utf-8"), at + n
        except UnicodeDecodeError:
            raise Invalid("utf-8") from None

    if b <= 0x7F:
        return b, pos + 1
    if b >= 0xE0:
        return b - 0x100, pos + 1
    if b <= 0x8F:
        return container(b & 0x0F, pos + 1, True)
    if b <= 0x9F:
        return container(b & 0x0F, pos + 1, False)
    if b <= 0xBF:
        return text(b & 0x1F, pos + 1)
    if b == 0xC0:
        return None, pos + 1
    if b in (0xC2, 0xC3):
        return b == 0xC3, pos + 1
    if b in (0xC4, 0xC5, 0xC6):
        fmt = {0xC4: ">B", 0xC5: ">H", 0xC6: ">I"}[b]
        n, at = unpack(fmt), pos + 1 + struct.calcsize(fmt)
        return take(n, at), at + n
    if b in (0xC7, 0xC8, 0xC9):
        fmt = {0xC7: ">B", 0xC8: ">H", 0xC9: ">I"}[b]
        n, at = unpack(fmt), pos + 1 + struct.calcsize(fmt)
        take(n + 1, at)
        return Ext(), at + n + 1
    if b == 0xCA:
        return float(unpack(">f")), pos + 5
    if b == 0xCB:
        return Float64(unpack(">d")), pos + 9
    ints = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
    if b in ints:
        return unpack(ints[b]), pos + 1 + struct.calcsize(ints[b])
    if b in (0xD4, 0xD5, 0xD6, 0xD7, 0xD8):
        take({0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}[b], pos + 1)
        return Ext(), pos + 1 + {0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}[b]
    if b in (0xD9, 0xDA, 0xDB):
        fmt = {0xD9: ">B", 0xDA: ">H", 0xDB: ">I"}[b]
        return text(unpack(fmt), pos + 1 + struct.calcsize(fmt))
    if b in (0xDC, 0xDD, 0xDE, 0xDF):
        fmt = ">H" if b in (0xDC, 0xDE) else ">I"
        return container(unpack(fmt), pos + 1 + struct.calcsize(fmt), b >= 0xDE)
    raise Invalid(f"byte {b:#x}")


# -- msgpack building blocks ------------------------------------------------------------------------


def mp_str(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return (bytes([0xA0 | len(raw)]) if len(raw) < 32 else b"\xd9" + bytes([len(raw)])) + raw


def mp_map_header(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)


def wire_items(payload: bytes = PAYLOAD) -> list[tuple[str, bytes]]:
    """The top-level (key, raw value bytes) pairs of a canonical payload, in order."""
    items = []
    pos = 1
    n = payload[0] & 0x0F
    for _ in range(n):
        klen = payload[pos] & 0x1F
        key = payload[pos + 1 : pos + 1 + klen].decode()
        pos += 1 + klen
        end = ref_skip(payload, pos)
        items.append((key, payload[pos:end]))
        pos = end
    return items


def build(items: list[tuple[str, bytes]]) -> bytes:
    return mp_map_header(len(items)) + b"".join(mp_str(k) + v for k, v in items)


def replaced(key: str, raw: bytes) -> bytes:
    return build([(k, raw if k == key else v) for k, v in wire_items()])


def nested(depth: int, leaf: bytes = b"\xc0", header: bytes = b"\x91") -> bytes:
    return header * depth + leaf


ITEMS = wire_items()
assert build(ITEMS) == PAYLOAD


HOSTILE_PAYLOADS: list[tuple[str, bytes, str]] = [
    # duplicate keys: msgspec alone would take the last value
    ("duplicate seq", build([*ITEMS, ("seq", b"\x05")]), "msgpack"),
    ("duplicate kind first", build([("kind", mp_str("eval")), *ITEMS]), "msgpack"),
    ("duplicate in sample", replaced("samples", b"\x91" + mp_map_header(8) + b"".join(
        mp_str(k) + v for k, v in [("response_tokens", b"\xc4\x00"), ("logprobs", b"\xc4\x00"), ("mask", b"\xc4\x00"),
                                   ("finish_reason", mp_str("stop")), ("reward", b"\xcb" + bytes(8)),
                                   ("turns", b"\x01"), ("tool_calls", b"\x00"),
                                   ("reward", b"\xcb" + struct.pack(">d", 5.0))])), "msgpack"),
    ("field left to its default", build([(k, v) for k, v in ITEMS if k != "plane"]), "msgpack"),
    ("reordered keys", build(ITEMS[1:] + ITEMS[:1]), "msgpack"),
    # non-canonical but well-typed encodings
    ("int for a float", replaced("started_at", b"\xce" + struct.pack(">I", int(NOW))), "msgpack"),
    ("float32", replaced("finished_at", b"\xca" + struct.pack(">f", NOW)), "msgpack"),
    ("non-minimal int", replaced("seq", b"\xd3" + struct.pack(">q", 3)), "msgpack"),
    ("str8 for a short str", replaced("kind", b"\xd9\x05train"), "msgpack"),
    ("map16 header", b"\xde" + struct.pack(">H", len(ITEMS)) + PAYLOAD[1:], "msgpack"),
    # nesting
    ("deep array for a str", replaced("kind", nested(1_000_000)), "type"),
    ("deep map for a str", replaced("kind", nested(1_000_000, header=b"\x81\xa1k")), "type"),
    ("deep unknown field", build([*ITEMS, ("z", nested(1_000_000))]), "type"),
    ("deep unknown field first", build([("z", nested(1_000_000)), *ITEMS]), "type"),
    ("a version field", build([("schema_version", b"\x03"), *ITEMS]), "type"),
    ("deep top level", nested(1_000_000), "type"),
    ("deep samples", replaced("samples", nested(100_000)), "type"),
    # huge declared lengths
    ("array32 of 4G items", replaced("samples", b"\xdd\xff\xff\xff\xff"), "type"),  # the next bytes are no sample
    ("map32 of 4G pairs", b"\xdf\xff\xff\xff\xff" + PAYLOAD[1:], "msgpack"),
    ("bin32 of 4 GiB", replaced("prompt_tokens", b"\xc6\xff\xff\xff\xff"), "msgpack"),
    ("str32 of 4 GiB", replaced("kind", b"\xdb\xff\xff\xff\xff"), "msgpack"),
    ("ext32 of 4 GiB", replaced("kind", b"\xc9\xff\xff\xff\xff\x01"), "msgpack"),
    # wrong types
    ("nil for samples", replaced("samples", b"\xc0"), "type"),
    ("bool for seq", replaced("seq", b"\xc3"), "type"),
    ("ext for a str", replaced("kind", b"\xd4\x01\x00"), "type"),
    ("uint64 over int64", replaced("seq", b"\xcf" + struct.pack(">Q", 2**63)), "type"),
    ("invalid utf-8", replaced("kind", b"\xa2\xff\xfe"), "msgpack"),
    ("lone surrogate", replaced("kind", b"\xa3\xed\xb3\xbf"), "msgpack"),
    ("non-str key", mp_map_header(1) + b"\x01\x02", "type"),
    ("array top level", b"\x93\x01\x02\x03", "type"),
    ("missing field", build(ITEMS[:-1]), "type"),
    ("unknown field", build([*ITEMS, ("surprise", b"\x01")]), "type"),
    ("odd token bytes", replaced("prompt_tokens", b"\xc4\x05" + bytes(5)), "schema"),
    # trailing and truncated
    ("trailing byte", PAYLOAD + b"\x00", "msgpack"),
    ("trailing record", PAYLOAD + PAYLOAD, "msgpack"),
    ("truncated", PAYLOAD[:-1], "msgpack"),
    ("reserved byte", b"\xc1", "msgpack"),
    ("empty payload", b"\x00", "type"),
]


@pytest.mark.parametrize("payload, reason", [h[1:] for h in HOSTILE_PAYLOADS], ids=[h[0] for h in HOSTILE_PAYLOADS])
def test_hostile_payloads_are_refused(payload: bytes, reason: str) -> None:
    assert reason_of(frame_payload(payload)) == reason


def test_no_recursion_error_however_high_the_recursion_limit() -> None:
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(50_000)
    try:
        for payload in (build([*ITEMS, ("z", nested(40_000))]), replaced("kind", nested(40_000))):
            assert reason_of(frame_payload(payload)) == "type"
    finally:
        sys.setrecursionlimit(old)


def zstd(payload: bytes, **kw: Any) -> bytes:
    return MAGIC + bytes([FORMAT]) + zstandard.ZstdCompressor(**kw).compress(payload)


def with_dict_id() -> bytes:
    samples = [encode_payload(make_group(1 + i % 5, seq=i, prompt_index=7 * i, run=f"r{i % 13}")) for i in range(300)]
    d = zstandard.train_dictionary(4096, samples)
    return zstd(PAYLOAD, dict_data=d, write_checksum=True)


def skippable(payload: bytes) -> bytes:
    return MAGIC + bytes([FORMAT]) + struct.pack("<II", 0x184D2A50, 4) + b"junk" + frame_payload(payload)[len(MAGIC) + 1 :]


def flip_checksum(record: bytes) -> bytes:
    return record[:-1] + bytes([record[-1] ^ 0xFF])


def big_window() -> bytes:
    params = zstandard.ZstdCompressionParameters(window_log=28, compression_level=1, write_checksum=1)
    cobj = zstandard.ZstdCompressor(compression_params=params).compressobj()  # streaming: no content size
    return MAGIC + bytes([FORMAT]) + cobj.compress(PAYLOAD) + cobj.flush()


def bomb(size: int, declared: int | None) -> bytes:
    cobj = zstandard.ZstdCompressor(level=1, write_checksum=True).compressobj(size=size)
    out = [cobj.compress(bytes(1 << 20)) for _ in range(size >> 20)] + [cobj.flush()]
    record = MAGIC + bytes([FORMAT]) + b"".join(out)
    if declared is not None:  # rewrite the 4-byte content-size field of the frame header
        base = len(MAGIC) + 1
        fhd = record[base + 4]
        assert fhd >> 6 == 2 and not fhd & 0x20 and fhd & 3 == 0
        at = base + 6
        record = record[:at] + declared.to_bytes(4, "little") + record[at + 4 :]
    return record


HOSTILE_FRAMES: list[tuple[str, Callable[[], bytes], str]] = [
    ("no checksum", lambda: zstd(PAYLOAD, write_checksum=False), "decompress"),
    ("no content size", lambda: zstd(PAYLOAD, write_content_size=False, write_checksum=True), "decompress"),
    ("dictionary", with_dict_id, "decompress"),
    ("skippable frame first", lambda: skippable(PAYLOAD), "decompress"),
    ("two frames", lambda: VALID + VALID[len(MAGIC) + 1 :], "decompress"),
    ("bad checksum", lambda: flip_checksum(VALID), "decompress"),
    ("window too large", big_window, "decompress"),
    ("trailing junk", lambda: VALID + b"\x00", "decompress"),
    ("truncated frame", lambda: VALID[:-3], "decompress"),
    ("bomb, honest size", lambda: bomb(64 << 20, None), "too_large"),
    ("bomb, lying size", lambda: bomb(64 << 20, 4096), "decompress"),
    ("empty frame", lambda: zstd(b"", write_checksum=True), "decompress"),
    ("not a frame", lambda: MAGIC + bytes([FORMAT]) + b"\x00" * 32, "decompress"),
]


@pytest.mark.parametrize("make, reason", [h[1:] for h in HOSTILE_FRAMES], ids=[h[0] for h in HOSTILE_FRAMES])
def test_hostile_frames_are_refused(make: Callable[[], bytes], reason: str) -> None:
    data = make()
    assert reason_of(data, max_bytes=1 << 20) == reason


def test_bombs_never_inflate() -> None:
    for record in (bomb(256 << 20, None), bomb(256 << 20, 1000)):
        tracemalloc.start()
        try:
            with pytest.raises(RecordError):
                decode_group(record, max_bytes=1 << 20)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20


# -- property tests against a reference decoder -------------------------------------------------------


GROUP_KEYS = ["kind", "run", "task_id", "prompt_index", "prompt_tokens", "samples", "weight_version",
              "state_digest", "sampling", "plane", "worker_id", "seq", "started_at", "finished_at"]
SAMPLE_KEYS = ["response_tokens", "logprobs", "mask", "finish_reason", "reward", "turns", "tool_calls"]
SAMPLING_KEYS = ["temperature", "top_p", "max_tokens", "stop"]


def plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return float(value) if isinstance(value, Float64) else value


def ref_decode(payload: bytes) -> RolloutGroup:
    """The reference: strict msgpack, exactly the schema's keys in order with exact types, in its
    canonical encoding (msgspec's), every array the right size. Invalid otherwise."""
    value, end = ref_parse(payload, 0, 0)
    if end != len(payload):
        raise Invalid("trailing")

    def struct_of(v: Any, keys: list[str]) -> dict[str, Any]:
        if not isinstance(v, dict) or list(v) != keys:
            raise Invalid("keys")
        return v

    def int64(v: Any) -> int:
        if type(v) is not int or not -(2**63) <= v < 2**63:
            raise Invalid("int")
        return v

    def f64(v: Any) -> float:
        if type(v) is not Float64:
            raise Invalid("float")
        return float(v)

    def string(v: Any) -> str:
        if type(v) is not str:
            raise Invalid("str")
        return v

    def array(v: Any, dtype: str) -> np.ndarray:
        if type(v) is not bytes or len(v) % np.dtype(dtype).itemsize:
            raise Invalid("bin")
        return np.frombuffer(v, dtype=dtype)

    g = struct_of(value, GROUP_KEYS)
    if type(g["samples"]) is not list or type(g["sampling"]) is not dict:
        raise Invalid("containers")
    samples = []
    for raw in g["samples"]:
        s = struct_of(raw, SAMPLE_KEYS)
        samples.append(Sample(
            response_tokens=array(s["response_tokens"], "<i4"), logprobs=array(s["logprobs"], "<f4"),
            mask=array(s["mask"], "u1"), finish_reason=string(s["finish_reason"]), reward=f64(s["reward"]),
            turns=int64(s["turns"]), tool_calls=int64(s["tool_calls"]),
        ))
    if len(samples) > MAX_SAMPLES:
        raise Invalid("samples")
    sp = struct_of(g["sampling"], SAMPLING_KEYS)
    if type(sp["stop"]) is not list or len(sp["stop"]) > MAX_STOP_SEQUENCES:
        raise Invalid("stop")
    group = RolloutGroup(
        kind=string(g["kind"]), run=string(g["run"]),
        task_id=string(g["task_id"]), prompt_index=int64(g["prompt_index"]),
        prompt_tokens=array(g["prompt_tokens"], "<i4"), samples=samples,
        weight_version=int64(g["weight_version"]), state_digest=string(g["state_digest"]),
        sampling=SamplingParams(
            temperature=f64(sp["temperature"]), top_p=f64(sp["top_p"]), max_tokens=int64(sp["max_tokens"]),
            stop=tuple(string(x) for x in sp["stop"]),
        ),
        plane=string(g["plane"]), worker_id=string(g["worker_id"]), seq=int64(g["seq"]),
        started_at=f64(g["started_at"]), finished_at=f64(g["finished_at"]),
    )
    if msgspec.msgpack.encode(plain(value)) != payload:  # canonical: minimal headers and ints
        raise Invalid("not canonical")
    return group


def test_reference_agrees_on_the_corpus() -> None:
    assert ref_decode(PAYLOAD) == GROUP
    for label, payload, _ in HOSTILE_PAYLOADS:
        with pytest.raises((Invalid, TypeError, ValueError)):
            if "deep" in label:
                raise Invalid("deep: the reference stops at depth 16")
            ref_decode(payload)


@st.composite
def mutated(draw: st.DrawFn, base: bytes) -> bytes:
    """`base` after 1-4 random edits: bit flips, byte writes, truncations, insertions, deletions,
    and splices of a slice of another valid payload (or of the base itself) anywhere."""
    data = bytearray(base)
    donors = [PAYLOAD, *OTHER_PAYLOADS]
    for op in draw(st.lists(st.sampled_from(["flip", "put", "cut", "insert", "delete", "splice", "overwrite"]),
                            min_size=1, max_size=4)):
        i = draw(st.integers(0, len(data)))
        if op == "flip" and i < len(data):
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "put" and i < len(data):
            data[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[i : i + draw(st.integers(1, 8))]
        elif op in ("splice", "overwrite"):
            donor = draw(st.sampled_from(donors))
            a = draw(st.integers(0, len(donor)))
            piece = donor[a : a + draw(st.integers(1, 64))]
            if op == "splice":
                data[i:i] = piece
            else:
                data[i : i + len(piece)] = piece
    return bytes(data)


def check_against_reference(payload: bytes) -> None:
    try:
        expected: RolloutGroup | None = ref_decode(payload)
    except (Invalid, TypeError, ValueError):
        expected = None
    try:
        got: RolloutGroup | None = decode_group(frame_payload(payload))
    except RecordError as e:
        assert type(e) is RecordError and e.reason in DECODE_REASONS
        got = None
    assert got == expected, "decode_group and the reference disagree"
    try:
        load_record(frame_payload(payload), LIMITS, now=NOW)
    except RecordRejected as e:
        assert e.reason in REJECT_REASONS


@PROPERTY
@given(mutated(PAYLOAD))
def test_mutated_payloads_match_the_reference(payload: bytes) -> None:
    check_against_reference(payload)


@PROPERTY
@given(mutated(OTHER_PAYLOADS[1]))
def test_mutated_larger_payloads_match_the_reference(payload: bytes) -> None:
    check_against_reference(payload)


def make_tool_group() -> RolloutGroup:
    """A tool episode group: model, tool and model tokens in each sample."""
    samples = [episode(response_tokens=[5 + i, 6, 7, 8, 9], reward=float(i)) for i in range(3)]
    return make_group(samples=samples)


TOOL_PAYLOAD = encode_payload(make_tool_group())


def test_reference_reads_episodes() -> None:
    assert ref_decode(TOOL_PAYLOAD) == make_tool_group() == decode_group(frame_payload(TOOL_PAYLOAD))
    load_record(frame_payload(TOOL_PAYLOAD), LIMITS, now=NOW)


@PROPERTY
@given(mutated(TOOL_PAYLOAD))
def test_mutated_episode_payloads_match_the_reference(payload: bytes) -> None:
    check_against_reference(payload)


@PROPERTY
@given(mutated(VALID))
def test_mutated_records_raise_only_record_errors(data: bytes) -> None:
    group = outcome(data)
    if group is not None:
        # The frame checksum covers the payload: whatever decodes is the original record (a
        # flip in an unused header bit) or a record whose payload is itself valid.
        assert group == GROUP or ref_decode(zstandard.ZstdDecompressor().decompress(data[len(MAGIC) + 1 :])) == group


@PROPERTY
@given(st.binary(max_size=64), st.integers(0, len(PAYLOAD)))
def test_garbage_inside_a_valid_payload(junk: bytes, at: int) -> None:
    check_against_reference(PAYLOAD[:at] + junk + PAYLOAD[at:])
