"""slime's rollout function for stoa: training batches from the bucket instead of SGLang engines.

Run slime with `--rollout-function-path slime_stoa.generate_rollout --rollout-num-gpus 0` (the
module path `slime_stoa.trainer.slime.rollout.generate_rollout` is the same function) and put the settings in the
`--custom-config-path` YAML, which slime sets as attributes of `args` in every process:

    stoa_bucket: s3://bucket/prefix?endpoint=https://host   # required: store URL (file://, s3://, r2://)
    stoa_run: my-run                                       # required: run name in the bucket
    # optional (ConsumerConfig fields; defaults in slime_stoa.trainer.consumer.config):
    stoa_staleness_limit: 4          # default: the run manifest's staleness_limit
    stoa_reuse_limit: 1              # default: the run manifest's reuse_limit
    stoa_wait_timeout_s: 1800        # then the rollout fails, naming the workers last seen
    stoa_poll_interval_s: 1.0        # pause between listings while waiting
    stoa_skew_window_ms: 60000       # late keys are still found this far behind the cursor
    stoa_sweep_interval_s: 5.0       # how often that window is listed again
    stoa_late_window_ms: 1800000     # records uploaded this late (a Mac back online) still count
    stoa_late_sweep_interval_s: 60   # how often that longer window is listed
    stoa_download_concurrency: 16    # record downloads in flight
    stoa_max_download_attempts: 3
    stoa_filter_all_equal: true      # drop groups whose rewards are all equal (no GRPO signal)
    stoa_verify_prompts: true        # reject records whose prompt is not their prompt_index's
    stoa_reward_tolerance: 1.0e-6    # worker vs trainer reward gap counted as a disagreement
    stoa_admission_order: oldest_version   # or fifo
    stoa_max_pool_groups: 4096       # backpressure: groups discovered but not yet used
    stoa_prefetch_groups: 0          # download this many groups in the background while the
                                     #   trainer trains (e.g. the rollout batch size)
    stoa_version_ahead_slack: 1
    stoa_progress_interval_s: 30
    stoa_tokenizer_dir: /path/to/hf  # local folder with tokenizer.json (default: the anchor's)
    stoa_state_in_bucket: true       # also write the consumer state to the bucket every rollout

Store credentials come from the environment, as for every stoa store URL.

What one call does: reads the trainer's published version from the run's pointer, waits for
`--rollout-batch-size` usable groups (`slime_stoa.trainer.consumer.RolloutConsumer`: validated,
re-scored with the run's task and tokenizer, fresh enough), and returns them as
`RolloutFnTrainOutput(samples=[[Sample] * n_samples_per_prompt] * rollout_batch_size, metrics)`.
`--n-samples-per-prompt` must equal the run's group size. Each group stays contiguous, so
slime's GRPO normalisation is per prompt.

Indices. `index` and `group_index` come from `data_source.get_samples(rollout_batch_size)`, the
documented way (slime's own rollout does the same): without `--prompt-data` slime's data source
hands out blank samples that carry only those two counters, and it checkpoints the counters, so
ids stay unique and consistent across restarts. Prompts come from the bucket, not from the data
source: do not set `--prompt-data` (its prompts would be ignored; a warning says so).

Persistence. The consumer state (cursor, keys seen in the skew window, pending keys, reuse
ledger, counters) is put in `data_source.metadata["stoa_consumer"]` after every call; slime's
data source saves its metadata with each checkpoint (`--save`, keep the rollout global dataset
on, the default) and loads it on resume, so a trainer restarted from checkpoint R resumes the
consumer exactly as it was after rollout R: no group is skipped, and only the groups of rollouts
whose training was lost are consumed again (at most reuse_limit uses per group still holds per
history). With `stoa_state_in_bucket` the state is also written to `runs/<run>/trainer/consumer.json`
(compare-and-swap: a second trainer on the same run fails instead of forking the cursor); a
process that finds no state in its checkpoint resumes from that object.

Evaluation is not supported yet: `evaluation=True` raises `EvaluationNotSupported`; do not set
`--eval-interval`.

One consumer lives per process (the RolloutManager actor), on its own event-loop thread, with
its store connections.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from slime_stoa.protocol.pulse.history import NotPublished, read_pointer
from slime_stoa.protocol.store import Store, open_store
from slime_stoa.trainer.consumer import (
    Batch,
    ConsumerConfig,
    RolloutConsumer,
    sample_fields,
)

from ..loop_thread import LoopThread
from .settings import as_bool, as_path, check_bucket_and_run, field_parsers, required_setting

log = logging.getLogger(__name__)

PREFIX = "stoa_"
METADATA_KEY = "stoa_consumer"
EVAL_MESSAGE = (
    "evaluation is not supported yet: do not set --eval-interval "
    "(stoa's rollout function only serves training batches from the bucket)"
)
T = TypeVar("T")


class EvaluationNotSupported(NotImplementedError):
    """slime asked the stoa rollout function for an evaluation."""


# -- settings -------------------------------------------------------------------------------------






# ConsumerConfig field -> parser (by the field's type); the setting is PREFIX + field name.
CONFIG_FIELDS = field_parsers(ConsumerConfig, exclude=("store_url", "run", "record_limits"))
# The settings read besides those (PREFIX + name).
OTHER_SETTINGS = ("bucket", "run", "tokenizer_dir", "state_in_bucket")


def config_from_args(args: Any) -> ConsumerConfig:
    """The ConsumerConfig from `args.stoa_*` (see the module doc); ValueError naming a bad setting."""
    if args is None:
        raise ValueError("the stoa rollout function needs slime's args (with stoa_bucket and stoa_run)")
    url, run = check_bucket_and_run(
        *(required_setting(args, PREFIX + name, needed_by="the stoa rollout function") for name in ("bucket", "run")),
        prefix=PREFIX,
    )
    fields = {
        name: parse(PREFIX + name, getattr(args, PREFIX + name))
        for name, parse in CONFIG_FIELDS.items()
        if getattr(args, PREFIX + name, None) is not None
    }
    try:
        return ConsumerConfig(store_url=url, run=run, **fields)
    except ValueError as exc:
        raise ValueError(f"invalid stoa rollout settings: {exc}") from None


def tokenizer_dir_from_args(args: Any) -> Path | None:
    value = getattr(args, PREFIX + "tokenizer_dir", None)
    return as_path(PREFIX + "tokenizer_dir", value) if value else None


def state_in_bucket_from_args(args: Any) -> bool:
    value = getattr(args, PREFIX + "state_in_bucket", None)
    return True if value is None else as_bool(PREFIX + "state_in_bucket", value)


def _positive(args: Any, name: str) -> int:
    value = getattr(args, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"slime's args.{name} must be an int >= 1, got {value!r}")
    return value


# -- the per-process session -----------------------------------------------------------------------
class _Session:
    """A RolloutConsumer on its own event-loop thread, callable from slime's synchronous code."""

    def __init__(self, config: ConsumerConfig, *, tokenizer_dir: Path | None, state_in_bucket: bool) -> None:
        self.config = config
        self.state_in_bucket = state_in_bucket
        self.resumed = False
        self._loop = LoopThread(f"stoa-consumer-{config.run}", on_close=self._aclose)
        self.store: Store | None = None
        try:
            self.store = self.call(self._open_store())
            self.consumer: RolloutConsumer = self.call(
                RolloutConsumer.open(self.store, config, tokenizer_dir=tokenizer_dir, restore=False)
            )
            self.group_size = self.consumer.config.record_limits.expected_group_size  # type: ignore[union-attr]
        except BaseException:
            self.close()
            raise

    async def _open_store(self) -> Store:
        return open_store(self.config.store_url)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.call(coro)

    def resume(self, checkpoint_state: Any) -> str:
        """Resume once: from the checkpoint's state if it has one for this run, else from the
        bucket's. Returns where from."""
        self.resumed = True
        has_bucket_state = self.call(self.consumer.load_from_bucket(apply=False))
        if isinstance(checkpoint_state, dict) and checkpoint_state.get("run") == self.config.run:
            self.call(self._apply(checkpoint_state))
            return "checkpoint"
        if has_bucket_state:
            self.call(self.consumer.load_from_bucket(apply=True))
            return "bucket"
        return "fresh"

    async def _apply(self, state: dict[str, Any]) -> None:
        self.consumer.load_state_dict(state)

    async def _batch(self, n: int) -> tuple[Batch, dict[str, Any]]:
        assert self.store is not None
        try:
            version = (await read_pointer(self.store, self.config.run)).version
        except NotPublished:
            version = 0  # nothing published yet
        batch = await self.consumer.next_batch(n, trainer_version=version)
        if self.state_in_bucket:
            await self.consumer.save_state()
        return batch, self.consumer.state_dict()

    def batch(self, n: int) -> tuple[Batch, dict[str, Any]]:
        return self.call(self._batch(n))

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


