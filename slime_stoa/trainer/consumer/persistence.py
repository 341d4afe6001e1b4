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

With one bucket a worker's token can also overwrite or delete the state, its heads and the
worker registry. A trainer given a folder of its own (`SavedState.copies`, from
`ConsumerConfig.keep_dir`) keeps the signed bytes of each state it saved and of the newest
registry it verified (`slime_stoa.protocol.kept`), and never stops on what a writer did:

- a save that meets garbage, a forgery or an older state of its own where its state should be
  writes over it, copies or not: the trainer holds the state it saves (a genuine state saved
  after its own is another trainer: `StateConflict`; in an unsigned run any consumer state is);
- a read that finds the state gone, garbage, forged or older than the trainer's copy resumes
  from the copy and puts it back, with its head; the copy's sequence is the floor a state read
  back must reach, whatever heads the bucket lists;
- a registry gone, garbage or older than the copy (a rollback: the copy wins, so a revoked
  worker stays revoked) is put back on every read and save.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from slime_stoa.protocol.kept import TrainerCopies
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.registry import Registry, RegistryError, load_registry
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

log = logging.getLogger(__name__)

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


class UnusableState(ValueError):
    """The bucket's state object is not a consumer state of this run (garbage, too large, another
    run's)."""


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
        raise UnusableState(f"{exc} (in {store.url}): not a valid consumer state") from None
    assert result is not None
    try:
        doc = load_json(result.data, max_bytes=MAX_STATE_BYTES)
    except ValueError as exc:
        raise UnusableState(f"{key} in {store.url} is not a valid consumer state: {exc}") from None
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
        raise UnusableState(f"{key} in {store.url} is not a valid consumer state: {exc}") from None
    if state.run != run:
        raise UnusableState(f"{key} in {store.url} holds the state of run {state.run!r}, not {run!r}")
    return state, result.etag


def state_bytes(state: ConsumerState, key: SigningKey | None) -> bytes:
    """The object `write_state` writes: `state` as JSON, signed with `key` (the run key)."""
    doc = state.to_json() if key is None else sign_document(state.to_json(), key)
    return json.dumps(doc, separators=(",", ":")).encode()


def parse_state(data: bytes, run: str, keys: Iterable[PublicKey] | None) -> ConsumerState:
    """A consumer state object of `run` (with `keys`: signed by one of them); ValueError (or
    SignatureError) otherwise."""
    doc = load_json(data, max_bytes=MAX_STATE_BYTES)
    if keys is not None:
        verify_document(doc, list(keys), where=state_key(run))
    if isinstance(doc, dict):
        doc.pop(SIGNATURE_FIELD, None)
    state = ConsumerState.from_json(doc)
    if state.run != run:
        raise ValueError(f"the state of run {state.run!r}, not {run!r}")
    return state


