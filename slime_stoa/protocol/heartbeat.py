"""Worker heartbeats (`runs/<run>/workers/<worker>.json`): what each Mac is doing.

Each worker rewrites its own heartbeat object every few seconds; the operator's `stoa fleet` and
the trainer's wait-timeout message read them. Pure data with strict parsing, what a heartbeat
means as of now (`shown_status`, `shown_lag`, `worker_metrics`), and the readers of heartbeats
(`read_heartbeat`, `read_heartbeats`, `read_fleet`), which read at most MAX_HEARTBEAT_BYTES + 1
bytes of each.

In a signed run a worker signs its heartbeat with its worker key (`signing.sign_document`, the
document naming its run too), and a reader judges it against the run's worker registry
(`judge_heartbeat`): "signed" when the key the registry holds for that worker id signed it for
this run; otherwise "unsigned", "unknown" (a key the registry does not hold), "revoked" (the
worker id's or the key's entry is revoked, whatever the heartbeat says) or "forged" (another
worker's key, another run, or a signature that does not verify). Only a "signed" heartbeat's
status is shown: any other one shows as its verdict, never as running (`shown_status`). In an
unsigned run heartbeats are not judged (verdict None) and show as they say.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import PurePosixPath
from typing import Literal

from .layout import RunLayout, check_name, check_worker_id
from .printable import printable
from .registry import Registry
from .run_manifest import PLANES
from .signing import SIGNATURE_FIELD, SignatureError, SigningKey, document_key_id, sign_document, verify_document
from .store import Store, StoreError
from .store.capped import read_capped_bytes
from .strict_json import check_timestamp, load_json

FORMAT = "stoa.heartbeat/1"

#: A signed run's verdict on a heartbeat (module doc); None in an unsigned run.
HeartbeatTrust = Literal["signed", "unsigned", "unknown", "revoked", "forged"]
#: The verdicts shown instead of what the heartbeat says (never as running).
UNTRUSTED: tuple[HeartbeatTrust, ...] = ("unsigned", "unknown", "revoked", "forged")


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    worker_id: str
    name: str  # the label given at join
    status: str  # "starting", "syncing", "generating", "paused" (spool full), "stopping"
    tier: str = ""  # memory tier, e.g. "24 GiB"
    version: int | None = None  # weight version held
    state_digest: str = ""  # state digest of the weights held (verified on every swap)
    plane: str = "bf16"  # the weight plane served: "bf16", "int8" or "int4" (`PLANES`)
    pointer_version: int | None = None  # latest version seen in the pointer
    tokens_per_s: float = 0.0  # generation throughput over the last ~30 s: moves during a cohort, 0 before any token
    tokens_generated: int = 0  # tokens this process sampled so far (groups dropped at a swap included)
    groups_uploaded: int = 0
    groups_spooled: int = 0  # waiting in the local spool
    groups_quarantined: int = 0  # set aside in the local spool, never to upload (their key held other bytes)
    groups_filtered: int = 0  # finished but not uploaded: rewards all equal (the run's dynamic_sampling)
    prompts_solved: int = 0  # prompts this worker no longer draws: recent groups all correct (skip_solved_after)
    swaps: int = 0
    last_swap_s: float = 0.0
    errors: int = 0
    last_error: str = ""
    weights_refused: int = 0  # weight objects refused: signature or content hash did not check (a forgery)
    memory_gb: float = 0.0  # resident memory of the daemon
    started_at: float = 0.0
    updated_at: float = 0.0
    # A random id of the `macd run` process writing this heartbeat: two processes sharing one
    # worker id show as two instances taking turns (`macd.twin`). "" in heartbeats of older workers.
    instance: str = ""

    @property
    def lag(self) -> int | None:
        if self.version is None or self.pointer_version is None:
            return None
        return max(self.pointer_version - self.version, 0)

    def to_bytes(self, key: SigningKey | None = None, *, run: str = "") -> bytes:
        """The heartbeat's JSON; signed by the worker `key` for `run` when given."""
        doc = {"format": FORMAT, **asdict(self)}
        if key is not None:
            doc = sign_document({**doc, "run": check_name("run", run)}, key)
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, worker: str | None = None) -> Heartbeat:
        """Parse a heartbeat strictly; ValueError for anything malformed.

        `worker`: the worker id of the key it was read from (`workers/<worker>.json`); when given,
        the heartbeat must be that worker's. Free text (`name`, `status`, `tier`, `last_error`) is
        bounded and any control or format character (a terminal escape, a right-to-left override)
        is replaced by U+FFFD, so a heartbeat is safe to print."""
        try:
            doc = load_json(data, max_bytes=MAX_HEARTBEAT_BYTES)
        except ValueError as exc:
            raise ValueError(f"heartbeat is not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.pop("format", None) != FORMAT:
            raise ValueError(f"not a {FORMAT} document")
        known = {f.name: f for f in fields(cls)}
        doc = {k: v for k, v in doc.items() if k in known}  # newer workers may add fields
        for name in ("worker_id", "name"):
            if name not in doc:
                raise ValueError(f"heartbeat has no {name}")
        for name, value in doc.items():
            kind = _FIELD_KINDS[name]
            if kind == "str":
                if not isinstance(value, str):
                    raise ValueError(f"heartbeat field {name} must be a string")
                doc[name] = printable(value, MAX_ERROR_CHARS if name == "last_error" else MAX_TEXT_CHARS)
            elif kind in ("count", "version"):
                if value is None and kind == "version":
                    continue
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
                    raise ValueError(f"heartbeat field {name} must be a non-negative integer")
            elif kind == "plane":
                if value not in PLANES:
                    raise ValueError(f"heartbeat field {name} must be one of {', '.join(PLANES)}")
            elif kind == "time":
                doc[name] = check_timestamp(value, f"heartbeat field {name}")
            elif (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                  or not 0 <= value <= MAX_HEARTBEAT_NUMBER):
                raise ValueError(f"heartbeat field {name} must be a number in [0, {MAX_HEARTBEAT_NUMBER:.0e}]")
        check_worker_id(doc["worker_id"])
        if worker is not None and doc["worker_id"] != worker:
            raise ValueError(f"heartbeat of worker {doc['worker_id']!r} found under worker {worker!r}")
        return cls(**doc)


# -- what a heartbeat says about its worker now ------------------------------------------------------

#: A worker rewrites its heartbeat every ~10 s; one silent for this long is not running any more.
SILENT_AFTER_S = 60.0
#: The shown statuses of a worker that is not running (see `shown_status`): stopped, silent, or
#: its heartbeat not trusted in a signed run (then never shown as running), or revoked itself.
NOT_RUNNING: tuple[str, ...] = ("stopped", "silent", *UNTRUSTED)


def judge_heartbeat(data: bytes, beat: Heartbeat, registry: Registry) -> HeartbeatTrust:
    """A signed run's verdict on heartbeat bytes `data` (already parsed into `beat`), judged
    against the run's worker `registry` (verified with the run key). Pure; never raises."""
    entry = registry.workers.get(beat.worker_id)
    if entry is not None and entry.revoked:
        return "revoked"
    try:
        doc = load_json(data, max_bytes=MAX_HEARTBEAT_BYTES)
    except ValueError:
        return "forged"
    if not isinstance(doc, dict) or SIGNATURE_FIELD not in doc:
        return "unsigned"
    signer = registry.by_key_id(document_key_id(doc) or "")
    if signer is None:
        return "unknown"
    if signer.revoked:
        return "revoked"
    if signer.worker != beat.worker_id or doc.get("run") != registry.run:
        return "forged"
    try:
        verify_document(doc, signer.key, where="heartbeat")
    except SignatureError:
        return "forged"
    return "signed"


def shown_status(beat: Heartbeat, now: float, trust: HeartbeatTrust | None = None) -> str:
    """The worker's status as of `now`: an untrusted heartbeat's verdict (`trust`, a signed
    run's: "unsigned", "unknown", "revoked", "forged"), whatever it says; "silent" when its
    heartbeat stopped coming, whatever it said last (a crash or a kill writes no final
    "stopped"); else what it said."""
    if trust is not None and trust != "signed":
        return trust
    if beat.status != "stopped" and now - beat.updated_at > SILENT_AFTER_S:
        return "silent"
    return beat.status


def shown_lag(beat: Heartbeat, now: float, head: int | None = None, trust: HeartbeatTrust | None = None) -> int | None:
    """Versions the worker is behind `head` (the run's current version; when None, the pointer
    version it last saw); None when it is not running (a stopped worker's version is history,
    not lag; an untrusted heartbeat's version is not known) or a version is unknown."""
    head = beat.pointer_version if head is None else head
    if shown_status(beat, now, trust) in NOT_RUNNING or beat.version is None or head is None:
        return None
    return max(head - beat.version, 0)


def ago(seconds: float) -> str:
    """A duration in the past, in the unit that reads best: "42s ago", "5m ago", "3.2h ago"."""
    seconds = max(seconds, 0.0)
    if seconds < 90:
        return f"{seconds:.0f}s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def worker_metrics(
    beat: Heartbeat, now: float, *, prefix: str = "worker", head: int | None = None, trust: HeartbeatTrust | None = None
) -> dict[str, float]:
    """A heartbeat as `<prefix>/<name>` numbers for an experiment tracker (both halves log
    these): `running` (1 or 0, `shown_status`), `tokens_per_s` (0 when not running), the
    cumulative `tokens_generated`,
    `version` and `lag` (`shown_lag` against `head`; each left out when unknown), the
    cumulative `groups_uploaded` and `errors`, the spool (`groups_spooled`,
    `groups_quarantined`), the worker's own filters (`groups_filtered`, `prompts_solved`), weight
    objects it refused (`weights_refused`), `swaps`, `last_swap_s`, `memory_gb` and `heartbeat_age_s`.
    With a signed run's verdict `trust`: `untrusted` (1 or 0) and `revoked` (1 or 0); an
    untrusted heartbeat's claims (throughput, version) are left at 0 or out."""
    running = shown_status(beat, now, trust) not in NOT_RUNNING
    values: dict[str, float] = {
        "running": float(running),
        "tokens_per_s": beat.tokens_per_s if running else 0.0,
        "tokens_generated": beat.tokens_generated,
        "groups_uploaded": beat.groups_uploaded,
        "groups_spooled": beat.groups_spooled,
        "groups_quarantined": beat.groups_quarantined,
        "groups_filtered": beat.groups_filtered,
        "prompts_solved": beat.prompts_solved,
        "weights_refused": beat.weights_refused,
        "errors": beat.errors,
        "swaps": beat.swaps,
        "last_swap_s": beat.last_swap_s,
        "memory_gb": beat.memory_gb,
        "heartbeat_age_s": max(now - beat.updated_at, 0.0),
    }
    untrusted = trust is not None and trust != "signed"
    if untrusted:
        values["tokens_generated"] = 0.0  # a claim of throughput, like tokens_per_s
    if trust is not None:
        values["untrusted"] = float(untrusted)
        values["revoked"] = float(trust == "revoked")
    if beat.version is not None and not untrusted:
        values["version"] = beat.version
    lag = shown_lag(beat, now, head, trust)
    if lag is not None:
        values["lag"] = lag
    return {f"{prefix}/{name}": float(value) for name, value in values.items()}


