"""The worker keys a judge of a signed run's records trusts: the run's registry, as last read.

The registry (`protocol.registry`) is verified with the run key and cached by ETag (a read that
finds it unchanged is one conditional GET). It is read again when a record names a key it does
not hold (the worker may have been added since) and at least every `refresh_s` seconds (so a
revocation reaches records not yet consumed). A registry that does not verify, or an older one
than the last read or than `floor` (a lower serial: a signed copy from before a revocation, put
back; the floor is the serial saved with the consumer state or its signed head, so this holds
across restarts), is reported (an old copy once per serial while it stands) and ignored: the last
good one stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from slime_stoa.protocol.records import RecordError
from slime_stoa.protocol.registry import Registry, RegistryError, RegistryRead, read_registry
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signed_record import is_signed, open_signed
from slime_stoa.protocol.store import Store

log = logging.getLogger(__name__)

#: What one read of the registry found.
ReadOutcome = Literal["unchanged", "updated", "invalid", "rollback"]


class Signers:
    """The run's worker registry for one reader (the consumer, an eval collector). One read at a
    time; not thread-safe."""

    def __init__(
        self,
        store: Store,
        run: str,
        trust: RunTrust,
        *,
        refresh_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.run = run
        self.trust = trust  # the run keys (pinned + rotations) a registry may be signed by
        self.refresh_s = refresh_s
        self.clock = clock
        self.registry = Registry(run=run)
        self.floor = 0  # no registry with a lower serial is accepted (the saved state's)
        self._etag: str | None = None
        self._rollback_logged: int | None = None  # the serial of the old copy last reported
        self._read_started = -float("inf")
        self._lock = asyncio.Lock()

    def due(self) -> bool:
        """True when the last read started `refresh_s` or more ago."""
        return self.clock() - self._read_started >= self.refresh_s

    def needs_read(self, data: bytes) -> bool:
        """Before judging the downloaded object `data`: True when it names a key the registry does
        not hold (a worker added since) or a read is `due`. A malformed envelope needs no read
        (it is judged as such)."""
        if self.due():
            return True
        if is_signed(data):
            with contextlib.suppress(RecordError):
                return self.registry.by_key_id(open_signed(data).key_id) is None
        return False

    async def refresh(
        self, since: float, *, through: Callable[[Callable[[], Awaitable[RegistryRead | None]]], Awaitable[RegistryRead | None]]
    ) -> ReadOutcome | None:
        """Read the registry unless a read started at or after `since` (this clock) already
        finished; None when it was skipped. `through(op)` runs the store call (through outages)."""
        async with self._lock:
            if self._read_started >= since:
                return None
            self._read_started = self.clock()
            try:
                read = await through(
                    lambda: read_registry(self.store, self.run, self.trust.keys, if_none_match=self._etag)
                )
            except RegistryError as exc:
                log.error("stoa: ignoring the worker registry of run %r (keeping serial %d): %s",
                          self.run, self.registry.serial, exc)
                return "invalid"
            if read is None:
                return "unchanged"
            newest = max(self.registry.serial, self.floor)
            if read.registry.serial < newest:
                level = logging.ERROR if read.registry.serial != self._rollback_logged else logging.DEBUG
                self._rollback_logged = read.registry.serial  # said once per serial while it stands
                log.log(
                    level, "stoa: ignoring the worker registry of run %r: serial %d is older than the %d already read "
                    "(an old copy put back?)", self.run, read.registry.serial, newest,
                )
                return "rollback"
            self._etag = read.etag
            changed = read.registry != self.registry
            self.registry = read.registry
            return "updated" if changed else "unchanged"
