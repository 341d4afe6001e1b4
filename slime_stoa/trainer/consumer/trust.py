"""Which workers the trainer trusts: the worker keys of a signed run (`slime_stoa.judging.signers`),
the quarantine book (`quarantine`) and the canaries (`canary`).

A revoked or vanished key refuses the pool's groups it signed; a quarantined worker's records,
and in a signed run those under a worker id the registry does not hold, are refused before they
are downloaded (a quarantined worker's pool groups dropped); a canary group is held to
the strict checks. The quarantine book lives in the consumer state; the canary secret never
leaves this process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from slime_stoa.judging.signers import Signers
from slime_stoa.protocol.registry import Registry

from . import canary
from .groups import Admitted, Pool
from .metrics import worker_counter
from .quarantine import Quarantine
from .shared import Shared
from .state import name_worker

log = logging.getLogger(__name__)

MAX_UNREGISTERED_IDS = 10_000  # unregistered worker ids remembered (then forgotten all at once)
UNKNOWN_ID_REREAD_S = 2.0  # at most one registry read this often for keys under unknown worker ids


class WorkerTrust:
    def __init__(self, shared: Shared, pool: Pool, *, task: str, signers: Signers | None) -> None:
        self.shared = shared
        self.pool = pool
        self.task = task  # the run's task name (canaries are keyed by it)
        self.signers = signers  # None: an unsigned run
        self.quarantine = Quarantine(shared.config.quarantine, shared.state.quarantine)
        self._unregistered: dict[str, float] = {}  # worker id -> when a key of it was first seen unregistered
        self._unknown_read = -float("inf")  # when discovery last had the registry read for an unknown id
        self.canary_secret = shared.config.canary.secret()

    # -- worker keys (signed runs) ----------------------------------------------------------------
    @property
    def registry(self) -> Registry | None:
        return None if self.signers is None else self.signers.registry

    def registry_serial(self, floor: int) -> int:
        """The registry serial a restarted consumer must not go below (saved with the state)."""
        s = self.signers
        return floor if s is None else max(floor, s.floor, s.registry.serial)

    def signers_due(self) -> bool:
        return self.signers is not None and self.signers.due()

    async def know_signer(self, data: bytes) -> None:
        """Before judging a record of a signed run: read the registry again if the record names
        a key it does not hold (a worker added since), or if the last read is `registry_refresh_s` old."""
        if self.signers is not None and self.signers.needs_read(data):
            await self.refresh_signers()

    async def refresh_signers(self, since: float | None = None) -> None:
        """Read the registry (unless a read started since this call did, or since `since`), apply
        its releases and drop the pool's groups whose key is now revoked or gone, counted as rejected."""
        signers, shared = self.signers, self.shared
        assert signers is not None
        outcome = await signers.refresh(
            signers.clock() if since is None else since,
            through=lambda op: shared.patiently(op, f"reading the worker registry of run {shared.config.run!r}"),
        )
        if outcome in ("invalid", "rollback"):
            shared.count(f"registry_{outcome}")
        if outcome != "updated":
            return
        registry = signers.registry
        self.apply_releases({worker: e.releases for worker, e in registry.workers.items()})  # `stoa worker release`
        for a in self.pool.drop(lambda a: self.distrust(a) is None):
            reason = self.distrust(a)
            assert reason is not None
            shared.reject(a.name, reason, f"its key {a.signer} was {reason.replace('_', ' ')} before the group was used")

    def distrust(self, admitted: Admitted) -> str | None:
        """In a signed run, why the registry as last read no longer trusts the key that signed
        `admitted` ("revoked", or "unknown_key" when it is gone); None when it does, or when the
        run is unsigned."""
        if self.signers is None:
            return None
        found = None if admitted.signer is None else self.signers.registry.by_key_id(admitted.signer)
        if found is None:
            return "unknown_key"
        return "revoked" if found.revoked else None

    # -- quarantine and canaries ------------------------------------------------------------------
    def quarantined(self) -> dict[str, str]:
        return self.quarantine.quarantined()

    def is_canary(self, prompt_index: int) -> bool:
        return canary.is_canary(self.canary_secret, self.task, prompt_index, self.shared.config.canary.rate)

    def observe_logprob_gap(
        self, worker: str, mean_abs_gap: float, tokens: int, *, prompt_index: int | None = None, plane: str = "bf16"
    ) -> list[str]:
        """See `RolloutConsumer.observe_logprob_gap`."""
        shared = self.shared
        now = int(shared.clock() * 1000)
        newly = self.quarantine.observe_gap(worker, mean_abs_gap, tokens, plane=plane, now_ms=now)
        if (
            prompt_index is not None and tokens > 0 and self.is_canary(prompt_index)
            and mean_abs_gap > shared.config.canary.max_logprob_gap + self.quarantine.config.allowance(plane)
        ):
            shared.count("canary_gap_failures")
            shared.count(worker_counter(worker, "canary_failed"))
            log.warning("stoa: worker %r failed a canary: logprob gap %.3g per token", worker, mean_abs_gap)
            newly += self.quarantine.observe_canary(worker, passed=False, now_ms=now)
        self._on_quarantined(newly)
        return newly

    def apply_releases(self, releases: Mapping[str, int]) -> list[str]:
        """See `RolloutConsumer.apply_releases`."""
        lifted = self.quarantine.apply_releases(releases)
        for worker in lifted:
            log.warning("stoa: worker %r released from quarantine", worker)
        return lifted

    async def admits(self, worker: str) -> bool:
        """Whether discovery may take keys of `worker`: in a signed run, an id of the registry.
        An id it does not hold has the registry read again first, at once unless such a read
        happened within `UNKNOWN_ID_REREAD_S`, whatever the number of ids (a worker added since is learned; made-up
        ids cost no read each). Keys skipped while their worker was unknown are found by a sweep."""
        signers = self.signers
        if signers is None or worker in signers.registry.workers:
            return True
        now = signers.clock()
        if now - self._unknown_read >= min(UNKNOWN_ID_REREAD_S, signers.refresh_s):
            self._unknown_read = now
            await self.refresh_signers(since=now)
        return worker in signers.registry.workers

    async def refuse_before_download(self, name: str) -> bool:
        """True (counted as rejected) for a record not even to download: a quarantined worker's,
        or, in a signed run, one whose key names a worker id the registry does not hold."""
        return self.refuse_quarantined(name) or await self.refuse_unregistered(name)

    async def refuse_unregistered(self, name: str) -> bool:
        """In a signed run, True (counted as "unknown_key") when the worker id in the record's key
        is not in the registry, read again first once per id and `registry_refresh_s` (a worker
        added since): junk keys under made-up ids cost no GET each."""
        signers = self.signers
        worker = name_worker(name)
        if signers is None or worker in signers.registry.workers:
            return False
        now = signers.clock()
        seen = self._unregistered.get(worker)
        if seen is None or now - seen >= signers.refresh_s:
            if len(self._unregistered) >= MAX_UNREGISTERED_IDS:
                self._unregistered.clear()
            self._unregistered[worker] = seen = now
        await self.refresh_signers(since=seen)
        if worker in signers.registry.workers:
            return False
        self.shared.reject(
            name, "unknown_key",
            f"worker id {worker!r} is not in the run's registry (serial {signers.registry.serial}): not downloaded",
        )
        return True

    def refuse_quarantined(self, name: str) -> bool:
        """True (counted as rejected) when the record `name` is a quarantined worker's."""
        worker = name_worker(name)
        if not self.quarantine.is_quarantined(worker):
            return False
        self.shared.reject(name, "quarantined", f"worker {worker!r} is quarantined ({self.quarantined().get(worker)})")
        return True

    def refuses(self, admitted: Admitted, uses: int | None) -> bool:
        """After a record passed admission: feed its evidence to the quarantine (the first time
        it is judged, `uses` None) and run a canary's strict checks. True (counted) when it is
        refused: a failed canary (`canary_failed`) or a quarantined worker (`quarantined`)."""
        shared, worker = self.shared, admitted.worker
        if uses is None:
            now = int(shared.clock() * 1000)
            newly = self.quarantine.observe_scored(
                worker, samples=len(admitted.rewards), disagreements=admitted.disagreements, now_ms=now
            )
            problem = None
            if self.is_canary(admitted.group.prompt_index):
                problem = canary.canary_problem(
                    admitted.group, rewards=admitted.rewards, texts=admitted.texts,
                    vocab_size=shared.config.record_limits.vocab_size, config=shared.config.canary,
                )
                newly += self.quarantine.observe_canary(worker, passed=problem is None, now_ms=now)
            self._on_quarantined(newly)
            if problem is not None:
                shared.count(worker_counter(worker, "canary_failed"))
                shared.reject(admitted.name, "canary_failed", problem)
                return True
        return self.refuse_quarantined(admitted.name)

    def _on_quarantined(self, workers: list[str]) -> None:
        """Drop the pool's groups of newly quarantined workers (counted `quarantine_dropped`)."""
        for worker in workers:
            dropped = self.pool.drop(_not_of(worker))
            self.shared.count("quarantine_dropped", len(dropped))
            self.shared.count("quarantined_workers")
            log.warning(
                "stoa: worker %r quarantined (%s): its records are refused and %d group(s) not yet used dropped, "
                "until `stoa worker release %s`", worker, self.quarantined().get(worker), len(dropped), worker,
            )


def _not_of(worker: str) -> Callable[[Admitted], bool]:
    return lambda a: a.worker != worker
