"""slime's rollout function for stoa: training batches from the bucket instead of SGLang engines.

Run slime with `--rollout-function-path slime_stoa.generate_rollout --rollout-num-gpus 0
--data-source-path slime_stoa.StoaDataSource` (the module paths
`slime_stoa.trainer.slime.rollout.generate_rollout` and
`slime_stoa.trainer.slime.data_source.StoaDataSource` are the same objects) and put the settings
in the `--custom-config-path` YAML, which slime sets as attributes of `args` in every process.
The keys, their defaults and meaning: docs/slime.md (generated from
`slime_stoa.trainer.slime.settings.StoaSettings`, which parses them).

What one call does: reads the trainer's published version from the run's pointer, waits for
`--rollout-batch-size` usable groups (`slime_stoa.trainer.consumer.RolloutConsumer`: validated,
re-scored with the run's task and tokenizer, fresh enough), persists the consumer state, and
returns them as `RolloutFnTrainOutput(samples=[[Sample] * n_samples_per_prompt] *
rollout_batch_size, metrics)`. `--n-samples-per-prompt` must equal the run's group size. Each
group stays contiguous, so slime's GRPO normalisation is per prompt.

Waiting. A call waits as long as it takes (a quiet fleet heals when Macs come back), logging
every `stoa_progress_interval_s` how many groups it has and needs; a store outage of any length
pauses it (logged with the error, every minute) and it carries on when the store answers. Only a
`StoreConfigError` (credentials, bucket) or a bad setting fails the rollout; `stoa_wait_timeout_s`
brings back a time limit.

Publisher liveness. slime calls the rollout function once per rollout and the (patched)
`update_weights` publishes a version after each train step, so each call after the first finds
the pointer one version further than the previous call saw. If it has not moved within
`stoa_publish_grace_s`, the call raises `PublishingStalled` naming the likely causes (stoa's slime
patch not applied; `stoa_publish: true` missing from the YAML; publisher errors in the trainer
log) instead of training on and on while the Macs sample old weights. The first call of a
process is exempt. With background publishing (`stoa_background_publish`, the default) the last
step's version may still be uploading when the next rollout starts, so the check allows one
version in flight: the pointer must pass the version seen two calls back (a hand-off waits for
the previous publish, so that one has committed) and a stall is caught one call later. Set `stoa_check_publishing: false` where the pointer does not move once per
rollout by design: slime's `train_async.py` (it generates rollout r+1 before publishing r) or
`--update-weights-interval` > 1; `--debug-train-only` / `--debug-rollout-only` (slime publishes
nothing) turn the check off by themselves, with a warning.

Indices. `index` and `group_index` come from `data_source.get_samples(rollout_batch_size)`
(slime's own rollout does the same): `StoaDataSource` hands out blank samples carrying only those
two counters and persists them with the consumer state; slime's default data source, without
`--prompt-data`, does the same and checkpoints them. Prompts come from the bucket, not from the
data source: do not set `--prompt-data` (its prompts would be ignored; a warning says so).

Persistence. With `--data-source-path slime_stoa.StoaDataSource` the consumer state (cursor,
keys seen in the skew window, pending keys, reuse ledger, counters) is written atomically to
`<--save>/rollout/stoa_consumer_state.json` after every batch, BEFORE the batch is returned to
slime, and (with `stoa_state_in_bucket`) to `runs/<run>/trainer/consumer.json` in the bucket
(compare-and-swap: a second trainer on the same run fails instead of forking the cursor). A
trainer killed at any moment resumes from the newer of the two: no group used twice, none
skipped; the groups of a batch that was handed out but whose training was lost are not trained
again. With slime's default data source the state goes into `data_source.metadata` (which slime
marks for removal and saves only with checkpoints): a restart from checkpoint R
consumes again the groups of the rollouts after R; a warning suggests the data source above.

Metrics. The returned `metrics` are what slime logs for the rollout (`log_rollout_data`, with
`rollout/step`, to W&B and TensorBoard): the consumer's `rollout/stoa_*` (staleness, reuse,
rejects by reason, scored reward, wait, pool) and `worker/<id>/*` counts of each worker's
groups, plus, with `stoa_worker_metrics`, each worker's heartbeat as `worker/<id>/*`
(throughput, version, lag, uploads, spool, errors) and the fleet's totals as
`rollout/stoa_fleet_*` (one listing and one read per worker per rollout; a store that does not
answer skips them for that rollout). With `--use-wandb` the rollout function also plots
`worker/*` against `rollout/step` in the run slime's rollout process joined (slime defines
`train/*`, `rollout/*`, ... but not `worker/*`); see `slime_stoa.trainer.tracking`.

Refused flags. `--get-mismatch-metrics` fails the first call (and every one after it) with one
line: slime would recompute the old log-probs for metrics the DPPO loss never computes.

Without args. slime's plugin contract tests (tests/plugin_contracts) call the function with
`args=None`; with no settings there is no bucket to read, so it returns one group of the data
source's own samples unchanged (a warning says so). A training launch always passes args.

Evaluation (`--eval-interval`, with this function as the eval path too, slime's default): an
`evaluation=True` call asks the fleet for an eval of the pointer's version
(`slime_stoa.trainer.slime.eval_rollout`).

One consumer lives per process (the RolloutManager actor), on its own event-loop thread, with
its store connections.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from slime_stoa.protocol.pulse.history import NotPublished, read_pointer
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store, StoreError, open_store
from slime_stoa.protocol.store.split import SplitStore
from slime_stoa.trainer.consumer import (
    Batch,
    ConsumerConfig,
    RolloutConsumer,
    sample_fields,
)
from slime_stoa.trainer.consumer.persistence import UntrustedState, UnusableState

from .. import tracking
from ..loop_thread import LoopThread
from .data_source import StoaDataSource
from .eval_rollout import eval_output
from .settings import StoaSettings, settings_from_args

log = logging.getLogger(__name__)

METADATA_KEY = "stoa_consumer"
DATA_SOURCE_PATH = "slime_stoa.StoaDataSource"
T = TypeVar("T")


class PublishingStalled(RuntimeError):
    """The run's pointer did not move after a train step: the trainer publishes nothing."""


