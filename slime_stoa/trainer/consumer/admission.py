"""Judging one downloaded record: decode, validate, match its key, re-score. Pure.

`judge_record` either returns an `Admitted` group or raises `RecordRejected` with a stable
reason: the validator's (`slime_stoa.protocol.validate.REJECT_REASONS`) or one of `CONSUMER_REASONS`.
Nothing a worker uploads can make it raise anything else.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime_stoa.protocol.layout import RolloutKey
from slime_stoa.protocol.records import RolloutGroup
from slime_stoa.protocol.validate import (
    REJECT_REASONS,
    RecordLimits,
    RecordRejected,
    load_record,
)

from .scoring import Rescorer

CONSUMER_REASONS = frozenset(
    {
        "bad_key",  # a key under the rollouts prefix that is not a record name
        "key_mismatch",  # the record's worker_id / seq / kind differ from its key
        "task",  # the record names another task than the run's
        "prompt_index",  # no task item with the record's prompt_index
        "prompt",  # prompt_tokens are not the run's prompt for that prompt_index
        "reward",  # the task could not score a sample (decoder or task error, non-finite)
        "version_ahead",  # weight_version further ahead of the trainer than the slack allows
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


def judge_record(
    name: str,
    data: bytes,
    *,
    key: RolloutKey,
    limits: RecordLimits,
    rescorer: Rescorer,
    reward_tolerance: float,
    now: float | None = None,
) -> Admitted:
    """Decode, validate and re-score one record; RecordRejected if it fails any check."""
    group = load_record(data, limits, now=now)
    check_key(group, key)
    scored = rescorer.score(group)
    disagreements = sum(
        1
        for sample, reward in zip(group.samples, scored.rewards, strict=True)
        if abs(sample.reward - reward) > reward_tolerance
    )
    return Admitted(
        name=name,
        group=group,
        prompt=scored.item.prompt,
        label=scored.item.label,
        texts=scored.texts,
        rewards=scored.rewards,
        disagreements=disagreements,
    )
