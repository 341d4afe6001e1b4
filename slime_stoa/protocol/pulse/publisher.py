"""The trainer side of the weight plane: publish each new bf16 state as a PULSE patch.

`publish(state)` diffs the state against the last *published* baseline and writes, in order:
the patch objects (a `step` patch from the previous version and, at the distances from the
anchor `catchup.py` schedules and within its byte budget, a `catchup` patch that is valid on any
state since the last anchor), a full anchor when the policy asks for one,
the version manifest, and finally moves `current.json` by compare-and-swap. Every object is
written with put-if-absent under keys that carry a fresh attempt id, so a crashed or losing
publisher never blocks a version; only the pointer's CAS decides. The baseline advances only
after the pointer moved. A second publisher racing on the same run loses the CAS and gets a
`PublishConflict`; its objects are unreferenced and nothing it wrote is visible to readers.

Each version records its weight lineage (`manifests.Origin`): trained from the previous version,
or, on the first publish after `open`, restored when the state is bit-identical to a committed
version's (a trainer restarted from a checkpoint). Restoring an earlier version than the
pointer's starts a new branch: the epoch goes up and the versions in between are abandoned
(consumers measure staleness along the lineage: `lineage.Lineage`). The patch chain is not
affected: the new version's step patch still goes from the pointer's version.

Given the run key (`key`), the publisher signs every pointer, version manifest and anchor
manifest it writes, and every manifest carries the sha256 of each object it names. On `open` it
refuses (`UntrustedState`) to resume from a pointer or manifests the run's keys did not sign, or
with a key that is not the run's current one (the run manifest's `run_key`, or the newest key
its rotations announce).

Freshness (signed runs): `open` resumes from the highest signed version manifest the bucket
lists, not from the pointer alone: an old genuine pointer put back (a rollback) is moved back to
that head. A version number gets one signed manifest: `publish` refuses (`PublishConflict`) when
another signed manifest of the version it would write exists (its own unanswered attempts
aside: they are never referenced). The one exception is the repair of an unsigned v0
(`stoa weights publish-anchor`): the unsigned v0 was never trusted by a signed reader, so the run
still has one signed v0.

Quantized planes (`PublisherConfig.planes`; `pulse.plane`, `layout.RunLayout(run, plane)`): after
each bf16 version v is committed, each plane of it (MLX affine codes, scales and biases of the same
weights) is published as version v of that plane by a publisher of its own, under the plane's
folder: its own patches, catch-ups on its own schedule and anchors, signed by the same key, with
state digests over the plane, and each version manifest naming the bf16 version it quantizes
(`source`). A plane that is not at the bf16 version (a crash between the two commits, a plane
publish that failed, a plane added to a running run) is brought to it before the next bf16 version
and when the publisher opens: as a step from the version before, or as a new chain from an anchor
when it is further behind.

The diff, digest update, catch-up merge and encode of a version run on `PublisherConfig.threads`
threads, off the event loop (tensors, segments of a large one and frames at a time,
`pulse.parallel`); the bytes published do not depend on the thread count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from slime_stoa.protocol.hf.folders import hf_config_files
from slime_stoa.protocol.layout import QuantPlane, RunLayout, check_plane, version_str
from slime_stoa.protocol.run_manifest import RunNotFound, read_run_manifest, run_retention
from slime_stoa.protocol.run_trust import RunTrust, Untrusted, content_hash, load_rotations
from slime_stoa.protocol.signing import PublicKey, SigningKey
from slime_stoa.protocol.store import NotFound, PreconditionFailed, Store, StoreError

from .anchor import write_anchor
from .catchup import CATCHUP_SCHEDULES, CatchupSchedule, catchup_due, within_budget
from .codec import Delta, check_bits, diff, merge_deltas, shapes_of
from .digest import StateDigest
from .frames import MODES, Mode, decode_frame, encode_delta
from .history import MalformedPointer, NotPublished, read_manifest, read_pointer_etag, walk_back
from .manifests import ManifestError, Origin, PatchRef, Pointer, Ref, VersionManifest
from .parallel import check_threads, ordered_map
from .plane import plane_bits, updated_plane_bits
from .subscriber import Subscriber, WeightsRefused

log = logging.getLogger("stoa.pulse")

# How many committed versions back the first publish after `open` looks for the one its state
# restores (a trainer restarted from an older checkpoint is rarely further back).
RESTORE_SEARCH = 1000
# How many manifests above the pointer `open` reads looking for the highest signed one (a worker's
# token can list junk there; each candidate is one small GET).
MAX_HEAD_CANDIDATES = 64


class PublishError(Exception):
    """A publish failed; the pointer did not move and the baseline is unchanged."""


class PublishConflict(PublishError):
    """Another publisher moved the run's pointer first."""


