"""The consumer's rules, as pure functions: staleness, reuse, admission order, dynamic sampling.

- Staleness: a group drawn from weight version w, used when the trainer is at version t, lags
  t - w versions (the consumer counts them in training steps along the weight lineage,
  `slime_stoa.protocol.pulse.lineage`, which is t - w until a trainer restart). It is used only
  while the lag is at most the staleness limit; past it the group is dropped (and counted), at
  admission or later while it waits in the pool.
- Reuse: a group may appear in up to `reuse_limit` batches, each time only while fresh enough.
- Admission order: a batch takes the least-used groups first; among those, `oldest_version`
  takes the lowest weight version first (the group nearest its staleness limit: slow, hard
  prompts finish late from old weights and would otherwise expire behind a stream of fast, easy
  ones), then the oldest key; `newest_version` takes the highest weight version first (the
  most on-policy data, for a trainer that outpaces its workers; older groups wait and may
  expire past the staleness limit). A group is never dropped because newer ones arrived; when
  the pool is full, discovery pauses instead (backpressure).
- Dynamic sampling: a group whose recomputed rewards are all equal has zero advantage for every
  sample under GRPO, so it carries no signal; it can be filtered (and counted).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .config import ADMISSION_ORDERS, AdmissionOrder


def version_lag(trainer_version: int, weight_version: int) -> int:
    """Versions the group's weights lag behind the trainer's (negative: the record claims newer)."""
    return trainer_version - weight_version


def is_stale(lag: int, staleness_limit: int) -> bool:
    return lag > staleness_limit


def is_ahead(lag: int, slack: int) -> bool:
    """A record claiming weights more than `slack` versions newer than the trainer's."""
    return lag < -slack


def can_reuse(uses: int, reuse_limit: int) -> bool:
    """Whether a group used `uses` times may be used again."""
    return uses < reuse_limit


def all_equal(rewards: Sequence[float], tolerance: float = 0.0) -> bool:
    """True when every reward equals the first (within `tolerance`): no GRPO signal."""
    if not rewards:
        return True
    first = rewards[0]
    return all(math.isclose(r, first, rel_tol=0.0, abs_tol=tolerance) for r in rewards)


@dataclass(frozen=True, slots=True)
class Candidate:
    """What the admission order looks at for one ready group."""

    name: str  # key name: starts with the key's timestamp, so it sorts by time
    weight_version: int
    uses: int


def admission_key(c: Candidate, order: AdmissionOrder) -> tuple:
    if order == "oldest_version":
        return (c.uses, c.weight_version, c.name)
    if order == "newest_version":
        return (c.uses, -c.weight_version, c.name)
    raise ValueError(f"unknown admission order {order!r}; expected one of {ADMISSION_ORDERS}")


def select(candidates: Iterable[Candidate], n: int, order: AdmissionOrder) -> list[str]:
    """Names of the `n` groups a batch takes (fewer if there are fewer), in admission order."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [c.name for c in sorted(candidates, key=lambda c: admission_key(c, order))[:n]]
