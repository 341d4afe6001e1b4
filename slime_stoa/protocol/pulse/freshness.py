"""Freshness of the weight plane: a reader never goes back to older genuine weights.

Every genuine pointer moves forward in (epoch, version): versions only grow, and a trainer that
restarts from an earlier checkpoint publishes its restore as a new, higher version of a new
epoch (`manifests.Origin`). An older pointer put back into the bucket (a rollback: old, genuinely
signed bytes) therefore always compares lower than what a reader already holds, and is refused
(`pointer_regression`); only a pointer of a higher epoch may name a lower version.

The head a reader compares against is `Head`: the (epoch, version) it holds, or remembered from
an earlier run (a restarted worker, `macd/run_pin.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .manifests import Pointer


@dataclass(frozen=True, slots=True, order=True)
class Head:
    """A position on the weight plane, ordered as the pointer moves: epoch first, then version."""

    epoch: int
    version: int

    def __str__(self) -> str:
        return f"v{self.version} (epoch {self.epoch})"


def pointer_head(pointer: Pointer) -> Head:
    return Head(pointer.epoch, pointer.version)


def pointer_regression(held: Head | None, pointer: Pointer) -> str | None:
    """Why `pointer` is refused by a reader at `held` (it goes back), or None when it does not."""
    new = pointer_head(pointer)
    if held is None or new >= held:
        return None
    return f"the pointer went back from {held} to {new}: an old pointer put back (a rollback)"
