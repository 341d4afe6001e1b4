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
- `replay`: the replay ledger (`ReplayLedger`): a content hash and the (worker, seq) of each of
  the last `capacity` admitted records, so a record replayed under another key or another
  sequence number is refused as "duplicate". Absent in states written before it: empty.
- `quarantine`: the quarantine book (`quarantine.WorkerRecord` per worker: weighted reward
  disagreements, logprob gap, canary strikes, whether and why quarantined, releases applied).
  Absent in states written before it: empty.
- `registry_serial`: the highest serial of the worker registry read (signed runs), so a trainer
  restarted from this state refuses an older registry copy put back in the bucket. Absent: 0.
- `seq`: the sequence number of the save (signed runs; `heads`): a state put back from before
  the newest signed head is refused. Absent: 0.

The JSON form (`to_json` / `from_json`) is what `state_dict()` returns and what the bucket and
slime's checkpoint hold.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from slime_stoa.protocol.records import RolloutGroup
from slime_stoa.protocol.validate import RecordRejected

from .quarantine import WorkerRecord, copy_records, records_from_json, records_to_json

FORMAT = "stoa.consumer/1"
_NAME = re.compile(r"\d{13}-[a-z0-9][a-z0-9-]{0,47}-\d{10}\.rec")
#: Admitted records the replay ledger remembers (32 bytes each in the saved state: 2 MiB).
DEFAULT_REPLAY_CAPACITY = 1 << 16


