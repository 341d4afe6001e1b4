"""Rollout-group records: exact round trips, hostile bytes, tool episodes, and validation reasons."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
from slime_stoa.protocol.validate import (
    REJECT_REASONS,
    VALIDATION_REASONS,
    RecordLimits,
    RecordRejected,
    load_record,
    validate_group,
)

NOW = 1_700_000_000.0
VOCAB = 1000
LIMITS = RecordLimits(
    vocab_size=VOCAB, max_samples=8, max_prompt_tokens=64, max_response_tokens=32
)
SAMPLING = SamplingParams(temperature=0.7, top_p=1.0, max_tokens=16, stop=("</s>",))
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def f32(*bits: int) -> np.ndarray:
    return np.array(bits, dtype=np.uint32).view(np.float32)


def make_sample(**kw: Any) -> Sample:
    fields: dict[str, Any] = dict(
        response_tokens=[5, 6, 7], logprobs=[-0.1, -2.5, -0.0], finish_reason="stop", reward=1.0
    )
    return Sample(**{**fields, **kw})


def make_group(**kw: Any) -> RolloutGroup:
    fields: dict[str, Any] = dict(
        kind="train",
        run="run-1",
        task_id="gsm8k",
        prompt_index=12,
        prompt_tokens=[1, 2, 3, 999],
        samples=[make_sample(reward=float(i)) for i in range(4)],
        weight_version=7,
        state_digest="0123456789abcdef" * 4,
        sampling=SAMPLING,
        worker_id="mac-01",
        seq=3,
        started_at=NOW - 20.0,
        finished_at=NOW - 1.0,
    )
    return RolloutGroup(**{**fields, **kw})


VALID = encode_group(make_group())


def reframe(d: dict[str, Any]) -> bytes:
    return frame_payload(msgspec.msgpack.encode(d))


def wire_dict(group: RolloutGroup | None = None) -> dict[str, Any]:
    return msgspec.msgpack.decode(encode_payload(group or make_group()))


def decode_reason(data: Any, **kw: Any) -> str:
    with pytest.raises(RecordError) as info:
        decode_group(data, **kw)
    assert type(info.value) is RecordError
    assert info.value.reason in DECODE_REASONS
    return info.value.reason


def rejection_reason(group: RolloutGroup, limits: RecordLimits) -> str:
    """The reason `group` is rejected with, the same validated directly and loaded from its bytes."""
    with pytest.raises(RecordRejected) as direct:
        validate_group(group, limits, now=NOW)
    with pytest.raises(RecordRejected) as loaded:
        load_record(encode_group(group), limits, now=NOW)
    assert direct.value.reason == loaded.value.reason
    return direct.value.reason


# ---------------------------------------------------------------------------------------------
# Round trip


def test_round_trip_is_exact_to_the_bit() -> None:
    logprobs = f32(
        0x80000000,  # -0.0
        0x00000000,  # +0.0
        0x80000001,  # smallest negative subnormal
        0x807FFFFF,  # largest negative subnormal
        0xFF7FFFFF,  # -float32 max
        0xFF800000,  # -inf
        0x7FC00123,  # NaN with a payload
        0xBFC00000,  # -1.5
    )
    tokens = [0, 2**31 - 1, -1, -(2**31), 151_935, 1, 2, 3]
    group = make_group(
        run="rün ✓",
        prompt_tokens=[2**31 - 1, 0],
        samples=[make_sample(response_tokens=tokens, logprobs=logprobs, reward=-0.0)],
        sampling=SamplingParams(temperature=1e-3, top_p=0.5, max_tokens=2**40, stop=()),
        seq=2**63 - 1,
        prompt_index=-(2**63),
    )
    back = decode_group(encode_group(group))
    assert back == group
    s = back.samples[0]
    assert s.logprobs.dtype == np.float32 and s.response_tokens.dtype == np.int32
    assert s.logprobs.view(np.uint32).tolist() == logprobs.view(np.uint32).tolist()
    assert s.response_tokens.tolist() == tokens
    assert np.signbit(s.reward) and back.sampling.stop == () and back.seq == 2**63 - 1
    assert not s.logprobs.flags.writeable and not back.prompt_tokens.flags.writeable


def test_equality_is_bitwise() -> None:
    a = make_group(samples=[make_sample(logprobs=f32(0x80000000, 0, 0))])
    b = make_group(samples=[make_sample(logprobs=f32(0, 0, 0))])
    assert a != b and a == make_group(samples=[make_sample(logprobs=f32(0x80000000, 0, 0))])


i32 = st.integers(-(2**31), 2**31 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
any_float = st.floats(allow_nan=True, allow_infinity=True)
text = st.text(max_size=12)


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    n = draw(st.integers(0, 12))
    m = draw(st.sampled_from([n, draw(st.integers(0, 12))]))  # usually matching lengths
    return Sample(
        response_tokens=draw(st.lists(i32, min_size=n, max_size=n)),
        logprobs=f32(*draw(st.lists(st.integers(0, 2**32 - 1), min_size=m, max_size=m))),
        mask=draw(st.lists(st.integers(0, 255), min_size=n, max_size=n) | st.lists(st.integers(0, 255), max_size=12)),
        finish_reason=draw(st.sampled_from(["stop", "length", "turns", ""]) | text),
        reward=draw(any_float),
        turns=draw(i64),
        tool_calls=draw(i64),
    )


@st.composite
def groups(draw: st.DrawFn) -> RolloutGroup:
    return RolloutGroup(
        kind=draw(text),
        run=draw(text),
        task_id=draw(text),
        prompt_index=draw(i64),
        prompt_tokens=draw(st.lists(i32, max_size=16)),
        samples=draw(st.lists(samples(), max_size=5)),
        weight_version=draw(i64),
        state_digest=draw(text),
        sampling=SamplingParams(
            temperature=draw(any_float),
            top_p=draw(any_float),
            max_tokens=draw(i64),
            stop=tuple(draw(st.lists(text, max_size=3))),
        ),
        worker_id=draw(text),
        seq=draw(i64),
        started_at=draw(any_float),
        finished_at=draw(any_float),
        plane=draw(st.sampled_from(["bf16", "int8", "int4"])),
    )


@FAST
@given(groups())
def test_round_trip_property(group: RolloutGroup) -> None:
    data = encode_group(group)
    assert decode_group(data) == group
    assert decode_group(bytearray(data)) == group and decode_group(memoryview(data)) == group


def test_encoding_is_deterministic_and_framed() -> None:
    assert encode_group(make_group()) == VALID
    assert VALID[: len(MAGIC)] == MAGIC and VALID[len(MAGIC)] == FORMAT
    frame = zstandard.get_frame_parameters(VALID[len(MAGIC) + 1 :])
    assert frame.has_checksum and frame.content_size == len(encode_payload(make_group()))


def test_encoding_is_compact() -> None:
    rng = np.random.default_rng(0)
    n, g = 512, 8
    group = make_group(
        samples=[
            make_sample(
                response_tokens=rng.integers(0, 151_936, n),
                logprobs=-rng.exponential(1.0, n).astype(np.float32),
            )
            for _ in range(g)
        ],
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=n),
    )
    assert len(encode_group(group)) < 9 * n * g  # at most the raw int32 + float32 + uint8 bytes


def test_the_encoder_refuses_a_record_no_reader_would_take() -> None:
    """A record over the size limit would be refused as "too_large": the encoder never writes it."""
    assert encode_group(make_group(), max_bytes=len(PAYLOAD)) == VALID
    with pytest.raises(ValueError, match="over the record limit"):
        encode_group(make_group(), max_bytes=len(PAYLOAD) - 1)
    with pytest.raises(ValueError, match="over the record limit"):
        encode_group(make_group(), max_bytes=len(VALID) - 1)  # compresses, but not enough


def test_the_layout_is_pinned() -> None:
    """The payload of a fixed group: a layout change must bump FORMAT (and this digest)."""
    assert FORMAT == 2
    assert hashlib.sha256(PAYLOAD).hexdigest() == "fa91d9ff49e1d24b59def165b918aff47f46ebb63d0989190d472f025381e986"


# ---------------------------------------------------------------------------------------------
# Constructors


def test_constructors_coerce_and_freeze() -> None:
    tokens = np.array([1, 2, 3], dtype=np.int64)
    logprobs = np.array([-0.1, -0.2, -0.3], dtype=np.float64)
    s = make_sample(response_tokens=tokens, logprobs=logprobs)
    tokens[0] = 99
    assert s.response_tokens.dtype == np.int32 and s.response_tokens.tolist() == [1, 2, 3]
    assert s.logprobs.dtype == np.float32 and s.logprobs[0] == np.float32(-0.1)
    with pytest.raises(ValueError):
        s.response_tokens[0] = 5
    with pytest.raises(AttributeError):  # frozen
        s.reward = 2.0  # type: ignore[misc]
    g = make_group(samples=[s], sampling=SamplingParams(temperature=1, top_p=1, max_tokens=4))
    assert isinstance(g.samples, tuple) and isinstance(g.sampling.temperature, float)
    assert make_sample(response_tokens=[], logprobs=[]).response_tokens.dtype == np.int32


@pytest.mark.parametrize(
    "build, exc",
    [
        (lambda: make_sample(response_tokens=[1.0, 2.0, 3.0]), TypeError),
        (lambda: make_sample(response_tokens=[[1, 2, 3]]), ValueError),
        (lambda: make_sample(response_tokens=[2**31, 0, 0]), ValueError),
        (lambda: make_sample(logprobs=[0, 0, 0]), TypeError),
        (lambda: make_sample(reward="1"), TypeError),
        (lambda: make_sample(finish_reason=None), TypeError),
        (lambda: make_group(seq=True), TypeError),
        (lambda: make_group(seq=2**63), ValueError),
        (lambda: make_group(kind=b"train"), TypeError),
        (lambda: make_group(samples=[{"response_tokens": []}]), TypeError),
        (lambda: make_group(sampling={"temperature": 1.0}), TypeError),
        (lambda: SamplingParams(temperature=1.0, top_p=1.0, max_tokens=4, stop="</s>"), TypeError),
    ],
)
def test_constructors_reject_wrong_types(build: Callable[[], object], exc: type) -> None:
    with pytest.raises(exc):
        build()


# ---------------------------------------------------------------------------------------------
# Decoding hostile bytes


def zstd_frame(payload: bytes, **kw: Any) -> bytes:
    return MAGIC + bytes([FORMAT]) + zstandard.ZstdCompressor(**kw).compress(payload)


def set_content_size(record: bytes, size: int) -> bytes:
    """Rewrite the zstd frame header's content-size field (4- or 8-byte fields only)."""
    base = len(MAGIC) + 1
    fhd = record[base + 4]
    fcs_bytes = {0: 0, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    assert fcs_bytes in (4, 8)
    at = base + 5 + (0 if fhd & 0x20 else 1) + {0: 0, 1: 1, 2: 2, 3: 4}[fhd & 3]
    return record[:at] + size.to_bytes(fcs_bytes, "little") + record[at + fcs_bytes :]


def zero_bomb(size: int, declare: bool) -> bytes:
    """A record whose frame inflates to `size` zero bytes, built without holding them."""
    cobj = zstandard.ZstdCompressor(level=1).compressobj(size=size if declare else -1)
    chunk = bytes(1 << 20)
    out = [cobj.compress(chunk) for _ in range(size >> 20)]
    return MAGIC + bytes([FORMAT]) + b"".join(out) + cobj.flush()


PAYLOAD = encode_payload(make_group())


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "bad_magic"),
        (b"hello, world", "bad_magic"),
        (PAYLOAD, "bad_magic"),
        (MAGIC, "bad_magic"),
        ("not bytes", "not_bytes"),
        (None, "not_bytes"),
        (MAGIC + bytes([FORMAT + 1]) + VALID[len(MAGIC) + 1 :], "bad_format"),
        (MAGIC + bytes([FORMAT]), "decompress"),
        (MAGIC + bytes([FORMAT]) + b"garbage garbage", "decompress"),
        (VALID[:-1], "decompress"),
        (VALID + b"\x00", "decompress"),
        (VALID + VALID[len(MAGIC) + 1 :], "decompress"),
        (zstd_frame(PAYLOAD, write_content_size=False), "decompress"),
        (zstd_frame(b""), "decompress"),
        (frame_payload(b"\xc1"), "msgpack"),
        (frame_payload(PAYLOAD + b"\x00"), "msgpack"),
        (frame_payload(PAYLOAD[:-5]), "msgpack"),
        (frame_payload(msgspec.msgpack.encode([1, 2, 3])), "type"),
    ],
)
def test_decode_rejects_with_reason(data: Any, reason: str) -> None:
    assert decode_reason(data) == reason


