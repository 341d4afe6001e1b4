"""The worker's spool and uploader: every finished group lands in the bucket exactly once.

Runs against both backends (local folder and a real SeaweedFS S3 server). The kill test SIGKILLs a
real worker process at random moments and then checks the bucket key by key.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from macd.spool import Spool, SpoolError
from macd.uploader import Uploader
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.records import (
    RolloutGroup,
    Sample,
    SamplingParams,
    decode_group,
    encode_group,
)
from slime_stoa.protocol.store import Store, StoreConfigError, open_store
from slime_stoa.protocol.store.retry import RetryPolicy
from slime_stoa.protocol.store.s3 import S3Store
from tests.conftest import async_wait_until, random_seed
from tests.s3server import LOOPBACK, LocalS3Server, free_ports

RUN = "spool-test"
WORKER = "mac-07"
LAYOUT = RunLayout(RUN)
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# helpers


def make_record(seq: int, *, worker: str = WORKER, run: str = RUN, kind: str = "train", salt: int = 0) -> bytes:
    """A small valid record carrying `seq` (salt changes the bytes, not the identity)."""
    sample = Sample(response_tokens=[5, 6, seq % 1000], logprobs=[-0.5, -1.0, -2.0], finish_reason="stop", reward=1.0)
    group = RolloutGroup(
        kind=kind,
        run=run,
        task_id="t",
        prompt_index=seq + salt,
        prompt_tokens=[1, 2, 3],
        samples=(sample, sample),
        weight_version=0,
        state_digest="ab" * 16,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8),
        worker_id=worker,
        seq=seq,
        started_at=1.0,
        finished_at=2.0,
    )
    return encode_group(group)


def builder(kind: str = "train") -> Callable[[int, int], bytes]:
    return lambda seq, ts_ms: make_record(seq, kind=kind)


def open_spool(folder: Path, **kw: object) -> Spool:
    options: dict[str, object] = {"worker_id": WORKER, "run": RUN, "max_bytes": 1 << 30, "max_items": 10_000}
    return Spool(folder, **{**options, **kw})  # type: ignore[arg-type]


def fast_uploader(store: Store, spool: Spool, **kw: object) -> Uploader:
    options: dict[str, object] = {"retry_delay": 0.02, "max_retry_delay": 0.1, "poll_interval": 0.05}
    return Uploader(store, spool, **{**options, **kw})  # type: ignore[arg-type]


async def bucket_keys(store: Store, kind: str = "train") -> list[str]:
    return [info.key async for info in store.list(LAYOUT.rollouts_prefix(kind))]


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[Spool]:
    with open_spool(tmp_path / "spool") as s:
        yield s


# ---------------------------------------------------------------------------------------------
# spool alone


def test_entries_are_durable_and_named_by_their_key(tmp_path: Path) -> None:
    clock = iter([5.0, 4.0, 6.0]).__next__  # goes backwards once: timestamps must not
    with open_spool(tmp_path / "s", clock=clock) as spool:
        entries = [spool.add(builder()), spool.add(builder("eval"), kind="eval"), spool.add(builder())]
    assert [e.seq for e in entries] == [0, 1, 2]
    assert [e.timestamp_ms for e in entries] == [5000, 5000, 6000]
    assert entries[1].key == LAYOUT.rollout(WORKER, 5000, 1, "eval")
    for entry in entries:
        group = decode_group(entry.read())
        assert (group.seq, group.kind, group.worker_id) == (entry.seq, entry.kind, WORKER)
    with open_spool(tmp_path / "s", clock=lambda: 1.0) as again:  # the clock went back further
        assert [e.key for e in again.pending()] == [e.key for e in entries]
        assert again.add(builder()).timestamp_ms == 6000


def test_restart_never_reuses_a_seq(tmp_path: Path) -> None:
    folder = tmp_path / "s"
    with open_spool(folder) as spool:
        for _ in range(3):
            spool.remove(spool.add(builder()))  # uploaded: nothing on disk names seq 0-2
        spool.reserve()  # seq 3 reserved, then a crash before its record was written
    (folder / ".tmp-halfwritten").write_bytes(b"partial")
    with open_spool(folder) as spool:
        assert not (folder / ".tmp-halfwritten").exists()
        assert spool.add(builder()).seq == 4
    (folder / "state.json").unlink()  # counter lost: the entries on disk still bound it
    with open_spool(folder) as spool:
        assert spool.add(builder()).seq == 5


def test_a_reservation_is_committed_once(spool: Spool) -> None:
    reservation = spool.reserve()
    spool.commit(reservation, make_record(reservation.seq))
    with pytest.raises(SpoolError, match="already committed"):
        spool.commit(reservation, make_record(reservation.seq))
    assert spool.depth == 1


def test_one_process_per_spool(spool: Spool) -> None:
    with pytest.raises(SpoolError, match="in use"):
        open_spool(spool.folder)


HOLD_SPOOL = f"""
import sys, time
from macd.spool import Spool
spool = Spool(sys.argv[1], worker_id={WORKER!r}, run={RUN!r}, max_bytes=1 << 20, max_items=10)
print("locked", flush=True)
time.sleep(600)
"""


def hold_spool(folder: Path) -> subprocess.Popen:
    """Another process holding the spool at `folder` (it says so once it does)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_SPOOL, str(folder)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_a_spool_held_by_a_live_process_names_it_and_what_to_do(tmp_path: Path) -> None:
    from macd.spool import SpoolLocked, lock_holder

    folder = tmp_path / "spool"
    holder = hold_spool(folder)
    try:
        assert lock_holder(folder) == holder.pid
        with pytest.raises(SpoolLocked) as raised:
            open_spool(folder)
        message = str(raised.value)
        assert raised.value.pid == holder.pid and "\n" not in message
        assert f"macd pid {holder.pid}, which is still running" in message
        assert "`macd stop`" in message and f"`kill {holder.pid}`" in message
        assert holder.poll() is None  # nobody touched it
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from macd.spool import LOCK_FILE, lock_holder

    folder = tmp_path / "spool"
    holder = hold_spool(folder)
    holder.send_signal(signal.SIGKILL)  # no chance to clean up
    holder.wait()
    assert (folder / LOCK_FILE).read_text().strip() == str(holder.pid)  # the lock file still names it
    assert lock_holder(folder) is None  # but the kernel released its lock with it
    with caplog.at_level("INFO", logger="macd.spool"), open_spool(folder) as spool:
        assert spool.add(builder()).seq == 0
        assert (folder / LOCK_FILE).read_text().strip() == str(os.getpid())
        assert lock_holder(folder) == os.getpid()
    assert f"taking over the lock of pid {holder.pid}" in caplog.text
    assert (folder / LOCK_FILE).read_text() == ""  # a clean close leaves no pid behind
    assert lock_holder(folder) is None
    with open_spool(folder) as again:
        assert again.depth == 1 and again.next_seq() == 1


