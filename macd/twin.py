"""One process per worker id: a second `macd run` of a worker id that another live process holds
is refused at start, with one line.

Two Macs joined with the same worker key (or `--worker-id`) would number their records alike:
their (worker, seq) keys repeat and the trainer refuses half their groups as duplicates. On one
Mac the spool's lock already prevents it (`spool.SpoolLocked`); across Macs only the bucket is
shared, so a worker reads its id's heartbeat at start, before it uploads anything or writes a
heartbeat of its own (`check_no_twin`):

- no heartbeat, a "stopped" one, one older than `FRESH_BEATS` heartbeat intervals, an unreadable
  one, or one written by the previous process of this data folder (`<data_dir>/instances/<run>`:
  holding the spool's lock proves that process gone, so a restart after a crash goes on at once):
  it goes on;
- else it watches the heartbeat for up to `WATCH_BEATS` intervals. Since this process has written
  nothing yet, a heartbeat that is rewritten meanwhile (and not as "stopped") is another live
  process's: refused (`TwinWorker`: a `fatal.Fatal`, exit 2). One not rewritten was left by a
  process that is gone (a crash elsewhere, a moved data folder): it goes on.

A twin can also start later and pass that check: a Mac set up as a copy of another (the same
config, worker key and data folder, so its heartbeat looks like its own previous process's), or
one whose clock makes the heartbeat look stale. So a running worker re-checks before each
heartbeat it writes (`TwinWatch`): it reads its id's heartbeat, and one written by another
instance, not "stopped", counts as a sighting. Two different sightings (the other process rewrote
its heartbeat while this one runs; one alone may be the last heartbeat of a process gone, or a
replay) prove a twin. Then the one of the two that started later (`started_at`, then `instance`:
both workers order the pair alike) stops with one line naming the other (`TwinWorker`), keeping
its spool un-uploaded (its record keys repeat the other's); the earlier one says so once and goes on.

Every `macd run` writes a random `instance` id in its heartbeat (`Reporter.instance`), which the
refusal names and the data folder keeps. `macd join` warns when the id's heartbeat says a worker
runs (`join_cmd`), without refusing.

Threat model: heartbeats are read from a bucket anyone holding a worker token can write, so a
forged heartbeat could try to lock an honest worker out. In a signed run (the worker holds a
worker key) only a heartbeat signed by this worker's own key, for this run, counts (`counts`);
that key lives only where this worker id runs, so nobody else can cause the refusal, and a forged
one is ignored with a log line. In an unsigned run anyone who can write the bucket can forge
anything, records included; there the refusal still needs the heartbeat rewritten while the
worker watches (a stale or replayed one never blocks), and its line says what it saw and what to
do. Freshness compares the heartbeat's time with this Mac's clock: a skewed clock only decides
whether to watch, never the refusal, which rests on the heartbeat changing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from slime_stoa.protocol.fsutil import atomic_write
from slime_stoa.protocol.heartbeat import MAX_HEARTBEAT_BYTES, Heartbeat, ago
from slime_stoa.protocol.layout import RunLayout, check_name
from slime_stoa.protocol.signing import SignatureError, SigningKey, document_key_id, verify_document
from slime_stoa.protocol.store import NotFound, Store, StoreConfigError, StoreError
from slime_stoa.protocol.store.capped import read_capped_bytes
from slime_stoa.protocol.strict_json import load_json

from .aio import wait
from .fatal import Fatal

log = logging.getLogger("macd")

#: A heartbeat younger than this many heartbeat intervals may be a live process's: it is watched.
FRESH_BEATS = 3
#: How long (in heartbeat intervals) a fresh heartbeat is watched for a rewrite.
WATCH_BEATS = 2
MAX_INSTANCE_BYTES = 64


class TwinWorker(Fatal):
    """Another live process holds this worker id."""


def instance_path(data_dir: Path, run: str) -> Path:
    return data_dir / "instances" / check_name("run", run)


def previous_instance(data_dir: Path, run: str) -> str:
    """The instance id of the last process that ran `run` from this data folder ("" if none)."""
    try:
        return instance_path(data_dir, run).read_bytes()[:MAX_INSTANCE_BYTES].decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def remember_instance(data_dir: Path, run: str, instance: str) -> None:
    """Keep this process's instance id for the next start (a crash restart knows its own heartbeat)."""
    atomic_write(instance_path(data_dir, run), f"{instance}\n".encode(), durable=False, parents_mode=0o700)


def counts(data: bytes, run: str, signer: SigningKey | None) -> bool:
    """Whether heartbeat bytes `data` may stop this worker: any heartbeat in an unsigned run
    (`signer` None); in a signed run only one signed by this worker's own key for this run
    (module doc: a forgery must not lock an honest worker out)."""
    if signer is None:
        return True
    try:
        doc = load_json(data, max_bytes=MAX_HEARTBEAT_BYTES)
    except ValueError:
        return False
    if not isinstance(doc, dict) or document_key_id(doc) != signer.key_id or doc.get("run") != run:
        return False
    try:
        verify_document(doc, signer.public, where="heartbeat")
    except SignatureError:
        return False
    return True