# -- settings (StoaSettings; these read a few from args alone) ---------------------------------------
def publishing_check(settings: StoaSettings) -> float | None:
    """The grace (seconds) the publisher-liveness check gives a version, or None when the check
    is off (`stoa_check_publishing: false`)."""
    return settings.publish_grace_s if settings.check_publishing else None


def _positive(args: Any, name: str) -> int:
    value = getattr(args, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"slime's args.{name} must be an int >= 1, got {value!r}")
    return value


def _progress(state: dict[str, Any] | None) -> int:
    """How far a saved consumer state got: groups handed out (grows with every batch)."""
    if not isinstance(state, dict):
        return -1
    counters = state.get("counters")
    value = counters.get("groups_used", 0) if isinstance(counters, dict) else 0
    return value if isinstance(value, int) else 0


def stall_message(*, run: str, url: str, rollout_id: Any, previous: int | None, now: int | None, grace_s: float) -> str:
    seen = "no published version" if previous is None else f"v{previous}"
    found = "still no published version" if now is None else f"still v{now}"
    expected = "a first version" if previous is None else f"v{previous + 1}"
    return (
        f"stoa: the trainer is not publishing its weights: before rollout {rollout_id} the weight pointer of run "
        f"{run!r} in {url} should have moved from {seen} (an earlier rollout) to {expected} after the train step, "
        f"but it is {found} after {grace_s:.0f} s (stoa_publish_grace_s). The Macs would keep sampling old weights. "
        "Likely causes: (1) stoa's slime patch is not applied to the slime checkout this trainer runs: "
        "`python scripts/apply_slime_patches.py <slime checkout> --check` (then without --check to apply it); "
        "(2) `stoa_publish: true` is missing from the --custom-config-path YAML (it must be the YAML boolean); "
        "(3) the publisher failed: look for `stoa:` publish errors in the trainer log (the train actors, rank 0). "
        "If this launch does not publish once per rollout by design (slime's train_async.py, "
        "--update-weights-interval > 1), set `stoa_check_publishing: false`."
    )


