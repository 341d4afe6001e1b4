"""Trainer-side glue: publish slime's weights as a PULSE version after every `update_weights`.

With `--rollout-num-gpus 0` slime starts no SGLang engines and `MegatronTrainRayActor.update_weights`
returns early. `patches/slime_publish_weights.patch` (applied with
`scripts/apply_slime_patches.py`) makes that branch call `publish_weights(self, args)` instead
when `args.stoa_publish` is true. slime calls `update_weights` once before its train loop (the
first call of a new run writes the anchor v0) and once after every rollout's training.

Settings are attributes of slime's `args`, normally from the `--custom-config-path` YAML (slime
sets every key of that file on `args`, in every process): `stoa_publish: true`, `stoa_bucket`,
`stoa_run` and the publisher's knobs, parsed by `slime_stoa.trainer.slime.settings.StoaSettings`
and listed in docs/slime.md.

Background publishing (the default). The weights are gathered on every rank (slime's
collective HF weight iterator); rank 0's copy of them is the snapshot: it is handed to the
publisher's own thread, which diffs, encodes and uploads it while training goes on, and
`update_weights` returns. The next publish first waits for the previous one if it is still
running (that wait is logged and returned as `Handoff.wait_s`), so at most one version is in
flight and versions commit in order. A failure of the background publish is logged when it
happens and raised by the next `update_weights` on every rank (as a synchronous publish would
have raised it); store outages are waited out inside the background publish. At exit
the version in flight is finished before the store is closed. Rank 0 holds one more copy of
the weights in CPU memory while a version is in flight (the snapshot, beside the publisher's
baseline). The rollout function waits for the pointer to move after each train step
(`stoa_publish_grace_s`), which includes the upload: give it more than the longest publish
(an anchor). `stoa_background_publish: false` publishes inside `update_weights`.

Pointer freshness. From the moment it opens (the first `update_weights`, which resumes from the
bucket's pointer) until it closes, the publisher re-signs its pointers every `refresh_s`
(`pulse.keepalive.PointerKeeper`, on its loop thread, between publishes), so workers joining for
the first time take its pointer while slime trains or evaluates (`pulse.freshness`).

The published names are exactly the `--hf-checkpoint` folder's (`hf_names.head_plan`): a tied
model at pipeline parallelism > 1 gathers the last stage's `output_layer.weight`, which slime's
converter names `lm_head.weight`; for a folder that ties its head and stores none it is left out
(a warning if it drifted from the embedding), and a tied folder that stores one gets the
embedding's copy.

The device path (`stoa_device_budget_bytes` set; `device_publish`): instead of copying every
gathered tensor to the host (`tensor_bits`, the default numpy path), rank 0 diffs each chunk
where it lives against the device's copy of the committed version, and only that delta crosses:
once a version is committed or resumed the publisher hands its host baseline to the device path
and keeps none, nor any quantized plane's (`release_baseline`); each version is handed over as its
change from the device's copy, and each plane's change from the plane of that copy, quantized on
the device (`device_publish.DeviceDelta`), and published by `Publisher.publish_delta`, so no host
copy of the state or of a plane is kept per version. A `StaleBase` (the committed state is not the
device's copy: a lost pointer answer that landed) brings the copy to the committed state and diffs
the same version again, or, when the committed state cannot be read back from the bucket, publishes
the version as a fresh anchor (`_publish_as_anchor`). The published bytes are the numpy path's.

Only bf16 weights are published: the HF tensors are gathered without quantization, and float16 or
float32 tensors are cast to bf16. The PPO critic path (`use_critic` with `offload_train`) never
reaches the patched branch, and slime's `keep_old_actor` queue is not advanced by a publish.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.thread  # registers its exit hook before any SyncPublisher registers one
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from slime_stoa.protocol.layout import QuantPlane
from slime_stoa.protocol.pulse.chain_keeper import kept_publisher_store
from slime_stoa.protocol.pulse.codec import Delta, check_bits
from slime_stoa.protocol.pulse.freshness import REFRESH_S
from slime_stoa.protocol.pulse.keepalive import PointerKeeper
from slime_stoa.protocol.pulse.plane_siblings import model_type_of
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig, PublishResult, StaleBase, UntrustedState
from slime_stoa.protocol.pulse.retry import DEFAULT_BACKOFF_S, DEFAULT_RETRIES, publish_with_retries
from slime_stoa.protocol.pulse.sync_result import SyncError
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store, open_store

from ..loop_thread import LoopThread
from .gathered import (
    Collector,
    Committed,
    HostCollector,
    NamedTensors,
    add_chunk,
    check_tied_head,
    chunks_to_state,
    tensor_bits,
)
from .hf_names import TIED_HEAD, HeadPlan, family_converter, head_plan
from .settings import StoaSettings, settings_from_args

if TYPE_CHECKING:  # the device path imports torch: only loaded when it is configured
    from .device_publish import DeviceDelta, Gatherer

__all__ = [  # the gathered state's pieces, kept importable from here
    "Collector", "Committed", "HostCollector", "NamedTensors", "add_chunk", "check_tied_head", "chunks_to_state",
    "tensor_bits",
]


class DeviceHook(Protocol):
    """What the publisher asks of the device path (`device_publish.DevicePath`)."""

    @property
    def by_delta(self) -> bool:
        """The publisher handed its baseline over (`adopt`): versions come as `DeviceDelta`s."""

    def collector(self, publisher: SyncPublisher) -> Callable[[HeadPlan], Gatherer]:
        """How the next gather collects the state (called while no publish is in flight)."""

    def adopt(
        self, baseline: Mapping[str, np.ndarray], digest: str, *, planes: tuple[QuantPlane, ...] = (),
        model_type: str | None = None,
    ) -> None:
        """Take the committed state (digest root `digest`) the publisher released, and compute
        `planes` (quantized for `model_type`) of each version from now on."""

    def published(self, handed: DeviceDelta, digest: str) -> None:
        """`handed` committed, its state's digest root `digest`."""

    def rebase(self, handed: DeviceDelta, committed: Mapping[str, np.ndarray], digest: str) -> None:
        """Rebuild the copy from the committed state and diff `handed`'s version again."""

    def rebase_by_step(self, handed: DeviceDelta, step: Delta, digest: str) -> None:
        """Bring the copy to the committed version by its step and diff `handed`'s version again."""

    def version_on_host(self, handed: DeviceDelta) -> dict[str, np.ndarray]:
        """`handed`'s whole version on the host."""

    def forget(self) -> None:
        """The copy is no committed version any more: host copies until the next `adopt`."""

