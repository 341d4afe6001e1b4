"""Worker heartbeats (`runs/<run>/workers/<worker>.json`): what each Mac is doing.

Each worker rewrites its own heartbeat object every few seconds; the operator's `stoa fleet` and
the trainer's wait-timeout message read them. Pure data with strict parsing.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

from .layout import check_worker_id
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
    "swaps": "count",
    "last_swap_s": "number",
    "errors": "count",
    "last_error": "str",
    "memory_gb": "number",
    "started_at": "number",
    "updated_at": "number",
}
