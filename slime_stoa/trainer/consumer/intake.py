"""What happens to a downloaded record: judged (`admission`) once, then rejected (counted by
reason, never raised), dropped (off lineage, stale, all-equal rewards: counted) or put in the
pool.

The record is decoded once (`admission.open_record`). When its weights are not among the
published versions as last read but a fresh read may have them (`PublishedVersions.worth_refresh`),
the versions are read again and the same decoded group goes through `admission.admit` a second
and last time; a version still unknown then is judged by the staleness rules where they refuse
it anyway, else rejected as "version" (or "digest"). A record that fails because an object it
needs is gone (the registry, the claimed version's manifest: `missing`) is held, not rejected
(`held`): it stays queued and is judged again once the object is back.
"""

from __future__ import annotations

import logging

from slime_stoa.judging.scoring import Rescorer
from slime_stoa.protocol.records import RolloutGroup
from slime_stoa.protocol.validate import RecordRejected

from . import policy
from .admission import UnpublishedVersion, admit, open_record
from .groups import Admitted, Pool
from .held import Held
from .metrics import worker_counter
from .shared import Shared
from .trust import WorkerTrust
from .versions import PublishedVersions, Verdict

log = logging.getLogger(__name__)


class Intake:
    def __init__(
        self,
        shared: Shared,
        *,
        rescorer: Rescorer,
        versions: PublishedVersions,
        trust: WorkerTrust,
        pool: Pool,
        held: Held,
    ) -> None:
        self.shared = shared
        self.held = held  # records waiting for an object a bucket writer deleted
        self.rescorer = rescorer
        self.versions = versions
        self.trust = trust
        self.pool = pool
        self.scored_rewards: list[float] = []  # every group scored since the last batch, unfiltered

    async def take(self, name: str, data: bytes, uses: int | None) -> bool:
        """Judge the downloaded record `name` (`uses`: None for a new record, else the times it
        was used before a restart) and route it. False when it stays queued: a fatal error, or held."""
        shared, versions = self.shared, self.versions
        if versions.done == 0:  # never read yet
            await versions.refresh(0)
        if shared.fatal is not None:
            return False
        await self.trust.know_signer(data)
        key = shared.layout.parse_rollout(shared.prefix + name)
        assert key is not None  # discovery only queues valid record keys
        seen = versions.started
        try:
            group, signer = open_record(
                data, key=key, limits=shared.config.record_limits, now=shared.clock(), registry=self.trust.registry
            )
            try:
                admitted = self._admit(name, group, signer)
            except UnpublishedVersion as exc:
                if not versions.worth_refresh(exc.version):
                    raise
                # It claims weights the trainer may have published since the last read: read again.
                await versions.refresh(seen)
                if shared.fatal is not None:
                    return False
                admitted = self._admit(name, group, signer)
        except UnpublishedVersion as exc:
            verdict = versions.verdict(exc.version, published=False) if exc.reason == "version" else None
            if verdict is not None:
                self._drop(name, exc.version, verdict)
                return True
            return await self._reject_or_hold(name, exc)
        except RecordRejected as exc:
            return await self._reject_or_hold(name, exc)
        except Exception as exc:  # a bug: keep consuming, but say so loudly
            log.exception("stoa: unexpected error judging %s", shared.prefix + name)
            shared.reject(name, "internal", f"{type(exc).__name__}: {exc}")
            return True
        self._route(admitted, uses)
        return True

    async def _reject_or_hold(self, name: str, exc: RecordRejected) -> bool:
        """Reject the record (True: off the queue), or hold it (False: it stays queued) when an
        object it needs is gone (`held`)."""
        need = await self.held.missing(exc)
        if need is None:
            self.shared.reject(name, exc.reason, exc.detail)
            return True
        self.held.hold(name, need, exc.detail)
        return False

    def _admit(self, name: str, group: RolloutGroup, signer: str | None) -> Admitted:
        return admit(
            name, group, signer, rescorer=self.rescorer, reward_tolerance=self.shared.config.reward_tolerance,
            published=self.versions.digests, replay=self.shared.state.replay,
        )

    def _route(self, admitted: Admitted, uses: int | None) -> None:
        """An admitted record: counted (the first time), then refused, dropped or pooled."""
        shared, config = self.shared, self.shared.config
        if uses is None:  # a restored ledger entry was counted when first admitted
            shared.count("samples_scored", len(admitted.rewards))
            self.scored_rewards.extend(admitted.rewards)
            shared.count("reward_disagreements", admitted.disagreements)
            shared.count(worker_counter(admitted.worker, "reward_disagreements"), admitted.disagreements)
        reason = self.trust.distrust(admitted)
        if reason is not None:  # the registry read while this record was judged revoked its key
            shared.reject(admitted.name, reason, f"its key {admitted.signer} was {reason.replace('_', ' ')} while it was judged")
            return
        if self.trust.refuses(admitted, uses):
            return
        verdict = self.versions.verdict(admitted.group.weight_version)
        if verdict is not None:
            self._drop(admitted.name, admitted.group.weight_version, verdict)
        elif uses is None and config.filter_all_equal and policy.all_equal(admitted.rewards):
            shared.count("filtered_all_equal")
        else:
            self.pool.add(admitted, uses or 0)
            if uses is None:
                shared.count("admitted")

    def _drop(self, name: str, weight_version: int, verdict: Verdict) -> None:
        if verdict == "version_ahead":
            self.shared.reject(
                name, "version_ahead", f"weight_version {weight_version}, trainer at v{self.versions.trainer_version}"
            )
        else:
            self.shared.count(verdict)
