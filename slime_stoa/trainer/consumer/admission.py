"""Judging one downloaded record: check its worker signature, decode, validate, match its key
and the published weights, refuse replays, re-score.

`judge_record` either returns an `Admitted` group or raises `RecordRejected` with a stable
reason: the validator's (`slime_stoa.protocol.validate.REJECT_REASONS`) or one of `CONSUMER_REASONS`.
Nothing a worker uploads can make it raise anything else. It is pure except for the optional
replay ledger, which it updates when it admits a record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from slime_stoa.protocol.layout import RolloutKey
from slime_stoa.protocol.records import RecordError, RolloutGroup
from slime_stoa.protocol.registry import Registry
from slime_stoa.protocol.signed_record import open_signed, record_bytes, verify_signed
from slime_stoa.protocol.validate import (
    REJECT_REASONS,
    RecordLimits,
    RecordRejected,
    load_record,
)

from .quarantine import QUARANTINE_REASONS
from .scoring import Rescorer
from .state import ReplayLedger

#: Why a record of a signed run (its manifest has a run key) fails the signature check.
SignatureReason = Literal[
    "unsigned",  # not a signed envelope
    "unknown_key",  # signed by a key the run's registry does not hold (read again first)
    "revoked",  # signed by a key the registry revoked (also groups admitted before, not yet used)
    "key_mismatch",  # the key's worker is not the worker of the record's object key (also below)
    "bad_signature",  # a malformed envelope, or the signature is not over these bytes for this run
]
SIGNATURE_REASONS: frozenset[str] = frozenset(get_args(SignatureReason))
CONSUMER_REASONS = SIGNATURE_REASONS | QUARANTINE_REASONS | frozenset(
    {
        "bad_key",  # a key under the rollouts prefix that is not a record name
        "key_mismatch",  # the record's worker_id / seq / kind differ from its key
        "task",  # the record names another task than the run's
        "prompt_index",  # no task item with the record's prompt_index
        "prompt",  # prompt_tokens are not the run's prompt for that prompt_index
        "reward",  # the task could not score a sample (decoder or task error, non-finite)
        "version_ahead",  # weight_version further ahead of the trainer than the slack allows
        "version",  # weight_version is not a version the trainer published (`check_published`)
        "digest",  # state_digest is not the published state digest of that version
        "duplicate",  # a replay: same content, or same worker and seq, as an earlier record under another key
        "missing",  # the object was listed but is gone
        "download",  # the store kept failing for this object
        "internal",  # an unexpected error while judging (a bug; logged with its traceback)
    }
)
ALL_REASONS = REJECT_REASONS | CONSUMER_REASONS


@dataclass(frozen=True, slots=True)
class Admitted:
    """A record that passed every check, with the trainer's rewards."""

    name: str  # key name relative to the rollouts prefix
    group: RolloutGroup
    prompt: str  # the task item's prompt text
    label: str  # the task item's label
    texts: tuple[str, ...]  # decoded completions
    rewards: tuple[float, ...]  # the trainer's rewards
    disagreements: int  # samples whose worker reward differs from the trainer's
    signer: str | None = None  # key id of the worker key that signed it (None: an unsigned run)

    @property
    def worker(self) -> str:
        return self.group.worker_id


def check_key(group: RolloutGroup, key: RolloutKey) -> None:
    """The record must be what its key says: train kind, same worker and sequence number."""
    if key.kind != "train" or group.worker_id != key.worker or group.seq != key.seq:
        raise RecordRejected(
            "key_mismatch",
            f"record says worker {group.worker_id!r} seq {group.seq} kind {group.kind!r}; "
            f"its key says worker {key.worker!r} seq {key.seq} kind {key.kind!r}",
        )


def check_published(group: RolloutGroup, published: Mapping[int, str]) -> None:
    """The record's weights must be weights the trainer published: `published` maps each
    published version to its state digest (from the version manifests). RecordRejected
    "version" for a version not in it, "digest" for another state digest than that version's."""
    digest = published.get(group.weight_version)
    if digest is None:
        raise RecordRejected("version", f"weight_version {group.weight_version} was never published (or is not known yet)")
    if group.state_digest != digest:
        raise RecordRejected(
            "digest",
            f"state_digest {group.state_digest[:40]} is not v{group.weight_version}'s published {digest[:40]}",
        )


def reject(reason: SignatureReason, detail: str) -> RecordRejected:
    return RecordRejected(reason, detail)


def check_signature(data: bytes, *, key: RolloutKey, registry: Registry | None) -> tuple[bytes, str | None]:
    """(record bytes, signer key id) of a downloaded object, RecordRejected with a
    `SignatureReason` if a signed run's record fails the signature check.

    `registry`: the run's worker registry (verified with the run key), or None for an unsigned
    run, whose records may come in an envelope too: it is unwrapped, its signature not trusted
    (there is no run key to trust it by)."""
    try:
        if registry is None:
            return record_bytes(data), None
        signed = open_signed(data)
        entry = registry.by_key_id(signed.key_id)
        if entry is None:
            raise reject("unknown_key", f"signed by key {signed.key_id}, which the registry (serial {registry.serial}) does not hold")
        if entry.revoked:
            raise reject("revoked", f"signed by the revoked key {signed.key_id} of worker {entry.worker!r}")
        if entry.worker != key.worker:
            raise reject(
                "key_mismatch", f"signed by the key of worker {entry.worker!r}; its key says worker {key.worker!r}"
            )
        verify_signed(signed, entry.key, run=registry.run)
    except RecordRejected:
        raise
    except RecordError as exc:
        raise RecordRejected(exc.reason, exc.detail) from None
    return signed.record, signed.key_id


def judge_record(
    name: str,
    data: bytes,
    *,
    key: RolloutKey,
    limits: RecordLimits,
    rescorer: Rescorer,
    reward_tolerance: float,
    now: float | None = None,
    published: Mapping[int, str] | None = None,
    replay: ReplayLedger | None = None,
    registry: Registry | None = None,
) -> Admitted:
    """Decode, validate and re-score one record; RecordRejected if it fails any check.

    `published` (version -> state digest of every version the trainer published that a record
    may still claim): when given, the record's weight version and digest must be in it
    (`check_published`). `replay`: when given, a record whose content or (worker, seq) was
    already admitted under another key is refused as "duplicate", and an admitted record is
    added to it. `registry`: the worker registry of a signed run (see `check_signature`);
    None for an unsigned run."""
    record, signer = check_signature(data, key=key, registry=registry)
    group = load_record(record, limits, now=now)
    check_key(group, key)
    if published is not None:
        check_published(group, published)
    if replay is not None:
        replay.check(group, name)
    scored = rescorer.score(group)
    disagreements = sum(
        1
        for sample, reward in zip(group.samples, scored.rewards, strict=True)
        if abs(sample.reward - reward) > reward_tolerance
    )
    if replay is not None:
        replay.add(group, name)
    return Admitted(
        name=name,
        group=group,
        prompt=scored.item.prompt,
        label=scored.item.label,
        texts=scored.texts,
        rewards=scored.rewards,
        disagreements=disagreements,
        signer=signer,
    )
