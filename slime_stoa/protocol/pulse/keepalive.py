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

Given the publisher's chains (`PointerKeeper.of_publisher`), each round also keeps their live
chains whole after re-signing: the patches, version manifests and anchor a worker needs to reach
the head are put back when a bucket writer deletes or spoils them, or replaced by a fresh anchor
(`chain_keeper`; it needs the store wrapped by `kept_chain.kept_chain_store`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from slime_stoa.protocol.store import StoreConfigError, StoreError

from .chain import ChainPublisher
from .chain_keeper import keep_chains, publisher_chains
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
    chains: Callable[[], Iterable[ChainPublisher]] | None = None, on_round: Callable[[], None] | None = None,
) -> None:
    """Until `stop` is set: every `every_s` (and first at once with `at_once`),
    `refresh_all(committers())` then `keep_chains(chains())` when given (read each round: the
    planes a publisher serves may change when it opens), holding `lock` (the one the owner's
    publishes hold) if given, then `on_round()`. A round that fails is logged; the next one tries
    again."""
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
                if chains is not None:
                    await keep_chains(chains())
        except Exception as exc:  # a wrong store configuration, or a fault: logged, never the trainer's end
            log.error("could not re-sign the weight pointers or check their chains (%s: %s); trying again in %.0f s",
                      type(exc).__name__, exc, every_s)
        if on_round is not None:
            on_round()


def publisher_committers(publisher: Publisher) -> list[Committer]:
    """The committers of every chain `publisher` serves: its bf16 weights' and each quantized
    plane's (the planes are known once it has opened)."""
    return [publisher.weights.committer, *(chain.committer for chain in publisher.planes.values())]


class PointerKeeper:
    """One process's keepalive (module doc): `keep_pointers_fresh` as a task on the running loop
    from `start` (a first round at once) to `stop`; the owner holds `lock` around each publish.
    With `chains`, each round also keeps those chains whole (`chain_keeper`)."""

    def __init__(
        self, committers: Callable[[], Iterable[Committer]], *, every_s: float = REFRESH_S,
        chains: Callable[[], Iterable[ChainPublisher]] | None = None,
    ) -> None:
        if every_s <= 0:
            raise ValueError(f"the pointer refresh interval must be > 0 s, not {every_s}")
        self.committers = committers
        self.chains = chains
        self.every_s = every_s
        self.lock = asyncio.Lock()
        self.rounds = 0  # rounds ended (ok or logged)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def of_publisher(cls, publisher: Callable[[], Publisher | None], *, every_s: float = REFRESH_S) -> PointerKeeper:
        """The keeper of the pointers and chains of `publisher()` (read each round; None: nothing
        yet, e.g. before the owner opened it)."""

        def committers() -> list[Committer]:
            pub = publisher()
            return [] if pub is None else publisher_committers(pub)

        def chains() -> list[ChainPublisher]:
            pub = publisher()
            return [] if pub is None else publisher_chains(pub)

        return cls(committers, every_s=every_s, chains=chains)

    def _ended_round(self) -> None:
        self.rounds += 1

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start re-signing on the running loop (the one that owns the committers); again: nothing."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                keep_pointers_fresh(self.committers, self._stop, self.every_s, self.lock, at_once=True,
                                    chains=self.chains, on_round=self._ended_round),
                name="stoa-pointer-keeper",
            )

    async def stop(self) -> None:
        """Stop re-signing, after the round under way (if any) ends."""
        self._stop.set()
        if self._task is not None:
            await self._task
