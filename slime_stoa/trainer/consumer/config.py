"""`ConsumerConfig`: every knob of the rollout consumer, typed, frozen and checked.

Three fields may be left unset (`None`) and are then taken from the run manifest when the
consumer opens the run: the staleness and reuse limits, and the record limits (vocabulary, group
size, lengths, sampling parameters). `ConsumerConfig.resolved` builds that form,
`ResolvedConfig`: the same settings with those three definite, what a `RolloutConsumer` runs on.
The quarantine and canary settings are nested configs (`QuarantineConfig`, `CanaryConfig`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, get_args

from slime_stoa.protocol.cli_fields import setting
from slime_stoa.protocol.layout import check_name
from slime_stoa.protocol.records import SamplingParams
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.signing import PublicKey
from slime_stoa.protocol.validate import RecordLimits

from .canary import CanaryConfig
from .quarantine import QuarantineConfig

AdmissionOrder = Literal["oldest_version", "newest_version"]
ADMISSION_ORDERS: tuple[AdmissionOrder, ...] = get_args(AdmissionOrder)


@dataclass(frozen=True, kw_only=True)
class ConsumerConfig:
    """How the trainer reads rollout groups from a run's bucket."""

    store_url: str = setting(
        "The bucket: `file:///dir`, `s3://bucket/prefix?endpoint=...` or "
        "`r2://<account>/<bucket>/prefix`.",
    )
    run: str = setting("The run name (`runs/<run>/` in the bucket).")
    rollouts_url: str | None = setting(
        "Least privilege: a second bucket holding the workers' records and heartbeats (the workers' token "
        "may write only there; `slime_stoa.protocol.store.split`). None: one bucket.",
        None,
    )

    staleness_limit: int | None = setting(
        "Most weight versions a group may lag behind the trainer when it is used (lag = trainer version - "
        "record weight_version); a group that lags more is dropped and counted. None: the run manifest's "
        "`staleness_limit`.",
        None,
    )
    reuse_limit: int | None = setting(
        "Most batches one group may appear in (each time only while it is fresh enough); 1 = use once. "
        "None: the run manifest's `reuse_limit`.",
        None,
    )

    wait_timeout_s: float | None = setting(
        "How long `next_batch` waits for enough groups before raising `ConsumerTimeout`. None (the "
        "default): as long as it takes (a quiet fleet is a condition that heals: Macs come back), logging "
        "its progress every `progress_interval_s`.",
        None,
    )
    poll_interval_s: float = setting(
        "Pause between two listings of new records while waiting (one listing costs one request per 1,000 "
        "new keys).",
        1.0,
    )
    skew_window_ms: int = setting(
        "Clock-skew and late-upload window: keys stamped up to this long before the newest key discovered "
        "are still found (by a periodic sweep).",
        60_000,
    )
    sweep_interval_s: float = setting("How often the window behind the cursor is listed again for late keys.", 5.0)
    late_window_ms: int = setting(
        "The longer window of a rarer deep sweep, for records a worker uploads long after it spooled them "
        "(a Mac offline for minutes); a record that lands later than this after its key's timestamp is "
        "never discovered. 0: no deep sweep (then `skew_window_ms` is the limit).",
        1_800_000,
    )
    late_sweep_interval_s: float = setting(
        "How often the late window is listed (one request per 1,000 keys in it).",
        60.0,
    )
    download_concurrency: int = setting("Record downloads in flight at once.", 16)
    download_deadline_s: float = setting(
        "One slow object never holds a batch: a record download still running after this long (plus its "
        "listed size at 64 KiB/s) is cut, and the record is tried again once every other record waiting "
        "was tried, with only the store's own deadline then (never lost). Keep it shorter than the "
        "store's overall deadline (60 s plus the bytes at 64 KiB/s).",
        20.0,
    )
    max_download_attempts: int = setting(
        "Attempts to fetch one record when the store fails for it while answering other calls (the store "
        "retries each attempt itself); after the last the record is rejected as `download`. Tries that "
        "fail during an outage (the store answers nothing) do not count: the downloads wait.",
        3,
    )

    filter_all_equal: bool = setting(
        "Drop (and count) groups whose recomputed rewards are all equal: they carry no GRPO signal.",
        True,
    )
    verify_prompts: bool = setting(
        "Reject (as `prompt`) records whose prompt tokens are not the run's prompt for their "
        "`prompt_index`, built with the run's tokenizer and chat template (needs transformers).",
        True,
    )
    reward_tolerance: float = setting(
        "A worker reward further than this from the trainer's counts as a disagreement.",
        1e-6,
    )

    quarantine: QuarantineConfig = setting(
        "Quarantine of workers whose statistics are outliers: their records are then refused as "
        "`quarantined` and their groups not yet used are dropped, until `stoa worker release` "
        "(`QuarantineConfig`; the plugin settings `stoa_quarantine_<field>`).",
        default_factory=QuarantineConfig,
    )
    canary: CanaryConfig = setting(
        "Canaries: an undisclosed share of the prompts judged strictly (`CanaryConfig`; the plugin "
        "settings `stoa_canary_<field>`). Off by default (`rate` 0).",
        default_factory=CanaryConfig,
    )

    admission_order: AdmissionOrder = setting(
        "Which ready groups a batch takes first, after the least-used ones: `oldest_version` (lowest "
        "weight version, then key time: groups nearest their staleness limit, such as slow, hard prompts, "
        "are used before they expire) or `newest_version` (highest weight version first: the most "
        "on-policy data when the trainer is faster than its workers, as in the quickstart).",
        "oldest_version",
    )
    max_pool_groups: int = setting(
        "Backpressure: at most this many groups discovered but not yet used (downloaded or not). When "
        "full, listing stops and the cursor waits; nothing is dropped because newer groups came.",
        4096,
    )
    prefetch_groups: int = setting(
        "After a batch, keep downloading in the background until this many groups are ready for the next "
        "one (0: download only on demand).",
        0,
    )
    version_ahead_slack: int = setting(
        "A record may claim a weight version at most this far ahead of the trainer version passed to "
        "`next_batch` (a version published during the wait); further ahead is rejected as "
        "`version_ahead`.",
        1,
    )
    progress_interval_s: float = setting(
        "How often a waiting `next_batch` logs its progress (what it has, what it needs), and how often a "
        "store outage is logged again (with the error) while the consumer waits it out.",
        60.0,
    )
    store_retry_max_delay_s: float = setting(
        "Longest pause between two tries of a store call during an outage. The consumer waits out an "
        "outage of any length (pointer reads, listings, record downloads, its state) with a jittered "
        "backoff doubling from 0.5 s to this; a `StoreConfigError` fails at once.",
        30.0,
    )

    record_limits: RecordLimits | None = setting(
        "What a record must satisfy (see `slime_stoa.protocol.validate`). None: derived from the run "
        "manifest (vocabulary, group size, prompt and response lengths, sampling parameters).",
        None,
    )

    run_key: str | None = setting(
        "The run's public key (`ed25519:...`) the trainer expects: a run manifest naming another key (or "
        "none) is refused, and records must be signed by worker keys of the registry this key signed. "
        "None: the run manifest's `run_key`, if it has one (trusted as found in the bucket).",
        None,
    )
    keep_dir: str | None = setting(
        "The trainer's own folder for its copies of what it signed (`slime_stoa.protocol.kept`: run "
        "manifest, registry, consumer state and head), which it puts back when a bucket writer deletes or "
        "overwrites them. None: no copies (the trainer then cannot repair such a write).",
        None,
    )
    registry_refresh_s: float = setting(
        "How often, at most this many seconds apart, the worker registry of a signed run is read again "
        "(cached by ETag), so a revocation reaches every group not yet handed to training. It is also "
        "read when a record names a key it does not hold.",
        10.0,
    )

    def __post_init__(self) -> None:
        if not isinstance(self.store_url, str) or "://" not in self.store_url:
            raise ValueError(f"ConsumerConfig.store_url must be a store URL, got {self.store_url!r}")
        check_name("run", self.run)
        if self.rollouts_url is not None and (not isinstance(self.rollouts_url, str) or "://" not in self.rollouts_url):
            raise ValueError(f"ConsumerConfig.rollouts_url must be a store URL, got {self.rollouts_url!r}")
        for name in ("staleness_limit",):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"ConsumerConfig.{name} must be an int >= 0 or None, got {value!r}")
        if self.reuse_limit is not None and (not _is_int(self.reuse_limit) or self.reuse_limit < 1):
            raise ValueError(f"ConsumerConfig.reuse_limit must be an int >= 1 or None, got {self.reuse_limit!r}")
        if self.wait_timeout_s is not None:
            _check_positive("wait_timeout_s", self.wait_timeout_s, "or None")
        for name in (
            "poll_interval_s",
            "sweep_interval_s",
            "late_sweep_interval_s",
            "progress_interval_s",
            "store_retry_max_delay_s",
            "registry_refresh_s",
            "download_deadline_s",
        ):
            _check_positive(name, getattr(self, name))
        if self.run_key is not None:
            PublicKey.from_text(self.run_key)  # ValueError naming the problem
        for name, low in (
            ("skew_window_ms", 0),
            ("late_window_ms", 0),
            ("download_concurrency", 1),
            ("max_download_attempts", 1),
            ("max_pool_groups", 1),
            ("prefetch_groups", 0),
            ("version_ahead_slack", 0),
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"ConsumerConfig.{name} must be an int >= {low}, got {value!r}")
        for name in ("filter_all_equal", "verify_prompts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ConsumerConfig.{name} must be a bool, got {getattr(self, name)!r}")
        tol = self.reward_tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (math.isfinite(tol) and tol >= 0):
            raise ValueError(f"ConsumerConfig.reward_tolerance must be a number >= 0, got {tol!r}")
        if not isinstance(self.quarantine, QuarantineConfig):
            raise ValueError(f"ConsumerConfig.quarantine must be a QuarantineConfig, got {self.quarantine!r}")
        if not isinstance(self.canary, CanaryConfig):
            raise ValueError(f"ConsumerConfig.canary must be a CanaryConfig, got {self.canary!r}")
        if self.admission_order not in ADMISSION_ORDERS:
            raise ValueError(
                f"ConsumerConfig.admission_order must be one of {ADMISSION_ORDERS}, got {self.admission_order!r}"
            )
        if self.record_limits is not None and not isinstance(self.record_limits, RecordLimits):
            raise ValueError("ConsumerConfig.record_limits must be a RecordLimits or None")

    def resolved(self, manifest: RunManifest, *, vocab_size: int) -> ResolvedConfig:
        """These settings with every unset field taken from the run manifest (`vocab_size`: the model's)."""
        if manifest.run != self.run:
            raise ValueError(f"run manifest is for run {manifest.run!r}, the consumer reads {self.run!r}")
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        settings.update(
            staleness_limit=manifest.staleness_limit if self.staleness_limit is None else self.staleness_limit,
            reuse_limit=manifest.reuse_limit if self.reuse_limit is None else self.reuse_limit,
            record_limits=self.record_limits or limits_for_run(manifest, vocab_size=vocab_size),
        )
        return ResolvedConfig(**settings)


