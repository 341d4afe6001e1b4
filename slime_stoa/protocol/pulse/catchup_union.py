"""The catch-up union a publisher carries between versions, rebuilt from the bucket on resume.

A catch-up patch at version c holds every change since the anchor with its values at c
(`catchup.py` says when one is written). The publisher keeps that union as it goes; a restarted
publisher rebuilds it from the newest catch-up at or below the head and the step patches after it
(every step since the anchor when there is none), whatever their mode: `patch_delta` takes the
changed elements from a patch and their values from the resumed state. When a link is missing,
the union cannot be rebuilt and the next version is an anchor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import numpy as np

from slime_stoa.protocol.run_trust import RunTrust, content_hash
from slime_stoa.protocol.store import Store

from .codec import Delta, merge_deltas
from .frames import decode_frame
from .history import walk_back
from .manifests import ManifestError, PatchRef, VersionManifest
from .parallel import ordered_map
from .publish_types import UntrustedState

log = logging.getLogger("stoa.pulse")


def patch_delta(index, body: bytes, state: Mapping[str, np.ndarray], *, threads: int | None = 1) -> Delta:
    """The elements a patch body changed, with their values in `state` (the state the patch
    reaches): a delta whatever the patch's mode. Frames decode on `threads` threads."""
    parts: dict[str, list[np.ndarray]] = {}

    def decoded(i: int) -> list:
        frame = index.frames[i]
        return decode_frame(index, i, body[frame.offset : frame.offset + frame.length])

    for entries in ordered_map(decoded, range(len(index.frames)), threads):
        for name, indices, _values in entries:
            parts.setdefault(name, []).append(indices)
    delta: Delta = {}
    for name, pieces in parts.items():
        indices = np.concatenate(pieces)
        delta[name] = (indices, state[name].reshape(-1)[indices])
    return delta


async def union_sources(
    store: Store, head: VersionManifest, *, trust: RunTrust | None
) -> tuple[list[PatchRef] | None, int]:
    """The patches whose changes make up the union since `head`'s anchor: the newest catch-up
    at or below `head` and the step patches after it (every step since the anchor when there is
    none), oldest first, or None when a link is missing (then an anchor is due); and the
    catch-up bytes written since the anchor, as far as the walk counted them."""
    anchor = head.anchor.version
    steps: list[PatchRef] = []
    newest: PatchRef | None = None
    reached = anchor  # the version the newest catch-up reaches (the anchor when none)
    counted = 0
    try:
        async for m in walk_back(store, head, limit=head.version - anchor, trust=trust):
            if m.version <= anchor or m.anchor.version != anchor:
                break
            catchup = m.patch("catchup")
            if catchup is not None:
                counted += catchup.bytes
                if newest is None and catchup.covers(anchor):
                    newest, reached = catchup, m.version
            if newest is None:
                step = m.patch("step")
                if step is None or step.base_min != m.version - 1:
                    return None, counted
                steps.append(step)
    except ManifestError as exc:
        log.warning("cannot rebuild the catch-up union of v%d: %s; the next version is an anchor", head.version, exc)
        return None, counted
    if reached + len(steps) != head.version:
        return None, counted
    return ([newest] if newest is not None else []) + steps[::-1], counted


async def merge_sources(
    store: Store, sources: list[PatchRef], state: Mapping[str, np.ndarray], *, trust: RunTrust | None,
    threads: int | None,
) -> Delta:
    """The union of the changes of `sources` (`union_sources`) with their values in `state` (the
    state they reach). UntrustedState when a patch body does not match its signed sha256."""
    deltas = []
    for source in sources:
        body = await store.get_bytes(source.key)
        if trust is not None and content_hash(body) != source.sha256:
            raise UntrustedState(f"refusing to resume: {source.key} does not match its signed sha256")
        deltas.append(await asyncio.to_thread(patch_delta, source.index, body, state, threads=threads))
    return await asyncio.to_thread(merge_deltas, deltas, threads=threads)
