"""The worker's heartbeat: the fields every part of the worker sets, its errors, its writes (signed
by the worker key in a signed run: `Reporter.signer`)."""

from __future__ import annotations

import asyncio
import logging
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from slime_stoa.protocol.heartbeat import Heartbeat
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store, StoreConfigError, StoreError

from .aio import wait
from .spool import Spool
from .uploader import Uploader

log = logging.getLogger("macd")


class Reporter:
    """The heartbeat as the worker's parts update it (`update`), the errors they report (`error`:
    counted in `errors`/`last_error`, the same message logged once per `repeat_log_s`), and its
    writes to the bucket (`write`, `beat_forever`)."""

    def __init__(self, store: Store, layout: RunLayout, worker_id: str, name: str, *, repeat_log_s: float) -> None:
        self.store, self.layout, self.worker_id, self.repeat_log_s = store, layout, worker_id, repeat_log_s
        self.beat = Heartbeat(worker_id=worker_id, name=name, status="starting", started_at=time.time())
        self.on_heartbeat: Callable[[Heartbeat], None] | None = None  # sees every heartbeat (macd.tracking)
        self.signer: SigningKey | None = None  # the worker key: signs every heartbeat written (a signed run's)
        self._logged: dict[str, float] = {}  # error message -> when it was last logged (monotonic)

    def update(self, **fields: Any) -> None:
        self.beat = replace(self.beat, **fields)

    def error(self, message: str) -> None:
        """Count an error in the heartbeat (`errors`, `last_error`) and log it; the same message
        again within `repeat_log_s` is counted but logged only at debug level."""
        now = time.monotonic()
        last = self._logged.get(message)
        if last is None or now - last >= self.repeat_log_s:
            self._logged = {m: t for m, t in self._logged.items() if now - t < self.repeat_log_s}
            self._logged[message] = now
            log.warning("%s", message)
        else:
            log.debug("%s", message)
        self.update(errors=self.beat.errors + 1, last_error=message[:500])

    def count_spool(self, spool: Spool, uploader: Uploader) -> None:
        self.update(groups_spooled=spool.depth, groups_quarantined=len(spool.quarantined()),
                    groups_uploaded=uploader.stats.uploaded)

    async def beat_forever(self, stop: asyncio.Event, spool: Spool, uploader: Uploader, every_s: float) -> None:
        """Write a heartbeat every `every_s` until `stop` is set (the final one is the worker's)."""
        while not stop.is_set():
            self.count_spool(spool, uploader)
            self.update(memory_gb=rss_gb())
            await self.write()
            await wait(stop, every_s)

    async def write(self) -> None:
        self.update(updated_at=time.time())
        if self.on_heartbeat is not None:
            self.on_heartbeat(self.beat)
        try:
            data = self.beat.to_bytes(self.signer, run=self.layout.run)
            await self.store.put(self.layout.heartbeat(self.worker_id), data)
        except StoreConfigError:
            raise
        except StoreError as exc:
            log.warning("heartbeat not written: %s", exc)


def rss_gb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 30) if sys.platform == "darwin" else rss / (1 << 20)


def tier() -> str:
    from .machine import memory_bytes

    return f"{memory_bytes() / 2**30:.0f} GiB"