@dataclass(frozen=True, kw_only=True)
class ResolvedConfig(ConsumerConfig):
    """A `ConsumerConfig` with nothing left to the run manifest (`ConsumerConfig.resolved`)."""

    staleness_limit: int
    reuse_limit: int
    record_limits: RecordLimits

    def __post_init__(self) -> None:
        super().__post_init__()
        if None in (self.staleness_limit, self.reuse_limit, self.record_limits):
            raise ValueError("ResolvedConfig needs staleness_limit, reuse_limit and record_limits")


def limits_for_run(manifest: RunManifest, *, vocab_size: int) -> RecordLimits:
    """The record limits a run's manifest implies: train records of exactly G samples, from this
    run, drawn with the manifest's sampling parameters, within its prompt and response lengths, on
    a plane the run serves: bf16, the run's `plane`, or a quantized plane it publishes (`planes`).

    A quantized plane widens every logprob-gap limit of the quarantine (`QuarantineConfig.allowance`),
    so the plane a record may claim is bound to what the trainer's own run manifest says, never to
    the record alone: int8 on a run that neither serves nor publishes it would let made-up logprobs
    (0.9 nats per token) pass as quantization noise, so such a record is refused (`plane`)."""
    if not _is_int(vocab_size) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    return RecordLimits(
        vocab_size=vocab_size,
        max_samples=max(64, manifest.group_size),
        expected_group_size=manifest.group_size,
        max_prompt_tokens=manifest.max_prompt_tokens,
        max_response_tokens=manifest.max_tokens,
        allowed_kinds=frozenset({"train"}),
        allowed_planes=frozenset({"bf16", manifest.plane, *manifest.planes}),
        expected_run=manifest.run,
        expected_sampling=SamplingParams(
            temperature=manifest.temperature,
            top_p=manifest.top_p,
            max_tokens=manifest.max_tokens,
            stop=manifest.stop,
        ),
    )


def _check_positive(name: str, value: object, extra: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"ConsumerConfig.{name} must be a number > 0{' ' + extra if extra else ''}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
