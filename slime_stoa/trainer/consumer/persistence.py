"""The consumer's state in the bucket: `runs/<run>/trainer/consumer.json`, moved by compare-and-swap.

One trainer consumes a run. Its state object is created with put-if-absent and then replaced
only if its ETag did not move since this trainer read or wrote it; a second trainer (or a stale
one) gets `StateConflict` instead of silently forking the cursors.

`write_state_retried` is the write that outlasts a store outage: a retry after a try whose
answer was lost (the write may have landed) that then meets a "conflict" checks whether the
bucket holds exactly this state, i.e. our own earlier try, and takes it as done.

A trainer holding the run key signs the state it writes (`sign_document`) and reads back only a
state signed by a run key (`UntrustedState` otherwise): with one bucket every worker's token can
write this object, and a forged cursor or reuse ledger would make the trainer skip or re-use
groups. Each signed save numbers the state and then writes a signed head (`heads`); a state
read back below the newest head is an old genuine state put back (`StateRollback`, refused).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_trust import RunTrust, load_rotations
from slime_stoa.protocol.signing import (
    SIGNATURE_FIELD,
    PublicKey,
    SignatureError,
    SigningKey,
    sign_document,
    verify_document,
)
from slime_stoa.protocol.store import NotFound, PreconditionFailed, Store, StoreUnavailable
from slime_stoa.protocol.store.capped import TooLarge, read_capped
from slime_stoa.protocol.strict_json import load_json

from .heads import ConsumerHead, heads_prefix, read_head, write_head
from .state import ConsumerState

STATE_FILE = "consumer.json"
#: Largest consumer state read back: the replay ledger takes under 3 MiB, the rest grows with the
#: records landing within one sweep window (about 60 bytes each).
MAX_STATE_BYTES = 64 << 20


class StateConflict(RuntimeError):
    """The state object moved under us: another trainer is consuming this run."""


class UntrustedState(ValueError):
    """The bucket's state is not signed by a key of the run (a forgery, or written unsigned).
    `etag` names the object, so a trainer resuming from elsewhere can replace it."""

    def __init__(self, message: str, etag: str) -> None:
        super().__init__(message)
        self.etag = etag


class StateRollback(UntrustedState):
    """The bucket's state is genuine but older than the newest signed head: an old copy put back."""


def state_key(run: str) -> str:
    return RunLayout(run).trainer_file(STATE_FILE)


async def read_state(
    store: Store, run: str, *, signed_by: Iterable[PublicKey] | None = None
) -> tuple[ConsumerState | None, str | None]:
    """(state, etag) from the bucket, or (None, None) when the run has none yet.
    ValueError if the object is not a valid consumer state of this run (or is larger than
    MAX_STATE_BYTES: read no further); with `signed_by` (the run's keys), UntrustedState unless
    one of them signed it."""
    key = state_key(run)
    try:
        result = await read_capped(store, key, MAX_STATE_BYTES)
    except NotFound:
        return None, None
    except TooLarge as exc:
        raise ValueError(f"{exc} (in {store.url}): not a valid consumer state") from None
    assert result is not None
    try:
        doc = load_json(result.data, max_bytes=MAX_STATE_BYTES)
    except ValueError as exc:
        raise ValueError(f"{key} in {store.url} is not a valid consumer state: {exc}") from None
    if signed_by is not None:
        try:
            verify_document(doc, list(signed_by), where=key)
        except SignatureError as exc:
            raise UntrustedState(
                f"{exc}: the trainer state in {store.url} was not written by this run's trainer (a forgery, "
                f"or a trainer without the run key); resume from slime's checkpoint, or delete {key} to "
                f"start consuming afresh",
                result.etag,
            ) from None
    if isinstance(doc, dict):
        doc.pop(SIGNATURE_FIELD, None)
    try:
        state = ConsumerState.from_json(doc)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{key} in {store.url} is not a valid consumer state: {exc}") from None
    if state.run != run:
        raise ValueError(f"{key} in {store.url} holds the state of run {state.run!r}, not {run!r}")
    return state, result.etag


