"""Rebuilding a version's state from the bucket: its committed manifest (`history`), then a fresh
`Subscriber` synced to it (an anchor and the patches after it, every digest checked)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.store import Store, StoreError

from .history import HistoryError, find_manifest, read_pointer
from .manifests import ManifestError, VersionManifest
from .subscriber import Subscriber, SyncError


@dataclass(frozen=True, slots=True)
class Rebuilt:
    state: dict[str, np.ndarray]
    manifest: VersionManifest
    path: str


async def rebuild(store: Store, run: str, version: int | None = None, *, trust: RunTrust | None = None) -> Rebuilt:
    """Reconstruct a version's verified bf16 state from the bucket (the current one by default);
    with `trust`, every document and object it reads is checked against the run keys.
    HistoryError when it cannot."""
    try:
        if version is None:
            version = (await read_pointer(store, run, trust=trust)).version
        manifest = await find_manifest(store, run, version, trust=trust)
        sub = Subscriber(store, run, trust=trust)
        result = await sub.sync_to(manifest)
    except (StoreError, ManifestError, SyncError) as exc:
        raise HistoryError(f"cannot rebuild v{version} of run {run!r}: {exc}") from None
    assert sub.state is not None
    return Rebuilt(sub.state, manifest, result.path)


__all__ = ["Rebuilt", "rebuild"]
