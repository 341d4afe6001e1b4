"""The worker side of the weight plane: follow the pointer and stay bit-identical to it.

`Subscriber.sync()` costs one conditional GET while nothing changed. When the pointer moves it
reads the new version's manifest and ranks the paths that reach it by bytes to download:

- `step`    — the single patch from the previous version (we are one behind);
- `catchup` — the merged patch valid on any state since the anchor (we are a few behind);
- `chain`   — the step patches of every version in between (no catch-up patch covers us);
- `anchor`  — the full anchor plus its catch-up patch or chain (cold start, or far behind).

It tries them cheapest first. Frames come in with concurrent ranged GETs, are verified against
their digests and applied in place with an undo log; the final state digest must equal the
manifest's. Any failure (bad digest, missing object, base mismatch) rolls the state back exactly,
is logged, and the next path is tried. The state is never left at an unverified version.

Nothing malformed in the bucket escapes as anything but `SyncError` (the state stays at its last
verified version): a pointer that does not parse (or names another run) is skipped until its ETag
changes, so a reader reports it once and recovers at the first good pointer; a pointer whose
manifest is unreadable is retried at the next poll (the manifest may be on its way).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import Store, StoreError

from .anchor import read_anchor
from .apply import UndoLog, apply_patch
from .codec import PatchError
from .digest import StateDigest
from .history import MalformedPointer, NotPublished, read_anchor_manifest, read_manifest, read_pointer_etag
from .manifests import ManifestError, PatchRef, Pointer, VersionManifest

log = logging.getLogger("stoa.pulse")

WHOLE_BODY_BYTES = 8 << 20  # smaller patches are fetched with one GET instead of one per frame


class SyncError(Exception):
    """No path reached the target version; the state was left as it was."""


@dataclass(frozen=True, kw_only=True)
class SubscriberConfig:
    """How a subscriber fetches (one per worker)."""

    concurrency: int = 8  # ranged GETs in flight
    max_chain: int = 64  # longest chain of step patches worth walking manifests for


@dataclass(frozen=True, slots=True)
class SyncResult:
    version: int
    previous: int | None
    path: str  # "step", "catchup", "chain" or "anchor" (+ how the anchor was advanced)
    bytes: int  # downloaded
    touched: tuple[str, ...]  # tensors whose bits may have changed
    seconds: float
    # Flat indices written per tensor (sorted, unique); None when the whole state was replaced
    # (anchor paths). Lets a receiver refresh only what changed, e.g. re-quantize touched groups.
    changed: Mapping[str, np.ndarray] | None = None


@dataclass(slots=True)
class _Plan:
    name: str
    cost: int
    patches: list[PatchRef] = field(default_factory=list)
    anchor: str | None = None  # anchor manifest key


class Subscriber:
    """Holds a bf16 state (`dict[str, np.ndarray]` of uint16) at a verified version."""

    def __init__(self, store: Store, run: str, config: SubscriberConfig = SubscriberConfig()):
        self.store = store
        self.layout = RunLayout(run)
        self.config = config
        self.state: dict[str, np.ndarray] | None = None
        self.version: int | None = None
        self.digest: StateDigest | None = None
        self.current: VersionManifest | None = None  # the manifest of `version`
        self._etag: str | None = None
        self._manifests: dict[str, VersionManifest] = {}

    # -- public ------------------------------------------------------------------------------
    async def poll(self) -> Pointer | None:
        """The pointer if it changed since the last poll (one conditional GET), else None.

        SyncError when the pointer is malformed or names another run; that object is then
        skipped (the next poll is a 304 until the pointer changes)."""
        try:
            got = await read_pointer_etag(self.store, self.layout.run, if_none_match=self._etag)
        except NotPublished:
            return None  # nothing published yet
        except MalformedPointer as exc:
            self._etag = exc.etag  # the same bytes will not parse any better: wait for new ones
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
        for plan in plans:
            try:
                touched, changed = await self._execute(plan, target)
            except (PatchError, ManifestError, StoreError, SyncError, ValueError) as exc:
                errors.append(f"{plan.name}: {exc}")
                log.warning("weights v%d via %s failed (%s); trying the next path", target.version, plan.name, exc)
                continue
            except Exception as exc:  # malformed input found a path the checks above missed
                errors.append(f"{plan.name}: {type(exc).__name__}: {exc}")
                log.exception("weights v%d via %s failed unexpectedly; trying the next path", target.version, plan.name)
                continue
            self.version = target.version
            self.current = target
            return SyncResult(
                target.version, previous, plan.name, plan.cost, touched, time.perf_counter() - start, changed
            )
        where = f"v{previous}" if previous is not None else "no weights"
        raise SyncError(
            f"could not reach weights v{target.version} from {where}; keeping the current state. "
            + "; ".join(errors or ["no path available"])
        )

    def _keeping(self) -> str:
        return f"keeping weights v{self.version}" if self.version is not None else "no weights yet"

    async def manifest(self, key: str) -> VersionManifest:
        cached = self._manifests.get(key)
        if cached is None:
            cached = await read_manifest(self.store, key)
            self._manifests[key] = cached
        return cached

    # -- planning ----------------------------------------------------------------------------
    async def _plans(self, target: VersionManifest) -> list[_Plan]:
        plans: list[_Plan] = []
        u, v = self.version, target.version
        if u is not None and self.digest is not None:
            step, catchup = target.patch("step"), target.patch("catchup")
            if step and step.covers(u) and step.base_digest == self.digest.root():
                plans.append(_Plan("step", step.bytes, [step]))
            if catchup and catchup.covers(u):
                plans.append(_Plan("catchup", catchup.bytes, [catchup]))
            if not plans and 0 <= v - u - 1 <= self.config.max_chain:
                chain = await self._chain(target, u)
                if chain:
                    plans.append(_Plan("chain", sum(p.bytes for p in chain), chain))
        plans.append(await self._anchor_plan(target))
        return sorted(plans, key=lambda p: p.cost)

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
            log.info("chain to v%d unavailable: %s", target.version, exc)
            return None
        return chain[::-1]

    async def _anchor_plan(self, target: VersionManifest) -> _Plan:
        a = target.anchor
        plan = _Plan("anchor", target.anchor_bytes, anchor=a.manifest)
        if a.version == target.version:
            return plan
        catchup = target.patch("catchup")
        if catchup and catchup.covers(a.version):
            plan.name, plan.patches = "anchor+catchup", [catchup]
        elif target.version - a.version == 1 and (step := target.patch("step")):
            plan.name, plan.patches = "anchor+step", [step]
        else:
            plan.name, plan.patches = "anchor+chain", await self._chain(target, a.version) or []
            if not plan.patches:
                raise SyncError(f"v{target.version}: no patches lead from its anchor v{a.version}")
        plan.cost += sum(p.bytes for p in plan.patches)
        return plan

    # -- execution ---------------------------------------------------------------------------
    async def _execute(self, plan: _Plan, target: VersionManifest):
        """Run a plan; the subscriber's state changes only if the target digest verifies.

        Returns (touched names, changed indices per tensor or None for a whole new state)."""
        if plan.anchor is None:
            assert self.state is not None and self.digest is not None
            logs, self.digest = await self._apply_verified(self.state, self.digest, plan.patches, target.state_digest)
            return _touched(logs), _changed(logs)
        anchor = await read_anchor_manifest(self.store, plan.anchor)
        state, digest = await read_anchor(self.store, anchor, concurrency=self.config.concurrency)
        _, digest = await self._apply_verified(state, digest, plan.patches, target.state_digest)
        self.state, self.digest = state, digest
        return tuple(sorted(state)), None

    async def _apply_verified(
        self,
        state: dict[str, np.ndarray],
        digest: StateDigest,
        patches: list[PatchRef],
        expected: str,
    ) -> tuple[list[UndoLog], StateDigest]:
        """Apply patches in order and check the digest; on any failure restore the state."""
        if patches and patches[0].base_digest is not None and patches[0].base_digest != digest.root():
            raise SyncError(f"{patches[0].key} needs base {patches[0].base_digest}, we hold {digest.root()}")
        logs: list[UndoLog] = []
        touched: set[str] = set()
        try:
            for ref in patches:
                frames = await self._fetch_frames(ref)
                undo = await asyncio.to_thread(apply_patch, state, ref.index, frames)
                logs.append(undo)
                touched.update(undo.touched)
            new_digest = await asyncio.to_thread(digest.update, state, touched)
            if new_digest.root() != expected:
                raise SyncError(
                    f"state digest {new_digest.root()} != {expected} after applying {len(patches)} patch(es)"
                )
        except BaseException:
            for undo in reversed(logs):
                undo.rollback(state)
            raise
        return logs, new_digest

    async def _fetch_frames(self, ref: PatchRef) -> Mapping[int, bytes]:
        frames = ref.index.frames
        if len(frames) <= 1 or ref.bytes <= WHOLE_BODY_BYTES:
            body = await self.store.get_bytes(ref.key)
            if len(body) != ref.bytes:
                raise SyncError(f"{ref.key}: {len(body)} bytes, manifest says {ref.bytes}")
            return {i: body[f.offset : f.offset + f.length] for i, f in enumerate(frames)}
        limit = asyncio.Semaphore(self.config.concurrency)

        async def fetch(i: int) -> tuple[int, bytes]:
            async with limit:
                got = await self.store.get(ref.key, offset=frames[i].offset, length=frames[i].length)
            assert got is not None
            return i, got.data

        return dict(await asyncio.gather(*(fetch(i) for i in range(len(frames)))))


def _touched(logs: list[UndoLog]) -> tuple[str, ...]:
    return tuple(sorted({name for undo in logs for name in undo.touched}))


def _changed(logs: list[UndoLog]) -> dict[str, np.ndarray]:
    parts: dict[str, list[np.ndarray]] = {}
    for undo in logs:
        for entry in undo.entries:
            parts.setdefault(entry.name, []).append(entry.indices)
    return {name: np.unique(np.concatenate(p)) for name, p in parts.items()}
