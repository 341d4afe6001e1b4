"""A live trainer keeps its pointers fresh: every `freshness.REFRESH_S` it re-signs the pointer of
each chain it publishes (the bf16 weights' and each quantized plane's: `Committer.refresh`), so
a worker joining for the first time can tell it from an old pointer put back
(`freshness.stale_first_pointer`).

Every trainer process that publishes runs one `PointerKeeper`, on the event loop that owns its
committers, from the moment its publisher has opened (resumed from the bucket's pointer, so a
trainer that publishes nothing in this session keeps the existing pointer fresh too) until it
stops. Its first round is at once: a trainer restarted after a long stop resumes from a pointer
that may be too old for new workers already, and they should not wait one interval for it. The refresh and the commits share each committer's ETag: the owner holds the keeper's
`lock` around each publish, and each round holds it too, so a refresh never interleaves with a
commit (it would make the commit's compare-and-swap lose and write over its own refreshed
pointer). A store that fails a refresh is logged and tried again at the next round; nothing a
round raises stops the keeper or the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from slime_stoa.protocol.store import StoreConfigError, StoreError

from .commit import Committer
from .freshness import REFRESH_S
from .publisher import Publisher

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
    committers: Callable[[], Iterable[Committer]], stop: asyncio.Event, every_s: float = REFRESH_S,
    lock: asyncio.Lock | None = None, *, at_once: bool = False,
) -> None:
    """Until `stop` is set: every `every_s` (and first at once with `at_once`),
    `refresh_all(committers())` (read each round: the planes a publisher serves may change when
    it opens), holding `lock` (the one the owner's publishes hold) if given. A round that fails
    is logged; the next one tries again."""
    wait_s = 0.0 if at_once else every_s
    while not stop.is_set():
        if wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait_s)
        wait_s = every_s
        if stop.is_set():
            break
        try:
            async with lock or contextlib.nullcontext():
                await refresh_all(committers())
        except Exception as exc:  # a wrong store configuration, or a fault: logged, never the trainer's end
            log.error("could not re-sign the weight pointers (%s: %s); trying again in %.0f s",
                      type(exc).__name__, exc, every_s)


def publisher_committers(publisher: Publisher) -> list[Committer]:
    """The committers of every chain `publisher` serves: its bf16 weights' and each quantized
    plane's (the planes are known once it has opened)."""
    return [publisher.weights.committer, *(chain.committer for chain in publisher.planes.values())]


class PointerKeeper:
    """One process's keepalive (module doc): `keep_pointers_fresh` as a task on the running loop
    from `start` (a first round at once) to `stop`; the owner holds `lock` around each publish."""

    def __init__(self, committers: Callable[[], Iterable[Committer]], *, every_s: float = REFRESH_S) -> None:
        if every_s <= 0:
            raise ValueError(f"the pointer refresh interval must be > 0 s, not {every_s}")
        self.committers = committers
        self.every_s = every_s
        self.lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start re-signing on the running loop (the one that owns the committers); again: nothing."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                keep_pointers_fresh(self.committers, self._stop, self.every_s, self.lock, at_once=True),
                name="stoa-pointer-keeper",
            )

    async def stop(self) -> None:
        """Stop re-signing, after the round under way (if any) ends."""
        self._stop.set()
        if self._task is not None:
            await self._task
