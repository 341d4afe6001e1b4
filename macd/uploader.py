"""Moves spooled records into the bucket, each exactly once, under the key the spool gave it.

Every upload is a put-if-absent of the entry's bytes at the entry's key. The entry leaves the
spool only after the bucket holds exactly those bytes:

- the put succeeded and a HEAD finds the key at the entry's size → uploaded. The HEAD (one small
  request per record, a fraction of a PUT's price) catches a put acknowledged but never stored
  (a faulty gateway or proxy): the entry stays and is retried like a failed one. Waiting for the
  trainer to list the record instead would keep every entry for minutes and need a listing
  per worker; the HEAD after the write settles it at once (S3 and R2 read their own writes);
- the key already exists (a crash after the upload but before the spool file was removed, or an
  answer lost on the network) → GET it: the same bytes → confirmed duplicate, removed; other
  bytes → never overwritten: the entry moves to the spool's quarantine and an error is logged;
- the store is unreachable or failing (`StoreUnavailable`, I/O errors) → the entry stays; the
  uploader stops the pass, backs off (exponential, capped, jittered) and tries again, forever;
- any other failure of one entry (a request the store rejects, an unexpected error) → that entry
  stays and is held back with its own backoff while the others go on, so one bad entry cannot
  block the spool;
- `StoreConfigError` (credentials, bucket, clock) → the uploader stops and raises it: retrying
  will not help until someone fixes the configuration. Entries stay on disk.

Cancelling an upload at any point is safe: at worst the object landed and the next attempt
confirms it as a duplicate.

Shutdown (SIGTERM): set the `run_forever` stop event, await it, then `await flush(timeout)`,
which drains for a bounded time and returns how many entries are left for the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from slime_stoa.protocol.store import (
    NotFound,
    PreconditionFailed,
    Store,
    StoreConfigError,
    StoreError,
    StoreUnavailable,
)
from slime_stoa.protocol.store.retry import describe_error

from .spool import Spool, SpoolEntry

log = logging.getLogger(__name__)


@dataclass
class UploaderStats:
    """Counters since the uploader was created (for heartbeats and logs)."""

    uploaded: int = 0  # records written by us
    retries: int = 0  # failed attempts that will be retried
    duplicates_confirmed: int = 0  # key already held our exact bytes
    quarantined: int = 0  # key held other bytes: entry moved aside
    consecutive_failures: int = 0  # failed passes (store down) since the last success
    held: int = 0  # entries waiting out their own backoff
    last_error: str | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class _Retry(Exception):
    """An attempt failed in a way that heals: keep the entry and back off."""


@dataclass
class _Pass:
    """State shared by the concurrent workers of one pass over the pending entries."""

    entries: Iterator[SpoolEntry]
    settled: int = 0
    failed: bool = False


class Uploader:
    """Drains a `Spool` into a `Store` with bounded concurrency; never drops an entry."""

    def __init__(
        self,
        store: Store,
        spool: Spool,
        *,
        concurrency: int = 4,
        retry_delay: float = 0.5,
        max_retry_delay: float = 30.0,
        poll_interval: float = 1.0,
        rng: random.Random | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        if retry_delay <= 0 or max_retry_delay < retry_delay:
            raise ValueError("need 0 < retry_delay <= max_retry_delay")
        self.store = store
        self.spool = spool
        self.concurrency = concurrency
        self.retry_delay = retry_delay
        self.max_retry_delay = max_retry_delay
        self.poll_interval = poll_interval
        self.stats = UploaderStats()
        self._rng = rng or random.Random()
        self._in_flight: set[str] = set()  # entry names being uploaded by any drain
        self._held: dict[str, tuple[float, int]] = {}  # entry name -> (retry at, failures)

    # -- public loops --------------------------------------------------------------------------
    async def drain(self, stop_event: asyncio.Event | None = None) -> int:
        """Upload until nothing is left to try (or `stop_event` is set); returns entries settled.

        While the store is down this keeps retrying with backoff. Entries held back after their
        own failure are left for a later call. Raises StoreConfigError.
        """
        settled = 0
        while not _is_set(stop_event):
            batch = self._ready()
            if not batch:
                break
            state = await self._pass(batch, stop_event)
            settled += state.settled
            if state.failed:
                self.stats.consecutive_failures += 1
                await self._back_off(stop_event)
        return settled

    async def run_forever(self, stop_event: asyncio.Event) -> None:
        """Drain whenever entries arrive (woken by the spool, else every `poll_interval`).

        Returns once `stop_event` is set and the uploads in flight have finished; raises
        StoreConfigError (entries stay in the spool).
        """
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def poke() -> None:  # called from the producer thread
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(wake.set)

        unsubscribe = self.spool.subscribe(poke)
        try:
            while not stop_event.is_set():
                wake.clear()
                await self.drain(stop_event)
                await _wait_any((stop_event, wake), self.poll_interval)
        finally:
            unsubscribe()

    async def flush(self, timeout: float) -> int:
        """Drain for at most `timeout` seconds (on shutdown); returns how many entries are left.

        A configuration error ends the flush early (logged, kept in `stats.last_error`).
        """
        try:
            async with asyncio.timeout(timeout):
                while self.spool.depth:
                    await self.drain()
                    if self.spool.depth:
                        await asyncio.sleep(0.05)  # the rest is in flight in another drain
        except TimeoutError:
            pass
        except StoreConfigError as exc:
            log.error("upload stopped: %s", exc)
        left = self.spool.depth
        if left:
            log.warning("flush: %d record(s) stay in the spool %s for the next start", left, self.spool.folder)
        return left

    # -- one pass ------------------------------------------------------------------------------
    def _ready(self) -> list[SpoolEntry]:
        """Pending entries to try now, oldest first: not in flight, not held back."""
        now = asyncio.get_running_loop().time()
        return [
            e
            for e in self.spool.pending()
            if e.name not in self._in_flight and self._held.get(e.name, (0.0, 0))[0] <= now
        ]

    async def _pass(self, batch: list[SpoolEntry], stop_event: asyncio.Event | None) -> _Pass:
        """Upload `batch` (oldest first) with `concurrency` workers; stop early on a failure."""
        state = _Pass(entries=iter(batch))
        tasks = [
            asyncio.create_task(self._worker(state, stop_event))
            for _ in range(min(self.concurrency, len(batch)))
        ]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return state

    async def _worker(self, state: _Pass, stop_event: asyncio.Event | None) -> None:
        for entry in state.entries:  # shared iterator: each entry goes to one worker
            if state.failed or _is_set(stop_event):
                return
            if entry.name in self._in_flight:
                continue
            self._in_flight.add(entry.name)
            try:
                await self._settle(entry)
                state.settled += 1
                self.stats.consecutive_failures = 0
                self._release(entry)
            except StoreConfigError as exc:
                self.stats.last_error = describe_error(exc)
                raise
            except (StoreUnavailable, OSError, TimeoutError) as exc:  # the store (or disk) is down
                state.failed = True
                self._note_failure(entry, exc)
            except Exception as exc:
                self._hold(entry)
                self._note_failure(entry, exc)
            finally:
                self._in_flight.discard(entry.name)

    async def _settle(self, entry: SpoolEntry) -> None:
        """Get `entry` into the bucket (or quarantine); raises if it must be retried."""
        try:
            data = await asyncio.to_thread(entry.read)
        except FileNotFoundError:
            log.warning("spool entry %s vanished before upload; forgetting it", entry.path)
            self.spool.remove(entry)
            return
        try:
            await self.store.put_if_absent(entry.key, data)
        except PreconditionFailed:
            await self._resolve_existing(entry, data)
            return
        await self._confirm_stored(entry, len(data))
        self.spool.remove(entry)
        self.stats.uploaded += 1

    async def _confirm_stored(self, entry: SpoolEntry, size: int) -> None:
        """The bucket holds `size` bytes at the entry's key after its put was acknowledged, else
        `_Retry` (the entry stays). Another object of that size there is settled by the retry's
        put-if-absent, which then compares the bytes."""
        try:
            info = await self.store.head(entry.key)
        except NotFound:
            raise _Retry(f"the upload of {entry.key} was acknowledged but the bucket does not hold it; "
                         "the record stays in the spool and is uploaded again") from None
        if info.size != size:
            raise _Retry(f"{entry.key} holds {info.size} bytes after our upload of {size}; checking it again")

    async def _resolve_existing(self, entry: SpoolEntry, data: bytes) -> None:
        """The key exists: confirm it holds our bytes, or quarantine the entry."""
        try:
            existing = await self.store.get_bytes(entry.key)
        except NotFound:
            raise _Retry(f"{entry.key} exists for put-if-absent but not for GET") from None
        if existing == data:
            log.info("%s was already uploaded (same bytes): confirmed", entry.key)
            self.spool.remove(entry)
            self.stats.duplicates_confirmed += 1
            return
        reason = (
            f"{entry.key} already holds a different object ({len(existing)} bytes, ours "
            f"{len(data)}); not overwritten"
        )
        target = self.spool.quarantine(entry, reason)
        self.stats.quarantined += 1
        self.stats.last_error = reason
        log.error("%s; our record is kept at %s", reason, target)

    # -- failures ------------------------------------------------------------------------------
    def _note_failure(self, entry: SpoolEntry, exc: Exception) -> None:
        self.stats.retries += 1
        self.stats.last_error = describe_error(exc)
        if isinstance(exc, (_Retry, StoreError, OSError, TimeoutError)):
            log.warning("upload of %s failed, will retry: %s", entry.key, self.stats.last_error)
        else:  # not a store error: a bug, but dropping the record would be worse
            log.exception("unexpected error uploading %s; will retry", entry.key)

    def _hold(self, entry: SpoolEntry) -> None:
        """Hold one failing entry back for its own backoff delay."""
        failures = self._held.get(entry.name, (0.0, 0))[1] + 1
        retry_at = asyncio.get_running_loop().time() + self._delay(failures)
        self._held[entry.name] = (retry_at, failures)
        self.stats.held = len(self._held)

    def _release(self, entry: SpoolEntry) -> None:
        if self._held.pop(entry.name, None) is not None:
            self.stats.held = len(self._held)

    def _delay(self, failures: int) -> float:
        """Exponential backoff with a cap and jitter (half to full delay)."""
        cap = min(self.max_retry_delay, self.retry_delay * 2.0 ** min(max(failures - 1, 0), 32))
        return self._rng.uniform(cap / 2, cap)

    async def _back_off(self, stop_event: asyncio.Event | None) -> None:
        delay = self._delay(self.stats.consecutive_failures)
        log.info("store failing (%s); next try in %.1fs", self.stats.last_error, delay)
        await _wait_any((stop_event,) if stop_event else (), delay)


def _is_set(event: asyncio.Event | None) -> bool:
    return event is not None and event.is_set()


async def _wait_any(events: tuple[asyncio.Event, ...], timeout: float) -> None:
    """Return when any of `events` is set or after `timeout` seconds."""
    if not events:
        await asyncio.sleep(timeout)
        return
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