# ---------------------------------------------------------------------------------------------
# uploads


@pytest.mark.both_backends
async def test_records_land_once_under_their_spool_keys(store: Store, spool: Spool) -> None:
    entries = [spool.add(builder()) for _ in range(8)] + [spool.add(builder("eval"), kind="eval")]
    uploader = Uploader(store, spool, concurrency=3)
    assert await uploader.drain() == 9
    assert sorted(await bucket_keys(store) + await bucket_keys(store, "eval")) == sorted(e.key for e in entries)
    for entry in entries:
        assert await store.get_bytes(entry.key) == make_record(entry.seq, kind=entry.kind)
    assert (spool.depth, spool.bytes, uploader.stats.uploaded) == (0, 0, 9)
    assert list(spool.folder.glob("*.rec")) == []
    assert await uploader.drain() == 0


async def test_restart_drains_leftovers_first(store: Store, tmp_path: Path) -> None:
    folder = tmp_path / "s"
    with open_spool(folder) as spool:
        leftovers = [spool.add(builder()) for _ in range(3)]  # then the worker stops
    with open_spool(folder) as spool:
        fresh = [spool.add(builder()) for _ in range(2)]
        assert [e.seq for e in fresh] == [3, 4]
        assert [e.name for e in spool.pending()] == [e.name for e in leftovers + fresh]
        first_done = asyncio.Event()
        spool.subscribe(first_done.set)  # fires on the first removal (same thread)
        uploader = Uploader(store, spool, concurrency=1)
        await uploader.drain(first_done)
        assert await bucket_keys(store) == [leftovers[0].key]
        await uploader.drain()
        assert await bucket_keys(store) == sorted(e.key for e in leftovers + fresh)