async def write_state(store: Store, state: ConsumerState, etag: str | None, *, key: SigningKey | None = None) -> str:
    """Write `state` (signed with `key`, the run key) over the version with `etag` (None:
    create); returns the new ETag."""
    doc = state.to_json() if key is None else sign_document(state.to_json(), key)
    data = json.dumps(doc, separators=(",", ":")).encode()
    key_name = state_key(state.run)
    try:
        return await store.cas(key_name, data, etag)
    except PreconditionFailed:
        raise StateConflict(
            f"{key_name} in {store.url} changed since this trainer last read or wrote it: another "
            f"trainer is consuming run {state.run!r} (stop it), or restart this one to resume "
            f"from the bucket's state"
        ) from None


async def write_state_retried(
    store: Store,
    state: ConsumerState,
    etag: str | None,
    *,
    retry: Callable[[Callable[[], Awaitable[str]]], Awaitable[str]],
    key: SigningKey | None = None,
) -> str:
    """`write_state`, with each try run by `retry` (e.g. `through_outages`); returns the new ETag.

    A `StateConflict` after a try failed as `StoreUnavailable` is checked: if the bucket holds
    exactly `state`, that try landed and its answer was lost, so the write is done."""
    ambiguous = False

    async def attempt() -> str:
        nonlocal ambiguous
        try:
            return await write_state(store, state, etag, key=key)
        except StoreUnavailable:
            ambiguous = True
            raise
        except StateConflict:
            if ambiguous:
                current, current_etag = await read_state(store, state.run, signed_by=None if key is None else [key.public])
                if current == state and current_etag is not None:
                    return current_etag
            raise

    return await retry(attempt)


class SavedState:
    """One consumer's state in the bucket: the ETag it last read or wrote (for the next
    compare-and-swap), the run key that signs what it writes (`key`), and the keys a state read
    back must be signed by (`key`'s, and with `trust` the run's pinned and rotated keys). Every
    call runs through `retry` (store outages)."""

    def __init__(
        self,
        store: Store,
        run: str,
        *,
        retry: Callable[[Callable[[], Awaitable[Any]], str], Awaitable[Any]],
        key: SigningKey | None = None,
        trust: RunTrust | None = None,
    ) -> None:
        self.store = store
        self.run = run
        self.retry = retry
        self.key = key
        self.trust = trust
        self.etag: str | None = None
        self.head: ConsumerHead | None = None  # the newest signed head read or written (signed runs)

    async def read(self) -> ConsumerState | None:
        """The bucket's state, or None; remembers its ETag (also of an `UntrustedState`, so a
        save replaces the forgery) and, in a signed run, the newest head. `StateRollback` when the
        state is older than that head."""
        try:
            state, etag = await self.retry(self._read, f"reading the consumer state of run {self.run!r}")
        except UntrustedState as exc:
            self.etag = exc.etag
            raise
        self.etag = etag
        head = self.head
        if state is not None and head is not None and state.seq < head.seq:
            raise StateRollback(
                f"{state_key(self.run)} in {self.store.url} is save {state.seq} of the consumer state, older than its "
                f"newest signed head ({head.seq}): an old copy put back; resume from slime's checkpoint, or delete "
                f"the heads under {heads_prefix(self.run)} to accept it",
                etag or "",
            )
        return state

    async def _read(self) -> tuple[ConsumerState | None, str | None]:
        if self.key is None and self.trust is None:
            return await read_state(self.store, self.run)
        keys = [] if self.key is None else [self.key.public]
        if self.trust is not None:
            await load_rotations(self.store, self.trust)
            keys += self.trust.keys
        head = await read_head(self.store, self.run, keys)
        if head is not None and (self.head is None or head > self.head):
            self.head = head
        if self.key is None:
            return await read_state(self.store, self.run)
        return await read_state(self.store, self.run, signed_by=keys)

    async def write(self, state: ConsumerState) -> int:
        """Write `state` by compare-and-swap (`StateConflict` if another trainer wrote since);
        signed, as the next save after the newest head, which it then writes. Returns the
        sequence number written."""
        if self.key is not None:
            state = dataclasses.replace(state, seq=max(state.seq, self.head.seq if self.head else 0) + 1)
        self.etag = await write_state_retried(
            self.store, state, self.etag,
            retry=lambda attempt: self.retry(attempt, f"saving the consumer state of run {self.run!r}"),
            key=self.key,
        )
        if self.key is not None:
            head = ConsumerHead(state.seq, state.registry_serial)
            key = self.key
            await self.retry(lambda: write_head(self.store, self.run, head, key), f"writing the consumer head of run {self.run!r}")
            self.head = head
        return state.seq
