"""The worker side of the weight plane: follow the pointer and stay bit-identical to it.

`Subscriber.sync()` costs one conditional GET while nothing changed. When the pointer moves it
reads the new version's manifest, lists the paths that reach it from the manifests back to the
held version (up to `max_chain` back) or the anchor (`route.patch_paths`), and ranks them by the
bytes they download (`route_by="bytes"`, ties by estimated time) or by estimated time
(`route_by="time"`: round trips, bytes at the measured download rate, and the CPU to apply each
change or to load an anchor, all measured as the subscriber goes):

- `step`    — the single patch from the previous version (we are one behind);
- `chain`   — the step patches of every version in between;
- `catchup` — a merged patch valid on our version (any state since the anchor, or exactly our
  state when it is base-relative), then the step patches after it (`catchup+chain`);
- `anchor`  — the full anchor plus the cheapest of those from it (cold start, or far behind).

It tries them best first. Patches of a path are fetched concurrently (frames with ranged GETs);
each frame is verified against its digest and decoded as it arrives, on `SubscriberConfig.threads`
threads, while later frames still download (`feed.FrameFeed`), and applied in place, in order,
with an undo log (a deferred sync stages it instead, writing nothing: see below); the final state digest
must equal the manifest's, and a patch counts only once its whole body matched the sha256 its
signed manifest carries. A patch carrying a base digest (every step patch, and every
base-relative patch) is only tried on exactly that base. Any failure (bad digest, missing object,
base mismatch) rolls the state back exactly, is logged, and the next path is tried. The state is
never left at an unverified version. The changed indices of a sync (`SyncResult.changed`) are
computed lazily, per tensor, in time proportional to the patches.

Nothing malformed in the bucket escapes as anything but `SyncError` (the state stays at its last
verified version): a pointer that does not parse (or names another run) is skipped until its ETag
changes, so a reader reports it once and recovers at the first good pointer; a pointer whose
manifest is unreadable is retried at the next poll (the manifest may be on its way). A pointer
that goes back in (epoch, version) from the held version (or from `floor`) is refused as a
rollback (`freshness.pointer_regression`), counted and logged once like a forgery. A signed
subscriber with no head at all (`first_pointer_max_age_s` set: a worker's first join) refuses a
pointer signed too long before `now` (`freshness.stale_first_pointer`) with a SyncError, and
polls on: the trainer's next re-signing changes the pointer. While it waits on that pointer,
`first_pointer_wait` says why (its age at each call), so a caller repeats one line naming it.

With a `RunTrust` (a signed run), the pointer, every version and anchor manifest must be signed by
the run key of its version and every patch object and anchor file must match the sha256 its
signed manifest carries, checked on download before anything from it is accepted (frames that
arrive by ranged GETs are decoded before the last one is in: a mismatch rolls them back, and a
frame failing its digest in a signed patch counts as a mismatch). A refused object is counted once
(`refused`), logged once, and when no path is left the sync raises `WeightsRefused` (a
SyncError): the state stays at its last verified version.

Who owns the bytes. A plain subscriber owns its `state` (numpy arrays nothing else holds) and
writes it. A `deferred` one holds no weight bytes at all, only where it stands (`version`,
`digest`, `current`): their owner (a worker's live weights, whose bytes are the model's memory)
lends them read-only to each `sync(base)`, which stages the next version against them
(`staged.stage_patches`: decode, verify, compute the final bits and the state digest they
make) or reads a new verified state (anchor paths) and returns it (`SyncResult.staged`). The
owner writes it where nothing computes with it and then calls `advance` (or nothing, if the
install failed: the subscriber still stands at the version the owner still holds).

What a sync returns and raises, and what a deferred sync stages, are in `sync_result.py`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slime_stoa.protocol.layout import QuantPlane, RunLayout
from slime_stoa.protocol.run_trust import ContentMismatch, RunTrust, Untrusted, check_content
from slime_stoa.protocol.store import Store, StoreError

from .anchor import read_anchor
from .apply import ChangedIndices, Frames, UndoLog, apply_patch
from .codec import PatchError
from .digest import StateDigest, tensor_digest
from .feed import FrameFeed
from .frames import PatchIndex
from .freshness import Head, pointer_regression, stale_first_pointer
from .history import MalformedPointer, NotPublished, read_anchor_manifest, read_manifest, read_pointer_etag
from .manifests import ManifestError, PatchRef, Pointer, VersionManifest
from .parallel import check_threads, thread_count
from .route import Link, Route, RouteBy, SpeedMeter, Speeds, estimate_s, patch_paths, rank_key
from .staged import stage_patches
from .sync_result import StagedSync, SyncError, SyncResult, WeightsRefused

log = logging.getLogger("stoa.pulse")

WHOLE_BODY_BYTES = 8 << 20  # smaller patches are fetched with one GET instead of one per frame
MAX_REFUSALS_KEPT = 4096  # distinct refused objects remembered (so each is counted and logged once)


@dataclass(frozen=True, kw_only=True)
class SubscriberConfig:
    """How a subscriber fetches (one per worker)."""

    concurrency: int = 8  # ranged GETs in flight
    max_chain: int = 64  # versions behind the anchor a lagger still walks manifests back for
    route_by: RouteBy = "bytes"  # rank paths by bytes to download, or by estimated time (`route.rank`)
    speeds: Speeds = field(default_factory=Speeds)  # rate guesses for path choice until measured
    manifest_cache: int = 256  # version manifests kept in memory (most recently used)
    threads: int | None = None
    """Threads decoding frames, merging staged writes and re-hashing patched tensors (numpy, zstd
    and xxh3 release the GIL; the state reached does not depend on it). None: one per CPU, at most 8."""

    def __post_init__(self) -> None:
        check_threads(self.threads)


@dataclass(slots=True)
class _Plan:
    name: str
    cost: int  # bytes to download
    patches: list[PatchRef] = field(default_factory=list)
    anchor: str | None = None  # anchor manifest key
    route: Route | None = None
    estimate_s: float = 0.0  # at planning time


class Subscriber:
    """Holds a bf16 state (`dict[str, np.ndarray]` of uint16) at a verified version.

    `deferred`: it holds no state; a sync reads the owner's bytes lent to it (`sync(base)`),
    writes nothing and returns the verified version staged; the owner installs it and calls
    `advance` (module doc)."""

    def __init__(
        self,
        store: Store,
        run: str,
        config: SubscriberConfig = SubscriberConfig(),
        *,
        trust: RunTrust | None = None,
        deferred: bool = False,
        plane: QuantPlane | None = None,
    ):
        self.store = store
        self.layout = RunLayout(run, plane)  # the run's bf16 weights, or its quantized `plane`
        self.config = config
        if trust is not None and trust.run != run:
            raise ValueError(f"the trust is run {trust.run!r}'s, not {run!r}'s")
        self.trust = trust  # None: an unsigned run, nothing is checked against run keys
        self.refused = 0  # distinct objects refused (signature or content hash)
        self.last_refusal = ""  # why the latest was
        self._refused_ids: OrderedDict[str, None] = OrderedDict()
        self.deferred = deferred
        self.floor: Head | None = None  # a pointer below this is refused before any version is held
        self.first_pointer_max_age_s: float | None = None  # with no head: the oldest signed pointer taken
        self.now: Callable[[], float] = time.time  # the clock that age is judged by (a worker's: the store's)
        self.state: dict[str, np.ndarray] | None = None  # a plain subscriber's own bytes (never deferred)
        self.version: int | None = None
        self.digest: StateDigest | None = None
        self.current: VersionManifest | None = None  # the manifest of `version`
        self.meter = SpeedMeter(config.speeds)  # measured rates, for path choice
        self._etag: str | None = None  # of the last pointer that verified: polls ask If-None-Match it
        self._failed_etag: str | None = None  # of the last pointer answer that did not (reported once)
        self._stale: Pointer | None = None  # the pointer polled last, refused as too old for a first join
        self._manifests: OrderedDict[str, VersionManifest] = OrderedDict()

    # -- public ------------------------------------------------------------------------------
    async def poll(self) -> Pointer | None:
        """The pointer if it changed since the last poll (one conditional GET), else None.

        SyncError when the pointer is malformed or names another run (WeightsRefused when its
        signature does not check). Only a pointer that verified sets the ETag polled with: an
        answer that fails (truncated on its way, say) may still carry the genuine object's ETag,
        and caching it would skip the genuine pointer (304) until the next publish. A bad
        pointer is therefore read again at each poll (at most `MAX_POINTER_BYTES`), but
        reported once: the same ETag failing again gives None."""
        try:
            got = await read_pointer_etag(
                self.store, self.layout.run, if_none_match=self._etag, trust=self.trust, plane=self.layout.plane
            )
        except NotPublished:
            self._stale = None
            return None  # nothing published yet
        except MalformedPointer as exc:
            self._stale = None
            if exc.etag == self._failed_etag:
                return None  # reported already: nothing new until these bytes change
            self._failed_etag = exc.etag
            if exc.untrusted:
                self._refuse(f"{self.layout.pointer}@{exc.etag}", str(exc))
                raise WeightsRefused(f"refused the pointer: {exc}; {self._keeping()}") from None
            raise SyncError(f"malformed pointer: {exc}; {self._keeping()}") from None
        if got is None:
            return None
        pointer, self._etag = got
        self._failed_etag, self._stale = None, None
        return pointer

    async def sync(self, base: Mapping[str, np.ndarray] | None = None) -> SyncResult | None:
        """Move to the pointer's version if it advanced; None when there was nothing to do.

        Deferred: `base` is the owner's bytes at the held version, only read, and only during
        this call (None before any version is held)."""
        etag = self._etag
        pointer = await self.poll()
        if pointer is None:
            return None
        problem = pointer_regression(self.head, pointer)
        if problem is not None:  # refused once: the next poll is a 304 until the pointer changes
            self._refuse(f"{self.layout.pointer}@{self._etag}", problem)
            raise WeightsRefused(f"refused the pointer: {problem}; {self._keeping()}")
        if self.head is None and self.trust is not None and self.first_pointer_max_age_s is not None:
            stale = stale_first_pointer(pointer, self.now(), self.first_pointer_max_age_s)
            if stale is not None:  # raised once: the next poll is a 304 until the pointer is re-signed
                self._stale = pointer
                raise SyncError(stale)
        if pointer.version == self.version:
            return None
        try:
            try:
                manifest = await self.manifest(pointer.manifest)
            except Untrusted as exc:
                self._refuse(pointer.manifest, str(exc))
                raise WeightsRefused(f"refused the manifest of v{pointer.version}: {exc}; {self._keeping()}") from None
            except (StoreError, ValueError) as exc:  # ManifestError, or a key the store refuses
                raise SyncError(
                    f"pointer names v{pointer.version} but its manifest is unreadable: {exc}; {self._keeping()}"
                ) from None
            if (
                manifest.run != self.layout.run
                or manifest.plane != self.layout.plane
                or manifest.version != pointer.version
                or manifest.state_digest != pointer.state_digest
                or manifest.origin.epoch != pointer.epoch
            ):
                raise SyncError(f"manifest {pointer.manifest} does not match the pointer; {self._keeping()}")
            return await self.sync_to(manifest, base)
        except BaseException:
            self._etag = etag  # retry this pointer on the next poll
            raise

    async def sync_to(self, target: VersionManifest, base: Mapping[str, np.ndarray] | None = None) -> SyncResult:
        """Reach `target`'s version by the cheapest path that verifies; SyncError if none does
        (`base`: as for `sync`)."""
        start = time.perf_counter()
        previous = self.version
        if self.deferred and self.version is not None and base is None:
            raise ValueError("a deferred subscriber holding a version syncs on its owner's bytes (`base`)")
        plans = await self._plans(target)
        errors = []
        refused = False
        for plan in plans:
            try:
                touched, changed, staged = await self._execute(plan, target, base)
            except Untrusted as exc:
                refused = True
                self._refuse(exc.key or f"{plan.name} of v{target.version}", str(exc))
                errors.append(f"{plan.name}: refused: {exc}")
                log.warning("weights v%d via %s failed (%s); trying the next path", target.version, plan.name, exc)
                continue
            except (PatchError, ManifestError, StoreError, SyncError, ValueError) as exc:
                errors.append(f"{plan.name}: {exc}")
                log.warning("weights v%d via %s failed (%s); trying the next path", target.version, plan.name, exc)
                continue
            except Exception as exc:  # malformed input found a path the checks above missed
                errors.append(f"{plan.name}: {type(exc).__name__}: {exc}")
                log.exception("weights v%d via %s failed unexpectedly; trying the next path", target.version, plan.name)
                continue
            if staged is None:
                self.version = target.version
                self.current = target
            return SyncResult(
                target.version, previous, plan.name, plan.cost, touched, time.perf_counter() - start, changed,
                plan.estimate_s, staged,
            )
        where = f"v{previous}" if previous is not None else "no weights"
        raise (WeightsRefused if refused else SyncError)(
            f"could not reach weights v{target.version} from {where}; keeping the current state. "
            + "; ".join(errors or ["no path available"])
        )

    def advance(self, staged: StagedSync) -> None:
        """Stand at the version a deferred sync staged: its owner installed it (writing nothing
        here: the subscriber holds no bytes). ValueError when it was staged on another version
        than the one held."""
        held = self.digest.root() if self.digest is not None else None
        if staged.patch is not None and staged.base != held:
            raise ValueError(f"v{staged.version} was staged on state {staged.base}, the subscriber stands at {held}")
        self.version, self.digest, self.current = staged.version, staged.digest, staged.manifest

    def forget(self) -> None:
        """Stand at no version (the owner's bytes match none any more): the next sync reads an
        anchor. The version left is kept as the `floor`, so no older pointer is taken meanwhile."""
        self.floor = self.head
        self.version = self.digest = self.current = None
        self._etag = None  # the pointer that may not have moved is read again

    @property
    def head_epoch(self) -> int:
        return self.current.origin.epoch if self.current is not None else 0

    def first_pointer_wait(self) -> str | None:
        """While the pointer last polled is one refused as too old for a first join: why
        (`freshness.stale_first_pointer`, its age now); None otherwise."""
        if self._stale is None or self.head is not None or self.first_pointer_max_age_s is None:
            return None
        return stale_first_pointer(self._stale, self.now(), self.first_pointer_max_age_s)

    @property
    def head(self) -> Head | None:
        """Where the subscriber stands on the weight plane (`freshness`): the held version, else
        `floor` (a head remembered from an earlier run), else None."""
        if self.version is not None:
            return Head(self.head_epoch, self.version)
        return self.floor

    def _keeping(self) -> str:
        return f"keeping weights v{self.version}" if self.version is not None else "no weights yet"

    def _refuse(self, what: str, reason: str) -> None:
        """Count and log a refused object, once per object."""
        self.last_refusal = reason[:500]
        if what in self._refused_ids:
            self._refused_ids.move_to_end(what)
            return
        self._refused_ids[what] = None
        while len(self._refused_ids) > MAX_REFUSALS_KEPT:
            self._refused_ids.popitem(last=False)
        self.refused += 1
        log.warning("refused weights object %s: %s", what, reason)

    async def manifest(self, key: str) -> VersionManifest:
        cached = self._manifests.get(key)
        if cached is None:
            start = time.perf_counter()
            cached = await read_manifest(self.store, key, trust=self.trust)
            self.meter.download(0, time.perf_counter() - start)  # a small GET: the request latency
            self._manifests[key] = cached
            while len(self._manifests) > max(1, self.config.manifest_cache):
                self._manifests.popitem(last=False)
        else:
            self._manifests.move_to_end(key)
        return cached

    # -- planning ----------------------------------------------------------------------------
    def _requests(self, ref: PatchRef) -> int:
        """Round trips to fetch a patch: one GET, or waves of concurrent ranged GETs."""
        frames = len(ref.index.frames)
        if frames <= 1 or ref.bytes <= WHOLE_BODY_BYTES:
            return 1
        return math.ceil(frames / max(1, self.config.concurrency))

    def _patch_route(self, name: str, patches: list[PatchRef]) -> Route:
        sizes = {e.name: e.size for p in patches for f in p.index.frames for e in f.entries}
        return Route(
            name=name, requests=sum(self._requests(p) for p in patches), bytes=sum(p.bytes for p in patches),
            changes=sum(p.count for p in patches), hashed=sum(sizes.values()),
        )

    async def _plans(self, target: VersionManifest) -> list[_Plan]:
        """Every path to `target` from the manifests (`route.patch_paths`), ranked (`route.rank`,
        by `SubscriberConfig.route_by`): from the held version, and from the target's anchor."""
        u, v, a = self.version, target.version, target.anchor.version
        root = self.digest.root() if self.digest is not None else None
        lagger = u is not None and root is not None and u < v and (u >= a or v - u <= self.config.max_chain + 1)
        lowest = min(a, u) if lagger and u is not None else a
        links = await self._links(target, lowest) if lowest < v else []
        plans: list[_Plan] = []
        if lagger and u is not None:
            for name, patches in patch_paths(u, root, [link for link in links if link.version > u]):
                route = self._patch_route(name, patches)
                plans.append(_Plan(name, route.bytes, patches, route=route))
        plans += self._anchor_plans(target, [link for link in links if link.version > a])
        speeds = self.meter.speeds
        for plan in plans:
            assert plan.route is not None
            plan.estimate_s = estimate_s(plan.route, speeds)
        by = self.config.route_by
        return sorted(plans, key=lambda p: rank_key(p.route, speeds, by) if p.route else (math.inf, 0, ""))

    async def _links(self, target: VersionManifest, base: int) -> list[Link]:
        """What the manifests of versions base + 1 .. target offer, oldest first; when a manifest
        is missing or unreadable, only the versions above it."""
        links: list[Link] = []
        manifest = target
        try:
            while manifest.version > base:
                links.append(Link(manifest.version, manifest.patch("step"), manifest.patch("catchup")))
                if manifest.parent is None or manifest.parent.version <= base:
                    break
                manifest = await self.manifest(manifest.parent.manifest)
        except (StoreError, ValueError) as exc:  # ManifestError, or a key the store refuses
            if isinstance(exc, Untrusted):
                self._refuse(exc.key or f"chain to v{target.version}", str(exc))
            log.info("manifests below v%d unavailable: %s", manifest.version, exc)
        return links[::-1]

    async def _chain(self, target: VersionManifest, base: int) -> list[PatchRef] | None:
        """Step patches from `base` to the target, oldest first; None if a link is missing."""
        links = await self._links(target, base)
        if not links or links[0].version != base + 1 or any(link.step is None for link in links):
            return None
        return [link.step for link in links if link.step is not None]

    def _anchor_plans(self, target: VersionManifest, links: list[Link]) -> list[_Plan]:
        """The anchor paths: the anchor, then each patch path from it to the target."""
        a = target.anchor
        if a.version == target.version:
            options: list[tuple[str, list[PatchRef]]] = [("anchor", [])]
        else:
            options = [(f"anchor+{name}", patches) for name, patches in patch_paths(a.version, a.state_digest, links)]
            if not options:
                log.warning("v%d: no patches lead from its anchor v%d", target.version, a.version)
        plans = []
        for name, patches in options:
            # One GET for the anchor manifest, one wave of shard GETs, then the patches.
            route = self._patch_route(name, patches)
            cost = target.anchor_bytes + route.bytes
            plans.append(_Plan(name, cost, patches, anchor=a.manifest, route=Route(
                name=name, requests=2 + route.requests, bytes=cost, changes=route.changes,
                hashed=route.hashed, elements=target.elements,
            )))
        return plans

    # -- execution ---------------------------------------------------------------------------
    async def _execute(
        self, plan: _Plan, target: VersionManifest, base: Mapping[str, np.ndarray] | None
    ) -> tuple[tuple[str, ...], Mapping[str, np.ndarray] | None, StagedSync | None]:
        """Run a plan; the subscriber's state changes only if the target digest verifies, and
        nothing is written when deferred (the staged version is returned instead, staged on
        `base`).

        Returns (touched names, changed indices per tensor or None for a whole new state, staged)."""
        if plan.anchor is None:
            assert self.digest is not None
            if self.deferred:
                assert base is not None
                staged = await self._stage(base, self.digest, plan.patches, target)
                assert staged.patch is not None
                return staged.patch.touched, staged.patch.written, staged
            assert self.state is not None
            logs, self.digest = await self._apply_verified(self.state, self.digest, plan.patches, target.state_digest)
            return _touched(logs), ChangedIndices(logs), None
        anchor = await read_anchor_manifest(self.store, plan.anchor, trust=self.trust)
        state, digest = await read_anchor(self.store, anchor, concurrency=self.config.concurrency, meter=self.meter)
        _, digest = await self._apply_verified(state, digest, plan.patches, target.state_digest)
        if self.deferred:
            return tuple(sorted(state)), None, StagedSync(target, digest, state=state)
        self.state, self.digest = state, digest
        return tuple(sorted(state)), None, None

    async def _stage(
        self, state: Mapping[str, np.ndarray], digest: StateDigest, patches: list[PatchRef], target: VersionManifest
    ) -> StagedSync:
        """Fetch and verify `patches` against `state` without writing it (`stage_patches`, on a
        thread, decoding each frame as it arrives); its cost feeds the speed estimates (the
        commit's scatter is tiny)."""
        if patches and patches[0].base_digest not in (None, digest.root()):
            raise SyncError(f"{patches[0].key} needs base {patches[0].base_digest}, we hold {digest.root()}")
        feeds = [FrameFeed() for _ in patches]
        fetches = [asyncio.ensure_future(self._feed(ref, feed)) for ref, feed in zip(patches, feeds, strict=True)]
        job = _thread(
            stage_patches, state, digest, [(ref.index, feed) for ref, feed in zip(patches, feeds, strict=True)],
            target.state_digest, threads=self.config.threads,
        )
        try:
            try:
                patch = await asyncio.shield(job)
            except (PatchError, ValueError):
                await _content_verdict(fetches)
                raise
        finally:
            await _settle(job, feeds, fetches)
        waited = sum(feed.waited_s for feed in feeds)
        self.meter.apply(patch.changes, max(0.0, patch.apply_s - waited))
        self.meter.hash(patch.hashed, patch.hash_s)
        return StagedSync(target, patch.digest, digest.root(), patch=patch)

    async def _apply_verified(
        self,
        state: dict[str, np.ndarray],
        digest: StateDigest,
        patches: list[PatchRef],
        expected: str,
    ) -> tuple[list[UndoLog], StateDigest]:
        """Apply patches in order and check the digest; on any failure restore the state.

        Every patch is fetched at once, and each frame is decoded and written as it arrives (the
        rest download meanwhile); a patch counts as applied only once its body checked against its
        signed sha256 (else it is rolled back). The last patch is applied while the tensors it
        finishes are re-hashed (`_apply_hashing`)."""
        if patches and patches[0].base_digest is not None and patches[0].base_digest != digest.root():
            raise SyncError(f"{patches[0].key} needs base {patches[0].base_digest}, we hold {digest.root()}")
        logs: list[UndoLog] = []
        touched: set[str] = set()
        new_digest = digest
        feeds = [FrameFeed() for _ in patches]
        fetches = [asyncio.ensure_future(self._feed(ref, feed)) for ref, feed in zip(patches, feeds, strict=True)]
        threads = self.config.threads
        job: asyncio.Future | None = None
        try:
            for i, (ref, feed, fetch) in enumerate(zip(patches, feeds, fetches, strict=True)):
                start = time.perf_counter()
                if i < len(patches) - 1:
                    job = _thread(apply_patch, state, ref.index, feed, threads=threads)
                else:
                    job = _thread(_apply_hashing, state, ref.index, feed, digest, touched, threads)
                try:
                    done = await asyncio.shield(job)
                except (PatchError, ValueError):
                    await _content_verdict([fetch])
                    raise
                job = None
                if i < len(patches) - 1:
                    undo = done
                    self.meter.apply(ref.count, max(0.0, time.perf_counter() - start - feed.waited_s))
                else:
                    undo, new_digest, spent = done
                    self.meter.apply(ref.count, max(0.0, spent[0] - feed.waited_s))
                    self.meter.hash(spent[1], spent[2])
                logs.append(undo)
                touched.update(undo.touched)
            if new_digest.root() != expected:
                raise SyncError(
                    f"state digest {new_digest.root()} != {expected} after applying {len(patches)} patch(es)"
                )
        except BaseException:
            await _settle(job, feeds, fetches)  # the thread writing the state has stopped
            for undo in reversed(logs):
                undo.rollback(state)
            raise
        finally:
            await _settle(None, feeds, fetches)
        return logs, new_digest

    async def _feed(self, ref: PatchRef, feed: FrameFeed) -> None:
        """Download a patch's frames into `feed` as they arrive, then close it with the verdict."""
        try:
            await self._fetch_frames(ref, feed.put)
        except Exception as exc:
            feed.close(exc)
            raise
        except BaseException:
            feed.close(SyncError(f"{ref.key}: download abandoned"))
            raise
        feed.close()

    async def _fetch_frames(
        self, ref: PatchRef, on_frame: Callable[[int, bytes], None] | None = None
    ) -> Mapping[int, bytes]:
        """A patch's frames by number, each also passed to `on_frame` as it arrives: one GET of
        the whole body (checked, then its frames passed on) or ranged GETs (each frame passed on
        as it lands). ContentMismatch when the body is not the one its manifest signs (checked
        once every frame is in)."""
        frames = ref.index.frames
        start = time.perf_counter()
        if len(frames) <= 1 or ref.bytes <= WHOLE_BODY_BYTES:
            body = await self.store.get_bytes(ref.key)
            if len(body) != ref.bytes:
                if ref.sha256 is not None:
                    raise ContentMismatch(f"{ref.key}: {len(body)} bytes, its manifest signs {ref.bytes}", ref.key)
                raise SyncError(f"{ref.key}: {len(body)} bytes, manifest says {ref.bytes}")
            await asyncio.to_thread(check_content, body, ref.sha256, ref.key)
            self.meter.download(len(body), time.perf_counter() - start)
            whole = {i: body[f.offset : f.offset + f.length] for i, f in enumerate(frames)}
            for i, data in whole.items():
                if on_frame is not None:
                    on_frame(i, data)
            return whole
        limit = asyncio.Semaphore(self.config.concurrency)

        async def fetch(i: int) -> tuple[int, bytes]:
            async with limit:
                got = await self.store.get(ref.key, offset=frames[i].offset, length=frames[i].length)
            assert got is not None
            if on_frame is not None:
                on_frame(i, got.data)
            return i, got.data

        got = dict(await asyncio.gather(*(fetch(i) for i in range(len(frames)))))
        if ref.sha256 is not None:
            await asyncio.to_thread(_check_frames, ref, got)
        self.meter.download(ref.bytes, time.perf_counter() - start)
        return got


def _thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future:
    """`fn` running on a thread, as a future that outlives a cancelled awaiter (await it
    through `asyncio.shield`, and `_settle` it before touching what it writes)."""
    return asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))


