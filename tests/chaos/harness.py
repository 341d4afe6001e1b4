"""The chaos suite's moving parts: real `macd run` workers and the quickstart learner as
processes, each talking to the bucket through its own fault-injecting proxy
(`tests.faultproxy`); the forger that plants malformed objects; and the reconciliation of what
every process says it did against the bucket. The acts themselves are in `test_chaos.py`.

Nothing sleeps to let something happen: every wait is for what can be observed (a request
reaching a proxy, a line in a worker's log, an event of the learner, a heartbeat), with
generous deadlines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from slime_stoa.protocol.heartbeat import Heartbeat
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.history import published_digests, read_lineage, read_manifest, read_pointer_etag
from slime_stoa.protocol.records import RecordError, decode_group, encode_group
from slime_stoa.protocol.signed_record import record_bytes
from slime_stoa.protocol.store import NotFound, Store
from tests.conftest import async_wait_until
from tests.faultproxy import Faults, FaultyProxy

REPO = Path(__file__).resolve().parents[2]
FORGER = "chaos-forger"  # the worker id under which forged records are planted
EVENTS = "events.jsonl"  # the learner's account of every batch it trained on (tests.chaos.learner)
INTERRUPTED = 130  # the learner's exit code after a clean stop (SIGTERM)
RUN = "chaos"
STALENESS = 2
REUSE = 1
LEARNER = dict(  # QuickstartConfig fields: a small, fast run that never ends by itself
    run=RUN, workers=2, minutes=1e4, max_versions=10**6, target=2.0, batch_groups=4, group_size=4,
    max_tokens=4, staleness_limit=STALENESS, warmup_steps=50, worker_batch=2, model_hidden=64, model_layers=2,
)  # fmt: skip
CHAOS_FAULTS = Faults(drop=0.01, delay=0.03, reset_request=0.01, reset_response=0.01, status_503=0.02)


@dataclass(frozen=True, kw_only=True)
class ChaosPlan:
    """How hard and how long the suite hits the run."""

    workers: int = 2
    chaos_s: float = 30.0  # the phase of faults (then a clean end phase)
    outage_s: tuple[float, float] = (2.0, 4.0)  # full outages of one proxy (or of all of them)
    burst_s: tuple[float, float] = (1.0, 2.0)  # 503 bursts
    network_gap_s: tuple[float, float] = (4.0, 10.0)  # between two outages or bursts
    worker_kills: int = 4  # one per point at least (generation, spooling, upload, weight swap)
    learner_kills: int = 2  # mid-publish and mid-consume at least
    wait_s: float = 120.0  # deadline of any one observed wait
    faults: Faults = CHAOS_FAULTS  # per-request faults on every proxy during the chaos phase


SHORT = ChaosPlan()
LONG = ChaosPlan(
    workers=3, chaos_s=25 * 60.0, outage_s=(5.0, 30.0), burst_s=(2.0, 8.0), network_gap_s=(20.0, 60.0),
    worker_kills=24, learner_kills=8, wait_s=300.0,
)  # fmt: skip


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STOA_ACCESS", "STOA_SECRET"))}
    return {**env, "PYTHONUNBUFFERED": "1", "MLX_DISABLE_COMPILE": "1", **extra}


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


class LineReader:
    """The complete lines appended to a file since the last call (files only grow here)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        self._offset += end
        return data[:end].decode(errors="replace").splitlines()


