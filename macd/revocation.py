"""A worker of a signed run learns that its key was revoked, and stops uploading.

The worker reads the run's registry (verified with the run keys; `protocol.registry`) at start
and every `poll_s` while it runs, one conditional GET while it is unchanged. When the registry
revokes its worker id or its key, the worker is told: `RevocationWatch.revoked` holds the entry,
the caller stops uploads (the trainer would refuse every record anyway) and keeps the spool. A
registry older than one already read (a lower serial: an old copy put back) is ignored, as is one
that does not verify or read: the worker keeps what it knew.
"""

from __future__ import annotations

import asyncio
import logging

from slime_stoa.protocol.registry import RegistryError, WorkerEntry, read_registry, revocation
from slime_stoa.protocol.run_trust import RunTrust, Untrusted, load_rotations
from slime_stoa.protocol.store import Store, StoreConfigError, StoreError

from .aio import wait

log = logging.getLogger("macd")


class RevocationWatch:
    def __init__(self, store: Store, run: str, worker_id: str, key_id: str, *, poll_s: float) -> None:
        self.store, self.run, self.worker_id, self.key_id, self.poll_s = store, run, worker_id, key_id, poll_s
        self.revoked: WorkerEntry | None = None
        self.serial = 0  # the highest registry serial read: a lower one is not read as news
        self._etag: str | None = None

    async def check(self, trust: RunTrust) -> WorkerEntry | None:
        """Read the registry once (rotations learned first); the revoked entry once this worker's
        id or key is revoked, else None. A store error, or a registry that does not verify, is
        logged at debug level and changes nothing (the next check tries again)."""
        if self.revoked is not None:
            return self.revoked
        try:
            await load_rotations(self.store, trust)
            read = await read_registry(self.store, self.run, trust.keys, if_none_match=self._etag)
        except StoreConfigError:
            raise
        except (StoreError, RegistryError, Untrusted) as exc:
            log.debug("worker registry of run %s not read: %s", self.run, exc)
            return None
        if read is None or read.registry.serial < self.serial:
            return None
        self.serial, self._etag = read.registry.serial, read.etag
        self.revoked = revocation(read.registry, self.worker_id, self.key_id)
        return self.revoked

    async def watch(self, trust: RunTrust, stop: asyncio.Event) -> WorkerEntry | None:
        """`check` every `poll_s` until this worker is revoked (returns its entry) or `stop` is set (None)."""
        while not stop.is_set():
            entry = await self.check(trust)
            if entry is not None:
                return entry
            await wait(stop, self.poll_s)
        return None