def with_field(path: str, value: Any) -> dict[str, Any]:
    """The valid record's msgpack map with one field (dotted path, `samples.0.x`) replaced."""
    d = wire_dict()
    *parents, last = path.split(".")
    node: Any = d
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return d


DELETE = object()


@pytest.mark.parametrize(
    "path, value, reason",
    [
        ("prompt_index", "12", "type"),
        ("prompt_index", 1.0, "type"),
        ("seq", True, "type"),
        ("seq", 2**64 - 1, "type"),
        ("kind", 5, "type"),
        ("samples", {}, "type"),
        ("samples", [1, 2], "type"),
        ("samples.0.logprobs", [-0.1, -2.5, 0.0], "type"),
        ("samples.0.response_tokens", "abc", "type"),
        ("samples.0.reward", None, "type"),
        ("samples.0.reward", DELETE, "type"),
        ("samples.0.mask", DELETE, "msgpack"),  # the default (all ones) must be spelled out
        ("samples.0.turns", DELETE, "msgpack"),
        ("plane", DELETE, "msgpack"),
        ("sampling.stop", DELETE, "msgpack"),
        ("samples.0.mask", [1, 1, 1], "type"),
        ("samples.0.tool_calls", None, "type"),
        ("samples.0.turns", 1.0, "type"),
        ("sampling.stop", [1], "type"),
        ("sampling.surprise", 1, "type"),
        ("surprise", 1, "type"),
        ("finished_at", DELETE, "type"),
        ("prompt_tokens", b"\x00" * 5, "schema"),
        ("samples.0.response_tokens", b"\x00" * 3, "schema"),
        ("samples.0.logprobs", b"\x00" * 13, "schema"),
    ],
)
def test_decode_rejects_wrong_wire_types(path: str, value: Any, reason: str) -> None:
    assert decode_reason(reframe(with_field(path, value))) == reason


