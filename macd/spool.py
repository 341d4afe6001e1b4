"""The worker's on-disk spool: finished rollout groups wait here until they are in the bucket.

A group gets its permanent identity when it enters the spool: a sequence number and a
millisecond timestamp, and therefore its bucket key (`RunLayout.rollout`). Every later upload
attempt, in this process or after a restart, uses that same key, so a record can never land
twice under two keys.

Folder layout:

    <folder>/.lock                                        flock: one process per spool (holds its pid)
    <folder>/state.json                                   {"next_seq": n, "last_ms": t}
    <folder>/<seq>+<ts>+<kind>+<worker>+<run>.rec          one entry: the record's exact bytes (signed
                                                          ones in their envelope, uploaded unchanged)
    <folder>/quarantine/<same name>(.why)                 entries whose key holds other bytes
    <folder>/.tmp-*                                       half-written files (removed on open)

Guarantees:
- A sequence number is never handed out twice: the counter is rewritten atomically (temp file,
  fsync, rename, fsync of the folder) *before* the record is written, and on open the next
  number is also at least one above every entry on disk (quarantined ones included).
- Timestamps do not go backwards for this spool: `max(clock, last timestamp)`, also persisted,
  except when the clock stepped back by more than `MAX_CLOCK_STEP_BACK_MS` (a clock that ran
  ahead and was corrected, e.g. by `clock.StoreClock`): then the clock wins, else every key would
  stay stamped that far ahead (refused by the trainer past its tolerance) until time catches up.
- An entry appears atomically (temp file, fsync, rename, fsync of the folder): after a crash
  there is either nothing or the complete record. Leftover temp files are removed on open.
- The entry's file name holds every part of its key, so nothing else is needed to upload it.
- A finished group is never refused: `full` only tells the producer to pause generation.
- Every committed entry is logged (`spooled <key>`, INFO), once it is durable: the worker's own
  account of what it finished, which a reconciliation can check the bucket against.
- One process per spool: an exclusive `flock` on `.lock`, which names the holder's pid. The
  kernel releases a flock when its process dies, however it dies, so a lock left by a dead
  process is simply taken over; a live holder is named in the error (`SpoolLocked`).

Thread safety: one producer thread calling `add`/`reserve`/`commit` and an asyncio uploader
calling `pending`/`remove`/`quarantine` may share a spool. Change listeners (`subscribe`) are
called from whichever thread made the change.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slime_stoa.protocol.fsutil import atomic_write, fsync_dir
from slime_stoa.protocol.layout import ROLLOUT_KINDS, RunLayout, check_worker_id

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
LOCK_FILE = ".lock"
QUARANTINE_DIR = "quarantine"
TMP_PREFIX = ".tmp-"
MAX_SEQ = 10**10 - 1  # the key holds 10 digits
#: The most a timestamp is held above a clock that went back (the jitter of a second-resolution
#: store Date); a larger step back is a correction, and the clock is followed.
MAX_CLOCK_STEP_BACK_MS = 5_000

_ENTRY = re.compile(
    r"^(\d{10})\+(\d{13})\+(train|eval)\+([a-z0-9][a-z0-9-]{0,47})\+([A-Za-z0-9][A-Za-z0-9._-]{0,63})\.rec$"
)


class SpoolError(Exception):
    """The spool cannot be used (locked by another process, corrupt counter, bad record)."""


class SpoolLocked(SpoolError):
    """Another live process (`pid`, None if it did not say) holds the spool's lock."""

    def __init__(self, folder: Path, pid: int | None) -> None:
        self.folder = folder
        self.pid = pid
        if pid == os.getpid():
            text = f"spool {folder} is in use by another Spool object of this process (pid {pid}); close it first"
        elif pid is not None:
            text = (
                f"spool {folder} is in use by macd pid {pid}, which is still running: stop it first "
                f"(`macd stop`, or `kill {pid}`); two workers on one spool would hand out the same sequence numbers"
            )
        else:
            text = (
                f"spool {folder} is in use by another process (its lock names no pid): stop the other "
                f"`macd run` first (`macd stop`); two workers on one spool would hand out the same sequence numbers"
            )
        super().__init__(text)


