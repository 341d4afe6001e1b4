"""The commit step of a chain: the signed version manifest, then the signed pointer by CAS.

Given the run key, the publisher signs every pointer, version manifest and anchor manifest it
writes, and every manifest carries the sha256 of each object it names. On `open` it refuses
(`UntrustedState`) to resume from a pointer or manifests the run's keys did not sign, or with a
key that is not the run's current one (the run manifest's `run_key`, or the newest key its
rotations announce: `publisher_trust`; a run manifest or key rotation a bucket writer replaced
is put back from the trainer's copy, or outlived when the run's pointer is the publisher's own or the publisher's
key vouches for the run's first key through its rotations' acceptances). A pointer gone or
refused is put back from the trainer's copy; without one, a signed run's pointer is written again
at the highest version the bucket holds a signed manifest of (`_point_at_head`). Freshness
(signed runs): a version number gets one signed manifest: a commit is refused
(`PreconditionFailed`) when another signed manifest of its version exists (this publisher's own
unanswered attempts aside: they are never referenced), and `highest_signed` finds the head an
old genuine pointer put back (a rollback) would hide. The one exception is the repair of an unsigned v0 (`stoa weights publish-anchor`):
the unsigned v0 was never trusted by a signed reader, so the run still has one signed v0.

A bucket writer cannot stop the publisher (single-bucket mode: every worker's token can write
the pointer). A pointer CAS that loses to an object no publisher wrote (garbage, a forgery) or
to an older pointer put back, or finds the pointer gone, writes over it: only a pointer signed
at this version or above is another publisher's (`PublishConflict`). With `copies` (the
trainer's own folder, `PublisherConfig.keep_dir`), the committer keeps each pointer and version
manifest it commits; `open` puts the pointer back when it is gone or refused, and each commit
puts back the manifests of the versions a reader still checks records against, the run manifest
and the key rotations (`put_back_window`).

Freshness in time (`freshness.REFRESH_S`): `refresh` re-signs the pointer the publisher last
wrote or resumed from with a new `updated_at` (same version), by CAS on its ETag, so a
first-time reader can tell a live trainer's pointer from an old one put back. A refresh that
loses its CAS to a newer commit does nothing; one that loses to a bucket writer's object writes
over it as a commit would (`_writable_over`).

A write acknowledged but not stored (a faulty gateway or proxy) is caught where it is cheap:
after each version manifest's put a HEAD confirms its size, and after each pointer CAS a HEAD
confirms the pointer's ETag is the one the CAS answered (`_confirm`: one small request per
version, beside the manifest and patches written). A write not confirmed raises StoreUnavailable
with the pointer's ETag left at the last confirmed one, so the publisher's unsure-commit path
(`chain._settle_unsure`) reads the pointer and publishes again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace

from slime_stoa.protocol.kept import Copies, put_back_changed
from slime_stoa.protocol.layout import RunLayout, version_str
from slime_stoa.protocol.run_manifest import MAX_RUN_MANIFEST_BYTES, RunManifest, RunNotFound, read_run_manifest
from slime_stoa.protocol.run_trust import (
    RunTrust,
    Untrusted,
    Unvouched,
    keep_rotations,
    load_rotations,
    put_back_rotations,
    vouched_first_key,
)
from slime_stoa.protocol.signing import PublicKey, SigningKey
from slime_stoa.protocol.store import NotFound, PreconditionFailed, Store, StoreUnavailable
from slime_stoa.protocol.store.capped import TooLarge, read_capped

from .history import (
    MAX_POINTER_BYTES,
    MalformedPointer,
    NotPublished,
    read_manifest,
    read_pointer_etag,
    signs_pointer,
)
from .manifests import ManifestError, Pointer, UntrustedDocument, VersionManifest
from .publish_types import UntrustedState

log = logging.getLogger("stoa.pulse")

# How many manifests above the pointer `open` reads looking for the highest signed one (a worker's
# token can list junk there; each candidate is one small GET).
MAX_HEAD_CANDIDATES = 64


async def publisher_trust(store: Store, run: str, key: SigningKey, copies: Copies | None = None) -> RunTrust:
    """The keys a publisher holding `key` resumes under: pinned to the run manifest's `run_key`
    (the publisher's own key for a run without one, or without a manifest), plus the run's
    rotations; UntrustedState unless `key` is the newest of them.

    A bucket writer cannot stop the publisher by replacing or deleting run.json or a rotation:
    with `copies` the trainer's own copies of those it accepted are put back and the check made
    again (what is accepted is kept there). Without a copy, a manifest naming another first key
    than the one `key`'s rotations vouch for is a forgery: publishing goes on under the vouched
    keys. Else, when the run's pointer verifies under `key` (the publisher signed it),
    publishing goes on pinned to `key` alone. Either way a warning names the repair (workers
    and the consumer refuse a forged manifest themselves). When nothing there is `key`'s, the
    refusal stands: the key is the operator's mistake, which no waiting repairs."""
    manifest_key = RunLayout(run).run_manifest
    kept = None if copies is None else copies.kept(manifest_key)
    if copies is not None:
        await put_back_rotations(store, run, copies)
    kept_first = _first_key_of(kept)
    try:
        trust, accepted = await _manifest_trust(store, run, key, kept_first)
    except UntrustedState as exc:
        refused: UntrustedState | None = exc
        why = f"was refused ({exc})"
    else:
        if accepted is not None or kept is None:
            if accepted is not None and copies is not None:
                await _keep_run_manifest(store, copies, manifest_key, accepted)
                await keep_rotations(store, copies, trust)
            return trust
        refused, why = None, "is gone"
    if copies is not None and kept is not None:
        await copies.put_back(store, manifest_key, why)
        try:
            trust = (await _manifest_trust(store, run, key, kept_first))[0]
            await keep_rotations(store, copies, trust)
            return trust
        except UntrustedState as exc:  # the copy is no better (a rotation refused, say): judged as without one
            refused = exc
    assert refused is not None  # a manifest gone with a copy kept returned above
    if isinstance(refused, _ForgedManifest):
        log.warning(
            "run %s: %s, so the manifest is a forgery: publishing goes on under the run's keys from %s. Repair: put %s "
            "back from `stoa run create`'s output or a kept copy", run, refused, refused.trust.pinned.key_id, manifest_key,
        )
        return refused.trust
    if not await signs_pointer(store, run, key.public):
        raise refused  # nothing here is `key`'s: the operator's config, said at once
    log.warning(
        "run %s: %s; the run's pointer is signed by this publisher's key %s: publishing goes on under that key "
        "alone. Repair: put %s back from `stoa run create`'s output or a kept copy",
        run, refused, key.key_id, manifest_key,
    )
    trust = RunTrust(run, key.public)
    trust.loaded = True  # the rotations chain from the manifest's key, which is refused: `key` is the newest trusted
    return trust


class _ForgedManifest(UntrustedState):
    """The run manifest names another first key than the one the publisher's key vouches for
    through its rotations' acceptances (`run_trust.vouched_first_key`); `trust`: the run's keys
    as the publisher's key vouches for them."""

    def __init__(self, message: str, trust: RunTrust) -> None:
        super().__init__(message)
        self.trust = trust


def _first_key_of(kept: bytes | None) -> PublicKey | None:
    """The run key named by the run manifest the trainer kept (None: none kept, or unsigned)."""
    if kept is None:
        return None
    try:
        manifest = RunManifest.from_bytes(kept)
    except ValueError:
        return None
    return None if manifest.run_key is None else PublicKey.from_text(manifest.run_key)


async def _manifest_trust(
    store: Store, run: str, key: SigningKey, kept_first: PublicKey | None = None
) -> tuple[RunTrust, RunManifest | None]:
    """The run's keys as its manifest and rotations name them, and the manifest read (None: the
    run has none); UntrustedState unless `key` is the newest of them (_ForgedManifest when `key`'s
    rotations vouch for another first key than the manifest's).

    Rotations up to `key` must carry their new keys' acceptances (`RunTrust.vouched_back_from`),
    judged on the very documents learned (the bucket may change between two reads): a rotation
    to `key` from a bucket writer's key needs no key of the run. Rotations of an older stoa have
    none; they are taken only from `kept_first`, the first key of the run manifest the trainer
    kept (a first key it trusted before)."""
    try:
        manifest: RunManifest | None = await read_run_manifest(store, run)
    except RunNotFound:
        manifest = None
    except ValueError as exc:
        raise UntrustedState(f"cannot read the run manifest to check the run key: {exc}") from None
    named = PublicKey.from_text(manifest.run_key) if manifest is not None and manifest.run_key else None
    try:
        first: PublicKey | None = await vouched_first_key(store, run, key.public)
    except Unvouched:
        first = None  # judged below, on the rotations learned
    except Untrusted as exc:
        raise UntrustedState(f"a key rotation of run {run!r} does not verify: {exc}") from None
    if first is not None and first != key.public and first != named:  # `key` vouches for `first`
        trust = RunTrust(run, first)
        await _load_rotations(store, trust, key)
        named_id = "none" if named is None else named.key_id
        raise _ForgedManifest(
            f"run.json names run key {named_id}, but the rotations key {key.key_id} accepted lead back to {first.key_id}",
            trust,
        )
    trust = RunTrust(run, named or key.public)
    await _load_rotations(store, trust, key)
    if trust.rotations and not trust.vouched_back_from(key.public) and trust.pinned != kept_first:
        raise UntrustedState(
            f"run {run!r}: a rotation up to key {key.key_id} carries no acceptance by its new key (written by an "
            f"older stoa, or forged), so nothing vouches for run.json's key {trust.pinned.key_id}; a keep_dir "
            f"holding the run manifest the trainer accepted before vouches for it"
        )
    return trust, manifest


async def _load_rotations(store: Store, trust: RunTrust, key: SigningKey) -> None:
    """Learn the run's rotations into `trust`; UntrustedState unless `key` is its newest key."""
    run = trust.run
    try:
        await load_rotations(store, trust)
    except Untrusted as exc:
        raise UntrustedState(f"a key rotation of run {run!r} does not verify: {exc}") from None
    if trust.newest != key.public:
        raise UntrustedState(
            f"key {key.key_id} is not the current key of run {run!r} (that is {trust.newest.key_id}, "
            f"fingerprint {trust.newest.fingerprint}): publish with that key"
        )


async def _keep_run_manifest(store: Store, copies: Copies, key: str, manifest: RunManifest) -> None:
    """Keep the bucket's bytes of the run manifest the publisher accepted (as the consumer's
    `kept_run_manifest` does): what it puts back when a bucket writer deletes or replaces it."""
    with contextlib.suppress(NotFound, ValueError):  # swapped since it was read: kept next time
        data = await store.get_bytes(key)
        if copies.kept(key) != data and RunManifest.from_bytes(data) == manifest:
            copies.keep(key, data)
            log.info("run %s: kept a copy of %s in %s", manifest.run, key, copies.path(key))


class Committer:
    """Writes one chain's version manifests and moves its pointer; owns the pointer's ETag and
    the keys of the manifests this publisher wrote."""

    def __init__(self, store: Store, layout: RunLayout, key: SigningKey | None, copies: Copies | None = None):
        self.store = store
        self.layout = layout
        self.key = key  # the run key: signs everything written (None: an unsigned run)
        self.copies = copies  # the trainer's own copies of the pointer and manifests committed (None: none)
        self.trust: RunTrust | None = None  # the run keys `authenticate` resumed under (with a key)
        self.etag: str | None = None  # the pointer's, as this publisher last wrote or read it
        self.last: Pointer | None = None  # the pointer at `etag` (what `refresh` re-signs)
        self._written: set[str] = set()  # version manifests this publisher wrote (its own lost attempts)

    async def authenticate(self) -> None:
        """With a run key: the run's keys, refusing a key that is not its current one (a run
        manifest a bucket writer replaced is put back or outlived: `publisher_trust`)."""
        if self.key is not None:
            self.trust = await publisher_trust(self.store, self.layout.run, self.key, self.copies)

    async def read_pointer(self) -> tuple[Pointer, str] | None:
        """The chain's pointer and ETag to resume from; None when the chain has none, and
        UntrustedState when the run's keys did not sign it."""
        try:
            found = await read_pointer_etag(self.store, self.layout.run, trust=self.trust, plane=self.layout.plane)
        except NotPublished:
            return await self._put_pointer_back(None, "is gone") or await self._point_at_head(None, "is gone")
        except MalformedPointer as exc:
            why = f"was refused ({exc})"
            if (back := await self._put_pointer_back(exc.etag, why) or await self._point_at_head(exc.etag, why)):
                return back
            if exc.untrusted:
                raise UntrustedState(f"refusing to resume run {self.layout.run!r}: {exc}") from None
            raise
        assert found is not None  # an unconditional read always returns the object
        self.last = found[0]
        return found

    async def _put_pointer_back(self, etag: str | None, why: str) -> tuple[Pointer, str] | None:
        """The trainer's copy of the pointer it last committed, written over the bucket's (at
        `etag`; None: gone) and read back; None when it keeps none."""
        kept = None if self.copies is None else self.copies.kept(self.layout.pointer)
        if kept is None:
            return None
        try:  # the copy may predate a key rotation (signed by a key no longer the newest)
            Pointer.from_bytes(kept, self.layout.pointer, run=self.layout.run, trust=self.trust, plane=self.layout.plane)
        except (UntrustedDocument, Untrusted, ManifestError) as exc:
            log.warning("run %s: the pointer %s, and the trainer's copy is refused too (%s)", self.layout.run, why, exc)
            return None
        self.etag = await self.store.cas(self.layout.pointer, kept, etag)
        log.warning("run %s: the pointer %s; put the trainer's own copy back", self.layout.run, why)
        found = await read_pointer_etag(self.store, self.layout.run, trust=self.trust, plane=self.layout.plane)
        assert found is not None
        self.last = found[0]
        return found

    async def _point_at_head(self, etag: str | None, why: str) -> tuple[Pointer, str] | None:
        """Without a copy to put back, in a signed run: the pointer written again (over the bucket's,
        at `etag`; None: gone) at the highest version the bucket holds a signed manifest of, which
        no bucket writer can forge; None when there is none (or the run is unsigned)."""
        if self.key is None or self.trust is None:
            return None
        head = await self._highest_signed_after(None)
        if head is None:
            return None
        self.etag = etag
        await self.point_back(head)
        assert self.last is not None and self.etag is not None
        log.warning(
            "run %s: the pointer %s and the trainer keeps no copy; wrote it again at the highest signed version, v%d",
            self.layout.run, why, head.version,
        )
        return self.last, self.etag

    async def landed(self, manifest: VersionManifest) -> str | None:
        """After a pointer write that got no answer: the pointer's ETag when it names `manifest`
        (the write landed), else None. StoreError while the store stays down."""
        try:
            found = await read_pointer_etag(self.store, self.layout.run, trust=self.trust, plane=self.layout.plane)
        except MalformedPointer as exc:
            if not exc.untrusted:
                raise
            return None  # not ours (ours are signed): it never landed
        if found is None or found[0].manifest != self.layout.version_manifest(manifest.version, manifest.attempt):
            return None
        self.last = found[0]  # the caller adopts its ETag: `refresh` re-signs this one
        return found[1]

    async def commit(self, manifest: VersionManifest, *, create: bool) -> None:
        """Write the manifest, then move the pointer (create it for the first version). In a
        signed run, PreconditionFailed when another signed manifest of the version exists."""
        key = self.layout.version_manifest(manifest.version, manifest.attempt)
        other = await self.signed_manifests(manifest.version)
        if other:
            raise PreconditionFailed(f"{other[0]} is already a signed manifest of v{manifest.version}")
        self._written.add(key)
        data = manifest.to_bytes(self.key)
        await self.store.put_if_absent(key, data)
        await self._confirm(key, size=len(data))
        moved = self.pointer(manifest)
        pointer = moved.to_bytes(self.key)
        try:
            etag = await self.store.cas(self.layout.pointer, pointer, None if create else self.etag)
        except PreconditionFailed:
            if create or not await self._writable_over(manifest.version):
                raise
            etag = await self.store.cas(self.layout.pointer, pointer, self.etag)
        await self._confirm(self.layout.pointer, etag=etag)  # raises with `self.etag` the last one confirmed
        self.etag, self.last = etag, moved
        if self.copies is not None:
            self.copies.keep(key, data)
            self.copies.keep(self.layout.pointer, pointer)

    async def _confirm(self, key: str, *, size: int | None = None, etag: str | None = None) -> None:
        """The bucket holds the object just written at `key` (of `size` bytes, or at `etag`):
        StoreUnavailable when its write was acknowledged but it is not there (module doc)."""
        try:
            info = await self.store.head(key)
        except NotFound:
            info = None
        if info is None or (size is not None and info.size != size) or (etag is not None and info.etag != etag):
            raise StoreUnavailable(
                f"the write of {key} was acknowledged but the bucket does not hold it: the store or a proxy "
                "before it lost the write; it is written again"
            )

    async def _writable_over(self, version: int) -> bool:
        """After the pointer's CAS lost, before committing `version`: True (and the ETag to write
        over remembered) unless the pointer is another publisher's, signed at `version` or above;
        garbage, a forgery, an older pointer put back, or none at all is a bucket writer's doing."""
        try:
            got = await read_capped(self.store, self.layout.pointer, MAX_POINTER_BYTES)
        except NotFound:
            why, etag = "is gone", None
        except TooLarge as exc:
            why, etag = "is oversized junk", exc.etag
        else:
            assert got is not None
            etag = got.etag
            try:
                theirs = Pointer.from_bytes(got.data, self.layout.pointer, run=self.layout.run, trust=self.trust,
                                            plane=self.layout.plane)
            except (ManifestError, UntrustedDocument, Untrusted) as exc:
                why = f"was overwritten with an object this run's publisher did not write ({exc})"
            else:
                if theirs.version >= version:
                    return False
                why = f"was put back to v{theirs.version}"
        log.warning("run %s: the pointer %s; writing v%d over it", self.layout.run, why, version)
        self.etag = etag
        return True

    async def put_back_window(self, head: int, window: int) -> None:
        """Before each version: put back the kept run manifest and key rotations where a bucket
        writer deleted or replaced them (a worker joining mid-run needs them; one GET each), and
        the kept manifests of versions head-window+1..head that the bucket lacks; forget the
        copies older than that."""
        if self.copies is None:
            return
        await put_back_changed(self.store, self.copies, self.layout.run_manifest, MAX_RUN_MANIFEST_BYTES)
        await put_back_rotations(self.store, self.layout.run, self.copies)
        low = max(0, head - window + 1)
        prefix = self.layout.versions_prefix
        folder = self.copies.path(prefix.rstrip("/"))
        kept = {prefix + p.name: parsed[0] for p in (folder.iterdir() if folder.is_dir() else ())
                if (parsed := self.layout.parse_version_manifest(prefix + p.name)) is not None}
        for key, v in kept.items():
            if v < low:
                self.copies.forget(key)
        wanted = {key for key, v in kept.items() if low <= v <= head}
        if not wanted:
            return
        after = f"{prefix}{version_str(low - 1)}." if low > 0 else None
        async for info in self.store.list(prefix, start_after=after):
            wanted.discard(info.key)
        for key in sorted(wanted):
            await self.copies.put_back(self.store, key, "is gone")

    async def point_back(self, head: VersionManifest) -> None:
        """Move the pointer (at `etag`) back to `head`, a signed version above it."""
        moved = self.pointer(head)
        pointer = moved.to_bytes(self.key)
        self.etag = await self.store.cas(self.layout.pointer, pointer, self.etag)
        self.last = moved
        if self.copies is not None:
            self.copies.keep(self.layout.pointer, pointer)

    async def refresh(self) -> bool:
        """Re-sign the pointer last written or resumed from with the time now (module doc);
        False when there is none yet or a newer pointer (another commit) won the CAS."""
        last = self.last
        if last is None:
            return False
        fresh = replace(last, updated_at=time.time())
        data = fresh.to_bytes(self.key)
        try:
            etag = await self.store.cas(self.layout.pointer, data, self.etag)
        except PreconditionFailed:
            if self.last is not last or not await self._writable_over(last.version + 1):
                return False  # a commit moved it meanwhile, or a pointer at or past this version is there
            etag = await self.store.cas(self.layout.pointer, data, self.etag)
        await self._confirm(self.layout.pointer, etag=etag)
        if self.last is not last:
            return False  # committed meanwhile: that commit's ETag stands
        self.etag, self.last = etag, fresh
        if self.copies is not None:
            self.copies.keep(self.layout.pointer, data)
        return True

    def pointer(self, manifest: VersionManifest) -> Pointer:
        return Pointer(
            run=self.layout.run, version=manifest.version, state_digest=manifest.state_digest,
            manifest=self.layout.version_manifest(manifest.version, manifest.attempt), anchor=manifest.anchor,
            updated_at=time.time(), epoch=manifest.origin.epoch, plane=self.layout.plane,
        )

    async def signed_manifests(self, version: int) -> list[str]:
        """Keys of the signed manifests of `version` this publisher did not write (signed runs;
        an unsigned or forged one is not a version: a worker's token cannot block the trainer)."""
        if self.trust is None:
            return []
        found = []
        async for info in self.store.list(self.layout.version_manifests_prefix(version)):
            if info.key not in self._written and await self.verified(info.key) is not None:
                found.append(info.key)
        return found

    async def highest_signed(self, pointer: Pointer) -> VersionManifest | None:
        """The signed manifest of the highest version the bucket lists above the pointer's, or
        None (an unsigned run, or none above it). A publisher resumes from it: an old genuine
        pointer put back must not make it publish a version number again. Reads at most
        MAX_HEAD_CANDIDATES manifests, highest first."""
        return await self._highest_signed_after(pointer.version)

    async def _highest_signed_after(self, version: int | None) -> VersionManifest | None:
        """`highest_signed` above `version` (None: of every version)."""
        if self.trust is None:
            return None
        # past every attempt of `version`
        after = None if version is None else f"{self.layout.versions_prefix}{version_str(version)}."
        keys = []
        async for info in self.store.list(self.layout.versions_prefix, start_after=after):
            parsed = self.layout.parse_version_manifest(info.key)
            if parsed is not None and (version is None or parsed[0] > version):
                keys.append((parsed[0], info.key))
        for _, key in sorted(keys, reverse=True)[:MAX_HEAD_CANDIDATES]:
            manifest = await self.verified(key)
            if manifest is not None:
                return manifest
        return None

    async def verified(self, key: str) -> VersionManifest | None:
        try:
            return await read_manifest(self.store, key, trust=self.trust)
        except (ManifestError, NotFound):
            return None
