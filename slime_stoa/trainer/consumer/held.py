"""Records held while an object they need is gone: never rejected for what a bucket writer did.

A record can be judged only against the run's worker registry (its signing key) and the version
manifest of the weights it claims. Any worker token can delete those objects; a record that fails
because one is gone is not itself invalid, so it is held, not rejected: it stays in the download
queue (and so in the saved state: a restart tries it again) but is not downloaded while it waits.
What it waits for ("registry", or "v<version>") is looked at again with a backoff doubling from
`poll_interval_s` to `store_retry_max_delay_s`, reported in one line at tries 1, 2, 4, ... with
the repair; once the object is back (restored by its owner or put back from the trainer's
`keep_dir`), its records are downloaded and judged again. Only then is a record still failing
rejected for good.

The questions behind a hold are asked here too: is the registry gone (`registry_gone`: a signed
run with none read and none in the bucket; discovery then takes every worker's keys, `admits`, and
downloads hold them, `hold_before_download`), and which gone object explains a rejection
(`missing`: the registry, or the manifest of a version the trainer published).

Held records are bounded by count and by listed bytes: past either bound the oldest is dropped
from the queue (counted `held_dropped`), so junk made to look like it waits costs memory once.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator

from slime_stoa.protocol.validate import RecordRejected

from .admission import UnpublishedVersion
from .pause import is_report_try
from .shared import Shared
from .trust import WorkerTrust
from .versions import PublishedVersions

log = logging.getLogger(__name__)

MAX_HELD_RECORDS = 10_000
MAX_HELD_BYTES = 1 << 30  # listed sizes of the held records

def needs_version(version: int) -> str:
    return f"v{version}"


class Held:
    def __init__(
        self,
        shared: Shared,
        *,
        trust: WorkerTrust,
        versions: PublishedVersions,
        forget: Callable[[str], None],
        max_records: int = MAX_HELD_RECORDS,
        max_bytes: int = MAX_HELD_BYTES,
    ) -> None:
        self.shared = shared
        self.trust = trust
        self.versions = versions
        self.forget = forget  # drops a record from the download queue
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.waiting: dict[str, str] = {}  # record name -> need, oldest held first
        self._bytes = 0
        self._per_need: Counter[str] = Counter()
        self._looks: dict[str, tuple[int, float, float]] = {}  # need -> (tries, delay, next look: monotonic)

    def __contains__(self, name: object) -> bool:
        return name in self.waiting

    def __len__(self) -> int:
        return len(self.waiting)

    def __iter__(self) -> Iterator[str]:
        return iter(self.waiting)

    def hold(self, name: str, need: str, detail: str) -> None:
        """Hold record `name` until `need` is back (`detail`: what failed); counted `held`."""
        if name in self.waiting:
            return
        self.waiting[name] = need
        self._per_need[need] += 1
        self._bytes += self._size(name)
        self.shared.count("held")
        if need not in self._looks:
            delay = self.shared.config.poll_interval_s
            self._looks[need] = (0, delay, time.monotonic() + delay)
            log.warning("stoa: holding records that need %s, which is gone (%s): %s", need, detail, self.repair(need))
        while self.waiting and (len(self.waiting) > self.max_records or self._bytes > self.max_bytes):
            oldest = next(iter(self.waiting))
            self._release(oldest)
            self.forget(oldest)
            self.shared.count("held_dropped")
            log.warning("stoa: dropped held record %s: more held than %d records or %d bytes",
                        self.shared.prefix + oldest, self.max_records, self.max_bytes)

    def next_look(self) -> float:
        """When (monotonic) an object held records wait for is looked at next (inf: none)."""
        return min((at for _, _, at in self._looks.values()), default=float("inf"))

    async def look(self) -> int:
        """Look at every object whose look is due; release the records of those back. How many
        records were released."""
        now, released = time.monotonic(), 0
        config = self.shared.config
        for need, (tries, delay, at) in list(self._looks.items()):
            if now < at:
                continue
            if await self.is_back(need):
                names = [n for n, waits in self.waiting.items() if waits == need]
                for name in names:
                    self._release(name)
                released += len(names)
                self.shared.count("held_released", len(names))
                self._looks.pop(need, None)
                log.warning("stoa: %s is back: %d held record(s) judged again", need, len(names))
                continue
            tries += 1
            self.shared.count("held_looks")
            if is_report_try(tries):
                log.error("stoa: %d record(s) held: %s is still gone (look %d). Repair: %s",
                          self._per_need[need], need, tries, self.repair(need))
            delay = min(delay * 2, max(config.store_retry_max_delay_s, config.poll_interval_s))
            self._looks[need] = (tries, delay, time.monotonic() + delay)
        return released

    def _release(self, name: str) -> None:
        need = self.waiting.pop(name)
        self._bytes -= self._size(name)
        self._per_need[need] -= 1
        if not self._per_need[need]:
            del self._per_need[need]
            self._looks.pop(need, None)

    def _size(self, name: str) -> int:
        return self.shared.state.pending.get(name) or 0

    # -- what a record needs, and whether it is gone ----------------------------------------------
    async def registry_gone(self) -> bool:
        """A signed run that has no worker registry to judge by: none read yet (serial 0) and none
        in the bucket. (One there but refused, a forgery or an old copy, is not gone: records
        that need it are refused, so a revoked key stays out.)"""
        signers = self.trust.signers
        if signers is None or signers.registry.serial != 0:
            return False
        key = self.shared.layout.registry
        return not await self.shared.patiently(lambda: self.shared.store.exists(key), f"looking for {key}")

    async def admits(self, worker: str) -> bool:
        """Discovery takes keys of the registry's workers, and every key while the registry is
        gone: they are held (bounded), not skipped, until it is back."""
        return await self.trust.admits(worker) or await self.registry_gone()

    async def hold_before_download(self, name: str) -> bool:
        """Hold record `name` (True: not downloaded) while the registry it needs is gone."""
        if not await self.registry_gone():
            return False
        self.hold(name, "registry", "the worker registry holds no worker")
        return True

    async def missing(self, exc: RecordRejected) -> str | None:
        """The object gone that made a record fail `exc`, or None when the record itself is at
        fault: the registry (a key it does not hold while it is gone), or the manifest of a
        version the trainer published (the record claims it, the bucket lacks it)."""
        if exc.reason == "unknown_key" and await self.registry_gone():
            return "registry"
        if not isinstance(exc, UnpublishedVersion) or exc.reason != "version":
            return None
        versions, version = self.versions, exc.version
        if version > max(versions.trainer_version, versions.pointer_version) or versions.lineage.is_abandoned(version):
            return None
        return None if await self._manifest_present(version) else needs_version(version)

    async def _manifest_present(self, version: int) -> bool:
        prefix = self.shared.layout.version_manifests_prefix(version)

        async def any_listed() -> bool:
            async for _ in self.shared.store.list(prefix):
                return True
            return False

        return await self.shared.patiently(any_listed, f"listing {prefix}")

    async def is_back(self, need: str) -> bool:
        """Is the object `need` ("registry" or "v<version>") back? A manifest put back has the
        published versions read again, through it."""
        if need == "registry":
            await self.trust.refresh_signers()
            return not await self.registry_gone()
        version = int(need[1:])
        if not await self._manifest_present(version):
            return False
        self.versions.pointer_seen = None  # read the lineage again, through the manifest put back
        await self.versions.refresh(self.versions.started)
        return True

    def repair(self, need: str) -> str:
        """How an operator puts `need` back."""
        layout = self.shared.layout
        if need == "registry":
            return (
                f"put the worker registry {layout.registry} back (the trainer does so itself with a keep_dir; "
                f"else `stoa worker add` re-creates it, one worker at a time, and every worker needs its key again)"
            )
        return (
            f"put the manifest of version {need} back under {layout.version_manifests_prefix(int(need[1:]))} "
            f"(the publisher does so itself with a keep_dir, at its next version)"
        )