async def test_already_uploaded_entry_is_confirmed_not_reuploaded(store: Store, spool: Spool) -> None:
    entry = spool.add(builder())
    etag = await store.put_if_absent(entry.key, entry.read())  # crash after upload, before removal
    uploader = Uploader(store, spool)
    await uploader.drain()
    stats = uploader.stats
    assert (stats.uploaded, stats.duplicates_confirmed, stats.quarantined) == (0, 1, 0)
    assert spool.depth == 0 and (await store.head(entry.key)).etag == etag


@pytest.mark.both_backends
async def test_conflicting_object_is_quarantined_never_overwritten(store: Store, spool: Spool) -> None:
    entry = spool.add(builder())
    other = make_record(entry.seq, salt=1)
    await store.put_if_absent(entry.key, other)
    ok = spool.add(builder())
    uploader = Uploader(store, spool)
    await uploader.drain()
    assert await store.get_bytes(entry.key) == other
    assert await store.get_bytes(ok.key) == make_record(ok.seq)
    assert (uploader.stats.quarantined, uploader.stats.uploaded, spool.depth) == (1, 1, 0)
    [kept] = spool.quarantined()
    assert kept.key == entry.key and kept.read() == make_record(entry.seq)
    assert "different object" in (spool.quarantine_folder / f"{kept.name}.why").read_text()
    assert "different object" in (uploader.stats.last_error or "")


# ---------------------------------------------------------------------------------------------
# outages and misconfiguration


class TcpGate:
    """A loopback TCP forwarder that can be shut (connection refused) and opened on one port."""

    def __init__(self, target: str) -> None:
        host, _, port = target.removeprefix("http://").partition(":")
        self.target = (host, int(port))
        self.port = free_ports(1)[0]
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._forward, LOOPBACK, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()
            self._server = None

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self._writers -= {writer, up_writer}

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def gate(s3_server: LocalS3Server) -> AsyncIterator[TcpGate]:
    g = TcpGate(s3_server.endpoint_url)
    yield g
    await g.close()


async def test_unreachable_store_keeps_entries_until_it_is_back(
    s3_server: LocalS3Server, s3_bucket: str, gate: TcpGate, spool: Spool
) -> None:
    prefix = f"gate-{random.randrange(1 << 30):x}"
    down = S3Store(
        bucket=s3_bucket,
        prefix=prefix,
        endpoint_url=gate.url,  # nothing listens there yet
        region=s3_server.region,
        credentials=s3_server.credentials(),
        url=f"s3://{s3_bucket}/{prefix}?endpoint={gate.url}",
        retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02),
        connect_timeout=1,
    )
    entries = [spool.add(builder()) for _ in range(5)]
    async with down, s3_server.store(s3_bucket, prefix) as direct:
        uploader = fast_uploader(down, spool)
        stop = asyncio.Event()
        task = asyncio.create_task(uploader.run_forever(stop))
        await async_wait_until(lambda: uploader.stats.retries >= 3)
        assert await uploader.flush(0.3) == 5  # SIGTERM during the outage: nothing lost
        assert spool.depth == 5 and await bucket_keys(direct) == []
        assert "StoreUnavailable" in (uploader.stats.last_error or "")
        await gate.open()  # the network is back
        await async_wait_until(lambda: spool.depth == 0)
        stop.set()
        await task
        assert await bucket_keys(direct) == [e.key for e in entries]
        assert uploader.stats.uploaded == 5


async def test_missing_store_folder_is_surfaced_and_nothing_is_dropped(tmp_path: Path, spool: Spool) -> None:
    root = tmp_path / "not-yet"
    entries = [spool.add(builder()) for _ in range(2)]
    async with open_store(f"file://{root}") as store:
        uploader = fast_uploader(store, spool)
        with pytest.raises(StoreConfigError, match="does not exist"):
            await uploader.drain()
        with pytest.raises(StoreConfigError):
            await uploader.run_forever(asyncio.Event())
        assert spool.depth == 2 and "StoreConfigError" in (uploader.stats.last_error or "")
        assert await uploader.flush(1.0) == 2
        root.mkdir()  # the user fixed it
        assert await uploader.drain() == 2
        assert await bucket_keys(store) == [e.key for e in entries]


