"""One chain of weight versions (the bf16 weights, or one quantized plane) as its publisher
writes it.

`publish(state)` diffs the state against the last *published* baseline (`step_diff`) and writes,
in order: the patch objects (`version_patches`), a full anchor when the policy asks for one
(`anchor_policy`), the version manifest, and finally moves the pointer by compare-and-swap
(`commit`). Every object is written with put-if-absent under keys that carry a fresh attempt id,
so a crashed or losing publisher never blocks a version; only the pointer's CAS decides. The
baseline advances only after the pointer moved. A second publisher racing on the same chain
loses the CAS and gets a `PublishConflict`; its objects are unreferenced and nothing it wrote is
visible to readers. A pointer write without an answer is settled on the next publish (`unsure`).

With `PublisherConfig.keep_dir` the committer keeps each pointer and manifest it commits and puts
them back when a bucket writer deletes or overwrites them (`commit`).

`open` resumes from the highest signed version (`commit.Committer.highest_signed`), syncing the
baseline from the bucket and rebuilding the catch-up union (`catchup_union`); each version
records its lineage (`restore`); after an anchor, old objects go (`retention`).

A plane's chain publishes each version as the bf16 version it quantizes (`source`): the next
version, or a new chain from an anchor when it is further behind. `plane_siblings` drives
the plane chains beside the bf16 one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

from slime_stoa.protocol.hf.folders import hf_config_files
from slime_stoa.protocol.kept import Copies
from slime_stoa.protocol.layout import QuantPlane, RunLayout
from slime_stoa.protocol.run_trust import RunTrust, Untrusted
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import PreconditionFailed, Store, StoreError

from .anchor import write_anchor
from .anchor_policy import anchor_due
from .catchup_union import merge_sources, union_sources
from .codec import Delta, check_bits, diff
from .commit import Committer
from .digest import StateDigest
from .manifests import Origin, Pointer, Ref, VersionManifest
from .publish_config import PublisherConfig
from .publish_types import PublishConflict, PublishError, PublishResult, UntrustedState
from .restore import log_restore, next_origin, version_ref
from .retention import retain
from .step_diff import DiffStep, SparseStep, StaleBase, TensorsOnDemand, diff_step, sparse_digest
from .subscriber import Subscriber, WeightsRefused
from .sync_result import SyncError
from .unsure import UnsureCommit, settled_result
from .version_patches import VersionPatches, encode_patches

log = logging.getLogger("stoa.pulse")


def new_attempt() -> str:
    return secrets.token_hex(4)


class ChainPublisher:
    def __init__(
        self, store: Store, run: str, config: PublisherConfig, *, key: SigningKey | None = None,
        plane: QuantPlane | None = None, diff_step: DiffStep = diff_step,
    ):
        """The publisher of run `run`'s bf16 weights, or with `plane` of that quantized plane
        (whose versions name their bf16 `source`); `diff_step` computes each version's delta
        and digest (`step_diff`)."""
        self.store = store
        self.layout = RunLayout(run, plane)
        self.config = config
        self.key = key  # the run key: signs everything written (None: an unsigned run)
        self.diff_step = diff_step
        self.committer = Committer(store, self.layout, key, copies=_copies(config.keep_dir))
        self.head: VersionManifest | None = None  # the committed version the pointer names
        self.last_delta: tuple[int, Delta] | None = None  # (version, what changed) of the latest step committed
        self._baseline: dict[str, np.ndarray] = {}
        self._digest: StateDigest | None = None
        self._union: Delta = {}
        self._catchup_bytes = 0  # catch-up bytes written since the anchor
        self._force_anchor = False
        self._opened = False
        self._resumed = False  # the next publish is the first since `open` found a pointer
        self._unsure: UnsureCommit | None = None
        self._shapes: dict[str, tuple[int, ...]] | None = None  # set once the baseline is released

    @property
    def version(self) -> int | None:
        return self.head.version if self.head is not None else None

    @property
    def trust(self) -> RunTrust | None:
        """The run keys `open` resumed under (with a key)."""
        return self.committer.trust

    @property
    def opened(self) -> bool:
        return self._opened

    @property
    def anchor_forced(self) -> bool:
        """Whether the next version is published as a fresh anchor whatever the policy says."""
        return self._force_anchor

    def force_anchor(self) -> None:
        """Publish the next version as a fresh anchor (an object a worker needs to reach the head
        is lost for good, e.g. an anchor shard a bucket writer deleted)."""
        self._force_anchor = True

    @property
    def baseline_lost(self) -> bool:
        """Whether `open` resumed at a committed version whose state it could not read back from
        the bucket (an object the chain needs was deleted or spoiled): the next version is a full
        anchor of the caller's state, with no patches (`_publish_fresh_anchor`)."""
        return self.head is not None and self._digest is None

    def lose_baseline(self) -> None:
        """Forget the committed state, which cannot be read back from the bucket (an object of its
        chain spoiled, no copy to put back): `baseline_lost` from now on, and the next version
        is a full anchor of the state `publish` is given, its parent the head."""
        if self.head is None:
            raise RuntimeError("lose_baseline() needs a committed version")
        self._forget_baseline()

    def _forget_baseline(self) -> None:
        self._baseline, self._digest, self._shapes, self._force_anchor = {}, None, None, True
        self._union, self._catchup_bytes = {}, 0

    @property
    def baseline(self) -> Mapping[str, np.ndarray]:
        """The published state (what the next version is diffed against); not to be written."""
        return self._baseline

    @property
    def state_digest(self) -> str | None:
        return self._digest.root() if self._digest else None

    # -- open ---------------------------------------------------------------------------------
    async def open(self) -> int | None:
        """Resume from the chain's pointer (baseline = the published state); None for a new chain."""
        await self.authenticate()
        return await self.resume()

    async def authenticate(self) -> None:
        """With a run key: load the run's keys; UntrustedState unless the key is its current one."""
        await self.committer.authenticate()

    async def resume(self) -> int | None:
        """`open` once authenticated."""
        self._opened = True
        found = await self.committer.read_pointer()
        if found is None:
            return None
        pointer, etag = found
        head = await self.committer.highest_signed(pointer)
        manifest = await self._sync_baseline(pointer, head)
        self.head, self.committer.etag = manifest, etag
        if head is not None:  # the pointer was put back (or its write was lost): point at the head again
            log.warning(
                "run %s: the pointer names v%d but the bucket holds signed v%d; resuming from v%d and moving the "
                "pointer back to it", self.layout.run, pointer.version, head.version, head.version,
            )
            await self.committer.point_back(head)
        self._union, self._catchup_bytes = {}, 0
        if self.config.catchup and manifest.anchor.version < manifest.version and not self.baseline_lost:
            sources, self._catchup_bytes = await union_sources(self.store, manifest, trust=self.trust)
            if sources is None:
                self._force_anchor = True
            else:
                self._union = await merge_sources(
                    self.store, sources, self._baseline, trust=self.trust, threads=self.config.threads
                )
        self._resumed = True
        on = "" if self.layout.plane is None else f" plane {self.layout.plane}"
        log.info("publisher resumed run %s%s at v%d", self.layout.run, on, manifest.version)
        return manifest.version

    async def _sync_baseline(self, pointer: Pointer, head: VersionManifest | None) -> VersionManifest:
        """Sync the baseline to `head` (else the pointer's version) from the bucket, checked
        like any reader's; its manifest. UntrustedState when a check fails."""
        sub = Subscriber(self.store, self.layout.run, trust=self.trust, plane=self.layout.plane)
        try:
            manifest = head or await sub.manifest(pointer.manifest)
        except (Untrusted, WeightsRefused) as exc:
            at = head.version if head is not None else pointer.version
            raise UntrustedState(f"refusing to resume run {self.layout.run!r} from v{at}: {exc}") from None
        try:
            await sub.sync_to(manifest)
        except (Untrusted, SyncError) as exc:
            # The head verifies, the chain below it does not read back: the caller holds its own
            # weights, so only the next version's patch needed this state; it becomes an anchor.
            self._forget_baseline()
            on = "" if self.layout.plane is None else f" plane {self.layout.plane}"
            log.warning(
                "run %s%s: the state of v%d cannot be read back from the bucket (%s); resuming at v%d without it, "
                "v%d will be a fresh anchor", self.layout.run, on, manifest.version, exc, manifest.version,
                manifest.version + 1,
            )
            return manifest
        assert sub.state is not None
        self._baseline, self._digest, self._shapes = sub.state, sub.digest, None
        return manifest

    # -- publish ------------------------------------------------------------------------------
    async def publish(self, state: Mapping[str, np.ndarray], *, source: Ref | None = None) -> PublishResult:
        """Publish `state` (bf16 bits as uint16 arrays; a plane's `plane.plane_bits`) as the next
        version; a plane's as version `source.version`, the bf16 version it quantizes."""
        if not self._opened:
            await self.open()
        return await self.publish_checked(self.checked(state, source), source)

    def checked(self, state: Mapping[str, np.ndarray], source: Ref | None) -> dict[str, np.ndarray]:
        """`state` as `publish_checked` takes it; ValueError for a bad state or source."""
        if (source is None) != (self.layout.plane is None):
            raise ValueError("a plane's version (and only one) is published with its bf16 source version")
        return {name: check_bits(name, bits) for name, bits in state.items()}

    async def publish_checked(self, state: dict[str, np.ndarray], source: Ref | None) -> PublishResult:
        """`publish` of a `checked` state on an opened publisher."""
        if self.version is None:
            return await self._publish_first(state, source)
        with self._next_version_errors():
            if self._unsure is not None and (landed := await self._settle_unsure(state)) is not None:
                return landed
            if source is not None and source.version != self.version + 1:
                if source.version <= self.version:
                    raise ValueError(f"plane {self.layout.plane} is at v{self.version} already, not below v{source.version}")
                return await self._publish_first(state, source)  # behind by more than one: a new chain
            await self.committer.put_back_window(self.version, self.config.retain_versions)
            if self.baseline_lost:
                return await self._publish_fresh_anchor(state, source)
            return await self._publish_next(state, source)

    @contextlib.contextmanager
    def _next_version_errors(self) -> Iterator[None]:
        """How a failed publish of the next version (by state or by delta) is raised: a lost race
        for the pointer as PublishConflict, any other store failure as PublishError."""
        assert self.version is not None
        try:
            yield
        except PreconditionFailed as exc:
            raise PublishConflict(
                f"another publisher wrote v{self.version + 1} of run {self.layout.run!r} first ({exc}); "
                f"only one trainer may publish a run — stop the other one, or restart this one to resume from the bucket"
            ) from None
        except StoreError as exc:
            raise PublishError(f"publishing v{self.version + 1} failed, the pointer did not move: {exc}") from exc

    # -- publish by delta, holding no state ------------------------------------------------------
    def release_baseline(self) -> dict[str, np.ndarray]:
        """Hand over the published state (for the weights' holder to keep its own copy, e.g.
        `device_delta.PreviousState.reset_from_host`) and stop keeping it: from now on the
        next versions come by `publish_delta`, and the publisher keeps only the digest, the
        tensors' shapes and the catch-up union. `open` or a full `publish` of a new chain holds a
        state again. RuntimeError before the first version is committed or opened."""
        if self.head is None or self._digest is None:
            raise RuntimeError("release_baseline() needs a committed version (publish or open first)")
        if self._shapes is not None:
            raise RuntimeError("the baseline is released already")
        released, self._baseline = self._baseline, {}
        self._shapes = {name: tuple(bits.shape) for name, bits in released.items()}
        return released

    async def committed_state(self) -> dict[str, np.ndarray]:
        """The committed version's state read back from the bucket, checked like any reader's
        (UntrustedState when a check fails), and not kept here: how a holder of the weights whose
        copy is not the committed state (`StaleBase`) rebuilds it after `release_baseline`."""
        if self.head is None or self._digest is None:
            raise RuntimeError("committed_state() needs a committed version (publish or open first)")
        sub = Subscriber(self.store, self.layout.run, trust=self.trust, plane=self.layout.plane)
        try:
            await sub.sync_to(self.head)
        except (Untrusted, WeightsRefused) as exc:
            raise UntrustedState(f"run {self.layout.run!r}: the committed v{self.head.version} reads back refused: {exc}") from None
        assert sub.state is not None and sub.digest is not None
        if sub.digest.root() != self._digest.root():
            raise UntrustedState(f"run {self.layout.run!r}: the committed v{self.head.version} reads back as another state")
        return sub.state

    @property
    def holds_state(self) -> bool:
        """Whether the published state is kept here (False after `release_baseline`)."""
        return self._shapes is None

    async def publish_delta(self, step: SparseStep, *, base: str, source: Ref | None = None) -> PublishResult:
        """Publish the version `step` takes the published state (whose digest root is `base`) to,
        as the next version (a plane's as `source.version`), holding no copy of the state
        (`release_baseline` first): the step patch from `step.delta` and `step.old`, the digest
        from the changed tensors read one at a time, and when an anchor is due every tensor read
        one at a time (`step_diff.SparseStep`). The bytes published are `publish`'s for the
        same new state. StaleBase when `base` is not the committed state (a pointer write without
        an answer turned out to have landed, or the caller's copy is behind): diff against
        `state_digest` and publish again."""
        if self._shapes is None:
            raise RuntimeError("publish_delta() needs release_baseline() first")
        if (source is None) != (self.layout.plane is None):
            raise ValueError("a plane's version (and only one) is published with its bf16 source version")
        unknown = sorted(set(step.delta) - set(self._shapes))
        if unknown or step.delta.keys() != step.old.keys():
            raise ValueError(f"the step's tensors are not the state's (unknown {unknown[:3]}) or lack their old bits")
        assert self.version is not None and self._digest is not None
        with self._next_version_errors():
            if self._unsure is not None and (landed := await self._settle_unsure_sparse(step, base)) is not None:
                return landed
            if base != self._digest.root():
                raise StaleBase(
                    f"the step goes from state {base[:12]}, the committed v{self.version} is {self._digest.root()[:12]}"
                )
            if source is not None and source.version != self.version + 1:
                raise ValueError(
                    f"plane {self.layout.plane} is at v{self.version}: by delta it publishes v{self.version + 1} only"
                )
            await self.committer.put_back_window(self.version, self.config.retain_versions)
            start = time.perf_counter()
            digest = await asyncio.to_thread(sparse_digest, self._digest, step, threads=self.config.threads)
            full = TensorsOnDemand(self._shapes, step.tensor)
            return await self._publish_step(step.delta, digest, source, start=start, full=full, base=None, old=step.old)

    async def _settle_unsure_sparse(self, step: SparseStep, base: str) -> PublishResult | None:
        """`_settle_unsure` by digest: a landed version is adopted; a step from the state before
        it is that version retried (its result) when it reaches the same digest, else stale."""
        assert self._digest is not None
        before = self._digest
        unsure = await self._adopt_landed()
        if unsure is None:
            return None
        if base == before.root():
            reached = await asyncio.to_thread(sparse_digest, before, step, threads=self.config.threads)
            if reached.root() == unsure.manifest.state_digest:
                return settled_result(unsure)
        return None  # a step from the landed state publishes as usual; any other is stale

    async def settle(self) -> None:
        """Settle a pointer write that got no answer, adopting its version when it landed, before
        the caller decides what to publish next (a plane by delta: a step from the version it is
        at, or a new chain). PublishError while the store stays down."""
        if self._unsure is not None and self.version is not None:
            with self._next_version_errors():
                await self._adopt_landed()

    async def _adopt_landed(self) -> UnsureCommit | None:
        """Read the pointer after a write that got no answer (`_unsure`): the commit, adopted
        here, when it landed; None when it did not. StoreError while the store stays down."""
        assert self._unsure is not None
        unsure = self._unsure
        etag = await self.committer.landed(unsure.manifest)
        self._unsure = None
        if etag is None:
            return None
        log.warning("the pointer write of v%d landed although its answer was lost", unsure.manifest.version)
        self.committer.etag, self.head = etag, unsure.manifest
        unsure.advance()
        return unsure

    async def publish_streamed(self, state: TensorsOnDemand, *, source: Ref) -> PublishResult:
        """A plane's version `source.version` as a new chain from a full anchor of `state`, read one
        tensor at a time and not kept (`step_diff.TensorsOnDemand`): how a plane publishing by
        delta that is not one step behind its bf16 source (it missed a version, or has none) is
        brought to it. The publisher holds no state after, as after `release_baseline`. The bytes
        are `publish`'s of the same plane state."""
        if self.layout.plane is None:
            raise ValueError("only a plane's chain starts over at its bf16 source version")
        if not self._opened:
            await self.open()
        await self.settle()
        if self.version is not None and source.version <= self.version:
            raise ValueError(f"plane {self.layout.plane} is at v{self.version} already, not below v{source.version}")
        return await self._publish_first(state, source)

    async def _publish_first(self, state: Mapping[str, np.ndarray], source: Ref | None = None) -> PublishResult:
        """The run's first version (a plane's: at its `source` version, or a new chain past a
        gap, keeping its epoch), an anchor. A `TensorsOnDemand` state is read one tensor at a
        time and not kept (`publish_streamed`)."""
        start = time.perf_counter()
        attempt = new_attempt()
        v = source.version if source is not None else 0
        epoch = self.head.origin.epoch if self.head is not None else 0
        shapes = state.shapes if isinstance(state, TensorsOnDemand) else {n: tuple(b.shape) for n, b in state.items()}
        digest = await asyncio.to_thread(StateDigest.of, state, threads=self.config.threads)
        anchor_key, anchor_bytes = await self._write_anchor(v, attempt, state, digest.root())
        manifest = VersionManifest(
            run=self.layout.run, version=v, attempt=attempt, state_digest=digest.root(), parent=None,
            anchor=Ref(version=v, manifest=anchor_key, state_digest=digest.root()), anchor_bytes=anchor_bytes,
            since_anchor_bytes=0, patches=(), elements=_elements(shapes), created_at=time.time(),
            lineage=Origin(epoch=epoch, step=0, parent=None), plane=self.layout.plane, source=source,
        )
        try:
            await self.committer.commit(manifest, create=self.committer.etag is None)
        except PreconditionFailed as exc:
            raise PublishConflict(f"run {self.layout.run!r} already has published weights ({exc})") from None
        self.head = manifest
        if isinstance(state, TensorsOnDemand):
            self._baseline, self._shapes = {}, dict(shapes)
        else:
            self._baseline, self._shapes = {name: bits.copy() for name, bits in state.items()}, None
        self._digest, self._union, self._catchup_bytes, self._force_anchor = digest, {}, 0, False
        self._resumed = False
        return PublishResult(v, True, 0, manifest.elements, 0, 0, anchor_bytes, time.perf_counter() - start)

    async def _publish_fresh_anchor(self, state: dict[str, np.ndarray], source: Ref | None) -> PublishResult:
        """The version after a head whose state `open` could not read back (`baseline_lost`): a
        full anchor of `state` with no patches, its chain parent and lineage the head's next."""
        assert self.head is not None
        start = time.perf_counter()
        prev, attempt = self.head, new_attempt()
        v = prev.version + 1
        digest = await asyncio.to_thread(StateDigest.of, state, threads=self.config.threads)
        root = digest.root()
        origin = await next_origin(
            self.store, self.layout, prev, root, first_since_open=self._resumed, trust=self.trust
        )
        key, anchor_bytes = await self._write_anchor(v, attempt, state, root)
        manifest = VersionManifest(
            run=self.layout.run, version=v, attempt=attempt, state_digest=root, parent=version_ref(self.layout, prev),
            anchor=Ref(version=v, manifest=key, state_digest=root), anchor_bytes=anchor_bytes, since_anchor_bytes=0,
            patches=(), elements=_elements({n: tuple(b.shape) for n, b in state.items()}), created_at=time.time(),
            lineage=origin, plane=self.layout.plane, source=source,
        )

        def advance() -> None:  # the state is held again: the versions after go by patch
            self._baseline, self._shapes = {name: bits.copy() for name, bits in state.items()}, None
            self._digest, self._union, self._catchup_bytes, self._force_anchor = digest, {}, 0, False
            self._resumed = False
            self.last_delta = None  # no step from the head is known

        await self._commit_advancing(manifest, advance, start)
        log_restore(v, origin)
        if self.config.retain_anchors != 0:
            await retain(
                self.store, self.layout, retain_anchors=self.config.retain_anchors,
                retain_versions=self.config.retain_versions, head=v,
            )
        return PublishResult(
            v, True, 0, manifest.elements, 0, 0, anchor_bytes, time.perf_counter() - start, epoch=origin.epoch,
            restored_from=origin.parent.version if origin.restored and origin.parent else None,
        )

    async def _publish_next(self, state: dict[str, np.ndarray], source: Ref | None = None) -> PublishResult:
        """The version after the head: its patches, an anchor when due, the commit."""
        start = time.perf_counter()
        assert self._digest is not None
        step = await asyncio.to_thread(
            self.diff_step, self._baseline, self._digest, state, threads=self.config.threads
        )
        return await self._publish_step(
            step.delta, step.digest, source, start=start, full=state, base=self._baseline, old=None
        )

    async def _publish_step(
        self, delta: Delta, new_digest: StateDigest, source: Ref | None, *, start: float,
        full: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray] | None, old: Mapping[str, np.ndarray] | None,
    ) -> PublishResult:
        """The version after the head given its `delta` and digest: its patches (coded against
        `base`, or `old`: the base's bits at the delta's indices), an anchor of `full` when due,
        the commit."""
        assert self.head is not None and self._digest is not None
        cfg, prev = self.config, self.head
        v, attempt = prev.version + 1, new_attempt()
        digest = new_digest.root()
        origin = await next_origin(
            self.store, self.layout, prev, digest, first_since_open=self._resumed, trust=self.trust
        )
        written = await encode_patches(
            self.layout, cfg, version=v, attempt=attempt, anchor=prev.anchor.version,
            since_anchor_bytes=prev.since_anchor_bytes, delta=delta, state=full, base=base, old=old,
            shapes=self._shapes, base_digest=self._digest.root(), union=self._union, catchup_bytes=self._catchup_bytes,
        )
        since = written.since_anchor_bytes
        anchored = anchor_due(
            version=v, anchor_version=prev.anchor.version, since_anchor_bytes=since, anchor_bytes=prev.anchor_bytes,
            anchor_every=cfg.anchor_every, anchor_fraction=cfg.anchor_fraction, forced=self._force_anchor,
        )
        await self._upload(written.uploads)
        anchor_ref, anchor_bytes, new_anchor_bytes = prev.anchor, prev.anchor_bytes, 0
        if anchored:
            key, new_anchor_bytes = await self._write_anchor(v, attempt, full, digest)
            anchor_ref, anchor_bytes = Ref(version=v, manifest=key, state_digest=digest), new_anchor_bytes
        manifest = VersionManifest(
            run=self.layout.run, version=v, attempt=attempt, state_digest=digest, parent=version_ref(self.layout, prev),
            anchor=anchor_ref, anchor_bytes=anchor_bytes, since_anchor_bytes=0 if anchored else since,
            patches=written.patches, elements=prev.elements, created_at=time.time(), lineage=origin,
            plane=self.layout.plane, source=source,
        )
        await self._commit_next(manifest, delta, new_digest, written, anchored=anchored, start=start)
        log_restore(v, origin)
        if anchored and cfg.retain_anchors != 0:
            await retain(
                self.store, self.layout, retain_anchors=cfg.retain_anchors, retain_versions=cfg.retain_versions, head=v
            )
        return PublishResult(
            v, anchored, written.step.count, manifest.elements, written.step.bytes,
            written.patches[1].bytes if len(written.patches) > 1 else 0, new_anchor_bytes, time.perf_counter() - start,
            epoch=origin.epoch, restored_from=origin.parent.version if origin.restored and origin.parent else None,
        )

    async def _commit_next(
        self, manifest: VersionManifest, delta: Delta, digest: StateDigest, written: VersionPatches, *,
        anchored: bool, start: float,
    ) -> None:
        """Commit `manifest` and advance the baseline by `delta`; a pointer write without an
        answer is kept to settle (`_settle_unsure`) and raised."""

        def advance() -> None:  # what a commit changes: run now, or once a lost answer is settled
            # Committed: only now does the baseline advance (in place, proportional to the patch);
            # a publisher that released it (`release_baseline`) keeps only the digest.
            if self._shapes is None:
                for name, (indices, values) in delta.items():
                    self._baseline[name].reshape(-1)[indices] = values
            self._digest = digest
            self._union = {} if anchored else written.union
            self._catchup_bytes = 0 if anchored else written.catchup_bytes
            self._force_anchor = False
            self._resumed = False
            self.last_delta = (manifest.version, delta)

        await self._commit_advancing(manifest, advance, start)

    async def _commit_advancing(self, manifest: VersionManifest, advance: Callable[[], None], start: float) -> None:
        """Commit `manifest`, then `advance` (what the commit changes here); a pointer write
        without an answer is kept to settle with `advance` (`_settle_unsure`) and raised."""
        try:
            await self.committer.commit(manifest, create=False)
        except PreconditionFailed:
            raise
        except StoreError:  # no answer: the pointer may have moved all the same (see _settle_unsure)
            self._unsure = UnsureCommit(manifest, advance, time.perf_counter() - start)
            raise
        self.head = manifest
        advance()

    async def _settle_unsure(self, state: dict[str, np.ndarray]) -> PublishResult | None:
        """After a pointer write that got no answer, read the pointer: if the write landed, that
        version is committed (adopted here); for the same state again (the caller retrying that
        publish) its result. StoreError while the store stays down (the caller retries)."""
        unsure = await self._adopt_landed()
        if unsure is None:
            return None  # it never landed: publish as usual
        if await asyncio.to_thread(diff, self._baseline, state, threads=self.config.threads):
            return None  # a newer state: publish it as the next version
        return settled_result(unsure)

    # -- uploads ------------------------------------------------------------------------------
    async def _upload(self, objects: list[tuple[str, bytes]]) -> None:
        limit = asyncio.Semaphore(self.config.concurrency)

        async def put(key: str, data: bytes) -> None:
            async with limit:
                await self.store.put_if_absent(key, data)

        await asyncio.gather(*(put(k, d) for k, d in objects))

    async def _write_anchor(self, version: int, attempt: str, state, digest: str) -> tuple[str, int]:
        """Write `state` as the anchor of `version`; its manifest's key and its bytes."""
        extras = hf_config_files(self.config.extras_dir) if self.config.extras_dir else []
        key, anchor = await write_anchor(
            self.store, self.layout, version=version, attempt=attempt, state=state, state_digest=digest,
            extras=extras, shard_bytes=self.config.shard_bytes, concurrency=self.config.concurrency, key=self.key,
        )
        return key, anchor.total_bytes


def _copies(folder: Path | None) -> Copies | None:
    """The trainer's own copies in `folder` (`PublisherConfig.keep_dir`); None: none kept."""
    if folder is None:
        return None
    from slime_stoa.protocol.kept import TrainerCopies  # the trainer's side: not loaded by readers of weights

    return TrainerCopies(folder)


def _elements(shapes: Mapping[str, tuple[int, ...]]) -> int:
    return int(sum(math.prod(shape) for shape in shapes.values()))
