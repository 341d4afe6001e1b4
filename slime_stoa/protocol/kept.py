"""The trainer's own copies of what it signed, on the trainer's disk: what a bucket writer cannot
take away.

In single-bucket mode every worker's token can overwrite or delete any object of the run, so the
trainer keeps, in a folder of its own (`ConsumerConfig.keep_dir`, `PublisherConfig.keep_dir`),
the signed bytes of the objects it depends on: the run manifest and its key rotations, the worker
registry, its consumer state and that state's newest head, and each pointer and version manifest
it committed.
They are filed under their bucket key (`<folder>/<key>`), so the folder holds a small mirror of
those objects. When the bucket's object is gone, garbage, or older than the trainer's copy, the
trainer uses its copy and puts it back (`put_back`): a worker can make the trainer restore an
object, never stop it.

Nothing here judges bytes: callers keep only what they verified (or signed themselves), and read
back only from their own disk.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from slime_stoa.protocol.fsutil import atomic_write
from slime_stoa.protocol.store import NotFound, Store
from slime_stoa.protocol.store.capped import TooLarge, read_capped_bytes

log = logging.getLogger("stoa.kept")


class Copies(Protocol):
    """The trainer's own copies of what it signed, by bucket key (`TrainerCopies`, or a test's)."""

    def keep(self, key: str, data: bytes) -> None: ...
    def kept(self, key: str) -> bytes | None: ...
    def forget(self, key: str) -> None: ...
    def path(self, key: str) -> Path: ...
    async def put_back(self, store: Store, key: str, why: str) -> bytes | None: ...


class TrainerCopies:
    """The copies under one folder, by bucket key."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    @classmethod
    def at(cls, folder: str | Path | None) -> TrainerCopies | None:
        """The copies in `folder`; None when no folder is configured (nothing is kept)."""
        return None if folder is None or str(folder) == "" else cls(folder)

    def path(self, key: str) -> Path:
        """Where the copy of bucket object `key` lives. Keys are the trainer's own (from
        `RunLayout`), never a listed name; still, one that would leave the folder is refused."""
        parts = key.split("/")
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"not a bucket key the trainer keeps a copy of: {key!r}")
        return self.folder.joinpath(*parts)

    def keep(self, key: str, data: bytes) -> None:
        """Keep `data` (signed bytes the caller checked or wrote) as the copy of `key`."""
        path = self.path(key)
        if self.kept(key) == data:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)

    def kept(self, key: str) -> bytes | None:
        """The copy of `key`, or None when the trainer keeps none."""
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def forget(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    async def put_back(self, store: Store, key: str, why: str) -> bytes | None:
        """Write the copy of `key` over the bucket's object (gone, garbage or older: `why`);
        the bytes put back, or None when the trainer keeps no copy of it."""
        data = self.kept(key)
        if data is None:
            return None
        await store.put(key, data)
        log.warning("stoa: %s %s; put the trainer's own copy back", key, why)
        return data


async def put_back_changed(store: Store, copies: Copies, key: str, limit: int) -> bool:
    """Put the copy of `key` back where the bucket's object is gone or holds other bytes (True
    when it did): for objects written once (put-if-absent: the run manifest, a key rotation),
    whose any other bytes are a bucket writer's. One GET of at most `limit` bytes; nothing
    without a copy."""
    kept = copies.kept(key)
    if kept is None:
        return False
    try:
        found: bytes | None = await read_capped_bytes(store, key, limit)
    except NotFound:
        found = None
    except TooLarge:
        found = b""
    if found == kept:
        return False
    await copies.put_back(store, key, "is gone" if found is None else "was replaced")
    return True
