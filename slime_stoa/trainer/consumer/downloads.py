"""Record downloads: the queue (keys discovered, and reuse-ledger entries of a restored state),
oldest first, `download_concurrency` at a time, each object at most one byte past the record
size limit, and the retries.

One slow object never holds a batch. Only as many downloads start as the batch still needs, so
a GET that the network holds (a trickling answer never trips a read timeout) would hold the
batch until the store's own deadline. A download still fetching after `download_deadline_s`
(plus its listed size at `MIN_RATE_BYTES_S`) is cut: its slot goes to the next record, and the
record stays queued behind every record not yet tried (`deferred`), then is fetched once more
with only the store's deadline (one cut per record, so a slow link still gets every record, and
none is lost). Cuts are counted (`downloads_cut`); a cut is not a failed attempt.

A download that fails as unavailable asks the store a cheap question (HEAD of the pointer, one
probe shared by every download): if the store does not answer, the downloads wait without
counting the try; if it does, only that object fails and the try counts towards
`max_download_attempts`, after which the record is rejected as `download`. A `StoreConfigError`
becomes the consumer's fatal error (the key stays queued).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn

from slime_stoa.protocol.store import NotFound, StoreConfigError, StoreError, StoreUnavailable
from slime_stoa.protocol.validate import RecordRejected

from .held import Held
from .shared import Shared

log = logging.getLogger(__name__)

#: A download's deadline grows with the record's listed size at this rate (the store's own
#: overall deadline assumes the same slow link, so this one stays the shorter).
MIN_RATE_BYTES_S = 64 << 10

#: Judges a downloaded record (name, bytes, uses: None for a new record, else its ledger count);
#: False when the record stays queued (a fatal error met while judging it).
Judge = Callable[[str, bytes, int | None], Awaitable[bool]]


class _Retry(Exception):
    """A download failed and stays queued for another attempt."""


class _StoreWasDown(Exception):
    """A download failed during an outage that is now over: try it again at once, uncounted."""


class Downloads:
    def __init__(
        self,
        shared: Shared,
        *,
        judge: Judge,
        refuse: Callable[[str], Awaitable[bool]],
        held: Held,
    ) -> None:
        self.shared = shared
        self.judge = judge
        self.refuse = refuse  # True (counted) for a record not even to download (a quarantined or unregistered worker's)
        self.held = held  # records held: queued, not downloaded until what they need is back
        self.restore: dict[str, int] = {}  # ledger entries to download again: name -> uses
        self.inflight: dict[str, asyncio.Task[None]] = {}
        self.deferred: set[str] = set()  # cut at the deadline once: tried again after the others
        self._fetching: dict[str, float] = {}  # name -> when its cuttable GET must be done (monotonic)
        self._cut_tasks: set[asyncio.Task[None]] = set()  # cut, still ending
        self._attempts: dict[str, int] = {}
        self._probe: asyncio.Task[bool] | None = None  # the shared "is the store down?" question

    def queued(self) -> int:
        """Keys waiting for a download (not in flight, not held)."""
        return len(self.restore) + len(self.shared.state.pending) - len(self.inflight) - len(self.held)

    def waiting(self) -> int:
        """Keys discovered or restored, not yet judged (in flight or not)."""
        return len(self.restore) + len(self.shared.state.pending)

    def launch(self, want: int) -> None:
        """Cut the downloads past their deadline, then start downloads, oldest key first (ledger
        entries before new ones, records cut once after both)."""
        self.cut_slow()
        pending, busy = self.shared.state.pending, set(self.inflight) | self.deferred | set(self.held)
        slots = min(self.shared.config.download_concurrency, want) - len(self.inflight)
        if slots <= 0:
            return
        restore = [n for n in sorted(self.restore) if n not in busy][:slots]
        slots -= len(restore)
        fresh = heapq.nsmallest(slots + len(busy), pending) if slots > 0 else []
        fresh = [n for n in fresh if n not in busy][:slots]
        slots -= len(fresh)
        self.deferred = {n for n in self.deferred if n in pending or n in self.restore}  # not dropped meanwhile
        again = [n for n in sorted(self.deferred) if n not in self.inflight and n not in self.held][: max(slots, 0)]
        for name in restore:
            self._start(name, None, self.restore[name])
        for name in fresh + again:
            if name in self.restore:
                self._start(name, None, self.restore[name])
            else:
                self._start(name, pending[name], None)

    def _start(self, name: str, size: int | None, uses: int | None) -> None:
        self.inflight[name] = asyncio.create_task(self._download(name, size, uses), name=f"stoa-get-{name}")

    def cut_slow(self) -> int:
        """Cut every GET past its deadline (its record stays queued, `deferred`); how many."""
        now = time.monotonic()
        late = [name for name, due in self._fetching.items() if now >= due]
        for name in late:
            del self._fetching[name]
            task = self.inflight.pop(name, None)  # the slot is free now; its task ends on its own
            if task is not None:
                task.cancel()
                self._cut_tasks.add(task)
                task.add_done_callback(self._cut_tasks.discard)
            self.deferred.add(name)
            self.shared.count("downloads_cut")
            log.warning(
                "stoa: download of %s took longer than %.0f s: cut; it is tried again after the other records",
                self.shared.prefix + name, self.shared.config.download_deadline_s,
            )
        return len(late)

    def next_cut(self) -> float:
        """When (monotonic) the next GET in flight passes its deadline (inf: none will)."""
        return min(self._fetching.values(), default=math.inf)

    def forget(self, name: str) -> None:
        self.shared.state.pending.pop(name, None)
        self.restore.pop(name, None)
        self._attempts.pop(name, None)
        self.deferred.discard(name)

    async def _download(self, name: str, size: int | None, uses: int | None) -> None:
        shared = self.shared
        try:
            if await self.held.hold_before_download(name):  # stays queued, held
                return
            if await self.refuse(name):  # not even downloaded
                self.forget(name)
                return
            try:
                while True:
                    try:
                        data = await self._fetch(name, size)
                        break
                    except _StoreWasDown:
                        continue  # the outage is over: again, at once
            except _Retry:
                return
            except StoreConfigError as exc:  # the key stays queued; next_batch raises this
                shared.fatal = exc
                return
            except RecordRejected as exc:
                self.forget(name)
                shared.reject(name, exc.reason, exc.detail)
                return
            # Still in flight while it is judged: nobody downloads it again.
            if await self.judge(name, data, uses):
                self.forget(name)
        finally:
            if self.inflight.get(name) is asyncio.current_task():  # a cut task's slot went to another
                del self.inflight[name]

    async def _fetch(self, name: str, size: int | None) -> bytes:
        shared = self.shared
        limit = shared.config.record_limits.max_record_bytes
        if size is not None and size > limit:
            raise RecordRejected("too_large", f"object is {size} bytes, limit {limit}")
        if size == 0:
            return b""
        key = shared.prefix + name
        shared.count("get_requests")
        if name not in self.deferred:  # a record's first GET may be cut; its second has the store's deadline
            self._fetching[name] = time.monotonic() + shared.config.download_deadline_s + (size or 0) / MIN_RATE_BYTES_S
        try:
            try:
                # Never more than one byte past the limit, even if the object grew since it was listed.
                result = await shared.store.get(key, length=limit + 1)
            finally:
                self._fetching.pop(name, None)  # the GET is over: waiting out an outage is never cut
        except NotFound:
            raise RecordRejected("missing", "listed, then gone (deleted by retention?)") from None
        except StoreConfigError:
            raise  # credentials, bucket: fatal for the whole consumer (see _download)
        except StoreUnavailable as exc:
            if await self._store_was_down():
                raise _StoreWasDown from None
            self._count_failed_attempt(name, key, exc)
        except StoreError as exc:
            self._count_failed_attempt(name, key, exc)
        assert result is not None
        if result.size > limit:
            raise RecordRejected("too_large", f"object is {result.size} bytes, limit {limit}")
        return result.data

    def _count_failed_attempt(self, name: str, key: str, exc: StoreError) -> NoReturn:
        """Raise `_Retry`, or reject the record once it failed `max_download_attempts` times."""
        attempts = self._attempts[name] = self._attempts.get(name, 0) + 1
        if attempts >= self.shared.config.max_download_attempts:
            raise RecordRejected("download", f"{attempts} attempts failed; last: {exc}") from None
        log.warning("stoa: download of %s failed (attempt %d), will retry: %s", key, attempts, exc)
        raise _Retry from None

    async def _store_was_down(self) -> bool:
        """After a record GET failed as unavailable: wait until the store answers a cheap probe
        (one probe shared by every download). True if it did not answer at first (an outage)."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._run_probe(), name="stoa-store-probe")
        return await asyncio.shield(self._probe)

    async def _run_probe(self) -> bool:
        shared, down = self.shared, False

        async def probe() -> bool:
            nonlocal down
            try:
                return await shared.store.exists(shared.layout.pointer)
            except StoreUnavailable:
                down = True
                raise

        await shared.patiently(probe, f"record downloads from {shared.store.url}")
        return down

    def take_tasks(self) -> list[asyncio.Task]:
        """Every task in flight (downloads, the probe), for `close` to cancel; forgets them."""
        tasks: list[asyncio.Task] = [*self.inflight.values(), *self._cut_tasks]
        if self._probe is not None:
            tasks.append(self._probe)
            self._probe = None
        self.inflight.clear()
        self._fetching.clear()
        return tasks
