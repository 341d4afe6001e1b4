"""The worker side of the weight plane: follow the pointer and stay bit-identical to it.

`Subscriber.sync()` costs one conditional GET while nothing changed. When the pointer moves it
reads the new version's manifest and ranks the paths that reach it by estimated time
(`route.py`: round trips, bytes at the measured download rate, and the CPU to apply each change
or to load an anchor, all measured as the subscriber goes):

- `step`    — the single patch from the previous version (we are one behind);
- `catchup` — the merged patch valid on our version (any state since the anchor, or exactly our
  state when it is base-relative);
- `chain`   — the step patches of every version in between (walked only when it may win);
- `anchor`  — the full anchor plus its catch-up patch or chain (cold start, or far behind).

It tries them fastest first. Patches of a path are fetched concurrently (frames with ranged GETs),
verified against their digests and applied in place, in order, with an undo log; the final state
digest must equal the manifest's. A patch carrying a base digest (every step patch, and every
base-relative patch) is only tried on exactly that base. Any failure (bad digest, missing object,
base mismatch) rolls the state back exactly, is logged, and the next path is tried. The state is
never left at an unverified version. The changed indices of a sync (`SyncResult.changed`) are
computed lazily, per tensor, in time proportional to the patches.

Nothing malformed in the bucket escapes as anything but `SyncError` (the state stays at its last
verified version): a pointer that does not parse (or names another run) is skipped until its ETag
changes, so a reader reports it once and recovers at the first good pointer; a pointer whose
manifest is unreadable is retried at the next poll (the manifest may be on its way).

With a `RunTrust` (a signed run), the pointer, every version and anchor manifest must be signed by
the run key of its version and every patch object and anchor file must match the sha256 its
signed manifest carries, checked on download before use. A refused object is counted once
(`refused`), logged once, and when no path is left the sync raises `WeightsRefused` (a
SyncError): the state stays at its last verified version.

What a sync returns and raises, and what a deferred sync stages, are in `sync_result.py`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_trust import ContentMismatch, RunTrust, Untrusted, check_content
from slime_stoa.protocol.store import Store, StoreError

from .anchor import read_anchor
from .apply import ChangedIndices, UndoLog, apply_patch
from .codec import PatchError
from .digest import StateDigest, tensor_digest
from .frames import PatchIndex
from .history import MalformedPointer, NotPublished, read_anchor_manifest, read_manifest, read_pointer_etag
from .manifests import ManifestError, PatchRef, Pointer, VersionManifest
from .route import Route, SpeedMeter, Speeds, chain_guess, estimate_s, rank
from .staged import StagedPatch, stage_patches
from .sync_result import Committed, StagedSync, SyncError, SyncResult, WeightsRefused

log = logging.getLogger("stoa.pulse")

WHOLE_BODY_BYTES = 8 << 20  # smaller patches are fetched with one GET instead of one per frame
MAX_REFUSALS_KEPT = 4096  # distinct refused objects remembered (so each is counted and logged once)


@dataclass(frozen=True, kw_only=True)
class SubscriberConfig:
    """How a subscriber fetches (one per worker)."""

    concurrency: int = 8  # ranged GETs in flight
    max_chain: int = 64  # longest chain of step patches worth walking manifests for
    speeds: Speeds = field(default_factory=Speeds)  # rate guesses for path choice until measured
    manifest_cache: int = 256  # version manifests kept in memory (most recently used)
    hash_threads: int | None = None  # threads re-hashing patched tensors (None: one per CPU)


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

    `deferred`: a sync writes nothing and returns the verified version to `commit` (module doc)."""

    def __init__(
        self,
        store: Store,
        run: str,
        config: SubscriberConfig = SubscriberConfig(),
        *,
        trust: RunTrust | None = None,
        deferred: bool = False,
    ):
        self.store = store
        self.layout = RunLayout(run)
        self.config = config
        if trust is not None and trust.run != run:
            raise ValueError(f"the trust is run {trust.run!r}'s, not {run!r}'s")
        self.trust = trust  # None: an unsigned run, nothing is checked against run keys
        self.refused = 0  # distinct objects refused (signature or content hash)
        self.last_refusal = ""  # why the latest was
        self._refused_ids: OrderedDict[str, None] = OrderedDict()
        self.deferred = deferred
        self.state: dict[str, np.ndarray] | None = None
        self.version: int | None = None
        self.digest: StateDigest | None = None
        self.current: VersionManifest | None = None  # the manifest of `version`
        self.meter = SpeedMeter(config.speeds)  # measured rates, for path choice
        self._etag: str | None = None
        self._manifests: OrderedDict[str, VersionManifest] = OrderedDict()

    # -- public ------------------------------------------------------------------------------
    async def poll(self) -> Pointer | None:
        """The pointer if it changed since the last poll (one conditional GET), else None.

        SyncError when the pointer is malformed or names another run; that object is then
        skipped (the next poll is a 304 until the pointer changes)."""
        try:
            got = await read_pointer_etag(self.store, self.layout.run, if_none_match=self._etag, trust=self.trust)
        except NotPublished:
            return None  # nothing published yet
        except MalformedPointer as exc:
            self._etag = exc.etag  # the same bytes will not parse any better: wait for new ones
            if exc.untrusted:
                self._refuse(f"{self.layout.pointer}@{exc.etag}", str(exc))
                raise WeightsRefused(f"refused the pointer: {exc}; {self._keeping()}") from None
            raise SyncError(f"malformed pointer: {exc}; {self._keeping()}") from None
        if got is None:
            return None
        pointer, self._etag = got
        return pointer

    async def sync(self) -> SyncResult | None:
        """Move to the pointer's version if it advanced; None when there was nothing to do."""
        etag = self._etag
        pointer = await self.poll()
        if pointer is None:
            return None
        if self.version is not None and pointer.version <= self.version:
            if pointer.version < self.version:
                log.warning("pointer went back from v%d to v%d: ignoring it", self.version, pointer.version)
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
                or manifest.version != pointer.version
                or manifest.state_digest != pointer.state_digest
            ):
                raise SyncError(f"manifest {pointer.manifest} does not match the pointer; {self._keeping()}")
            return await self.sync_to(manifest)
        except BaseException:
            self._etag = etag  # retry this pointer on the next poll
            raise

    async def sync_to(self, target: VersionManifest) -> SyncResult:
        """Reach `target`'s version by the cheapest path that verifies; SyncError if none does."""
        start = time.perf_counter()
        previous = self.version
        plans = await self._plans(target)
        errors = []
        refused = False
        for plan in plans:
            try:
                touched, changed, staged = await self._execute(plan, target)
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

    def commit(self, staged: StagedSync) -> Committed:
        """Hold the version a deferred sync staged: write its patch into the held state in place,
        or take its new state. Call it where nothing reads the state (a worker: at a safe point).
        ValueError when the held state is no longer the one the patch was staged on; on any
        error nothing changed. A new state replaces the held one for good; a patch's commit can
        be undone with `revert`."""
        held = self.digest.root() if self.digest is not None else None
        undo = None
        if staged.patch is not None:
            if self.state is None or staged.base != held:
                raise ValueError(f"v{staged.version} was staged on state {staged.base}, the subscriber holds {held}")
            undo = staged.patch.commit(self.state)
        done = Committed(staged, undo, self.version, self.digest, self.current)
        if staged.state is not None:
            self.state = staged.state
        self.version, self.digest, self.current = staged.version, staged.digest, staged.manifest
        return done

    def revert(self, done: Committed) -> None:
        """Undo the latest `commit` of a patch: the held bits, version and digest as before it."""
        if done.undo is None or self.digest is not done.staged.digest or self.state is None:
            raise ValueError(f"cannot revert v{done.staged.version}: not the latest commit of a patch")
        done.undo.rollback(self.state)
        self.version, self.digest, self.current = done.version, done.digest, done.current

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

    def _applies(self, ref: PatchRef | None, version: int, digest: str | None) -> bool:
        """Whether `ref` may be applied to our state (its base range, and its base digest if any)."""
        return ref is not None and ref.covers(version) and (ref.base_digest is None or ref.base_digest == digest)

    async def _plans(self, target: VersionManifest) -> list[_Plan]:
        plans: list[_Plan] = []
        u, v = self.version, target.version
        speeds = self.meter.speeds
        anchor = await self._anchor_plan(target)
        if anchor is not None:
            plans.append(anchor)
        if u is not None and self.digest is not None:
            root = self.digest.root()
            step, catchup = target.patch("step"), target.patch("catchup")
            for kind, ref in (("step", step), ("catchup", catchup)):
                if ref is not None and self._applies(ref, u, root):
                    plans.append(_Plan(kind, ref.bytes, [ref], route=self._patch_route(kind, [ref])))
            behind = v - u
            if step is not None and not self._applies(step, u, root) and 2 <= behind <= self.config.max_chain + 1:
                best = min((estimate_s(p.route, speeds) for p in plans if p.route), default=math.inf)
                # Walking costs a manifest GET per version: only when a chain of steps like this
                # one may be faster than the best alternative (the guess may be off either way).
                guess = chain_guess(behind, self._patch_route("step", [step]))
                if estimate_s(guess, speeds) < 2 * best:
                    chain = await self._chain(target, u)
                    if chain and chain[0].base_digest in (None, root):
                        route = self._patch_route("chain", chain)
                        plans.append(_Plan("chain", route.bytes, chain, route=route))
        by_name = {p.name: p for p in plans}
        ranked = [by_name[r.name] for r in rank((p.route for p in plans if p.route), speeds)]
        for plan in ranked:
            assert plan.route is not None
            plan.estimate_s = estimate_s(plan.route, speeds)
        return ranked

    async def _chain(self, target: VersionManifest, base: int) -> list[PatchRef] | None:
        """Step patches from `base` to the target, oldest first; None if a link is missing."""
        chain: list[PatchRef] = []
        manifest = target
        try:
            while manifest.version > base:
                step = manifest.patch("step")
                if step is None or manifest.parent is None:
                    return None
                chain.append(step)
                if manifest.parent.version == base:
                    break
                manifest = await self.manifest(manifest.parent.manifest)
        except (StoreError, ValueError) as exc:  # ManifestError, or a key the store refuses
            if isinstance(exc, Untrusted):
                self._refuse(exc.key or f"chain to v{target.version}", str(exc))
            log.info("chain to v%d unavailable: %s", target.version, exc)
            return None
        return chain[::-1]

    async def _anchor_plan(self, target: VersionManifest) -> _Plan | None:
        """The anchor path (None when no patches lead from the anchor to the target)."""
        a = target.anchor
        plan = _Plan("anchor", target.anchor_bytes, anchor=a.manifest)
        if a.version != target.version:
            catchup, step = target.patch("catchup"), target.patch("step")
            if catchup is not None and self._applies(catchup, a.version, a.state_digest):
                plan.name, plan.patches = "anchor+catchup", [catchup]
            elif target.version - a.version == 1 and step is not None:
                plan.name, plan.patches = "anchor+step", [step]
            else:
                plan.name, plan.patches = "anchor+chain", await self._chain(target, a.version) or []
                if not plan.patches:
                    log.warning("v%d: no patches lead from its anchor v%d", target.version, a.version)
                    return None
            plan.cost += sum(p.bytes for p in plan.patches)
        # One GET for the anchor manifest, one wave of shard GETs, then the patches.
        patches = self._patch_route(plan.name, plan.patches)
        plan.route = Route(
            name=plan.name, requests=2 + patches.requests, bytes=plan.cost, changes=patches.changes,
            hashed=patches.hashed, elements=target.elements,
        )
        return plan

    # -- execution ---------------------------------------------------------------------------
    async def _execute(
        self, plan: _Plan, target: VersionManifest
    ) -> tuple[tuple[str, ...], Mapping[str, np.ndarray] | None, StagedSync | None]:
        """Run a plan; the subscriber's state changes only if the target digest verifies, and
        not at all when deferred (the staged version is returned instead).

        Returns (touched names, changed indices per tensor or None for a whole new state, staged)."""
        if plan.anchor is None:
            assert self.state is not None and self.digest is not None
            if self.deferred:
                staged = await self._stage(self.state, self.digest, plan.patches, target)
                assert staged.patch is not None
                return staged.patch.touched, _written(staged.patch), staged
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
        self, state: dict[str, np.ndarray], digest: StateDigest, patches: list[PatchRef], target: VersionManifest
    ) -> StagedSync:
        """Fetch and verify `patches` against `state` without writing it (`stage_patches`, on a
        thread); its cost feeds the speed estimates (the commit's scatter is tiny)."""
        if patches and patches[0].base_digest not in (None, digest.root()):
            raise SyncError(f"{patches[0].key} needs base {patches[0].base_digest}, we hold {digest.root()}")
        fetches = [asyncio.ensure_future(self._fetch_frames(ref)) for ref in patches]
        try:
            frames = await asyncio.gather(*fetches)
        finally:
            for fetch in fetches:
                fetch.cancel()  # the others, when one failed
        patch = await asyncio.to_thread(
            stage_patches, state, digest, [(ref.index, f) for ref, f in zip(patches, frames, strict=True)],
            target.state_digest,
        )
        self.meter.apply(patch.changes, patch.apply_s)
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

        Every patch is fetched at once (the next downloads while one applies); the last one is
        applied while the tensors it finishes are re-hashed (`_apply_hashing`)."""
        if patches and patches[0].base_digest is not None and patches[0].base_digest != digest.root():
            raise SyncError(f"{patches[0].key} needs base {patches[0].base_digest}, we hold {digest.root()}")
        logs: list[UndoLog] = []
        touched: set[str] = set()
        new_digest = digest
        fetches = [asyncio.ensure_future(self._fetch_frames(ref)) for ref in patches]
        threads = self.config.hash_threads or os.cpu_count() or 1
        try:
            for i, (ref, fetch) in enumerate(zip(patches, fetches, strict=True)):
                frames = await fetch
                start = time.perf_counter()
                if i < len(patches) - 1:
                    undo = await asyncio.to_thread(apply_patch, state, ref.index, frames)
                    self.meter.apply(ref.count, time.perf_counter() - start)
                else:
                    undo, new_digest, spent = await asyncio.to_thread(
                        _apply_hashing, state, ref.index, frames, digest, touched, threads
                    )
                    self.meter.apply(ref.count, spent[0])
                    self.meter.hash(spent[1], spent[2])
                logs.append(undo)
                touched.update(undo.touched)
            if new_digest.root() != expected:
                raise SyncError(
                    f"state digest {new_digest.root()} != {expected} after applying {len(patches)} patch(es)"
                )
        except BaseException:
            for undo in reversed(logs):
                undo.rollback(state)
            raise
        finally:
            for fetch in fetches:
                fetch.cancel()
            for outcome in await asyncio.gather(*fetches, return_exceptions=True):
                if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                    log.debug("an unused patch fetch failed: %s", outcome)
        return logs, new_digest

    async def _fetch_frames(self, ref: PatchRef) -> Mapping[int, bytes]:
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
            return {i: body[f.offset : f.offset + f.length] for i, f in enumerate(frames)}
        limit = asyncio.Semaphore(self.config.concurrency)

        async def fetch(i: int) -> tuple[int, bytes]:
            async with limit:
                got = await self.store.get(ref.key, offset=frames[i].offset, length=frames[i].length)
            assert got is not None
            return i, got.data

        got = dict(await asyncio.gather(*(fetch(i) for i in range(len(frames)))))
        if ref.sha256 is not None:
            await asyncio.to_thread(_check_frames, ref, got)
        self.meter.download(ref.bytes, time.perf_counter() - start)
        return got


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
    frames: Mapping[int, bytes],
    digest: StateDigest,
    earlier: set[str],
    threads: int,
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

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="stoa-hash") as pool:

        def submit(name: str) -> None:
            futures[name] = pool.submit(hashed, name)

        for name in sorted(earlier - set(index.touched)):
            submit(name)
        start = time.perf_counter()
        undo = apply_patch(state, index, frames, on_done=submit)
        apply_s = time.perf_counter() - start
        done = {name: future.result() for name, future in futures.items()}
    spent = (apply_s, sum(state[name].size for name in done), sum(s for _, s in done.values()))
    return undo, digest.with_digests({name: d for name, (d, _) in done.items()}), spent


def _touched(logs: list[UndoLog]) -> tuple[str, ...]:
    return tuple(sorted({name for undo in logs for name in undo.touched}))


def _written(patch: StagedPatch) -> Mapping[str, np.ndarray]:
    """A staged patch's sorted unique written indices per tensor, read-only."""
    out = {}
    for w in patch.writes:
        view = w.indices.view()
        view.flags.writeable = False
        out[w.name] = view
    return MappingProxyType(out)
