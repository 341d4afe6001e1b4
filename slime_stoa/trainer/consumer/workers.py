"""Who was last heard from: for the message of a consumer that waited in vain.

Two sources, both optional: the newest record key the consumer discovered from each worker, and
the heartbeat objects under `runs/<run>/workers/` (their modification time from one listing, and
for the few most recent ones their content: status, weight version, spool, last error). A run
may have no heartbeat at all, and a heartbeat that cannot be read or parsed is simply left out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from slime_stoa.protocol.heartbeat import Heartbeat, read_heartbeat
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import Store, StoreError

MAX_HEARTBEATS = 1000  # one LIST page: enough to name the most recent ones
SHOWN = 10


async def heartbeat_times(
    store: Store, run: str, *, limit: int = MAX_HEARTBEATS
) -> tuple[dict[str, float], str | None]:
    """({worker: last modified, seconds since the epoch}, error text or None). Never raises."""
    layout = RunLayout(run)
    prefix = layout.workers_prefix
    out: dict[str, float] = {}
    try:
        listing = store.list(prefix)
        async with contextlib.aclosing(listing):
            async for info in listing:
                name = info.key[len(prefix) :]
                if name.endswith(".json") and "/" not in name and info.last_modified is not None:
                    out[name[: -len(".json")]] = info.last_modified
                if len(out) >= limit:
                    break
    except StoreError as exc:
        return out, f"{type(exc).__name__}: {exc}"
    return out, None


def heartbeat_summary(beat: Heartbeat) -> str:
    """A few words from a heartbeat: status, weights held, spool, last error."""
    bits = [beat.status]
    if beat.version is not None:
        bits.append(f"v{beat.version}" + (f" of v{beat.pointer_version}" if beat.pointer_version is not None else ""))
    if beat.groups_spooled:
        bits.append(f"{beat.groups_spooled} groups spooled")
    if beat.errors:
        bits.append(f"{beat.errors} errors, last: {beat.last_error[:120]}")
    return ", ".join(bits)


async def heartbeat_summaries(store: Store, run: str, workers: list[str]) -> dict[str, str]:
    """{worker: heartbeat_summary} for `workers` whose heartbeat reads and parses. Never raises."""
    out = {}
    for worker in workers:
        try:
            beat = await read_heartbeat(store, run, worker)  # at most MAX_HEARTBEAT_BYTES + 1 bytes
        except (StoreError, ValueError):
            continue
        out[worker] = heartbeat_summary(beat)
    return out


def newest_first(last_record_ms: Mapping[str, int], heartbeats: Mapping[str, float]) -> list[str]:
    """Workers seen by record or heartbeat, most recently seen first."""

    def newest(worker: str) -> float:
        return max(last_record_ms.get(worker, -1) / 1000, heartbeats.get(worker, -1.0))

    return sorted(set(last_record_ms) | set(heartbeats), key=newest, reverse=True)


def _age(now: float, then: float) -> str:
    seconds = max(now - then, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def describe_workers(
    last_record_ms: Mapping[str, int],
    heartbeats: Mapping[str, float],
    *,
    now: float,
    heartbeat_error: str | None = None,
    summaries: Mapping[str, str] | None = None,
    shown: int = SHOWN,
) -> str:
    """One line naming the most recently seen workers (records and heartbeats), newest first;
    `summaries` adds what a worker's heartbeat says."""
    ranked = newest_first(last_record_ms, heartbeats)
    if not ranked:
        text = "no worker seen: no rollout record discovered and no heartbeat found"
        if heartbeat_error:
            text += f" (heartbeats could not be listed: {heartbeat_error})"
        return text + "; are workers running against this bucket and run?"

    parts = []
    for worker in ranked[:shown]:
        bits = []
        if worker in last_record_ms:
            bits.append(f"last record {_age(now, last_record_ms[worker] / 1000)}")
        if worker in heartbeats:
            bits.append(f"heartbeat {_age(now, heartbeats[worker])}")
        if summaries and worker in summaries:
            bits.append(summaries[worker])
        parts.append(f"{worker} ({', '.join(bits)})")
    more = f" and {len(ranked) - shown} more" if len(ranked) > shown else ""
    text = f"workers last seen, newest first: {'; '.join(parts)}{more}"
    if heartbeat_error:
        text += f" (heartbeats could not be listed: {heartbeat_error})"
    return text