async def _settle(job: asyncio.Future | None, feeds: list[FrameFeed], fetches: Sequence[asyncio.Future]) -> None:
    """Stop the downloads, end every feed (a thread waiting on one wakes up and fails) and wait
    until `job`'s thread returned; nothing raised."""
    for fetch in fetches:
        fetch.cancel()
    for feed in feeds:
        feed.close(SyncError("sync abandoned"))  # ignored by a feed already ended
    for outcome in await asyncio.gather(*fetches, *([job] if job is not None else []), return_exceptions=True):
        if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
            log.debug("an unused patch fetch or apply failed: %s", outcome)


async def _content_verdict(fetches: Sequence[asyncio.Future]) -> None:
    """Raise the ContentMismatch of a download, if one had it, once they are all done: a frame
    that fails its digest in a signed patch is a refused object, not just a damaged one."""
    for outcome in await asyncio.gather(*fetches, return_exceptions=True):
        if isinstance(outcome, ContentMismatch):
            raise outcome


def _check_frames(ref: PatchRef, frames: Mapping[int, bytes]) -> None:
    """The frames of a patch fetched by ranges must tile its body and hash to its sha256."""
    h, offset = hashlib.sha256(), 0
    for i, info in enumerate(ref.index.frames):
        data = frames[i]
        if info.offset != offset or len(data) != info.length:
            raise ContentMismatch(f"{ref.key}: frame {i} is not where or as long as its index says", ref.key)
        h.update(data)
        offset += len(data)
    if offset != ref.bytes or h.hexdigest() != ref.sha256:
        raise ContentMismatch(f"{ref.key}: content does not match the sha256 digest its manifest signs", ref.key)


