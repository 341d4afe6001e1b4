"""The consumer's state in the bucket: `runs/<run>/trainer/consumer.json`, moved by compare-and-swap.

One trainer consumes a run. Its state object is created with put-if-absent and then replaced
only if its ETag did not move since this trainer read or wrote it; a second trainer (or a stale
one) gets `StateConflict` instead of silently forking the cursors.

`write_state_retried` is the write that outlasts a store outage: a retry after a try whose
answer was lost (the write may have landed) that then meets a "conflict" checks whether the
bucket holds exactly this state, i.e. our own earlier try, and takes it as done.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import NotFound, PreconditionFailed, Store, StoreUnavailable

from .state import ConsumerState

STATE_FILE = "consumer.json"


class StateConflict(RuntimeError):
    """The state object moved under us: another trainer is consuming this run."""


def state_key(run: str) -> str:
    return RunLayout(run).trainer_file(STATE_FILE)


async def read_state(store: Store, run: str) -> tuple[ConsumerState | None, str | None]:
    """(state, etag) from the bucket, or (None, None) when the run has none yet.
    ValueError if the object is not a valid consumer state of this run."""
    key = state_key(run)
    try:
        result = await store.get(key)
    except NotFound:
        return None, None
    assert result is not None
    try:
        state = ConsumerState.from_json(json.loads(result.data))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{key} in {store.url} is not a valid consumer state: {exc}") from None
    if state.run != run:
        raise ValueError(f"{key} in {store.url} holds the state of run {state.run!r}, not {run!r}")
    return state, result.etag


async def write_state(store: Store, state: ConsumerState, etag: str | None) -> str:
    """Write `state` over the version with `etag` (None: create); returns the new ETag."""
    key = state_key(state.run)
    data = json.dumps(state.to_json(), separators=(",", ":")).encode()
    try:
        return await store.cas(key, data, etag)
    except PreconditionFailed:
        raise StateConflict(
            f"{key} in {store.url} changed since this trainer last read or wrote it: another "
            f"trainer is consuming run {state.run!r} (stop it), or restart this one to resume "
            f"from the bucket's state"
        ) from None


async def write_state_retried(
    store: Store,
    state: ConsumerState,
    etag: str | None,
    *,
    retry: Callable[[Callable[[], Awaitable[str]]], Awaitable[str]],
) -> str:
    """`write_state`, with each try run by `retry` (e.g. `through_outages`); returns the new ETag.

    A `StateConflict` after a try failed as `StoreUnavailable` is checked: if the bucket holds
    exactly `state`, that try landed and its answer was lost, so the write is done."""
    ambiguous = False

    async def attempt() -> str:
        nonlocal ambiguous
        try:
            return await write_state(store, state, etag)
        except StoreUnavailable:
            ambiguous = True
            raise
        except StateConflict:
            if ambiguous:
                current, current_etag = await read_state(store, state.run)
                if current == state and current_etag is not None:
                    return current_etag
            raise

    return await retry(attempt)
