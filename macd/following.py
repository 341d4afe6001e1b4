"""Following the run's weights beside generation and installing each version at a safe point.

Who owns what: the weights' bytes belong to the live weights (`weights.LiveWeights`: the MLX
model's memory and the bits that are it, or on int8 the bf16 master beside it), written only on
the MLX thread (`mlx_thread`). The subscriber (`pulse.subscriber`, deferred) owns no bytes: it
polls, downloads and verifies on the asyncio side while the MLX thread generates, reading the
held bits lent read-only for the length of a sync (`LiveWeights.bits`), and returns the
verified version staged (a patch's final bits, or an anchor's new state).

One install path, every plane (bf16, int8 from the bf16 master, a published int8/int4 plane
held alone): at the generation loop's next safe point (`WeightFollower.swap`), the MLX thread
installs the staged version in one call (`LiveWeights.install_version`); then the subscriber
stands at it (`Subscriber.advance`). A version the model cannot take changes nothing: the
model keeps serving, and the subscriber stays at, the version it holds. If the model could not
be brought back (it then holds no verified version), the subscriber forgets its version and the
next sync restores the model from an anchor. On a published quantized plane the groups carry
the state digest of the bf16 version the plane quantizes (the plane's manifest names it,
signed), the one the trainer checks records against (`served_digest`).

Trust on first use, bounded in time: in a signed run a worker that never installed the run's
weights (no head kept, `run_pin`) takes only a pointer signed within `FIRST_POINTER_MAX_AGE_S`
of the store's clock (`clock.StoreClock`, not this Mac's), as a live trainer re-signs its
pointers every `REFRESH_S` (`pulse.keepalive`): an old genuine pointer put back is refused, and
while the pointer is too old the worker waits, repeating one line that says why
(`freshness.stale_first_pointer`). A worker with a head kept is bound by that head, not by time.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from slime_stoa.protocol.hf.architectures import unsupported_model
from slime_stoa.protocol.layout import QuantPlane, check_plane
from slime_stoa.protocol.pulse.anchor import download_extras, fetch_verified
from slime_stoa.protocol.pulse.freshness import FIRST_POINTER_MAX_AGE_S
from slime_stoa.protocol.pulse.history import read_anchor_manifest, read_pointer
from slime_stoa.protocol.pulse.manifests import VersionManifest
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.pulse.sync_result import StagedSync, SyncError, SyncResult, WeightsRefused
from slime_stoa.protocol.run_manifest import Plane, RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.store import Store, StoreConfigError, StoreError
from slime_stoa.protocol.store.retry import describe_error

from .aio import Wakeup, wait
from .clock import StoreClock
from .cmdline import run_create_command
from .config import DaemonConfig, decoding_sequences, plane_override
from .fatal import Fatal
from .index_plan import run_index_plan
from .machine import memory_bytes
from .mlx_thread import MLXThread, return_freed_memory
from .options import WorkerOptions
from .plane_choice import choose_plane
from .reporting import Reporter
from .run_pin import head_path, remember_head, remembered_head
from .shared_dir import machine_shared_dir

if TYPE_CHECKING:
    from .generate import Generator, Model, Tokenizer
    from .weights import LiveWeights

log = logging.getLogger("macd")
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class SwapRecord:
    """One version change of the live model (seconds)."""

    version: int  # installed
    path: str  # how the subscriber reached it ("step", "chain", "catchup", "catchup+chain", "anchor...")
    ready_s: float  # poll, download, verify, all beside generation
    drain_s: float  # from then to the safe point; in-flight groups kept decoding
    drain_steps: int  # decode steps taken from then to the safe point (at most swap_drain_s's worth + 1)
    pause_s: float  # decoding stopped: drop what was in flight, wait for MLX, install
    install_s: float  # the install itself, on the MLX thread (a patch: its scatter, and int8's re-quantized groups)
    dropped: int  # groups in flight at the safe point, dropped and restarted on the new weights


@dataclass
class _SwapClock:
    """perf_counter() marks of one version change."""

    synced: float = 0.0  # the sync started
    asked: float = 0.0  # the install was asked for
    paused: float = 0.0  # decoding stopped
    installed: float = 0.0  # the install started
    resumed: float = 0.0  # decoding may go on
    dropped: int = 0
    steps: int = 0  # decode steps taken while the install waited for a safe point


@dataclass
class Pending:
    """An install waiting for the generation loop's next safe point."""

    install: Callable[[], Any]  # runs on the MLX thread
    version: int
    digest: str
    future: asyncio.Future


