"""`ConsumerState`: everything a restarted trainer needs to neither re-consume nor skip data.

Key names here are relative to the run's rollouts prefix (`<13-digit ms>-<worker>-<10-digit seq>.rec`),
so they sort by time and carry their own timestamp.

- `cursor`: the furthest key name discovered (never past the trainer's clock); new keys are
  listed strictly after it.
- `seen`: names discovered within the longest sweep window (`late_window_ms`, or
  `skew_window_ms` when larger) before the cursor, so the window can be listed again for late
  keys without taking a key twice. Older names are pruned: memory is bounded by the records
  landing within one window.
- `pending`: discovered, not yet downloaded and judged (name -> size from the listing).
- `ledger`: the reuse ledger, admitted groups still usable (name -> times used).
- `counters`: cumulative counts (rejects by reason, stale, filtered, per worker, ...).
- `last_seen`: each worker's newest key timestamp (ms), for the wait-timeout message.

The JSON form (`to_json` / `from_json`) is what `state_dict()` returns and what the bucket and
slime's checkpoint hold.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

FORMAT = "stoa.consumer/1"
_NAME = re.compile(r"^\d{13}-[a-z0-9][a-z0-9-]{0,47}-\d{10}\.rec$")


def is_key_name(name: object) -> bool:
    """True for a rollout key name relative to the rollouts prefix."""
    return isinstance(name, str) and bool(_NAME.match(name))


def name_time_ms(name: str) -> int:
    """The millisecond timestamp a key name (or cursor) starts with."""
    return int(name[:13])


def name_worker(name: str) -> str:
    """The worker id inside a key name."""
    return name[14:-15]


@dataclass
class ConsumerState:
    run: str
    cursor: str = ""
    seen: set[str] = field(default_factory=set)
    pending: dict[str, int | None] = field(default_factory=dict)
    ledger: dict[str, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    last_seen: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "run": self.run,
            "cursor": self.cursor,
            "seen": sorted(self.seen),
            "pending": [[name, size] for name, size in sorted(self.pending.items())],
            "ledger": dict(sorted(self.ledger.items())),
            "counters": dict(sorted(self.counters.items())),
            "last_seen": dict(sorted(self.last_seen.items())),
        }

    @classmethod
    def from_json(cls, doc: Any) -> ConsumerState:
        """Parse `to_json` output; ValueError naming the first bad field."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} consumer state")
        run = doc.get("run")
        if not isinstance(run, str) or not run:
            raise ValueError("consumer state: bad 'run'")
        cursor = doc.get("cursor", "")
        if not isinstance(cursor, str) or (cursor and not (len(cursor) >= 13 and cursor[:13].isdigit())):
            raise ValueError(f"consumer state: bad cursor {cursor!r}")
        seen = doc.get("seen", [])
        if not isinstance(seen, list) or not all(is_key_name(n) for n in seen):
            raise ValueError("consumer state: 'seen' must be a list of rollout key names")
        pending: dict[str, int | None] = {}
        for entry in doc.get("pending", []):
            if (
                not isinstance(entry, list)
                or len(entry) != 2
                or not is_key_name(entry[0])
                or not (entry[1] is None or _nonneg_int(entry[1]))
            ):
                raise ValueError(f"consumer state: bad pending entry {entry!r}")
            pending[entry[0]] = entry[1]
        ledger = _int_map(doc.get("ledger", {}), "ledger", key_check=is_key_name)
        counters = _int_map(doc.get("counters", {}), "counters")
        last_seen = _int_map(doc.get("last_seen", {}), "last_seen")
        return cls(
            run=run,
            cursor=cursor,
            seen=set(seen),
            pending=pending,
            ledger=ledger,
            counters=counters,
            last_seen=last_seen,
        )


def _nonneg_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _int_map(doc: Any, what: str, key_check=None) -> dict[str, int]:
    if not isinstance(doc, dict):
        raise ValueError(f"consumer state: '{what}' must be an object")
    out = {}
    for key, value in doc.items():
        if not isinstance(key, str) or (key_check and not key_check(key)) or not _nonneg_int(value):
            raise ValueError(f"consumer state: bad {what} entry {key!r}: {value!r}")
        out[key] = value
    return out