async def test_an_entry_the_store_rejects_is_held_back_not_blocking(tmp_path: Path, spool: Spool) -> None:
    bad = spool.add(builder("eval"), kind="eval")  # oldest entry, and its key cannot be written:
    good = [spool.add(builder()) for _ in range(3)]
    async with open_store(f"file://{tmp_path / 'bucket'}", create=True) as store:
        blocker = LAYOUT.rollouts_prefix("eval").rstrip("/")
        await store.put_if_absent(blocker, b"an object where the evals folder goes")
        uploader = fast_uploader(store, spool)
        stop = asyncio.Event()
        task = asyncio.create_task(uploader.run_forever(stop))
        await async_wait_until(lambda: spool.depth == 1)
        assert await bucket_keys(store) == [e.key for e in good]
        assert [e.name for e in spool.pending()] == [bad.name] and uploader.stats.held == 1
        await store.delete(blocker)  # fixed: the held entry goes up on a later retry
        await async_wait_until(lambda: spool.depth == 0)
        stop.set()
        await task
        assert await bucket_keys(store, "eval") == [bad.key] and uploader.stats.held == 0


# ---------------------------------------------------------------------------------------------
# back-pressure


async def test_full_spool_pauses_until_the_uploader_frees_room(store: Store, tmp_path: Path) -> None:
    one = len(make_record(0))
    with open_spool(tmp_path / "bytes", max_bytes=2 * one, max_items=100) as spool:
        spool.add(builder())
        assert not spool.full
        spool.add(builder())
        assert spool.full  # by bytes
    with open_spool(tmp_path / "items", max_items=3) as spool:
        for _ in range(3):
            spool.add(builder())
        assert spool.full and spool.add(builder()).seq == 3  # a finished group is never refused
        assert await spool.wait_not_full(timeout=0.1) is False
        waiter = asyncio.create_task(spool.wait_not_full())
        await asyncio.sleep(0)  # the waiter runs up to its wait (no thread or timer involved)
        assert not waiter.done()
        spool.add(builder())  # a change that leaves the spool full wakes it, and it waits on
        for _ in range(3):  # the change callback, the wake-up, the re-check
            await asyncio.sleep(0)
        assert not waiter.done()
        await Uploader(store, spool).drain()
        assert await asyncio.wait_for(waiter, 5) is True and not spool.full


async def test_producer_thread_and_uploader_share_a_bounded_spool(store: Store, tmp_path: Path) -> None:
    with open_spool(tmp_path / "s", max_items=3) as spool:
        uploader = fast_uploader(store, spool, concurrency=2)
        stop = asyncio.Event()
        task = asyncio.create_task(uploader.run_forever(stop))
        depths: list[int] = []

        def produce() -> None:  # the generation thread
            for _ in range(20):
                assert spool.wait_not_full_sync(timeout=10)
                spool.add(builder())
                depths.append(spool.depth)

        await asyncio.to_thread(produce)
        await async_wait_until(lambda: spool.depth == 0)
        stop.set()
        await task
        assert max(depths) <= 3
        assert len(await bucket_keys(store)) == 20 and uploader.stats.uploaded == 20


# ---------------------------------------------------------------------------------------------
# kill -9


