"""The lineage a publisher records for each version it writes (`manifests.Origin`).

A version is trained from the previous one, or, on the first publish after `open`, restores a
committed version whose state it is bit for bit (a trainer restarted from a checkpoint).
Restoring an earlier version than the pointer's starts a new branch: the epoch goes up and the
versions in between are abandoned (consumers measure staleness along the lineage:
`lineage.Lineage`). The patch chain is not affected: the new version's step patch still goes
from the pointer's version.
"""

from __future__ import annotations

import logging

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.store import Store

from .history import walk_back
from .manifests import ManifestError, Origin, Ref, VersionManifest

log = logging.getLogger("stoa.pulse")

# How many committed versions back the first publish after `open` looks for the one its state
# restores (a trainer restarted from an older checkpoint is rarely further back).
RESTORE_SEARCH = 1000


def version_ref(layout: RunLayout, manifest: VersionManifest) -> Ref:
    """The reference to a committed version that a later manifest names (parent, source)."""
    return Ref(
        version=manifest.version,
        manifest=layout.version_manifest(manifest.version, manifest.attempt),
        state_digest=manifest.state_digest,
    )


async def next_origin(
    store: Store, layout: RunLayout, prev: VersionManifest, digest: str, *, first_since_open: bool,
    trust: RunTrust | None,
) -> Origin:
    """The lineage of the version after `prev`, whose state has `digest`: trained from `prev`,
    or, on the first publish since `open`, a restore of the newest committed version with the
    same state (`prev` itself, or an earlier one: a new branch)."""
    last = prev.origin
    trained = Origin(epoch=last.epoch, step=last.step + 1, parent=version_ref(layout, prev))
    if not first_since_open:
        return trained
    if digest == prev.state_digest:
        return Origin(epoch=last.epoch, step=last.step, parent=version_ref(layout, prev), restored=True)
    try:
        async for older in walk_back(store, prev, limit=RESTORE_SEARCH, trust=trust):
            if older.version < prev.version and older.state_digest == digest:
                return Origin(
                    epoch=last.epoch + 1, step=older.origin.step, parent=version_ref(layout, older), restored=True
                )
    except ManifestError as exc:  # the chain is damaged further back: as far as it reads, no match
        log.warning("looking for the version v%d restores stopped at a malformed manifest: %s", prev.version + 1, exc)
    return trained


def log_restore(version: int, origin: Origin) -> None:
    """Say which version a committed restore brings back, and the branch it abandons."""
    if not origin.restored or origin.parent is None:
        return
    back = origin.parent.version
    log.info(
        "v%d restores the weights of v%d (lineage step %d, epoch %d)%s", version, back, origin.step, origin.epoch,
        f": a new branch, v{back + 1}..v{version - 1} abandoned" if back < version - 1 else "",
    )