# -- the per-process session -----------------------------------------------------------------------
class _Session:
    """A RolloutConsumer on its own event-loop thread, callable from slime's synchronous code."""

    def __init__(
        self, config: ConsumerConfig, *, tokenizer_dir: Path | None, state_in_bucket: bool, state_key: SigningKey | None = None
    ) -> None:
        self.config = config
        self.state_in_bucket = state_in_bucket
        self.resumed = False
        self.calls = 0  # rollouts served by this process
        self.last_version: int | None = None  # the pointer's version at the previous call (None: none)
        self.seen: list[int | None] = []  # the pointer's version at each call, the last few
        self.warned: set[str] = set()
        self._loop = LoopThread(f"stoa-consumer-{config.run}", on_close=self._aclose)
        self.store: Store | None = None
        try:
            self.store = self.call(self._open_store())
            self.consumer: RolloutConsumer = self.call(
                RolloutConsumer.open(self.store, config, tokenizer_dir=tokenizer_dir, restore=False, state_key=state_key)
            )
            self.group_size = self.consumer.config.record_limits.expected_group_size
        except BaseException:
            self.close()
            raise

    async def _open_store(self) -> Store:
        weights = open_store(self.config.store_url)
        if self.config.rollouts_url is None:
            return weights
        return SplitStore(weights, open_store(self.config.rollouts_url))

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.call(coro)

    def warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self.warned:
            self.warned.add(key)
            log.warning(message, *args)

    # -- resuming --------------------------------------------------------------------------------
    def resume(self, checkpoint_state: Any, *, newest: bool = False) -> str:
        """Resume once, from the checkpoint's state (if it has one for this run) or the bucket's:
        with `newest`, whichever got further (the checkpoint's on a tie); else the checkpoint's
        first (slime's metadata path). Returns where from."""
        self.resumed = True
        return self.call(self._resume(checkpoint_state, newest))

    async def _resume(self, checkpoint_state: Any, newest: bool) -> str:
        local = checkpoint_state if isinstance(checkpoint_state, dict) and checkpoint_state.get("run") == self.config.run else None
        # Reading the bucket's state also remembers its ETag for the next save. A state a bucket
        # writer spoiled (garbage, a forgery, an old genuine copy put back) never stops the
        # trainer: with the checkpoint's own state it is passed over (the next save writes over
        # it); without one the trainer's copy is put back (keep_dir), or the consumer pauses
        # until it is repaired.
        if local is None:
            bucket = await self.consumer.repaired_bucket_state()
        else:
            try:
                bucket = await self.consumer.bucket_state()
            except (UntrustedState, UnusableState) as exc:
                log.error("stoa: %s; resuming from the checkpoint's consumer state", exc)
                bucket = None
        if local is not None and (not newest or _progress(local) >= _progress(bucket)):
            self.consumer.load_state_dict(local)
            return "checkpoint"
        if bucket is not None:
            self.consumer.load_state_dict(bucket)
            return "bucket"
        return "fresh"

    # -- the pointer -----------------------------------------------------------------------------
    async def _read_version(self) -> int | None:
        """The pointer's version (None: nothing published yet), through store outages."""
        assert self.store is not None
        store = self.store

        async def read() -> int | None:
            try:
                return (await read_pointer(store, self.config.run)).version
            except NotPublished:
                return None

        return await self.consumer.patiently(read, f"reading the weight pointer of run {self.config.run!r}")

    async def _published_version(self, rollout_id: Any, grace_s: float | None, behind: int = 0) -> int | None:
        """The pointer's version; with `grace_s`, it must have moved past the version seen
        `1 + behind` calls ago within that long (the time the store was down does not count).
        `behind` is 1 with background publishing: the version of the last train step may still be
        uploading, but the one before it has committed (a hand-off waits for the previous publish)."""
        first = len(self.seen) <= behind
        previous = None if first else self.seen[-1 - behind]
        started = time.monotonic()
        version = await self._read_version()
        if first or grace_s is None:
            return version
        deadline = started + grace_s
        if version is None or (previous is not None and version <= previous):
            log.info(
                "stoa: rollout %s: waiting up to %.0f s (stoa_publish_grace_s) for the trainer to publish %s "
                "(the pointer of run %s is at %s)",
                rollout_id, grace_s, "a first version" if previous is None else f"v{previous + 1}", self.config.run,
                "no version" if version is None else f"v{version}",
            )
        while version is None or (previous is not None and version <= previous):
            now = time.monotonic()
            if now >= deadline:
                raise PublishingStalled(
                    stall_message(
                        run=self.config.run, url=self.config.store_url, rollout_id=rollout_id,
                        previous=previous, now=version, grace_s=grace_s,
                    )
                )
            await asyncio.sleep(min(self.config.poll_interval_s, deadline - now))
            before = time.monotonic()
            version = await self._read_version()
            deadline += max(time.monotonic() - before - 1.0, 0.0)  # an outage does not eat the grace
        if previous is not None and version > previous + 1 + behind:
            log.warning(
                "stoa: the weight pointer of run %s moved from v%d to v%d in one rollout (expected one version "
                "per train step): is another trainer publishing to this run?",
                self.config.run, previous, version,
            )
        return version

    # -- batches ---------------------------------------------------------------------------------
    async def _batch(
        self, n: int, rollout_id: Any, grace_s: float | None, behind: int = 0
    ) -> tuple[Batch, dict[str, Any]]:
        version = await self._published_version(rollout_id, grace_s, behind)
        batch = await self.consumer.next_batch(n, trainer_version=0 if version is None else version)
        self.last_version = version
        self.seen = [*self.seen[-2:], version]
        self.calls += 1
        return batch, self.consumer.state_dict()  # the state with this batch taken

    def batch(
        self, n: int, rollout_id: Any = None, grace_s: float | None = None, behind: int = 0
    ) -> tuple[Batch, dict[str, Any]]:
        """The next batch of `n` groups and the consumer state right after it was taken."""
        return self.call(self._batch(n, rollout_id, grace_s, behind))

    def save(self, state: dict[str, Any]) -> None:
        """Write `state` to the bucket (compare-and-swap, through store outages)."""
        self.call(self.consumer.save_state(state))

    def fleet_metrics(self, head: int) -> dict[str, float]:
        """The workers' heartbeats as metrics (`tracking.read_fleet_metrics`); {} when the store
        does not answer (said once: metrics never hold up a rollout)."""
        assert self.store is not None
        try:
            return self.call(tracking.read_fleet_metrics(
                self.store, self.config.run, time.time(), head=head, registry=self.consumer.registry
            ))
        except StoreError as exc:
            self.warn_once("fleet", "stoa: worker metrics left out (heartbeats unreadable): %s", exc)
            return {}

    async def _aclose(self) -> None:
        if getattr(self, "consumer", None) is not None:
            await self.consumer.close()
        if self.store is not None:
            await self.store.close()

    def close(self) -> None:
        """Close the consumer and the store, then stop the loop thread (idempotent; also at exit)."""
        self._loop.close()


