"""The diff and digest of a new state against the published one: the seam of the publisher's
compute.

`diff_step` is all a publisher computes from the full new state before encoding: which elements
changed (bits compared, `codec.diff`) and the new state digest (only changed tensors re-hashed).
A publisher takes it as a parameter (`Publisher(..., diff_step=)`), so an implementation that
computes the same delta and digest elsewhere (on the device holding the weights) can replace it;
whatever computes it, the delta must equal `codec.diff`'s and the digest `StateDigest.of(new)`'s,
or the published bytes change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from .codec import Delta, diff
from .digest import StateDigest


@dataclass(frozen=True, slots=True)
class StepDiff:
    delta: Delta  # tensor -> (flat indices whose bits changed, their new bits)
    digest: StateDigest  # the new state's


DiffStep = Callable[..., StepDiff]
"""`(previous, previous_digest, new, *, threads) -> StepDiff`, run off the event loop."""


def diff_step(
    previous: Mapping[str, np.ndarray], previous_digest: StateDigest, new: Mapping[str, np.ndarray], *,
    threads: int | None = 1,
) -> StepDiff:
    """The delta taking `previous` (whose digest is `previous_digest`) to `new`, and `new`'s
    digest, on `threads` threads. ValueError when the states differ in names, shapes or dtypes."""
    delta = diff(previous, new, threads=threads)
    return StepDiff(delta, previous_digest.update(new, delta.keys(), threads=threads))
