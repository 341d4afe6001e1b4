"""Worker heartbeats (`runs/<run>/workers/<worker>.json`): what each Mac is doing.

Each worker rewrites its own heartbeat object every few seconds; the operator's `stoa fleet` and
the trainer's wait-timeout message read them. Pure data with strict parsing.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

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
    swaps: int = 0
    last_swap_s: float = 0.0
    errors: int = 0
    last_error: str = ""
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
    def from_bytes(cls, data: bytes) -> Heartbeat:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"heartbeat is not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.pop("format", None) != FORMAT:
            raise ValueError(f"not a {FORMAT} document")
        known = {f.name: f for f in fields(cls)}
        doc = {k: v for k, v in doc.items() if k in known}  # newer workers may add fields
        try:
            beat = cls(**doc)
        except TypeError as exc:
            raise ValueError(f"heartbeat: {exc}") from None
        for name in ("tokens_per_s", "last_swap_s", "memory_gb", "started_at", "updated_at"):
            value = getattr(beat, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"heartbeat field {name} must be a finite number")
        if not isinstance(beat.worker_id, str) or not isinstance(beat.name, str):
            raise ValueError("heartbeat worker_id and name must be strings")
        return beat
