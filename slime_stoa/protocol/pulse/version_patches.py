"""The patches of one version: its step patch from the version before and, when the catch-up
schedule and budget (`catchup.py`) say so, a catch-up patch from the anchor. Encoding only: the
caller uploads them."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_trust import content_hash

from .catchup import catchup_due, within_budget
from .codec import Delta, merge_deltas, shapes_of
from .frames import Mode, encode_delta
from .manifests import PatchRef
from .publish_config import PublisherConfig

STEP_MODE: Mode = "rel"
"""Step patches carry base-relative codes: smaller than new values, and a step patch only ever
applies to the version before it (receivers check its base digest)."""
CATCHUP_MODE: Mode = "abs"
"""Catch-up patches carry new values: they apply to any version since the anchor."""


@dataclass(frozen=True, slots=True)
class VersionPatches:
    patches: tuple[PatchRef, ...]  # the step patch, then the catch-up if one is written
    bodies: tuple[bytes, ...]  # theirs, in the same order
    union: Delta  # every change since the anchor, this version's included ({} without catch-ups)
    catchup_bytes: int  # catch-up bytes written since the anchor, this version's included
    since_anchor_bytes: int  # step patch bytes written since the anchor, this version's included

    @property
    def step(self) -> PatchRef:
        return self.patches[0]

    @property
    def uploads(self) -> list[tuple[str, bytes]]:
        return [(p.key, body) for p, body in zip(self.patches, self.bodies, strict=True)]


async def encode_patches(
    layout: RunLayout, config: PublisherConfig, *, version: int, attempt: str, anchor: int, since_anchor_bytes: int,
    delta: Delta, state: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray] | None, base_digest: str,
    union: Delta, catchup_bytes: int, old: Mapping[str, np.ndarray] | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> VersionPatches:
    """The patches of `version` (attempt `attempt`) whose `state` is `base` (digest
    `base_digest`, the version before) changed by `delta`. `anchor` is the last anchor, after
    which the step patches took `since_anchor_bytes` (this one not included), the catch-ups
    `catchup_bytes` and the changes `union`. A publisher holding no full state passes `old` (the
    base's bits at the delta's indices) for `base` and the tensors' `shapes` for `state`'s."""
    threads = config.threads
    shapes = shapes if shapes is not None else shapes_of(state)
    index, body = await asyncio.to_thread(
        encode_delta, delta, shapes, base=base, old=old, mode=STEP_MODE, frame_bytes=config.frame_bytes,
        threads=threads,
    )
    step = PatchRef(
        kind="step", key=layout.patch(version, attempt, "step", version - 1), bytes=len(body), count=index.count,
        base_min=version - 1, base_max=version - 1, base_digest=base_digest, index=index,
        sha256=await asyncio.to_thread(content_hash, body),
    )
    patches, bodies = [step], [body]
    union = await asyncio.to_thread(merge_deltas, [union, delta], threads=threads) if config.catchup else {}
    since = since_anchor_bytes + len(body)
    if config.catchup and catchup_due(version - anchor):
        cu_index, cu_body = await asyncio.to_thread(
            encode_delta, union, shapes, mode=CATCHUP_MODE, frame_bytes=config.frame_bytes, threads=threads
        )
        if within_budget(catchup_bytes, len(cu_body), since, config.catchup_budget):
            catchup_bytes += len(cu_body)
            patches.append(
                PatchRef(
                    kind="catchup", key=layout.patch(version, attempt, "catchup", anchor), bytes=len(cu_body),
                    count=cu_index.count, base_min=anchor, base_max=version - 1, base_digest=None, index=cu_index,
                    sha256=await asyncio.to_thread(content_hash, cu_body),
                )
            )
            bodies.append(cu_body)
    return VersionPatches(tuple(patches), tuple(bodies), union, catchup_bytes, since)
