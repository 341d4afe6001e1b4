"""Every small document a reader takes from the bucket, made oversize by an attacker with a bucket
token: each `Case` writes junk a megabyte past its reader's limit (at least 2 MiB) at the
document's key, runs the reader through a `ByteCounter`, and checks that it refused the object
in its usual way (a worker or trainer reports it and carries on), no read of it taking more
than `limit + 1` bytes (a reader that polls may read it again, each time as bounded). `tally` gives the security report's `oversize_tried` and
`max_bytes_read_over_limit`.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from slime_stoa.protocol import heartbeat as hb
from slime_stoa.protocol.eval_request import MAX_REQUEST_BYTES, get_request
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse import history
from slime_stoa.protocol.pulse.history import MalformedPointer
from slime_stoa.protocol.pulse.manifests import ManifestError
from slime_stoa.protocol.pulse.subscriber import Subscriber, SyncError
from slime_stoa.protocol.registry import MAX_REGISTRY_BYTES, RegistryError, read_registry
from slime_stoa.protocol.run_manifest import MAX_RUN_MANIFEST_BYTES, read_run_manifest
from slime_stoa.protocol.run_trust import MAX_ROTATION_BYTES, RunTrust, load_rotations
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import GetResult, ObjectInfo, Store
from slime_stoa.protocol.store.base import Payload
from slime_stoa.trainer.consumer.persistence import MAX_STATE_BYTES, read_state, state_key
from slime_stoa.trainer.tracking import read_fleet_metrics

RUN = "oversize"
LAYOUT = RunLayout(RUN)
ATTEMPT = "0123abcd"
WORKER = "mac-big-abc123"


class ByteCounter(Store):
    """Forwards to `inner` and counts the bytes the GETs returned, per key, in all (`read`) and
    the most one GET returned (`largest`). `listed_size`: the size listings report for every
    object (a listing that says an oversize object is small)."""

    def __init__(self, inner: Store, *, listed_size: int | None = None) -> None:
        self.inner, self.url, self.listed_size = inner, inner.url, listed_size
        self.read: Counter[str] = Counter()
        self.largest: Counter[str] = Counter()

    async def get(
        self, key: str, *, offset: int = 0, length: int | None = None, if_none_match: str | None = None
    ) -> GetResult | None:
        got = await self.inner.get(key, offset=offset, length=length, if_none_match=if_none_match)
        self.read[key] += 0 if got is None else len(got.data)
        self.largest[key] = max(self.largest[key], 0 if got is None else len(got.data))
        return got

    async def put(self, key: str, data: Payload, *, if_match: str | None = None) -> str:
        return await self.inner.put(key, data, if_match=if_match)

    async def put_if_absent(self, key: str, data: Payload) -> str:
        return await self.inner.put_if_absent(key, data)

    async def head(self, key: str) -> ObjectInfo:
        return await self.inner.head(key)

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncGenerator[ObjectInfo, None]:
        listing = self.inner.list(prefix, start_after=start_after)
        async with contextlib.aclosing(listing):
            async for info in listing:
                yield info if self.listed_size is None else ObjectInfo(info.key, self.listed_size, info.etag)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)


def junk(limit: int) -> bytes:
    """Bytes a megabyte past `limit` (at least 2 MiB), not JSON."""
    return b"\xff" * max(limit + (1 << 20), 2 << 20)


Check = Callable[[ByteCounter], Awaitable[None]]  # raises AssertionError unless refused as expected


@dataclass(frozen=True)
class Case:
    name: str
    key: str
    limit: int
    check: Check
    listed_size: int | None = None  # the size the listing claims (None: the true one)


async def _raises(call: Awaitable[object], kinds: type[BaseException], text: str = "over the limit") -> None:
    try:
        await call
    except kinds as exc:
        assert text in str(exc), exc
        return
    raise AssertionError(f"not refused: {call}")


async def _subscriber_poll(store: ByteCounter) -> None:
    sub = Subscriber(store, RUN)
    await _raises(sub.poll(), SyncError)
    assert await sub.poll() is None  # the same refused pointer is reported once (each poll reads at most the limit)


async def _pointer(store: ByteCounter) -> None:
    await _raises(history.read_pointer(store, RUN), MalformedPointer)


async def _version_manifest(store: ByteCounter) -> None:
    await _raises(history.read_manifest(store, LAYOUT.version_manifest(1, ATTEMPT)), ManifestError)


async def _anchor_manifest(store: ByteCounter) -> None:
    await _raises(history.read_anchor_manifest(store, LAYOUT.anchor_manifest(0, ATTEMPT)), ManifestError)


async def _run_manifest(store: ByteCounter) -> None:
    await _raises(read_run_manifest(store, RUN), ValueError)


async def _registry(store: ByteCounter) -> None:
    await _raises(read_registry(store, RUN, SigningKey.generate().public), RegistryError)


async def _rotation(store: ByteCounter) -> None:
    trust = RunTrust(RUN, SigningKey.generate().public)
    assert await load_rotations(store, trust) == 0  # passed over: no rotation, unread past its cap
    assert trust.rotations == 0 and trust.passed_over is not None


async def _eval_request(store: ByteCounter) -> None:
    await _raises(get_request(store, LAYOUT.eval_request(1, "test")), ValueError)


async def _consumer_state(store: ByteCounter) -> None:
    await _raises(read_state(store, RUN), ValueError)


async def _heartbeat(store: ByteCounter) -> None:
    await _raises(hb.read_heartbeat(store, RUN, WORKER), ValueError)


async def _good_heartbeat(store: Store) -> None:
    beat = hb.Heartbeat(worker_id="mac-ok-abc123", name="ok", status="generating")
    await store.put(LAYOUT.heartbeat(beat.worker_id), beat.to_bytes())


async def _heartbeats(store: ByteCounter) -> None:
    await _good_heartbeat(store)
    beats, bad = await hb.read_heartbeats(store, RUN)
    assert [b.worker_id for b in beats] == ["mac-ok-abc123"] and bad == 1, (beats, bad)


async def _tracking(store: ByteCounter) -> None:
    await _good_heartbeat(store)
    metrics = await read_fleet_metrics(store, RUN, now=0.0)
    assert metrics["rollout/stoa_fleet_bad_heartbeats"] == 1.0 and "worker/mac-ok-abc123/running" in metrics, metrics


def cases() -> list[Case]:
    beat = LAYOUT.heartbeat(WORKER)
    return [
        Case("subscriber poll (worker)", LAYOUT.pointer, history.MAX_POINTER_BYTES, _subscriber_poll),
        Case("pointer", LAYOUT.pointer, history.MAX_POINTER_BYTES, _pointer),
        Case("version manifest", LAYOUT.version_manifest(1, ATTEMPT), history.MAX_VERSION_MANIFEST_BYTES, _version_manifest),
        Case("anchor manifest", LAYOUT.anchor_manifest(0, ATTEMPT), history.MAX_ANCHOR_MANIFEST_BYTES, _anchor_manifest),
        Case("run manifest", LAYOUT.run_manifest, MAX_RUN_MANIFEST_BYTES, _run_manifest),
        Case("registry", LAYOUT.registry, MAX_REGISTRY_BYTES, _registry),
        Case("key rotation", LAYOUT.key_rotation(1), MAX_ROTATION_BYTES, _rotation),
        Case("eval request", LAYOUT.eval_request(1, "test"), MAX_REQUEST_BYTES, _eval_request),
        Case("consumer state", state_key(RUN), MAX_STATE_BYTES, _consumer_state),
        Case("heartbeat", beat, hb.MAX_HEARTBEAT_BYTES, _heartbeat),
        # The listing claims the heartbeat is small, so it is read (and stopped at the limit).
        Case("heartbeats (fleet)", beat, hb.MAX_HEARTBEAT_BYTES, _heartbeats, listed_size=100),
        Case("heartbeats (trainer tracking)", beat, hb.MAX_HEARTBEAT_BYTES, _tracking, listed_size=100),
    ]


@dataclass(frozen=True)
class Outcome:
    refused: bool
    read: int  # bytes read of the oversize object
    over: int  # bytes one read took past limit + 1 (0: every read stopped in time)


async def run_case(store: Store, case: Case) -> Outcome:
    """Write the case's junk into `store` (empty), run its reader; whether it refused as
    expected, and how many bytes of the junk it read."""
    await store.put(case.key, junk(case.limit))
    counter = ByteCounter(store, listed_size=case.listed_size)
    try:
        await case.check(counter)
        refused = True
    except AssertionError:
        refused = False
    return Outcome(refused, counter.read[case.key], max(counter.largest[case.key] - (case.limit + 1), 0))


async def tally(fresh: Callable[[str], Awaitable[Store]]) -> dict[str, int]:
    """`oversize_tried`, `oversize_refused`, `max_bytes_read_over_limit` over every case, each in
    a fresh empty store (`fresh(name)`)."""
    outcomes = [await run_case(await fresh(f"oversize-{i}"), case) for i, case in enumerate(cases())]
    return {
        "oversize_tried": len(outcomes),
        "oversize_refused": sum(o.refused for o in outcomes),
        "max_bytes_read_over_limit": max((o.over for o in outcomes), default=0),
    }


__all__ = ["ByteCounter", "Case", "Outcome", "cases", "junk", "run_case", "tally"]
