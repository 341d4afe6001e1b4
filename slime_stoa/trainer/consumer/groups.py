"""The shapes a rollout record takes on the trainer's side, in the order it takes them.

    bytes           the object a worker uploaded (a signed envelope in a signed run)
    RolloutGroup    decoded and validated (`slime_stoa.protocol.records`, `protocol.validate`)
    Admitted        judged (`admission.judge_record`): the trainer's rewards, decoded texts, the
                    task item's prompt and label, reward disagreements, the signing key
    (in the pool)   an Admitted with its use count (`Pool`; the counts are the reuse ledger)
    ConsumedGroup   in a batch: its object key, version lag and which use this is
    sample dicts    `sample_fields`: one dict per sample, named after slime's `Sample` fields

The slime plugin turns each dict into `Sample(**fields)` (`slime_stoa.trainer.slime.rollout`).
stoa's own learner does not read these dicts: the quickstart builds its
`learner.TrainSequence`s straight from a ConsumedGroup (the record's prompt and response tokens,
the worker's logprobs as recorded, the mask, the trainer's rewards).

Per sample of a group of G (contiguous, in the record's order), `sample_fields` gives:

    tokens             prompt tokens + response tokens
    response_length    number of response tokens (a tool episode's: model and tool tokens)
    response           the decoded completion the reward was computed from (a tool episode's
                       whole text, observations included)
    prompt, label      the task item's prompt text and label
    reward             the trainer's recomputed reward (never the worker's)
    loss_mask          the record's mask, one 0/1 per response token: 1 = sampled by the model
                       (trained on), 0 = a tool/observation token (never trained on); all ones
                       for a single-turn (v1) record
    rollout_log_probs  the worker's logprob of each response token at the sampling temperature,
                       clamped to <= 0 (the validator admits float32 rounding up to +1e-4); 0.0
                       at tool tokens (masked out)
    status             "truncated" when the sample hit max_tokens (finish_reason "length") or
                       a tool episode its turn limit ("turns"), else "completed"
    group_index, index the ids the caller passes (slime: from its data source)
    weight_versions    [str(weight version)] (informational in slime)
    metadata           stoa_* provenance: worker, weight version, version lag, use, key, worker
                       reward, task, prompt index, finish reason, turns, tool calls

Pure and free of slime and torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from slime_stoa.protocol.records import RolloutGroup

from . import policy
from .config import AdmissionOrder

STATUS_COMPLETED = "completed"
STATUS_TRUNCATED = "truncated"


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


class Pool:
    """Admitted groups waiting to be used, each with the times it was used (the reuse
    ledger). A batch takes them in admission order (`policy.select`), a group at most `reuse_limit`
    times; groups that became too stale or whose branch a trainer restart abandoned are dropped
    (`expire`), as are those of a worker who lost the trainer's trust (`drop`)."""

    def __init__(self) -> None:
        self._groups: dict[str, Admitted] = {}  # name -> group, in admission order
        self._uses: dict[str, int] = {}  # name -> times used
        self._expired_at: object = None

    def __len__(self) -> int:
        return len(self._groups)

    def __bool__(self) -> bool:
        return bool(self._groups)

    def __iter__(self) -> Iterator[Admitted]:
        return iter(list(self._groups.values()))

    def add(self, admitted: Admitted, uses: int = 0) -> None:
        self._groups[admitted.name] = admitted
        self._uses[admitted.name] = uses

    def ledger(self) -> dict[str, int]:
        """{name: times used} of every group in the pool (the state's reuse ledger)."""
        return dict(self._uses)

    def drop(self, keep: Callable[[Admitted], bool]) -> list[Admitted]:
        """Remove and return the groups `keep` refuses."""
        dropped = [a for a in self._groups.values() if not keep(a)]
        for a in dropped:
            del self._groups[a.name], self._uses[a.name]
        return dropped

    def expire(self, at: object, lag: Callable[[int], int | None], staleness_limit: int) -> tuple[int, int]:
        """Drop the groups whose weight version is on an abandoned branch (`lag` None) or lags
        more than `staleness_limit`; (off-lineage, stale) groups dropped. Nothing to do while `at`
        (what the lags depend on) is what it was at the last call."""
        if self._expired_at == at:
            return 0, 0
        self._expired_at = at
        off = stale = 0

        def keep(a: Admitted) -> bool:
            nonlocal off, stale
            steps = lag(a.group.weight_version)
            if steps is None:
                off += 1
                return False
            if policy.is_stale(steps, staleness_limit):
                stale += 1
                return False
            return True

        self.drop(keep)
        return off, stale

    def take(self, n: int, order: AdmissionOrder, reuse_limit: int) -> list[tuple[Admitted, int]]:
        """The `n` groups (fewer if there are fewer) a batch takes, in admission order, each with
        its use number (1: the first time); a group used `reuse_limit` times leaves the pool."""
        candidates = (policy.Candidate(name, a.group.weight_version, self._uses[name]) for name, a in self._groups.items())
        out = []
        for name in policy.select(candidates, n, order):
            admitted, uses = self._groups[name], self._uses[name] + 1
            if policy.can_reuse(uses, reuse_limit):
                self._uses[name] = uses
            else:
                del self._groups[name], self._uses[name]
            out.append((admitted, uses))
        return out