async def read_heartbeat(store: Store, run: str, worker: str) -> Heartbeat:
    """The heartbeat of `worker`, read with at most MAX_HEARTBEAT_BYTES + 1 bytes. NotFound when
    it has none, ValueError (TooLarge for an oversize object) when it does not parse, another
    StoreError when the store fails."""
    beat, _ = await read_judged_heartbeat(store, run, worker, None)
    return beat


async def read_judged_heartbeat(
    store: Store, run: str, worker: str, registry: Registry | None
) -> tuple[Heartbeat, HeartbeatTrust | None]:
    """`read_heartbeat` with its verdict (`judge_heartbeat`) against a signed run's `registry`
    (None: an unsigned run, verdict None)."""
    key = RunLayout(run).heartbeat(worker)
    data = await read_capped_bytes(store, key, MAX_HEARTBEAT_BYTES)
    beat = Heartbeat.from_bytes(data, worker=worker)
    return beat, None if registry is None else judge_heartbeat(data, beat, registry)


async def read_heartbeats(store: Store, run: str, *, concurrency: int = 16) -> tuple[list[Heartbeat], int]:
    """Every parseable heartbeat of the run (one listing, `concurrency` reads at a time), and
    how many objects could not be read or parsed (oversize ones among them: never read past
    MAX_HEARTBEAT_BYTES + 1 bytes, nor at all when the listing already shows them too large).
    A failed listing raises its StoreError."""
    judged, bad = await read_fleet(store, run, None, concurrency=concurrency)
    return [beat for beat, _ in judged], bad


