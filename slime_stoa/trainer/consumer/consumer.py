"""`RolloutConsumer`: assemble batches of validated, re-scored, fresh rollout groups.

    consumer = await RolloutConsumer.open(store, ConsumerConfig(store_url=url, run="demo"))
    batch = await consumer.next_batch(256, trainer_version=7)
    ... train on batch.groups; log batch.metrics ...
    await consumer.save_state()

How a batch comes together (all on one event loop):

1. Discovery lists new keys after the cursor (`discovery.Discovery.tail`, one request per
   1,000 new keys, whatever the number of workers) into the pending queue, and now and then
   sweeps the skew window behind the cursor for late keys (and, more rarely, the longer late
   window, for workers that come back online with a spool of old records). It stops while the pool and the
   queue hold `max_pool_groups` (backpressure: the cursor waits, nothing is skipped).
2. Pending keys are downloaded oldest first, `download_concurrency` at a time, only as many as
   the batch still needs (plus `prefetch_groups` in the background between batches).
3. Each record is judged (`admission.judge_record`: decode, validate against the run's limits,
   key match, reward re-computed from the text and the label). A reject is counted by reason
   and never raised. The trainer's rewards replace the worker's; disagreements are counted per
   worker. Then the policies (`policy`), with the lag measured in training steps along the
   weight lineage (`pulse.lineage`: a trainer restarted from an earlier checkpoint starts a
   new branch): too far ahead -> rejected; drawn from an abandoned branch -> dropped
   (`off_lineage`); too stale -> dropped; all-equal rewards -> filtered (if configured); else
   the group joins the pool.
4. When the pool holds enough groups, the batch takes them in admission order; a group is used
   at most `reuse_limit` times, each time only while fresh enough.

`next_batch` waits as long as it takes by default, logging what it has and what it needs every
`progress_interval_s`; with `wait_timeout_s` set it raises `ConsumerTimeout` after that long,
naming the workers last seen and the rejects by reason.

Store outages. Every store call the loop depends on (listings, record downloads, the state in
the bucket, opening the run) waits out an outage of any length (`retry.through_outages`: the
error logged when it starts and then every `progress_interval_s`, a jittered backoff capped at
`store_retry_max_delay_s`) and carries on by itself when the store answers. A record download
that fails as unavailable asks the store a cheap question (HEAD of the pointer, one probe shared
by every download): if the store does not answer, the downloads wait without counting the try;
if it does, only that object fails and the try counts towards `max_download_attempts`. A
`StoreConfigError` (credentials, bucket) is raised at once.

The state (`state_dict()`, JSON) holds the cursor, the keys seen within the window, the pending
queue and the reuse ledger: a trainer restarted from it neither re-consumes nor skips a group
(groups in the ledger are downloaded again). Not thread-safe: call every method from the loop
that runs the consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.history import NotPublished, read_lineage, read_pointer
from slime_stoa.protocol.pulse.lineage import Lineage
from slime_stoa.protocol.records import RecordError, RolloutGroup
from slime_stoa.protocol.run_trust import RunTrust, load_rotations
from slime_stoa.protocol.signed_record import is_signed, open_signed, record_bytes
from slime_stoa.protocol.signing import PublicKey, SigningKey
from slime_stoa.protocol.store import NotFound, Store, StoreConfigError, StoreError, StoreUnavailable
from slime_stoa.protocol.store.retry import outage_policy, through_outages
from slime_stoa.protocol.validate import RecordRejected, load_record

from . import canary, policy
from .admission import Admitted, judge_record
from .config import ConsumerConfig
from .discovery import Discovery, PollResult
from .episode_metrics import episode_metrics
from .metrics import (
    batch_metrics,
    delta,
    reject_counter,
    rejects_by_reason,
    worker_counter,
)
from .persistence import UntrustedState, read_state, write_state_retried
from .quarantine import Quarantine, copy_records
from .run_context import open_run_context
from .scoring import Decode, PromptOf, Rescorer
from .signers import Signers
from .state import ConsumerState, name_worker
from .workers import (
    SHOWN,
    describe_workers,
    heartbeat_summaries,
    heartbeat_times,
    newest_first,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

LOUD_REJECTS = 10  # rejects logged as warnings per reason; later ones every 1,000th


class ConsumerTimeout(TimeoutError):
    """`next_batch` waited `wait_timeout_s` (when set) without getting enough groups."""

    def __init__(self, message: str, *, needed: int, ready: int, rejects: dict[str, int]) -> None:
        super().__init__(message)
        self.needed = needed
        self.ready = ready
        self.rejects = rejects


@dataclass(frozen=True, slots=True)
class ConsumedGroup:
    """One group of a batch, ready to train on."""

    key: str  # the record's object key
    group: RolloutGroup
    prompt: str  # the task item's prompt text
    label: str  # the task item's label
    texts: tuple[str, ...]  # decoded completions
    rewards: tuple[float, ...]  # the trainer's rewards (the worker's are in group.samples)
    version_lag: int  # training steps the weights lag the trainer's (along the lineage) when this batch was made
    use: int  # 1 the first time this group is used, 2 the second, ...

    @property
    def worker(self) -> str:
        return self.group.worker_id

    @property
    def weight_version(self) -> int:
        return self.group.weight_version


@dataclass(frozen=True)
class Batch:
    groups: tuple[ConsumedGroup, ...]
    metrics: dict[str, float]
    trainer_version: int


@dataclass(slots=True)
class _Entry:
    admitted: Admitted
    uses: int


class _Retry(Exception):
    """A download failed and stays queued for another attempt."""


class _StoreWasDown(Exception):
    """A download failed during an outage that is now over: try it again at once, uncounted."""


class RolloutConsumer:
    def __init__(
        self,
        store: Store,
        config: ConsumerConfig,
        *,
        rescorer: Rescorer,
        clock: Callable[[], float] = time.time,
        run_key: PublicKey | None = None,
        state_key: SigningKey | None = None,
    ) -> None:
        if not config.is_resolved:
            raise ValueError(
                "RolloutConsumer needs a resolved config (staleness_limit, reuse_limit and "
                "record_limits set): use RolloutConsumer.open or ConsumerConfig.resolved"
            )
        self.store = store
        self.config = config
        self.rescorer = rescorer
        self.clock = clock
        self.layout = RunLayout(config.run)
        self._prefix = self.layout.rollouts_prefix("train")
        self._state = ConsumerState(run=config.run)
        self._discovery = Discovery(
            store, self.layout, self._state, window_ms=config.skew_window_ms,
            late_window_ms=config.late_window_ms, clock=clock,
        )
        self._pool: dict[str, _Entry] = {}
        self._restore: dict[str, int] = {}  # ledger entries to download again: name -> uses
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._attempts: dict[str, int] = {}
        self._trainer_version = 0
        self._expired_at: tuple[int, tuple[int, str] | None] | None = None
        self._next_tail = -math.inf
        self._next_sweep = time.monotonic() + config.sweep_interval_s
        self._next_late_sweep = time.monotonic() + config.late_sweep_interval_s
        self._batch_counters: dict[str, int] = {}
        self._scored_rewards: list[float] = []  # every group scored since the last batch, unfiltered
        self._prefetch: asyncio.Task[bool] | None = None
        self._etag: str | None = None
        self._logged: dict[str, int] = {}
        self._probe: asyncio.Task[bool] | None = None  # the shared "is the store down?" question
        self._fatal: StoreConfigError | None = None  # a download met a config error: raise it
        # The published versions a record may claim (`_refresh_published`): {version: state digest},
        # those on the pointer's weight lineage, which also says how far each lags.
        self._published: dict[int, str] = {}
        self._lineage = Lineage.straight({})
        self._pointer_seen: tuple[int, str] | None = None  # (version, manifest) they were read from
        self._refresh_task: asyncio.Task[None] | None = None
        self._refreshes_started = 0
        self._refreshes_done = 0
        # Honest workers (`quarantine`, `canary`): the book lives in the state; the secret never leaves here.
        self._quarantine = Quarantine(config.quarantine_config, self._state.quarantine)
        key_file = config.canary_key_file
        self._canary_secret = (
            canary.load_or_create_secret(key_file) if key_file is not None and config.canary_rate > 0
            else canary.new_secret()
        )
        # A signed run (a run key: the manifest's, checked against config.run_key): the worker registry.
        if run_key is None and config.run_key is not None:
            run_key = PublicKey.from_text(config.run_key)
        # Its pointer and version manifests are read through the run's trust (pinned key + rotations),
        # so a forged pointer cannot make a forged version "published".
        self._trust = None if run_key is None else RunTrust(config.run, run_key)
        # The trainer's own run key (when it has it): signs the state it saves in the bucket, and
        # a state read back must carry a run key's signature (`persistence.UntrustedState`).
        self._state_key = state_key
        self._signers = (
            None if self._trust is None
            else Signers(store, config.run, self._trust, refresh_s=config.registry_refresh_s)
        )

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
    ) -> RolloutConsumer:
        """A consumer for `config.run`: reads the run manifest, task and tokenizer (see
        `run_context.open_run_context`; through store outages), and with `restore` resumes from
        the bucket's state. `state_key`: the run key, which signs the saved state (and a state
        read back must be signed by a key of the run)."""
        ctx = await patiently(
            config,
            lambda: open_run_context(
                store, config, decode=decode, eos_ids=eos_ids, tokenizer_dir=tokenizer_dir, prompt_of=prompt_of
            ),
            f"opening run {config.run!r} in {store.url}",
        )
        consumer = cls(store, ctx.config, rescorer=ctx.rescorer, clock=clock, run_key=ctx.run_key, state_key=state_key)
        if restore:
            await consumer.load_from_bucket()
        return consumer

    # -- store calls through outages --------------------------------------------------------------
    async def patiently(self, op: Callable[[], Awaitable[T]], describe: str) -> T:
        """`op()`, waiting out a store outage of any length (see the module doc)."""
        return await patiently(self.config, op, describe, on_outage=lambda _exc: self._count("store_outage_retries"))

    async def _store_was_down(self) -> bool:
        """After a record GET failed as unavailable: wait until the store answers a cheap probe
        (one probe shared by every download). True if it did not answer at first (an outage)."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._run_probe(), name="stoa-store-probe")
        return await asyncio.shield(self._probe)

    async def _run_probe(self) -> bool:
        down = False

        async def probe() -> bool:
            nonlocal down
            try:
                return await self.store.exists(self.layout.pointer)
            except StoreUnavailable:
                down = True
                raise

        await self.patiently(probe, f"record downloads from {self.store.url}")
        return down

    # -- state ---------------------------------------------------------------------------------
    @property
    def counters(self) -> dict[str, int]:
        """Cumulative counters (see `metrics`); a copy."""
        return dict(self._state.counters)

    def state_dict(self) -> dict[str, Any]:
        """The consumer's state as JSON-serialisable data (see `state.ConsumerState`)."""
        ledger = {name: e.uses for name, e in self._pool.items()}
        ledger.update(self._restore)
        s = self._state
        snapshot = ConsumerState(
            run=s.run,
            cursor=s.cursor,
            seen=set(s.seen),
            pending=dict(s.pending),
            ledger=ledger,
            counters=dict(s.counters),
            last_seen=dict(s.last_seen),
            replay=s.replay,
            quarantine=copy_records(s.quarantine),
            registry_serial=self._registry_serial(),
        )
        return snapshot.to_json()

    def load_state_dict(self, doc: dict[str, Any]) -> None:
        """Resume from `state_dict()` output. Only before the first batch (nothing in flight)."""
        if self._inflight or self._pool or self._prefetch is not None:
            raise RuntimeError("load_state_dict must be called before the consumer's first batch")
        state = ConsumerState.from_json(doc)
        if state.run != self.config.run:
            raise ValueError(f"consumer state is for run {state.run!r}, this consumer reads {self.config.run!r}")
        self._restore = dict(state.ledger)
        state.ledger = {}
        if self._signers is not None:
            self._signers.floor = max(self._signers.floor, state.registry_serial)
        self._state = state
        self._discovery.state = state
        self._quarantine.records = state.quarantine
        self._batch_counters = dict(state.counters)

    async def bucket_state(self) -> dict[str, Any] | None:
        """The bucket's saved state (`state_dict()` form), or None; remembers its ETag for the
        next `save_state`. Waits out store outages."""
        try:
            state, etag = await self.patiently(self._read_state, f"reading the consumer state of run {self.config.run!r}")
        except UntrustedState as exc:
            self._etag = exc.etag  # a save from another state replaces the forgery
            raise
        self._etag = etag
        return None if state is None else state.to_json()

    async def _read_state(self) -> tuple[ConsumerState | None, str | None]:
        """The bucket's state; when this trainer holds the run key, only one a run key signed."""
        if self._state_key is None:
            return await read_state(self.store, self.config.run)
        keys = [self._state_key.public]
        if self._trust is not None:
            await load_rotations(self.store, self._trust)
            keys += self._trust.keys
        return await read_state(self.store, self.config.run, signed_by=keys)

    async def load_from_bucket(self, *, apply: bool = True) -> bool:
        """Read the bucket's saved state (remembering its ETag for the next `save_state`) and,
        with `apply`, resume from it. True if the bucket had one. Waits out store outages."""
        state = await self.bucket_state()
        if state is None:
            return False
        if apply:
            self.load_state_dict(state)
        return True

    async def save_state(self, snapshot: dict[str, Any] | None = None) -> None:
        """Write `snapshot` (default: `state_dict()` now) to `runs/<run>/trainer/consumer.json` by
        compare-and-swap (`StateConflict` if another trainer wrote it since we last read or wrote
        it). Waits out store outages."""
        state = ConsumerState.from_json(self.state_dict() if snapshot is None else snapshot)
        self._etag = await write_state_retried(
            self.store,
            state,
            self._etag,
            retry=lambda attempt: self.patiently(attempt, f"saving the consumer state of run {self.config.run!r}"),
            key=self._state_key,
        )

    # -- counting ------------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        if n:
            counters = self._state.counters
            counters[name] = counters.get(name, 0) + n

    def _reject(self, name: str, reason: str, detail: str) -> None:
        worker = name_worker(name)
        self._count(reject_counter(reason))
        self._count(worker_counter(worker, "rejected"))
        seen = self._logged[reason] = self._logged.get(reason, 0) + 1
        if seen <= LOUD_REJECTS or seen % 1000 == 0:
            log.warning("stoa: rejected %s (%s, %d so far): %s", self._prefix + name, reason, seen, detail)

    def _count_poll(self, result: PollResult) -> None:
        self._count("list_requests", result.requests)
        self._count("late_keys", result.late)
        self._count(reject_counter("bad_key"), result.bad)

    # -- downloads and admission ---------------------------------------------------------------
    def _queued(self) -> int:
        """Keys waiting for a download (not in flight)."""
        return len(self._restore) + len(self._state.pending) - len(self._inflight)

    def _launch(self, want: int) -> None:
        """Start downloads, oldest key first (ledger entries before new ones)."""
        slots = min(self.config.download_concurrency, want) - len(self._inflight)
        if slots <= 0:
            return
        restore = [n for n in sorted(self._restore) if n not in self._inflight][:slots]
        slots -= len(restore)
        fresh = heapq.nsmallest(slots + len(self._inflight), self._state.pending) if slots > 0 else []
        fresh = [n for n in fresh if n not in self._inflight][:slots]
        for name in restore:
            self._start(name, None, self._restore[name])
        for name in fresh:
            self._start(name, self._state.pending[name], None)

    def _start(self, name: str, size: int | None, uses: int | None) -> None:
        self._inflight[name] = asyncio.create_task(self._download(name, size, uses), name=f"stoa-get-{name}")

    def _forget(self, name: str) -> None:
        self._state.pending.pop(name, None)
        self._restore.pop(name, None)
        self._attempts.pop(name, None)

    async def _fetch(self, name: str, size: int | None) -> bytes:
        limit = self.config.record_limits.max_record_bytes  # type: ignore[union-attr]
        if size is not None and size > limit:
            raise RecordRejected("too_large", f"object is {size} bytes, limit {limit}")
        if size == 0:
            return b""
        key = self._prefix + name
        self._count("get_requests")
        try:
            # Never more than one byte past the limit, even if the object grew since it was listed.
            result = await self.store.get(key, length=limit + 1)
        except NotFound:
            raise RecordRejected("missing", "listed, then gone (deleted by retention?)") from None
        except StoreConfigError:
            raise  # credentials, bucket: fatal for the whole consumer (see _download)
        except StoreUnavailable as exc:
            if await self._store_was_down():
                raise _StoreWasDown from None
            self._count_failed_attempt(name, key, exc)
        except StoreError as exc:
            self._count_failed_attempt(name, key, exc)
        assert result is not None
        if result.size > limit:
            raise RecordRejected("too_large", f"object is {result.size} bytes, limit {limit}")
        return result.data

    def _count_failed_attempt(self, name: str, key: str, exc: StoreError) -> NoReturn:
        """Raise `_Retry`, or reject the record once it failed `max_download_attempts` times."""
        attempts = self._attempts[name] = self._attempts.get(name, 0) + 1
        if attempts >= self.config.max_download_attempts:
            raise RecordRejected("download", f"{attempts} attempts failed; last: {exc}") from None
        log.warning("stoa: download of %s failed (attempt %d), will retry: %s", key, attempts, exc)
        raise _Retry from None

    async def _download(self, name: str, size: int | None, uses: int | None) -> None:
        try:
            if self._refuse_quarantined(name):  # not even downloaded
                return
            try:
                while True:
                    try:
                        data = await self._fetch(name, size)
                        break
                    except _StoreWasDown:
                        continue  # the outage is over: again, at once
            except _Retry:
                return
            except StoreConfigError as exc:  # the key stays queued; next_batch raises this
                self._fatal = exc
                return
            except RecordRejected as exc:
                self._forget(name)
                self._reject(name, exc.reason, exc.detail)
                return
            # Still in flight while the published versions are read: nobody downloads it again.
            if self._refreshes_done == 0:  # never read yet
                await self._refresh_published(0)
            if self._fatal is not None:  # the key stays queued; next_batch raises it
                return
            await self._know_signer(data)
            seen = self._refreshes_started
            if not self._judge(name, data, uses, refreshed=False):
                # It claims weights the trainer may have published since the last read: read again.
                await self._refresh_published(seen)
                if self._fatal is None:
                    self._judge(name, data, uses, refreshed=True)
        finally:
            self._inflight.pop(name, None)

    def _judge(self, name: str, data: bytes, uses: int | None, *, refreshed: bool = True) -> bool:
        """Admit, drop or reject one downloaded record (synchronous: no await in here). False
        (the record untouched, still queued) when `refreshed` is False and it claims a version
        or digest that the published versions as last read do not have but a fresh read may
        (see `_worth_refresh`): call again with `refreshed` after `_refresh_published`."""
        key = self.layout.parse_rollout(self._prefix + name)
        assert key is not None  # discovery only queues valid record keys
        try:
            admitted = judge_record(
                name,
                data,
                key=key,
                limits=self.config.record_limits,  # type: ignore[arg-type]
                rescorer=self.rescorer,
                reward_tolerance=self.config.reward_tolerance,
                now=self.clock(),
                published=self._published,
                replay=self._state.replay,
                registry=None if self._signers is None else self._signers.registry,
            )
        except RecordRejected as exc:
            if exc.reason in ("version", "digest"):
                claimed = self._claimed_version(data)
                if not refreshed and claimed is not None and self._worth_refresh(claimed):
                    return False
                self._forget(name)
                if claimed is not None and exc.reason == "version" and self._unpublished_verdict(name, claimed):
                    return True
                self._reject(name, exc.reason, exc.detail)
                return True
            self._forget(name)
            self._reject(name, exc.reason, exc.detail)
            return True
        except Exception as exc:  # a bug: keep consuming, but say so loudly
            self._forget(name)
            log.exception("stoa: unexpected error judging %s", self._prefix + name)
            self._reject(name, "internal", f"{type(exc).__name__}: {exc}")
            return True
        self._forget(name)
        if uses is None:  # a restored ledger entry was counted when first admitted
            self._count("samples_scored", len(admitted.rewards))
            self._scored_rewards.extend(admitted.rewards)
            self._count("reward_disagreements", admitted.disagreements)
            self._count(worker_counter(admitted.worker, "reward_disagreements"), admitted.disagreements)
        if self._honesty_refuses(admitted, uses):
            return True
        lag = self._lag(admitted.group.weight_version)
        if lag is None:
            self._count("off_lineage")
        elif policy.is_ahead(lag, self.config.version_ahead_slack):
            self._reject(
                name,
                "version_ahead",
                f"weight_version {admitted.group.weight_version}, trainer at v{self._trainer_version}",
            )
        elif policy.is_stale(lag, self.config.staleness_limit):  # type: ignore[arg-type]
            self._count("stale")
        elif uses is None and self.config.filter_all_equal and policy.all_equal(admitted.rewards):
            self._count("filtered_all_equal")
        else:
            self._pool[name] = _Entry(admitted, uses or 0)
            if uses is None:
                self._count("admitted")
        return True

    # -- the worker registry (signed runs) ----------------------------------------------------------
    def _registry_serial(self) -> int:
        """The registry serial a restarted consumer must not go below (saved with the state)."""
        floor = self._state.registry_serial
        return floor if self._signers is None else max(floor, self._signers.floor, self._signers.registry.serial)

    async def _know_signer(self, data: bytes) -> None:
        """Before judging a record of a signed run: read the registry again if the record names
        a key it does not hold (a worker added since), or if the last read is `registry_refresh_s` old."""
        signers = self._signers
        if signers is None:
            return
        unknown = False
        if is_signed(data):
            with contextlib.suppress(RecordError):  # a malformed envelope: judged as such
                unknown = signers.registry.by_key_id(open_signed(data).key_id) is None
        if unknown or signers.due():
            await self._refresh_signers()

    async def _refresh_signers(self) -> None:
        """Read the registry (unless a read started since this call did) and drop the pool's
        groups whose key is now revoked or gone, counted as rejected."""
        signers = self._signers
        assert signers is not None
        outcome = await signers.refresh(
            signers.clock(), through=lambda op: self.patiently(op, f"reading the worker registry of run {self.config.run!r}")
        )
        if outcome in ("invalid", "rollback"):
            self._count(f"registry_{outcome}")
        if outcome != "updated":
            return
        registry = signers.registry
        self.apply_releases({worker: e.releases for worker, e in registry.workers.items()})  # `stoa worker release`
        for name, entry in list(self._pool.items()):
            signer = entry.admitted.signer
            found = None if signer is None else registry.by_key_id(signer)
            if found is None or found.revoked:
                del self._pool[name]
                reason = "revoked" if found is not None else "unknown_key"
                self._reject(name, reason, f"its key {signer} was {reason.replace('_', ' ')} before the group was used")

    # -- honest workers: quarantine and canaries ------------------------------------------------------
    @property
    def quarantined(self) -> dict[str, str]:
        """{worker: reason} of the workers quarantined now (see `quarantine`)."""
        return self._quarantine.quarantined()

    def is_canary(self, prompt_index: int) -> bool:
        """Whether the run's prompt `prompt_index` is a canary (keyed by this consumer's secret)."""
        return canary.is_canary(self._canary_secret, self.rescorer.task.name, prompt_index, self.config.canary_rate)

    def observe_logprob_gap(
        self, worker: str, mean_abs_gap: float, tokens: int, *, prompt_index: int | None = None
    ) -> list[str]:
        """Feed the learner's measurement: the mean |trainer - worker| logprob over `tokens` of
        `worker`'s tokens, under the weights they were sampled with. With `prompt_index` (one
        group's measurement), a gap above `canary_max_logprob_gap` on a canary prompt is a strike.
        Returns the workers this quarantined (their groups not yet used are dropped)."""
        now = int(self.clock() * 1000)
        newly = self._quarantine.observe_gap(worker, mean_abs_gap, tokens, now_ms=now)
        if (
            prompt_index is not None and tokens > 0 and self.is_canary(prompt_index)
            and mean_abs_gap > self.config.canary_max_logprob_gap
        ):
            self._count("canary_gap_failures")
            self._count(worker_counter(worker, "canary_failed"))
            log.warning("stoa: worker %r failed a canary: logprob gap %.3g per token", worker, mean_abs_gap)
            newly += self._quarantine.observe_canary(worker, passed=False, now_ms=now)
        self._on_quarantined(newly)
        return newly

    def apply_releases(self, releases: Mapping[str, int]) -> list[str]:
        """Lift the quarantine of workers whose release count (the registry's `releases`, raised
        by `stoa worker release`) rose since it was quarantined; call it whenever the registry
        is read. Returns the workers released."""
        lifted = self._quarantine.apply_releases(releases)
        for worker in lifted:
            log.warning("stoa: worker %r released from quarantine", worker)
        return lifted

    def _refuse_quarantined(self, name: str) -> bool:
        worker = name_worker(name)
        if not self._quarantine.is_quarantined(worker):
            return False
        self._forget(name)
        self._reject(name, "quarantined", f"worker {worker!r} is quarantined ({self.quarantined.get(worker)})")
        return True

    def _honesty_refuses(self, admitted: Admitted, uses: int | None) -> bool:
        """After a record passed admission: feed its evidence to the quarantine (the first time
        it is judged) and run a canary's strict checks. True (counted) when it is refused: a
        failed canary (`canary_failed`) or a quarantined worker (`quarantined`)."""
        worker = admitted.worker
        if uses is None:
            now = int(self.clock() * 1000)
            newly = self._quarantine.observe_scored(
                worker, samples=len(admitted.rewards), disagreements=admitted.disagreements, now_ms=now
            )
            problem = None
            if self.is_canary(admitted.group.prompt_index):
                problem = canary.canary_problem(
                    admitted.group, rewards=admitted.rewards, texts=admitted.texts,
                    vocab_size=self.config.record_limits.vocab_size,  # type: ignore[union-attr]
                    config=self.config.canary_config,
                )
                newly += self._quarantine.observe_canary(worker, passed=problem is None, now_ms=now)
            self._on_quarantined(newly)
            if problem is not None:
                self._count(worker_counter(worker, "canary_failed"))
                self._reject(admitted.name, "canary_failed", problem)
                return True
        return self._refuse_quarantined(admitted.name)

    def _on_quarantined(self, workers: list[str]) -> None:
        """Drop the pool's groups of newly quarantined workers (counted `quarantine_dropped`)."""
        for worker in workers:
            dropped = [n for n, e in self._pool.items() if e.admitted.worker == worker]
            for name in dropped:
                del self._pool[name]
            self._count("quarantine_dropped", len(dropped))
            self._count("quarantined_workers")
            log.warning(
                "stoa: worker %r quarantined (%s): its records are refused and %d group(s) not yet used dropped, "
                "until `stoa worker release %s`", worker, self.quarantined.get(worker), len(dropped), worker,
            )

    # -- the published versions ------------------------------------------------------------------
    def _lag(self, weight_version: int) -> int | None:
        """Training steps `weight_version` lags the trainer's version along the weight lineage;
        None when it is on a branch a trainer restart abandoned."""
        return self._lineage.lag(self._trainer_version, weight_version)

    def _claimed_version(self, data: bytes) -> int | None:
        """The weight version a record that failed `check_published` claims (decoded again: only
        on that rare path), or None if it does not decode now."""
        try:
            return load_record(record_bytes(data), self.config.record_limits, now=self.clock()).weight_version  # type: ignore[arg-type]
        except RecordError:
            return None

    @property
    def _pointer_version(self) -> int:
        """The pointer's version when the published versions were last read (-1: none)."""
        return -1 if self._pointer_seen is None else self._pointer_seen[0]

    def _worth_refresh(self, version: int) -> bool:
        """Could reading the published versions again admit a record claiming `version`? Yes
        when it is unknown but within the slack of the pointer (published since the last read), or
        known with another digest (the version published again after a trainer restart)."""
        if version in self._published:
            return True
        if self._lineage.is_abandoned(version):
            return False
        return version <= self._pointer_version + self.config.version_ahead_slack

    def _unpublished_verdict(self, name: str, version: int) -> bool:
        """For a record whose version is not among the published ones even after a fresh read:
        True (and counted) when the trainer's policies refuse it anyway, as they did before the
        published check: too far ahead ("version_ahead"), or older than the versions a record may
        still claim ("stale": the published versions kept are those a record may be fresh at), or
        from a branch a trainer restart abandoned ("off_lineage")."""
        lag = self._lag(version)
        if lag is None:
            self._count("off_lineage")
            return True
        if policy.is_ahead(lag, self.config.version_ahead_slack):
            self._reject(name, "version_ahead", f"weight_version {version}, trainer at v{self._trainer_version}")
            return True
        if policy.is_stale(lag, self.config.staleness_limit) and version < min(self._published, default=0):  # type: ignore[arg-type]
            self._count("stale")
            return True
        return False

    def _published_depth(self) -> int:
        limit: int = self.config.staleness_limit  # type: ignore[assignment]
        return limit + self.config.version_ahead_slack + 1

    async def _refresh_published(self, after: int) -> None:
        """Make sure a read of the published versions that started after read number `after`
        has finished (one read at a time, shared by every caller)."""
        while self._refreshes_done <= after and self._fatal is None:
            if self._refresh_task is None or self._refresh_task.done():
                self._refreshes_started += 1
                self._refresh_task = asyncio.create_task(
                    self._run_refresh(self._refreshes_started), name="stoa-published-versions"
                )
            await asyncio.shield(self._refresh_task)

    async def _run_refresh(self, number: int) -> None:
        """Read the pointer (one GET) and, when it moved, the published versions along its weight
        lineage (`read_lineage`, depth staleness_limit + version_ahead_slack + 1 steps), through outages.
        Never raises: a config error becomes fatal, any other error keeps the versions last read."""
        run = self.config.run
        try:
            try:
                pointer = await self.patiently(
                    lambda: read_pointer(self.store, run, trust=self._trust), f"reading the pointer of run {run!r}"
                )
            except NotPublished:
                self._published, self._pointer_seen, self._lineage = {}, None, Lineage.straight({})
                return
            seen = (pointer.version, pointer.manifest)
            if seen != self._pointer_seen:
                depth = self._published_depth()
                lineage = await self.patiently(
                    lambda: read_lineage(self.store, run, depth=depth, pointer=pointer, trust=self._trust),
                    f"reading the published versions of run {run!r}",
                )
                self._lineage, self._published = lineage, dict(lineage.digests)
                self._pointer_seen = seen
                abandoned = ", ".join(f"v{a}..v{b}" for a, b in lineage.abandoned)
                log.info(
                    "stoa: published versions of run %r: %s%s", run, sorted(self._published),
                    f" (epoch {pointer.epoch}; abandoned by trainer restarts: {abandoned})" if abandoned else "",
                )
        except StoreConfigError as exc:
            self._fatal = exc
        except Exception as exc:
            log.error("stoa: could not read the published versions of run %r (keeping the last read): %s: %s",
                      run, type(exc).__name__, exc)
        finally:
            self._refreshes_done = max(self._refreshes_done, number)

    def _expire(self) -> None:
        """Drop pool groups that became too stale for the trainer's version, or whose branch a
        trainer restart abandoned (when the version or the lineage read moved)."""
        at = (self._trainer_version, self._pointer_seen)
        if self._expired_at == at:
            return
        self._expired_at = at
        limit: int = self.config.staleness_limit  # type: ignore[assignment]
        for name, entry in list(self._pool.items()):
            lag = self._lag(entry.admitted.group.weight_version)
            if lag is None:
                del self._pool[name]
                self._count("off_lineage")
            elif policy.is_stale(lag, limit):
                del self._pool[name]
                self._count("stale")

    # -- discovery -----------------------------------------------------------------------------
    def _capacity(self) -> int:
        return self.config.max_pool_groups - len(self._pool) - len(self._state.pending) - len(self._restore)

    async def _poll_tail(self) -> int:
        result = await self.patiently(
            lambda: self._discovery.tail(self._capacity()), f"listing new records of run {self.config.run!r}"
        )
        self._count_poll(result)
        return len(result.new)

    async def _poll_sweep(self, window_ms: int | None = None) -> int:
        result = await self.patiently(
            lambda: self._discovery.sweep(window_ms), f"listing late records of run {self.config.run!r}"
        )
        self._count_poll(result)
        if result.late:
            log.info("stoa: found %d late record(s) behind the cursor", result.late)
        return len(result.new)

    # -- the wait ------------------------------------------------------------------------------
    async def _fill(self, target: int, deadline: float | None, *, quiet: bool = False) -> bool:
        """Discover, download and judge until the pool holds `target` groups (True), or until
        `deadline` (monotonic seconds; None: no limit) passes (False). Progress is logged every
        `progress_interval_s` unless `quiet` (the background prefetch)."""
        cfg = self.config
        started = time.monotonic()
        next_log = started + cfg.progress_interval_s
        while True:
            if self._fatal is not None:
                raise self._fatal
            self._expire()
            need = target - len(self._pool)
            if need <= 0:
                return True
            self._launch(need)
            now = time.monotonic()
            # List again only when the queue cannot cover the need and there is room for more.
            listing_helps = self._queued() < need - len(self._inflight) and self._capacity() > 0
            if listing_helps and now >= self._next_tail:
                self._next_tail = now + cfg.poll_interval_s
                if self._signers is not None and self._signers.due():
                    await self._refresh_signers()  # a release (or revocation) also while nothing is admitted
                await self._poll_tail()
                continue
            if cfg.late_window_ms and now >= self._next_late_sweep:
                self._next_late_sweep = now + cfg.late_sweep_interval_s
                self._next_sweep = now + cfg.sweep_interval_s  # it covers the short window too
                await self._poll_sweep(cfg.late_window_ms)
                continue
            if now >= self._next_sweep:
                self._next_sweep = now + cfg.sweep_interval_s
                await self._poll_sweep()
                continue
            if deadline is not None and now >= deadline:
                return False
            wake = min(
                self._next_tail if listing_helps else math.inf,
                self._next_sweep,
                self._next_late_sweep if cfg.late_window_ms else math.inf,
                math.inf if deadline is None else deadline,
                next_log,
            )
            timeout = max(wake - now, 0.0)
            if self._inflight:
                await asyncio.wait(set(self._inflight.values()), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(timeout)
            if time.monotonic() >= next_log:
                next_log = time.monotonic() + cfg.progress_interval_s
                if not quiet:
                    log.info("stoa: %s", self._progress(target, time.monotonic() - started))

    def _progress(self, target: int, waited: float) -> str:
        rejects = rejects_by_reason(self._state.counters)
        reject_text = ", ".join(f"{r}={c}" for r, c in rejects.items()) or "none"
        newest = max(self._state.last_seen.items(), key=lambda kv: kv[1], default=None)
        seen = (
            f"newest record from {newest[0]} {max(self.clock() - newest[1] / 1000, 0):.0f} s ago"
            if newest
            else "no record discovered yet"
        )
        return (
            f"waited {waited:.0f} s for {target} groups of run {self.config.run!r} (trainer v{self._trainer_version}): "
            f"have {len(self._pool)} of {target} ready, {len(self._inflight)} downloading, {self._queued()} queued; "
            f"rejected so far: {reject_text}; {seen}"
        )

    async def _stop_prefetch(self) -> None:
        task, self._prefetch = self._prefetch, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:  # the next batch tries again
            exc = task.exception()
            log.warning("stoa: background prefetch failed: %s: %s", type(exc).__name__, exc)

    async def _timeout_error(self, needed: int, waited: float) -> ConsumerTimeout:
        heartbeats, error = await heartbeat_times(self.store, self.config.run)
        recent = [w for w in newest_first(self._state.last_seen, heartbeats)[:SHOWN] if w in heartbeats]
        summaries = await heartbeat_summaries(self.store, self.config.run, recent)
        workers = describe_workers(
            self._state.last_seen, heartbeats, now=self.clock(), heartbeat_error=error, summaries=summaries
        )
        counters = self._state.counters
        rejects = rejects_by_reason(counters)
        reject_text = (
            f"{sum(rejects.values())} record(s) rejected ({', '.join(f'{r}={c}' for r, c in rejects.items())})"
            if rejects
            else "no record rejected"
        )
        message = (
            f"stoa: waited {waited:.0f} s for {needed} rollout groups of run {self.config.run!r} in "
            f"{self.store.url} and have {len(self._pool)} (trainer at v{self._trainer_version}, "
            f"staleness limit {self.config.staleness_limit}). {workers}. Since start: {reject_text}; "
            f"{counters.get('stale', 0)} group(s) dropped as stale; "
            f"{counters.get('filtered_all_equal', 0)} filtered for all-equal rewards."
        )
        return ConsumerTimeout(message, needed=needed, ready=len(self._pool), rejects=rejects)

    # -- batches -------------------------------------------------------------------------------
    def _take(self, n: int) -> list[ConsumedGroup]:
        candidates = (
            policy.Candidate(name, e.admitted.group.weight_version, e.uses) for name, e in self._pool.items()
        )
        out = []
        for name in policy.select(candidates, n, self.config.admission_order):
            entry = self._pool[name]
            entry.uses += 1
            if not policy.can_reuse(entry.uses, self.config.reuse_limit):  # type: ignore[arg-type]
                del self._pool[name]
            a = entry.admitted
            out.append(
                ConsumedGroup(
                    key=self._prefix + name,
                    group=a.group,
                    prompt=a.prompt,
                    label=a.label,
                    texts=a.texts,
                    rewards=a.rewards,
                    version_lag=self._batch_lag(a.group.weight_version),
                    use=entry.uses,
                )
            )
            self._count("groups_used")
            self._count("groups_reused", int(entry.uses > 1))
            self._count(worker_counter(a.worker, "groups"))
        return out

    def _batch_lag(self, weight_version: int) -> int:
        lag = self._lag(weight_version)
        assert lag is not None  # `_expire` dropped the pool's off-lineage groups
        return lag

    async def next_batch(self, n_groups: int, *, trainer_version: int) -> Batch:
        """Wait until `n_groups` usable groups are ready and return them with the batch metrics.

        `trainer_version`: the trainer's latest published weight version (staleness is measured
        against it, in training steps along the weight lineage). Waits as long as it takes, or raises `ConsumerTimeout` after `wait_timeout_s`
        when that is set.
        """
        if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
            raise ValueError(f"n_groups must be an int >= 1, got {n_groups!r}")
        if n_groups > self.config.max_pool_groups:
            raise ValueError(
                f"n_groups {n_groups} exceeds max_pool_groups {self.config.max_pool_groups}: raise max_pool_groups"
            )
        if isinstance(trainer_version, bool) or not isinstance(trainer_version, int) or trainer_version < 0:
            raise ValueError(f"trainer_version must be an int >= 0, got {trainer_version!r}")
        await self._stop_prefetch()
        self._trainer_version = trainer_version
        # The pointer may have moved (one GET; the versions are read again only when it did).
        await self._refresh_published(self._refreshes_started)
        if self._fatal is not None:
            raise self._fatal
        start = time.monotonic()
        timeout = self.config.wait_timeout_s
        while True:
            if not await self._fill(n_groups, None if timeout is None else start + timeout):
                raise await self._timeout_error(n_groups, time.monotonic() - start)
            if self._signers is None or not self._signers.due():
                break
            await self._refresh_signers()  # a revocation reaches groups waiting in the pool
            if len(self._pool) >= n_groups:
                break
        wait_s = time.monotonic() - start
        groups = self._take(n_groups)
        gained = delta(self._state.counters, self._batch_counters)
        self._batch_counters = dict(self._state.counters)
        per_worker: dict[str, int] = {}
        for g in groups:
            per_worker[g.worker] = per_worker.get(g.worker, 0) + 1
        metrics = batch_metrics(
            gained=gained,
            lags=[g.version_lag for g in groups],
            rewards=[r for g in groups for r in g.rewards],
            scored_rewards=self._scored_rewards,
            workers=per_worker,
            wait_s=wait_s,
            pool=len(self._pool),
            pending=len(self._state.pending) + len(self._restore),
        )
        metrics["rollout/stoa_store_outage_retries"] = float(gained.get("store_outage_retries", 0))
        metrics.update(self._quarantine.metrics())
        metrics.update(episode_metrics(groups, self.rescorer.task.tool_format))  # a tool task: search rate, ...
        self._scored_rewards = []
        log.info(
            "stoa: batch of %d groups from %d worker(s) after %.1f s (version lag mean %.2f, max %d)",
            len(groups), len(per_worker), wait_s,
            metrics["rollout/stoa_version_lag_mean"], int(metrics["rollout/stoa_version_lag_max"]),
        )
        if self.config.prefetch_groups > 0:
            self._prefetch = asyncio.create_task(self._fill(self.config.prefetch_groups, None, quiet=True))
        return Batch(groups=tuple(groups), metrics=metrics, trainer_version=trainer_version)

    async def close(self) -> None:
        """Stop background work (the prefetch and downloads in flight). The store stays open."""
        await self._stop_prefetch()
        tasks: list[asyncio.Task[Any]] = list(self._inflight.values())
        if self._probe is not None:
            tasks.append(self._probe)
            self._probe = None
        if self._refresh_task is not None:
            tasks.append(self._refresh_task)
            self._refresh_task = None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._inflight.clear()


async def patiently(
    config: ConsumerConfig,
    op: Callable[[], Awaitable[T]],
    describe: str,
    *,
    on_outage: Callable[[BaseException], object] | None = None,
) -> T:
    """`op()` through store outages of any length, with `config`'s backoff cap and log interval."""
    return await through_outages(
        op,
        describe=describe,
        policy=outage_policy(config.store_retry_max_delay_s),
        log_interval_s=config.progress_interval_s,
        logger=log,
        on_outage=on_outage,
    )