class WeightFollower:
    """The worker's weights: the subscriber, the live model it installs into (`live`), the
    version and digest the model computes with (`installed`), and the install waiting for a safe
    point (`pending`, taken by the generation loop with `swap`)."""

    def __init__(
        self, store: Store, config: DaemonConfig, options: WorkerOptions, mlx: MLXThread, reporter: Reporter,
        wake: Wakeup,
    ) -> None:
        self.store, self.config, self.options, self.mlx, self.reporter, self.wake = (
            store, config, options, mlx, reporter, wake
        )
        self.sub: Subscriber | None = None
        self.now: Callable[[], float] = StoreClock(store)  # what a first join judges the pointer's age by
        self.live: LiveWeights | None = None
        self.installed: tuple[int, str] = (-1, "")  # (version, state digest) the model computes with
        self.plane: Plane = "bf16"  # the plane the model serves (`load_model`); records name it
        self.generating = False  # a generation loop takes installs at its safe points
        self.pending: Pending | None = None
        self.clock = _SwapClock()  # the version change under way
        self.swaps: collections.deque[SwapRecord] = collections.deque(maxlen=1000)  # the latest version changes

    def subscriber(self, trust: RunTrust | None, plane: QuantPlane | None = None) -> Subscriber:
        """The worker's subscriber, of the run's bf16 weights or of its published `plane`
        (`held_plane`); in a signed run it refuses pointers below the highest weights this
        worker installed before (`run_pin`), across restarts, and on a first join (no head
        kept) a pointer signed too long ago by the store's clock (module doc)."""
        if self.sub is None:
            self.sub = Subscriber(self.store, self.config.run, trust=trust, deferred=True, plane=plane)
            self.sub.now = self.now
            if trust is not None:
                self.sub.floor = remembered_head(self.config.data_dir, self.config.run)
                if self.sub.floor is None:
                    self.sub.first_pointer_max_age_s = FIRST_POINTER_MAX_AGE_S
        return self.sub

    async def plane_for(self, manifest: RunManifest, trust: RunTrust | None) -> Plane:
        """The plane this Mac serves the run on (`plane_choice`): the run's, or, when the run
        publishes quantized planes, a smaller one if the run's does not fit this Mac's memory.
        The model's config is read from the run's bf16 anchor (the run's plane when it cannot be),
        the size of the run's search index from its manifest (`index_plan`).
        The daemon config's `plane` overrides the pick (`Fatal` when the run cannot be served on it);
        TaskDataRefused when a signed run's task data the index plan reads is refused."""
        if self.config.plane:
            try:
                plane = plane_override(manifest, self.config.plane)
            except ValueError as exc:  # the config asks what the run cannot serve: no retry changes that
                raise Fatal(f"{exc}: change `plane` in the config (`macd join --plane PLANE`, or leave it out "
                            f"to serve the largest plane that fits)") from None
            log.info("plane for this Mac: %s (the daemon config's)", plane)
            return plane
        if not manifest.planes:
            return manifest.plane
        try:
            pointer = await read_pointer(self.store, self.config.run, trust=trust)
            anchor = await read_anchor_manifest(self.store, pointer.anchor.manifest, trust=trust)
            entry = next((f for f in anchor.extras if f.name == "config.json"), None)
            model_config = None if entry is None else json.loads(await fetch_verified(self.store, entry))
        except StoreConfigError:
            raise
        except Exception as exc:  # nothing published yet, or a malformed object: the run's plane
            log.info("serving the run's %s plane: its model config is not readable (%s)", manifest.plane, describe_error(exc))
            return manifest.plane
        sequences = decoding_sequences(self.config, manifest.group_size)
        index = await run_index_plan(self.store, manifest, machine_shared_dir(), trust)
        if index is not None and index.refused is not None:
            raise index.refused  # a signed run's split replaced since it was loaded: waited for as the task load is
        choice = None if not isinstance(model_config, dict) else choose_plane(
            model_config, manifest, memory=memory_bytes(), sequences=sequences,
            index_bytes=0 if index is None else index.counted,
        )
        if choice is None:
            return manifest.plane
        log.info("plane for this Mac: %s", choice.describe())
        return choice.plane

    def keep_head(self) -> None:
        """Keep the head of a signed run's installed weights for the next start (best effort)."""
        sub = self.sub
        if sub is None or sub.trust is None or sub.head is None:
            return
        try:
            remember_head(self.config.data_dir, self.config.run, sub.head)
        except OSError as exc:
            log.warning("could not keep the installed weights' version in %s: %s", self.config.data_dir, exc)

    # -- cold start ------------------------------------------------------------------------------
    async def first_sync(self, sub: Subscriber, stop: asyncio.Event) -> StagedSync | None:
        """Wait for the run's weights and sync to them: the verified state staged, for
        `load_model` to build the model holding it; None if stopped first.

        A malformed or unreadable pointer or manifest, or a store outage, is reported and the
        pointer polled again. A pointer too old for a first join is waited on with one line that
        says why, repeated once per `repeat_log_s` while it stays so (`_wait_line`)."""
        said_at: float | None = None  # when the too-old pointer's line was last logged (monotonic)
        while not stop.is_set():
            staged = None
            try:
                result = await sub.sync()
                staged = None if result is None else result.staged
            except StoreConfigError:
                raise
            except (SyncError, StoreError) as exc:
                if sub.first_pointer_wait() is None:  # a too-old pointer is said by the wait line below
                    hint = ""
                    if isinstance(exc, WeightsRefused) and sub.floor is not None and sub.version is None:
                        hint = (f" (this worker installed {sub.floor} before; if the run was re-created on purpose, "
                                f"delete {head_path(self.config.data_dir, self.config.run)})")
                    self.reporter.error(f"weights: {exc}{hint}")
            self.count_refused(sub)
            if staged is not None:
                return staged
            said_at = self._wait_line(sub, said_at)
            await wait(stop, self.options.idle_poll_s)
        return None

    def _wait_line(self, sub: Subscriber, said_at: float | None) -> float | None:
        """Say why the worker still has no weights: the run has none yet, or its pointer is too
        old for a first join (that reason, with the pointer's age, in the heartbeat's
        `last_error` at every poll and logged once per `repeat_log_s`); when it was last logged."""
        why = sub.first_pointer_wait()
        if why is None:
            log.info("waiting for the trainer to publish weights for run %s", self.config.run)
            return None
        line = f"weights: {why}"
        self.reporter.update(last_error=line[:500])
        now = time.monotonic()
        if said_at is not None and now - said_at < self.options.repeat_log_s:
            return said_at
        log.warning("%s", line)
        return now

    async def load_model(self, sub: Subscriber, staged: StagedSync, plane: Plane) -> tuple[Model, Tokenizer]:
        """The model, built from the anchor's config and tokenizer files and holding the state
        `first_sync` staged (`LiveWeights.from_state`, on the MLX thread, which owns it from then
        on); the subscriber then stands at its version."""
        assert staged.state is not None
        try:
            return await self._load_model(sub, staged, plane)
        except BaseException:
            sub.forget()  # nothing took the state: the next try syncs (and reads the pointer) again
            raise

    async def _load_model(self, sub: Subscriber, staged: StagedSync, plane: Plane) -> tuple[Model, Tokenizer]:
        assert staged.state is not None
        anchor = await read_anchor_manifest(self.store, staged.manifest.anchor.manifest, trust=sub.trust)
        folder = self.config.data_dir / "models" / self.config.run
        extras = folder / "extras"
        await download_extras(self.store, anchor, extras)
        await asyncio.to_thread(_drop_weight_files, folder)
        create = run_create_command(self.config.store, "NEW_RUN")
        # A family macd cannot run would fail in mlx-lm, far from its cause (a GPT-2's projections
        # are stored transposed from mlx-lm's): refused by name first, once, as no retry fixes it.
        if why := await asyncio.to_thread(unsupported_model, extras):
            raise Fatal(f"run {self.config.run!r}: its model cannot run on macd: {why}; the operator creates a "
                        f"run of a supported model (`{create}`)")
        held = sub.layout.plane
        try:
            model, tokenizer, self.live = await self.mlx.run(
                _build_model, extras, staged.state, held or plane, held is not None, staged.digest.root()
            )
        except (MemoryError, OSError):
            raise  # this Mac's memory or disk: may pass, retried
        except Exception as exc:  # mlx-lm refused the anchor's config or weights: the same every time
            log.debug("building the model failed", exc_info=exc)
            raise Fatal(
                f"run {self.config.run!r}: macd could not build its model from the anchor of v{staged.version} "
                f"({describe_error(exc)}); retrying cannot fix it: upgrade macd if the run's model is newer than "
                f"its mlx-lm, else the operator creates a run of a model macd can build (`{create}`)"
            ) from exc
        sub.advance(staged)
        self.keep_head()
        self.plane = held or plane
        self.reporter.update(plane=self.plane)
        return model, tokenizer

    # -- following -------------------------------------------------------------------------------
    async def follow(self, stop: asyncio.Event) -> None:
        """Poll the pointer and sync beside generation; each new version is installed at a safe
        point."""
        assert self.sub is not None
        while not stop.is_set():
            result = await self._sync(self.sub)
            if result is not None and result.staged is not None:
                await self._install(self.sub, result)
            del result  # its staged writes: as large as the patch
            waiting = self.reporter.beat.status == "waiting"
            await wait(stop, self.options.budget_poll_s if waiting else self.options.weights_poll_s)

    async def _sync(self, sub: Subscriber) -> SyncResult | None:
        """One sync (None when nothing changed); errors are reported, the state stays verified."""
        self.clock = _SwapClock(synced=time.perf_counter())
        assert self.live is not None
        try:
            return await sub.sync(self.live.bits())
        except SyncError as exc:  # the subscriber's state is still the last verified one (it says so)
            self.reporter.error(f"weights: {exc}")  # a refusal (WeightsRefused) too: its reason in last_error
        except StoreError as exc:
            self.reporter.error(f"weights: {describe_error(exc)}; serving v{self.installed[0]}")
        except Exception as exc:  # never leave a bad object in the bucket to stop generation
            log.exception("unexpected error syncing weights")
            self.reporter.error(f"weights: {describe_error(exc)}; serving v{self.installed[0]}")
        finally:
            self.count_refused(sub)
        return None

    def count_refused(self, sub: Subscriber) -> None:
        """The heartbeat's `weights_refused`: weight objects refused (each logged once by the subscriber)."""
        if sub.refused != self.reporter.beat.weights_refused:
            self.reporter.update(weights_refused=sub.refused)

    async def _install(self, sub: Subscriber, result: SyncResult) -> None:
        """Install what a sync staged at a safe point, in one call on the MLX thread (module
        doc); then the subscriber stands at it. A version that does not fit the model, or whose
        install fails, is reported and changes nothing (the model keeps serving the version it
        holds); a model left at no verified version is restored from an anchor at the next sync."""
        staged, live = result.staged, self.live
        assert staged is not None and live is not None
        before = self.installed[0]
        try:
            await self.install_at_safe_point(
                lambda: live.install_version(staged), staged.version, served_digest(staged.manifest, staged.digest.root())
            )
        except Exception as exc:  # the model keeps its version; the follow loop goes on
            if isinstance(exc, ValueError):
                problem = f"does not fit the model ({exc})"
            else:
                log.exception("installing weights v%d failed", staged.version)
                problem = f"failed to install ({describe_error(exc)})"
            if live.digest is None:  # half-written: only a whole verified state puts it right
                sub.forget()
                problem += "; the model is restored from the anchor at the next sync"
            self.reporter.error(f"weights: v{staged.version} {problem}; serving v{self.installed[0]}")
            return
        sub.advance(staged)
        self.keep_head()
        if staged.patch is None:
            return_freed_memory()  # the replaced state's
        c = self.clock
        record = SwapRecord(
            version=self.installed[0], path=result.path,
            ready_s=c.asked - c.synced, drain_s=c.paused - c.asked, drain_steps=c.steps, pause_s=c.resumed - c.paused,
            install_s=c.resumed - c.installed, dropped=c.dropped,
        )
        self.swaps.append(record)
        self.reporter.update(
            version=self.installed[0], pointer_version=staged.version, swaps=self.reporter.beat.swaps + 1,
            last_swap_s=c.resumed - c.synced, state_digest=self.installed[1],
        )
        moved = f"v{record.version} reinstalled" if before == record.version else (
            f"v{record.version}" if before < 0 else f"v{before} -> v{record.version}"
        )
        log.info(
            "weights %s via %s: %.1f KB ready in %.2fs beside generation, %.2fs to the safe point; "
            "generation paused %.3fs (install %.3fs), %d group(s) dropped to restart on the new weights",
            moved, record.path, result.bytes / 1e3,
            record.ready_s, record.drain_s, record.pause_s, record.install_s, record.dropped,
        )

    async def install_at_safe_point(self, install: Callable[[], T], version: int, digest: str) -> T:
        """Run `install` on the MLX thread where no sequence is in flight, then label the groups
        started from then on (`version`, `digest`). While generating, that is the generation
        loop's next safe point: after a short drain (`swap_drain_steps`) it drops the groups
        still unfinished (their prompts restart on the new weights); otherwise at once."""
        c = self.clock
        c.asked = time.perf_counter()
        if not self.generating:
            c.paused = c.installed = time.perf_counter()
            result = await self.mlx.run(install)
            self.installed = (version, digest)
            c.resumed = time.perf_counter()
            return result
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self.pending = Pending(install, version, digest, future)
        self.wake()
        return await future

    async def swap(self, gen: Generator) -> list[Any]:
        """At a safe point: install the pending version now. Drop what is in flight, install, and
        from now on label new groups with its version; the dropped groups' tags (to restart).
        The pending install's future gets its result or error."""
        pending = self.pending
        assert pending is not None
        self.reporter.update(status="syncing")
        c = self.clock
        c.paused = time.perf_counter()
        self.pending = None
        dropped: list[Any] = []
        try:
            dropped = await self.mlx.run(gen.quiesce)
            c.dropped = len(dropped)
            c.installed = time.perf_counter()
            result = await self.mlx.run(pending.install)
        except Exception as exc:
            if not pending.future.done():
                pending.future.set_exception(exc)
            return dropped
        self.installed = (pending.version, pending.digest)
        c.resumed = time.perf_counter()
        if not pending.future.done():
            pending.future.set_result(result)
        return dropped

    def stop_generating(self) -> None:
        """The generation loop ended: an install waiting for it is cancelled."""
        self.generating = False
        if self.pending is not None and not self.pending.future.done():
            self.pending.future.cancel()
        self.pending = None