log = logging.getLogger(__name__)

MiB = 1 << 20

# -- a Publisher for synchronous callers ---------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Handoff:
    """What handing a state to the background publisher cost the caller (`SyncPublisher.submit`)."""

    wait_s: float  # waiting for the previous publish to finish (0 when it had)
    snapshot_s: float  # copying the state (0 when the caller handed its arrays over)
    blocked_s: float  # the whole call: wait, snapshot and hand-off
    previous: PublishResult | None  # the last committed publish before this one (None: none yet)


class SyncPublisher:
    """A `Publisher` running on its own event-loop thread, callable from synchronous code.

    The store is opened from `url` on that loop, so its connections live on one loop for the
    whole run. Every publish retries store failures (`PublishError`, `StoreUnavailable`) up to
    `retries` times with exponential backoff and waits out outages (`publish_with_retries`); a
    `PublishConflict` (another publisher owns the run) is raised at once. A failed publish never
    moves the pointer nor the baseline.

    `publish` returns when the version is committed. `submit` hands the state over and returns
    at once: the version is published on the loop thread while the caller goes on. At most one
    version is in flight: the next `submit`, `publish`, `wait` or `close` waits for it first, and
    raises its error if it failed (it is also logged when it happens).
    """

    def __init__(
        self,
        url: str,
        run: str,
        config: PublisherConfig = PublisherConfig(),
        *,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        environ: Mapping[str, str] | None = None,
        create: bool = False,
        key: SigningKey | None = None,
        device: DeviceHook | None = None,
        refresh_s: float = REFRESH_S,
    ) -> None:
        if retries < 0 or backoff_s < 0:
            raise ValueError("retries and backoff_s must be >= 0")
        # re-signs the pointers and keeps the live weight chain whole, on the loop once opened
        self._keeper = PointerKeeper.of_publisher(lambda: self._publisher, every_s=refresh_s)
        self.url, self.run, self.config = url, run, config
        self.device = device  # the device path's state (None: the numpy path)
        self.key = key  # the run key: signs every version (None: an unsigned run)
        self.retries, self.backoff_s = retries, backoff_s
        self._publisher: Publisher | None = None
        self._store: Store | None = None
        self._lock = threading.RLock()
        self._closed = False
        self._inflight: concurrent.futures.Future[PublishResult] | None = None
        self._task: asyncio.Future[PublishResult] | None = None  # the same publish, on the loop
        self.last: PublishResult | None = None  # the last committed publish
        self._loop = LoopThread(f"stoa-publisher-{run}", on_close=self._aclose)
        try:
            self._store = self._loop.call(self._open_store(environ, create))
        except BaseException:
            self._loop.close()
            raise
        _finish_at_exit(self)

    async def _open_store(self, environ: Mapping[str, str] | None, create: bool) -> Store:
        # with a keep_dir: the chain objects it writes are kept, and what a writer spoiled while no
        # trainer ran is put back before the publisher resumes from it
        return await kept_publisher_store(open_store(self.url, environ=environ, create=create), self.run,
                                          self.config.keep_dir)

    async def _aclose(self) -> None:
        task = self._task
        if task is not None and not task.done():  # at exit: finish the version in flight first
            log.info("stoa: finishing the background publish before closing")
            await asyncio.wait([task])
        await self._keeper.stop()
        if self._store is not None:
            await self._store.close()

    @property
    def version(self) -> int | None:
        """The last published version (None before `open` or for a new run)."""
        return self._publisher.version if self._publisher else None

    def open(self) -> int | None:
        """Resume from the run's pointer (once); the published version, None for a new run."""
        with self._lock:
            self._check_open()
            return self._loop.call(self._open_and_release())

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SyncPublisher is closed")

    async def _open_and_release(self) -> int | None:
        version = await self._open()
        self._release()
        return version

    async def _open(self) -> int | None:
        # Runs on the loop while the caller holds `_lock`.
        if self._publisher is None:
            assert self._store is not None
            publisher = Publisher(self._store, self.run, self.config, key=self.key)
            version = await publisher.open()
            self._publisher = publisher  # only once open succeeded; a failed open is retried afresh
            where = f"resuming after v{version}" if version is not None else "new run"
            log.info("stoa: publishing weights to run %s at %s (%s)", self.run, self.url, where)
            self._keeper.start()  # the resumed pointer is kept fresh from now on, published to or not
        return self._publisher.version

    def _release(self) -> None:
        """The device path: once a version is committed (or resumed), the publisher's state goes to
        the device path and the publisher keeps none, nor any plane's (by delta from now on)."""
        publisher, device = self._publisher, self.device
        if device is None or publisher is None or not publisher.weights.holds_state:
            return
        digest = publisher.state_digest
        if publisher.version is None or digest is None:
            return
        planes = tuple(sorted(publisher.planes))
        device.adopt(publisher.release_baseline(), digest, planes=planes, model_type=model_type_of(self.config))

    def committed(self) -> Committed | None:
        """The last committed bf16 version of an opened publisher (None: not opened, or a new
        run). Read it while no publish is in flight (after `wait`): the baseline changes in place
        when a version commits. Its baseline is empty once the publisher released it (publishing
        by delta: the device path holds the state then)."""
        publisher = self._publisher
        if publisher is None or publisher.version is None or publisher.state_digest is None:
            return None
        baseline = publisher.weights.baseline if publisher.weights.holds_state else {}
        return Committed(publisher.version, publisher.state_digest, baseline)

    def publish(self, state: Mapping[str, np.ndarray] | DeviceDelta) -> PublishResult:
        """Publish `state` (uint16 bf16 bits, or the device path's `DeviceDelta`) as the next
        version, retrying store failures, and return once it is committed (after the one in
        flight, if any)."""
        with self._lock:
            self._check_open()
            self.wait()
            self.last = self._loop.call(self._publish(state))
            return self.last

    async def _publish(self, state: Mapping[str, np.ndarray] | DeviceDelta) -> PublishResult:
        async def attempt() -> PublishResult:
            await self._open()
            publisher = self._publisher
            assert publisher is not None
            if not isinstance(state, Mapping):
                return await self._publish_delta(publisher, state)
            if not publisher.weights.holds_state:
                raise ValueError(
                    f"run {self.run!r} publishes by delta (the device path holds the committed state): "
                    "hand the device path's DeviceDelta, not a full state"
                )
            result = await publisher.publish(state)
            self._release()  # a run's first version: by delta from the next one
            return result

        async with self._keeper.lock:  # no refresh while a version commits (they share the pointer's ETag)
            return await publish_with_retries(
                attempt, retries=self.retries, backoff_s=self.backoff_s,
                what=f"publishing weights to run {self.run!r} at {self.url}",
            )

    async def _publish_delta(self, publisher: Publisher, handed: DeviceDelta) -> PublishResult:
        """Publish the device path's `handed` by delta; after a `StaleBase`, rebuild the device's
        copy from the committed state read back from the bucket and diff the version again (the
        stale step writes nothing). The device's copy advances once the version is committed."""
        device = self.device
        assert device is not None
        try:
            result = await publisher.publish_delta(handed.step, base=handed.base, planes=handed.planes)
        except StaleBase as exc:
            weights, digest = publisher.weights, publisher.state_digest
            assert weights.head is not None and digest is not None
            parent, last = weights.head.parent, weights.last_delta
            if parent is not None and parent.state_digest == handed.base and last and last[0] == weights.version:
                # the version after the copy's committed (a lost answer that landed): its step is known
                log.warning("stoa: %s; bringing the device's copy to v%d by its step and diffing this version again",
                            exc, weights.version)
                await asyncio.to_thread(device.rebase_by_step, handed, last[1], digest)
            else:
                log.warning("stoa: %s; rebuilding the device's copy from the bucket's v%s and diffing this version "
                            "again", exc, weights.version)
                try:
                    committed = await weights.committed_state()
                except (UntrustedState, SyncError) as lost:
                    return await self._publish_as_anchor(publisher, handed, lost)
                await asyncio.to_thread(device.rebase, handed, committed, digest)
                del committed
            # the planes as the host path leaves them: not stepped to the version the settle adopted
            result = await publisher.publish_delta(handed.step, base=handed.base, planes=handed.planes, step_behind=False)
        digest = publisher.state_digest
        assert digest is not None
        device.published(handed, digest)
        return result

    async def _publish_as_anchor(self, publisher: Publisher, handed: DeviceDelta, lost: Exception) -> PublishResult:
        """After a `StaleBase` whose committed state cannot be read back from the bucket (an object
        of its chain spoiled and not put back, e.g. an anchor shard): `handed`'s version published
        as a fresh anchor of the trainer's own weights, read once to the host, and handed to the
        device path as the committed state (by delta again from the next version), as after a
        restart over a lost chain."""
        device = self.device
        assert device is not None
        log.warning("stoa: the committed v%s cannot be read back from the bucket (%s); publishing this version as "
                    "a fresh anchor of the trainer's weights", publisher.version, lost)
        state = await asyncio.to_thread(device.version_on_host, handed)
        publisher.weights.lose_baseline()
        device.forget()
        result = await publisher.publish(state)
        del state
        self._release()
        return result

    def submit(
        self, state: Mapping[str, np.ndarray] | DeviceDelta, *, copy: bool = True, gather_s: float = 0.0
    ) -> Handoff:
        """Publish `state` as the next version in the background; returns once it is handed over.

        First waits for the version in flight, if any (its error is raised here: nothing was
        handed over). With `copy` the arrays are copied before the call returns, so the caller
        may reuse them at once; without it the caller hands them over (they are made read-only)
        and must not write them again. A `DeviceDelta` is handed over as it is (its arrays are
        the delta's own, its tensors read from the device's copy, which the caller's next gather
        does not touch before this publish is waited for). ValueError for a state that is not
        uint16 arrays.
        `gather_s` (how long the caller took to gather the state) only goes into the log line.
        """
        start = time.perf_counter()
        with self._lock:
            self._check_open()
            checked = {name: check_bits(name, bits) for name, bits in state.items()} if isinstance(state, Mapping) else None
            waited = self.wait()
            previous = self.last
            snap_start = time.perf_counter()
            snapshot: dict[str, np.ndarray] | DeviceDelta
            if checked is None:
                assert not isinstance(state, Mapping)
                snapshot = state
            elif copy:
                snapshot = {name: bits.copy() for name, bits in checked.items()}
            else:
                snapshot = checked
                for bits in snapshot.values():
                    bits.flags.writeable = False
            snapshot_s = time.perf_counter() - snap_start
            blocked = time.perf_counter() - start
            self._inflight = asyncio.run_coroutine_threadsafe(
                self._background(snapshot, gather_s=gather_s, wait_s=waited, blocked_s=blocked), self._loop.loop
            )
            return Handoff(wait_s=waited, snapshot_s=snapshot_s, blocked_s=blocked, previous=previous)

    async def _background(
        self, state: dict[str, np.ndarray] | DeviceDelta, *, gather_s: float, wait_s: float, blocked_s: float
    ) -> PublishResult:
        self._task = asyncio.current_task()
        try:
            result = await self._publish(state)
        except BaseException as exc:
            log.error(
                "stoa: background publish to run %r failed; the pointer did not move and the error is raised "
                "by the next publish: %s: %s", self.run, type(exc).__name__, exc,
            )
            raise
        log.info(format_result(result, gather_s=gather_s, wait_s=wait_s, blocked_s=blocked_s))
        return result

    def wait(self) -> float:
        """Wait for the version in flight (if any) to be committed; raises its error if it failed
        (once: the next call goes on). Returns the seconds waited."""
        start = time.perf_counter()
        with self._lock:
            future, self._inflight = self._inflight, None
            if future is None:
                return 0.0
            try:
                self.last = future.result()
            finally:
                self._task = None
            return time.perf_counter() - start

    @property
    def busy(self) -> bool:
        """A background publish is in flight."""
        future = self._inflight
        return future is not None and not future.done()

    def close(self) -> None:
        """Finish the version in flight (its error is logged, not raised), close the store and
        stop the loop thread (idempotent; also at exit)."""
        with self._lock:
            if not self._closed:
                try:
                    self.wait()
                except Exception as exc:
                    log.error("stoa: the last background publish failed: %s: %s", type(exc).__name__, exc)
            self._closed = True
            self._loop.close()

    def __enter__(self) -> SyncPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _finish_at_exit(publisher: SyncPublisher) -> None:
    """Close `publisher` (finishing the version in flight) when the interpreter exits normally,
    while thread pools still take work: at the threading module's shutdown, which runs before
    `atexit` and in reverse order of registration, so before concurrent.futures stops its pools.
    A process killed without its exit handlers (SIGKILL, a force-killed Ray actor) loses the
    version in flight; its weights are in the trainer's checkpoint."""
    ref = weakref.ref(publisher)

    def finish() -> None:
        alive = ref()
        if alive is not None:
            alive.close()

    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython: LoopThread's own atexit close still runs (thread pools may be gone)
        return
    with contextlib.suppress(RuntimeError):  # created during interpreter shutdown: too late
        register(finish)


