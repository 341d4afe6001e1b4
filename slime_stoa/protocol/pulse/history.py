"""Reading a run's weight plane: one reader per document (the pointer, version manifests,
anchor manifests), then the history built on them: find any version's manifest, walk the
chain, read the weight lineage (`rebuild` rebuilds a version's state on these).

Every reader takes an optional `RunTrust`: given one, a document must be signed by the run key
of its version (`run_trust`), else it is refused (`UntrustedDocument`, a ManifestError).

Each document is read with a size limit (`MAX_POINTER_BYTES`, `MAX_VERSION_MANIFEST_BYTES`,
`MAX_ANCHOR_MANIFEST_BYTES`): a larger object is refused after at most limit + 1 bytes."""

from __future__ import annotations

from slime_stoa.protocol.layout import QuantPlane, RunLayout
from slime_stoa.protocol.run_trust import RunTrust, Untrusted, load_rotations, signer_of
from slime_stoa.protocol.signing import PublicKey
from slime_stoa.protocol.store import NotFound, Store
from slime_stoa.protocol.store.capped import TooLarge, read_capped, read_capped_bytes

from .lineage import Lineage
from .manifests import AnchorManifest, ManifestError, Pointer, UntrustedDocument, VersionManifest


class HistoryError(Exception):
    """The requested version cannot be found or rebuilt."""


class NotPublished(HistoryError):
    """The run has no pointer: the trainer has not published weights for it yet."""


# -- the documents: every reader of the bucket parses them here -----------------------------------

#: A pointer is a few hundred bytes.
MAX_POINTER_BYTES = 64 << 10
#: Tensors a version manifest is sized for: LFM2-8B-A1B, a mixture of experts with one tensor
#: per expert matrix, has about 2,600; this leaves 25x headroom.
MAX_MODEL_TENSORS = 65_536
#: A version manifest: two patch indexes (step and catch-up), each naming every tensor once per
#: frame it spans. Of MAX_MODEL_TENSORS tensors in 20,000 frames, an index takes 0.6 MB (the
#: limit was sized for the retired verbose JSON index, 7 MB: ample headroom).
MAX_VERSION_MANIFEST_BYTES = 16 << 20
#: An anchor manifest: about 350 bytes per shard or HF file (an 8B model has 16 shards of 1 GiB).
MAX_ANCHOR_MANIFEST_BYTES = 4 << 20


class MalformedPointer(ManifestError):
    """The pointer object does not parse or names another run; `etag` identifies those bytes, so
    a poller can skip them (`If-None-Match`) until the pointer changes. `untrusted`: it parses
    but its signature does not check (a forgery, not a bug)."""

    def __init__(self, message: str, etag: str, *, untrusted: bool = False) -> None:
        super().__init__(message)
        self.etag = etag
        self.untrusted = untrusted


async def read_pointer_etag(
    store: Store, run: str, *, if_none_match: str | None = None, trust: RunTrust | None = None,
    plane: QuantPlane | None = None,
) -> tuple[Pointer, str] | None:
    """The pointer of the run's bf16 weights (of its quantized `plane` when given) and its ETag,
    or None when its ETag is still `if_none_match`.

    NotPublished when the run has no pointer; MalformedPointer (a ManifestError) when it does not
    parse or names another run, or (`untrusted`) when `trust` is given and the newest run key did
    not sign it. The trust reads the run's key rotations first if it has not yet, or when the
    pointer is signed by a key it does not know.
    """
    key = RunLayout(run, plane).pointer
    try:
        got = await read_capped(store, key, MAX_POINTER_BYTES, if_none_match=if_none_match)
    except NotFound:
        on = "" if plane is None else f" on plane {plane}"
        raise NotPublished(f"run {run!r} has no published weights{on} in {store.url}") from None
    except TooLarge as exc:
        raise MalformedPointer(str(exc), exc.etag) from None
    if got is None:
        return None
    try:
        if trust is not None and (not trust.loaded or not trust.knows(signer_of(got.data))):
            await load_rotations(store, trust)
        return Pointer.from_bytes(got.data, key, run=run, trust=trust, plane=plane), got.etag
    except (UntrustedDocument, Untrusted) as exc:
        raise MalformedPointer(str(exc), got.etag, untrusted=True) from None
    except ManifestError as exc:
        raise MalformedPointer(str(exc), got.etag) from None


async def read_pointer(
    store: Store, run: str, *, trust: RunTrust | None = None, plane: QuantPlane | None = None
) -> Pointer:
    """The run's pointer (current version; of its quantized `plane` when given); NotPublished
    when it has none, ManifestError when bad (or not signed by the newest key of `trust`)."""
    found = await read_pointer_etag(store, run, trust=trust, plane=plane)
    assert found is not None  # an unconditional read always returns the object
    return found[0]


async def signs_pointer(store: Store, run: str, key: PublicKey) -> bool:
    """Whether the run's weight pointer verifies under `key` itself (the trainer holding it
    signed it). False when there is none, when it does not verify, and when its signer is a key
    the rotations moved to after `key` (`key` is no longer the run's)."""
    trust = RunTrust(run, key)
    trust.loaded = True  # `key` alone: no rotation read from the bucket can vouch for it
    try:
        await read_pointer(store, run, trust=trust)
    except (NotPublished, ManifestError):
        return False
    return trust.rotations == 0


