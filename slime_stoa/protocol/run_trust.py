"""Which run keys a reader trusts, and for which weight versions (signed weights).

A reader pins the run's first public key (the run manifest's `run_key`, pinned by a worker at
`macd join`). The trainer may rotate it: `runs/<run>/keys/<seq>.json` (seq 1, 2, ...), each signed
by the key before it, names the new key and `from_version`. The old key signs the documents of
versions up to `from_version`, the new one every later version; the pointer is always signed by
the newest key (a rotation re-signs the current pointer with the new key). A document at the
next rotation's key that the newest key did not sign is passed over (a bucket writer's: see
`load_rotations`); one it signed that skips a number or goes back in versions is refused: the
reader keeps the keys it has.

A rotation document also carries the new key's acceptance (`accepted`: a document the new key
signs, naming the run, the rotation's number and the key before it). A reader that pinned the
run's first key needs none of it. A trainer restarted with a later key does: it knows only its own
key, and the first key is what run.json says, which a bucket writer can replace together with the
rotation naming its key (a manifest of the writer's key, and a rotation from that key to the
trainer's, which any key can sign). Following the acceptances back from its own key
(`vouched_first_key`), each key vouches for the one before it, down to the first: a chain no one
without those keys can forge.

`RunTrust` is pure: it checks documents and learns rotation documents it is given;
`load_rotations` reads the rotations from the bucket (the IO edge). Content hashes (`sha256`
members of the signed manifests) are checked with `content_hash`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .kept import Copies, put_back_changed
from .layout import RunLayout, check_name
from .run_manifest import RunNotFound, read_run_manifest
from .signing import (
    SIGNATURE_FIELD,
    PublicKey,
    SignatureError,
    SigningKey,
    canonical_json,
    document_key_id,
    sign_document,
    verify_document,
)
from .store import NotFound, Store
from .store.capped import TooLarge, read_capped_bytes
from .strict_json import load_json

log = logging.getLogger("stoa.trust")

ROTATION_FORMAT = "stoa.key-rotation/1"
ACCEPTANCE_FORMAT = "stoa.key-acceptance/1"
MAX_ROTATIONS = 1000  # a reader stops reading rotation documents after this many
MAX_ROTATION_BYTES = 16 << 10  # a rotation document is about 400 bytes


class Untrusted(ValueError):
    """An object is refused: its signature or content hash does not check. `key`: the object's key."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class RunKeyRefused(Untrusted):
    """A reader refuses the run manifest: it is unsigned, or signed by another key, while the
    reader pinned a run key or holds a worker key (a downgrade or a re-keyed run)."""


class ContentMismatch(Untrusted):
    """A patch object or anchor file's bytes do not hash to what its signed manifest says."""


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """The content hash signed manifests carry for every patch object and anchor file."""
    return hashlib.sha256(data).hexdigest()


def check_content(data: bytes | bytearray | memoryview, expected: str | None, key: str) -> None:
    """ContentMismatch unless `data` hashes to `expected` (nothing to check when None)."""
    if expected is not None and content_hash(data) != expected:
        raise ContentMismatch(f"{key}: content does not match the sha256 digest its manifest signs", key)


@dataclass(frozen=True, slots=True)
class _Epoch:
    key: PublicKey
    after: int  # signs the documents of versions > after (the first key: -1, every version)
    vouches: bool = True  # the key accepted the key before it (the first key: nothing before it)