_PUBLISHER: SyncPublisher | None = None


def get_publisher(settings: StoaSettings) -> SyncPublisher:
    """The process-wide SyncPublisher, created from the settings on first use."""
    global _PUBLISHER
    if _PUBLISHER is None:
        s = settings
        device = None
        if s.device_budget_bytes is not None:
            from .device_publish import DevicePath

            device = DevicePath(s.device_budget_bytes)
        _PUBLISHER = SyncPublisher(  # closed at exit
            s.bucket, s.run, s.publisher, retries=s.publish_retries, backoff_s=s.publish_backoff_s, key=s.run_key,
            device=device,
        )
    return _PUBLISHER


# -- the slime hook ------------------------------------------------------------------------------
def publish_weights(actor: Any, args: Any) -> PublishResult | Handoff | None:
    """Publish the actor's current weights (called by the patched `update_weights` on every rank).

    Every rank iterates slime's collective HF weight iterator; rank 0 keeps the bf16 bits and
    publishes them — handed to the background publisher (a `Handoff` is returned), or with
    `stoa_background_publish: false` published before returning (the `PublishResult`). Then the
    outcome is broadcast on slime's Gloo group, which also synchronises the ranks as slime's own
    weight updaters do with a Gloo barrier. A failure on rank 0 (including the previous
    background publish's) is raised on every rank. None on the other ranks.
    """
    import torch.distributed as dist
    from slime.utils.distributed_utils import get_gloo_group

    # Same args on every rank: a bad setting fails everywhere, before any collective starts.
    settings = settings_from_args(args)
    background = settings.background_publish
    rank = dist.get_rank()
    error: Exception | None = None
    waited = 0.0
    collect: Callable[[HeadPlan], Gatherer] | None = None
    if rank == 0:
        try:
            publisher = get_publisher(settings)
            if background:  # before the gather: at most one more copy of the weights in memory
                waited = publisher.wait()
            if publisher.device is not None:  # no publish in flight now: the device path syncs with it
                collect = publisher.device.collector(publisher)
        except Exception as exc:  # reported to every rank below, after the collective
            error = exc
    start = time.perf_counter()
    state, gather_error = gather_state(actor, args, keep=rank == 0, collect=collect)
    gathered = time.perf_counter()
    error = error or gather_error
    result: PublishResult | Handoff | None = None
    if rank == 0 and error is None:
        try:
            publisher = get_publisher(settings)
            if background:  # the gathered arrays are fresh copies: hand them over
                handoff = publisher.submit(state, copy=False, gather_s=gathered - start)
                result = replace(handoff, wait_s=handoff.wait_s + waited, blocked_s=handoff.blocked_s + waited)
            else:
                result = publisher.publish(state)
        except Exception as exc:  # reported to every rank below
            error = exc
    del state
    outcome: list[str | None] = [f"{type(error).__name__}: {error}" if error is not None else None]
    dist.broadcast_object_list(outcome, src=0, group=get_gloo_group())
    if error is not None:
        raise error
    if outcome[0] is not None:
        raise RuntimeError(f"stoa: rank 0 failed to publish the weights: {outcome[0]}")
    if isinstance(result, PublishResult):
        log.info(format_result(result, gather_s=gathered - start))
    elif isinstance(result, Handoff):
        log.info(
            "stoa: weights handed to the background publisher (gather %.1fs, waited %.1fs for the previous "
            "publish, blocked %.2fs)", gathered - start, result.wait_s, result.blocked_s,
        )
    return result


