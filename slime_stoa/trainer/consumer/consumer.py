"""`RolloutConsumer`: assemble batches of validated, re-scored, fresh rollout groups.

    consumer = await RolloutConsumer.open(store, ConsumerConfig(store_url=url, run="demo"))
    batch = await consumer.next_batch(256, trainer_version=7)
    ... train on batch.groups; log batch.metrics ...
    await consumer.save_state()

How a batch comes together (all on one event loop; each step is one part, the consumer composes
them):

1. Discovery lists new keys after the cursor (`discovery.Discovery.tail`, one request per
   1,000 new keys, whatever the number of workers) into the pending queue, and now and then
   sweeps the skew window behind the cursor for late keys (and, more rarely, the longer late
   window, for workers that come back online with a spool of old records). It stops while the
   pool and the queue hold `max_pool_groups` (backpressure: the cursor waits, nothing is
   skipped). `wait.Filler` runs this loop.
2. Pending keys are downloaded oldest first, `download_concurrency` at a time, only as many as
   the batch still needs (plus `prefetch_groups` in the background between batches)
   (`downloads.Downloads`).
3. Each record is judged (`intake.Intake`, with `admission`: decode, validate against the run's
   limits, key match, published weights (`versions.PublishedVersions`), reward re-computed from
   the text and the label). A reject is counted by reason and never raised. The trainer's
   rewards replace the worker's; disagreements are counted per worker, and the worker's
   standing is judged (`trust.WorkerTrust`: worker keys, quarantine, canaries). Then the
   policies (`policy`), with the lag measured in training steps along the weight lineage
   (`pulse.lineage`: a trainer restarted from an earlier checkpoint starts a new branch): too
   far ahead -> rejected; drawn from an abandoned branch -> dropped (`off_lineage`); too stale
   -> dropped; all-equal rewards -> filtered (if configured); else the group joins the pool. A
   record that fails because an object it needs is gone (the registry, a version manifest: a
   bucket writer deleted it) is held, not rejected, until it is back (`held.Held`).
4. When the pool (`groups.Pool`) holds enough groups, the batch takes them in admission order; a
   group is used at most `reuse_limit` times, each time only while fresh enough.

`next_batch` waits as long as it takes by default, logging what it has and what it needs every
`progress_interval_s`; with `wait_timeout_s` set it raises `ConsumerTimeout` after that long,
naming the workers last seen and the rejects by reason.

Store outages. Every store call the loop depends on (listings, record downloads, the state in
the bucket, opening the run) waits out an outage of any length (`shared.patiently`) and carries
on by itself when the store answers; a `StoreConfigError` (credentials, bucket) is raised at once.

The state (`state_dict()`, JSON) holds the cursor, the keys seen within the window, the pending
queue and the reuse ledger: a trainer restarted from it neither re-consumes nor skips a group
(groups in the ledger are downloaded again). Not thread-safe: call every method from the loop
that runs the consumer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from slime_stoa.judging.scoring import Decode, PromptOf, Rescorer
from slime_stoa.judging.signers import Signers
from slime_stoa.protocol.kept import TrainerCopies
from slime_stoa.protocol.registry import Registry
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import PublicKey, SigningKey
from slime_stoa.protocol.store import Store

from .config import ConsumerConfig, ResolvedConfig
from .discovery import Discovery
from .downloads import Downloads
from .groups import Batch, ConsumedGroup, Pool
from .held import Held
from .intake import Intake
from .metrics import batch_metrics, delta, episode_metrics, worker_counter
from .pause import Broken, until_repaired
from .persistence import SavedState, UntrustedState, UnusableState, state_key
from .run_context import open_run_context
from .shared import Shared, patiently
from .state import ConsumerState
from .trust import WorkerTrust
from .versions import PublishedVersions
from .wait import ConsumerTimeout, Filler

__all__ = ["Batch", "ConsumedGroup", "ConsumerTimeout", "RolloutConsumer"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class RolloutConsumer:
    def __init__(
        self,
        store: Store,
        config: ResolvedConfig,
        *,
        rescorer: Rescorer,
        clock: Callable[[], float] = time.time,
        run_key: PublicKey | None = None,
        state_key: SigningKey | None = None,
    ) -> None:
        if not isinstance(config, ResolvedConfig):
            raise ValueError(
                "RolloutConsumer needs a resolved config (staleness_limit, reuse_limit and "
                "record_limits set): use RolloutConsumer.open or ConsumerConfig.resolved"
            )
        self.store = store
        self.rescorer = rescorer
        self.clock = clock
        shared = self._shared = Shared(store, config, ConsumerState(run=config.run), clock=clock)
        self.layout = shared.layout
        # A signed run (a run key: the manifest's, checked against config.run_key): its pointer and
        # version manifests are read through the run's trust (pinned key + rotations), so a forged
        # pointer cannot make a forged version "published"; records need keys of its registry.
        if run_key is None and config.run_key is not None:
            run_key = PublicKey.from_text(config.run_key)
        trust = None if run_key is None else RunTrust(config.run, run_key)
        signers = None if trust is None else Signers(store, config.run, trust, refresh_s=config.registry_refresh_s)
        self._pool = Pool()
        self._versions = PublishedVersions(shared, trust)
        self._trust = WorkerTrust(shared, self._pool, task=rescorer.task.name, signers=signers)
        self._held = Held(shared, trust=self._trust, versions=self._versions, forget=lambda name: self._downloads.forget(name))
        self._discovery = Discovery(
            store, shared.layout, shared.state, window_ms=config.skew_window_ms,
            late_window_ms=config.late_window_ms, future_ms=int(config.record_limits.max_clock_skew_s * 1000),
            admits=None if signers is None else self._held.admits, clock=clock,
        )
        self._intake = Intake(
            shared, rescorer=rescorer, versions=self._versions, trust=self._trust, pool=self._pool, held=self._held
        )
        self._downloads = Downloads(
            shared, judge=self._intake.take, refuse=self._trust.refuse_before_download, held=self._held
        )
        self._filler = Filler(
            shared, discovery=self._discovery, downloads=self._downloads, pool=self._pool,
            versions=self._versions, trust=self._trust, held=self._held,
        )
        # The trainer's own run key (when it has it) signs the state it saves in the bucket, and
        # a state read back must carry a run key's signature (`persistence.UntrustedState`).
        self._saved = SavedState(
            store, config.run, retry=self.patiently, key=state_key, trust=trust, copies=TrainerCopies.at(config.keep_dir)
        )
        self._batch_counters: dict[str, int] = {}

    @property
    def config(self) -> ResolvedConfig:
        return self._shared.config

    @config.setter
    def config(self, config: ResolvedConfig) -> None:
        self._shared.config = config

    # -- construction ------------------------------------------------------------------------
    @classmethod
    async def open(
        cls,
        store: Store,
        config: ConsumerConfig,
        *,
        decode: Decode | None = None,
        eos_ids: frozenset[int] = frozenset(),
        tokenizer_dir: Path | None = None,
        prompt_of: PromptOf | None = None,
        restore: bool = True,
        clock: Callable[[], float] = time.time,
        state_key: SigningKey | None = None,
        on_try: Callable[[Broken], object] | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> RolloutConsumer:
        """A consumer for `config.run` (a `ConsumerConfig`): reads the run manifest, task and
        tokenizer (see `run_context.open_run_context`; through store outages), and with
        `restore` resumes from the bucket's state. `state_key`: the run key, which signs the
        saved state (and a state read back must be signed by a key of the run). `on_try`,
        `sleep`: the caller's hooks on the wait for a run manifest a bucket writer deleted or
        forged (`pause.until_repaired`'s), e.g. to end it at a time limit of its own."""
        ctx = await until_repaired(  # a run manifest deleted or forged by a bucket writer: wait for it
            lambda: patiently(
                config,
                lambda: open_run_context(
                    store, config, decode=decode, eos_ids=eos_ids, tokenizer_dir=tokenizer_dir, prompt_of=prompt_of
                ),
                f"opening run {config.run!r} in {store.url}",
            ),
            config,
            on_try=on_try,
            sleep=sleep,
        )
        consumer = cls(store, ctx.config, rescorer=ctx.rescorer, clock=clock, run_key=ctx.run_key, state_key=state_key)
        if restore:
            await consumer.resume_from_bucket()
        return consumer

    async def patiently(self, op: Callable[[], Awaitable[T]], describe: str) -> T:
        """`op()`, waiting out a store outage of any length (see the module doc)."""
        return await self._shared.patiently(op, describe)

    # -- state ---------------------------------------------------------------------------------
    @property
    def counters(self) -> dict[str, int]:
        """Cumulative counters (see `metrics`); a copy."""
        return dict(self._shared.state.counters)

    def state_dict(self) -> dict[str, Any]:
        """The consumer's state as JSON-serialisable data (see `state.ConsumerState`)."""
        ledger = self._pool.ledger()
        ledger.update(self._downloads.restore)
        s = self._shared.state
        snapshot = s.snapshot(ledger=ledger, registry_serial=self._trust.registry_serial(s.registry_serial))
        return snapshot.to_json()

    def load_state_dict(self, doc: dict[str, Any]) -> None:
        """Resume from `state_dict()` output. Only before the first batch (nothing in flight)."""
        if self._downloads.inflight or self._pool or self._filler.prefetching or self._filler.discovering:
            raise RuntimeError("load_state_dict must be called before the consumer's first batch")
        state = ConsumerState.from_json(doc)
        if state.run != self.config.run:
            raise ValueError(f"consumer state is for run {state.run!r}, this consumer reads {self.config.run!r}")
        self._downloads.restore = dict(state.ledger)
        state.ledger = {}
        signers = self._trust.signers
        if signers is not None:
            signers.floor = max(signers.floor, state.registry_serial)
        self._shared.state = state
        self._discovery.state = state
        self._discovery.forget_sweep()
        self._trust.quarantine.records = state.quarantine
        self._batch_counters = dict(state.counters)

    async def bucket_state(self) -> dict[str, Any] | None:
        """The bucket's saved state (`state_dict()` form), or None; remembers its ETag for the
        next `save_state`. Waits out store outages. In a signed run the newest signed head read
        with it (`heads`) raises the registry floor (an older registry copy is refused, even with
        no state), and a state older than that head raises `persistence.StateRollback`."""
        try:
            state = await self._saved.read()
        finally:
            head, signers = self._saved.head, self._trust.signers
            if head is not None and signers is not None:
                signers.floor = max(signers.floor, head.registry_serial)
        return None if state is None else state.to_json()

    async def load_from_bucket(self, *, apply: bool = True) -> bool:
        """Read the bucket's saved state (remembering its ETag for the next `save_state`) and,
        with `apply`, resume from it. True if the bucket had one. Waits out store outages;
        `persistence.UntrustedState` or `UnusableState` for a state it cannot trust (see
        `resume_from_bucket`, which waits for its repair instead)."""
        state = await self.bucket_state()
        if state is None:
            return False
        if apply:
            self.load_state_dict(state)
        return True

    async def repaired_bucket_state(self) -> dict[str, Any] | None:
        """`bucket_state`, waiting for a state a bucket writer made unusable (garbage, a forgery,
        an old copy put back) that the trainer keeps no copy of (with `keep_dir` the copy is put
        back and no wait is needed): paused, counted `paused/consumer_state`, and reported in one
        line naming the repair, until it is repaired (`pause`). Never raises for what a writer did."""

        async def read() -> dict[str, Any] | None:
            try:
                return await self.bucket_state()
            except (UntrustedState, UnusableState) as exc:
                raise Broken(f"the consumer state {state_key(self.config.run)} is unusable", self._state_repair(), exc) from exc

        return await until_repaired(read, self.config, on_try=lambda _exc: self._shared.count("paused/consumer_state"))

    async def resume_from_bucket(self) -> bool:
        """Resume from `repaired_bucket_state` (waiting for a state a writer spoiled to be
        repaired). True if the bucket had one. How `open` resumes."""
        state = await self.repaired_bucket_state()
        if state is None:
            return False
        self.load_state_dict(state)
        return True

    def _state_repair(self) -> str:
        key = state_key(self.config.run)
        return (
            f"put back the trainer's own copy (set keep_dir: it does so itself), or delete {key} to consume afresh "
            f"(records used since the last good save may be used again), or resume from slime's checkpoint"
        )

    async def save_state(self, snapshot: dict[str, Any] | None = None) -> None:
        """Write `snapshot` (default: `state_dict()` now) to `runs/<run>/trainer/consumer.json` by
        compare-and-swap (`StateConflict` if another trainer wrote it since we last read or wrote
        it). Waits out store outages."""
        seq = await self._saved.write(ConsumerState.from_json(self.state_dict() if snapshot is None else snapshot))
        self._shared.state.seq = max(self._shared.state.seq, seq)

    # -- honest workers: quarantine and canaries ------------------------------------------------------
    @property
    def registry(self) -> Registry | None:
        """A signed run's worker registry as last read (None for an unsigned run): the trainer's
        metrics judge heartbeats by it (`protocol.heartbeat.judge_heartbeat`)."""
        return self._trust.registry

    @property
    def quarantined(self) -> dict[str, str]:
        """{worker: reason} of the workers quarantined now (see `quarantine`)."""
        return self._trust.quarantined()

    def is_canary(self, prompt_index: int) -> bool:
        """Whether the run's prompt `prompt_index` is a canary (keyed by this consumer's secret)."""
        return self._trust.is_canary(prompt_index)

    def observe_logprob_gap(
        self, worker: str, mean_abs_gap: float, tokens: int, *, prompt_index: int | None = None, plane: str = "bf16"
    ) -> list[str]:
        """Feed the learner's measurement: the mean |trainer - worker| logprob over `tokens` of
        `worker`'s tokens, under the weights they were sampled with, on `plane` (the record's
        `plane`: its limits add the plane's allowance, `QuarantineConfig.allowance`). With `prompt_index`
        (one group's measurement), a gap above `canary.max_logprob_gap` (plus that allowance) on a
        canary prompt is a strike. Returns the workers this quarantined (their groups not yet used
        are dropped). A plane the run does not offer (`record_limits.allowed_planes`: what the run
        publishes, never what a record says alone) gets no allowance: judged as bf16."""
        if plane not in self.config.record_limits.allowed_planes:
            self._shared.count("gap_plane_not_offered")
            plane = "bf16"
        return self._trust.observe_logprob_gap(worker, mean_abs_gap, tokens, prompt_index=prompt_index, plane=plane)

    def apply_releases(self, releases: Mapping[str, int]) -> list[str]:
        """Lift the quarantine of workers whose release count (the registry's `releases`, raised
        by `stoa worker release`) rose since it was quarantined; call it whenever the registry
        is read. Returns the workers released."""
        return self._trust.apply_releases(releases)

    # -- batches -------------------------------------------------------------------------------
    async def next_batch(self, n_groups: int, *, trainer_version: int, timeout_s: float | str | None = "config") -> Batch:
        """Wait until `n_groups` usable groups are ready and return them with the batch metrics.

        `trainer_version`: the trainer's latest published weight version (staleness is measured
        against it, in training steps along the weight lineage). Waits as long as it takes, or
        raises `ConsumerTimeout` after `timeout_s` seconds: by default the config's
        `wait_timeout_s`; a number or None (no limit) for this call alone (a trainer with a time
        budget waits at most what is left of it).
        """
        config, state, filler = self.config, self._shared.state, self._filler
        if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
            raise ValueError(f"n_groups must be an int >= 1, got {n_groups!r}")
        if n_groups > config.max_pool_groups:
            raise ValueError(
                f"n_groups {n_groups} exceeds max_pool_groups {config.max_pool_groups}: raise max_pool_groups"
            )
        if isinstance(trainer_version, bool) or not isinstance(trainer_version, int) or trainer_version < 0:
            raise ValueError(f"trainer_version must be an int >= 0, got {trainer_version!r}")
        await filler.stop_prefetch()
        self._versions.trainer_version = trainer_version
        if timeout_s == "config":
            timeout_s = config.wait_timeout_s
        elif isinstance(timeout_s, str) or (timeout_s is not None and not timeout_s > 0):
            raise ValueError(f"timeout_s must be a number > 0, None or 'config', got {timeout_s!r}")
        wait_s = await filler.ready(n_groups, timeout_s)
        groups = self._take(n_groups)
        gained = delta(state.counters, self._batch_counters)
        self._batch_counters = dict(state.counters)
        per_worker = Counter(g.worker for g in groups)
        metrics = batch_metrics(
            gained=gained,
            lags=[g.version_lag for g in groups],
            rewards=[r for g in groups for r in g.rewards],
            scored_rewards=self._intake.scored_rewards,
            workers=per_worker,
            wait_s=wait_s,
            pool=len(self._pool),
            pending=self._downloads.waiting(),
        )
        metrics.update(self._trust.quarantine.metrics())
        metrics.update(episode_metrics(groups, self.rescorer.task.tool_format))  # a tool task: search rate, ...
        self._intake.scored_rewards = []
        log.info(
            "stoa: batch of %d groups from %d worker(s) after %.1f s (version lag mean %.2f, max %d)",
            len(groups), len(per_worker), wait_s,
            metrics["rollout/stoa_version_lag_mean"], int(metrics["rollout/stoa_version_lag_max"]),
        )
        if config.prefetch_groups > 0:
            filler.start_prefetch(config.prefetch_groups)
        return Batch(groups=tuple(groups), metrics=metrics, trainer_version=trainer_version)

    def _take(self, n: int) -> list[ConsumedGroup]:
        shared, out = self._shared, []
        for admitted, use in self._pool.take(n, self.config.admission_order, self.config.reuse_limit):
            lag = self._versions.lag(admitted.group.weight_version)
            assert lag is not None  # `Filler.expire` dropped the pool's off-lineage groups
            out.append(ConsumedGroup.of(admitted, key=shared.prefix + admitted.name, version_lag=lag, use=use))
            shared.count("groups_used")
            shared.count("groups_reused", int(use > 1))
            shared.count(worker_counter(admitted.worker, "groups"))
        return out

    async def close(self) -> None:
        """Stop background work (the prefetch, a sweep step and downloads in flight). The store stays open."""
        await self._filler.stop_prefetch()
        await self._filler.stop_sweep()
        tasks = self._downloads.take_tasks()
        refresh = self._versions.take_task()
        if refresh is not None:
            tasks.append(refresh)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
