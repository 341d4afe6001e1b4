"""Finding new rollout records: one listing from a cursor, whatever the number of workers, at a
cost that junk in the prefix cannot raise for long.

Rollout keys lead with a 13-digit millisecond timestamp, so every worker's new records sort
after the cursor and one paginated listing finds them all: a poll costs one request per 1,000
new keys, never one per worker, and nothing grows with the total number of records.

Two listings, both plain `list(prefix, start_after=...)`, each ended at the horizon:

- `tail(capacity)`: keys strictly after the cursor, in key order, taking at most `capacity`
  (backpressure: the cursor stops at the last key taken, so nothing is skipped; the rest is
  found by the next poll). The cursor moves over every key listed, taken or not (junk is
  listed once, then sorts behind the cursor), but never past the trainer's clock: a worker
  whose clock runs ahead cannot make the cursor jump over the keys of the others.
- `sweep(window_ms)`: a window before the cursor, listed again now and then, for keys that
  landed late: often over the short skew window (a slow upload), rarely over the long late
  window (a worker that was offline with a full spool). Names already discovered in the
  longest window are in `state.seen` and skipped; older names are pruned from it, so memory
  holds one long window of keys. A sweep is walked in steps of `SWEEP_PAGES` pages, and the
  consumer runs each step as a task of its own beside the tail and the downloads (they share
  this state: a key judged by both is taken once, and a sweep never lists names older than the
  remembered window, which the tail may forget during a step), so junk inside a window delays
  no honest record.

What a listed key must be to be taken (added to `seen` and the download queue, i.e. to the saved
state) -- anything else is counted once, when the tail passes it (`rejected/<reason>`), and left
where it is:

- a valid record name (`RunLayout.parse_rollout`), else `rejected/bad_key`;
- stamped no later than `future_ms` past the trainer's clock: the listing ends at the first key
  stamped later (`horizon`), so keys stamped further ahead are never listed (until their time
  comes) and never stored;
- not stamped more than `future_ms` after the store says it was written (the listing's
  LastModified): such a key was written in the future on purpose, so it is junk even when its
  time comes (`rejected/future_key`; under the id of a worker the run admits, also counted as
  that worker's `clock_refused`: an honest Mac whose clock runs ahead, see below);
- of a worker the run admits (`admits`: in a signed run, an id of the worker registry), else
  `rejected/unknown_key` with no per-worker counter, so made-up ids grow nothing.

What a writer of the prefix (any worker token, revoked ones included) can still cost:
- every junk key stamped within the windows behind the cursor is listed once by the tail and
  again by each sweep whose window covers it: at most `1 + skew/sweep_interval +
  late/late_sweep_interval` listings of it (43 with the defaults), i.e. one LIST request per
  ~23 junk PUTs it paid for, spread over the late window, then nothing;
- a key stamped within `future_ms` ahead of the clock is listed by every tail poll until the
  clock passes it (one LIST request per 1,000 such keys per poll), so the writer must keep
  writing fresh keys to keep the cost up;
- a key under a registered worker's id (a forgery: its signature fails) is taken like an honest
  one: one GET, and about 60 bytes of saved state until it leaves the late window.
Nothing of it is saved beyond that, and no amount of it changes which honest keys are found.

A key stamped more than the longest window before the cursor when it lands is never found:
choose it longer than the worst upload delay worth keeping (such a record is often stale anyway;
the staleness rule decides).

Workers' clocks. macd stamps keys (and record times) with the store's clock (`macd/clock.py`:
the `Date` of the store's answers), so an honest key's skew is the store's against the trainer's
plus a second or two, whatever the Mac's own clock says. Where a worker has no store date (the
folder store, which shares the local clock) its clock must lie within these limits of the
trainer's: up to `future_ms` ahead (further: every record refused as `future_key` or
`timestamps`, counted as the worker's `clock_refused`); up to `skew_window_ms` behind and found
by the tail's next polls or the short sweep; up to `late_window_ms` behind and found by the deep
sweep, within `late_sweep_interval_s`; further behind, never found (nothing lists there).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import Store

from .state import ConsumerState, name_time_ms

PAGE_SIZE = 1000  # keys per LIST response (S3's maximum, and what every backend here uses)
# LIST pages per sweep step: a long sweep goes on at the next call (`Discovery.sweep`). A step runs
# beside the tail, so its length delays no new record; shorter steps lose less work when the
# consumer closes during one (a cancelled step is listed again) and leave the store quieter gaps.
SWEEP_PAGES = 2
MAX_BAD_NAMES = 10_000  # junk key names remembered so each is counted once (then counted again)


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
    future: int = 0  # valid names written stamped more than the future window ahead (junk)
    unknown: int = 0  # valid names of workers the run does not admit (unregistered ids)
    clock_refused: Counter[str] = field(default_factory=Counter)  # `future` keys of admitted workers, by worker


def cursor_cap(now_ms: int) -> str:
    """The furthest the cursor may go at time `now_ms`: every key stamped `now_ms` or later sorts after it."""
    return f"{max(now_ms, 0):013d}"


def advance_cursor(cursor: str, name: str, now_ms: int) -> str:
    """The cursor after listing `name`: forward only, and never past the clock."""
    past = cursor_past(name)
    return cursor if past is None else max(cursor, min(past, cursor_cap(now_ms)))


def cursor_past(name: str) -> str | None:
    """A cursor (13 leading digits) at or after `name` with no record name between the two:
    `name` itself when it leads with 13 digits; else, for a junk name that leads with k < 13
    digits, the next k-digit prefix padded with zeros (every record name in between would need a
    non-digit among its first 13 characters). None when there is no such cursor."""
    digits = len(name) - len(name.lstrip("0123456789"))
    if digits >= 13:
        return name
    if digits == 0 or name[:digits] == "9" * digits:
        return None
    return f"{int(name[:digits]) + 1:0{digits}d}".ljust(13, "0")


def horizon(now_ms: int, future_ms: int) -> str:
    """Where a listing at `now_ms` ends: every name stamped more than `future_ms` ahead (and every
    name that does not start with a timestamp, such as letters) sorts at or after it."""
    return f"{max(now_ms + future_ms + 1, 0):013d}"


def written_ahead(name: str, last_modified: float | None, future_ms: int) -> bool:
    """Whether the key `name` was stamped more than `future_ms` after the store wrote it."""
    return last_modified is not None and name_time_ms(name) > int(last_modified * 1000) + future_ms


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
        future_ms: int = 300_000,
        admits: Callable[[str], Awaitable[bool]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.layout = layout
        self.state = state
        self.window_ms = window_ms
        self.keep_ms = max(window_ms, late_window_ms)  # how long discovered names are remembered
        self.future_ms = future_ms
        self.admits = admits  # worker id -> whether its records may be taken (None: every id)
        self.clock = clock
        self.prefix = layout.rollouts_prefix("train")
        self._bad: set[str] = set()
        self._sweep_from: str | None = None  # where the unfinished sweep goes on (start_after)

    @property
    def sweeping(self) -> bool:
        """Whether a sweep stopped after its step's pages and goes on at the next `sweep` call."""
        return self._sweep_from is not None

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

    def _count_junk(self, key: str, result: PollResult, what: str, *, once: bool) -> bool:
        """Count a junk key (True when counted now); `once`: the cursor passes it now, so no
        poll lists it again (a key ahead of the clock is listed by every poll: counted once
        per process, bounded)."""
        if key in self._bad:  # counted while it was ahead of the clock
            if once:
                self._bad.discard(key)
            return False
        if not once:
            if len(self._bad) >= MAX_BAD_NAMES:
                return False
            self._bad.add(key)
        setattr(result, what, getattr(result, what) + 1)
        return True

    async def _judge_key(
        self, key: str, last_modified: float | None, result: PollResult, *, count: bool, once: bool = True
    ) -> tuple[str, str] | None:
        """(name, worker) of a listed key to take, or None for junk (with `count`, counted: the
        tail counts what it passes; a sweep lists keys the tail counted already)."""
        parsed = self.layout.parse_rollout(key)
        what = None
        if parsed is None or parsed.kind != "train":
            what = "bad"
        elif written_ahead(key[len(self.prefix) :], last_modified, self.future_ms):
            what = "future"
        elif self.admits is not None and not await self.admits(parsed.worker):
            what = "unknown"
        if what is not None:
            if count and self._count_junk(key, result, what, once=once) and what == "future":
                assert parsed is not None
                if self.admits is None or await self.admits(parsed.worker):  # made-up ids grow nothing
                    result.clock_refused[parsed.worker] += 1
            return None
        assert parsed is not None
        return key[len(self.prefix) :], parsed.worker

    async def tail(self, capacity: int) -> PollResult:
        """List keys after the cursor, up to the horizon, and take up to `capacity` new ones (0: no request)."""
        result = PollResult()
        if capacity <= 0:
            return result
        state = self.state
        start = self.prefix + state.cursor if state.cursor else None
        now_ms = self._now_ms()
        end = horizon(now_ms, self.future_ms)
        listing = self.store.list(self.prefix, start_after=start)
        async with contextlib.aclosing(listing):
            async for info in listing:
                result.listed += 1
                name = info.key[len(self.prefix) :]
                if name >= end:  # stamped too far ahead, or not a timestamp: nothing after it is listed
                    if self.layout.parse_rollout(info.key) is None:  # in the page already: counted, free
                        self._count_junk(info.key, result, "bad", once=False)
                    break
                state.cursor = advance_cursor(state.cursor, name, now_ms)  # junk too: listed once
                past = cursor_past(name)
                passed = past is not None and past <= state.cursor  # no later tail lists it again
                judged = await self._judge_key(info.key, info.last_modified, result, count=True, once=passed)
                if judged is None or name in state.seen:
                    continue  # junk, or a key stamped ahead taken by an earlier poll
                self._take(name, judged[1], info.size, result)
                if len(result.new) >= capacity:
                    break
        result.requests = pages(result.listed)
        prune_seen(state.seen, state.cursor, self.keep_ms)
        return result

    def _new_behind(self, name: str) -> bool:
        """Whether a sweep may take `name`: not seen, and inside the remembered window (older
        names may be forgotten already: taking one would take it a second time)."""
        state = self.state
        return name not in state.seen and name >= cursor_cap(window_floor_ms(state.cursor, self.keep_ms))

    def forget_sweep(self) -> None:
        """Drop the unfinished sweep and the junk names counted (a state loaded in place of this one)."""
        self._sweep_from = None
        self._bad.clear()

    async def sweep(self, window_ms: int | None = None, *, max_pages: int = SWEEP_PAGES) -> PollResult:
        """List `window_ms` (default: the skew window, at most the remembered one) behind the
        cursor again and take every key not seen yet, `max_pages` listing pages at most per
        call: a longer sweep stops there (`sweeping`) and the next call goes on from where it
        stopped, whatever its `window_ms`. Why: junk stamped inside the window is listed again by
        every sweep (millions of keys take the folder store or S3 tens of seconds to list),
        and a step is a unit of work the consumer can run beside the tail (which may move the
        cursor and forget old names during it) and cancel. A failed or cancelled step is taken
        again from where it began."""
        result = PollResult()
        state = self.state
        if not state.cursor:
            self._sweep_from = None
            return result  # nothing discovered yet: the tail covers everything
        if self._sweep_from is None:
            window = min(self.window_ms if window_ms is None else window_ms, self.keep_ms)
            self._sweep_from = self.layout.rollout_after(window_floor_ms(state.cursor, window))
        # Names older than the remembered window may be forgotten already: the tail prunes `seen`
        # as the cursor moves, between a sweep's steps and during one. A sweep never takes them
        # (it would take them a second time).
        self._sweep_from = max(self._sweep_from, self.layout.rollout_after(window_floor_ms(state.cursor, self.keep_ms)))
        limit = max(max_pages, 1) * PAGE_SIZE
        listing = self.store.list(self.prefix, start_after=self._sweep_from)
        stopped_at = None
        async with contextlib.aclosing(listing):
            async for info in listing:
                result.listed += 1
                name = info.key[len(self.prefix) :]
                if name > state.cursor:
                    break  # the tail's part
                if self._new_behind(name):
                    judged = await self._judge_key(info.key, info.last_modified, result, count=False)
                    if judged is not None and self._new_behind(name):  # the tail may take (and forget) it meanwhile
                        self._take(name, judged[1], info.size, result)
                        result.late += 1
                if result.listed >= limit:  # before the next page is asked for
                    stopped_at = info.key
                    break
        self._sweep_from = stopped_at
        result.requests = pages(result.listed)
        prune_seen(state.seen, state.cursor, self.keep_ms)
        return result
