"""Finding new rollout records: one listing from a cursor, whatever the number of workers.

Rollout keys lead with a 13-digit millisecond timestamp, so every worker's new records sort
after the cursor and one paginated listing finds them all: a poll costs one request per 1,000
new keys, never one per worker, and nothing grows with the total number of records.

Two listings, both plain `list(prefix, start_after=...)`:

- `tail(capacity)`: keys strictly after the cursor, in key order, taking at most `capacity`
  (backpressure: the cursor stops at the last key taken, so nothing is skipped; the rest is
  found by the next poll). The cursor then moves to the last key taken, but never past the
  trainer's clock: a worker whose clock runs ahead cannot make the cursor jump over the keys
  of the others.
- `sweep(window_ms)`: a window before the cursor, listed again now and then, for keys that
  landed late: often over the short skew window (a slow upload, a worker clock behind), rarely
  over the long late window (a worker that was offline with a full spool). Names already
  discovered in the longest window are in `state.seen` and skipped; older names are pruned from
  it, so memory holds one long window of keys.

A key stamped more than the longest window before the cursor when it lands is never found:
choose it longer than the worst upload delay worth keeping (such a record is often stale anyway;
the staleness rule decides).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import Store

from .state import ConsumerState, name_time_ms

PAGE_SIZE = 1000  # keys per LIST response (S3's maximum, and what every backend here uses)
MAX_BAD_NAMES = 10_000  # invalid key names remembered so each is counted once


@dataclass(frozen=True, slots=True)
class Listed:
    """A newly discovered record key (relative name) and its size from the listing."""

    name: str
    worker: str
    size: int


@dataclass(slots=True)
class PollResult:
    new: list[Listed] = field(default_factory=list)
    listed: int = 0  # keys the store returned
    requests: int = 0  # LIST requests made
    late: int = 0  # new keys found behind the cursor by a sweep
    bad: int = 0  # keys under the prefix that are not valid record names (counted once each)


def cursor_cap(now_ms: int) -> str:
    """The furthest the cursor may go at time `now_ms`: every key stamped `now_ms` or later sorts after it."""
    return f"{max(now_ms, 0):013d}"


def advance_cursor(cursor: str, name: str, now_ms: int) -> str:
    """The cursor after discovering `name`: forward only, and never past the clock."""
    return max(cursor, min(name, cursor_cap(now_ms)))


def window_floor_ms(cursor: str, window_ms: int) -> int:
    """Oldest key timestamp still inside the window behind `cursor`."""
    return max(name_time_ms(cursor) - window_ms, 0) if cursor else 0


def prune_seen(seen: set[str], cursor: str, window_ms: int) -> None:
    """Forget names older than the window: no listing from the window floor can return them."""
    floor = window_floor_ms(cursor, window_ms)
    if floor:
        seen.difference_update([n for n in seen if name_time_ms(n) < floor])


def pages(listed: int, page_size: int = PAGE_SIZE) -> int:
    """LIST requests a listing that returned `listed` keys made."""
    return max(1, -(-listed // page_size))


class Discovery:
    """Incremental listing of a run's train records, updating a `ConsumerState` in place."""

    def __init__(
        self,
        store: Store,
        layout: RunLayout,
        state: ConsumerState,
        *,
        window_ms: int,
        late_window_ms: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.layout = layout
        self.state = state
        self.window_ms = window_ms
        self.keep_ms = max(window_ms, late_window_ms)  # how long discovered names are remembered
        self.clock = clock
        self.prefix = layout.rollouts_prefix("train")
        self._bad: set[str] = set()

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def _take(self, name: str, worker: str, size: int, result: PollResult) -> None:
        state = self.state
        state.seen.add(name)
        state.pending[name] = size
        ts = name_time_ms(name)
        if ts > state.last_seen.get(worker, -1):
            state.last_seen[worker] = ts
        result.new.append(Listed(name, worker, size))

    def _bad_key(self, key: str, result: PollResult) -> None:
        if key not in self._bad and len(self._bad) < MAX_BAD_NAMES:
            self._bad.add(key)
            result.bad += 1

    async def tail(self, capacity: int) -> PollResult:
        """List keys after the cursor and take up to `capacity` new ones (0: no request)."""
        result = PollResult()
        if capacity <= 0:
            return result
        state = self.state
        start = self.prefix + state.cursor if state.cursor else None
        now_ms = self._now_ms()
        listing = self.store.list(self.prefix, start_after=start)
        async with contextlib.aclosing(listing):
            async for info in listing:
                result.listed += 1
                parsed = self.layout.parse_rollout(info.key)
                if parsed is None or parsed.kind != "train":
                    self._bad_key(info.key, result)
                    continue
                name = info.key[len(self.prefix) :]
                if name in state.seen:
                    continue  # a key stamped in the future, taken by an earlier poll
                self._take(name, parsed.worker, info.size, result)
                state.cursor = advance_cursor(state.cursor, name, now_ms)
                if len(result.new) >= capacity:
                    break
        result.requests = pages(result.listed)
        prune_seen(state.seen, state.cursor, self.keep_ms)
        return result

    async def sweep(self, window_ms: int | None = None) -> PollResult:
        """List `window_ms` (default: the skew window, at most the remembered one) behind the
        cursor again and take every key not seen yet."""
        result = PollResult()
        state = self.state
        if not state.cursor:
            return result  # nothing discovered yet: the tail covers everything
        window = min(self.window_ms if window_ms is None else window_ms, self.keep_ms)
        start = self.layout.rollout_after(window_floor_ms(state.cursor, window))
        listing = self.store.list(self.prefix, start_after=start)
        async with contextlib.aclosing(listing):
            async for info in listing:
                result.listed += 1
                name = info.key[len(self.prefix) :]
                if name > state.cursor:
                    break  # the tail's part
                parsed = self.layout.parse_rollout(info.key)
                if parsed is None or parsed.kind != "train":
                    self._bad_key(info.key, result)
                    continue
                if name in state.seen:
                    continue
                self._take(name, parsed.worker, info.size, result)
                result.late += 1
        result.requests = pages(result.listed)
        prune_seen(state.seen, state.cursor, self.keep_ms)
        return result
