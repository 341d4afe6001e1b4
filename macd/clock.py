"""The worker's clock for what it stamps (record keys, record times): the store's clock.

The trainer judges a record's key and times against its own clock with a tolerance (the run's
`max_clock_skew_s`, 300 s): a key stamped further ahead is refused, one stamped far behind lands
behind the trainer's cursor (found only by a sweep, or never). A Mac whose clock is minutes off
would lose its records, so it stamps with the bucket's clock instead: the `Date` of the store's
last answer (`Store.server_date`), carried forward on the monotonic clock (a wall-clock jump on
the Mac changes nothing). Every answer refreshes it: the manifest and pointer reads, heartbeats,
uploads.

Without a store date (the folder store, which shares the local clock; or before the first
answer) the local clock is used as it is; then the limits the consumer documents hold (a clock
more than `max_clock_skew_s` ahead: refused as `timestamps`/`future_key` and counted for the
worker in the trainer's state, which `stoa fleet` shows; more than the late window behind: never
found).

`corrected_now` is the pure rule; `StoreClock` binds it to a store.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from slime_stoa.protocol.store import ServerDate, Store

#: An HTTP `Date` is truncated to the second: the server's time at the answer was, on average,
#: half a second later than it says.
DATE_RESOLUTION_S = 1.0


def corrected_now(date: ServerDate | None, *, local_s: float, monotonic_s: float) -> float:
    """Seconds since the epoch by the store's clock: its last `date` carried forward by the
    monotonic time since that answer; the local wall clock `local_s` when there is none."""
    if date is None:
        return local_s
    return date.server_s + DATE_RESOLUTION_S / 2 + max(monotonic_s - date.monotonic_s, 0.0)


class StoreClock:
    """A clock (a `time.time` stand-in) that reads `store`'s last date each time it is called."""

    def __init__(
        self,
        store: Store,
        *,
        local: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.local = local
        self.monotonic = monotonic

    def __call__(self) -> float:
        return corrected_now(self.store.server_date(), local_s=self.local(), monotonic_s=self.monotonic())

    def offset_s(self) -> float:
        """How far the store's clock is ahead of the local one (0 without a store date)."""
        return self() - self.local()