class Process:
    """One child process whose output goes to `log` (appended across restarts)."""

    def __init__(self, name: str, log: Path, env: dict[str, str]) -> None:
        self.name, self.log, self.env = name, log, env
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []
        self.exits: list[tuple[int, str]] = []  # (return code, how it was stopped: kill, stop or crash)
        self._expect: str | None = None

    def spawn(self, cmd: list[str]) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is still running"
        with open(self.log, "ab") as out:
            out.write(f"\n===== chaos: start {' '.join(cmd[1:4])} =====\n".encode())
            out.flush()
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.pids.append(self.proc.pid)
        self._expect = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def _record_exit(self) -> None:
        assert self.proc is not None
        rc = self.proc.wait()
        self.exits.append((rc, self._expect or "crash"))
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash or a power cut would end it."""
        assert self.proc is not None
        self._expect = "kill"
        self.proc.send_signal(signal.SIGKILL)
        self._record_exit()

    async def stop(self, timeout: float) -> int:
        """SIGTERM and wait for the exit (SIGKILL after `timeout`, counted as a failure)."""
        assert self.proc is not None
        self._expect = "stop"
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.proc.poll() is None:
            self._expect = "hung"
            self.proc.kill()
        rc = self.proc.wait()
        self._record_exit()
        return rc

    def check_crash(self) -> bool:
        """True (recorded as a crash) if it exited by itself (not while we stop or kill it)."""
        if self.proc is not None and self._expect is None and self.proc.poll() is not None:
            self._record_exit()
            return True
        return False


class WorkerProcess(Process):
    """A `macd run` worker with its own config, data folder and proxy; in a signed run, with the
    worker key the quickstart learner made and registered for it (`key_file`)."""

    def __init__(
        self, index: int, folder: Path, proxy: FaultyProxy, url: str, run: str, env: dict[str, str], seed: int,
        key_file: Path | None = None,
    ):  # fmt: skip
        folder.mkdir(parents=True, exist_ok=True)
        super().__init__(f"worker-{index}", folder / "macd.log", env)
        self.index, self.folder, self.proxy, self.url, self.run, self.seed = index, folder, proxy, url, run, seed
        self.key_file = key_file
        self.worker_id = f"quickstart-{index}"  # the ids the quickstart learner reads heartbeats of
        self.config = folder / "macd.toml"
        self.starts = 0
        self._reader = LineReader(self.log)
        self._spooled: list[str] = []
        self._weight_errors = 0

    def _scan(self) -> None:
        for line in self._reader.new_lines():
            if (found := re.search(r"spooled (\S+)", line)) is not None:
                self._spooled.append(found[1])
            elif "WARNING macd: weights: " in line:
                self._weight_errors += 1

    def join(self) -> None:
        cmd = [
            sys.executable, "-m", "macd", "join", self.url, "--run", self.run, "--name", self.name,
            "--worker-id", self.worker_id, "--config", str(self.config), "--data-dir", str(self.folder / "data"),
            "--batch", "2", "--no-check", *(["--worker-key", str(self.key_file)] if self.key_file else []),
        ]  # fmt: skip
        done = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"macd join failed: {done.stderr or done.stdout}"

    def start(self) -> None:
        self.starts += 1
        self.spawn([
            sys.executable, "-m", "macd", "run", "--config", str(self.config), "--seed", str(self.seed + 1000 * self.starts),
            "--parent-pid", str(os.getpid()), "--lock-wait", "60",
        ])  # fmt: skip

    def spooled(self) -> list[str]:
        """Every key this worker says it spooled (a finished group), in order, across restarts."""
        self._scan()
        return self._spooled

    def weight_errors(self) -> int:
        """Weight-sync problems it reported (a malformed pointer, manifest or patch, an outage)."""
        self._scan()
        return self._weight_errors

    @property
    def spool_folder(self) -> Path:
        return self.folder / "data" / "spool" / self.run

    def spool_pending(self) -> list[Path]:
        return sorted(self.spool_folder.glob("*.rec")) if self.spool_folder.exists() else []

    def spool_quarantined(self) -> list[Path]:
        q = self.spool_folder / "quarantine"
        return sorted(q.glob("*.rec")) if q.exists() else []

    def next_seq(self) -> int:
        try:
            return int(json.loads((self.spool_folder / "state.json").read_text())["next_seq"])
        except FileNotFoundError:
            return 0


class LearnerProcess(Process):
    """The quickstart learner (`tests.chaos.learner`) behind its proxy."""

    def __init__(self, folder: Path, proxy: FaultyProxy, config: dict[str, Any], env: dict[str, str]):
        folder.mkdir(parents=True, exist_ok=True)
        super().__init__("learner", folder / "learner.log", env)
        self.folder, self.proxy = folder, proxy
        self.config_path = folder / "learner.json"
        self.config_path.write_text(json.dumps({**config, "out": str(folder / "out")}))
        (folder / "out").mkdir(exist_ok=True)
        self._events_reader = LineReader(folder / "out" / EVENTS)
        self._events: list[dict[str, Any]] = []

    def worker_key(self, index: int) -> Path:
        """Where the quickstart learner keeps the key of its worker `index` (a signed run)."""
        return self.folder / "out" / "workers" / f"worker-{index}" / "worker.key"

    def start(self, restart_from: int | None = None) -> None:
        """Start it (resuming where the bucket says); with `restart_from`, this one start restarts
        the run from the learner's checkpoint of that version (`--restart-from`)."""
        path = self.config_path
        if restart_from is not None:
            path = self.folder / "learner-restart.json"
            path.write_text(json.dumps({**json.loads(self.config_path.read_text()), "restart_from": restart_from}))
        self.spawn([sys.executable, "-m", "tests.chaos.learner", str(path)])

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The learner's events (`tests.chaos.learner`), across restarts."""
        for line in self._events_reader.new_lines():
            try:
                self._events.append(json.loads(line))
            except ValueError:  # a line cut by a SIGKILL mid-write (the next one starts on a new line)
                continue
        return [e for e in self._events if kind is None or e.get("event") == kind]

    def starting(self) -> bool:
        """It runs and has not opened its consumer yet (the quickstart's start-up checks)."""
        if not self.alive:
            return False
        assert self.proc is not None
        pid = self.proc.pid
        return not any(e.get("pid") == pid and "started" in e.get("text", "") for e in self.events("note"))

    def said(self, text: str) -> bool:
        """Whether a note of any of its starts so far says `text`."""
        return any(text in e.get("text", "") for e in self.events("note"))

    def versions(self) -> list[dict[str, Any]]:
        return self.events("version")

    def last_version(self) -> int:
        return max((e["version"] for e in self.versions()), default=-1)