async def read_manifest(store: Store, key: str, *, trust: RunTrust | None = None) -> VersionManifest:
    """The version manifest at `key`; NotFound when it is gone (retention), ManifestError when bad
    or when it is not the manifest that belongs at `key` (another run, version or attempt)."""
    data = await _read_document(store, key, MAX_VERSION_MANIFEST_BYTES)
    return VersionManifest.from_bytes(data, key, key=key, trust=trust)


async def read_anchor_manifest(store: Store, key: str, *, trust: RunTrust | None = None) -> AnchorManifest:
    """The anchor manifest at `key`; NotFound when it is gone (retention), ManifestError when bad
    or when it is not the manifest that belongs at `key` (another run, version or attempt)."""
    data = await _read_document(store, key, MAX_ANCHOR_MANIFEST_BYTES)
    return AnchorManifest.from_bytes(data, key, key=key, trust=trust)


async def _read_document(store: Store, key: str, limit: int) -> bytes:
    """At most `limit` bytes of `key`; ManifestError when the object is larger."""
    try:
        return await read_capped_bytes(store, key, limit)
    except TooLarge as exc:
        raise ManifestError(str(exc)) from None


# -- history --------------------------------------------------------------------------------------


async def walk_back(store: Store, start: VersionManifest, *, limit: int, trust: RunTrust | None = None):
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
            manifest = await read_manifest(store, manifest.parent.manifest, trust=trust)
        except NotFound:
            return


# A lineage read stops after this many manifests past `depth` (restores add no step, so a run
# restarted again and again from its last version could otherwise make the walk unbounded).
RESTORE_ALLOWANCE = 64


async def read_lineage(
    store: Store, run: str, *, depth: int, pointer: Pointer | None = None, trust: RunTrust | None = None
) -> Lineage:
    """The pointer's weight lineage back `depth` training steps (see `lineage.Lineage`): the
    versions on it lagging the pointer's by fewer than `depth` steps, with their steps and state
    digests, and the version ranges restarts abandoned on the way. Follows each version's
    lineage parent (`Origin.parent`), so an abandoned branch is skipped, not read. Empty when
    nothing is published. One GET for the pointer (none when the caller passes it) and one per
    manifest; stops quietly at a manifest retention deleted (its version still counts, from the
    reference to it); ManifestError when a manifest is malformed or contradicts its child, or
    (with `trust`) is not signed by the run's key for its version."""
    if pointer is None:
        try:
            pointer = await read_pointer(store, run, trust=trust)
        except NotPublished:
            return Lineage.straight({})
    manifest: VersionManifest | None = await read_manifest(store, pointer.manifest, trust=trust)
    assert manifest is not None
    head, head_step = manifest.version, manifest.origin.step
    steps: dict[int, int] = {}
    digests: dict[int, str] = {}
    abandoned: list[tuple[int, int]] = []
    complete = False
    for _ in range(depth + RESTORE_ALLOWANCE):
        if manifest is None or head_step - manifest.origin.step >= depth:
            break
        origin = manifest.origin
        steps[manifest.version], digests[manifest.version] = origin.step, manifest.state_digest
        parent, parent_step = origin.parent, origin.parent_step
        if parent is None or parent_step is None:
            complete = True
            break
        if parent.version < manifest.version - 1:
            abandoned.append((parent.version + 1, manifest.version - 1))
        try:
            child, manifest = manifest, await read_manifest(store, parent.manifest, trust=trust)
        except NotFound:  # retention: what the reference says is all there is
            if head_step - parent_step < depth:
                steps[parent.version], digests[parent.version] = parent_step, parent.state_digest
            break
        if manifest.state_digest != parent.state_digest or manifest.origin.step != parent_step:
            raise ManifestError(
                f"v{manifest.version} of run {run!r} is not the lineage parent v{child.version} names "
                f"(state digest or step differ)"
            )
    return Lineage(
        head=head, head_step=head_step, steps=steps, digests=digests, abandoned=tuple(abandoned), complete=complete
    )


async def published_digests(
    store: Store, run: str, *, depth: int, pointer: Pointer | None = None, trust: RunTrust | None = None
) -> dict[int, str]:
    """{version: state digest} of the versions on the pointer's lineage within `depth` training
    steps of it (`read_lineage`): what a record may claim
    (`slime_stoa.trainer.consumer.admission.check_published`). Without restarts, the pointer's
    version and the `depth - 1` before it. Empty when nothing is published."""
    return dict((await read_lineage(store, run, depth=depth, pointer=pointer, trust=trust)).digests)


async def find_manifest(store: Store, run: str, version: int, *, trust: RunTrust | None = None) -> VersionManifest:
    """The committed manifest of `version` (the one on the pointer's chain)."""
    pointer = await read_pointer(store, run, trust=trust)
    if version > pointer.version:
        raise HistoryError(f"run {run!r} is at v{pointer.version}; v{version} does not exist yet")
    layout = RunLayout(run)
    if version == pointer.version:
        return await read_manifest(store, pointer.manifest, trust=trust)
    keys = [info.key async for info in store.list(layout.version_manifests_prefix(version))]
    if len(keys) == 1:  # the usual case: one attempt per version
        return await read_manifest(store, keys[0], trust=trust)
    if not keys:
        raise HistoryError(f"v{version} of run {run!r} is gone (older than the anchors kept)")
    # Several attempts (a crash or a lost race): follow the chain from the pointer.
    head = await read_manifest(store, pointer.manifest, trust=trust)
    async for manifest in walk_back(store, head, limit=pointer.version + 1, trust=trust):
        if manifest.version == version:
            return manifest
    raise HistoryError(f"v{version} of run {run!r} is not on the committed chain")