async def read_fleet(
    store: Store, run: str, registry: Registry | None, *, concurrency: int = 16
) -> tuple[list[tuple[Heartbeat, HeartbeatTrust | None]], int]:
    """`read_heartbeats`, each heartbeat with its verdict (`judge_heartbeat`) against a signed
    run's `registry` (None: an unsigned run, every verdict None)."""
    prefix = RunLayout(run).workers_prefix
    infos = [info async for info in store.list(prefix) if info.key.endswith(".json")]
    gate = asyncio.Semaphore(concurrency)

    async def read(key: str, size: int) -> tuple[Heartbeat, HeartbeatTrust | None] | None:
        if size > MAX_HEARTBEAT_BYTES:
            return None
        async with gate:
            try:
                data = await read_capped_bytes(store, key, MAX_HEARTBEAT_BYTES)
                beat = Heartbeat.from_bytes(data, worker=PurePosixPath(key).stem)
            except (StoreError, ValueError):
                return None
        return beat, None if registry is None else judge_heartbeat(data, beat, registry)

    beats = await asyncio.gather(*(read(info.key, info.size) for info in infos))
    return [b for b in beats if b is not None], sum(b is None for b in beats)


MAX_HEARTBEAT_BYTES = 64 * 1024
MAX_TEXT_CHARS = 256
MAX_ERROR_CHARS = 2000
#: Largest number a heartbeat may state (tokens per second, seconds, GB): bounded, so printable.
MAX_HEARTBEAT_NUMBER = 1e12
#: How each field is checked: free text, a non-negative count, a version or None, a plane (one of
#: `PLANES`), a number in [0, MAX_HEARTBEAT_NUMBER], a time (`strict_json.check_timestamp`).
_FIELD_KINDS = {
    "worker_id": "str",
    "name": "str",
    "status": "str",
    "tier": "str",
    "version": "version",
    "state_digest": "str",
    "plane": "plane",
    "pointer_version": "version",
    "tokens_per_s": "number",
    "tokens_generated": "count",
    "groups_uploaded": "count",
    "groups_spooled": "count",
    "groups_quarantined": "count",
    "groups_filtered": "count",
    "prompts_solved": "count",
    "swaps": "count",
    "last_swap_s": "number",
    "errors": "count",
    "last_error": "str",
    "weights_refused": "count",
    "memory_gb": "number",
    "started_at": "time",
    "updated_at": "time",
    "instance": "str",
}
