"""`macd run`: the rollout worker loop.

One thread owns MLX (loading, weight swaps, generation); asyncio owns the network (pointer
polls, weight downloads, uploads, heartbeats). Between two generation cohorts — never during
one — the worker polls the weight pointer and, when it moved, applies the patch to the live MLX
weights in place; the next cohort records the new version. Every finished group is written to
the on-disk spool first and uploaded from there, so nothing finished is ever lost.

The worker outlives whatever the bucket does. A malformed or unreadable object (the run
manifest, the task file, the pointer, a version or anchor manifest, a patch) is reported — the
log and the heartbeat's `errors`/`last_error` — and skipped: before the first weights the worker
keeps retrying; after, it keeps generating with its last verified weights and moves on at the
first good pointer. A store outage of any length only delays uploads: groups wait in the spool,
which drains when the store is back. Only a configuration error (`StoreConfigError`: credentials,
bucket) stops it, since retrying cannot fix that.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import random
import resource
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from slime_stoa.protocol.heartbeat import Heartbeat
from slime_stoa.protocol.hf.folders import save_hf_folder
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.anchor import download_extras
from slime_stoa.protocol.pulse.history import read_anchor_manifest
from slime_stoa.protocol.pulse.subscriber import Subscriber, SyncError
from slime_stoa.protocol.records import (
    RolloutGroup,
    Sample,
    SamplingParams,
    encode_group,
)
from slime_stoa.protocol.run_manifest import Plane, RunManifest, read_run_manifest
from slime_stoa.protocol.store import Store, StoreConfigError, StoreError
from slime_stoa.protocol.store.retry import describe_error
from slime_stoa.tasks import Task, TaskItem, load_task
from slime_stoa.tasks.prompting import prompt_tokens

from .config import DaemonConfig
from .spool import Spool, SpoolLocked
from .uploader import Uploader

log = logging.getLogger("macd")
T = TypeVar("T")


def task_key(manifest: RunManifest) -> str:
    """The bucket key of the task file workers draw prompts from."""
    return manifest.layout.task_data(manifest.task, manifest.task_split)


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    """Timing knobs of the loop (the daemon config holds the rest)."""

    heartbeat_s: float = 10.0  # seconds between heartbeat writes
    idle_poll_s: float = 2.0  # wait between pointer polls while no weights are published yet
    flush_timeout_s: float = 30.0  # on stop: how long to keep uploading the spool
    final_beat_timeout_s: float = 10.0  # on stop: how long the last heartbeat write may take
    max_cohorts: int | None = None  # stop after this many cohorts (tests, benchmarks)
    seed: int | None = None  # prompt choice and sampling seed (None: random)
    budget_poll_s: float = 0.25  # pointer poll interval while waiting for a new version
    budget_patience_s: float = 10.0  # after this long without a new version, generate another round
    setup_retry_max_s: float = 30.0  # longest wait between two tries to read the run and its weights
    lock_wait_s: float = 0.0  # spool in use by a live process: wait this long for it to stop, then fail
    repeat_log_s: float = 60.0  # the same error again within this long is counted, not logged again


class MLXThread:
    """A daemon thread that runs every MLX call, so MLX state is only touched from one thread.

    A daemon thread (not an executor) so that a stop never waits for a cohort to finish."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="mlx", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, loop, future = job
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting coroutine
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((lambda: fn(*args, **kwargs), loop, future))
        return await future

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the job in flight (MLX must not be torn down mid-computation at exit)."""
        self._jobs.put(None)
        self._thread.join(timeout)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def build_group(
    *,
    manifest: RunManifest,
    worker_id: str,
    item: TaskItem,
    prompt: list[int],
    completions: list[Any],
    rewards: list[float],
    version: int,
    digest: str,
    started_at: float,
    finished_at: float,
) -> Callable[[int, int], bytes]:
    """A spool builder: the record's bytes for the seq the spool assigns."""
    samples = tuple(
        Sample(response_tokens=c.tokens, logprobs=c.logprobs, finish_reason=c.finish_reason, reward=float(r))
        for c, r in zip(completions, rewards, strict=True)
    )
    sampling = SamplingParams(
        temperature=manifest.temperature, top_p=1.0, max_tokens=manifest.max_tokens, stop=manifest.stop
    )

    def build(seq: int, _timestamp_ms: int) -> bytes:
        return encode_group(
            RolloutGroup(
                kind="train",
                run=manifest.run,
                task_id=manifest.task,
                prompt_index=item.index,
                prompt_tokens=np.asarray(prompt, dtype=np.int32),
                samples=samples,
                weight_version=version,
                state_digest=digest,
                sampling=sampling,
                worker_id=worker_id,
                seq=seq,
                started_at=started_at,
                finished_at=finished_at,
            )
        )

    return build