class RunTrust:
    """The pinned run key and the keys learned since through verified rotations."""

    def __init__(self, run: str, pinned: PublicKey) -> None:
        self.run = check_name("run", run)
        self._epochs = [_Epoch(pinned, -1)]
        self.loaded = False  # whether `load_rotations` has read the bucket's rotations yet
        self.passed_over: tuple[str, str] | None = None  # the last junk rotation `load_rotations` warned about

    @classmethod
    def from_text(cls, run: str, key_text: str) -> RunTrust:
        """A trust pinned to `ed25519:...` public key text (ValueError if it does not parse)."""
        return cls(run, PublicKey.from_text(key_text))

    @property
    def pinned(self) -> PublicKey:
        return self._epochs[0].key

    @property
    def newest(self) -> PublicKey:
        return self._epochs[-1].key

    @property
    def rotations(self) -> int:
        """Rotations learned (the next rotation document expected is number rotations + 1)."""
        return len(self._epochs) - 1

    @property
    def keys(self) -> tuple[PublicKey, ...]:
        """Every run key this trust holds, the pinned one first (the worker registry may be signed
        by any of them: a registry written before a rotation stays valid)."""
        return tuple(e.key for e in self._epochs)

    def knows(self, key_id: str | None) -> bool:
        return any(e.key.key_id == key_id for e in self._epochs)

    def vouched_back_from(self, key: PublicKey) -> bool:
        """Whether `key` is one of the run's keys and it and every key before it accepted the key
        before it (their rotations carry the new key's acceptance), so that `key` vouches for the
        pinned first key."""
        for epoch in self._epochs:
            if not epoch.vouches:
                return False
            if epoch.key == key:
                return True
        return False

    def key_for(self, version: int | None) -> PublicKey:
        """The key that must sign a document of `version` (None: the pointer, the newest key)."""
        if version is None:
            return self.newest
        return next(e.key for e in reversed(self._epochs) if e.after < version)

    def verify(self, doc: Any, where: str, version: int | None = None) -> PublicKey:
        """Untrusted unless `doc` is signed by the key for `version` (None: the newest key)."""
        try:
            return verify_document(doc, self.key_for(version), where=where)
        except SignatureError as exc:
            raise Untrusted(str(exc), where) from None

    def learn(self, doc: Any, where: str) -> PublicKey:
        """Accept rotation document `doc` (the next in sequence) and return its new key.
        Untrusted when it is not signed by the current newest key or does not follow the last."""
        seq = self.rotations + 1
        try:
            verify_document(doc, self.newest, where=where)
        except SignatureError as exc:
            raise Untrusted(str(exc), where) from None
        assert isinstance(doc, Mapping)
        key_text, after = doc.get("key"), doc.get("from_version")
        if doc.get("format") != ROTATION_FORMAT or doc.get("run") != self.run or doc.get("seq") != seq:
            raise Untrusted(f"{where}: not rotation {seq} of run {self.run!r}", where)
        if isinstance(after, bool) or not isinstance(after, int) or after < self._epochs[-1].after:
            raise Untrusted(f"{where}: from_version {after!r} goes back before v{self._epochs[-1].after}", where)
        try:
            key = PublicKey.from_text(key_text)
        except ValueError as exc:
            raise Untrusted(f"{where}: {exc}", where) from None
        if self.knows(key.key_id):
            raise Untrusted(f"{where}: key {key.key_id} was already a run key", where)
        self._epochs.append(_Epoch(key, after, vouches=_accepts(doc, key, self.newest, self.run, seq, where)))
        return key


def _accepts(doc: Mapping[str, Any], new: PublicKey, previous: PublicKey, run: str, seq: int, where: str) -> bool:
    """Whether rotation `doc` carries `new`'s acceptance of rotation `seq` from `previous`; False
    when it carries none (written by an older stoa), Untrusted when it carries another."""
    accepted = doc.get("accepted")
    if accepted is None:
        return False
    try:
        verify_document(accepted, new, where=f"{where}: accepted")
    except SignatureError as exc:
        raise Untrusted(str(exc), where) from None
    if accepted != {**_acceptance_body(run, seq, new, previous), SIGNATURE_FIELD: accepted[SIGNATURE_FIELD]}:
        raise Untrusted(f"{where}: the new key's acceptance names another rotation", where)
    return True


def _acceptance_body(run: str, seq: int, new: PublicKey, previous: PublicKey) -> dict[str, Any]:
    return {"format": ACCEPTANCE_FORMAT, "run": run, "seq": seq, "key": new.to_text(), "previous": previous.to_text()}