_SESSION: _Session | None = None
_LOCK = threading.Lock()


def session_for(settings: StoaSettings) -> _Session:
    """The process's consumer session for these settings (reopened when they changed)."""
    global _SESSION
    config = settings.consumer
    with _LOCK:
        if _SESSION is not None and _SESSION.config != config:
            log.info("stoa: rollout settings changed; reopening the consumer")
            _SESSION.close()
            _SESSION = None
        if _SESSION is None:
            _SESSION = _Session(
                config, tokenizer_dir=settings.tokenizer_dir, state_in_bucket=settings.state_in_bucket,
                state_key=settings.run_key,
            )
        return _SESSION


# -- slime glue ----------------------------------------------------------------------------------
def _checkpoint_metadata(data_source: Any) -> dict | None:
    metadata = getattr(data_source, "metadata", None)
    return metadata if isinstance(metadata, dict) else None


def _slime_samples(batch: Batch, slots: list[list[Any]], sample_cls: Any) -> list[list[Any]]:
    if len(slots) != len(batch.groups):
        raise ValueError(f"data_source.get_samples gave {len(slots)} groups for {len(batch.groups)}")
    if any(getattr(s, "prompt", "") for slot in slots for s in slot):
        log.warning("stoa: the data source holds prompts (--prompt-data?); they are ignored: prompts come from the bucket")
    out = []
    for consumed, slot in zip(batch.groups, slots, strict=True):
        fields = sample_fields(
            consumed, group_index=getattr(slot[0], "group_index", None), indices=[getattr(s, "index", None) for s in slot]
        )
        out.append([sample_cls(**{**f, "status": sample_cls.Status(f["status"])}) for f in fields])
    return out


def _publish_grace(args: Any, settings: StoaSettings, session: _Session) -> float | None:
    grace = publishing_check(settings)
    if grace is None:
        return None
    for flag in ("debug_train_only", "debug_rollout_only"):
        if getattr(args, flag, False):
            session.warn_once(
                "debug",
                "stoa: --%s is set: slime publishes no weights, so the publisher-liveness check is off",
                flag.replace("_", "-"),
            )
            return None
    return grace


def _attach_worker_axis(args: Any, session: _Session) -> None:
    try:
        tracking.attach_worker_axis(args)
    except Exception as exc:  # tracking never stops training
        session.warn_once("wandb", "stoa: worker/* not given the rollout/step axis in W&B: %s", exc)