@dataclass(frozen=True, slots=True)
class ConsumedGroup:
    """One group of a batch, ready to train on."""

    key: str  # the record's object key
    group: RolloutGroup
    prompt: str  # the task item's prompt text
    label: str  # the task item's label
    texts: tuple[str, ...]  # decoded completions
    rewards: tuple[float, ...]  # the trainer's rewards (the worker's are in group.samples)
    version_lag: int  # training steps the weights lag the trainer's (along the lineage) when this batch was made
    use: int  # 1 the first time this group is used, 2 the second, ...

    @classmethod
    def of(cls, admitted: Admitted, *, key: str, version_lag: int, use: int) -> ConsumedGroup:
        a = admitted
        return cls(
            key=key, group=a.group, prompt=a.prompt, label=a.label, texts=a.texts, rewards=a.rewards,
            version_lag=version_lag, use=use,
        )

    @property
    def worker(self) -> str:
        return self.group.worker_id

    @property
    def weight_version(self) -> int:
        return self.group.weight_version


@dataclass(frozen=True)
class Batch:
    groups: tuple[ConsumedGroup, ...]
    metrics: dict[str, float]
    trainer_version: int


def sample_status(finish_reason: str) -> str:
    return STATUS_TRUNCATED if finish_reason in ("length", "turns") else STATUS_COMPLETED


def sample_fields(
    group: ConsumedGroup,
    *,
    group_index: int | None = None,
    indices: Sequence[int | None] | None = None,
) -> list[dict[str, Any]]:
    """One field dict per sample of `group` (see the module doc). `indices`, when given, holds
    one sample index per sample."""
    g = group.group
    if indices is not None and len(indices) != len(g.samples):
        raise ValueError(f"{len(indices)} indices for a group of {len(g.samples)} samples")
    prompt = [int(t) for t in g.prompt_tokens]
    out = []
    for i, s in enumerate(g.samples):
        response = [int(t) for t in s.response_tokens]
        n = len(response)
        out.append(
            {
                "group_index": group_index,
                "index": None if indices is None else indices[i],
                "prompt": group.prompt,
                "label": group.label,
                "tokens": prompt + response,
                "response": group.texts[i],
                "response_length": n,
                "reward": float(group.rewards[i]),
                "loss_mask": [int(m) for m in s.mask],
                "rollout_log_probs": np.minimum(s.logprobs.astype(np.float64), 0.0).tolist(),
                "status": sample_status(s.finish_reason),
                "weight_versions": [str(g.weight_version)],
                "metadata": {
                    "stoa_worker": g.worker_id,
                    "stoa_weight_version": g.weight_version,
                    "stoa_version_lag": group.version_lag,
                    "stoa_use": group.use,
                    "stoa_key": group.key,
                    "stoa_worker_reward": float(s.reward),
                    "stoa_task": g.task_id,
                    "stoa_prompt_index": g.prompt_index,
                    "stoa_finish_reason": s.finish_reason,
                    "stoa_turns": s.turns,
                    "stoa_tool_calls": s.tool_calls,
                },
            }
        )
    return out