def _apply_hashing(
    state: dict[str, np.ndarray],
    index: PatchIndex,
    frames: Frames,
    digest: StateDigest,
    earlier: set[str],
    threads: int | None,
) -> tuple[UndoLog, StateDigest, tuple[float, int, float]]:
    """Apply a path's last patch; return its undo log, the new state digest and what it took
    (apply seconds, elements hashed, hashing seconds summed over threads).

    Each tensor is hashed on a thread pool (xxh3 releases the GIL) as soon as it is final: the
    tensors only earlier patches touched at once, the others when this patch's last entry for
    them is written, so hashing overlaps the rest of the apply."""
    futures: dict[str, Future[tuple[bytes, float]]] = {}

    def hashed(name: str) -> tuple[bytes, float]:
        start = time.perf_counter()
        return tensor_digest(name, state[name], digest.dtype), time.perf_counter() - start

    with ThreadPoolExecutor(thread_count(threads), thread_name_prefix="stoa-hash") as pool:

        def submit(name: str) -> None:
            futures[name] = pool.submit(hashed, name)

        for name in sorted(earlier - set(index.touched)):
            submit(name)
        start = time.perf_counter()
        undo = apply_patch(state, index, frames, on_done=submit, threads=threads)
        apply_s = time.perf_counter() - start
        done = {name: future.result() for name, future in futures.items()}
    spent = (apply_s, sum(state[name].size for name in done), sum(s for _, s in done.values()))
    return undo, digest.with_digests({name: d for name, (d, _) in done.items()}), spent


def _touched(logs: list[UndoLog]) -> tuple[str, ...]:
    return tuple(sorted({name for undo in logs for name in undo.touched}))
