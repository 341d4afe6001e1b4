"""`macd run`: the rollout worker loop.

One thread owns MLX (loading, weight swaps, generation; `mlx_thread.py`); asyncio owns the
network (pointer polls, weight downloads, uploads, heartbeats). The worker is made of parts with
one job each:

- `following.WeightFollower`: follows the run's weights beside generation (poll, download,
  verify) and installs each version at a safe point: the subscriber's sync returns the staged
  version and the MLX thread installs it in one call into the live weights, the one owner of
  the weights' bytes (on the bf16 plane the model's memory itself: one copy, `weights.py`).
- `generation.GenerationLoop`: one continuous generator of groups (for a tool task, multi-turn
  episodes whose tool calls run on the asyncio side), kept full across weight versions, each
  group exact to the version it is tagged with (a group that straddles a swap is dropped and
  restarted, at most once).
- `recording.Recorder`: scores finished groups and spools them (signed records for a signed
  run); the uploader (`uploader.py`) drains the spool to the bucket.
- `reporting.Reporter`: the heartbeat every part updates, and the errors they report.

`Worker` sets them up: makes sure no other live process holds its worker id (`twin.py`: two
would repeat each other's record keys; re-checked before each heartbeat, `twin.TwinWatch`), reads the run and its task, syncs the first weights and
builds the model from the anchor's config with the synced state installed in memory, prepares a
tool task's tool, then runs them until stopped.

Every finished group is written to the on-disk spool first and uploaded from there, so nothing
finished is ever lost. With the run's `dynamic_sampling`, a group whose rewards are all equal is
counted (heartbeat `groups_filtered`) instead of uploaded; with `skip_solved_after`, prompts
solved that many times in a row are no longer drawn (`curriculum.py`).

The worker outlives whatever the bucket does. A malformed or unreadable object (the run
manifest, the task file, the pointer, a version or anchor manifest, a patch) is reported — the
log and the heartbeat's `errors`/`last_error` — and skipped: before the first weights the worker
keeps retrying; after, it keeps generating with its last verified weights and moves on at the
first good pointer. A store outage of any length only delays uploads: groups wait in the spool,
which drains when the store is back. Only what retrying cannot fix stops it, with one line naming
the cause and the fix: a configuration error (`StoreConfigError`: credentials, bucket), and the
problems `fatal.py` lists (a model family macd cannot run or a model it cannot build, an error of
the code itself). A run whose task data is missing (never prepared, or deleted) is waited for:
one line naming the `stoa task prepare` command, said again with backoff, and the worker goes on
once the task is there (`TaskNotPrepared`). In a signed run a split whose bytes are not the ones
the run key's task manifest signs, or a manifest gone or forged, is waited for the same way, the
line naming `stoa task prepare ... --key` (`protocol.task_manifest`).

In a signed run the worker signs its heartbeat with its worker key, and reads the run's registry
at start and every `registry_poll_s` (`revocation.py`). Once its key is revoked it stops
uploading and generating, says so in one log line, and stays up with the heartbeat status
"revoked" until stopped; its spool is kept.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from slime_stoa.protocol.heartbeat import Heartbeat
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.run_manifest import RunManifest, read_run_manifest
from slime_stoa.protocol.run_trust import RunKeyRefused, RunTrust, run_key_refusal
from slime_stoa.protocol.signing import PublicKey, SigningKey
from slime_stoa.protocol.store import NotFound, Store, StoreConfigError
from slime_stoa.protocol.store.retry import describe_error
from slime_stoa.protocol.task_manifest import TaskDataRefused, read_task_object
from slime_stoa.tasks import Task, load_task
from slime_stoa.tasks.tools import Tool, ToolContext, prepare_tool, tool_for

from .aio import Wakeup, settle_task, wait
from .clock import StoreClock
from .cmdline import task_prepare_command
from .config import DaemonConfig
from .evaluate import EvalResponder
from .fatal import permanent
from .following import SwapRecord, WeightFollower, held_plane, served_digest
from .generation import GenerationLoop, Ready, ToolCalls, at_safe_point
from .mlx_thread import MLXThread, return_freed_memory
from .options import WorkerOptions
from .recording import WorkerKeyError, build_group, check_signing, load_worker_key
from .reporting import Reporter, rss_gb, tier
from .revocation import RevocationWatch
from .run_pin import remember_run_key, remembered_run_key
from .shared_dir import machine_shared_dir
from .spool import Spool, SpoolLocked
from .twin import TwinWatch, TwinWorker, check_no_twin, remember_instance
from .uploader import Uploader

if TYPE_CHECKING:
    from .generate import Generator
    from .weights import LiveWeights

log = logging.getLogger("macd")

__all__ = [  # with the parts' names other modules import from here
    "Worker", "WorkerKeyError", "WorkerOptions", "at_safe_point", "build_group", "check_signing", "load_worker_key",
    "task_key",
]


def task_key(manifest: RunManifest) -> str:
    """The bucket key of the task file workers draw prompts from."""
    return manifest.layout.task_data(manifest.task, manifest.task_split)


class TaskNotPrepared(Exception):
    """The run's task data is not in the bucket, or (a signed run) not the data its run key
    signed. Healable (the operator prepares it, or prepares it again after a token holder deleted
    or replaced it), so the worker waits for it instead of stopping."""


def waits_for(refused: TaskDataRefused) -> TaskNotPrepared:
    """The wait on a signed run's refused task data, in the words of its refusal."""
    return TaskNotPrepared(f"{refused}; this worker waits for it")


