"""Trainer-side limits and validation of rollout-group records.

The trainer never trusts a worker: `load_record` decodes an object and checks every value the
trainer relies on, raising `RecordRejected` with a stable `reason` code (so rejects can be counted
by reason). Validation is about the record being well-formed and within limits; recomputing the
reward and comparing logprobs with the trainer's own forward pass happen later, in the trainer.

Logprob tolerance: a sampled token's logprob is <= 0 mathematically, but a worker's float32
log-softmax can round to a tiny positive value (its error is a few ulps of the largest logit,
~1e-6 for logits around 30). `RecordLimits.logprob_tolerance` (default 1e-4) admits such values;
anything above it is rejected as "logprob_positive". The validator never modifies a record, so a
consumer that needs probabilities <= 1 should clamp with `min(logprob, 0)`. Below, a logprob
under `RecordLimits.min_logprob` (default -100) is "logprob_too_small": no sampler draws a token
that unlikely.

Finish reasons follow the worker's generation (`macd.generate`): "length" only for a response of
exactly `sampling.max_tokens` tokens ("finish_mismatch" otherwise); "stop" for one that ended on
an EOS token or a stop string, at any length up to the limit. Whether a "stop" at the limit really
ends on a stop token (and a "length" does not) needs the tokenizer: the trainer's re-scoring
checks that (`slime_stoa.judging.scoring`).

Tool episodes (see `slime_stoa.protocol.record_types`): the response is the whole episode, so
`max_response_tokens` and `sampling.max_tokens` bound model and tool tokens together (the
episode's token budget). Each sample's `mask` must have one 0/1 value per response token and
start with a model token; `turns` and `tool_calls` must be its runs of 1s and 0s; no run of tool
tokens may exceed `max_tool_tokens` and no episode `max_turns` model turns; a tool position's
logprob must be +0.0 exactly (one byte form). "turns" (the last allowed turn called a tool) ends
on a model token. A single-turn sample is the case of an all-ones mask: one turn, no tool call.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import numpy as np

from slime_stoa.protocol.layout import SEQ_DIGITS, VERSION_DIGITS, check_name, check_worker_id
from slime_stoa.protocol.records import (
    DECODE_REASONS,
    DEFAULT_MAX_RECORD_BYTES,
    FINISH_REASONS,
    KINDS,
    PLANES,
    RecordError,
    RolloutGroup,
    Sample,
    SamplingParams,
    decode_group,
)
from slime_stoa.protocol.strict_json import MAX_TIMESTAMP

# Stable reason codes of validate_group (RecordRejected.reason).
VALIDATION_REASONS = frozenset(
    {
        "kind",  # kind not in limits.allowed_kinds
        "plane",  # plane not in limits.allowed_planes (a plane the run does not offer)
        "run",  # run differs from limits.expected_run
        "identifier",  # run / task_id not a layout name, worker_id not a layout worker id (check_name)
        "state_digest",  # not a lowercase hex string of 16..128 characters
        "counter",  # prompt_index / weight_version / seq negative, or beyond what a key can hold
        "sampling",  # sampling params out of range or different from limits.expected_sampling
        "timestamps",  # non-finite, before min_timestamp, reversed, too long, or in the future
        "prompt_length",  # prompt empty or longer than max_prompt_tokens
        "group_size",  # no samples, more than max_samples, or not expected_group_size
        "token_range",  # a prompt or response token id outside [0, vocab_size)
        "empty_response",  # a sample without response tokens
        "response_length",  # a response longer than max_response_tokens or sampling.max_tokens
        "length_mismatch",  # len(logprobs) != len(response_tokens)
        "logprob_not_finite",  # a NaN or infinite logprob
        "logprob_positive",  # a logprob above logprob_tolerance
        "logprob_too_small",  # a logprob below min_logprob (default -100: a sampled token is never that unlikely)
        "bad_finish_reason",  # finish_reason not in FINISH_REASONS
        "finish_mismatch",  # "length" on a response shorter than sampling.max_tokens
        "reward_not_finite",  # NaN or infinite reward
        # tool episodes (a single-turn sample: an all-ones mask)
        "mask_length",  # len(mask) != len(response_tokens)
        "mask_value",  # a mask value other than 0/1, or a response that starts with a tool token
        "tool_span",  # a run of tool tokens longer than max_tool_tokens
        "turns",  # turns / tool_calls not the mask's runs, or more than max_turns turns
        "logprob_tool",  # a tool token's logprob is not +0.0
    }
)
# Every reason load_record can report: decoding failures keep their RecordError reason
# ("group_size" is both: load_record lets the decoder refuse too many samples early).
REJECT_REASONS = DECODE_REASONS | VALIDATION_REASONS

_HEX_DIGEST = re.compile(r"[0-9a-f]{16,128}")


class RecordRejected(RecordError):
    """A record failed decoding or validation. `reason` is a code from REJECT_REASONS."""


@dataclass(frozen=True, kw_only=True)
class RecordLimits:
    """What the trainer accepts. Only `vocab_size` has no default."""

    vocab_size: int
    """Token ids must lie in [0, vocab_size): the model's embedding rows, not the tokenizer's."""
    max_samples: int = 64
    """Most samples a group may hold."""
    expected_group_size: int | None = None
    """When set, every group must hold exactly this many samples (the run's G)."""
    max_prompt_tokens: int = 8192
    """Longest prompt, in tokens (a prompt must have at least one token)."""
    max_response_tokens: int = 8192
    """Longest response, in tokens; a response is also bounded by its sampling.max_tokens."""
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    """Cap on the stored object and on its decompressed payload (decompression-bomb guard)."""
    allowed_kinds: frozenset[str] = frozenset(KINDS)
    """Kinds accepted ("train", "eval")."""
    allowed_planes: frozenset[str] = frozenset(PLANES)
    """Weight planes a record may say it was sampled with: the trainer's logprob-gap limits allow
    more for a quantized plane, so a plane the run does not offer is refused, not believed."""
    expected_run: str | None = None
    """When set, the record's run name must equal it."""
    expected_sampling: SamplingParams | None = None
    """When set, the record's sampling params must equal it (the run manifest's)."""
    logprob_tolerance: float = 1e-4
    """Largest logprob accepted (float32 rounding slack above 0; see the module doc)."""
    min_logprob: float | None = -100.0
    """Smallest logprob accepted (None: no floor). A sampled token's logprob is that of a token the
    worker actually drew: at -100 its probability is e^-100, which no sampler ever draws, so a
    lower value is a fabricated record (and a huge importance weight in the loss)."""
    max_id_chars: int = 256
    """Longest run / task_id / worker_id string."""
    max_stop_sequences: int = 16
    """Most stop sequences in sampling.stop."""
    max_stop_chars: int = 256
    """Longest stop sequence, in characters (each must be non-empty)."""
    min_timestamp: float = 1_577_836_800.0
    """Earliest started_at accepted (2020-01-01 UTC): catches zero or garbage clocks."""
    max_clock_skew_s: float = 300.0
    """How far finished_at may lie in the trainer's future."""
    max_generation_s: float = 86_400.0
    """Longest finished_at - started_at."""
    max_turns: int = 16
    """Most model turns in one episode."""
    max_tool_tokens: int = 4096
    """Longest run of tool (observation) tokens."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "max_samples", "max_prompt_tokens", "max_response_tokens")
        for name in (*positive, "max_record_bytes", "max_id_chars", "max_stop_chars", "max_turns", "max_tool_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"RecordLimits.{name} must be >= 1")
        if self.vocab_size > 2**31:
            raise ValueError("RecordLimits.vocab_size must be <= 2**31 (tokens are int32)")
        g = self.expected_group_size
        if g is not None and not 1 <= g <= self.max_samples:
            raise ValueError("RecordLimits.expected_group_size must be in [1, max_samples]")
        if not self.logprob_tolerance >= 0:
            raise ValueError("RecordLimits.logprob_tolerance must be >= 0")
        if self.max_stop_sequences < 0:
            raise ValueError("RecordLimits.max_stop_sequences must be >= 0")
        floor = self.min_logprob
        if floor is not None and (isinstance(floor, bool) or not isinstance(floor, (int, float)) or not (math.isfinite(floor) and floor < 0)):
            raise ValueError("RecordLimits.min_logprob must be a finite number < 0, or None")


def _short(x: object, n: int = 60) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


def _check_identifier(name: str, value: str, limits: RecordLimits) -> None:
    if not value or len(value) > limits.max_id_chars or not value.isprintable():
        detail = f"{name} {_short(value)}: want 1..{limits.max_id_chars} printable characters"
        raise RecordRejected("identifier", detail)
    # The same grammar as in keys: a record's names end up in keys, counters and logs.
    try:
        if name == "worker_id":
            check_worker_id(value)
        else:
            check_name(name, value)
    except ValueError as exc:
        raise RecordRejected("identifier", str(exc)) from None


def _check_header(g: RolloutGroup, limits: RecordLimits) -> None:
    if g.kind not in limits.allowed_kinds:
        raise RecordRejected("kind", f"{_short(g.kind)} not in {sorted(limits.allowed_kinds)}")
    if g.plane not in limits.allowed_planes:
        raise RecordRejected("plane", f"{_short(g.plane)}: the run offers {sorted(limits.allowed_planes)}")
    for name in ("run", "task_id", "worker_id"):
        _check_identifier(name, getattr(g, name), limits)
    if limits.expected_run is not None and g.run != limits.expected_run:
        raise RecordRejected("run", f"{_short(g.run)}, expected {limits.expected_run!r}")
    if not _HEX_DIGEST.fullmatch(g.state_digest):
        detail = f"{_short(g.state_digest)}: want 16..128 lowercase hex digits"
        raise RecordRejected("state_digest", detail)
    for name in ("prompt_index", "weight_version", "seq"):
        if getattr(g, name) < 0:
            raise RecordRejected("counter", f"{name} is {getattr(g, name)}")
    if g.weight_version >= 10**VERSION_DIGITS or g.seq >= 10**SEQ_DIGITS:
        raise RecordRejected("counter", f"weight_version {g.weight_version} or seq {g.seq} too large for a key")


def _sampling_problem(s: SamplingParams, limits: RecordLimits) -> str | None:
    if not (math.isfinite(s.temperature) and s.temperature > 0):
        return f"temperature {s.temperature} must be finite and > 0"
    if not 0 < s.top_p <= 1:
        return f"top_p {s.top_p} must be in (0, 1]"
    if not 1 <= s.max_tokens <= limits.max_response_tokens:
        return f"max_tokens {s.max_tokens} not in [1, {limits.max_response_tokens}]"
    if len(s.stop) > limits.max_stop_sequences:
        return f"{len(s.stop)} stop sequences, limit {limits.max_stop_sequences}"
    if any(not 1 <= len(x) <= limits.max_stop_chars for x in s.stop):
        return f"a stop sequence is empty or over {limits.max_stop_chars} characters"
    if limits.expected_sampling is not None and s != limits.expected_sampling:
        return f"{_short(s, 200)} differs from the run's {_short(limits.expected_sampling, 200)}"
    return None


def _timestamps_problem(t0: float, t1: float, limits: RecordLimits, now: float) -> str | None:
    if not (math.isfinite(t0) and math.isfinite(t1)):
        return f"started_at {t0}, finished_at {t1} must be finite"
    if not (0 <= t0 <= MAX_TIMESTAMP and 0 <= t1 <= MAX_TIMESTAMP):  # bounded: every time below prints short
        return f"started_at {t0:.6g}, finished_at {t1:.6g} must be times between 1970 and the year 5138"
    if t0 < limits.min_timestamp:
        return f"started_at {t0} before {limits.min_timestamp}"
    if not 0 <= t1 - t0 <= limits.max_generation_s:
        return f"finished_at - started_at = {t1 - t0:.3f} s not in [0, {limits.max_generation_s}]"
    if t1 > now + limits.max_clock_skew_s:
        return f"finished_at {t1} is {t1 - now:.0f} s in the future"
    return None


def _check_token_range(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    bad = (tokens < 0) | (tokens >= vocab_size)
    if bad.any():
        i = int(np.argmax(bad))
        detail = f"{where}[{i}] = {int(tokens[i])} not in [0, {vocab_size})"
        raise RecordRejected("token_range", detail)


def _check_prompt(tokens: np.ndarray, limits: RecordLimits) -> None:
    if not 1 <= len(tokens) <= limits.max_prompt_tokens:
        detail = f"{len(tokens)} tokens, want 1..{limits.max_prompt_tokens}"
        raise RecordRejected("prompt_length", detail)
    _check_token_range(tokens, limits.vocab_size, "prompt_tokens")


def _check_group_size(n: int, limits: RecordLimits) -> None:
    if not 1 <= n <= limits.max_samples:
        raise RecordRejected("group_size", f"{n} samples, want 1..{limits.max_samples}")
    if limits.expected_group_size is not None and n != limits.expected_group_size:
        raise RecordRejected("group_size", f"{n} samples, expected {limits.expected_group_size}")


def _check_logprobs(lp: np.ndarray, limits: RecordLimits, where: str) -> None:
    finite = np.isfinite(lp)
    if not finite.all():
        i = int(np.argmin(finite))
        raise RecordRejected("logprob_not_finite", f"{where}[{i}] = {lp[i]}")
    tol = limits.logprob_tolerance
    if (lp > tol).any():
        i = int(np.argmax(lp))
        raise RecordRejected("logprob_positive", f"{where}[{i}] = {lp[i]} > {tol}")
    if limits.min_logprob is not None and (lp < limits.min_logprob).any():
        i = int(np.argmin(lp))
        raise RecordRejected("logprob_too_small", f"{where}[{i}] = {lp[i]} < {limits.min_logprob}")


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of equal values in a non-empty 1-D array."""
    starts = np.flatnonzero(np.concatenate(([True], mask[1:] != mask[:-1])))
    return starts, np.diff(np.append(starts, len(mask)))


def _check_mask(i: int, s: Sample, limits: RecordLimits) -> None:
    """The mask, turns, tool calls, tool spans and tool-position logprobs."""
    n, mask = len(s.response_tokens), s.mask
    if len(mask) != n:
        raise RecordRejected("mask_length", f"samples[{i}]: {len(mask)} mask values for {n} tokens")
    if ((mask != 0) & (mask != 1)).any():
        j = int(np.argmax((mask != 0) & (mask != 1)))
        raise RecordRejected("mask_value", f"samples[{i}].mask[{j}] = {int(mask[j])}, want 0 or 1")
    if mask[0] != 1:
        raise RecordRejected("mask_value", f"samples[{i}] starts with a tool token (the model speaks first)")
    starts, lengths = _runs(mask)
    model_runs = int((mask[starts] == 1).sum())
    tool_lengths = lengths[mask[starts] == 0]
    if s.turns != model_runs or s.tool_calls != len(tool_lengths):
        detail = f"samples[{i}]: turns {s.turns}, tool_calls {s.tool_calls}; the mask has {model_runs} and {len(tool_lengths)}"
        raise RecordRejected("turns", detail)
    if s.turns > limits.max_turns:
        raise RecordRejected("turns", f"samples[{i}]: {s.turns} turns, limit {limits.max_turns}")
    if len(tool_lengths) and int(tool_lengths.max()) > limits.max_tool_tokens:
        detail = f"samples[{i}]: a tool span of {int(tool_lengths.max())} tokens, limit {limits.max_tool_tokens}"
        raise RecordRejected("tool_span", detail)
    tool_bits = s.logprobs.view(np.uint32)[mask == 0]
    if tool_bits.any():  # +0.0 is the only all-zero float32
        raise RecordRejected("logprob_tool", f"samples[{i}]: a tool token's logprob is not +0.0")
    if s.finish_reason == "turns" and mask[-1] != 1:
        raise RecordRejected("finish_mismatch", f"samples[{i}]: 'turns' must end on a model turn")


def _check_sample(i: int, s: Sample, max_tokens: int, limits: RecordLimits) -> None:
    n = len(s.response_tokens)
    if n == 0:
        raise RecordRejected("empty_response", f"samples[{i}] has no response tokens")
    cap = min(max_tokens, limits.max_response_tokens)
    if n > cap:
        raise RecordRejected("response_length", f"samples[{i}] has {n} tokens, limit {cap}")
    if len(s.logprobs) != n:
        detail = f"samples[{i}]: {len(s.logprobs)} logprobs for {n} tokens"
        raise RecordRejected("length_mismatch", detail)
    if s.finish_reason not in FINISH_REASONS:
        raise RecordRejected("bad_finish_reason", f"samples[{i}]: {_short(s.finish_reason)}")
    if s.finish_reason == "length" and n != max_tokens:
        # A worker reports "length" only for a response cut at exactly sampling.max_tokens
        # (macd.generate: an EOS or a stop string at that token makes it "stop").
        detail = f"samples[{i}]: 'length' after {n} tokens, max_tokens is {max_tokens}"
        raise RecordRejected("finish_mismatch", detail)
    if not math.isfinite(s.reward):
        raise RecordRejected("reward_not_finite", f"samples[{i}]: {s.reward}")
    _check_token_range(s.response_tokens, limits.vocab_size, f"samples[{i}].response_tokens")
    _check_logprobs(s.logprobs, limits, f"samples[{i}].logprobs")
    _check_mask(i, s, limits)


def validate_group(group: RolloutGroup, limits: RecordLimits, *, now: float | None = None) -> None:
    """Raise RecordRejected unless `group` is well-formed and within `limits`.

    `now` (seconds since the epoch, default the current time) bounds finished_at from above.
    """
    _check_header(group, limits)
    if problem := _sampling_problem(group.sampling, limits):
        raise RecordRejected("sampling", problem)
    now = time.time() if now is None else now
    if problem := _timestamps_problem(group.started_at, group.finished_at, limits, now):
        raise RecordRejected("timestamps", problem)
    _check_prompt(group.prompt_tokens, limits)
    _check_group_size(len(group.samples), limits)
    for i, s in enumerate(group.samples):
        _check_sample(i, s, group.sampling.max_tokens, limits)


def load_record(
    data: bytes | bytearray | memoryview, limits: RecordLimits, *, now: float | None = None
) -> RolloutGroup:
    """Decode and validate a record. Raises only RecordRejected, with a REJECT_REASONS code."""
    try:
        group = decode_group(
            data, max_bytes=limits.max_record_bytes, max_samples=limits.max_samples
        )
    except RecordError as e:
        raise RecordRejected(e.reason, e.detail) from e
    validate_group(group, limits, now=now)
    return group


__all__ = [
    "REJECT_REASONS",
    "VALIDATION_REASONS",
    "RecordLimits",
    "RecordRejected",
    "load_record",
    "validate_group",
]