def gather_state(
    actor: Any, args: Any, *, keep: bool, collect: Callable[[HeadPlan], Gatherer] | None = None
) -> tuple[dict[str, np.ndarray] | DeviceDelta, Exception | None]:
    """Iterate slime's HF weight chunks (collective); where `keep`, collect them as bf16 bits
    (by `collect(plan)`'s collector; `HostCollector`, copying them, by default), or, by delta,
    as the device path's `DeviceDelta`.

    A conversion error is returned, not raised, after the iteration finished, so that no rank
    leaves the collective early. Mirrors slime's engine path for `--offload-train`: the process
    groups are reloaded around the gather and the memory saver is bypassed.
    """
    import torch
    from slime.utils import accelerator

    offload = bool(getattr(args, "offload_train", False))
    guard: Any = nullcontext()
    if offload:
        from slime.utils.reloadable_process_group import (
            destroy_process_groups,
            reload_process_groups,
        )
        from torch_memory_saver import torch_memory_saver

        reload_process_groups()
        guard = torch_memory_saver.disable()
    state: dict[str, np.ndarray] | DeviceDelta = {}
    error: Exception | None = None
    plan = tied_head(actor, args) if keep else HeadPlan()
    collector = (collect or HostCollector)(plan)
    if plan.error is not None:
        error = ValueError(f"stoa: {plan.error}")
    try:
        with guard, torch.no_grad():
            chunks = hf_weight_iterator(actor, args).get_hf_weight_chunks(
                actor.weights_backuper.get("actor"),  # slime's CPU copy, refreshed after each train
                progress_desc="stoa: gather weights",
                should_convert_chunk=lambda _idx: keep,  # HF conversion (and its state) on rank 0 only
            )
            for chunk in chunks:
                if keep and error is None:
                    try:
                        collector.add(chunk)
                    except Exception as exc:
                        error = exc
                del chunk
        accelerator.empty_cache()
    finally:
        if offload:
            destroy_process_groups()
    if keep and error is None:
        try:
            state = collector.finish()
        except Exception as exc:
            error = exc
    return state, error


