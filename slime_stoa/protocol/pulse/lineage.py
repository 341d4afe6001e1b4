"""The weight lineage as a consumer sees it: which versions the trainer's weights descend from,
and how many training steps each lags behind (pure data; `history.read_lineage` builds it).

Version numbers only grow, but after a trainer restarts from the checkpoint of an earlier version
R while the pointer is at P > R, the weights no longer follow them: the next version P+1 restores
R's weights (a new epoch) and versions R+1..P are an abandoned branch. Staleness is therefore
measured in lineage steps (`Origin.step`: training steps from the first version; a restore adds
none), not in version numbers:

- a group drawn from a version on the trainer's lineage lags `step(trainer) - step(version)`: a
  group from R is as fresh at P+1 as it was at R (they are the same weights);
- a group drawn from an abandoned branch is off the lineage: its weights were trained on batches
  the restarted trainer never learnt from, and it is dropped (`lag` returns None) rather than
  measured to the common ancestor;
- versions newer than the one read continue the head's lineage one step each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class Lineage:
    """The head's lineage, as far back as it was read."""

    head: int  # the pointer's version when read
    head_step: int
    steps: Mapping[int, int]  # version -> lineage step, for every version read on the head's lineage
    digests: Mapping[int, str]  # version -> state digest, same versions
    abandoned: tuple[tuple[int, int], ...] = field(default=())  # inclusive version ranges left by restarts
    complete: bool = False  # read back to the first version (nothing older is on the lineage unread)

    @classmethod
    def straight(cls, digests: Mapping[int, str]) -> Lineage:
        """A lineage without restarts: every version one step after the previous."""
        head = max(digests, default=-1)
        return cls(head=head, head_step=head, steps={v: v for v in digests}, digests=dict(digests))

    def is_abandoned(self, version: int) -> bool:
        """On a branch a restart left behind (as far as the lineage was read)."""
        return any(low <= version <= high for low, high in self.abandoned)

    def step_of(self, version: int) -> int | None:
        """The lineage step of `version`, None when it is off the lineage. Nothing read: the
        version itself. Versions past the head continue it; versions older than what was read
        are assumed on it, one step each."""
        if version in self.steps:
            return self.steps[version]
        if not self.steps:
            return version
        if version > self.head:
            return self.head_step + (version - self.head)
        oldest = min(self.steps)
        if version < oldest and not self.complete and not self.is_abandoned(version):
            gap = oldest - version
            for low, high in self.abandoned:  # a branch in between, and the restore that skipped it
                if version <= low - 1 and high + 1 <= oldest:
                    gap -= high - low + 2
            return self.steps[oldest] - gap
        return None  # within what was read, yet not on the lineage: a branch left behind

    def lag(self, trainer_version: int, weight_version: int) -> int | None:
        """Training steps a group drawn from `weight_version` lags behind the trainer at
        `trainer_version` (negative: the group claims newer weights), or None when the group's
        weights are off the trainer's lineage."""
        trainer, weights = self.step_of(trainer_version), self.step_of(weight_version)
        if trainer is None:  # the trainer names a version off the head's lineage: count versions
            return trainer_version - weight_version
        if weights is None:
            return None
        return trainer - weights