# -- the bucket side -----------------------------------------------------------------------------
def key_of(path: str, store_prefix: str) -> str | None:
    """The store key an S3 request path names (`/bucket/prefix/<key>?query`), or None."""
    path = path.split("?", 1)[0]
    marker = f"/{store_prefix.strip('/')}/"
    at = path.find(marker)
    return path[at + len(marker) :] if at >= 0 else None


async def honest_records(store: Store, run: str) -> dict[str, bytes]:
    layout = RunLayout(run)
    out = {}
    async for info in store.list(layout.rollouts_prefix()):
        parsed = layout.parse_rollout(info.key)
        if parsed is not None and parsed.worker != FORGER:
            out[info.key] = await store.get_bytes(info.key)
    return out


def generation_id(data: bytes) -> str | None:
    """What makes a finished group that group (None: does not decode): its worker, its cohort's
    times, its prompt and its samples, everything but the seq and key the spool gave it. Two
    records with one generation id are one group stored twice. (Two groups of one prompt with
    identical samples are not: on a tiny task a near-deterministic model draws them often.)"""
    try:
        g = decode_group(record_bytes(data))  # a signed run's record: the one inside its signature
    except RecordError:
        return None
    h = hashlib.sha256(f"{g.worker_id} {g.started_at!r} {g.finished_at!r} {g.prompt_index}".encode())
    h.update(g.prompt_tokens.tobytes())
    for s in g.samples:
        h.update(s.response_tokens.tobytes())
        h.update(s.logprobs.tobytes())
    return h.hexdigest()


