"""When the publisher writes a catch-up patch: a schedule and a byte budget, both pure.

A catch-up patch at version c holds the union of every change since the anchor a, with its
values at c (absolute values, valid on any state in a..c-1). It grows with the distance
c - a, so writing one at every version makes the trainer's upload grow quadratically between
anchors (the sum of the unions). Instead catch-ups are written only at distances that are
powers of two: c - a in 2, 4, 8, 16, ... The newest catch-up at or below any head h is then
more than halfway from the anchor to h, so a lagger reaches h with that one catch-up plus a
chain of fewer than (h - a) / 2 step patches, or with the chain from its own version when that
is shorter; and the catch-ups of an anchor interval of n versions cost the unions at log2(n)
distances, whose sizes sum to at most ~2n step patches' worth of changes when no element
changes twice (the overlap of real training makes unions smaller). (A fixed period p would make
the chain after a catch-up shorter than p, but cost ~n^2 / (2p) steps' worth of catch-ups.)

On top of that `within_budget` keeps the catch-up bytes written since the anchor at most `budget`
times the step bytes written since it (a due catch-up that would exceed it is not written), so
the trainer's upload per version stays bounded between anchors whatever the trajectory; and it
skips a catch-up no lagger would take (one at least as large as the chain from the anchor: with
absolute values a union costs more per change than base-relative steps, so early catch-ups of
changes that do not overlap are not worth their bytes).
"""

from __future__ import annotations

import math


def catchup_due(distance: int) -> bool:
    """Whether the version `distance` versions past the anchor gets a catch-up patch: a power of
    two (a version one past the anchor never does: its step patch is the same change)."""
    return distance >= 2 and distance & (distance - 1) == 0


def within_budget(catchup_bytes: int, new_bytes: int, step_bytes: int, budget: float) -> bool:
    """Whether a due catch-up of `new_bytes` is written: it must be smaller than the step patches
    since the anchor (`step_bytes`, this version's included; else the chain from the anchor, and
    so from any version a lagger holds, is cheaper and nobody would download it), and keep the
    catch-up bytes since the anchor (`catchup_bytes` before it) within `budget` times them.
    An infinite `budget` writes every due catch-up (for receivers that rank paths by time, to
    whom one large patch may beat many small ones)."""
    if math.isinf(budget):
        return True
    return new_bytes < step_bytes and catchup_bytes + new_bytes <= budget * step_bytes
