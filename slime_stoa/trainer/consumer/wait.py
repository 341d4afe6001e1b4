"""The wait for a batch: discover, download and judge until the pool holds enough groups.

Listing new keys after the cursor only when the queue cannot cover the need and there is room
(backpressure: `max_pool_groups` groups discovered but not yet used), sweeping the skew window
and, more rarely, the late window behind the cursor; progress logged every
`progress_interval_s`. `ConsumerTimeout` names the workers last seen and the rejects by reason.

Pacing: each kind of listing starts again no sooner than its interval (`poll_interval_s`,
`sweep_interval_s`, `late_sweep_interval_s`) after the previous one of its kind ENDED, so a slow
store gets that much quiet between listings instead of back-to-back requests, and a wait of
`timeout` seconds makes at most about `timeout / poll_interval_s` tail listings whatever the
store's speed. A sweep goes in steps of `discovery.SWEEP_PAGES` pages, one step at a time, each
a task of its own beside the tail polls and the downloads: a sweep through junk (a writer can
put millions of keys inside the windows behind the cursor) never holds a new record back, and a
step outlives the wait that started it (the next wait takes it up). The deadline is checked
before every tail listing; one already under way is not cut short (its keys are taken one by
one into the state), so a wait ends at most one listing after its deadline. While the store is
down, a listing retries until it answers (an outage pauses the run, it never ends it), and the
wait ends after that listing.

Who was last heard from, for the message of a wait in vain: the newest record key discovered
from each worker, and the heartbeat objects under `runs/<run>/workers/` (their modification
time from one listing, and for the few most recent ones their content: status, weight version,
spool, last error). A run may have no heartbeat at all, and a heartbeat that cannot be read or
parsed is simply left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from slime_stoa.protocol.heartbeat import Heartbeat, read_heartbeat
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import Store, StoreError

from .discovery import Discovery, PollResult
from .downloads import Downloads
from .groups import Pool
from .held import Held
from .metrics import reject_counter, rejects_by_reason, worker_counter
from .shared import CLOCK_REFUSED, Shared
from .trust import WorkerTrust
from .versions import PublishedVersions

log = logging.getLogger(__name__)

MAX_HEARTBEATS = 1000  # one LIST page: enough to name the most recent ones
SHOWN = 10  # workers named in the message


class ConsumerTimeout(TimeoutError):
    """`next_batch` waited `wait_timeout_s` (when set) without getting enough groups."""

    def __init__(self, message: str, *, needed: int, ready: int, rejects: dict[str, int]) -> None:
        super().__init__(message)
        self.needed = needed
        self.ready = ready
        self.rejects = rejects


class Filler:
    def __init__(
        self,
        shared: Shared,
        *,
        discovery: Discovery,
        downloads: Downloads,
        pool: Pool,
        versions: PublishedVersions,
        trust: WorkerTrust,
        held: Held,
    ) -> None:
        self.shared = shared
        self.held = held  # records waiting for an object a writer deleted: looked at again with a backoff
        self.discovery = discovery
        self.downloads = downloads
        self.pool = pool
        self.versions = versions
        self.trust = trust
        config = shared.config
        self._next_tail = -math.inf
        self._next_sweep = time.monotonic() + config.sweep_interval_s
        self._next_late_sweep = time.monotonic() + config.late_sweep_interval_s
        self._prefetch: asyncio.Task[bool] | None = None
        self._sweep: asyncio.Task[None] | None = None  # the sweep step under way
        self._sweep_is_late = False  # the sweep under way covers the late window

    # -- discovery -----------------------------------------------------------------------------
    def capacity(self) -> int:
        return self.shared.config.max_pool_groups - len(self.pool) - self.downloads.waiting()

    async def poll_tail(self) -> int:
        shared = self.shared
        result = await shared.patiently(
            lambda: self.discovery.tail(self.capacity()), f"listing new records of run {shared.config.run!r}"
        )
        self._count_poll(result)
        shared.count("tail_listings")
        shared.count("tail_list_requests", result.requests)
        return len(result.new)

    async def poll_sweep(self, window_ms: int | None = None) -> int:
        shared = self.shared
        result = await shared.patiently(
            lambda: self.discovery.sweep(window_ms), f"listing late records of run {shared.config.run!r}"
        )
        self._count_poll(result)
        if result.late:
            log.info("stoa: found %d late record(s) behind the cursor", result.late)
        return len(result.new)

    async def _sweep_step(self, window_ms: int | None) -> None:
        """One step of a sweep (`Discovery.sweep`); the sweeps are scheduled again once it ends."""
        cfg = self.shared.config
        try:
            await self.poll_sweep(window_ms)
        finally:
            if not self.discovery.sweeping:
                if self._sweep_is_late:
                    self._next_late_sweep = time.monotonic() + cfg.late_sweep_interval_s
                self._next_sweep = time.monotonic() + cfg.sweep_interval_s  # a late sweep covers the short window too

    @property
    def discovering(self) -> bool:
        """Whether a sweep step is under way (it writes into the state); a finished one is
        forgotten here, its failure logged (no wait takes it up any more)."""
        if (task := self._finished_sweep()) is not None:
            _say_sweep_failure(task)
        return self._sweep is not None

    def _start_sweep_step(self, now: float) -> bool:
        """Start the next sweep step as a task, when one is due and none is under way (True)."""
        cfg = self.shared.config
        if self._sweep is not None:
            return False
        if self.discovery.sweeping:  # the next step of a long sweep
            window = None
        elif cfg.late_window_ms and now >= self._next_late_sweep:
            self._sweep_is_late, window = True, cfg.late_window_ms
        elif now >= self._next_sweep:
            self._sweep_is_late, window = False, None
        else:
            return False
        self._sweep = asyncio.create_task(self._sweep_step(window))
        return True

    def _finished_sweep(self) -> asyncio.Task[None] | None:
        """The sweep step when it has finished, forgotten (None while one runs, or none)."""
        task = self._sweep
        if task is None or not task.done():
            return None
        self._sweep = None
        return task

    def _reap_sweep(self) -> None:
        """Forget a finished sweep step; raises what it raised (an outage it waits out: a
        failure here is the consumer's fatal error, or a bug)."""
        if (task := self._finished_sweep()) is not None:
            task.result()

    async def stop_sweep(self) -> None:
        """Cancel the sweep step under way: its keys taken so far stay taken, the step is
        listed again from where it began by the next one (`Discovery.sweep`)."""
        task, self._sweep = self._sweep, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait([task])
        _say_sweep_failure(task)  # one that ended before the cancel: said, not lost

    def _count_poll(self, result: PollResult) -> None:
        self.shared.count("list_requests", result.requests)
        self.shared.count("late_keys", result.late)
        self.shared.count(reject_counter("bad_key"), result.bad)
        self.shared.count(reject_counter("future_key"), result.future)
        self.shared.count(reject_counter("unknown_key"), result.unknown)
        for worker, n in result.clock_refused.items():
            self.shared.count(worker_counter(worker, CLOCK_REFUSED), n)

    # -- the wait ------------------------------------------------------------------------------
    async def ready(self, n_groups: int, timeout: float | None) -> float:
        """Wait until the pool holds `n_groups` groups (after a look at the pointer: one GET, the
        published versions read again only when it moved) and no worker-registry read is due
        (a revocation reaches groups waiting in the pool); the seconds waited.
        `ConsumerTimeout` after `timeout` seconds (None: no limit)."""
        versions, trust = self.versions, self.trust
        await versions.refresh(versions.started)
        if self.shared.fatal is not None:
            raise self.shared.fatal
        start = time.monotonic()
        while True:
            if not await self.fill(n_groups, None if timeout is None else start + timeout):
                raise await self.timeout_error(n_groups, time.monotonic() - start)
            if not trust.signers_due():
                break
            await trust.refresh_signers()
            if len(self.pool) >= n_groups:
                break
        return time.monotonic() - start

    def expire(self) -> None:
        """Drop pool groups that became too stale for the trainer's version, or whose branch a
        trainer restart abandoned (when the version or the lineage read moved)."""
        v = self.versions
        off, stale = self.pool.expire((v.trainer_version, v.pointer_seen), v.lag, self.shared.config.staleness_limit)
        self.shared.count("off_lineage", off)
        self.shared.count("stale", stale)

    async def fill(self, target: int, deadline: float | None, *, quiet: bool = False) -> bool:
        """Discover, download and judge until the pool holds `target` groups (True), or until
        `deadline` (monotonic seconds; None: no limit) passes (False), checked before every
        listing (see the module doc for the pacing). Progress is logged every
        `progress_interval_s` unless `quiet` (the background prefetch)."""
        shared, cfg, downloads = self.shared, self.shared.config, self.downloads
        started = time.monotonic()
        next_log = started + cfg.progress_interval_s
        while True:
            if shared.fatal is not None:
                raise shared.fatal
            self._reap_sweep()
            self.expire()
            need = target - len(self.pool)
            if need <= 0:
                return True
            downloads.launch(need)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            # List again only when the queue cannot cover the need and there is room for more
            # (records cut at their deadline count as queued: they are tried again later).
            listing_helps = downloads.queued() < need - len(downloads.inflight) and self.capacity() > 0
            if listing_helps and now >= self._next_tail:
                if self.trust.signers_due():
                    await self.trust.refresh_signers()  # a release (or revocation) also while nothing is admitted
                try:
                    await self.poll_tail()
                finally:
                    self._next_tail = time.monotonic() + cfg.poll_interval_s
                continue
            if self._start_sweep_step(now):
                continue
            held_look = self.held.next_look()
            if now >= held_look:
                await self.held.look()
                continue
            sweep_waits = self._sweep is None  # else the step's end wakes the loop
            wake = min(
                self._next_tail if listing_helps else math.inf,
                self._next_sweep if sweep_waits else math.inf,
                self._next_late_sweep if cfg.late_window_ms and sweep_waits else math.inf,
                math.inf if deadline is None else deadline,
                next_log,
                downloads.next_cut(),  # a GET past its deadline frees its slot for another record
                held_look,
            )
            timeout = max(wake - now, 0.0)
            running: set[asyncio.Future[Any]] = set(downloads.inflight.values())
            if self._sweep is not None:
                running.add(self._sweep)
            if running:
                await asyncio.wait(running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(timeout)
            if time.monotonic() >= next_log:
                next_log = time.monotonic() + cfg.progress_interval_s
                if not quiet:
                    log.info("stoa: %s", self.progress(target, time.monotonic() - started))

    def progress(self, target: int, waited: float) -> str:
        shared = self.shared
        rejects = rejects_by_reason(shared.state.counters)
        reject_text = ", ".join(f"{r}={c}" for r, c in rejects.items()) or "none"
        newest = max(shared.state.last_seen.items(), key=lambda kv: kv[1], default=None)
        seen = (
            f"newest record from {newest[0]} {max(shared.clock() - newest[1] / 1000, 0):.0f} s ago"
            if newest
            else "no record discovered yet"
        )
        return (
            f"waited {waited:.0f} s for {target} groups of run {shared.config.run!r} (trainer v{self.versions.trainer_version}): "
            f"have {len(self.pool)} of {target} ready, {len(self.downloads.inflight)} downloading, "
            f"{self.downloads.queued()} queued, {len(self.held)} held; rejected so far: {reject_text}; {seen}"
        )

    async def timeout_error(self, needed: int, waited: float) -> ConsumerTimeout:
        shared = self.shared
        store, run, state = shared.store, shared.config.run, shared.state
        heartbeats, error = await heartbeat_times(store, run)
        recent = [w for w in newest_first(state.last_seen, heartbeats)[:SHOWN] if w in heartbeats]
        summaries = await heartbeat_summaries(store, run, recent)
        workers = describe_workers(state.last_seen, heartbeats, now=shared.clock(), heartbeat_error=error, summaries=summaries)
        counters = state.counters
        rejects = rejects_by_reason(counters)
        reject_text = (
            f"{sum(rejects.values())} record(s) rejected ({', '.join(f'{r}={c}' for r, c in rejects.items())})"
            if rejects
            else "no record rejected"
        )
        message = (
            f"stoa: waited {waited:.0f} s for {needed} rollout groups of run {run!r} in "
            f"{store.url} and have {len(self.pool)} (trainer at v{self.versions.trainer_version}, "
            f"staleness limit {shared.config.staleness_limit}). {workers}. Since start: {reject_text}; "
            f"{counters.get('stale', 0)} group(s) dropped as stale; "
            f"{counters.get('filtered_all_equal', 0)} filtered for all-equal rewards."
        )
        return ConsumerTimeout(message, needed=needed, ready=len(self.pool), rejects=rejects)

    # -- the background prefetch ---------------------------------------------------------------
    @property
    def prefetching(self) -> bool:
        return self._prefetch is not None

    def start_prefetch(self, target: int) -> None:
        self._prefetch = asyncio.create_task(self.fill(target, None, quiet=True))

    async def stop_prefetch(self) -> None:
        task, self._prefetch = self._prefetch, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:  # the next batch tries again
            exc = task.exception()
            log.warning("stoa: background prefetch failed: %s: %s", type(exc).__name__, exc)


def _say_sweep_failure(task: asyncio.Task[None]) -> None:
    """Log the failure of a sweep step no wait will take up (nothing when it ended well or was cancelled)."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("stoa: a sweep for late records failed: %s: %s", type(exc).__name__, exc)


# -- who was last heard from -----------------------------------------------------------------
async def heartbeat_times(
    store: Store, run: str, *, limit: int = MAX_HEARTBEATS
) -> tuple[dict[str, float], str | None]:
    """({worker: last modified, seconds since the epoch}, error text or None). Never raises."""
    layout = RunLayout(run)
    prefix = layout.workers_prefix
    out: dict[str, float] = {}
    try:
        listing = store.list(prefix)
        async with contextlib.aclosing(listing):
            async for info in listing:
                name = info.key[len(prefix) :]
                if name.endswith(".json") and "/" not in name and info.last_modified is not None:
                    out[name[: -len(".json")]] = info.last_modified
                if len(out) >= limit:
                    break
    except StoreError as exc:
        return out, f"{type(exc).__name__}: {exc}"
    return out, None


def heartbeat_summary(beat: Heartbeat) -> str:
    """A few words from a heartbeat: status, weights held, spool, last error."""
    bits = [beat.status]
    if beat.version is not None:
        bits.append(f"v{beat.version}" + (f" of v{beat.pointer_version}" if beat.pointer_version is not None else ""))
    if beat.groups_spooled:
        bits.append(f"{beat.groups_spooled} groups spooled")
    if beat.errors:
        bits.append(f"{beat.errors} errors, last: {beat.last_error[:120]}")
    return ", ".join(bits)


async def heartbeat_summaries(store: Store, run: str, workers: list[str]) -> dict[str, str]:
    """{worker: heartbeat_summary} for `workers` whose heartbeat reads and parses. Never raises."""
    out = {}
    for worker in workers:
        try:
            beat = await read_heartbeat(store, run, worker)  # at most MAX_HEARTBEAT_BYTES + 1 bytes
        except (StoreError, ValueError):
            continue
        out[worker] = heartbeat_summary(beat)
    return out


def newest_first(last_record_ms: Mapping[str, int], heartbeats: Mapping[str, float]) -> list[str]:
    """Workers seen by record or heartbeat, most recently seen first."""

    def newest(worker: str) -> float:
        return max(last_record_ms.get(worker, -1) / 1000, heartbeats.get(worker, -1.0))

    return sorted(set(last_record_ms) | set(heartbeats), key=newest, reverse=True)


def _age(now: float, then: float) -> str:
    seconds = max(now - then, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def describe_workers(
    last_record_ms: Mapping[str, int],
    heartbeats: Mapping[str, float],
    *,
    now: float,
    heartbeat_error: str | None = None,
    summaries: Mapping[str, str] | None = None,
    shown: int = SHOWN,
) -> str:
    """One line naming the most recently seen workers (records and heartbeats), newest first;
    `summaries` adds what a worker's heartbeat says."""
    ranked = newest_first(last_record_ms, heartbeats)
    if not ranked:
        text = "no worker seen: no rollout record discovered and no heartbeat found"
        if heartbeat_error:
            text += f" (heartbeats could not be listed: {heartbeat_error})"
        return text + "; are workers running against this bucket and run?"

    parts = []
    for worker in ranked[:shown]:
        bits = []
        if worker in last_record_ms:
            bits.append(f"last record {_age(now, last_record_ms[worker] / 1000)}")
        if worker in heartbeats:
            bits.append(f"heartbeat {_age(now, heartbeats[worker])}")
        if summaries and worker in summaries:
            bits.append(summaries[worker])
        parts.append(f"{worker} ({', '.join(bits)})")
    more = f" and {len(ranked) - shown} more" if len(ranked) > shown else ""
    text = f"workers last seen, newest first: {'; '.join(parts)}{more}"
    if heartbeat_error:
        text += f" (heartbeats could not be listed: {heartbeat_error})"
    return text
