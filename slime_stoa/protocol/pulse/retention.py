"""Retention: which weight objects of a chain the publisher deletes after writing an anchor.

The policy is pure (`retention_floor`: the version below which objects go; `deletion_order`: the
keys below it, manifests first); `retain` is its IO edge, best effort: a store error skips it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunNotFound, read_run_manifest, run_retention
from slime_stoa.protocol.store import Store, StoreError

log = logging.getLogger("stoa.pulse")


def retention_floor(anchors: list[int], *, retain: int, head: int, window: int) -> int | None:
    """The version below which retention deletes weight objects, or None to delete nothing.

    An anchor: the `retain`-th newest, or an older one when that one is within `window`
    versions of `head` (every version from `head - window + 1` on keeps its manifest and the
    objects it needs). `anchors` sorted ascending; `retain` >= 1."""
    assert retain >= 1 and window >= 1
    if len(anchors) <= retain:
        return None
    floor = anchors[-retain]
    oldest_needed = head - window + 1
    if floor > oldest_needed:
        older = [a for a in anchors if a <= oldest_needed]
        floor = older[-1] if older else anchors[0]
    return floor if floor > anchors[0] else None


def deletion_order(layout: RunLayout, keys: Iterable[str], keep_from: int) -> list[str]:
    """The weight objects among `keys` older than `keep_from`, version manifests first, so no
    reader finds a manifest whose patches or anchor are gone."""
    doomed = [k for k in keys if (parsed := layout.weight_object_version(k)) is not None and parsed[0] < keep_from]
    return sorted(doomed, key=lambda k: (not k.startswith(layout.versions_prefix), k))


async def retain(
    store: Store, layout: RunLayout, *, retain_anchors: int | None, retain_versions: int, head: int
) -> None:
    """Delete the chain's weight objects older than the oldest anchor kept (best effort).
    `retain_anchors` None: the run manifest's; the versions kept behind `head` are at least
    `retain_versions` and the run's staleness window."""
    try:
        retain = retain_anchors if retain_anchors is not None else await run_retention(store, layout.run)
        if retain == 0:
            return
        anchors = sorted(
            {
                parsed[0]
                async for info in store.list(layout.anchors_prefix)
                if info.key.endswith("/manifest.json")
                and (parsed := layout.weight_object_version(info.key)) is not None
                and parsed[0] <= head
            }
        )
        window = max(retain_versions, await staleness_window(store, layout.run))
        keep_from = retention_floor(anchors, retain=retain, head=head, window=window)
        if keep_from is None:
            return
        prefixes = (layout.versions_prefix, layout.patches_prefix, layout.anchors_prefix)
        listed = [info.key for prefix in prefixes async for info in store.list(prefix)]
        doomed = deletion_order(layout, listed, keep_from)
        for key in doomed:
            await store.delete(key)
        if doomed:
            log.info("retention: deleted %d objects older than anchor v%d", len(doomed), keep_from)
    except StoreError as exc:
        log.warning("retention skipped: %s", exc)


async def staleness_window(store: Store, run: str) -> int:
    """The run's staleness_limit + 2 (the versions a consumer checks records against), 0 when
    the run manifest cannot be read."""
    try:
        return (await read_run_manifest(store, run)).staleness_limit + 2
    except (RunNotFound, ValueError):
        return 0