MISMATCH_METRICS = (
    "--get-mismatch-metrics is not supported with stoa: slime would recompute the old log-probs "
    "(one more forward pass per rollout) for metrics slime_stoa.dppo_loss never computes; remove it "
    "(the loss reports train/train_rollout_logprob_abs_diff and train/ppo_kl against the workers' log-probs)"
)


def refuse_unsupported(args: Any) -> None:
    """ValueError for slime flags this plugin cannot honour (`MISMATCH_METRICS`)."""
    if getattr(args, "get_mismatch_metrics", False):
        raise ValueError(MISMATCH_METRICS)


def _without_args(rollout_id: Any, data_source: Any, evaluation: bool) -> Any:
    """The answer to a call without slime's args (slime's plugin contract tests,
    tests/plugin_contracts, call `fn(None, rollout_id, data_source, evaluation)`): with no
    settings there is no bucket to read, so one group of `data_source.get_samples(1)` goes back
    as the data source made it, as a train batch or as the eval dataset `stoa_no_args`."""
    from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
    from slime.utils.types import Sample

    log.warning(
        "stoa: rollout %s called without slime's args: no bucket or run to read, so the data source's own "
        "samples are returned unchanged (slime's plugin contract check; a training launch always passes args)",
        rollout_id,
    )
    groups = data_source.get_samples(1)
    metrics = {"rollout/stoa_no_args": 1.0}
    if not evaluation:
        return RolloutFnTrainOutput(samples=groups, metrics=metrics)
    samples = [s for group in groups for s in group]
    entry = {
        "rewards": [s.reward for s in samples],
        "truncated": [s.status == Sample.Status.TRUNCATED for s in samples],
        "samples": samples,
    }
    return RolloutFnEvalOutput(data={"stoa_no_args": entry}, metrics={"eval/stoa_no_args": 1.0})


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """slime rollout function: `rollout_batch_size` groups from the run's bucket, or with
    `evaluation` the fleet's answers to an eval of the pointer's version (module doc)."""
    if args is None:
        return _without_args(rollout_id, data_source, evaluation)
    refuse_unsupported(args)
    if evaluation:
        return eval_output(args, rollout_id, session_for)
    from slime.rollout.base_types import RolloutFnTrainOutput
    from slime.utils.types import Sample

    settings = settings_from_args(args)  # a bad setting fails before anything is opened
    config = settings.consumer
    n_groups = _positive(args, "rollout_batch_size")
    group_size = _positive(args, "n_samples_per_prompt")
    session = session_for(settings)  # opening the run waits out store outages
    if group_size != session.group_size:
        raise ValueError(
            f"--n-samples-per-prompt is {group_size} but run {config.run!r} has groups of {session.group_size}"
        )
    ours = isinstance(data_source, StoaDataSource)
    metadata = None if ours else _checkpoint_metadata(data_source)
    if not ours:
        session.warn_once(
            "data_source",
            "stoa: slime's data source (%s) keeps the consumer state only in checkpoints (data_source.metadata, "
            "which slime marks for removal): a restart consumes again the groups of the rollouts after the last "
            "checkpoint. Add --data-source-path %s: the state is then saved after every batch",
            type(data_source).__name__, DATA_SOURCE_PATH,
        )
    if not session.resumed:
        if ours:
            source = session.resume(data_source.consumer_state(config.run), newest=True)
        else:
            source = session.resume(metadata.get(METADATA_KEY) if metadata is not None else None)
        log.info("stoa: consumer of run %s resumed from %s state", config.run, source)
    behind = 1 if settings.background_publish else 0  # the last step's version may still be uploading
    batch, state = session.batch(n_groups, rollout_id, _publish_grace(args, settings, session), behind)
    slots = data_source.get_samples(n_groups)
    samples = _slime_samples(batch, slots, Sample)
    # Persist the state with this batch taken BEFORE slime gets the batch: a kill at any moment
    # then neither hands a group out twice nor skips one.
    if ours:
        data_source.commit(state)
    elif metadata is not None:
        metadata[METADATA_KEY] = state
    if session.state_in_bucket:
        session.save(state)
    metrics = dict(batch.metrics)
    metrics["rollout/stoa_trainer_version"] = float(batch.trainer_version)
    if settings.worker_metrics:
        metrics.update(session.fleet_metrics(batch.trainer_version))
    _attach_worker_axis(args, session)
    log.info("stoa: rollout %s: %d groups at trainer v%d", rollout_id, len(samples), batch.trainer_version)
    return RolloutFnTrainOutput(samples=samples, metrics=metrics)
