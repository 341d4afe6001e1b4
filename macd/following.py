"""Following the run's weights beside generation and installing each version at a safe point.

Polling, downloading and verifying run on the asyncio side while the MLX thread generates: the
subscriber is deferred (`pulse.subscriber`), so a sync writes nothing and returns the verified
version staged (a patch's final bits, or an anchor's new state). The worker installs it in one
direction, at the generation loop's next safe point (`WeightFollower.swap`): on the bf16 plane,
where the subscriber's state *is* the model's memory (one copy of the weights, `weights.py`),
the commit scatters the patch's bits into the live weights there; on the int8 plane the bf16
master is not the model, so it is written beside generation and the safe point re-quantizes the
groups that changed. On a quantized plane the run publishes (the Mac's pick, `plane_for`), the
worker follows that plane and holds it alone (`held_plane`, `macd.plane_weights`): like bf16, its
state is the model's memory; the groups it makes carry the state digest of the bf16 version the
plane quantizes (the plane's manifest names it, signed), the one the trainer checks records
against. A patch commit the model cannot take is undone (the state and the subscriber back at
the version the model computes with; an anchor's new state stays, as the subscriber's); either
way the next version is installed whole.
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
from slime_stoa.protocol.pulse.history import read_anchor_manifest, read_pointer
from slime_stoa.protocol.pulse.manifests import VersionManifest
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.pulse.sync_result import Committed, SyncError, SyncResult, WeightsRefused
from slime_stoa.protocol.run_manifest import Plane, RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.store import Store, StoreConfigError, StoreError
from slime_stoa.protocol.store.retry import describe_error

from .aio import Wakeup, wait
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
    ready_s: float  # poll, download, verify (int8: patch the master), all beside generation
    drain_s: float  # from then to the safe point; in-flight groups kept decoding
    drain_steps: int  # decode steps taken from then to the safe point (at most swap_drain_s's worth + 1)
    pause_s: float  # decoding stopped: drop what was in flight, wait for MLX, install
    install_s: float  # the install itself, on the MLX thread (bf16: the patch's scatter into the weights)
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
        self.live: LiveWeights | None = None
        self.installed: tuple[int, str] = (-1, "")  # (version, state digest) the model computes with
        self.plane: Plane = "bf16"  # the plane the model serves (`load_model`); records name it
        self.generating = False  # a generation loop takes installs at its safe points
        self.pending: Pending | None = None
        self.clock = _SwapClock()  # the version change under way
        self.swaps: collections.deque[SwapRecord] = collections.deque(maxlen=1000)  # the latest version changes
        self._whole = False  # the next version is installed whole (an install failed)

    def subscriber(self, trust: RunTrust | None, plane: QuantPlane | None = None) -> Subscriber:
        """The worker's subscriber, of the run's bf16 weights or of its published `plane`
        (`held_plane`); in a signed run it refuses pointers below the highest weights this
        worker installed before (`run_pin`), across restarts."""
        if self.sub is None:
            self.sub = Subscriber(self.store, self.config.run, trust=trust, deferred=True, plane=plane)
            if trust is not None:
                self.sub.floor = remembered_head(self.config.data_dir, self.config.run)
        return self.sub

    async def plane_for(self, manifest: RunManifest, trust: RunTrust | None) -> Plane:
        """The plane this Mac serves the run on (`plane_choice`): the run's, or, when the run
        publishes quantized planes, a smaller one if the run's does not fit this Mac's memory.
        The model's config is read from the run's bf16 anchor (the run's plane when it cannot be),
        the size of the run's search index from its manifest (`index_plan`).
        The daemon config's `plane` overrides the pick (`Fatal` when the run cannot be served on it)."""
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
        index = await run_index_plan(self.store, manifest, machine_shared_dir())
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
    async def first_sync(self, sub: Subscriber, stop: asyncio.Event) -> bool:
        """Wait for the run's weights and sync to them; False if stopped first. Nothing computes
        with the state yet, so what a sync staged is committed at once.

        A malformed or unreadable pointer or manifest, or a store outage, is reported and the
        pointer polled again."""
        while not stop.is_set():
            try:
                result = await sub.sync()
            except StoreConfigError:
                raise
            except (SyncError, StoreError) as exc:
                hint = ""
                if isinstance(exc, WeightsRefused) and sub.floor is not None and sub.version is None:
                    hint = (f" (this worker installed {sub.floor} before; if the run was re-created on purpose, "
                            f"delete {head_path(self.config.data_dir, self.config.run)})")
                self.reporter.error(f"weights: {exc}{hint}")
            else:
                if result is not None and result.staged is not None:
                    sub.commit(result.staged)
                    self.keep_head()
                if sub.state is None:
                    log.info("waiting for the trainer to publish weights for run %s", self.config.run)
            self.count_refused(sub)
            if sub.state is not None:
                return True
            await wait(stop, self.options.idle_poll_s)
        return False

    async def load_model(self, sub: Subscriber, plane: Plane) -> tuple[Model, Tokenizer]:
        """The model, built from the anchor's config and tokenizer files and holding the synced
        state in memory (`LiveWeights.from_state`, on the MLX thread)."""
        assert sub.state is not None and sub.current is not None
        anchor = await read_anchor_manifest(self.store, sub.current.anchor.manifest, trust=sub.trust)
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
                _build_model, extras, sub.state, held or plane, held is not None
            )
        except (MemoryError, OSError):
            raise  # this Mac's memory or disk: may pass, retried
        except Exception as exc:  # mlx-lm refused the anchor's config or weights: the same every time
            log.debug("building the model failed", exc_info=exc)
            raise Fatal(
                f"run {self.config.run!r}: macd could not build its model from the anchor of v{sub.current.version} "
                f"({describe_error(exc)}); retrying cannot fix it: upgrade macd if the run's model is newer than "
                f"its mlx-lm, else the operator creates a run of a model macd can build (`{create}`)"
            ) from exc
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
        try:
            return await sub.sync()
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
        """Commit what a sync staged and refresh the model from it, at a safe point (module doc).
        A version that does not fit the model, or whose install fails, is reported (the model
        keeps serving the version it holds) and the next one is installed whole."""
        staged, live = result.staged, self.live
        assert staged is not None and live is not None
        before = self.installed[0]
        whole = self._whole or staged.patch is None
        changed = None if whole else result.changed
        early: Committed | None = None
        if live.master_apart:  # the master is not the model: written beside generation
            early = await asyncio.to_thread(sub.commit, staged)
        reverted = False

        def install() -> None:
            nonlocal reverted
            done = early or sub.commit(staged)
            assert sub.state is not None
            try:
                live.apply(sub.state, changed, result.touched)
            except BaseException:
                if done.undo is not None:
                    sub.revert(done)  # the state back at the version the model computes with
                    reverted = True
                raise

        try:
            await self.install_at_safe_point(install, staged.version, served_digest(staged.manifest, staged.digest.root()))
        except Exception as exc:  # the model keeps its version; the follow loop goes on
            if early is not None and early.undo is not None and not reverted:
                await asyncio.to_thread(sub.revert, early)  # the install never ran: the master back too
            self._whole = True
            if isinstance(exc, ValueError):
                problem = f"does not fit the model ({exc})"
            else:
                log.exception("installing weights v%d failed", staged.version)
                problem = f"failed to install ({describe_error(exc)})"
            self.reporter.error(f"weights: v{staged.version} {problem}; serving v{self.installed[0]}")
            return
        self._whole = False
        self.keep_head()
        if changed is None:
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
    run publishes it (`RunManifest.planes`), else None (the bf16 weights: served as they are, or
    quantized to int8 here from them). ValueError for a 4-bit plane the run does not publish."""
    if plane != "bf16" and manifest.offers(plane):
        return check_plane(plane)
    if plane == "int4":
        raise ValueError(f"run {manifest.run!r} does not publish the int4 plane; serve bf16 or int8")
    return None


def served_digest(manifest: VersionManifest | None, digest: str) -> str:
    """The state digest the groups made on a version are labelled with: a plane's bf16 source
    version's (what the trainer published and checks records against), else `digest`."""
    return manifest.source.state_digest if manifest is not None and manifest.source is not None else digest


def _build_model(
    folder: Path, state: dict[str, np.ndarray], plane: Plane, held: bool = False
) -> tuple[Model, Tokenizer, LiveWeights]:
    """(model, tokenizer, LiveWeights) on the MLX thread: the model of `folder`'s config holding
    `state` (with `held`, the quantized `plane` itself: `PlaneWeights`)."""
    from .generate import build_model
    from .hf_layout import live_weights
    from .plane_weights import PlaneWeights

    model, tokenizer = build_model(folder)
    if held:
        live: LiveWeights = PlaneWeights.from_state(model, state, check_plane(plane))
    else:
        live = live_weights(model, state, plane)  # through the model's own layout of the checkpoint (LFM2)
    return_freed_memory()  # what the state's own arrays held before it lent the model's memory
    return model, tokenizer, live


def _drop_weight_files(folder: Path) -> None:
    """Remove weight files a cold start of an earlier macd wrote into the model folder."""
    if folder.is_dir():
        for path in [*folder.glob("model*.safetensors"), folder / "model.safetensors.index.json"]:
            if path.is_file():
                path.unlink()