class UntrustedState(PublishError):
    """A publisher with a run key refuses the bucket: the state it would resume from is not
    signed by the run's keys, or its key is not the run's current key."""


async def publisher_trust(store: Store, run: str, key: SigningKey) -> RunTrust:
    """The keys a publisher holding `key` resumes under: pinned to the run manifest's `run_key`
    (the publisher's own key for a run without one, or without a manifest), plus the run's
    rotations; UntrustedState unless `key` is the newest of them."""
    try:
        manifest = await read_run_manifest(store, run)
        pinned = PublicKey.from_text(manifest.run_key) if manifest.run_key else key.public
    except RunNotFound:
        pinned = key.public
    except ValueError as exc:
        raise UntrustedState(f"cannot read the run manifest to check the run key: {exc}") from None
    trust = RunTrust(run, pinned)
    try:
        await load_rotations(store, trust)
    except Untrusted as exc:
        raise UntrustedState(f"a key rotation of run {run!r} does not verify: {exc}") from None
    if trust.newest != key.public:
        raise UntrustedState(
            f"key {key.key_id} is not the current key of run {run!r} (that is {trust.newest.key_id}, "
            f"fingerprint {trust.newest.fingerprint}): publish with that key"
        )
    return trust


@dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    """How the trainer publishes weights (one per run)."""

    anchor_every: int = 50
    """Write a full anchor at least every this many versions."""
    anchor_fraction: float = 0.5
    """... or once the step patches since the last anchor exceed this share of it."""
    catchup: bool = True
    """Publish merged catch-up patches (at the distances `catchup_schedule` picks), so a lagging
    worker downloads one catch-up and a short chain instead of a long chain or an anchor."""
    catchup_schedule: CatchupSchedule = "powers_of_two"
    """At which distances from the anchor a catch-up is written: "powers_of_two" (2, 4, 8, ...:
    the newest one is more than halfway from the anchor to any head, and those of an anchor
    interval cost about two steps' worth per version at most) or "every" (`catchup_every`
    versions); see `pulse/catchup.py`."""
    catchup_every: int = 8
    """The period of the "every" schedule."""
    catchup_budget: float = 1.5
    """Catch-up bytes written since the anchor stay at most this many times the step bytes
    written since it (a due catch-up over the budget, or as large as the steps since the anchor,
    is skipped); `inf`: every due catch-up is written."""
    mode: Mode = "rel"
    """Step patches: "rel" (smaller, valid only on the exact base: receivers check its digest) or "abs"."""
    frame_bytes: int = 16 << 20
    """Target uncompressed bytes per independently compressed frame."""
    shard_bytes: int = 1 << 30
    """Anchor safetensors shard size."""
    retain_anchors: int | None = None
    """Keep this many anchors and everything after the oldest (0: keep all); None: the run's
    `retain_anchors` (`stoa run create --retain-anchors`), read from its manifest."""
    retain_versions: int = 8
    """Versions behind the head always kept, whatever retain_anchors says: a consumer checks a
    record against the published versions of its staleness window (staleness_limit +
    version_ahead_slack + 1 back), so deleting them would refuse honest, fresh records. The
    publisher keeps max(this, the run's staleness_limit + 2)."""
    extras_dir: Path | None = None
    """An HF folder whose config and tokenizer files ship with anchors (`""`: none)."""
    concurrency: int = 8
    """Uploads in flight."""
    threads: int | None = None
    """Threads the diff, digest, merge and encode of a version run on (numpy, xxh3 and zstd
    release the GIL; the bytes published do not depend on it). None: one per CPU, at most 8."""
    planes: tuple[QuantPlane, ...] | None = None
    """Quantized planes published beside the bf16 weights, each version after its bf16 version:
    "int8", "int4" (MLX affine, groups of 64; a worker on one holds that plane alone); None: the
    planes the run manifest offers (`stoa run create --planes`), none without one."""
    model_type: str | None = None
    """The model type whose mlx-lm quantization rule the planes follow (its overrides, e.g. an
    MoE router kept at 8 bits); None: `extras_dir`'s config.json says, else no overrides."""

    def __post_init__(self) -> None:
        if self.anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1, got {self.anchor_every}")
        if not self.anchor_fraction > 0:
            raise ValueError(f"anchor_fraction must be positive, got {self.anchor_fraction}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.retain_anchors is not None and self.retain_anchors < 0:
            raise ValueError("retain_anchors must be >= 0")
        if self.retain_versions < 1:
            raise ValueError(f"retain_versions must be >= 1, got {self.retain_versions}")
        if self.catchup_schedule not in CATCHUP_SCHEDULES:
            raise ValueError(f"catchup_schedule must be one of {CATCHUP_SCHEDULES}, got {self.catchup_schedule!r}")
        if self.catchup_every < 1:
            raise ValueError(f"catchup_every must be >= 1, got {self.catchup_every}")
        if not self.catchup_budget >= 0:
            raise ValueError(f"catchup_budget must be >= 0, got {self.catchup_budget}")
        check_threads(self.threads)
        if self.planes is not None:
            if not isinstance(self.planes, tuple) or len(set(self.planes)) != len(self.planes):
                raise ValueError(f"planes must be a tuple of distinct plane names, got {self.planes!r}")
            for plane in self.planes:
                check_plane(plane)


@dataclass(frozen=True, slots=True)
class PublishResult:
    version: int
    anchored: bool
    changed: int  # elements whose bits changed since the previous version
    elements: int
    patch_bytes: int  # the step patch (what an up-to-date worker downloads)
    catchup_bytes: int
    anchor_bytes: int  # written this version (0 if none)
    seconds: float
    epoch: int = 0  # the lineage branch (see `manifests.Origin`)
    restored_from: int | None = None  # the version whose weights this one restores (a trainer restart)
    planes: tuple[QuantPlane, ...] = ()  # the quantized planes published at this version

    @property
    def density(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    @property
    def full_bytes(self) -> int:
        return 2 * self.elements


def new_attempt() -> str:
    return secrets.token_hex(4)


def patch_delta(index, body: bytes, state: Mapping[str, np.ndarray], *, threads: int | None = 1) -> Delta:
    """The elements a patch body changed, with their values in `state` (the state the patch
    reaches): a delta whatever the patch's mode. Frames decode on `threads` threads."""
    parts: dict[str, list[np.ndarray]] = {}

    def decoded(i: int) -> list:
        frame = index.frames[i]
        return decode_frame(index, i, body[frame.offset : frame.offset + frame.length])

    for entries in ordered_map(decoded, range(len(index.frames)), threads):
        for name, indices, _values in entries:
            parts.setdefault(name, []).append(indices)
    delta: Delta = {}
    for name, pieces in parts.items():
        indices = np.concatenate(pieces)
        delta[name] = (indices, state[name].reshape(-1)[indices])
    return delta


class Publisher:
    def __init__(
        self, store: Store, run: str, config: PublisherConfig = PublisherConfig(), *, key: SigningKey | None = None,
        plane: QuantPlane | None = None,
    ):
        """The publisher of run `run`'s bf16 weights (and of `config.planes`), or with `plane`
        of that quantized plane alone (whose versions name their bf16 `source`)."""
        self.store = store
        self.layout = RunLayout(run, plane)
        self.config = config
        if plane is not None and config.planes:
            raise ValueError("a plane's publisher publishes no planes of its own")
        self.key = key  # the run key: signs everything written (None: an unsigned run)
        # The planes' own publishers (module docstring); with `config.planes` None, made by `open`.
        self.planes: dict[QuantPlane, Publisher] = self._plane_publishers(config.planes or ())
        self.trust: RunTrust | None = None  # the run keys `open` resumed under (with a key)
        self.version: int | None = None
        self._baseline: dict[str, np.ndarray] = {}
        self._digest: StateDigest | None = None
        self._etag: str | None = None
        self._manifest: VersionManifest | None = None
        self._union: Delta = {}
        self._catchup_bytes = 0  # catch-up bytes written since the anchor
        self._force_anchor = False
        self._opened = False
        self._resumed = False  # the next publish is the first since `open` found a pointer
        # A commit whose pointer write got no answer: (its manifest, what it changes, seconds).
        self._unsure: tuple[VersionManifest, Callable[[], None], float] | None = None
        self._written: set[str] = set()  # version manifests this publisher wrote (its own lost attempts)
        self._last_delta: tuple[int, Delta] | None = None  # (version, what changed) of the latest step committed

    @property
    def state_digest(self) -> str | None:
        return self._digest.root() if self._digest else None

    async def open(self) -> int | None:
        """Resume from the run's pointer (baseline = the published state); None for a new run."""
        if self.key is not None:
            self.trust = await publisher_trust(self.store, self.layout.run, self.key)
        if self.config.planes is None and self.layout.plane is None and not self._opened:
            self.planes = self._plane_publishers(await _offered_planes(self.store, self.layout.run))
        self._opened = True
        try:
            found = await read_pointer_etag(self.store, self.layout.run, trust=self.trust, plane=self.layout.plane)
        except NotPublished:
            return None
        except MalformedPointer as exc:
            if exc.untrusted:
                raise UntrustedState(f"refusing to resume run {self.layout.run!r}: {exc}") from None
            raise
        assert found is not None
        pointer, etag = found
        sub = Subscriber(self.store, self.layout.run, trust=self.trust, plane=self.layout.plane)
        head = await self._highest_signed(pointer)
        try:
            manifest = head or await sub.manifest(pointer.manifest)
            await sub.sync_to(manifest)
        except (Untrusted, WeightsRefused) as exc:
            at = head.version if head is not None else pointer.version
            raise UntrustedState(f"refusing to resume run {self.layout.run!r} from v{at}: {exc}") from None
        assert sub.state is not None
        self._baseline, self._digest = sub.state, sub.digest
        self.version, self._etag, self._manifest = manifest.version, etag, manifest
        if head is not None:  # the pointer was put back (or its write was lost): point at the head again
            log.warning(
                "run %s: the pointer names v%d but the bucket holds signed v%d; resuming from v%d and moving the "
                "pointer back to it", self.layout.run, pointer.version, head.version, head.version,
            )
            self._etag = await self.store.cas(self.layout.pointer, self._pointer(head).to_bytes(self.key), etag)
        self._union, self._catchup_bytes = {}, 0
        if self.config.catchup and manifest.anchor.version < manifest.version:
            sources = await self._union_sources(manifest)
            if sources is None:
                self._force_anchor = True
            else:
                deltas = []
                for source in sources:
                    body = await self.store.get_bytes(source.key)
                    if self.trust is not None and content_hash(body) != source.sha256:
                        raise UntrustedState(f"refusing to resume: {source.key} does not match its signed sha256")
                    deltas.append(
                        await asyncio.to_thread(patch_delta, source.index, body, self._baseline, threads=self.config.threads)
                    )
                self._union = await asyncio.to_thread(merge_deltas, deltas, threads=self.config.threads)
        self._resumed = True
        on = "" if self.layout.plane is None else f" plane {self.layout.plane}"
        log.info("publisher resumed run %s%s at v%d", self.layout.run, on, self.version)
        await self._publish_planes(self._baseline)
        return self.version

    async def publish(self, state: Mapping[str, np.ndarray], *, source: Ref | None = None) -> PublishResult:
        """Publish `state` (bf16 bits as uint16 arrays) as the next version, then its quantized
        planes (`PublisherConfig.planes`). A plane's publisher publishes the plane's `state` (from
        `plane.plane_bits`) as version `source.version`, the bf16 version it quantizes."""
        if not self._opened:
            await self.open()
        if (source is None) != (self.layout.plane is None):
            raise ValueError("a plane's version (and only one) is published with its bf16 source version")
        state = {name: check_bits(name, bits) for name, bits in state.items()}
        if self.planes:
            await self._publish_planes(self._baseline)  # planes left behind the published version
        result = await self._publish(state, source)
        return replace(result, planes=await self._publish_planes(state)) if self.planes else result

    async def _publish(self, state: dict[str, np.ndarray], source: Ref | None) -> PublishResult:
        if self.version is None:
            return await self._publish_first(state, source)
        try:
            if self._unsure is not None and (landed := await self._settle_unsure(state)) is not None:
                return landed
            if source is not None and source.version != self.version + 1:
                if source.version <= self.version:
                    raise ValueError(f"plane {self.layout.plane} is at v{self.version} already, not below v{source.version}")
                return await self._publish_first(state, source)  # behind by more than one: a new chain
            return await self._publish_next(state, source)
        except PreconditionFailed as exc:
            raise PublishConflict(
                f"another publisher wrote v{self.version + 1} of run {self.layout.run!r} first ({exc}); "
                f"only one trainer may publish a run — stop the other one, or restart this one to resume from the bucket"
            ) from None
        except StoreError as exc:
            raise PublishError(f"publishing v{self.version + 1} failed, the pointer did not move: {exc}") from exc

    # -- the planes ----------------------------------------------------------------------------
    async def _publish_planes(self, state: Mapping[str, np.ndarray]) -> tuple[QuantPlane, ...]:
        """Bring every plane not at the published bf16 version (whose state is `state`) to it;
        the planes published. A plane that fails is logged and left to the next call."""
        head = self._manifest
        if head is None or not self.planes:
            return ()
        source, done = self._ref(head), []
        last = self._last_delta
        for plane, pub in self.planes.items():
            try:
                if not pub._opened:
                    await pub.open()
                if pub.version is not None and pub.version >= head.version:
                    continue
                if last is not None and last[0] == head.version and pub.version == head.version - 1:
                    # One step behind: re-quantize only the groups the step changed.
                    changed = {name: indices for name, (indices, _) in last[1].items()}
                    bits = await asyncio.to_thread(
                        updated_plane_bits, pub._baseline, state, changed, plane, self._model_type(),
                        threads=self.config.threads,
                    )
                else:
                    bits = await asyncio.to_thread(plane_bits, state, plane, self._model_type(), threads=self.config.threads)
                await pub.publish(bits, source=source)
                done.append(plane)
            except (PublishError, StoreError) as exc:
                log.warning(
                    "run %s: plane %s of v%d not published (%s); retried before the next version",
                    self.layout.run, plane, head.version, exc,
                )
        return tuple(done)

    def _plane_publishers(self, planes: tuple[QuantPlane, ...]) -> dict[QuantPlane, Publisher]:
        config = replace(self.config, planes=())
        return {p: Publisher(self.store, self.layout.run, config, key=self.key, plane=p) for p in planes}

    def _model_type(self) -> str | None:
        """`PublisherConfig.model_type`, else the `model_type` of `extras_dir`'s config.json."""
        if self.config.model_type is not None or self.config.extras_dir is None:
            return self.config.model_type
        try:
            found = json.loads((Path(self.config.extras_dir) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            return None
        return found if isinstance(found, str) else None

    # -- the two kinds of publish -----------------------------------------------------------
    async def _publish_first(self, state: dict[str, np.ndarray], source: Ref | None = None) -> PublishResult:
        """The run's first version (a plane's: at its `source` version, or a new chain past a
        gap, keeping its epoch), an anchor."""
        start = time.perf_counter()
        attempt = new_attempt()
        v = source.version if source is not None else 0
        epoch = self._manifest.origin.epoch if self._manifest is not None else 0
        digest = await asyncio.to_thread(StateDigest.of, state, threads=self.config.threads)
        anchor_key, anchor = await self._write_anchor(v, attempt, state, digest.root())
        manifest = VersionManifest(
            run=self.layout.run,
            version=v,
            attempt=attempt,
            state_digest=digest.root(),
            parent=None,
            anchor=Ref(version=v, manifest=anchor_key, state_digest=digest.root()),
            anchor_bytes=anchor.total_bytes,
            since_anchor_bytes=0,
            patches=(),
            elements=_elements(state),
            created_at=time.time(),
            lineage=Origin(epoch=epoch, step=0, parent=None),
            plane=self.layout.plane,
            source=source,
        )
        try:
            await self._commit(manifest, create=self._etag is None)
        except PreconditionFailed as exc:
            raise PublishConflict(f"run {self.layout.run!r} already has published weights ({exc})") from None
        self._baseline = {name: bits.copy() for name, bits in state.items()}
        self._digest, self._union, self._catchup_bytes, self._force_anchor = digest, {}, 0, False
        self._resumed = False
        return PublishResult(v, True, 0, manifest.elements, 0, 0, anchor.total_bytes, time.perf_counter() - start)

    async def _publish_next(self, state: dict[str, np.ndarray], source: Ref | None = None) -> PublishResult:
        start = time.perf_counter()
        assert self._manifest is not None and self._digest is not None and self.version is not None
        cfg, prev = self.config, self._manifest
        v, attempt = self.version + 1, new_attempt()
        threads = cfg.threads
        delta = await asyncio.to_thread(diff, self._baseline, state, threads=threads)
        shapes = shapes_of(state)
        digest = await asyncio.to_thread(self._digest.update, state, delta.keys(), threads=threads)
        origin = await self._origin(prev, digest.root())
        step_index, step_body = await asyncio.to_thread(
            encode_delta, delta, shapes, base=self._baseline, mode=cfg.mode,
            frame_bytes=cfg.frame_bytes, threads=threads,
        )
        since = prev.since_anchor_bytes + len(step_body)
        anchored = (
            self._force_anchor
            or v - prev.anchor.version >= cfg.anchor_every
            or since > cfg.anchor_fraction * prev.anchor_bytes
        )
        step = PatchRef(
            kind="step", key=self.layout.patch(v, attempt, "step", v - 1), bytes=len(step_body),
            count=step_index.count, base_min=v - 1, base_max=v - 1, base_digest=self._digest.root(),
            index=step_index, sha256=await asyncio.to_thread(content_hash, step_body),
        )
        uploads = [(step.key, step_body)]
        patches = [step]
        union = await asyncio.to_thread(merge_deltas, [self._union, delta], threads=threads) if cfg.catchup else {}
        catchup_bytes = self._catchup_bytes
        a = prev.anchor.version
        if cfg.catchup and catchup_due(v - a, cfg.catchup_schedule, cfg.catchup_every):
            cu_index, cu_body = await asyncio.to_thread(
                encode_delta, union, shapes, mode="abs", frame_bytes=cfg.frame_bytes, threads=threads
            )
            if within_budget(catchup_bytes, len(cu_body), since, cfg.catchup_budget):
                catchup_bytes += len(cu_body)
                patches.append(
                    PatchRef(
                        kind="catchup", key=self.layout.patch(v, attempt, "catchup", a), bytes=len(cu_body),
                        count=cu_index.count, base_min=a, base_max=v - 1, base_digest=None, index=cu_index,
                        sha256=await asyncio.to_thread(content_hash, cu_body),
                    )
                )
                uploads.append((patches[-1].key, cu_body))
        await self._upload(uploads)
        anchor_ref, anchor_bytes, written = prev.anchor, prev.anchor_bytes, 0
        if anchored:
            key, anchor = await self._write_anchor(v, attempt, state, digest.root())
            anchor_ref, anchor_bytes, written = Ref(version=v, manifest=key, state_digest=digest.root()), anchor.total_bytes, anchor.total_bytes
        manifest = VersionManifest(
            run=self.layout.run,
            version=v,
            attempt=attempt,
            state_digest=digest.root(),
            parent=self._ref(prev),
            anchor=anchor_ref,
            anchor_bytes=anchor_bytes,
            since_anchor_bytes=0 if anchored else since,
            patches=tuple(patches),
            elements=prev.elements,
            created_at=time.time(),
            lineage=origin,
            plane=self.layout.plane,
            source=source,
        )
        def advance() -> None:  # what a commit changes: run now, or once a lost answer is settled
            # Committed: only now does the baseline advance (in place, proportional to the patch).
            for name, (indices, values) in delta.items():
                self._baseline[name].reshape(-1)[indices] = values
            self._digest = digest
            self._union = {} if anchored else union
            self._catchup_bytes = 0 if anchored else catchup_bytes
            self._force_anchor = False
            self._resumed = False
            self._last_delta = (v, delta)

        try:
            await self._commit(manifest, create=False)
        except PreconditionFailed:
            raise
        except StoreError:  # no answer: the pointer may have moved all the same (see _settle_unsure)
            self._unsure = (manifest, advance, time.perf_counter() - start)
            raise
        advance()
        if origin.restored:
            assert origin.parent is not None
            log.info(
                "v%d restores the weights of v%d (lineage step %d, epoch %d)%s", v, origin.parent.version,
                origin.step, origin.epoch,
                f": a new branch, v{origin.parent.version + 1}..v{v - 1} abandoned" if origin.parent.version < v - 1 else "",
            )
        if anchored and cfg.retain_anchors != 0:
            await self._retain()
        return PublishResult(
            v, anchored, step.count, manifest.elements, step.bytes, patches[1].bytes if len(patches) > 1 else 0, written, time.perf_counter() - start,
            epoch=origin.epoch, restored_from=origin.parent.version if origin.restored and origin.parent else None,
        )

    async def _settle_unsure(self, state: dict[str, np.ndarray]) -> PublishResult | None:
        """After a pointer write that got no answer (an outage), read the pointer: if the write
        landed, that version is committed (adopted here, not published twice, not taken for
        another publisher's); for the same state again (the caller retrying that publish) its
        result. StoreError while the store stays down (the caller retries)."""
        assert self._unsure is not None
        manifest, advance, seconds = self._unsure
        try:
            found = await read_pointer_etag(self.store, self.layout.run, trust=self.trust, plane=self.layout.plane)
        except MalformedPointer as exc:
            if not exc.untrusted:
                raise
            found = None  # not ours (ours are signed): it never landed
        self._unsure = None
        if found is None:
            return None
        pointer, etag = found
        if pointer.manifest != self.layout.version_manifest(manifest.version, manifest.attempt):
            return None  # it never landed: publish as usual
        log.warning("the pointer write of v%d landed although its answer was lost", manifest.version)
        self._etag, self.version, self._manifest = etag, manifest.version, manifest
        advance()
        if await asyncio.to_thread(diff, self._baseline, state, threads=self.config.threads):
            return None  # a newer state: publish it as the next version
        step = manifest.patch("step")
        return PublishResult(
            manifest.version, manifest.anchor.version == manifest.version, step.count if step else 0,
            manifest.elements, step.bytes if step else 0, 0, 0, seconds, epoch=manifest.origin.epoch,
        )

    async def _union_sources(self, head: VersionManifest) -> list[PatchRef] | None:
        """The patches whose changes make up the union since `head`'s anchor: the newest
        catch-up at or below `head` and the step patches after it (every step since the anchor
        when there is none), oldest first; None when a link is missing (then an anchor is due).
        Also counts the catch-up bytes written since the anchor."""
        anchor = head.anchor.version
        steps: list[PatchRef] = []
        newest: PatchRef | None = None
        reached = anchor  # the version the newest catch-up reaches (the anchor when none)
        try:
            async for m in walk_back(self.store, head, limit=head.version - anchor, trust=self.trust):
                if m.version <= anchor or m.anchor.version != anchor:
                    break
                catchup = m.patch("catchup")
                if catchup is not None:
                    self._catchup_bytes += catchup.bytes
                    if newest is None and catchup.covers(anchor):
                        newest, reached = catchup, m.version
                if newest is None:
                    step = m.patch("step")
                    if step is None or step.base_min != m.version - 1:
                        return None
                    steps.append(step)
        except ManifestError as exc:
            log.warning("cannot rebuild the catch-up union of v%d: %s; the next version is an anchor", head.version, exc)
            return None
        if reached + len(steps) != head.version:
            return None
        return ([newest] if newest is not None else []) + steps[::-1]

    # -- lineage ------------------------------------------------------------------------------
    def _ref(self, manifest: VersionManifest) -> Ref:
        return Ref(
            version=manifest.version,
            manifest=self.layout.version_manifest(manifest.version, manifest.attempt),
            state_digest=manifest.state_digest,
        )

    async def _origin(self, prev: VersionManifest, digest: str) -> Origin:
        """The lineage of the next version, whose state has `digest`: trained from `prev`, or,
        on the first publish since `open`, a restore of the newest committed version with the
        same state (`prev` itself, or an earlier one: a new branch)."""
        last = prev.origin
        trained = Origin(epoch=last.epoch, step=last.step + 1, parent=self._ref(prev))
        if not self._resumed:
            return trained
        if digest == prev.state_digest:
            return Origin(epoch=last.epoch, step=last.step, parent=self._ref(prev), restored=True)
        try:
            async for older in walk_back(self.store, prev, limit=RESTORE_SEARCH, trust=self.trust):
                if older.version < prev.version and older.state_digest == digest:
                    return Origin(epoch=last.epoch + 1, step=older.origin.step, parent=self._ref(older), restored=True)
        except ManifestError as exc:  # the chain is damaged further back: as far as it reads, no match
            log.warning("looking for the version v%d restores stopped at a malformed manifest: %s", prev.version + 1, exc)
        return trained

    # -- helpers ------------------------------------------------------------------------------
    async def _upload(self, objects: list[tuple[str, bytes]]) -> None:
        limit = asyncio.Semaphore(self.config.concurrency)

        async def put(key: str, data: bytes) -> None:
            async with limit:
                await self.store.put_if_absent(key, data)

        await asyncio.gather(*(put(k, d) for k, d in objects))

    async def _write_anchor(self, version: int, attempt: str, state, digest: str):
        extras = hf_config_files(self.config.extras_dir) if self.config.extras_dir else []
        return await write_anchor(
            self.store, self.layout, version=version, attempt=attempt, state=state, state_digest=digest,
            extras=extras, shard_bytes=self.config.shard_bytes, concurrency=self.config.concurrency, key=self.key,
        )

    async def _commit(self, manifest: VersionManifest, *, create: bool) -> None:
        """Write the manifest, then move the pointer (create it for the first version). In a
        signed run, PreconditionFailed when another signed manifest of the version exists."""
        key = self.layout.version_manifest(manifest.version, manifest.attempt)
        other = await self._signed_manifests(manifest.version)
        if other:
            raise PreconditionFailed(f"{other[0]} is already a signed manifest of v{manifest.version}")
        self._written.add(key)
        await self.store.put_if_absent(key, manifest.to_bytes(self.key))
        etag = None if create else self._etag
        self._etag = await self.store.cas(self.layout.pointer, self._pointer(manifest).to_bytes(self.key), etag)
        self.version, self._manifest = manifest.version, manifest

    def _pointer(self, manifest: VersionManifest) -> Pointer:
        return Pointer(
            run=self.layout.run, version=manifest.version, state_digest=manifest.state_digest,
            manifest=self.layout.version_manifest(manifest.version, manifest.attempt), anchor=manifest.anchor,
            updated_at=time.time(), epoch=manifest.origin.epoch, plane=self.layout.plane,
        )

    # -- freshness (signed runs) -------------------------------------------------------------
    async def _signed_manifests(self, version: int) -> list[str]:
        """Keys of the signed manifests of `version` this publisher did not write (signed runs;
        an unsigned or forged one is not a version: a worker's token cannot block the trainer)."""
        if self.trust is None:
            return []
        found = []
        async for info in self.store.list(self.layout.version_manifests_prefix(version)):
            if info.key not in self._written and await self._verified(info.key) is not None:
                found.append(info.key)
        return found

    async def _highest_signed(self, pointer: Pointer) -> VersionManifest | None:
        """The signed manifest of the highest version the bucket lists above the pointer's, or
        None (an unsigned run, or none above it). A publisher resumes from it: an old genuine
        pointer put back must not make it publish a version number again. Reads at most
        MAX_HEAD_CANDIDATES manifests, highest first."""
        if self.trust is None:
            return None
        after = f"{self.layout.versions_prefix}{version_str(pointer.version)}."  # past every attempt of it
        keys = []
        async for info in self.store.list(self.layout.versions_prefix, start_after=after):
            parsed = self.layout.parse_version_manifest(info.key)
            if parsed is not None and parsed[0] > pointer.version:
                keys.append((parsed[0], info.key))
        for _, key in sorted(keys, reverse=True)[:MAX_HEAD_CANDIDATES]:
            manifest = await self._verified(key)
            if manifest is not None:
                return manifest
        return None

    async def _verified(self, key: str) -> VersionManifest | None:
        try:
            return await read_manifest(self.store, key, trust=self.trust)
        except (ManifestError, NotFound):
            return None

    async def _retain(self) -> None:
        """Delete weight objects older than the oldest anchor kept (best effort)."""
        try:
            retain = self.config.retain_anchors
            if retain is None:
                retain = await run_retention(self.store, self.layout.run)
            if retain == 0:
                return
            anchors = sorted(
                {
                    parsed[0]
                    async for info in self.store.list(self.layout.anchors_prefix)
                    if info.key.endswith("/manifest.json")
                    and (parsed := self.layout.weight_object_version(info.key)) is not None
                    and parsed[0] <= (self.version or 0)
                }
            )
            window = max(self.config.retain_versions, await _staleness_window(self.store, self.layout.run))
            keep_from = retention_floor(anchors, retain=retain, head=self.version or 0, window=window)
            if keep_from is None:
                return
            doomed = []
            for prefix in (self.layout.versions_prefix, self.layout.patches_prefix, self.layout.anchors_prefix):
                async for info in self.store.list(prefix):
                    parsed = self.layout.weight_object_version(info.key)
                    if parsed is not None and parsed[0] < keep_from:
                        doomed.append(info.key)
            # Manifests first, so no reader finds a manifest whose patches are gone.
            doomed.sort(key=lambda k: (not k.startswith(self.layout.versions_prefix), k))
            for key in doomed:
                await self.store.delete(key)
            if doomed:
                log.info("retention: deleted %d objects older than anchor v%d", len(doomed), keep_from)
        except StoreError as exc:
            log.warning("retention skipped: %s", exc)


def retention_floor(anchors: list[int], *, retain: int, head: int, window: int) -> int | None:
    """The version below which retention deletes weight objects, or None to delete nothing.

    An anchor: the `retain`-th newest, or an older one when that one is within `window`
    versions of `head` (every version from `head - window + 1` on keeps its manifest and the
    objects it needs). `anchors` sorted ascending; `retain` >= 1."""
    assert retain >= 1 and window >= 1
    if len(anchors) <= retain:
        return None
    floor = anchors[-retain]
    oldest_needed = head - window + 1
    if floor > oldest_needed:
        older = [a for a in anchors if a <= oldest_needed]
        floor = older[-1] if older else anchors[0]
    return floor if floor > anchors[0] else None


async def _offered_planes(store: Store, run: str) -> tuple[QuantPlane, ...]:
    """The quantized planes the run manifest offers; none without a readable one (a warning
    says why when it does not parse)."""
    try:
        return (await read_run_manifest(store, run)).planes
    except RunNotFound:
        return ()
    except ValueError as exc:
        log.warning("%s; publishing no quantized plane until it is fixed", exc)
        return ()


async def _staleness_window(store: Store, run: str) -> int:
    """The run's staleness_limit + 2 (the versions a consumer checks records against), 0 when
    the run manifest cannot be read."""
    try:
        return (await read_run_manifest(store, run)).staleness_limit + 2
    except (RunNotFound, ValueError):
        return 0


def _elements(state: Mapping[str, np.ndarray]) -> int:
    return int(sum(bits.size for bits in state.values()))
