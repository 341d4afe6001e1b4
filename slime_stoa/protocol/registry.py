"""The worker registry (`runs/<run>/registry.json`): which worker keys may sign a run's records.

One JSON document, signed by the run key (`signing.sign_document`):

    {"format": "stoa.registry/1", "run": <run>, "serial": <n>,
     "workers": {<worker id>: {"name": <display name>, "key": "ed25519:...",
                               "added_at": <unix s>, "revoked_at": <unix s> | null, "releases": <n>}},
     "signature": {...}}

- `serial` grows by one with every edit, so a reader that saw serial n refuses an older copy
  (a worker token can write the object, and could put back an old signed copy from before a
  revocation).
- A key belongs to one worker id: the record envelope names the key id, the entry names the
  worker the key signs for, and a reader checks both against the record's object key.
- `revoked_at`: from then on nothing signed by the key is accepted (not even records signed
  before it and not yet consumed).
- `releases`: how many times an operator lifted a quarantine of the worker (`stoa worker release`).

The pure part parses strictly, verifies and edits; `read_registry` and `update_registry` are the
store IO. Edits are conditional puts (If-None-Match for the first, If-Match after), so two
operators editing at once never lose each other's change: the loser reads again and re-applies.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from slime_stoa.protocol.layout import RunLayout, check_name, check_worker_id
from slime_stoa.protocol.printable import names_shown
from slime_stoa.protocol.signing import (
    SIGNATURE_FIELD,
    PublicKey,
    SignatureError,
    SigningKey,
    sign_document,
    verify_document,
)
from slime_stoa.protocol.store import NotFound, PreconditionFailed, Store
from slime_stoa.protocol.store.capped import TooLarge, read_capped
from slime_stoa.protocol.strict_json import load_json

REGISTRY_FORMAT = "stoa.registry/1"
MAX_REGISTRY_BYTES = 16 << 20  # ~60,000 workers
MAX_NAME_CHARS = 64
_ENTRY_FIELDS = frozenset({"name", "key", "added_at", "revoked_at", "releases"})
_DOC_FIELDS = frozenset({"format", "run", "serial", "workers", SIGNATURE_FIELD})
UPDATE_ATTEMPTS = 16  # conditional-put races an edit may lose before giving up


class RegistryError(ValueError):
    """The registry does not parse, is not signed by the run key, or describes another run."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerEntry:
    worker: str  # the worker id the key signs for
    name: str  # display name given to `stoa worker add`
    key: PublicKey
    added_at: float
    revoked_at: float | None = None
    releases: int = 0

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def to_doc(self) -> dict[str, Any]:
        return {
            "name": self.name, "key": self.key.to_text(), "added_at": self.added_at,
            "revoked_at": self.revoked_at, "releases": self.releases,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Registry:
    run: str
    serial: int = 0  # 0: never written
    workers: Mapping[str, WorkerEntry] = field(default_factory=dict)
    _by_key: Mapping[str, WorkerEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_name("run", self.run)
        by_key: dict[str, WorkerEntry] = {}
        for worker, entry in self.workers.items():
            if entry.worker != worker:
                raise RegistryError(f"registry entry {worker!r} is for worker {entry.worker!r}")
            other = by_key.setdefault(entry.key.key_id, entry)
            if other is not entry:
                raise RegistryError(f"key {entry.key.key_id} is registered for two workers ({other.worker}, {worker})")
        object.__setattr__(self, "workers", MappingProxyType(dict(sorted(self.workers.items()))))
        object.__setattr__(self, "_by_key", MappingProxyType(by_key))

    def by_key_id(self, key_id: str) -> WorkerEntry | None:
        """The entry whose key has this id (revoked or not), or None."""
        return self._by_key.get(key_id)

    def to_doc(self) -> dict[str, Any]:
        return {
            "format": REGISTRY_FORMAT, "run": self.run, "serial": self.serial,
            "workers": {w: e.to_doc() for w, e in self.workers.items()},
        }


# -- parsing and signing (pure) ----------------------------------------------------------------------


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise RegistryError(f"{what} must be a finite number >= 0, got {value!r:.80}")
    return float(value)


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
        raise RegistryError(f"{what} must be an integer >= 0, got {value!r:.80}")
    return value


def check_display_name(name: Any) -> str:
    """A worker's display name: 1-64 printable characters without surrounding spaces."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS or not name.isprintable() or name != name.strip():
        raise ValueError(f"worker name must be 1-{MAX_NAME_CHARS} printable characters, got {name!r:.80}")
    return name


def _entry(worker: Any, doc: Any) -> WorkerEntry:
    try:
        worker = check_worker_id(worker)
    except ValueError as exc:
        raise RegistryError(f"registry: {exc}") from None
    where = f"registry entry {worker}"
    if not isinstance(doc, dict) or set(doc) != _ENTRY_FIELDS:
        raise RegistryError(f"{where}: expected exactly the fields {sorted(_ENTRY_FIELDS)}")
    try:
        name = check_display_name(doc["name"])
        key = PublicKey.from_text(doc["key"])
    except ValueError as exc:
        raise RegistryError(f"{where}: {exc}") from None
    revoked = doc["revoked_at"]
    return WorkerEntry(
        worker=worker, name=name, key=key, added_at=_number(doc["added_at"], f"{where}: added_at"),
        revoked_at=None if revoked is None else _number(revoked, f"{where}: revoked_at"),
        releases=_count(doc["releases"], f"{where}: releases"),
    )


def parse_registry(doc: Any, *, run: str) -> Registry:
    """A registry from its parsed JSON (signature not checked: see `load_registry`)."""
    if not isinstance(doc, dict) or doc.get("format") != REGISTRY_FORMAT:
        raise RegistryError(f"not a {REGISTRY_FORMAT} document")
    unknown = set(doc) - _DOC_FIELDS
    if unknown:
        raise RegistryError(f"registry has unknown fields {names_shown(unknown)}")
    if doc.get("run") != run:
        raise RegistryError(f"registry is for run {str(doc.get('run'))[:80]!r}, not {run!r}")
    workers = doc.get("workers")
    if not isinstance(workers, dict):
        raise RegistryError("registry: 'workers' must be an object")
    entries = {w: _entry(w, e) for w, e in workers.items()}
    return Registry(run=run, serial=_count(doc.get("serial"), "registry serial"), workers=entries)


RunKeys = PublicKey | Iterable[PublicKey]  # the run key, or every run key trusted (rotations)


def load_registry(data: bytes, *, run: str, run_key: RunKeys) -> Registry:
    """Parse registry bytes and check they are signed by `run_key` (or one of them); RegistryError otherwise."""
    try:
        doc = load_json(data, max_bytes=MAX_REGISTRY_BYTES)
    except ValueError as exc:
        raise RegistryError(f"registry of run {run!r}: {exc}") from None
    try:
        verify_document(doc, run_key, where=f"registry of run {run!r}")
    except SignatureError as exc:
        raise RegistryError(str(exc)) from None
    return parse_registry(doc, run=run)


def registry_bytes(registry: Registry, key: SigningKey) -> bytes:
    """The signed JSON of `registry`."""
    return json.dumps(sign_document(registry.to_doc(), key), indent=1, sort_keys=True).encode() + b"\n"


# -- edits (pure; each bumps the serial) -----------------------------------------------------------


def add_worker(registry: Registry, *, worker: str, name: str, key: PublicKey, now: float) -> Registry:
    """Register `key` for `worker`; ValueError if the worker id or the key is already there."""
    check_worker_id(worker)
    if worker in registry.workers:
        raise ValueError(f"worker {worker!r} is already registered in run {registry.run!r}")
    if registry.by_key_id(key.key_id) is not None:
        raise ValueError(f"key {key.key_id} is already registered in run {registry.run!r}")
    entry = WorkerEntry(worker=worker, name=check_display_name(name), key=key, added_at=now)
    return replace(registry, serial=registry.serial + 1, workers={**registry.workers, worker: entry})


def _edited(registry: Registry, worker: str, **changes: Any) -> Registry:
    entry = replace(registry.workers[worker], **changes)
    return replace(registry, serial=registry.serial + 1, workers={**registry.workers, worker: entry})


def find_worker(registry: Registry, worker: str) -> WorkerEntry:
    """The entry of `worker` (its id or its display name, if that names one worker); ValueError if none."""
    if worker in registry.workers:
        return registry.workers[worker]
    named = [e for e in registry.workers.values() if e.name == worker]
    if len(named) == 1:
        return named[0]
    if named:
        raise ValueError(f"{len(named)} workers are named {worker!r}: give a worker id ({', '.join(e.worker for e in named)})")
    raise ValueError(f"no worker {worker!r} in the registry of run {registry.run!r}")


def revocation(registry: Registry, worker: str, key_id: str) -> WorkerEntry | None:
    """The revoked entry that stops `worker` signing with key `key_id` (its worker id's, or the
    key's), or None while neither is revoked."""
    for entry in (registry.workers.get(worker), registry.by_key_id(key_id)):
        if entry is not None and entry.revoked:
            return entry
    return None


def revoke_worker(registry: Registry, worker: str, *, now: float) -> Registry:
    """Revoke the key of `worker` (id or name); ValueError if unknown or already revoked."""
    entry = find_worker(registry, worker)
    if entry.revoked:
        raise ValueError(f"worker {entry.worker!r} is already revoked")
    return _edited(registry, entry.worker, revoked_at=now)


def release_worker(registry: Registry, worker: str) -> Registry:
    """Count one more release of `worker` (id or name); ValueError if unknown."""
    entry = find_worker(registry, worker)
    return _edited(registry, entry.worker, releases=entry.releases + 1)


# -- store IO ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RegistryRead:
    registry: Registry  # serial 0 and no workers when the run has no registry yet
    etag: str | None  # None when the object does not exist


async def read_registry(
    store: Store, run: str, run_key: RunKeys, *, if_none_match: str | None = None
) -> RegistryRead | None:
    """The run's registry, verified with `run_key`; None when its ETag still is `if_none_match`.

    RegistryError when the object does not parse, is larger than MAX_REGISTRY_BYTES (read no
    further than that) or is not signed by the run key; StoreError when the store cannot be read."""
    key = RunLayout(run).registry
    try:
        result = await read_capped(store, key, MAX_REGISTRY_BYTES, if_none_match=if_none_match)
    except NotFound:
        return RegistryRead(Registry(run=run), None)
    except TooLarge as exc:
        raise RegistryError(f"registry of run {run!r}: {exc}") from None
    if result is None:
        return None
    return RegistryRead(load_registry(result.data, run=run, run_key=run_key), result.etag)


async def read_run_registry(store: Store, run: str, run_key: PublicKey) -> Registry:
    """The registry of a signed run whose first run key is `run_key`, verified with it or a key its
    rotations name (read first). RegistryError or `run_trust.Untrusted` when it does not check,
    StoreError when the store cannot be read."""
    from .run_trust import RunTrust, load_rotations

    trust = RunTrust(run, run_key)
    await load_rotations(store, trust)
    read = await read_registry(store, run, trust.keys)
    assert read is not None  # no if_none_match: a read always returns the registry
    return read.registry


async def update_registry(
    store: Store,
    run: str,
    key: SigningKey,
    edit: Callable[[Registry], Registry],
    *,
    attempts: int = UPDATE_ATTEMPTS,
    trusted: RunKeys | None = None,
) -> Registry:
    """Apply `edit` to the current registry and write it signed by the run `key` by a
    conditional put; on a lost race read again and re-apply. Returns the registry written.
    `trusted`: the run keys the current registry may be signed by (default: `key`; after a
    rotation, the run's keys, so the new key takes over a registry the old one signed).

    `edit` may raise ValueError (refused edit); RegistryError if the registry in the bucket is
    not the run key's (a forged one is never overwritten silently)."""
    target = RunLayout(run).registry
    for _ in range(attempts):
        current = await read_registry(store, run, key.public if trusted is None else trusted)
        assert current is not None
        updated = edit(current.registry)
        try:
            await store.cas(target, registry_bytes(updated, key), current.etag)
        except PreconditionFailed:
            continue
        return updated
    raise RegistryError(f"{target}: lost {attempts} conditional writes in a row to other edits; try again")
