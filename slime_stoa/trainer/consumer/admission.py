"""Judging one downloaded record: check its worker signature, decode, validate, match its key
and the published weights, refuse replays, re-score.

`judge_record` either returns an `Admitted` group or raises `RecordRejected` with a stable
reason: the validator's (`slime_stoa.protocol.validate.REJECT_REASONS`) or one of `CONSUMER_REASONS`.
Nothing a worker uploads can make it raise anything else. It is pure except for the optional
replay ledger, which it updates when it admits a record.

It runs in two steps, which the consumer calls apart: `open_record` (signature, decode,
validation, key: the record's bytes are decoded here, once) and `admit` (published weights,
replays, re-scoring: the decoded group). A record whose weights are not among the published
versions as last read fails `admit` with `UnpublishedVersion`, naming the version it claims, so
the consumer can read the published versions again and `admit` the same group once more.
"""

from __future__ import annotations

from collections.abc import Mapping

from slime_stoa.judging.scoring import Rescorer
from slime_stoa.judging.signature import SIGNATURE_REASONS, check_signature
from slime_stoa.protocol.layout import RolloutKey
from slime_stoa.protocol.records import RolloutGroup
from slime_stoa.protocol.registry import Registry
from slime_stoa.protocol.validate import REJECT_REASONS, RecordLimits, RecordRejected, load_record

from .groups import Admitted
from .quarantine import QUARANTINE_REASONS
from .state import ReplayLedger

CONSUMER_REASONS = SIGNATURE_REASONS | QUARANTINE_REASONS | frozenset(
    {
        "bad_key",  # a key under the rollouts prefix that is not a record name
        "future_key",  # a record key stamped further ahead of when it was written than the future window
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


class UnpublishedVersion(RecordRejected):
    """`check_published` failed ("version" or "digest"); `version` is the weight version the
    record claims."""

    def __init__(self, reason: str, detail: str, version: int) -> None:
        super().__init__(reason, detail)
        self.args = (reason, detail, version)  # so it pickles
        self.version = version


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
    published version to its state digest (from the version manifests). UnpublishedVersion
    "version" for a version not in it, "digest" for another state digest than that version's."""
    version = group.weight_version
    digest = published.get(version)
    if digest is None:
        raise UnpublishedVersion("version", f"weight_version {version} was never published (or is not known yet)", version)
    if group.state_digest != digest:
        raise UnpublishedVersion(
            "digest", f"state_digest {group.state_digest[:40]} is not v{version}'s published {digest[:40]}", version
        )


def open_record(
    data: bytes, *, key: RolloutKey, limits: RecordLimits, now: float | None = None, registry: Registry | None = None
) -> tuple[RolloutGroup, str | None]:
    """(group, signer key id) of a downloaded object that passes the signature check (`registry`:
    a signed run's worker registry, None for an unsigned run), decodes, validates against
    `limits` and is what its key says; RecordRejected otherwise."""
    record, signer = check_signature(data, key=key, registry=registry)
    group = load_record(record, limits, now=now)
    check_key(group, key)
    return group, signer


def admit(
    name: str,
    group: RolloutGroup,
    signer: str | None,
    *,
    rescorer: Rescorer,
    reward_tolerance: float,
    published: Mapping[int, str] | None = None,
    replay: ReplayLedger | None = None,
) -> Admitted:
    """The opened `group` (from key `name`) checked against the published weights and the replay
    ledger and re-scored; RecordRejected (UnpublishedVersion for the published check) if it
    fails. The replay ledger is updated only when it is admitted."""
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
    group, signer = open_record(data, key=key, limits=limits, now=now, registry=registry)
    return admit(
        name, group, signer, rescorer=rescorer, reward_tolerance=reward_tolerance, published=published, replay=replay
    )