def is_key_name(name: object) -> bool:
    """True for a rollout key name relative to the rollouts prefix."""
    return isinstance(name, str) and bool(_NAME.fullmatch(name))


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
    replay: ReplayLedger = field(default_factory=lambda: ReplayLedger())
    quarantine: dict[str, WorkerRecord] = field(default_factory=dict)
    registry_serial: int = 0
    seq: int = 0  # the save's sequence number (signed runs: `heads`); 0 never saved

    def snapshot(self, *, ledger: dict[str, int], registry_serial: int) -> ConsumerState:
        """A copy (sharing only the replay ledger) with this reuse `ledger` and registry serial."""
        return ConsumerState(
            run=self.run,
            cursor=self.cursor,
            seen=set(self.seen),
            pending=dict(self.pending),
            ledger=ledger,
            counters=dict(self.counters),
            last_seen=dict(self.last_seen),
            replay=self.replay,
            quarantine=copy_records(self.quarantine),
            registry_serial=registry_serial,
            seq=self.seq,
        )

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
            "replay": self.replay.to_json(),
            "quarantine": records_to_json(self.quarantine),
            "registry_serial": self.registry_serial,
            "seq": self.seq,
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
        replay = ReplayLedger.from_json(doc.get("replay", ""))
        quarantine = records_from_json(doc.get("quarantine", {}))
        registry_serial = doc.get("registry_serial", 0)
        if not _nonneg_int(registry_serial):
            raise ValueError(f"consumer state: bad registry_serial {registry_serial!r}")
        seq = doc.get("seq", 0)
        if not _nonneg_int(seq):
            raise ValueError(f"consumer state: bad seq {seq!r}")
        return cls(
            run=run,
            cursor=cursor,
            seen=set(seen),
            pending=pending,
            ledger=ledger,
            counters=counters,
            last_seen=last_seen,
            replay=replay,
            quarantine=quarantine,
            registry_serial=registry_serial,
            seq=seq,
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


# -- the replay ledger ----------------------------------------------------------------------------


def content_digest(group: RolloutGroup) -> bytes:
    """A 16-byte xxh3-128 of what a record teaches: its run, task, prompt (index and tokens) and
    the multiset of its samples (each sample's response tokens and logprob bits).

    Left out on purpose, because a replaying worker can change them freely: the worker id, the
    sequence number, the timestamps, the weight version and state digest (relabelling old
    samples as fresh), the worker's rewards and finish reasons, and the order of the samples.
    Two honest groups share a digest only if they drew the same responses with bit-identical
    logprobs for the same prompt (in practice: a fully deterministic policy, whose groups carry
    no GRPO signal anyway)."""
    h = xxhash.xxh3_128()
    h.update(b"stoa.content/1\0")
    for text in (group.run, group.task_id):
        raw = text.encode("utf-8", "surrogatepass")
        h.update(struct.pack("<Q", len(raw)) + raw)
    h.update(struct.pack("<qQ", group.prompt_index, len(group.prompt_tokens)))
    h.update(np.ascontiguousarray(group.prompt_tokens, dtype="<i4").tobytes())
    samples = []
    for s in group.samples:
        tokens = np.ascontiguousarray(s.response_tokens, dtype="<i4").tobytes()
        logprobs = np.ascontiguousarray(s.logprobs, dtype="<f4").tobytes()
        samples.append(xxhash.xxh3_128_digest(struct.pack("<QQ", len(tokens), len(logprobs)) + tokens + logprobs))
    h.update(struct.pack("<Q", len(samples)))
    for digest in sorted(samples):
        h.update(digest)
    return h.digest()


def _ident_digest(worker: str, seq: int) -> bytes:
    return xxhash.xxh3_64_digest(f"{worker}/{seq}".encode())


def _name_digest(name: str) -> bytes:
    return xxhash.xxh3_64_digest(name.encode())


_ENTRY = 32  # content digest (16) | (worker, seq) digest (8) | key name digest (8)


class ReplayLedger:
    """The last `capacity` admitted records, by content and by (worker, seq), each with the key
    name it came under, so a replay is refused (`check`) and a record judged again under its own
    key (a restored reuse-ledger entry) is not.

    - content: the same `content_digest` under another key is a replay (another worker, another
      sequence number, another timestamp, relabelled weights or shuffled samples);
    - (worker, seq): one worker's sequence number names one record; the same pair under another
      key (another timestamp) is a replay even with different content.

    Memory is bounded: the oldest records are forgotten first (a replay of a record older than
    the last `capacity` admitted is usually refused as stale anyway). Saved with the consumer
    state as one base64 string of 32-byte entries (64-bit digests for the (worker, seq) pair and
    the key name: a false match needs a 64-bit collision among `capacity` entries)."""

    def __init__(self, capacity: int = DEFAULT_REPLAY_CAPACITY) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"ReplayLedger capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._content: dict[bytes, bytes] = {}  # content digest -> name digest
        self._ident: dict[bytes, bytes] = {}  # (worker, seq) digest -> name digest
        self._order: deque[bytes] = deque()  # entries (see _ENTRY), oldest first

    def __len__(self) -> int:
        return len(self._order)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplayLedger) and list(self._order) == list(other._order)

    def problem(self, group: RolloutGroup, name: str) -> str | None:
        """Why `group`, read from key `name`, is a replay of an admitted record; None if it is not."""
        key = _name_digest(name)
        first = self._ident.get(_ident_digest(group.worker_id, group.seq))
        if first is not None and first != key:
            return f"worker {group.worker_id!r} seq {group.seq} was already admitted under another key"
        first = self._content.get(content_digest(group))
        if first is not None and first != key:
            return "the same prompt and samples were already admitted under another key"
        return None

    def check(self, group: RolloutGroup, name: str) -> None:
        """RecordRejected("duplicate") if `group` replays an admitted record."""
        if problem := self.problem(group, name):
            raise RecordRejected("duplicate", problem)

    def add(self, group: RolloutGroup, name: str) -> None:
        """Remember an admitted record (call after `check` passed)."""
        self._add(content_digest(group) + _ident_digest(group.worker_id, group.seq) + _name_digest(name))

    def _add(self, entry: bytes) -> None:
        content, ident, key = entry[:16], entry[16:24], entry[24:]
        if self._content.get(content) == key and self._ident.get(ident) == key:
            return  # judged again under its own key: already remembered
        self._content[content] = key
        self._ident[ident] = key
        self._order.append(entry)
        while len(self._order) > self.capacity:
            old = self._order.popleft()
            if self._content.get(old[:16]) == old[24:]:
                del self._content[old[:16]]
            if self._ident.get(old[16:24]) == old[24:]:
                del self._ident[old[16:24]]

    def to_json(self) -> str:
        return base64.b64encode(b"".join(self._order)).decode("ascii")

    @classmethod
    def from_json(cls, doc: Any, capacity: int = DEFAULT_REPLAY_CAPACITY) -> ReplayLedger:
        """Parse `to_json` output (the newest `capacity` entries are kept); ValueError if malformed."""
        if not isinstance(doc, str):
            raise ValueError("consumer state: 'replay' must be a base64 string")
        try:
            raw = base64.b64decode(doc.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise ValueError("consumer state: 'replay' is not base64") from None
        if len(raw) % _ENTRY:
            raise ValueError(f"consumer state: 'replay' holds {len(raw)} bytes, not a multiple of {_ENTRY}")
        ledger = cls(capacity)
        start = max(0, len(raw) // _ENTRY - capacity) * _ENTRY
        for at in range(start, len(raw), _ENTRY):
            ledger._add(raw[at : at + _ENTRY])
        return ledger