@dataclass
class Forger:
    """Plants malformed and corrupted objects in the bucket, as a hostile Mac could."""

    store: Store
    run: str
    rng: random.Random
    injected: Counter[str] = field(default_factory=Counter)
    keys: list[str] = field(default_factory=list)
    _seq: int = 0

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.run)

    def _key(self) -> str:
        self._seq += 1
        return self.layout.rollout(FORGER, int(time.time() * 1000), self._seq)

    async def _plant(self, kind: str, data: bytes) -> None:
        key = self._key()
        await self.store.put_if_absent(key, data)
        self.keys.append(key)
        self.injected[kind] += 1

    async def records(self, sample: bytes) -> None:
        """Forged rollout records: noise, a truncated and a bit-flipped copy of a real one, the
        real one under another worker's key, and re-encoded copies that claim weights never
        published or replay the real group's content."""
        group = decode_group(record_bytes(sample))  # re-encoded copies carry no worker's signature
        await self._plant("record_noise", self.rng.randbytes(self.rng.randrange(1, 3000)))
        await self._plant("record_truncated", sample[: self.rng.randrange(1, len(sample))])
        flipped = bytearray(sample)
        flipped[self.rng.randrange(len(flipped))] ^= 1 << self.rng.randrange(8)
        await self._plant("record_bitflip", bytes(flipped))
        await self._plant("record_wrong_key", sample)
        for kind, change in (
            ("record_wrong_digest", {"state_digest": "0" * 64}),
            ("record_unpublished_version", {"weight_version": group.weight_version + 50}),
            ("record_replay", {}),
        ):
            forged = msgspec.structs.replace(group, worker_id=FORGER, seq=self._seq + 1, **change)
            await self._plant(kind, encode_group(forged))

    async def _beat_errors(self, w: WorkerProcess) -> int:
        try:
            return Heartbeat.from_bytes(await self.store.get_bytes(self.layout.heartbeat(w.worker_id))).errors
        except (NotFound, ValueError):
            return 0

    async def heartbeats(self, worker_id: str) -> None:
        await self.store.put(self.layout.heartbeat(FORGER), b'{"format": "stoa.heartbeat/1", "worker_id": 7')
        self.injected["heartbeat_malformed"] += 1
        beat = Heartbeat(worker_id=FORGER, name="x" * 10_000, status="\x1b[31mevil")
        await self.store.put(self.layout.heartbeat(worker_id), beat.to_bytes())  # under a real worker's key
        self.injected["heartbeat_foreign"] += 1

    async def pointer_faults(self, workers: list[WorkerProcess], timeout: float) -> None:
        """With the learner down: point the run at a malformed pointer, at a malformed version
        manifest, then at a manifest whose patch is corrupted; after each, wait until every
        running worker reported a weight-sync problem; then put the real pointer back (same
        bytes, so the same ETag: the learner's next compare-and-swap still holds)."""
        found = await read_pointer_etag(self.store, self.run)
        assert found is not None
        pointer, _ = found
        original = await self.store.get_bytes(self.layout.pointer)
        manifest = await read_manifest(self.store, pointer.manifest)
        attempt = f"{self.rng.randrange(1 << 32):08x}"
        v = pointer.version + 1
        forged_manifest_key = self.layout.version_manifest(v, attempt)
        step = manifest.patch("step")
        plans: list[tuple[str, list[tuple[str, bytes]], bytes]] = [
            ("pointer_malformed", [], original[: len(original) // 2] + b"#"),
            (
                "manifest_malformed",
                [(forged_manifest_key, b'{"format": "stoa.version/1", "run": ')],
                dataclasses.replace(pointer, version=v, manifest=forged_manifest_key, updated_at=time.time()).to_bytes(),
            ),
        ]
        if step is not None:
            body = bytearray(await self.store.get_bytes(step.key))
            for _ in range(8):
                body[self.rng.randrange(len(body))] ^= 0xFF
            attempt2 = f"{self.rng.randrange(1 << 32):08x}"
            key2 = self.layout.version_manifest(v, attempt2)
            patch = dataclasses.replace(
                step, key=self.layout.patch(v, attempt2, "step", pointer.version), base_min=pointer.version,
                base_max=pointer.version, base_digest=pointer.state_digest,
            )  # fmt: skip
            forged = dataclasses.replace(
                manifest, version=v, attempt=attempt2, state_digest=hashlib.sha256(bytes(body)).hexdigest(),
                parent=dataclasses.replace(manifest.parent or manifest.anchor, version=pointer.version,
                                           manifest=pointer.manifest, state_digest=pointer.state_digest),
                patches=(patch,), since_anchor_bytes=manifest.since_anchor_bytes + len(body), created_at=time.time(),
                **({"lineage": None} if "lineage" in {f.name for f in dataclasses.fields(manifest)} else {}),
            )  # fmt: skip
            plans.append((
                "patch_corrupted",
                [(patch.key, bytes(body)), (key2, forged.to_bytes())],
                dataclasses.replace(pointer, version=v, manifest=key2, state_digest=forged.state_digest,
                                    updated_at=time.time()).to_bytes(),
            ))  # fmt: skip
        try:
            for kind, objects, bad_pointer in plans:
                live = [w for w in workers if w.alive and w.spooled()]
                before = {w.index: (w.weight_errors(), await self._beat_errors(w)) for w in live}
                for key, data in objects:
                    await self.store.put_if_absent(key, data)
                await self.store.put(self.layout.pointer, bad_pointer)
                self.injected[kind] += 1

                async def reported(live: list[WorkerProcess] = live, before: dict = before) -> bool:
                    # its log says so (the same message is logged once a minute), or its heartbeat counts it
                    for w in live:
                        logged, counted = before[w.index]
                        if w.alive and w.weight_errors() <= logged and await self._beat_errors(w) <= counted:
                            return False
                    return True

                await async_wait_until(
                    reported, message=lambda kind=kind: f"every worker to report the {kind} pointer", timeout=timeout,
                    interval=0.2,
                )
        finally:
            await self.store.put(self.layout.pointer, original)


# -- reconciliation --------------------------------------------------------------------------------
async def reconcile(
    store: Store,
    run: str,
    workers: list[WorkerProcess],
    learner: LearnerProcess,
    forger: Forger,
    *,
    staleness_limit: int,
    reuse_limit: int,
    version_ahead_slack: int = 1,
) -> dict[str, Any]:
    """What every process says it did, checked against the bucket (see the module doc)."""
    layout = RunLayout(run)
    records = await honest_records(store, run)
    in_bucket: dict[str, list[int]] = {}  # worker -> seqs
    for key in records:
        parsed = layout.parse_rollout(key)
        assert parsed is not None
        in_bucket.setdefault(parsed.worker, []).append(parsed.seq)
    finished: set[str] = set()
    lost: list[str] = []
    gaps: dict[str, int] = {}
    unlogged = 0  # in the bucket, never logged as spooled: killed between the spool write and its log line
    for w in workers:
        said = set(w.spooled())
        mine = {k for k in records if (p := layout.parse_rollout(k)) is not None and p.worker == w.worker_id}
        lost += sorted(said - mine)
        finished |= said | mine
        unlogged += len(mine - said)
        seqs = set(in_bucket.get(w.worker_id, []))
        gaps[w.worker_id] = len(set(range(w.next_seq())) - seqs)  # reserved, never finished (a kill between)
    duplicates = sum(len(s) - len(set(s)) for s in in_bucket.values())
    hashes = Counter(h for data in records.values() if (h := generation_id(data)) is not None)
    duplicates += sum(n - 1 for n in hashes.values() if n > 1)

    found = await read_pointer_etag(store, run)
    assert found is not None
    pointer, _ = found
    # What was published: the learner's own account, and the chain still in the bucket (retention
    # deletes older versions); they must agree.
    published: dict[int, str] = {}
    invalid: list[str] = []
    chain = await published_digests(store, run, depth=pointer.version + 1, pointer=pointer)
    lineage = await read_lineage(store, run, depth=pointer.version + 1, pointer=pointer)
    for event in learner.events("published"):
        published.setdefault(event["version"], event["digest"])
        if published[event["version"]] != event["digest"]:
            invalid.append(f"v{event['version']} published twice, with two digests")
    for version, digest in chain.items():
        if published.setdefault(version, digest) != digest:
            invalid.append(f"v{version}: the bucket's digest is not the one the learner published")
    # Staleness and reuse along the final lineage: a batch that trained a version a restart
    # abandoned was never learnt from (its groups may be used again); on the lineage, a group's
    # lag is counted in training steps (a restored version is as fresh as the one it restores)
    # and a group drawn from an abandoned branch is never used.
    used: Counter[str] = Counter()
    unverified = 0
    used_abandoned = 0
    for event in learner.versions():
        if lineage.step_of(event["version"]) is None:
            used_abandoned += len(event["groups"])
            continue
        for g in event["groups"]:
            used[g["key"]] += 1
            problems = []
            if g["key"] not in records:
                problems.append("not an honest record in the bucket")
            lag = lineage.lag(event["trainer_version"], g["weight_version"])
            if lag is None:
                problems.append(f"drawn from v{g['weight_version']}, on a branch a restart abandoned")
            elif lag != g["lag"] or not -version_ahead_slack <= lag <= staleness_limit:
                problems.append(f"lag {g['lag']} (along the lineage: {lag})")
            claimed = published.get(g["weight_version"])
            unverified += claimed is None
            if claimed is not None and claimed != g["digest"]:
                problems.append(f"digest of v{g['weight_version']} is not the published one")
            if g["use"] > reuse_limit:
                problems.append(f"use {g['use']}")
            if problems:
                invalid.append(f"{g['key']}: {', '.join(problems)}")
    beyond = sum(1 for n in used.values() if n > reuse_limit)

    mismatches = []
    for w in workers:
        try:
            beat = Heartbeat.from_bytes(await store.get_bytes(layout.heartbeat(w.worker_id)))
        except (NotFound, ValueError) as exc:
            mismatches.append(f"{w.worker_id}: no final heartbeat ({exc})")
            continue
        if (beat.version, beat.state_digest) != (pointer.version, pointer.state_digest) or beat.status != "stopped":
            mismatches.append(f"{w.worker_id}: {beat.status} at v{beat.version} {beat.state_digest[:12]}, "
                              f"pointer v{pointer.version} {pointer.state_digest[:12]}")
        if beat.groups_spooled or beat.groups_quarantined or w.spool_pending() or w.spool_quarantined():
            lost.append(f"{w.worker_id}: spool not empty at the end")

    state = json.loads(await store.get_bytes(layout.trainer_file("consumer.json")))
    counters = state.get("counters", {}) if isinstance(state, dict) else {}
    rejected = {k.split("/", 1)[1]: v for k, v in counters.items() if k.startswith("rejected/")}
    forged_used = sorted(set(forger.keys) & set(used))
    prefix = layout.rollouts_prefix()
    honest_rejected = [
        f"{key} ({reason})"
        for key, reason in re.findall(r"stoa: rejected (\S+) \((\w+),", learner.log_text())
        if key in records or (key.startswith(prefix) and FORGER not in key)
    ]
    return {
        "groups_finished": len(finished),
        "groups_in_bucket": len(records),
        "groups_used": sum(used.values()),  # on the final lineage
        "groups_used_abandoned": used_abandoned,  # by batches of versions a restart abandoned
        "groups_used_by_consumer": counters.get("groups_used", 0),
        "groups_lost": len(lost),
        "duplicates": duplicates,
        "reused_beyond_limit": beyond,
        "digest_mismatches": len(mismatches),
        "records_rejected": dict(sorted(rejected.items())),
        "invalid_used": invalid[:20] + forged_used,
        "used_unverified": unverified,  # used groups of a version whose digest neither source still had
        "honest_rejected": honest_rejected[:20],
        "sequence_gaps": gaps,
        "finished_unlogged": unlogged,
        "final_version": pointer.version,
        "epoch": pointer.epoch,
        "abandoned": [list(r) for r in lineage.abandoned],
        "details": {"lost": lost[:20], "mismatches": mismatches},
    }


def processes_left(procs: list[Process], marker: str) -> list[str]:
    """Our children still running, and any process whose command line names `marker` (our folder)."""
    left = [f"{p.name} pid {pid}" for p in procs for pid in p.pids if running(pid)]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and running(int(entry.name)):
            left.append(f"pid {entry.name}: {cmdline[:120]}")
    return sorted(set(left))

