"""Which of the four ways a quickstart starts its learner applies: a pure decision.

- `NEW`: the run is new in the bucket; the learner as prepared (and warm started) is its first version.
- `RESTART`: `--restart-from N`; the checkpoint of vN (`checkpoints`) is published again as a restore.
- `LEARNER_FILE`: the learner's own file (`learner_file`) holds the weights the bucket's pointer
  names; the learner resumes exactly, optimizer state included.
- `REBUILD`: anything else (no learner file, a stale or damaged one); the learner resumes from the
  published weights, rebuilt from the bucket, with a fresh optimizer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ResumeMode(enum.Enum):
    NEW = "new"
    RESTART = "restart"
    LEARNER_FILE = "learner file"
    REBUILD = "rebuild"


@dataclass(frozen=True)
class WeightsAt:
    """Which weights: those of `version` of `run`, whose state digest is `state_digest`."""

    run: str
    version: int
    state_digest: str


def resume_mode(
    *, new_run: bool, restart_from: int | None, published: WeightsAt, saved: WeightsAt | None
) -> ResumeMode:
    """The mode that applies to a run that is `new_run` in the bucket, asked to restart from
    `restart_from` (None: not asked), whose pointer names the `published` weights, and whose
    learner file holds the `saved` ones (None: no readable learner file)."""
    if new_run:
        return ResumeMode.NEW
    if restart_from is not None:
        return ResumeMode.RESTART
    if saved == published:
        return ResumeMode.LEARNER_FILE
    return ResumeMode.REBUILD