def test_other_layouts_are_named() -> None:
    """One schema: a field it does not know is refused, and another layout is another FORMAT."""
    assert decode_reason(reframe({**wire_dict(), "schema_version": 3})) == "type"
    assert decode_reason(reframe({**wire_dict(), "new_field": 1})) == "type"
    assert decode_reason(MAGIC + bytes([1]) + VALID[len(MAGIC) + 1 :]) == "bad_format"


def peak_alloc(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
    except RecordError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize(
    "declared, reason", [(None, "too_large"), (0, "decompress"), (1000, "decompress")]
)
def test_decompression_bomb_is_refused_without_inflating(declared: int | None, reason: str) -> None:
    cap = 1 << 20
    size = 256 << 20
    if declared == 0:
        bomb = zero_bomb(size, declare=False)  # frame without a content size
    else:
        bomb = zero_bomb(size, declare=True)
        if declared is not None:
            bomb = set_content_size(bomb, declared)  # lies about its size
    assert len(bomb) < cap
    assert decode_reason(bomb, max_bytes=cap) == reason
    assert peak_alloc(lambda: decode_group(bomb, max_bytes=cap)) < cap


def test_oversized_object_and_payload_are_too_large() -> None:
    assert decode_reason(VALID, max_bytes=len(VALID) - 1) == "too_large"
    assert decode_reason(VALID, max_bytes=len(PAYLOAD) - 1) == "too_large"
    assert decode_group(VALID, max_bytes=len(PAYLOAD)) == make_group()


EMPTY_SAMPLE = dict(response_tokens=b"", logprobs=b"", mask=b"", finish_reason="", reward=0.0, turns=1, tool_calls=0)


def flood(n: int) -> bytes:
    """A payload of `n` empty samples: the most samples (and arrays) per payload byte."""
    return msgspec.msgpack.encode({**wire_dict(), "samples": [EMPTY_SAMPLE] * n})


def test_sample_flood_is_refused_before_building_samples() -> None:
    payload = flood(50_000)
    record = frame_payload(payload)
    assert decode_reason(record) == "type"  # over the schema's MAX_SAMPLES, refused at the array header
    assert peak_alloc(lambda: decode_group(record)) < 3 * len(payload)
    with pytest.raises(RecordRejected, match="type"):
        load_record(record, LIMITS, now=NOW)


def test_samples_within_the_schema_cap_cost_bounded_memory() -> None:
    payload = flood(MAX_SAMPLES)
    record = frame_payload(payload)
    assert decode_reason(record, max_samples=8) == "group_size"
    with pytest.raises(RecordRejected, match="group_size"):
        load_record(record, LIMITS, now=NOW)
    # What decoding builds for the most samples the schema allows: a few times the payload, and
    # at most ~1 KiB a sample (their arrays are views of the decoded bytes).
    assert peak_alloc(lambda: decode_group(record, max_samples=8)) < 3 * len(payload) + MAX_SAMPLES * 1024
    assert len(decode_group(record).samples) == MAX_SAMPLES


def test_every_truncation_is_rejected() -> None:
    for n in range(len(VALID)):
        decode_reason(VALID[:n])


def outcome(data: bytes) -> RolloutGroup | None:
    """Decode and load `data`; anything but a record or the documented errors fails the test."""
    try:
        group = decode_group(data)
    except RecordError as e:
        assert type(e) is RecordError and e.reason in DECODE_REASONS
        group = None
    try:
        load_record(data, LIMITS, now=NOW)
    except RecordRejected as e:
        assert e.reason in REJECT_REASONS
    return group


def test_every_bit_flip_is_rejected_or_harmless() -> None:
    original = make_group()
    for i in range(len(VALID) * 8):
        flipped = bytearray(VALID)
        flipped[i // 8] ^= 1 << (i % 8)
        # The frame checksum covers the payload: a flip that decodes (an unused header bit, a
        # larger window) must give back the very same record.
        assert outcome(bytes(flipped)) in (None, original)


@FAST
@given(st.binary(max_size=512))
def test_random_bytes_are_rejected(data: bytes) -> None:
    decode_reason(data)
    decode_reason(MAGIC + bytes([FORMAT]) + data)


@st.composite
def mutations(draw: st.DrawFn, base: bytes) -> bytes:
    data = bytearray(base)
    for op in draw(st.lists(st.sampled_from(["flip", "cut", "junk", "put", "drop"]), min_size=1,
                            max_size=4)):
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[i:]
        elif op == "junk":
            data += draw(st.binary(min_size=1, max_size=16))
        elif op == "put" and data:
            data[i] = draw(st.integers(0, 255))
        elif op == "drop" and data:
            del data[i]
    return bytes(data)


@FAST
@given(mutations(VALID))
def test_mutated_records_are_rejected_or_valid(data: bytes) -> None:
    outcome(data)


@FAST
@given(mutations(PAYLOAD))
def test_mutated_payloads_are_rejected_or_valid(payload: bytes) -> None:
    outcome(frame_payload(payload))


@FAST
@given(st.binary(max_size=256))
def test_random_payloads_are_rejected(payload: bytes) -> None:
    assert outcome(frame_payload(payload)) is None


# ---------------------------------------------------------------------------------------------
# Validation


def test_valid_group_passes() -> None:
    group = make_group()
    validate_group(group, LIMITS, now=NOW)
    assert load_record(VALID, LIMITS, now=NOW) == group
    tolerated = make_group(samples=[make_sample(logprobs=[5e-5, 0.0, -0.0])] * 4)
    validate_group(tolerated, LIMITS, now=NOW)


def replace_sample(**kw: Any) -> RolloutGroup:
    return make_group(samples=[make_sample(), make_sample(**kw)])


HOSTILE: list[tuple[str, RolloutGroup, str]] = [
    ("unknown kind", make_group(kind="sft"), "kind"),
    ("empty run", make_group(run=""), "identifier"),
    ("control char", make_group(worker_id="mac\n01"), "identifier"),
    ("long task id", make_group(task_id="t" * 257), "identifier"),
    ("bad digest", make_group(state_digest="XYZ" * 10), "state_digest"),
    ("short digest", make_group(state_digest="abcd"), "state_digest"),
    ("negative seq", make_group(seq=-1), "counter"),
    ("negative version", make_group(weight_version=-3), "counter"),
    ("zero temperature", make_group(sampling=msgspec.structs.replace(SAMPLING, temperature=0.0)),
     "sampling"),
    ("nan top_p", make_group(sampling=msgspec.structs.replace(SAMPLING, top_p=float("nan"))),
     "sampling"),
    ("huge max_tokens", make_group(sampling=msgspec.structs.replace(SAMPLING, max_tokens=10**6)),
     "sampling"),
    ("empty stop", make_group(sampling=msgspec.structs.replace(SAMPLING, stop=("",))), "sampling"),
    ("reversed times", make_group(started_at=NOW - 1, finished_at=NOW - 2), "timestamps"),
    ("future", make_group(started_at=NOW, finished_at=NOW + 3600), "timestamps"),
    ("zero clock", make_group(started_at=0.0, finished_at=1.0), "timestamps"),
    ("nan time", make_group(finished_at=float("nan")), "timestamps"),
    ("empty prompt", make_group(prompt_tokens=[]), "prompt_length"),
    ("long prompt", make_group(prompt_tokens=[1] * 65), "prompt_length"),
    ("prompt token >= vocab", make_group(prompt_tokens=[1, VOCAB]), "token_range"),
    ("no samples", make_group(samples=[]), "group_size"),
    ("too many samples", make_group(samples=[make_sample()] * 9), "group_size"),
    ("token >= vocab", replace_sample(response_tokens=[1, VOCAB, 2]), "token_range"),
    ("negative token", replace_sample(response_tokens=[1, -1, 2]), "token_range"),
    ("empty response", replace_sample(response_tokens=[], logprobs=[]), "empty_response"),
    ("response > max_tokens", replace_sample(response_tokens=[1] * 17, logprobs=[-1.0] * 17),
     "response_length"),
    ("short logprobs", replace_sample(logprobs=[-0.1, -0.2]), "length_mismatch"),
    ("long logprobs", replace_sample(logprobs=[-0.1] * 4), "length_mismatch"),
    ("nan logprob", replace_sample(logprobs=[-0.1, float("nan"), -0.3]), "logprob_not_finite"),
    ("-inf logprob", replace_sample(logprobs=[-0.1, -float("inf"), -0.3]),
     "logprob_not_finite"),
    ("positive logprob", replace_sample(logprobs=[-0.1, 0.5, -0.3]), "logprob_positive"),
    ("just over tolerance", replace_sample(logprobs=[-0.1, 2e-4, -0.3]), "logprob_positive"),
    ("finish reason", replace_sample(finish_reason="eos"), "bad_finish_reason"),
    ("nan reward", replace_sample(reward=float("nan")), "reward_not_finite"),
    ("inf reward", replace_sample(reward=float("inf")), "reward_not_finite"),
    ("run not a layout name", make_group(run="run 1"), "identifier"),
    ("task id with a path", make_group(task_id="../gsm8k"), "identifier"),
    ("worker id upper case", make_group(worker_id="Mac-01"), "identifier"),
    ("worker id a device name", make_group(worker_id="nul"), "identifier"),
    ("version beyond a key", make_group(weight_version=10**12), "counter"),
    ("seq beyond a key", make_group(seq=10**10), "counter"),
    ("length below max_tokens", replace_sample(finish_reason="length"), "finish_mismatch"),
    ("logprob below the default floor", replace_sample(logprobs=[-0.1, -100.5, -0.3]), "logprob_too_small"),
]


@pytest.mark.parametrize("group, reason", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_groups_are_rejected(group: RolloutGroup, reason: str) -> None:
    assert reason in VALIDATION_REASONS
    assert rejection_reason(group, LIMITS) == reason


@pytest.mark.parametrize(
    "limits, reason",
    [
        (dataclasses.replace(LIMITS, expected_group_size=2), "group_size"),
        (dataclasses.replace(LIMITS, expected_run="other-run"), "run"),
        (dataclasses.replace(LIMITS, allowed_kinds=frozenset({"eval"})), "kind"),
        (dataclasses.replace(LIMITS, expected_sampling=msgspec.structs.replace(SAMPLING, top_p=0.9)),
         "sampling"),
        (dataclasses.replace(LIMITS, min_logprob=-1.0), "logprob_too_small"),
        (dataclasses.replace(LIMITS, vocab_size=999), "token_range"),
        (dataclasses.replace(LIMITS, max_record_bytes=len(VALID) - 1), "too_large"),
    ],
)
def test_optional_limits_are_enforced(limits: RecordLimits, reason: str) -> None:
    with pytest.raises(RecordRejected) as info:
        load_record(VALID, limits, now=NOW)
    assert info.value.reason == reason
    assert load_record(VALID, dataclasses.replace(LIMITS, expected_sampling=SAMPLING), now=NOW)


def test_finish_reasons_follow_the_worker() -> None:
    """"length" only at exactly max_tokens; "stop" at any length up to it."""
    at_limit = dict(response_tokens=[1] * SAMPLING.max_tokens, logprobs=[-1.0] * SAMPLING.max_tokens)
    for finish in ("length", "stop"):
        validate_group(replace_sample(finish_reason=finish, **at_limit), LIMITS, now=NOW)
    validate_group(replace_sample(finish_reason="stop", response_tokens=[1], logprobs=[-1.0]), LIMITS, now=NOW)
    with pytest.raises(RecordRejected, match="finish_mismatch"):
        validate_group(replace_sample(finish_reason="length", response_tokens=[1] * 15, logprobs=[-1.0] * 15),
                       LIMITS, now=NOW)


def test_logprob_floor_defaults_to_minus_100_and_can_be_lifted() -> None:
    assert LIMITS.min_logprob == -100.0
    low = replace_sample(logprobs=[-0.1, -99.9, -0.3])
    validate_group(low, LIMITS, now=NOW)
    lower = replace_sample(logprobs=[-0.1, -1e30, -0.3])
    validate_group(lower, dataclasses.replace(LIMITS, min_logprob=None), now=NOW)
    with pytest.raises(RecordRejected, match="logprob_too_small"):
        validate_group(lower, LIMITS, now=NOW)


def test_load_record_wraps_decode_errors() -> None:
    with pytest.raises(RecordRejected) as info:
        load_record(b"junk", LIMITS, now=NOW)
    e = info.value
    assert e.reason == "bad_magic" and isinstance(e, RecordError)
    assert type(e.__cause__) is RecordError and e.__cause__.reason == "bad_magic"


def test_reasons_survive_pickling() -> None:
    e = pickle.loads(pickle.dumps(RecordRejected("token_range", "samples[1] = 1000")))
    assert (type(e), e.reason, e.detail) == (RecordRejected, "token_range", "samples[1] = 1000")
    assert str(e) == "token_range: samples[1] = 1000"
    assert {"group_size"} == DECODE_REASONS & VALIDATION_REASONS


@pytest.mark.parametrize(
    "kw",
    [
        dict(vocab_size=0),
        dict(vocab_size=2**31 + 1),
        dict(vocab_size=10, max_samples=0),
        dict(vocab_size=10, max_samples=4, expected_group_size=5),
        dict(vocab_size=10, logprob_tolerance=-1.0),
        dict(vocab_size=10, max_record_bytes=0),
        dict(vocab_size=10, min_logprob=0.0),
        dict(vocab_size=10, min_logprob=float("-inf")),
        dict(vocab_size=10, min_logprob=float("nan")),
    ],
)
def test_limits_reject_nonsense(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RecordLimits(**kw)


# ---------------------------------------------------------------------------------------------
# Tool episodes: the mask, turns and tool calls (a single-turn sample: all ones, one turn, none)

TOOL_SAMPLING = SamplingParams(temperature=0.7, top_p=1.0, max_tokens=16, stop=("</answer>",))
TOOL_LIMITS = RecordLimits(vocab_size=1000, max_samples=8, max_prompt_tokens=64, max_response_tokens=32,
                           max_turns=3, max_tool_tokens=4)


def episode(**kw: Any) -> Sample:
    """model (2) | tool (2) | model (1): two turns, one tool call."""
    fields: dict[str, Any] = dict(
        response_tokens=[5, 6, 7, 8, 9], logprobs=[-0.1, -2.5, 0.0, 0.0, -0.3], finish_reason="stop", reward=1.0,
        mask=[1, 1, 0, 0, 1], turns=2, tool_calls=1,
    )
    return Sample(**{**fields, **kw})


def make_tool_group(samples: list[Sample] | None = None, **kw: Any) -> RolloutGroup:
    """`make_group` as a search group of two episodes."""
    fields: dict[str, Any] = dict(
        task_id="search", prompt_index=3, prompt_tokens=[1, 2, 3],
        samples=samples or [episode(), episode(reward=0.0)], sampling=TOOL_SAMPLING,
    )
    return make_group(**{**fields, **kw})


def tool_reason(group: RolloutGroup) -> str:
    return rejection_reason(group, TOOL_LIMITS)


def test_episodes_round_trip_exactly() -> None:
    group = make_tool_group()
    back = decode_group(encode_group(group))
    assert back == group
    s = back.samples[0]
    assert s.mask.dtype == np.uint8 and s.mask.tolist() == [1, 1, 0, 0, 1] and not s.mask.flags.writeable
    assert (s.turns, s.tool_calls) == (2, 1)
    assert load_record(encode_group(group), TOOL_LIMITS, now=NOW) == group


def test_every_sample_carries_its_mask_on_the_wire() -> None:
    keys = ["response_tokens", "logprobs", "mask", "finish_reason", "reward", "turns", "tool_calls"]
    tool = wire_dict(make_tool_group())["samples"][0]
    assert list(tool) == keys and tool["mask"] == bytes([1, 1, 0, 0, 1])
    single = wire_dict(make_group())["samples"][0]
    assert list(single) == keys and single["mask"] == b"\x01\x01\x01"
    assert (single["turns"], single["tool_calls"]) == (1, 0)


def test_a_single_turn_sample_is_all_ones() -> None:
    single = Sample(response_tokens=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3], finish_reason="stop", reward=1.0)
    assert single == Sample(response_tokens=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3], finish_reason="stop",
                            reward=1.0, mask=[1, 1, 1], turns=1, tool_calls=0)
    back = decode_group(encode_group(make_tool_group([single])))
    s = back.samples[0]
    assert s.mask.tolist() == [1, 1, 1] and not s.mask.flags.writeable and (s.turns, s.tool_calls) == (1, 0)
    validate_group(back, TOOL_LIMITS, now=NOW)
    # replacing the tokens keeps a mask given explicitly: its length is the validator's to check
    longer = msgspec.structs.replace(s, response_tokens=[5, 6, 7, 8], logprobs=[-0.1] * 4)
    assert tool_reason(make_tool_group([longer])) == "mask_length"


def test_a_non_canonical_mask_is_refused() -> None:
    payload = encode_payload(make_tool_group())
    key = b"\xa4mask\xc4\x05"
    assert payload.count(key) == 2
    bin16 = payload.replace(key, b"\xa4mask\xc5\x00\x05", 1)  # bin16 header for a 5-byte mask
    with pytest.raises(RecordError, match="msgpack"):
        decode_group(frame_payload(bin16))


TOOL_HOSTILE: list[tuple[str, RolloutGroup, str]] = [
    ("mask shorter", make_tool_group([episode(mask=[1, 1, 0, 0])]), "mask_length"),
    ("mask longer", make_tool_group([episode(mask=[1, 1, 0, 0, 1, 1])]), "mask_length"),
    ("mask value 2", make_tool_group([episode(mask=[1, 2, 0, 0, 1])]), "mask_value"),
    ("mask value 255", make_tool_group([episode(mask=[1, 1, 0, 255, 1])]), "mask_value"),
    ("tool first", make_tool_group([episode(mask=[0, 1, 0, 0, 1], logprobs=[0.0, -2.5, 0.0, 0.0, -0.3], turns=2,
                                            tool_calls=2)]), "mask_value"),
    ("turns off by one", make_tool_group([episode(turns=3)]), "turns"),
    ("tool calls hidden", make_tool_group([episode(tool_calls=0)]), "turns"),
    ("single turn with a tool call", make_tool_group([episode(mask=[1] * 5, logprobs=[-0.1] * 5, turns=1)]), "turns"),
    ("too many turns", make_tool_group([episode(response_tokens=[5] * 7, mask=[1, 0, 1, 0, 1, 0, 1],
                                                logprobs=[-0.1, 0, -0.1, 0, -0.1, 0, -0.1], turns=4, tool_calls=3)]),
     "turns"),
    ("tool span over the limit", make_tool_group([episode(response_tokens=[5] * 7, mask=[1, 0, 0, 0, 0, 0, 1],
                                                          logprobs=[-0.1, 0, 0, 0, 0, 0, -0.1])]), "tool_span"),
    ("logprob at a tool token", make_tool_group([episode(logprobs=[-0.1, -2.5, -0.7, 0.0, -0.3])]), "logprob_tool"),
    ("-0.0 at a tool token", make_tool_group([episode(logprobs=[-0.1, -2.5, -0.0, 0.0, -0.3])]), "logprob_tool"),
    ("turns ending on a tool", make_tool_group([episode(response_tokens=[5, 6, 7], mask=[1, 0, 0],
                                                        logprobs=[-0.1, 0, 0], turns=1, tool_calls=1,
                                                        finish_reason="turns")]), "finish_mismatch"),
    ("length below the budget", make_tool_group([episode(finish_reason="length")]), "finish_mismatch"),
    ("episode over the budget", make_tool_group([episode(response_tokens=[5] * 17, mask=[1] * 17,
                                                         logprobs=[-0.1] * 17, turns=1, tool_calls=0)]),
     "response_length"),
]


@pytest.mark.parametrize("group, want", [h[1:] for h in TOOL_HOSTILE], ids=[h[0] for h in TOOL_HOSTILE])
def test_hostile_episodes_are_rejected(group: RolloutGroup, want: str) -> None:
    assert want in VALIDATION_REASONS
    assert tool_reason(group) == want


def test_episode_finish_reasons() -> None:
    ends_in_call = episode(response_tokens=[5, 6, 7, 8], mask=[1, 0, 0, 1], logprobs=[-0.1, 0, 0, -0.2],
                           finish_reason="turns")
    validate_group(make_tool_group([ends_in_call]), TOOL_LIMITS, now=NOW)
    # "length": the budget (sampling.max_tokens) counts tool tokens too, and may end in a tool span
    full = episode(response_tokens=[5] * 16, mask=[1] * 12 + [0] * 4, logprobs=[-0.1] * 12 + [0.0] * 4, turns=1,
                   finish_reason="length")
    validate_group(make_tool_group([full]), TOOL_LIMITS, now=NOW)


def test_limits_for_turns_and_tool_tokens_are_checked() -> None:
    for bad in (dict(max_turns=0), dict(max_tool_tokens=0)):
        with pytest.raises(ValueError):
            RecordLimits(vocab_size=10, **bad)  # type: ignore[arg-type]
    wide = dataclasses.replace(TOOL_LIMITS, max_tool_tokens=5, max_turns=4)
    long_span = episode(response_tokens=[5] * 7, mask=[1, 0, 0, 0, 0, 0, 1], logprobs=[-0.1, 0, 0, 0, 0, 0, -0.1])
    validate_group(make_tool_group([long_span]), wide, now=NOW)