def run_key_refusal(run: str, found: str | None, expected: str | None, *, holds_worker_key: bool) -> str | None:
    """Why a reader refuses a run manifest carrying run key `found` (None: unsigned), or None to
    accept it. `expected`: the run key the reader pinned (at `macd join`, or the first one it
    trusted); `holds_worker_key`: the reader signs records, so the run it joined is signed."""
    if expected is not None:
        if found == expected:
            return None
        pinned = PublicKey.from_text(expected).key_id
        if found is None:
            return f"run {run!r}: run.json is unsigned, this worker pinned run key {pinned}: refusing a downgraded run"
        return (
            f"run {run!r}: run.json names run key {_key_id(found)}, this worker pinned {pinned}: refusing a re-keyed "
            f"run (if the run was re-created on purpose, join it again with its new run key)"
        )
    if found is None and holds_worker_key:
        return f"run {run!r}: run.json is unsigned but this worker holds a worker key (a signed run's): refusing a downgraded run"
    return None


def _key_id(text: str) -> str:
    try:
        return PublicKey.from_text(text).key_id
    except ValueError:
        return "(malformed)"


def rotation_document(
    run: str, seq: int, new: SigningKey | PublicKey, from_version: int, old: SigningKey
) -> dict[str, Any]:
    """Rotation `seq` of `run`, signed by `old`: `new` signs every version after `from_version`.
    Given `new`'s private half, the document carries its acceptance (see the module doc); a public
    key alone gives one without (as an older stoa wrote them)."""
    if seq < 1 or from_version < -1:
        raise ValueError("a rotation has seq >= 1 and from_version >= -1")
    public = new.public if isinstance(new, SigningKey) else new
    doc: dict[str, Any] = {"format": ROTATION_FORMAT, "run": run, "seq": seq, "key": public.to_text(),
                           "from_version": from_version, "created_at": time.time()}
    if isinstance(new, SigningKey):
        doc["accepted"] = sign_document(_acceptance_body(run, seq, public, old.public), new)
    return sign_document(doc, old)


def rotation_bytes(doc: Mapping[str, Any]) -> bytes:
    return canonical_json(doc)


def signer_of(data: bytes) -> str | None:
    """The key id a JSON document's signature names (None if it is not a signed JSON object)."""
    try:
        return document_key_id(load_json(data))
    except ValueError:
        return None


async def read_rotation(store: Store, key: str) -> tuple[bytes, Any]:
    """The bytes of the rotation document at `key` and its parsed JSON, read no further than
    MAX_ROTATION_BYTES; NotFound, TooLarge, or ValueError when it is not JSON. Nothing checked."""
    data = await read_capped_bytes(store, key, MAX_ROTATION_BYTES)
    return data, load_json(data, max_bytes=MAX_ROTATION_BYTES)


async def load_rotations(store: Store, trust: RunTrust) -> int:
    """Learn the run's rotation documents after those `trust` knows; returns how many it learned.
    Stops at the first one missing, and at the first one that is not a document the newest key
    signed: a genuine rotation always is, so anything else there is a bucket writer's, passed
    over with a warning (raising would let one junk object stop every reader of the run).
    Untrusted (the trust keeps what it learned before) at one the newest key signed that is not
    the next rotation (the key holder's own mistake)."""
    layout, learned = RunLayout(trust.run), 0
    while trust.rotations < MAX_ROTATIONS:
        key = layout.key_rotation(trust.rotations + 1)
        try:
            _, doc = await read_rotation(store, key)
            verify_document(doc, trust.newest, where=key)
        except NotFound:
            break
        except (TooLarge, ValueError) as exc:  # SignatureError is a ValueError
            if trust.passed_over != (key, str(exc)):  # once, not at every read
                trust.passed_over = (key, str(exc))
                log.warning("run %s: %s is not a rotation of the run (%s): passed over", trust.run, key, exc)
            break
        trust.learn(doc, key)
        learned += 1
    trust.loaded = True
    return learned


class Unvouched(Untrusted):
    """A rotation names the key, but the rotations before it carry no acceptance by their new keys
    (written by an older stoa): the key cannot vouch for the run's first key."""


