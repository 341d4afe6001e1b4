"""Reading a run's weight history: find any version's manifest, walk the chain, rebuild a state."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import NotFound, Store, StoreError

from .manifests import ManifestError, Pointer, VersionManifest
from .subscriber import Subscriber, SyncError


class HistoryError(Exception):
    """The requested version cannot be found or rebuilt."""


async def read_pointer(store: Store, run: str) -> Pointer:
    layout = RunLayout(run)
    try:
        return Pointer.from_bytes(await store.get_bytes(layout.pointer), layout.pointer)
    except NotFound:
        raise HistoryError(f"run {run!r} has no published weights in {store.url}") from None


async def read_manifest(store: Store, key: str) -> VersionManifest:
    return VersionManifest.from_bytes(await store.get_bytes(key), key)


async def walk_back(store: Store, start: VersionManifest, *, limit: int):
    """Yield manifests from `start` back through their parents (at most `limit`), newest first;
    stops quietly at the first version whose manifest is gone (retention)."""
    manifest: VersionManifest | None = start
    for _ in range(limit):
        if manifest is None:
            return
        yield manifest
        if manifest.parent is None:
            return
        try:
            manifest = await read_manifest(store, manifest.parent.manifest)
        except NotFound:
            return


async def find_manifest(store: Store, run: str, version: int) -> VersionManifest:
    """The committed manifest of `version` (the one on the pointer's chain)."""
    pointer = await read_pointer(store, run)
    if version > pointer.version:
        raise HistoryError(f"run {run!r} is at v{pointer.version}; v{version} does not exist yet")
    layout = RunLayout(run)
    if version == pointer.version:
        return await read_manifest(store, pointer.manifest)
    keys = [info.key async for info in store.list(layout.version_manifests_prefix(version))]
    if len(keys) == 1:  # the usual case: one attempt per version
        return await read_manifest(store, keys[0])
    if not keys:
        raise HistoryError(f"v{version} of run {run!r} is gone (older than the anchors kept)")
    # Several attempts (a crash or a lost race): follow the chain from the pointer.
    async for manifest in walk_back(store, await read_manifest(store, pointer.manifest), limit=pointer.version + 1):
        if manifest.version == version:
            return manifest
    raise HistoryError(f"v{version} of run {run!r} is not on the committed chain")


@dataclass(frozen=True, slots=True)
class Rebuilt:
    state: dict[str, np.ndarray]
    manifest: VersionManifest
    path: str


async def rebuild(store: Store, run: str, version: int | None = None) -> Rebuilt:
    """Reconstruct a version's verified bf16 state from the bucket (the current one by default)."""
    try:
        if version is None:
            version = (await read_pointer(store, run)).version
        manifest = await find_manifest(store, run, version)
        sub = Subscriber(store, run)
        result = await sub.sync_to(manifest)
    except (StoreError, ManifestError, SyncError) as exc:
        raise HistoryError(f"cannot rebuild v{version} of run {run!r}: {exc}") from None
    assert sub.state is not None
    return Rebuilt(sub.state, manifest, result.path)