async def read_own_heartbeat(store: Store, run: str, worker: str, signer: SigningKey | None) -> Heartbeat | None:
    """The heartbeat under this worker id when it counts (`counts`); None when there is none, it
    cannot be read (then nothing is checked: a store problem never keeps a worker from starting)
    or it does not count."""
    try:
        data = await read_capped_bytes(store, RunLayout(run).heartbeat(worker), MAX_HEARTBEAT_BYTES)
        beat = Heartbeat.from_bytes(data, worker=worker)
    except NotFound:
        return None
    except StoreConfigError:
        raise
    except (StoreError, ValueError) as exc:
        log.info("worker %s: its heartbeat could not be read (%s): not checked for another process", worker, exc)
        return None
    if not counts(data, run, signer):
        log.warning("worker %s: a heartbeat under its id is not signed by its key for run %s (a forgery, or another "
                    "run's): ignored", worker, run)
        return None
    return beat


async def check_no_twin(
    store: Store, run: str, worker: str, *, instance: str, data_dir: Path, signer: SigningKey | None,
    every_s: float, stop: asyncio.Event,
) -> None:
    """Raise `TwinWorker` when another live process holds `worker` (module doc); return when
    none does, or once `stop` is set. `every_s`: the heartbeat interval."""
    previous = previous_instance(data_dir, run)
    first = await read_own_heartbeat(store, run, worker, signer)
    if first is None or first.status == "stopped" or (first.instance and first.instance == previous):
        return
    age = time.time() - first.updated_at
    if age > FRESH_BEATS * every_s:
        return
    watch_s = WATCH_BEATS * every_s
    log.info("worker %s: its heartbeat was written %s by another process (instance %s, name %r, %s); watching "
             "it for up to %.0f s in case that one still runs", worker, ago(age), first.instance or "unknown",
             first.name, first.status, watch_s)
    deadline = time.monotonic() + watch_s
    while (left := deadline - time.monotonic()) > 0:
        await wait(stop, min(every_s / 4, left))
        if stop.is_set():
            return
        again = await read_own_heartbeat(store, run, worker, signer)
        if again is None or again.status == "stopped":
            return
        if (again.updated_at, again.instance) != (first.updated_at, first.instance):
            raise TwinWorker(twin_line(worker, run, again, signed=signer is not None))
    log.info("worker %s: that heartbeat was not rewritten: its process is gone; starting", worker)


class TwinWatch:
    """The re-check before each heartbeat this process writes (module doc): `check(own)` reads the
    id's heartbeat and returns a `TwinWorker` once another live process is proven to write it and
    this one started later; None otherwise."""

    def __init__(self, store: Store, run: str, worker: str, signer: SigningKey | None) -> None:
        self.store, self.run, self.worker, self.signer = store, run, worker, signer
        self.seen: tuple[float, str] | None = None  # (updated_at, instance) of the last other heartbeat seen
        self.twin: Heartbeat | None = None  # the other live process's heartbeat, once proven

    async def check(self, own: Heartbeat) -> TwinWorker | None:
        beat = await read_own_heartbeat(self.store, self.run, self.worker, self.signer)
        if beat is None or beat.instance == own.instance or beat.status == "stopped":
            return None
        sighting, before = (beat.updated_at, beat.instance), self.seen
        self.seen = sighting
        if before is None or before == sighting:
            return None  # not rewritten (yet): a process gone may have left it
        if (beat.started_at, beat.instance) > (own.started_at, own.instance):  # the other one started later: it stops
            if self.twin is None:
                log.warning("worker %s: another process writes its heartbeat (instance %s, name %r, started %s); it "
                            "started after this one, so it stops itself", self.worker, beat.instance or "unknown",
                            beat.name, ago(time.time() - beat.started_at))
            self.twin = beat
            return None
        self.twin = beat
        return TwinWorker(later_twin_line(self.worker, self.run, beat, signed=self.signer is not None))


def later_twin_line(worker: str, run: str, beat: Heartbeat, *, signed: bool) -> str:
    """The stop of a running worker that found a twin started before it: who, and what to do."""
    who = (f"instance {beat.instance or 'unknown'}, name {beat.name!r}, tier {beat.tier or 'unknown'}, "
           f"started {ago(time.time() - beat.started_at)}")
    proof = ", signed by this worker's key" if signed else ""
    return (
        f"another macd runs as worker {worker!r} of run {run!r} and started before this one ({who}{proof}): "
        f"two workers with one id repeat each other's record keys, so this one stops and keeps its spool "
        f"un-uploaded; give this machine an id of its own (`macd join` again with another --worker-id and "
        f"another data folder; in a signed run a worker key of its own from `stoa worker add`)"
    )


def twin_line(worker: str, run: str, beat: Heartbeat, *, signed: bool) -> str:
    """The refusal: who holds the id, and what to do."""
    who = f"instance {beat.instance or 'unknown'}, name {beat.name!r}, status {beat.status!r}"
    proof = ", signed by this worker's key" if signed else ""
    return (
        f"another macd is running as worker {worker!r} of run {run!r} (its heartbeat kept being rewritten while "
        f"this one waited: {who}{proof}): two workers with one id repeat each other's record keys and the trainer "
        f"refuses half their groups; stop the other one (`macd stop` on that Mac), or give this Mac an id of its "
        f"own (`macd join` again with another --worker-id; in a signed run a worker key of its own from "
        f"`stoa worker add`)"
    )