async def vouched_first_key(store: Store, run: str, key: PublicKey) -> PublicKey:
    """The run's first key as `key` vouches for it, reading no run manifest: `key` itself when no
    rotation names it (it is the run's first key, or none of the run's: a caller compares it with
    what run.json names); else the first key that the acceptances of the rotations up to the one
    naming `key` lead back to (Unvouched when one of them carries none; Untrusted when one does
    not verify)."""
    layout, named = RunLayout(run), None
    docs: list[tuple[str, Any]] = []
    while named is None and len(docs) < MAX_ROTATIONS:
        where = layout.key_rotation(len(docs) + 1)
        try:
            _, doc = await read_rotation(store, where)
        except NotFound:
            break
        except (TooLarge, ValueError) as exc:
            raise Untrusted(f"{where}: not a rotation document ({exc})", where) from None
        docs.append((where, doc))
        if isinstance(doc, Mapping) and doc.get("key") == key.to_text():
            named = where
    if named is None:
        return key
    where, doc = docs[0]
    accepted = doc.get("accepted") if isinstance(doc, Mapping) else None
    previous = accepted.get("previous") if isinstance(accepted, Mapping) else None
    try:
        trust = RunTrust(run, PublicKey.from_text(previous if isinstance(previous, str) else ""))
    except ValueError:
        raise Unvouched(f"{where} carries no acceptance by its new key: key {key.key_id} cannot vouch for the "
                        f"run's first key", where) from None
    for where, doc in docs:
        trust.learn(doc, where)
    if not trust.vouched_back_from(key):
        raise Unvouched(f"a rotation up to {named} carries no acceptance by its new key: key {key.key_id} cannot "
                        f"vouch for the run's first key", named)
    return trust.pinned


async def first_run_key(store: Store, run: str, key_text: str | None) -> str | None:
    """The run key (public text) a reader configured with `key_text` pins run.json to: the run's
    first key as `key_text` vouches for it (`vouched_first_key`: a trainer restarted with a rotated
    key), else `key_text` itself. None: none configured."""
    if key_text is None:
        return None
    try:
        return (await vouched_first_key(store, run, PublicKey.from_text(key_text))).to_text()
    except Untrusted:
        return key_text  # nothing vouched: run.json must name the configured key itself


async def put_back_rotations(store: Store, run: str, copies: Copies) -> None:
    """The rotation documents the trainer keeps, put back where the bucket's are gone or differ
    (they are written once, put-if-absent: any other bytes are a bucket writer's)."""
    layout = RunLayout(run)
    for seq in range(1, MAX_ROTATIONS + 1):
        key = layout.key_rotation(seq)
        if copies.kept(key) is None:
            return
        await put_back_changed(store, copies, key, MAX_ROTATION_BYTES)


async def keep_rotations(store: Store, copies: Copies, trust: RunTrust) -> None:
    """Keep the bucket's bytes of each rotation `trust` learned (verified from the run's first key)
    that the trainer keeps no copy of yet: what `put_back_rotations` puts back."""
    layout = RunLayout(trust.run)
    for seq in range(1, trust.rotations + 1):
        key = layout.key_rotation(seq)
        if copies.kept(key) is None:
            with contextlib.suppress(NotFound, TooLarge, ValueError):  # swapped since it was read: kept next time
                data, doc = await read_rotation(store, key)
                verify_document(doc, trust.keys[seq - 1], where=key)  # the document learned, not a later swap
                if doc.get("key") == trust.keys[seq].to_text() and doc.get("seq") == seq and doc.get("run") == trust.run:
                    copies.keep(key, data)


async def weights_trust(store: Store, run: str, pinned: str | None) -> RunTrust | None:
    """The trust a run's weights are checked against: `pinned` (a run key's text, which the run
    manifest must carry), else a signed run's own key; None for an unsigned run without `pinned`.
    RunNotFound when `pinned` is given and the run has no manifest."""
    try:
        manifest = await read_run_manifest(store, run, pinned=pinned)
    except RunNotFound:
        if pinned is None:
            return None
        raise
    text = pinned or manifest.run_key
    return None if text is None else RunTrust.from_text(run, text)
