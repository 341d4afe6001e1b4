"""When a version is published as a full anchor as well as a patch: a pure policy.

A worker that holds no version, or one from before the anchor, downloads the anchor and the
chain after it; so the chain after an anchor must stay short (in versions: `anchor_every`) and
cheap next to the anchor (in bytes: the step patches since it stay within `anchor_fraction` of
the anchor's size). A publisher that could not rebuild its catch-up union on resume forces one
(`forced`): a new anchor starts a fresh union.
"""

from __future__ import annotations


def anchor_due(
    *,
    version: int,
    anchor_version: int,
    since_anchor_bytes: int,
    anchor_bytes: int,
    anchor_every: int,
    anchor_fraction: float,
    forced: bool = False,
) -> bool:
    """Whether `version` is written as an anchor. `anchor_version` is the last anchor,
    `since_anchor_bytes` the step patch bytes after it including `version`'s own step patch,
    `anchor_bytes` that anchor's size."""
    return (
        forced
        or version - anchor_version >= anchor_every
        or since_anchor_bytes > anchor_fraction * anchor_bytes
    )
