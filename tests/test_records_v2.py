"""Record schema v2 (multi-turn tool episodes): layout, canonical decoding and validation."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import msgspec
import numpy as np
import pytest

from slime_stoa.protocol.records import (
    SCHEMA_V1,
    SCHEMA_V2,
    V1_SAMPLE_FIELDS,
    RecordError,
    RolloutGroup,
    Sample,
    SamplingParams,
    decode_group,
    encode_group,
    encode_payload,
    frame_payload,
)
from slime_stoa.protocol.validate import VALIDATION_REASONS, RecordLimits, RecordRejected, load_record, validate_group
from tests.test_records import NOW, reframe, rejection_reason
from tests.test_records import make_group as v1_group

SAMPLING = SamplingParams(temperature=0.7, top_p=1.0, max_tokens=16, stop=("</answer>",))
LIMITS = RecordLimits(vocab_size=1000, max_samples=8, max_prompt_tokens=64, max_response_tokens=32,
                      max_turns=3, max_tool_tokens=4)


def episode(**kw: Any) -> Sample:
    """model (2) | tool (2) | model (1): two turns, one tool call."""
    fields: dict[str, Any] = dict(
        response_tokens=[5, 6, 7, 8, 9], logprobs=[-0.1, -2.5, 0.0, 0.0, -0.3], finish_reason="stop", reward=1.0,
        mask=[1, 1, 0, 0, 1], turns=2, tool_calls=1,
    )
    return Sample(**{**fields, **kw})


def make_group(samples: list[Sample] | None = None, **kw: Any) -> RolloutGroup:
    """`test_records.make_group` as a v2 search group of two episodes."""
    fields: dict[str, Any] = dict(
        schema_version=SCHEMA_V2, task_id="search", prompt_index=3, prompt_tokens=[1, 2, 3],
        samples=samples or [episode(), episode(reward=0.0)], sampling=SAMPLING,
    )
    return v1_group(**{**fields, **kw})


def reason(group: RolloutGroup) -> str:
    return rejection_reason(group, LIMITS)


# -- layout ----------------------------------------------------------------------------------------


def test_v2_round_trips_exactly() -> None:
    group = make_group()
    back = decode_group(encode_group(group))
    assert back == group and back.schema_version == SCHEMA_V2
    s = back.samples[0]
    assert s.mask.dtype == np.uint8 and s.mask.tolist() == [1, 1, 0, 0, 1] and not s.mask.flags.writeable
    assert (s.turns, s.tool_calls) == (2, 1)
    assert load_record(encode_group(group), LIMITS, now=NOW) == group


def test_v2_wire_has_the_mask_fields_and_v1_does_not() -> None:
    v2 = msgspec.msgpack.decode(encode_payload(make_group()))
    assert list(v2["samples"][0]) == [*V1_SAMPLE_FIELDS, "mask", "turns", "tool_calls"]
    assert v2["samples"][0]["mask"] == bytes([1, 1, 0, 0, 1])
    single = Sample(response_tokens=[5, 6], logprobs=[-0.1, -0.2], finish_reason="stop", reward=1.0)
    v1 = msgspec.msgpack.decode(encode_payload(make_group([single], schema_version=SCHEMA_V1)))
    assert list(v1["samples"][0]) == list(V1_SAMPLE_FIELDS)


def test_v1_bytes_are_those_schema_v1_always_wrote() -> None:
    """A single-turn group encodes to the very bytes the encoder wrote before v2 existed."""
    samples = [Sample(response_tokens=[5, 6, 7], logprobs=[-0.1, -2.5, -0.0], finish_reason="stop", reward=float(i))
               for i in range(2)]
    group = make_group(samples, schema_version=SCHEMA_V1, task_id="gsm8k", prompt_index=12, prompt_tokens=[1, 2, 3, 999],
                       sampling=SamplingParams(temperature=0.7, top_p=1.0, max_tokens=16, stop=("</s>",)))
    digest = hashlib.sha256(encode_group(group)).hexdigest()
    assert digest == "8f44e332edf7f36853a8a3ed23ab709ed75641a7101e2509ccaa9dd88daf3ff9"


def test_v1_records_read_with_an_all_ones_mask() -> None:
    single = Sample(response_tokens=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3], finish_reason="stop", reward=1.0)
    back = decode_group(encode_group(make_group([single], schema_version=SCHEMA_V1)))
    s = back.samples[0]
    assert s.mask.tolist() == [1, 1, 1] and (s.turns, s.tool_calls) == (1, 0) and s.single_turn
    validate_group(back, LIMITS, now=NOW)


def test_v1_cannot_carry_tool_tokens() -> None:
    with pytest.raises(ValueError, match="schema v1"):
        encode_group(make_group(schema_version=SCHEMA_V1))
    with pytest.raises(RecordRejected, match="mask_value"):
        validate_group(make_group(schema_version=SCHEMA_V1), LIMITS, now=NOW)


def test_a_v2_group_without_tool_calls_is_valid() -> None:
    single = Sample(response_tokens=[5, 6], logprobs=[-0.1, -0.2], finish_reason="stop", reward=1.0)
    group = make_group([single])
    assert load_record(encode_group(group), LIMITS, now=NOW) == group


def wire(**sample_fields: Any) -> dict[str, Any]:
    d = msgspec.msgpack.decode(encode_payload(make_group()))
    d["samples"][0].update(sample_fields)
    return d


@pytest.mark.parametrize(
    "d, want",
    [
        (wire(mask=[1, 1, 0, 0, 1]), "type"),  # an array, not bin
        (wire(turns=2.0), "type"),
        (wire(tool_calls=None), "type"),
        ({**wire(), "schema_version": 1}, "type"),  # v2 fields under a v1 version
        ({**wire(), "schema_version": 3}, "schema_version"),
    ],
)
def test_v2_decoder_refuses_wrong_wire_types(d: dict[str, Any], want: str) -> None:
    with pytest.raises(RecordError) as info:
        decode_group(reframe(d))
    assert info.value.reason == want


def test_v2_under_a_v1_map_and_missing_fields_are_refused() -> None:
    d = wire()
    del d["samples"][0]["mask"]
    with pytest.raises(RecordError, match="type"):
        decode_group(reframe(d))
    v1 = msgspec.msgpack.decode(encode_payload(make_group([episode(mask=[1] * 5, turns=1, tool_calls=0,
                                                                   logprobs=[-0.1] * 5)], schema_version=SCHEMA_V1)))
    with pytest.raises(RecordError, match="type"):
        decode_group(reframe({**v1, "schema_version": SCHEMA_V2}))  # v1 samples under v2


def test_v2_non_canonical_mask_is_refused() -> None:
    payload = encode_payload(make_group())
    key = b"\xa4mask\xc4\x05"
    assert payload.count(key) == 2
    bin16 = payload.replace(key, b"\xa4mask\xc5\x00\x05", 1)  # bin16 header for a 5-byte mask
    with pytest.raises(RecordError, match="msgpack"):
        decode_group(frame_payload(bin16))


# -- validation (hostile v2 corpus) -----------------------------------------------------------------

HOSTILE: list[tuple[str, RolloutGroup, str]] = [
    ("mask shorter", make_group([episode(mask=[1, 1, 0, 0])]), "mask_length"),
    ("mask longer", make_group([episode(mask=[1, 1, 0, 0, 1, 1])]), "mask_length"),
    ("mask value 2", make_group([episode(mask=[1, 2, 0, 0, 1])]), "mask_value"),
    ("mask value 255", make_group([episode(mask=[1, 1, 0, 255, 1])]), "mask_value"),
    ("tool first", make_group([episode(mask=[0, 1, 0, 0, 1], logprobs=[0.0, -2.5, 0.0, 0.0, -0.3], turns=2,
                                       tool_calls=2)]), "mask_value"),
    ("turns off by one", make_group([episode(turns=3)]), "turns"),
    ("tool calls hidden", make_group([episode(tool_calls=0)]), "turns"),
    ("too many turns", make_group([episode(response_tokens=[5] * 7, mask=[1, 0, 1, 0, 1, 0, 1],
                                           logprobs=[-0.1, 0, -0.1, 0, -0.1, 0, -0.1], turns=4, tool_calls=3)]),
     "turns"),
    ("tool span over the limit", make_group([episode(response_tokens=[5] * 7, mask=[1, 0, 0, 0, 0, 0, 1],
                                                     logprobs=[-0.1, 0, 0, 0, 0, 0, -0.1])]), "tool_span"),
    ("logprob at a tool token", make_group([episode(logprobs=[-0.1, -2.5, -0.7, 0.0, -0.3])]), "logprob_tool"),
    ("-0.0 at a tool token", make_group([episode(logprobs=[-0.1, -2.5, -0.0, 0.0, -0.3])]), "logprob_tool"),
    ("turns ending on a tool", make_group([episode(response_tokens=[5, 6, 7], mask=[1, 0, 0], logprobs=[-0.1, 0, 0],
                                                   turns=1, tool_calls=1, finish_reason="turns")]), "finish_mismatch"),
    ("turns finish in v1", make_group([Sample(response_tokens=[5], logprobs=[-0.1], finish_reason="turns", reward=0.0)],
                                      schema_version=SCHEMA_V1), "bad_finish_reason"),
    ("length below the budget", make_group([episode(finish_reason="length")]), "finish_mismatch"),
    ("episode over the budget", make_group([episode(response_tokens=[5] * 17, mask=[1] * 17, logprobs=[-0.1] * 17,
                                                    turns=1, tool_calls=0)]), "response_length"),
]


@pytest.mark.parametrize("group, want", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_v2_groups_are_rejected(group: RolloutGroup, want: str) -> None:
    assert want in VALIDATION_REASONS
    assert reason(group) == want


def test_v2_finish_reasons() -> None:
    ends_in_call = episode(response_tokens=[5, 6, 7, 8], mask=[1, 0, 0, 1], logprobs=[-0.1, 0, 0, -0.2],
                           finish_reason="turns")
    validate_group(make_group([ends_in_call]), LIMITS, now=NOW)
    # "length": the budget (sampling.max_tokens) counts tool tokens too, and may end in a tool span
    full = episode(response_tokens=[5] * 16, mask=[1] * 12 + [0] * 4, logprobs=[-0.1] * 12 + [0.0] * 4, turns=1,
                   finish_reason="length")
    validate_group(make_group([full]), LIMITS, now=NOW)


def test_limits_for_turns_and_tool_tokens_are_checked() -> None:
    for bad in (dict(max_turns=0), dict(max_tool_tokens=0)):
        with pytest.raises(ValueError):
            RecordLimits(vocab_size=10, **bad)  # type: ignore[arg-type]
    wide = dataclasses.replace(LIMITS, max_tool_tokens=5, max_turns=4)
    long_span = episode(response_tokens=[5] * 7, mask=[1, 0, 0, 0, 0, 0, 1], logprobs=[-0.1, 0, 0, 0, 0, 0, -0.1])
    validate_group(make_group([long_span]), wide, now=NOW)
