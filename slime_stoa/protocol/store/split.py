"""Two stores seen as one: what workers write in one bucket, what the trainer writes in the other.

Least privilege for the fleet. A worker needs to read the weights, the run and its task data, and
to write its own rollout records and heartbeat, nothing else. With one bucket, every worker's
token can also write weights; with two, the worker holds a read-only token for the weights bucket
and a read-write token for the rollouts bucket, and the trainer a token for both.

`SplitStore` routes every key by the layout: keys under `runs/<run>/rollouts/`,
`runs/<run>/evals/` and `runs/<run>/workers/` (records and heartbeats, what workers write) go to
the `rollouts` store, everything else (run manifest, pointer, manifests, patches, anchors, task
data, the worker registry, trainer state) to the `weights` store. The keys are the same as in one
bucket, so nothing above the store changes. A listing whose prefix spans both (e.g. `runs/`)
merges the two in key order.
"""

from __future__ import annotations

import heapq
from collections.abc import AsyncGenerator

from ..layout import ROLLOUT_KINDS
from .base import GetResult, ObjectInfo, Payload, ServerDate, Store, check_key, check_prefix

#: The run sub-folders workers write (records of every kind, heartbeats): the rollouts store's.
WORKER_FOLDERS = (*ROLLOUT_KINDS.values(), "workers")


def routes_to_rollouts(key: str) -> bool:
    """True when `key` (a full key or a prefix) lies inside a run's workers-written folders."""
    parts = key.split("/", 3)
    return len(parts) >= 4 and parts[0] == "runs" and parts[2] in WORKER_FOLDERS


def _spans_rollouts(prefix: str) -> bool:
    """Whether a listing of `prefix` may reach keys of the rollouts store (it is not yet inside
    one run folder that is known to be the weights store's)."""
    parts = prefix.split("/")
    if len(parts) == 1:
        return "runs".startswith(parts[0])  # "", "r", ..., "runs"
    if parts[0] != "runs":
        return False
    if len(parts) == 2:
        return True  # "runs/<run, or the start of one>"
    if len(parts) == 3:  # "runs/<run>/<the start of a folder>"
        return any(name.startswith(parts[2]) for name in WORKER_FOLDERS)
    return parts[2] in WORKER_FOLDERS


class SplitStore(Store):
    """One `Store` over a weights store and a rollouts store (see the module docs)."""

    def __init__(self, weights: Store, rollouts: Store) -> None:
        self.weights = weights
        self.rollouts = rollouts
        self.url = f"{weights.url} + rollouts {rollouts.url}"

    def _route(self, key: str) -> Store:
        return self.rollouts if routes_to_rollouts(check_key(key)) else self.weights

    async def get(
        self, key: str, *, offset: int = 0, length: int | None = None, if_none_match: str | None = None
    ) -> GetResult | None:
        return await self._route(key).get(key, offset=offset, length=length, if_none_match=if_none_match)

    async def put(self, key: str, data: Payload, *, if_match: str | None = None) -> str:
        return await self._route(key).put(key, data, if_match=if_match)

    async def put_if_absent(self, key: str, data: Payload) -> str:
        return await self._route(key).put_if_absent(key, data)

    async def head(self, key: str) -> ObjectInfo:
        return await self._route(key).head(key)

    async def delete(self, key: str) -> None:
        await self._route(key).delete(key)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncGenerator[ObjectInfo, None]:
        check_prefix(prefix)
        if routes_to_rollouts(prefix):
            return self.rollouts.list(prefix, start_after=start_after)
        if not _spans_rollouts(prefix):
            return self.weights.list(prefix, start_after=start_after)
        return _merged(
            self.weights.list(prefix, start_after=start_after),
            self.rollouts.list(prefix, start_after=start_after),
        )

    def server_date(self) -> ServerDate | None:
        """The newer of the two stores' dates (both are servers' clocks; either will do)."""
        dates = [d for d in (self.rollouts.server_date(), self.weights.server_date()) if d is not None]
        return max(dates, key=lambda d: d.monotonic_s, default=None)

    async def close(self) -> None:
        try:
            await self.weights.close()
        finally:
            await self.rollouts.close()


async def _merged(*listings: AsyncGenerator[ObjectInfo, None]) -> AsyncGenerator[ObjectInfo, None]:
    """Merge key-ordered listings into one key-ordered listing (a key is in one of them only).
    The listings are closed however the merge ends (a reader may stop early)."""
    try:
        heads: list[tuple[str, int, ObjectInfo]] = []
        for i, listing in enumerate(listings):
            first = await anext(listing, None)
            if first is not None:
                heapq.heappush(heads, (first.key, i, first))
        while heads:
            _, i, info = heapq.heappop(heads)
            yield info
            following = await anext(listings[i], None)
            if following is not None:
                heapq.heappush(heads, (following.key, i, following))
    finally:
        for listing in listings:
            await listing.aclose()
