"""Reading a run's weight plane: one reader per document (the pointer, version manifests,
anchor manifests), then the history built on them: find any version's manifest, walk the
chain, rebuild a state."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import NotFound, Store, StoreError

from .manifests import AnchorManifest, ManifestError, Pointer, VersionManifest


class HistoryError(Exception):
    """The requested version cannot be found or rebuilt."""


class NotPublished(HistoryError):
    """The run has no pointer: the trainer has not published weights for it yet."""


# -- the documents: every reader of the bucket parses them here -----------------------------------


class MalformedPointer(ManifestError):
    """The pointer object does not parse or names another run; `etag` identifies those bytes, so
    a poller can skip them (`If-None-Match`) until the pointer changes."""

    def __init__(self, message: str, etag: str) -> None:
        super().__init__(message)
        self.etag = etag


async def read_pointer_etag(store: Store, run: str, *, if_none_match: str | None = None) -> tuple[Pointer, str] | None:
    """The run's pointer and its ETag, or None when its ETag is still `if_none_match`.

    NotPublished when the run has no pointer; MalformedPointer (a ManifestError) when it does not
    parse or names another run.
    """
    key = RunLayout(run).pointer
    try:
        got = await store.get(key, if_none_match=if_none_match)
    except NotFound:
        raise NotPublished(f"run {run!r} has no published weights in {store.url}") from None
    if got is None:
        return None
    try:
        return Pointer.from_bytes(got.data, key, run=run), got.etag
    except ManifestError as exc:
        raise MalformedPointer(str(exc), got.etag) from None


async def read_pointer(store: Store, run: str) -> Pointer:
    """The run's pointer (current version); NotPublished when it has none, ManifestError when bad."""
    found = await read_pointer_etag(store, run)
    assert found is not None  # an unconditional read always returns the object
    return found[0]


async def read_manifest(store: Store, key: str) -> VersionManifest:
    """The version manifest at `key`; NotFound when it is gone (retention), ManifestError when bad
    or when it is not the manifest that belongs at `key` (another run, version or attempt)."""
    return VersionManifest.from_bytes(await store.get_bytes(key), key, key=key)


async def read_anchor_manifest(store: Store, key: str) -> AnchorManifest:
    """The anchor manifest at `key`; NotFound when it is gone (retention), ManifestError when bad
    or when it is not the manifest that belongs at `key` (another run, version or attempt)."""
    return AnchorManifest.from_bytes(await store.get_bytes(key), key, key=key)


# -- history --------------------------------------------------------------------------------------


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


async def published_digests(
    store: Store, run: str, *, depth: int, pointer: Pointer | None = None
) -> dict[int, str]:
    """{version: state digest} of the pointer's version and the `depth - 1` before it on the
    committed chain (fewer when older manifests are gone): what a record may claim
    (`slime_stoa.trainer.consumer.admission.check_published`). Empty when nothing is published.
    One GET for the pointer (none when the caller just read it and passes it) and one per
    manifest; ManifestError when a manifest is malformed."""
    if pointer is None:
        try:
            pointer = await read_pointer(store, run)
        except NotPublished:
            return {}
    start = await read_manifest(store, pointer.manifest)
    return {m.version: m.state_digest async for m in walk_back(store, start, limit=depth)}


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
    from .subscriber import Subscriber, SyncError  # the subscriber reads documents with the readers above

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
