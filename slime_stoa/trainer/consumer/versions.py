"""The weight versions a record may claim: those the trainer published along the pointer's
weight lineage (`slime_stoa.protocol.pulse.lineage`), with their state digests, as last read.

One read at a time, shared by every caller (`refresh`): the pointer (one GET) and, when it moved,
the version manifests along its lineage, `staleness_limit + version_ahead_slack + 1` steps deep
(a record further behind is stale anyway), through store outages. The lineage also says how far
a version lags the trainer's (`lag`, in training steps) and whether a trainer restart abandoned
it, which decides a group's fate (`verdict`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from slime_stoa.protocol.pulse.history import NotPublished, read_lineage, read_pointer
from slime_stoa.protocol.pulse.lineage import Lineage
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.store import StoreConfigError

from . import policy
from .shared import Shared

log = logging.getLogger(__name__)

#: Why a group is not used although it passed admission (see `PublishedVersions.verdict`).
Verdict = Literal["off_lineage", "version_ahead", "stale"]


class PublishedVersions:
    def __init__(self, shared: Shared, trust: RunTrust | None) -> None:
        self.shared = shared
        self.trust = trust  # a signed run: the pointer and manifests are read through the run's trust
        self.trainer_version = 0  # the version `next_batch` was given: lags are measured against it
        self.digests: dict[int, str] = {}  # {version: state digest} of the versions a record may claim
        self.lineage = Lineage.straight({})
        self.pointer_seen: tuple[int, str] | None = None  # (version, manifest) they were read from
        self.started = 0  # reads started
        self.done = 0  # the number of the newest read finished
        self._task: asyncio.Task[None] | None = None

    def lag(self, weight_version: int) -> int | None:
        """Training steps `weight_version` lags the trainer's version along the weight lineage;
        None when it is on a branch a trainer restart abandoned."""
        return self.lineage.lag(self.trainer_version, weight_version)

    def verdict(self, weight_version: int, *, published: bool = True) -> Verdict | None:
        """Why a group drawn from `weight_version` is not used now, or None when it may be:
        from an abandoned branch, too far ahead of the trainer, or too stale. For a version that
        is not `published` (not among the versions as read), "stale" only when it is older than
        every version a record may still claim."""
        lag = self.lag(weight_version)
        config = self.shared.config
        if lag is None:
            return "off_lineage"
        if policy.is_ahead(lag, config.version_ahead_slack):
            return "version_ahead"
        if policy.is_stale(lag, config.staleness_limit) and (published or weight_version < min(self.digests, default=0)):
            return "stale"
        return None

    @property
    def pointer_version(self) -> int:
        """The pointer's version when the published versions were last read (-1: none)."""
        return -1 if self.pointer_seen is None else self.pointer_seen[0]

    def worth_refresh(self, version: int) -> bool:
        """Could reading the published versions again admit a record claiming `version`? Yes
        when it is unknown but within the slack of the pointer (published since the last read), or
        known with another digest (the version published again after a trainer restart)."""
        if version in self.digests:
            return True
        if self.lineage.is_abandoned(version):
            return False
        return version <= self.pointer_version + self.shared.config.version_ahead_slack

    @property
    def depth(self) -> int:
        config = self.shared.config
        return config.staleness_limit + config.version_ahead_slack + 1

    async def refresh(self, after: int) -> None:
        """Make sure a read that started after read number `after` has finished (one read at a
        time, shared by every caller), unless a fatal error stops the consumer."""
        while self.done <= after and self.shared.fatal is None:
            if self._task is None or self._task.done():
                self.started += 1
                self._task = asyncio.create_task(self._read(self.started), name="stoa-published-versions")
            await asyncio.shield(self._task)

    async def _read(self, number: int) -> None:
        """One read (see the module doc). Never raises: a config error becomes fatal, any other
        error keeps the versions last read."""
        shared, run = self.shared, self.shared.config.run
        try:
            try:
                pointer = await shared.patiently(
                    lambda: read_pointer(shared.store, run, trust=self.trust), f"reading the pointer of run {run!r}"
                )
            except NotPublished:
                self.digests, self.pointer_seen, self.lineage = {}, None, Lineage.straight({})
                return
            seen = (pointer.version, pointer.manifest)
            if seen != self.pointer_seen:
                depth = self.depth
                lineage = await shared.patiently(
                    lambda: read_lineage(shared.store, run, depth=depth, pointer=pointer, trust=self.trust),
                    f"reading the published versions of run {run!r}",
                )
                self.lineage, self.digests = lineage, dict(lineage.digests)
                self.pointer_seen = seen
                abandoned = ", ".join(f"v{a}..v{b}" for a, b in lineage.abandoned)
                log.info(
                    "stoa: published versions of run %r: %s%s", run, sorted(self.digests),
                    f" (epoch {pointer.epoch}; abandoned by trainer restarts: {abandoned})" if abandoned else "",
                )
        except StoreConfigError as exc:
            shared.fatal = exc
        except Exception as exc:
            log.error("stoa: could not read the published versions of run %r (keeping the last read): %s: %s",
                      run, type(exc).__name__, exc)
        finally:
            self.done = max(self.done, number)

    def take_task(self) -> asyncio.Task[None] | None:
        """The read in flight, if any, for `close` to cancel."""
        task, self._task = self._task, None
        return task
