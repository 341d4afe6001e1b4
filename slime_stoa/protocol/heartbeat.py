"""Worker heartbeats (`runs/<run>/workers/<worker>.json`): what each Mac is doing.

Each worker rewrites its own heartbeat object every few seconds; the operator's `stoa fleet` and
the trainer's wait-timeout message read them. Pure data with strict parsing, what a heartbeat
means as of now (`shown_status`, `shown_lag`, `worker_metrics`), and the readers of heartbeats
(`read_heartbeat`, `read_heartbeats`), which read at most MAX_HEARTBEAT_BYTES + 1 bytes of each.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import PurePosixPath

from .layout import RunLayout, check_worker_id
from .store import Store, StoreError
from .store.capped import read_capped_bytes
from .strict_json import load_json

FORMAT = "stoa.heartbeat/1"


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    worker_id: str
    name: str  # the label given at join
    status: str  # "starting", "syncing", "generating", "paused" (spool full), "stopping"
    tier: str = ""  # memory tier, e.g. "24 GiB"
    version: int | None = None  # weight version held
    state_digest: str = ""  # state digest of the weights held (verified on every swap)
    pointer_version: int | None = None  # latest version seen in the pointer
    tokens_per_s: float = 0.0  # generation throughput over the last cohort
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

    @property
    def lag(self) -> int | None:
        if self.version is None or self.pointer_version is None:
            return None
        return max(self.pointer_version - self.version, 0)

    def to_bytes(self) -> bytes:
        return json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True).encode()

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
                doc[name] = _printable(value, MAX_ERROR_CHARS if name == "last_error" else MAX_TEXT_CHARS)
            elif kind in ("count", "version"):
                if value is None and kind == "version":
                    continue
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
                    raise ValueError(f"heartbeat field {name} must be a non-negative integer")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"heartbeat field {name} must be a finite number")
        check_worker_id(doc["worker_id"])
        if worker is not None and doc["worker_id"] != worker:
            raise ValueError(f"heartbeat of worker {doc['worker_id']!r} found under worker {worker!r}")
        return cls(**doc)


# -- what a heartbeat says about its worker now ------------------------------------------------------

#: A worker rewrites its heartbeat every ~10 s; one silent for this long is not running any more.
SILENT_AFTER_S = 60.0
#: The shown statuses of a worker that is not running (see `shown_status`).
NOT_RUNNING = ("stopped", "silent")


def shown_status(beat: Heartbeat, now: float) -> str:
    """The worker's status as of `now`: "silent" when its heartbeat stopped coming, whatever it
    said last (a crash or a kill writes no final "stopped"), else what it said."""
    if beat.status != "stopped" and now - beat.updated_at > SILENT_AFTER_S:
        return "silent"
    return beat.status


def shown_lag(beat: Heartbeat, now: float, head: int | None = None) -> int | None:
    """Versions the worker is behind `head` (the run's current version; when None, the pointer
    version it last saw); None when it is not running (a stopped worker's version is history,
    not lag) or a version is unknown."""
    head = beat.pointer_version if head is None else head
    if shown_status(beat, now) in NOT_RUNNING or beat.version is None or head is None:
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


def worker_metrics(beat: Heartbeat, now: float, *, prefix: str = "worker", head: int | None = None) -> dict[str, float]:
    """A heartbeat as `<prefix>/<name>` numbers for an experiment tracker (both halves log
    these): `running` (1 or 0, `shown_status`), `tokens_per_s` (0 when not running),
    `version` and `lag` (`shown_lag` against `head`; each left out when unknown), the
    cumulative `groups_uploaded` and `errors`, the spool (`groups_spooled`,
    `groups_quarantined`), the worker's own filters (`groups_filtered`, `prompts_solved`), weight
    objects it refused (`weights_refused`), `swaps`, `last_swap_s`, `memory_gb` and `heartbeat_age_s`."""
    running = shown_status(beat, now) not in NOT_RUNNING
    values: dict[str, float] = {
        "running": float(running),
        "tokens_per_s": beat.tokens_per_s if running else 0.0,
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
    if beat.version is not None:
        values["version"] = beat.version
    lag = shown_lag(beat, now, head)
    if lag is not None:
        values["lag"] = lag
    return {f"{prefix}/{name}": float(value) for name, value in values.items()}


async def read_heartbeat(store: Store, run: str, worker: str) -> Heartbeat:
    """The heartbeat of `worker`, read with at most MAX_HEARTBEAT_BYTES + 1 bytes. NotFound when
    it has none, ValueError (TooLarge for an oversize object) when it does not parse, another
    StoreError when the store fails."""
    key = RunLayout(run).heartbeat(worker)
    return Heartbeat.from_bytes(await read_capped_bytes(store, key, MAX_HEARTBEAT_BYTES), worker=worker)


async def read_heartbeats(store: Store, run: str, *, concurrency: int = 16) -> tuple[list[Heartbeat], int]:
    """Every parseable heartbeat of the run (one listing, `concurrency` reads at a time), and
    how many objects could not be read or parsed (oversize ones among them: never read past
    MAX_HEARTBEAT_BYTES + 1 bytes, nor at all when the listing already shows them too large).
    A failed listing raises its StoreError."""
    prefix = RunLayout(run).workers_prefix
    infos = [info async for info in store.list(prefix) if info.key.endswith(".json")]
    gate = asyncio.Semaphore(concurrency)

    async def read(key: str, size: int) -> Heartbeat | None:
        if size > MAX_HEARTBEAT_BYTES:
            return None
        async with gate:
            try:
                data = await read_capped_bytes(store, key, MAX_HEARTBEAT_BYTES)
                return Heartbeat.from_bytes(data, worker=PurePosixPath(key).stem)
            except (StoreError, ValueError):
                return None

    beats = await asyncio.gather(*(read(info.key, info.size) for info in infos))
    return [b for b in beats if b is not None], sum(b is None for b in beats)


def _printable(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, each non-printable one replaced by U+FFFD."""
    text = text[:limit]
    return text if text.isprintable() else "".join(c if c.isprintable() else "\ufffd" for c in text)


MAX_HEARTBEAT_BYTES = 64 * 1024
MAX_TEXT_CHARS = 256
MAX_ERROR_CHARS = 2000
#: How each field is checked: free text, a non-negative count, a version or None, a finite number.
_FIELD_KINDS = {
    "worker_id": "str",
    "name": "str",
    "status": "str",
    "tier": "str",
    "version": "version",
    "state_digest": "str",
    "pointer_version": "version",
    "tokens_per_s": "number",
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
    "started_at": "number",
    "updated_at": "number",
}