def tied_head(actor: Any, args: Any) -> HeadPlan:
    """`hf_names.head_plan` for slime's `--hf-checkpoint` folder and the actor's HF config
    (cached on the actor: it does not change during a run)."""
    plan = getattr(actor, "_stoa_head_plan", None)
    if plan is None:
        hf = getattr(args, "hf_checkpoint", None)
        folder = Path(hf) if isinstance(hf, str) and hf and Path(hf).is_dir() else None
        plan = head_plan(
            folder, untied=bool(getattr(args, "untie_embeddings_and_output_weights", False)),
            hf_config=getattr(actor, "hf_config", None),
        )
        if plan.drop:
            log.info("stoa: the HF folder ties its output head: %s (the last pipeline stage's copy) is not published",
                     TIED_HEAD)
        actor._stoa_head_plan = plan
    return plan


def hf_weight_iterator(actor: Any, args: Any) -> Any:
    """slime's HfWeightIteratorDirect for this actor (built once: building it is a collective)."""
    iterator = getattr(actor, "_stoa_hf_iterator", None)
    if iterator is None:
        from slime.backends.megatron_utils.update_weight.hf_weight_iterator_direct import (
            HfWeightIteratorDirect,
        )

        model_name = getattr(args, "model_name", None) or type(actor.hf_config).__name__.lower()
        iterator = HfWeightIteratorDirect(
            args=args,
            model=actor.model,
            model_name=model_name,
            quantization_config=None,  # always bf16: stoa's weight plane carries bf16 bits
            transform_ue8m0=False,
        )
        if (convert := family_converter(actor.hf_config)) is not None:  # a family slime cannot name
            iterator._convert_to_hf_named_tensors = convert
        actor._stoa_hf_iterator = iterator
    return iterator


def format_result(
    result: PublishResult, *, gather_s: float = 0.0, wait_s: float | None = None, blocked_s: float | None = None
) -> str:
    """One log line per published version; `wait_s`/`blocked_s` for a background publish (how
    long its hand-off waited for the previous publish, and held the caller in all)."""
    line = (
        f"stoa: published weights v{result.version} anchored={result.anchored} "
        f"density={result.density:.6f} patch={result.patch_bytes / MiB:.2f}MiB "
        f"catchup={result.catchup_bytes / MiB:.2f}MiB anchor={result.anchor_bytes / MiB:.2f}MiB "
        f"full={result.full_bytes / MiB:.2f}MiB gather={gather_s:.1f}s publish={result.seconds:.1f}s"
    )
    if wait_s is not None:
        line += f" background wait={wait_s:.1f}s blocked={blocked_s or 0.0:.2f}s"
    if result.restored_from is not None:
        line += f" restores=v{result.restored_from} epoch={result.epoch}"
    return line