def _session(config: ConsumerConfig, args: Any) -> _Session:
    global _SESSION
    with _LOCK:
        if _SESSION is not None and _SESSION.config != config:
            log.info("stoa: rollout settings changed; reopening the consumer")
            _SESSION.close()
            _SESSION = None
        if _SESSION is None:
            _SESSION = _Session(
                config, tokenizer_dir=tokenizer_dir_from_args(args), state_in_bucket=state_in_bucket_from_args(args)
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


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """slime rollout function: `rollout_batch_size` groups from the run's bucket (module doc)."""
    if evaluation:
        raise EvaluationNotSupported(EVAL_MESSAGE)
    from slime.rollout.base_types import RolloutFnTrainOutput
    from slime.utils.types import Sample

    config = config_from_args(args)
    n_groups = _positive(args, "rollout_batch_size")
    group_size = _positive(args, "n_samples_per_prompt")
    session = _session(config, args)
    if group_size != session.group_size:
        raise ValueError(
            f"--n-samples-per-prompt is {group_size} but run {config.run!r} has groups of {session.group_size}"
        )
    metadata = _checkpoint_metadata(data_source)
    if not session.resumed:
        source = session.resume(metadata.get(METADATA_KEY) if metadata is not None else None)
        log.info("stoa: consumer of run %s resumed from %s state", config.run, source)
    batch, state = session.batch(n_groups)
    slots = data_source.get_samples(n_groups)
    samples = _slime_samples(batch, slots, Sample)
    if metadata is not None:
        metadata[METADATA_KEY] = state
    metrics = dict(batch.metrics)
    metrics["rollout/stoa_trainer_version"] = float(batch.trainer_version)
    log.info("stoa: rollout %s: %d groups at trainer v%d", rollout_id, len(samples), batch.trainer_version)
    return RolloutFnTrainOutput(samples=samples, metrics=metrics)