WORKER_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from pathlib import Path

    from macd.spool import Spool
    from macd.uploader import Uploader
    from slime_stoa.protocol.records import RolloutGroup, Sample, SamplingParams, encode_group
    from slime_stoa.protocol.store import open_store

    folder, url, run, worker, target, logs = sys.argv[1:7]
    target, logs = int(target), Path(logs)

    def record(seq):
        sample = Sample(response_tokens=[5, 6, 7], logprobs=[-0.5, -1.0, -2.0], finish_reason="stop", reward=1.0)
        return encode_group(RolloutGroup(
            kind="train", run=run, task_id="t", prompt_index=seq, prompt_tokens=[1, 2, 3],
            samples=(sample,) * 4, weight_version=0, state_digest="ab" * 16,
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8),
            worker_id=worker, seq=seq, started_at=1.0, finished_at=2.0))

    def log(f, seq):
        f.write(f"{seq}\\n"); f.flush(); os.fsync(f.fileno())

    def produce(spool):
        spooled = logs / "spooled"
        done = len(spooled.read_text().split()) if spooled.exists() else 0
        with open(logs / "reserved", "a") as reserved, open(spooled, "a") as out:
            while done < target:
                r = spool.reserve()
                log(reserved, r.seq)
                spool.commit(r, record(r.seq))
                log(out, r.seq)
                done += 1

    async def main():
        spool = Spool(folder, worker_id=worker, run=run, max_bytes=1 << 30, max_items=100_000)
        async with open_store(url) as store:
            uploader = Uploader(store, spool, retry_delay=0.01, max_retry_delay=0.05, poll_interval=0.01)
            stop = asyncio.Event()
            await store.exists(run + "-warm-up")  # connect now, so kills land mid-upload
            task = asyncio.create_task(uploader.run_forever(stop))
            print("ready", flush=True)
            await asyncio.to_thread(produce, spool)
            stop.set()
            await task
            left = await uploader.flush(60)
        print("done", left, json.dumps(uploader.stats.as_dict()), flush=True)

    asyncio.run(main())
    """
)


def _lines(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


async def _start_worker(script: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
    assert line.strip() == "ready", f"worker did not start: {line!r}"
    return proc


@pytest.mark.both_backends
async def test_kill_9_at_random_moments_loses_and_duplicates_nothing(
    store: Store, store_url: str, store_env: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    logs = tmp_path / "logs"
    logs.mkdir()
    rounds = 5 if store_url.startswith("file://") else 3  # an S3 client starts slower
    args = [str(tmp_path / "spool"), store_url, RUN, WORKER, "", str(logs)]
    env = {**os.environ, **store_env, "PYTHONPATH": str(REPO)}
    seed = random_seed()  # STOA_TEST_SEED=<seed> replays the kill moments
    rng, replay = random.Random(seed), f"(replay: STOA_TEST_SEED={seed})"
    killed = 0
    args[4] = str(10**6)  # killed rounds never reach their target
    for _ in range(rounds):
        proc = await _start_worker(script, args, env)
        # The kill lands after a random number of further records were spooled (and some of them
        # are mid-upload): a moment chosen by what the worker did, not by the clock.
        spooled_before, more = len(_lines(logs / "spooled")), rng.randint(1, 12)
        await async_wait_until(lambda: len(_lines(logs / "spooled")) >= spooled_before + more, interval=0.001)  # noqa: B023
        proc.send_signal(signal.SIGKILL)
        killed += await asyncio.to_thread(proc.wait) == -signal.SIGKILL
        proc.stdout.close()  # type: ignore[union-attr]
    target = len(_lines(logs / "spooled")) + 20
    args[4] = str(target)  # the clean run spools a few more, then drains and exits
    proc = await _start_worker(script, args, env)
    out, _ = await asyncio.wait_for(asyncio.to_thread(proc.communicate), 120)
    assert proc.returncode == 0 and out.startswith("done 0 "), f"{replay}\n{out}"
    assert killed == rounds, replay  # every kill hit a running worker

    reserved, spooled = _lines(logs / "reserved"), _lines(logs / "spooled")
    assert len(reserved) == len(set(reserved)), f"a seq was handed out twice {replay}"
    assert len(spooled) == target and set(spooled) <= set(reserved), replay

    keys = [info.key async for info in store.list(LAYOUT.root)]
    parsed = [LAYOUT.parse_rollout(k) for k in keys]
    assert all(p is not None and p.worker == WORKER and p.kind == "train" for p in parsed), (replay, keys)
    per_seq = Counter(p.seq for p in parsed if p)
    assert max(per_seq.values()) == 1, f"a record landed under two keys {replay}"
    assert set(spooled) <= set(per_seq) <= set(reserved), replay
    for key, p in zip(keys, parsed, strict=False):
        assert p is not None and decode_group(await store.get_bytes(key)).seq == p.seq, (replay, key)

    with open_spool(tmp_path / "spool") as spool:
        assert spool.depth == 0 and spool.quarantined() == [], replay
    assert json.loads(out.split(" ", 2)[2])["quarantined"] == 0, replay

