"""The consumer's state in the bucket: `runs/<run>/trainer/consumer.json`, moved by compare-and-swap.

One trainer consumes a run. Its state object is created with put-if-absent and then replaced
only if its ETag did not move since this trainer read or wrote it; a second trainer (or a stale
one) gets `StateConflict` instead of silently forking the cursors.
"""

from __future__ import annotations

import json

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import NotFound, PreconditionFailed, Store

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