def missing_tool_data(manifest: RunManifest, store_url: str, exc: NotFound) -> str:
    """What a tool's missing object (e.g. the search index's manifest or a chunk) means, with the
    command that puts it back: preparing the task again uploads its index (`--key` in a signed run)."""
    prepare = task_prepare_command(manifest.task, manifest.task_split, store_url, manifest.run)
    if manifest.run_key:
        prepare += " --key RUN_KEY_FILE"
    return f"the run's {manifest.task} data is missing from the bucket ({exc}): the operator puts it back with `{prepare}`"


def says_again(tries: int) -> bool:
    """Whether the `tries`-th try of a wait says its line again: at tries 1, 2, 4, 8, ... (a
    backoff on top of the polls' own)."""
    return tries > 0 and tries & (tries - 1) == 0


class Worker:
    def __init__(self, config: DaemonConfig, store: Store, options: WorkerOptions | None = None):
        self.config = config
        self.store = store
        self.options = options = options or WorkerOptions()
        self.layout = RunLayout(config.run)
        self.mlx = MLXThread()
        self.reporter = Reporter(store, self.layout, config.worker_id, config.name, repeat_log_s=options.repeat_log_s)
        self.rng = random.Random(options.seed)
        wake = Wakeup()
        self.weights = WeightFollower(store, config, options, self.mlx, self.reporter, wake)
        self.loop = GenerationLoop(config, options, self.mlx, self.reporter, self.weights, wake, self.rng)
        self.trust: RunTrust | None = None  # the run keys weights must be signed by (None: an unsigned run)
        self._signer: SigningKey | None = None  # the worker key: signs every record (`load_worker_key`)
        self.evals: EvalResponder | None = None  # answers eval requests while generating (macd/evaluate.py)
        self.revocation: RevocationWatch | None = None  # a signed run's: is this worker's key revoked?
        self.twin: TwinWorker | None = None  # another live process with this worker id, found after start

    # -- what the parts hold, for inspection (tests, benchmarks, the CLI) ---------------------
    @property
    def beat(self) -> Heartbeat:
        return self.reporter.beat

    @property
    def on_heartbeat(self) -> Callable[[Heartbeat], None] | None:
        return self.reporter.on_heartbeat

    @on_heartbeat.setter
    def on_heartbeat(self, fn: Callable[[Heartbeat], None] | None) -> None:
        self.reporter.on_heartbeat = fn

    @property
    def sub(self) -> Subscriber | None:
        return self.weights.sub

    @property
    def live(self) -> LiveWeights | None:
        return self.weights.live

    @property
    def swaps(self) -> collections.deque[SwapRecord]:
        return self.weights.swaps

    @property
    def tools(self) -> ToolCalls | None:
        return self.loop.tools

    @property
    def _gen(self) -> Generator | None:
        """The generator while generating (read it on the MLX thread)."""
        return self.loop.gen

    @property
    def groups_in_flight(self) -> int:
        """Groups started and not finished (0 when not generating)."""
        return self.loop.gen.groups if self.loop.gen is not None else 0

    @property
    def groups_started(self) -> int:
        return self.loop.groups_started

    @property
    def groups_dropped(self) -> int:
        return self.loop.groups_dropped

    @property
    def cohorts(self) -> int:
        return self.loop.recorder.cohorts if self.loop.recorder is not None else 0

    @property
    def groups_recorded(self) -> int:
        return self.loop.recorder.recorded if self.loop.recorder is not None else 0

    @property
    def groups_filtered(self) -> int:
        return self.loop.recorder.filtered if self.loop.recorder is not None else 0

    # -- setup -------------------------------------------------------------------------------
    async def _load_run(self) -> tuple[RunManifest, Task]:
        manifest = await read_run_manifest(self.store, self.config.run)
        self._check_run_key(manifest)
        key_text = manifest.run_key
        if key_text and (self.trust is None or self.trust.pinned.to_text() != key_text):
            self.trust = RunTrust.from_text(self.config.run, key_text)
        try:
            data = await read_task_object(self.store, manifest.run, manifest.task, manifest.task_split, self.trust)
        except NotFound:  # never prepared, or deleted: the operator prepares it, this worker waits
            prepare = task_prepare_command(manifest.task, manifest.task_split, self.config.store, manifest.run)
            raise TaskNotPrepared(
                f"run {manifest.run!r} has no task data ({task_key(manifest)} is not in the bucket): "
                f"the operator prepares it with `{prepare}`; this worker waits for it"
            ) from None
        except TaskDataRefused as exc:  # a signed run's split replaced, or its manifest gone: the same wait
            raise waits_for(exc) from None
        task = await asyncio.to_thread(load_task, data)
        if task.name != manifest.task:
            raise ValueError(f"task file {task_key(manifest)} holds task {task.name!r}, the run says {manifest.task!r}")
        return manifest, task

    def _check_run_key(self, manifest: RunManifest) -> None:
        """RunKeyRefused unless the manifest's run key is the one this worker trusts: the key
        pinned at `macd join`, else the first one it trusted (`run_pin`); a worker holding a
        worker key refuses an unsigned run. A first signed run key is kept (trust on first use)."""
        data_dir, run = self.config.data_dir, self.config.run
        expected = self.config.run_key or remembered_run_key(data_dir, run)
        problem = run_key_refusal(run, manifest.run_key, expected, holds_worker_key=self._signer is not None)
        if problem is not None:
            raise RunKeyRefused(problem, self.layout.run_manifest)
        if manifest.run_key:
            if not self.config.run_key and expected is None:
                log.warning("run key not pinned in the config: trusting run %s's key %s from now on",
                            run, PublicKey.from_text(manifest.run_key).key_id)
            remember_run_key(data_dir, run, manifest.run_key)

    async def _open_spool(self, stop: asyncio.Event) -> Spool | None:
        """This worker's spool; while a live process holds it, wait up to `lock_wait_s` for it to
        stop, then raise `SpoolLocked` (naming it). None if stopped while waiting."""
        deadline = time.monotonic() + self.options.lock_wait_s
        said = False
        while True:
            try:
                return Spool(
                    self.config.data_dir / "spool" / self.config.run,
                    worker_id=self.config.worker_id,
                    run=self.config.run,
                    max_bytes=self.config.spool_max_mb << 20,
                    max_items=1_000_000,
                    clock=StoreClock(self.store),  # keys stamped by the bucket's clock (clock.py)
                )
            except SpoolLocked as exc:
                if time.monotonic() >= deadline or exc.pid == os.getpid():
                    raise
                if not said:
                    log.warning("%s; waiting up to %.0f s for it to stop", exc, self.options.lock_wait_s)
                    said = True
            await wait(stop, 0.25)
            if stop.is_set():
                return None

    async def _claim_worker_id(self, stop: asyncio.Event) -> bool:
        """`twin.check_no_twin` (TwinWorker when another live process holds this worker id), then
        this process's instance id kept in the data folder; False if stopped first."""
        config = self.config
        await check_no_twin(self.store, config.run, config.worker_id, instance=self.reporter.instance,
                            data_dir=config.data_dir, signer=self._signer, every_s=self.options.heartbeat_s, stop=stop)
        if stop.is_set():
            return False
        try:
            remember_instance(config.data_dir, config.run, self.reporter.instance)
        except OSError as exc:  # only the next start's shortcut is lost
            log.warning("instance id not kept in %s: %s", config.data_dir, exc)
        return True

    async def _setup(self, stop: asyncio.Event, upload_task: asyncio.Task) -> Ready | None:
        """Read the run and its task, sync the weights and build the model holding them; retried
        (each failure reported) until it works. None if stopped first (or the uploader failed)."""
        delay = self.options.idle_poll_s
        loaded: tuple[RunManifest, Task] | None = None
        task_waits = 0  # tries that found no task data
        while not stop.is_set() and not upload_task.done():
            try:
                if loaded is None:
                    loaded = await self._load_run()
                    if task_waits:
                        log.info("run %s: its task data is there now: starting", self.config.run)
                    if self.reporter.beat.status == "refused":
                        self.reporter.update(status="starting")
                manifest, task = loaded
                check_signing(manifest, self._signer, self.config.store)
                if self.trust is not None and self.revocation is not None and await self.revocation.check(self.trust):
                    return None
                try:
                    plane = await self.weights.plane_for(manifest, self.trust)
                except TaskDataRefused as exc:  # its index plan read a split replaced since: read the task again
                    loaded = None
                    raise waits_for(exc) from None
                sub = self.weights.subscriber(self.trust, held_plane(manifest, plane))
                staged = await self.weights.first_sync(sub, stop)
                if staged is None:
                    return None
                model, tokenizer = await self.weights.load_model(sub, staged, plane)
                return Ready(manifest, task, model, tokenizer)
            except (StoreConfigError, WorkerKeyError):
                raise
            except RunKeyRefused as exc:  # one line per `repeat_log_s`; the bucket may be put right
                self.reporter.update(status="refused")
                self.reporter.error(str(exc))
            except TaskNotPrepared as exc:  # counted at every try, said at tries 1, 2, 4, 8, ...
                task_waits += 1
                if says_again(task_waits):
                    log.warning("%s", exc)
                self.reporter.update(errors=self.reporter.beat.errors + 1, last_error=str(exc)[:500])
            except Exception as exc:  # malformed or missing objects, a store outage: retried
                what = "run" if loaded is None else "weights"
                self._stop_if_permanent(exc, what)
                self.reporter.error(f"{what}: {describe_error(exc)}; retrying in {delay:.0f} s")
            await wait(stop, delay)
            delay = min(2 * delay, self.options.setup_retry_max_s)
        return None

    def _stop_if_permanent(self, exc: Exception, what: str) -> None:
        """Raise `exc` as a `Fatal` (`fatal.permanent`) when no retry can fix it: reported in the
        heartbeat first (the final one says why the worker stopped), its traceback at debug level."""
        fatal = permanent(exc, what)
        if fatal is None:
            return
        if fatal is not exc:
            log.debug("%s failed", what, exc_info=exc)
        self.reporter.update(errors=self.reporter.beat.errors + 1, last_error=str(fatal)[:500])
        raise fatal from (None if fatal is exc else exc)

    async def _open_tool(self, manifest: RunManifest, task: Task, stop: asyncio.Event) -> Tool | None:
        """The tool of a tool task (`slime_stoa.tasks.tools.tool_for`), prepared (e.g. the search index fetched,
        resumably, and memory-mapped): retried, each failure reported, until it works; None if
        stopped first. ValueError when no tool is registered for the task (this macd cannot run it)."""
        fmt = task.tool_format
        if fmt is not None and fmt.answer_close not in manifest.stop:
            log.warning(
                "run %s: its stop strings lack the task's answer tag %r; an episode that answers at max_tokens "
                "will be refused by the trainer (create the run with --stop %s)",
                manifest.run, fmt.answer_close, fmt.answer_close,
            )
        context = ToolContext(run=manifest.run, store=self.store, data_dir=self.config.data_dir, shared_dir=machine_shared_dir())
        tool = tool_for(task, context)  # the search index: one copy per Mac (`shared_dir`)
        delay = self.options.idle_poll_s
        while not stop.is_set():
            try:
                await prepare_tool(tool)
                return tool
            except StoreConfigError:
                raise
            except NotFound as exc:  # never uploaded, or deleted by a token holder: only the operator puts it back
                self.reporter.error(f"tool: {missing_tool_data(manifest, self.config.store, exc)}; retrying in {delay:.0f} s")
            except Exception as exc:  # a damaged index, a store outage
                self._stop_if_permanent(exc, "tool")
                self.reporter.error(f"tool: {describe_error(exc)}; retrying in {delay:.0f} s")
            await wait(stop, delay)
            delay = min(2 * delay, self.options.setup_retry_max_s)
        return None

    # -- the loop ----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> int:
        """Run until `stop` is set (or max_cohorts); returns the process exit code.

        Raises `SpoolLocked` when another live macd holds this worker's spool, `TwinWorker` when
        another live process holds its worker id (`twin.py`), `StoreConfigError` when the store's
        configuration is wrong, and `Fatal` for what no retry fixes (`fatal.py`)."""
        return_freed_memory()
        self._signer = self.reporter.signer = load_worker_key(self.config)  # a bad key file fails here, at once
        if self._signer is not None:
            self.revocation = RevocationWatch(
                self.store, self.config.run, self.config.worker_id, self._signer.key_id, poll_s=self.options.registry_poll_s
            )
        spool = await self._open_spool(stop)
        if spool is None:
            return 0
        try:  # before any upload or heartbeat: another live process may hold this worker id (twin.py)
            claimed = await self._claim_worker_id(stop)
        except BaseException:
            spool.close()
            await asyncio.to_thread(self.mlx.close)
            raise
        if not claimed:
            spool.close()
            await asyncio.to_thread(self.mlx.close)
            return 0
        uploader = Uploader(self.store, spool, concurrency=self.config.transfer_concurrency)
        stop_uploads = asyncio.Event()
        upload_task = asyncio.create_task(uploader.run_forever(stop_uploads))  # drains what a last run left
        stop_beats = asyncio.Event()
        beat_task = asyncio.create_task(self._beat_forever(stop_beats, spool, uploader, stop_uploads))
        stop_watch = asyncio.Event()
        watch_task: asyncio.Task | None = None
        try:
            ready = await self._setup(stop, upload_task)
            if ready is not None and self.trust is not None and self.revocation is not None:
                watch_task = asyncio.create_task(self._watch_revocation(self.trust, stop_watch, stop_uploads))
            if ready is not None and not self.revoked:
                await self._generate(ready, spool, upload_task, stop)
            upload_error = upload_task.exception() if upload_task.done() else None
            if upload_error is not None:
                raise upload_error  # a configuration error: the user must act
            if self.twin is not None:
                raise self.twin
            if self.revoked:
                await self._stay_revoked(spool, stop_uploads, stop)
        finally:
            stop_watch.set()
            if watch_task is not None:
                await asyncio.gather(watch_task, return_exceptions=True)
            self.reporter.update(status="revoked" if self.revoked else "stopping")
            stop_uploads.set()
            await asyncio.gather(upload_task, return_exceptions=True)
            kept = self.revoked or self.twin is not None  # nothing more uploads: its keys would not be its own
            left = spool.depth if kept else await uploader.flush(self.options.flush_timeout_s)
            if left and not kept:
                log.warning("%d group(s) stay in the spool; they upload first on the next start", left)
            stop_beats.set()
            await settle_task(beat_task, self.options.heartbeat_s)
            self.reporter.update(status="revoked" if self.revoked else "stopped")
            self.reporter.count_spool(spool, uploader)
            try:
                async with asyncio.timeout(self.options.final_beat_timeout_s):
                    await self.reporter.write()
            except TimeoutError:
                log.warning("the final heartbeat was not written in %.0fs", self.options.final_beat_timeout_s)
            spool.close()
            await asyncio.to_thread(self.mlx.close)
        return 0

    async def _beat_forever(self, stop: asyncio.Event, spool: Spool, uploader: Uploader, stop_uploads: asyncio.Event) -> None:
        """The heartbeat every `heartbeat_s` (`Reporter.beat_forever`'s), each write after the
        twin re-check (`twin.TwinWatch`). At a twin that started first: `twin` set and the uploads
        stopped (which ends setup and generation), no heartbeat more but the final one."""
        watch = TwinWatch(self.store, self.config.run, self.config.worker_id, self._signer)
        while not stop.is_set():
            twin = await watch.check(self.reporter.beat)
            if twin is not None:
                self.twin = twin
                self.reporter.update(errors=self.reporter.beat.errors + 1, last_error=str(twin)[:500])
                stop_uploads.set()
                return
            self.reporter.count_spool(spool, uploader)
            self.reporter.update(memory_gb=rss_gb())
            await self.reporter.write()
            await wait(stop, self.options.heartbeat_s)

    # -- revocation (signed runs) -------------------------------------------------------------
    @property
    def revoked(self) -> bool:
        return self.revocation is not None and self.revocation.revoked is not None

    async def _watch_revocation(self, trust: RunTrust, stop_watch: asyncio.Event, stop_uploads: asyncio.Event) -> None:
        """Read the registry every `registry_poll_s`; at a revocation, stop the uploads (which ends
        generation: the loop stops with the uploader)."""
        assert self.revocation is not None
        if await self.revocation.watch(trust, stop_watch) is not None:
            self.reporter.update(status="revoked")
            stop_uploads.set()

    async def _stay_revoked(self, spool: Spool, stop_uploads: asyncio.Event, stop: asyncio.Event) -> None:
        """The worker's key is revoked: no upload from now on, one log line, the heartbeat
        status "revoked" until `stop` (a service manager restarting the worker would only
        find the same revocation)."""
        assert self.revocation is not None and self.revocation.revoked is not None
        stop_uploads.set()
        self.reporter.update(status="revoked")
        log.error(
            "worker %s: its key was revoked in the registry of run %s (serial %d): it uploads nothing more and stays "
            "idle until stopped; %d group(s) are kept in the spool at %s (a new key: `stoa worker add`, then "
            "`macd join --worker-key`)",
            self.config.worker_id, self.config.run, self.revocation.serial, spool.depth, spool.folder,
        )
        await stop.wait()

    async def _generate(self, ready: Ready, spool: Spool, upload_task: asyncio.Task, stop: asyncio.Event) -> None:
        """Generate until `stop` (or max_cohorts, or an upload configuration error): a tool task's
        tool prepared first (e.g. the search index fetched), eval requests answered between decode
        calls on the installed weights (macd/evaluate.py)."""
        manifest, task = ready.manifest, ready.task
        sub = self.weights.sub
        assert sub is not None and sub.digest is not None and sub.version is not None  # a first sync verified them
        self.weights.installed = (sub.version, served_digest(sub.current, sub.digest.root()))
        self.reporter.update(version=sub.version, pointer_version=sub.version, tier=tier(), state_digest=self.weights.installed[1])
        log.info(
            "worker %s joined run %s at weights v%d (%s plane%s, task %s, group size %d, batch %d)",
            self.config.worker_id, manifest.run, sub.version, self.live.plane if self.live else manifest.plane,
            ", published, held alone" if sub.layout.plane else "", manifest.task,
            manifest.group_size, self.config.batch,
        )
        tool = None if task.tool_format is None else await self._open_tool(manifest, task, stop)
        if task.tool_format is not None and tool is None:
            return  # stopped first
        evals = self.evals = EvalResponder(
            store=self.store, manifest=manifest, worker_id=self.config.worker_id, trust=self.trust,
            signer=self._signer, rng=random.Random(self.options.seed), seed=self.options.seed,
            poll_s=self.options.eval_poll_s,
            tool_for=None if tool is None else (lambda _task: tool),  # the prepared tool of this run's task
        )
        await self.loop.run(ready, tool, evals, spool, upload_task, stop, self._signer)
