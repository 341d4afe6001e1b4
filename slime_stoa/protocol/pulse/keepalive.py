"""A live trainer keeps its pointers fresh: every `freshness.REFRESH_S` it re-signs the pointer of
each chain it publishes (the bf16 weights' and each quantized plane's: `Committer.refresh`), so
a worker joining for the first time can tell it from an old pointer put back
(`freshness.stale_first_pointer`). Runs beside the publisher, on its event loop (the refresh and
the commits share each committer's ETag); a store that fails a refresh is logged and tried again
at the next one, never stopping the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from slime_stoa.protocol.store import StoreConfigError, StoreError

from .commit import Committer
from .freshness import REFRESH_S

log = logging.getLogger("stoa.pulse")


async def refresh_all(committers: Iterable[Committer]) -> int:
    """Re-sign each committer's pointer once; how many were re-signed. A store error is logged
    (the next round tries again); a wrong store configuration is raised."""
    done = 0
    for committer in committers:
        try:
            done += await committer.refresh()
        except StoreConfigError:
            raise
        except StoreError as exc:
            log.warning("run %s: could not re-sign the pointer (%s); trying again in %.0f s",
                        committer.layout.run, exc, REFRESH_S)
    return done


async def keep_pointers_fresh(
    committers: Callable[[], Iterable[Committer]], stop: asyncio.Event, every_s: float = REFRESH_S
) -> None:
    """Until `stop` is set: every `every_s`, `refresh_all(committers())` (read each round: the
    planes a publisher serves may change when it opens)."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        if not stop.is_set():
            await refresh_all(committers())