def held_plane(manifest: RunManifest, plane: Plane) -> QuantPlane | None:
    """The quantized plane a worker serving `plane` follows and holds alone: `plane` when the
    run publishes it (`RunManifest.planes`), else None (the bf16 weights: served as they are, or,
    int8 being the run's own plane unpublished, quantized here from them). ValueError for a
    quantized plane the run neither serves nor publishes (the trainer refuses records of it)."""
    if plane != "bf16" and manifest.offers(plane):
        return check_plane(plane)
    if plane not in ("bf16", manifest.plane):
        raise ValueError(f"run {manifest.run!r} does not publish the {plane} plane; serve bf16")
    return None


def served_digest(manifest: VersionManifest | None, digest: str) -> str:
    """The state digest the groups made on a version are labelled with: a plane's bf16 source
    version's (what the trainer published and checks records against), else `digest`."""
    return manifest.source.state_digest if manifest is not None and manifest.source is not None else digest


def _build_model(
    folder: Path, state: dict[str, np.ndarray], plane: Plane, held: bool = False, digest: str | None = None
) -> tuple[Model, Tokenizer, LiveWeights]:
    """(model, tokenizer, LiveWeights) on the MLX thread: the model of `folder`'s config holding
    `state`, whose root digest is `digest` (with `held`, the quantized `plane` itself:
    `PlaneWeights`)."""
    from .generate import build_model
    from .hf_layout import live_weights
    from .plane_weights import PlaneWeights

    model, tokenizer = build_model(folder)
    if held:
        live: LiveWeights = PlaneWeights.from_state(model, state, check_plane(plane), digest)
    else:
        live = live_weights(model, state, plane, digest)  # through the model's own layout of the checkpoint (LFM2)
    return_freed_memory()  # what the state's own arrays held before it lent the model's memory
    return model, tokenizer, live


def _drop_weight_files(folder: Path) -> None:
    """Remove weight files a cold start of an earlier macd wrote into the model folder."""
    if folder.is_dir():
        for path in [*folder.glob("model*.safetensors"), folder / "model.safetensors.index.json"]:
            if path.is_file():
                path.unlink()