def lock_holder(folder: str | os.PathLike[str]) -> int | None:
    """The pid of the live process holding the spool lock of `folder`, or None when it is free.

    (A lock held by a process of unknown pid reads as -1.)"""
    path = Path(folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            return -1 if pid is None else pid
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int | None:
    """The pid written in a lock file, None if it holds none."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


# ---------------------------------------------------------------------------------------------
# entries


@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    """A record identity handed out by `Spool.reserve`: put `seq` into the record, then commit."""

    run: str
    worker: str
    kind: str
    seq: int
    timestamp_ms: int

    @property
    def key(self) -> str:
        return RunLayout(self.run).rollout(self.worker, self.timestamp_ms, self.seq, self.kind)

    @property
    def file_name(self) -> str:
        return f"{self.seq:010d}+{self.timestamp_ms:013d}+{self.kind}+{self.worker}+{self.run}.rec"


@dataclass(frozen=True, slots=True, kw_only=True)
class SpoolEntry:
    """One spooled record: its file and the parts of its bucket key."""

    path: Path
    run: str
    worker: str
    kind: str
    seq: int
    timestamp_ms: int
    size: int

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def key(self) -> str:
        """The record's bucket key, fixed when it entered the spool."""
        return RunLayout(self.run).rollout(self.worker, self.timestamp_ms, self.seq, self.kind)

    def read(self) -> bytes:
        """The record's bytes, exactly as spooled."""
        return self.path.read_bytes()


def parse_entry(path: Path) -> SpoolEntry | None:
    """The entry a spool file name stands for; None if the name is not an entry's."""
    match = _ENTRY.match(path.name)
    if not match:
        return None
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    return SpoolEntry(
        path=path,
        seq=int(match[1]),
        timestamp_ms=int(match[2]),
        kind=match[3],
        worker=match[4],
        run=match[5],
        size=size,
    )


# ---------------------------------------------------------------------------------------------
# the spool


class Spool:
    """A bounded, crash-safe folder of records waiting for upload. Use `close()` when done."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        worker_id: str,
        run: str,
        max_bytes: int,
        max_items: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Open (creating if needed) the spool at `folder` and recover it.

        `clock` gives seconds since the epoch (macd passes `clock.StoreClock`: the store's clock);
        a record's bytes are spooled as built: its builder gets the reserved seq (`add`), and
        its encoder refuses a record over the trainer's size limit (`records.encode_group`)."""
        if max_bytes < 1 or max_items < 1:
            raise ValueError(f"max_bytes and max_items must be positive, got {max_bytes}, {max_items}")
        self.folder = Path(folder)
        self.worker_id = check_worker_id(worker_id)
        self.run = RunLayout(run).run
        self.max_bytes = max_bytes
        self.max_items = max_items
        self.clock = clock
        self.quarantine_folder = self.folder / QUARANTINE_DIR
        self._cond = threading.Condition(threading.Lock())  # guards the in-memory state
        self._reserve_lock = threading.Lock()  # serialises counter writes (held across fsync)
        self._entries: dict[str, SpoolEntry] = {}
        self._bytes = 0
        self._listeners: list[Callable[[], None]] = []
        self._next_seq = 0
        self._last_ms = 0
        self._lock_fd: int | None = None
        self._open()

    # -- opening and recovery ------------------------------------------------------------------
    def _open(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.quarantine_folder.mkdir(exist_ok=True)
        self._take_lock()
        try:
            self._remove_temp_files()
            self._load_entries()
            self._load_state()
        except BaseException:
            self.close()
            raise

    def _take_lock(self) -> None:
        """Take the spool's flock and write our pid into it; SpoolLocked naming a live holder.

        A lock file naming a process that is gone is a stale lock: its flock went with its
        process, so it is taken over here (and said so)."""
        fd = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise SpoolLocked(self.folder, holder) from None
        try:
            previous = _read_pid(fd)
            if previous is not None and previous != os.getpid():
                log.info("spool: taking over the lock of pid %d, which no longer holds it", previous)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd

    def _remove_temp_files(self) -> None:
        for folder in (self.folder, self.quarantine_folder):
            for path in folder.glob(f"{TMP_PREFIX}*"):
                log.info("spool: removing leftover temp file %s", path)
                path.unlink(missing_ok=True)

    def _load_entries(self) -> None:
        for path in self.folder.iterdir():
            if path.name in (STATE_FILE, LOCK_FILE) or not path.is_file():
                continue
            entry = parse_entry(path)
            if entry is None:
                log.warning("spool: ignoring unknown file %s", path)
                continue
            self._entries[entry.name] = entry
            self._bytes += entry.size
            self._see(entry.seq, entry.timestamp_ms)
        for path in self.quarantine_folder.iterdir():
            entry = parse_entry(path)
            if entry is not None:
                self._see(entry.seq, entry.timestamp_ms)

    def _see(self, seq: int, timestamp_ms: int) -> None:
        self._next_seq = max(self._next_seq, seq + 1)
        self._last_ms = max(self._last_ms, timestamp_ms)

    def _load_state(self) -> None:
        path = self.folder / STATE_FILE
        try:
            state = json.loads(path.read_bytes())
            self._see(int(state["next_seq"]) - 1, int(state["last_ms"]))
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError) as exc:
            # Written atomically, so this means outside damage: refuse rather than reuse numbers.
            raise SpoolError(
                f"spool counter {path} is unreadable ({exc}); if the bucket already holds records "
                f"of worker {self.worker_id!r}, restore it with a next_seq above their highest seq"
            ) from None

    def close(self) -> None:
        """Release the spool's lock (entries stay on disk)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # released cleanly: no pid left behind to take over
            os.close(fd)

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- adding --------------------------------------------------------------------------------
    def reserve(self, kind: str = "train") -> Reservation:
        """Hand out the next seq and timestamp (persisted before returning) for a new record."""
        if kind not in ROLLOUT_KINDS:
            raise ValueError(f"unknown rollout kind {kind!r}; expected one of {sorted(ROLLOUT_KINDS)}")
        with self._reserve_lock:
            with self._cond:
                seq, last_ms = self._next_seq, self._last_ms
            if seq > MAX_SEQ:
                raise SpoolError(f"spool {self.folder}: sequence numbers exhausted")
            now_ms = int(self.clock() * 1000)
            ts = now_ms if last_ms - now_ms > MAX_CLOCK_STEP_BACK_MS else max(now_ms, last_ms)
            state = json.dumps({"next_seq": seq + 1, "last_ms": ts}).encode()
            atomic_write(self.folder / STATE_FILE, state, tmp_prefix=TMP_PREFIX)  # durable before the seq is used
            with self._cond:
                self._next_seq, self._last_ms = seq + 1, ts
        return Reservation(run=self.run, worker=self.worker_id, kind=kind, seq=seq, timestamp_ms=ts)

    def next_seq(self) -> int:
        """The seq the next reservation will get (informational; `reserve` is what claims it)."""
        with self._cond:
            return self._next_seq

    def commit(self, reservation: Reservation, data: bytes) -> SpoolEntry:
        """Write the record for `reservation` durably and make it pending."""
        data = bytes(data)
        with self._cond:
            if reservation.file_name in self._entries:
                raise SpoolError(f"reservation seq {reservation.seq} was already committed")
        path = atomic_write(self.folder / reservation.file_name, data, tmp_prefix=TMP_PREFIX)
        entry = SpoolEntry(
            path=path,
            run=reservation.run,
            worker=reservation.worker,
            kind=reservation.kind,
            seq=reservation.seq,
            timestamp_ms=reservation.timestamp_ms,
            size=len(data),
        )
        with self._cond:
            self._entries[entry.name] = entry
            self._bytes += entry.size
        log.info("spooled %s", entry.key)  # the worker's own account of what it finished
        self._changed()
        return entry

    def add(self, record: bytes | Callable[[int, int], bytes], *, kind: str = "train") -> SpoolEntry:
        """Spool one record; returns once it is durable.

        `record` is the record's bytes, or `build(seq, timestamp_ms) -> bytes` called with the
        identity this record gets, so the seq inside the record matches its key. A seq whose
        build raised is simply never used.
        """
        reservation = self.reserve(kind)
        data = record(reservation.seq, reservation.timestamp_ms) if callable(record) else record
        return self.commit(reservation, data)

    # -- uploader side -------------------------------------------------------------------------
    def pending(self) -> list[SpoolEntry]:
        """Entries waiting for upload, oldest (lowest seq) first."""
        with self._cond:
            entries = list(self._entries.values())
        return sorted(entries, key=lambda e: (e.seq, e.name))

    def remove(self, entry: SpoolEntry) -> None:
        """Forget an entry whose record is safely in the bucket (idempotent)."""
        entry.path.unlink(missing_ok=True)  # a lost unlink only causes a confirmed duplicate
        self._forget(entry)

    def quarantine(self, entry: SpoolEntry, reason: str) -> Path:
        """Move an entry that must not be uploaded aside (kept for a human); returns its path."""
        target = self.quarantine_folder / entry.name
        with contextlib.suppress(FileNotFoundError):
            os.replace(entry.path, target)
            (self.quarantine_folder / f"{entry.name}.why").write_text(reason + "\n")
            fsync_dir(self.quarantine_folder)
            fsync_dir(self.folder)
        self._forget(entry)
        return target

    def quarantined(self) -> list[SpoolEntry]:
        """Entries moved to quarantine, lowest seq first."""
        found = (parse_entry(p) for p in self.quarantine_folder.iterdir())
        return sorted((e for e in found if e is not None), key=lambda e: e.seq)

    def _forget(self, entry: SpoolEntry) -> None:
        with self._cond:
            known = self._entries.pop(entry.name, None)
            if known is not None:
                self._bytes -= known.size
        if known is not None:
            self._changed()

    # -- stats and back-pressure ---------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Entries waiting for upload."""
        with self._cond:
            return len(self._entries)

    @property
    def bytes(self) -> int:
        """Bytes of the entries waiting for upload."""
        with self._cond:
            return self._bytes

    @property
    def full(self) -> bool:
        """At or over `max_items` or `max_bytes`: the producer should pause generation."""
        with self._cond:
            return self._is_full()

    def _is_full(self) -> bool:
        return len(self._entries) >= self.max_items or self._bytes >= self.max_bytes

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener()` after every add or removal; returns a function that unsubscribes."""
        with self._cond:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._cond, contextlib.suppress(ValueError):
                self._listeners.remove(listener)

        return unsubscribe

    def _changed(self) -> None:
        with self._cond:
            self._cond.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener()
            except Exception:  # a broken listener must not fail an add or a removal
                log.exception("spool: change listener failed")

    def wait_not_full_sync(self, timeout: float | None = None) -> bool:
        """Block the calling thread until the spool is not full; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._is_full(), timeout)

    async def wait_not_full(self, timeout: float | None = None) -> bool:
        """Wait (async) until the spool is not full; False on timeout."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def poke() -> None:
            with contextlib.suppress(RuntimeError):  # the loop may be closed already
                loop.call_soon_threadsafe(changed.set)

        unsubscribe = self.subscribe(poke)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    changed.clear()
                    if not self.full:
                        return True
                    await changed.wait()
        except TimeoutError:
            return False
        finally:
            unsubscribe()

    def stats(self) -> dict[str, int]:
        """Depth, bytes and the next seq, for heartbeats."""
        with self._cond:
            return {"depth": len(self._entries), "bytes": self._bytes, "next_seq": self._next_seq}