async def write_state(store: Store, state: ConsumerState, etag: str | None, *, key: SigningKey | None = None) -> str:
    """Write `state` (signed with `key`, the run key) over the version with `etag` (None:
    create); returns the new ETag."""
    data = state_bytes(state, key)
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
    call runs through `retry` (store outages). With `copies` (signed runs), the trainer's own
    copies of its state and of the registry (see the module doc)."""

    def __init__(
        self,
        store: Store,
        run: str,
        *,
        retry: Callable[[Callable[[], Awaitable[Any]], str], Awaitable[Any]],
        key: SigningKey | None = None,
        trust: RunTrust | None = None,
        copies: TrainerCopies | None = None,
    ) -> None:
        self.store = store
        self.run = run
        self.retry = retry
        self.key = key
        self.trust = trust
        self.copies = copies if key is not None else None  # an unsigned trainer has nothing of its own to keep
        self.etag: str | None = None
        self.head: ConsumerHead | None = None  # the newest signed head read or written (signed runs)

    def _keys(self) -> list[PublicKey]:
        keys = [] if self.key is None else [self.key.public]
        return keys + (list(self.trust.keys) if self.trust is not None else [])

    async def read(self) -> ConsumerState | None:
        """The bucket's state, or None; remembers its ETag (also of an `UntrustedState`, so a
        save replaces the forgery) and, in a signed run, the newest head. `StateRollback` when the
        state is older than that head. With `copies`: the trainer's copy instead of a state that
        is gone, unusable or older, put back (see the module doc)."""
        kept = self._kept_state()
        if kept is not None:
            floor = ConsumerHead(kept.seq, kept.registry_serial)
            self.head = floor if self.head is None else max(self.head, floor)
        try:
            state, etag = await self.retry(self._read, f"reading the consumer state of run {self.run!r}")
        except UntrustedState as exc:
            self.etag = exc.etag
            if kept is None:
                raise
            state, etag = None, exc.etag
            await self._put_back(kept, f"was refused ({exc})")
        except ValueError as exc:  # not a consumer state at all (garbage)
            if kept is None:
                raise
            await self._put_back(kept, f"is not a consumer state ({exc})")
            state, etag = kept, self.etag
        else:
            self.etag = etag
        if kept is not None and (state is None or state.seq < kept.seq):
            await self._put_back(kept, "is gone" if state is None else f"is save {state.seq}, older than the trainer's {kept.seq}")
            state = kept
        await self._keep_registry()
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
        keys = self._keys()
        if self.trust is not None:
            await load_rotations(self.store, self.trust)
            keys = self._keys()
        head = await read_head(self.store, self.run, keys)
        if head is not None and (self.head is None or head > self.head):
            self.head = head
        if self.key is None:
            return await read_state(self.store, self.run)
        return await read_state(self.store, self.run, signed_by=keys)

    async def write(self, state: ConsumerState) -> int:
        """Write `state` by compare-and-swap (`StateConflict` if another trainer wrote since);
        signed, as the next save after the newest head, which it then writes. Returns the
        sequence number written. With `copies`, a writer's garbage, forgery or old copy where
        the state should be is written over, and the state saved is kept."""
        if self.key is not None:
            state = dataclasses.replace(state, seq=max(state.seq, self.head.seq if self.head else 0) + 1)
        try:
            self.etag = await self._cas(state)
        except StateConflict:
            # The trainer holds the state it writes: a writer's garbage, forgery or old copy is
            # written over (copies or not); only another trainer's newer state stops it.
            if not await self._not_another_trainers(state):
                raise
            self.etag = await self._cas(state)
        if self.key is not None:
            if self.copies is not None:
                self.copies.keep(state_key(self.run), state_bytes(state, self.key))
            await self._write_head(ConsumerHead(state.seq, state.registry_serial))
            await self._keep_registry()
        return state.seq

    async def _cas(self, state: ConsumerState) -> str:
        return await write_state_retried(
            self.store, state, self.etag,
            retry=lambda attempt: self.retry(attempt, f"saving the consumer state of run {self.run!r}"),
            key=self.key,
        )

    async def _write_head(self, head: ConsumerHead) -> None:
        key = self.key
        assert key is not None
        await self.retry(lambda: write_head(self.store, self.run, head, key), f"writing the consumer head of run {self.run!r}")
        self.head = head

    # -- the trainer's copies ---------------------------------------------------------------------
    def _kept_state(self) -> ConsumerState | None:
        """The trainer's copy of the last state it saved (its own disk: read, not judged)."""
        data = None if self.copies is None else self.copies.kept(state_key(self.run))
        return None if data is None else parse_state(data, self.run, None)

    async def _not_another_trainers(self, state: ConsumerState) -> bool:
        """After a lost compare-and-swap: True (and the ETag to write over remembered) unless the
        bucket holds a genuine state saved after the one being written (another trainer's)."""
        found = await self.retry(self._raw_state, f"reading the consumer state of run {self.run!r}")
        data, etag = found if found is not None else (None, None)
        why = "is gone"
        if data is not None:
            signed = self.key is not None or self.trust is not None
            try:
                theirs = parse_state(data, self.run, self._keys() if signed else None)
            except (ValueError, SignatureError, UnicodeDecodeError) as exc:
                why = f"was overwritten with an object this run's trainer did not write ({exc})"
            else:
                if not signed or theirs.seq >= state.seq:  # unsigned: no telling a writer from a trainer
                    return False
                why = f"was overwritten with the older save {theirs.seq}"
        log.warning("stoa: %s in %s %s; writing save %d over it", state_key(self.run), self.store.url, why, state.seq)
        self.etag = etag
        return True

    async def _raw_state(self) -> tuple[bytes, str] | None:
        try:
            got = await read_capped(self.store, state_key(self.run), MAX_STATE_BYTES)
        except NotFound:
            return None
        except TooLarge as exc:
            return b"", exc.etag
        assert got is not None
        return got.data, got.etag

    async def _put_back(self, kept: ConsumerState, why: str) -> None:
        """Write the trainer's copy `kept` over the bucket's state (`why` it is unusable) and
        its head over the bucket's heads."""
        assert self.copies is not None and self.key is not None
        found = await self.retry(self._raw_state, f"reading the consumer state of run {self.run!r}")
        self.etag = None if found is None else found[1]
        self.etag = await self._cas(kept)
        log.warning("stoa: %s in %s %s; put the trainer's own copy (save %d) back", state_key(self.run), self.store.url,
                    why, kept.seq)
        head = ConsumerHead(kept.seq, kept.registry_serial)
        bucket_head = await self.retry(lambda: read_head(self.store, self.run, self._keys()), "reading the consumer heads")
        if bucket_head is None or bucket_head < head:
            await self._write_head(head)

    async def _keep_registry(self) -> None:
        """Keep the bucket's registry when it verifies and is at least the trainer's copy; else
        put the copy back (gone, garbage, or an older one: the copy wins)."""
        if self.copies is None:
            return
        copies, where = self.copies, RunLayout(self.run).registry
        kept_bytes = copies.kept(where)
        kept = None if kept_bytes is None else load_registry(kept_bytes, run=self.run, run_key=self._keys())
        try:
            data: bytes | None = await self.retry(lambda: self.store.get_bytes(where), "reading the worker registry")
        except NotFound:
            data = None
        why = "is gone"
        if data is not None:
            try:
                found: Registry = load_registry(data, run=self.run, run_key=self._keys())
            except RegistryError as exc:
                why = f"does not verify ({exc})"
            else:
                if kept is None or found.serial >= kept.serial:
                    copies.keep(where, data)
                    return
                why = f"is serial {found.serial}, older than the trainer's {kept.serial}"
        if kept is not None:
            await self.retry(lambda: copies.put_back(self.store, where, why), "putting the worker registry back")