class Worker:
    def __init__(self, config: DaemonConfig, store: Store, options: WorkerOptions = WorkerOptions()):
        self.config = config
        self.store = store
        self.options = options
        self.layout = RunLayout(config.run)
        self.mlx = MLXThread()
        self.beat = Heartbeat(worker_id=config.worker_id, name=config.name, status="starting", started_at=time.time())
        self.rng = random.Random(options.seed)
        self.cohorts = 0
        self._groups_at: dict[int | None, int] = {}  # groups generated per weight version
        self._waiting_since: float | None = None
        self._logged: dict[str, float] = {}  # error message -> when it was last logged (monotonic)
        self.sub: Subscriber | None = None  # exposed for inspection (tests, doctor)
        self.live: Any = None
        self.on_heartbeat: Callable[[Heartbeat], None] | None = None  # sees every heartbeat (macd.tracking)

    # -- setup -------------------------------------------------------------------------------
    async def _load_run(self) -> tuple[RunManifest, Task]:
        manifest = await read_run_manifest(self.store, self.config.run)
        task = await asyncio.to_thread(load_task, await self.store.get_bytes(task_key(manifest)))
        if task.name != manifest.task:
            raise ValueError(f"task file {task_key(manifest)} holds task {task.name!r}, the run says {manifest.task!r}")
        return manifest, task

    async def _first_sync(self, sub: Subscriber, stop: asyncio.Event) -> bool:
        """Wait for the run's weights and sync to them; False if stopped first.

        A malformed or unreadable pointer or manifest, or a store outage, is reported and the
        pointer polled again."""
        while not stop.is_set():
            try:
                await sub.sync()
            except StoreConfigError:
                raise
            except (SyncError, StoreError) as exc:
                self._error(f"weights: {exc}")
            else:
                if sub.state is None:
                    log.info("waiting for the trainer to publish weights for run %s", self.config.run)
            if sub.state is not None:
                return True
            await _wait(stop, self.options.idle_poll_s)
        return False

    async def _materialize(self, sub: Subscriber) -> Path:
        """An HF folder of the synced weights with the anchor's config and tokenizer (for mlx-lm)."""
        assert sub.state is not None and sub.current is not None
        anchor = await read_anchor_manifest(self.store, sub.current.anchor.manifest)
        folder = self.config.data_dir / "models" / self.config.run
        extras = folder / "extras"
        await download_extras(self.store, anchor, extras)
        await asyncio.to_thread(save_hf_folder, sub.state, folder, source_dir=extras)
        return folder

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
                )
            except SpoolLocked as exc:
                if time.monotonic() >= deadline or exc.pid == os.getpid():
                    raise
                if not said:
                    log.warning("%s; waiting up to %.0f s for it to stop", exc, self.options.lock_wait_s)
                    said = True
            await _wait(stop, 0.25)
            if stop.is_set():
                return None

    async def _setup(self, stop: asyncio.Event, upload_task: asyncio.Task) -> tuple[RunManifest, Task, Any, Any] | None:
        """Read the run and its task, sync the weights and load the model; retried (each failure
        reported) until it works. None if stopped first (or the uploader failed)."""
        delay = self.options.idle_poll_s
        loaded: tuple[RunManifest, Task] | None = None
        while not stop.is_set() and not upload_task.done():
            try:
                if loaded is None:
                    loaded = await self._load_run()
                manifest, task = loaded
                sub = self.sub = self.sub or Subscriber(self.store, self.config.run)
                if not await self._first_sync(sub, stop):
                    return None
                folder = await self._materialize(sub)
                model, tokenizer, self.live = await self.mlx.run(_load_model, folder, sub.state, manifest.plane)
                return manifest, task, model, tokenizer
            except StoreConfigError:
                raise
            except Exception as exc:  # malformed or missing objects, a store outage, a model mlx-lm refuses
                what = "run" if loaded is None else "weights"
                self._error(f"{what}: {describe_error(exc)}; retrying in {delay:.0f} s")
            await _wait(stop, delay)
            delay = min(2 * delay, self.options.setup_retry_max_s)
        return None

    # -- the loop ----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> int:
        """Run until `stop` is set (or max_cohorts); returns the process exit code.

        Raises `SpoolLocked` when another live macd holds this worker's spool, and
        `StoreConfigError` when the store's configuration is wrong."""
        spool = await self._open_spool(stop)
        if spool is None:
            return 0
        uploader = Uploader(self.store, spool, concurrency=self.config.transfer_concurrency)
        stop_uploads = asyncio.Event()
        upload_task = asyncio.create_task(uploader.run_forever(stop_uploads))  # drains what a last run left
        stop_beats = asyncio.Event()
        beat_task = asyncio.create_task(self._heartbeats(stop_beats, spool, uploader))
        try:
            ready = await self._setup(stop, upload_task)
            if ready is not None:
                await self._generate(ready, spool, upload_task, stop)
            upload_error = upload_task.exception() if upload_task.done() else None
            if upload_error is not None:
                raise upload_error  # a configuration error: the user must act
        finally:
            self.beat = replace(self.beat, status="stopping")
            stop_uploads.set()
            await asyncio.gather(upload_task, return_exceptions=True)
            left = await uploader.flush(self.options.flush_timeout_s)
            if left:
                log.warning("%d group(s) stay in the spool; they upload first on the next start", left)
            stop_beats.set()
            await _settle_task(beat_task, self.options.heartbeat_s)
            self.beat = replace(self.beat, status="stopped", groups_spooled=spool.depth,
                                groups_quarantined=len(spool.quarantined()), groups_uploaded=uploader.stats.uploaded)
            try:
                async with asyncio.timeout(self.options.final_beat_timeout_s):
                    await self._write_heartbeat()
            except TimeoutError:
                log.warning("the final heartbeat was not written in %.0fs", self.options.final_beat_timeout_s)
            spool.close()
            await asyncio.to_thread(self.mlx.close)
        return 0

    async def _generate(
        self, ready: tuple[RunManifest, Task, Any, Any], spool: Spool, upload_task: asyncio.Task, stop: asyncio.Event
    ) -> None:
        """Cohort after cohort until `stop` (or max_cohorts, or an upload configuration error)."""
        manifest, task, model, tokenizer = ready
        sub, live = self.sub, self.live
        assert sub is not None and sub.digest is not None  # a first sync leaves a verified state and its digest
        self.beat = replace(
            self.beat, version=sub.version, pointer_version=sub.version, tier=_tier(), state_digest=sub.digest.root()
        )
        log.info(
            "worker %s joined run %s at weights v%d (%s plane, task %s, group size %d, batch %d)",
            self.config.worker_id, manifest.run, sub.version, manifest.plane, manifest.task,
            manifest.group_size, self.config.batch,
        )
        while not stop.is_set() and not upload_task.done():
            await self._maybe_swap(sub, live)
            if self._version_budget_spent(manifest, sub):
                # Enough groups on this version: wait for the trainer's next one instead of
                # producing data that would only go stale.
                self.beat = replace(self.beat, status="waiting")
                await _wait(stop, self.options.budget_poll_s)
                continue
            if spool.full:
                self.beat = replace(self.beat, status="paused")
                await spool.wait_not_full(timeout=self.options.heartbeat_s)
                continue
            await self._cohort(manifest, task, sub, model, tokenizer, spool, stop)
            if self.options.max_cohorts is not None and self.cohorts >= self.options.max_cohorts:
                break

    def _version_budget_spent(self, manifest: RunManifest, sub: Subscriber) -> bool:
        """True while this version's group budget is spent and the trainer may still move on.

        The budget renews after `budget_patience_s` without a new version, so a trainer that
        filtered many groups (e.g. all-equal rewards) is never starved."""
        limit = manifest.worker_groups_per_version
        if not limit or self._groups_at.get(sub.version, 0) < limit:
            self._waiting_since = None
            return False
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        if now - self._waiting_since >= self.options.budget_patience_s:
            self._groups_at[sub.version] = 0
            self._waiting_since = None
            return False
        return True

    async def _maybe_swap(self, sub: Subscriber, live: Any) -> None:
        try:
            result = await sub.sync()
        except SyncError as exc:  # the subscriber's state is still the last verified one (it says so)
            self._error(f"weights: {exc}")
            return
        except StoreError as exc:
            self._error(f"weights: {describe_error(exc)}; serving v{sub.version}")
            return
        except Exception as exc:  # never leave a bad object in the bucket to stop generation
            log.exception("unexpected error syncing weights")
            self._error(f"weights: {describe_error(exc)}; serving v{sub.version}")
            return
        if result is None:
            return
        self.beat = replace(self.beat, status="syncing")
        stats = await self.mlx.run(live.apply, sub.state, result.changed, result.touched)
        assert sub.digest is not None  # a successful sync leaves a verified state and its digest
        self.beat = replace(
            self.beat, version=sub.version, pointer_version=sub.version, swaps=self.beat.swaps + 1,
            last_swap_s=result.seconds + stats.seconds, state_digest=sub.digest.root(),
        )
        log.info(
            "weights v%s -> v%d via %s: %.1f KB in %.2fs, swap %.3fs (%d tensors)",
            result.previous, result.version, result.path, result.bytes / 1e3, result.seconds,
            stats.seconds, stats.tensors,
        )

    async def _cohort(self, manifest, task, sub, model, tokenizer, spool, stop) -> None:
        from .generate import SamplingConfig, generate_groups

        items = self.rng.sample(task.items, min(self.config.batch, len(task.items)))
        prompts = [(item, prompt_tokens(tokenizer, task, item)) for item in items]
        prompts = [(i, p) for i, p in prompts if len(p) <= manifest.max_prompt_tokens]
        if not prompts:
            raise ValueError(f"every prompt of task {task.name} is longer than max_prompt_tokens")
        version, digest = sub.version, sub.digest.root()
        sampling = SamplingConfig(
            temperature=manifest.temperature, max_tokens=manifest.max_tokens, group_size=manifest.group_size,
            stop=manifest.stop, seed=None if self.options.seed is None else self.rng.randrange(1 << 30),
        )
        self.beat = replace(self.beat, status="generating")
        started = time.time()
        cancel = threading.Event()
        token_lists = [p for _, p in prompts]
        gen = asyncio.ensure_future(
            self.mlx.run(generate_groups, model, tokenizer, token_lists, sampling,
                         max_batch=self.config.max_decode or None, cancel=cancel)
        )
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({gen, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not gen.done():
            cancel.set()  # the MLX thread stops at its next decode step
            gen.cancel()  # an unfinished cohort is simply dropped
            return
        groups = gen.result()
        finished = time.time()
        tokens, rewards = 0, []
        for (item, prompt), completions in zip(prompts, groups, strict=True):
            scores = [task.reward(c.text, item.label) for c in completions]
            rewards += scores
            tokens += sum(len(c.tokens) for c in completions)
            build = build_group(
                manifest=manifest, worker_id=self.config.worker_id, item=item, prompt=prompt,
                completions=completions, rewards=scores, version=version, digest=digest,
                started_at=started, finished_at=finished,
            )
            await asyncio.to_thread(spool.add, build)
        self.cohorts += 1
        # The budget counts groups that carry a GRPO signal (rewards not all equal): the trainer
        # filters the others, so counting them would starve it.
        g = manifest.group_size
        useful = sum(1 for i in range(len(groups)) if len(set(rewards[i * g : (i + 1) * g])) > 1)
        self._groups_at = {version: self._groups_at.get(version, 0) + useful}
        rate = tokens / max(finished - started, 1e-9)
        self.beat = replace(self.beat, tokens_per_s=rate, groups_spooled=spool.depth)
        log.info(
            "cohort %d: v%d, %d groups, %d tokens, %.0f tok/s, reward mean %.3f",
            self.cohorts, version, len(groups), tokens, rate, float(np.mean(rewards)) if rewards else 0.0,
        )

    # -- heartbeats --------------------------------------------------------------------------
    async def _heartbeats(self, stop: asyncio.Event, spool: Spool, uploader: Uploader) -> None:
        """Write a heartbeat every `heartbeat_s` until `stop` is set (the final one is run's)."""
        while not stop.is_set():
            self.beat = replace(
                self.beat, groups_spooled=spool.depth, groups_quarantined=len(spool.quarantined()),
                groups_uploaded=uploader.stats.uploaded, memory_gb=_rss_gb(),
            )
            await self._write_heartbeat()
            await _wait(stop, self.options.heartbeat_s)

    async def _write_heartbeat(self) -> None:
        self.beat = replace(self.beat, updated_at=time.time())
        if self.on_heartbeat is not None:
            self.on_heartbeat(self.beat)
        try:
            await self.store.put(self.layout.heartbeat(self.config.worker_id), self.beat.to_bytes())
        except StoreConfigError:
            raise
        except StoreError as exc:
            log.warning("heartbeat not written: %s", exc)

    def _error(self, message: str) -> None:
        """Count an error in the heartbeat (`errors`, `last_error`) and log it; the same message
        again within `repeat_log_s` is counted but logged only at debug level."""
        now = time.monotonic()
        last = self._logged.get(message)
        if last is None or now - last >= self.options.repeat_log_s:
            self._logged = {m: t for m, t in self._logged.items() if now - t < self.options.repeat_log_s}
            self._logged[message] = now
            log.warning("%s", message)
        else:
            log.debug("%s", message)
        self.beat = replace(self.beat, errors=self.beat.errors + 1, last_error=message[:500])


def _load_model(folder: Path, state: dict[str, np.ndarray], plane: Plane) -> tuple[Any, Any, Any]:
    """(model, tokenizer, LiveWeights) on the MLX thread."""
    from .generate import load_model
    from .weights import LiveWeights

    model, tokenizer = load_model(folder)
    live = LiveWeights.from_state(model, state, plane)
    return model, tokenizer, live


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    """Sleep up to `seconds`, returning early when `stop` is set.

    `asyncio.timeout`, not `wait_for`: on Python 3.11 `wait_for` swallows a cancellation that
    arrives just as the awaited event fires, which once left a heartbeat loop spinning forever."""
    if stop.is_set():
        return
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        pass


async def _settle_task(task: asyncio.Task, timeout: float) -> None:
    """Let `task` end by itself for up to `timeout` seconds, then cancel it and wait."""
    await asyncio.wait({task}, timeout=timeout)
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _rss_gb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 30) if sys.platform == "darwin" else rss / (1 << 20)


def _tier() -> str:
    from .doctor import memory_bytes

    return f"{memory_bytes() / 2**30:.0f} GiB"
