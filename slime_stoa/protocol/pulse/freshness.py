"""Freshness of the weight plane: a reader never goes back to older genuine weights.

Every genuine pointer moves forward in (epoch, version): versions only grow, and a trainer that
restarts from an earlier checkpoint publishes its restore as a new, higher version of a new
epoch (`manifests.Origin`). An older pointer put back into the bucket (a rollback: old, genuinely
signed bytes) therefore always compares lower than what a reader already holds, and is refused
(`pointer_regression`); only a pointer of a higher epoch may name a lower version.

The head a reader compares against is `Head`: the (epoch, version) it holds, or remembered from
an earlier run (a restarted worker, `macd/run_pin.py`).

A reader with no head at all (a worker joining for the first time) has nothing to compare
against, so the pointer's signed time bounds it instead: every pointer carries `updated_at`,
signed with it, and a live trainer re-signs its pointer at least every `REFRESH_S`
(`commit.Committer.refresh`, run by each publishing process's `keepalive.PointerKeeper`) even
when no version is published. A first-time reader refuses a
pointer signed more than `FIRST_POINTER_MAX_AGE_S` before the store's clock
(`stale_first_pointer`): an old genuine pointer put back is then at most that old. When the
trainer is down its pointer goes stale: workers that hold weights keep them (their head, not the
time, is their check), and a first-time worker waits, saying so in one line, until the trainer
re-signs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .manifests import Pointer

#: How often a live trainer re-signs its pointer (one small PUT per chain).
REFRESH_S = 300.0
#: The oldest signed pointer a reader with no head takes, by the store's clock: a dozen missed
#: refreshes, covering the trainer's clock being off the store's and a store outage.
FIRST_POINTER_MAX_AGE_S = 3600.0


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


def stale_first_pointer(pointer: Pointer, now_s: float, max_age_s: float = FIRST_POINTER_MAX_AGE_S) -> str | None:
    """Why a reader with no head refuses `pointer` at time `now_s` (the store's clock): it was
    signed more than `max_age_s` before; None when it is fresh enough."""
    age = now_s - pointer.updated_at
    if age <= max_age_s:
        return None
    return (f"the pointer (v{pointer.version}) was signed {age / 60:.0f} min ago, over the {max_age_s / 60:.0f} min "
            "a worker without weights accepts: the trainer is down or an old pointer was put back; "
            "waiting for the trainer to re-sign it")
