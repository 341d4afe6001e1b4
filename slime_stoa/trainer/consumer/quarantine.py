"""Quarantine: per-worker evidence of dishonesty, and the pure decision to stop using a worker.

Every Mac holds a token that can write anything in the bucket, so the trainer judges each worker
by what it can check itself (the consumer feeds these in; nothing here does IO):

- reward disagreements: samples whose worker reward differs from the trainer's recomputation,
  over the samples scored (`observe_scored`). An honest worker scores with the same task code,
  so its rate is ~0; a worker that claims rewards it did not earn stands out;
- the logprob gap: mean |trainer - worker| logprob of the same tokens under the same weights,
  weighted by tokens (`observe_gap`, from the learner's forward pass). An honest worker's gap is
  numerical noise (bf16, kernels: ~1e-3 in the quickstart); logprobs a worker made up are not.
  A worker serving a quantized plane (its signed records name it, `RolloutGroup.plane`) computes
  with the plane's weights, not the trainer's bf16 ones: its honest gap is the quantization's
  (measured on the tiny models, tests/test_plane_gap.py: int4 up to ~1 nat per token on a tiny
  random MoE whose routing flips), so every gap limit of a plane adds its allowance (`int8_gap_allowance`, `int4_gap_allowance`)
  and the fleet median a gap is compared with is that of the workers on the same plane;
- canary strikes: failed canary groups (`observe_canary`, see `canary`).

Tallies are exponentially weighted so they follow a worker's recent behaviour: each new sample
(token) multiplies the older weight by exp(-1 / window), i.e. they cover roughly the last
`window_samples` samples (`window_tokens` tokens). Raw counts since the worker was first seen
or last released decide when there is enough evidence to judge (`min_samples`, `min_gap_tokens`).

`decide` is the policy; thresholds are strict (`>`): a rate exactly at its limit is allowed.
A quarantined worker stays so until released: `apply_releases` takes the operator's release
counts (`stoa worker release WORKER` increments one in the run's registry) and lifts the
quarantine of each worker whose count rose since it was quarantined, with fresh statistics.

The records persist with the consumer state (`to_json` / `from_json`), so a restarted trainer
keeps its quarantines. They hold no canary secret and no per-canary pass counts (the bucket copy
of the state is readable by every worker, which must not learn which prompts are canaries).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from slime_stoa.protocol.cli_fields import setting
from slime_stoa.protocol.run_manifest import PLANES

#: Reject reasons the quarantine adds: a record of a quarantined worker, a failed canary group.
QUARANTINE_REASONS = frozenset({"quarantined", "canary_failed"})
#: Why a worker was quarantined.
Reason = Literal["canary", "reward_disagreement", "logprob_gap", "logprob_gap_relative"]
#: Workers with enough gap evidence needed before the fleet median means anything.
MEDIAN_MIN_WORKERS = 3


@dataclass(frozen=True, kw_only=True)
class QuarantineConfig:
    """Thresholds of the quarantine policy (`ConsumerConfig.quarantine`)."""

    enabled: bool = setting("False: evidence is still gathered, nobody is quarantined.", True)
    min_samples: int = setting(
        "Samples scored (since first seen or released) before the disagreement rate is judged.",
        64,
    )
    window_samples: int = setting("The disagreement rate covers about this many of the worker's latest samples.", 2048)
    max_disagreement_rate: float = setting(
        "Largest share of samples whose worker reward may differ from the trainer's.",
        0.05,
    )
    min_gap_tokens: int = setting("Tokens with a measured logprob gap before the gap is judged.", 1024)
    window_tokens: int = setting("The mean gap covers about this many of the worker's latest measured tokens.", 65536)
    max_logprob_gap: float | None = setting(
        "Largest mean |trainer - worker| logprob per token (nats); None: no absolute limit.",
        0.5,
    )
    max_gap_ratio: float | None = setting(
        "Largest mean gap as a multiple of the fleet median (median of the workers not quarantined with "
        "enough gap evidence, once there are `MEDIAN_MIN_WORKERS`); None: no relative limit.",
        10.0,
    )
    gap_floor: float = setting(
        "The relative limit never goes below this gap: a fleet whose gaps are all tiny noise quarantines "
        "nobody for noise ten times as tiny.",
        0.05,
    )
    canary_strikes: int = setting("Failed canary groups that quarantine a worker.", 2)
    int8_gap_allowance: float = setting(
        "Gap (nats per token) added to every gap limit (`max_logprob_gap`, the relative limit's floor, "
        "the canary's) for a worker on the int8 plane: above the honest gaps measured on the tiny models "
        "(mean up to ~0.18 on a random MoE), well below made-up logprobs' (4-6).",
        0.5,
    )
    int4_gap_allowance: float = setting(
        "The same for the int4 plane (honest mean gaps measured up to ~1.1 on a random MoE whose routing "
        "flips, ~0.02 on a dense model).",
        2.0,
    )

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be a bool, got {self.enabled!r}")
        for name, low in (
            ("min_samples", 0), ("window_samples", 1), ("min_gap_tokens", 0), ("window_tokens", 1),
            ("canary_strikes", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        rate = self.max_disagreement_rate
        if not _number(rate) or not 0 <= rate <= 1:
            raise ValueError(f"max_disagreement_rate must be a number in [0, 1], got {rate!r}")
        for name in ("max_logprob_gap", "max_gap_ratio"):
            value = getattr(self, name)
            if value is not None and not (_number(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0 or None, got {value!r}")
        if not (_number(self.gap_floor) and self.gap_floor >= 0):
            raise ValueError(f"gap_floor must be a number >= 0, got {self.gap_floor!r}")
        for name in ("int8_gap_allowance", "int4_gap_allowance"):
            value = getattr(self, name)
            if not (_number(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")

    def allowance(self, plane: str) -> float:
        """The gap added to every limit for a worker on `plane` (0 on bf16)."""
        return {"int8": self.int8_gap_allowance, "int4": self.int4_gap_allowance}.get(plane, 0.0)


@dataclass(slots=True)
class WorkerRecord:
    """What the trainer holds against one worker (weighted tallies, see the module doc)."""

    samples: int = 0  # samples scored since first seen or released
    w_samples: float = 0.0  # weighted samples
    w_disagreements: float = 0.0  # weighted disagreements
    gap_tokens: int = 0  # tokens with a measured gap since first seen or released
    w_tokens: float = 0.0  # weighted tokens
    w_gap: float = 0.0  # weighted sum of gap x tokens
    strikes: int = 0  # failed canaries since first seen or released
    releases: int = 0  # the release count last applied (`apply_releases`)
    reason: str = ""  # why it is quarantined; "" when it is not
    since_ms: int = 0  # when it was quarantined (ms since the epoch)
    plane: str = "bf16"  # the plane of the worker's latest measured gap

    @property
    def quarantined(self) -> bool:
        return bool(self.reason)

    @property
    def disagreement_rate(self) -> float:
        return self.w_disagreements / self.w_samples if self.w_samples > 0 else 0.0

    @property
    def mean_gap(self) -> float | None:
        return self.w_gap / self.w_tokens if self.w_tokens > 0 else None


def decay(window: int, n: float) -> float:
    """The weight left to older evidence after `n` new samples (tokens) in a `window`."""
    return math.exp(-n / window)


def fleet_median_gap(
    records: Mapping[str, WorkerRecord], config: QuarantineConfig, plane: str | None = None
) -> float | None:
    """Median mean gap of the workers not quarantined with at least `min_gap_tokens` measured
    (on `plane`, when given), or None with fewer than `MEDIAN_MIN_WORKERS` of them."""
    gaps = [
        g for r in records.values()
        if not r.quarantined and r.gap_tokens >= config.min_gap_tokens and (g := r.mean_gap) is not None
        and (plane is None or r.plane == plane)
    ]
    return statistics.median(gaps) if len(gaps) >= MEDIAN_MIN_WORKERS else None


def decide(record: WorkerRecord, config: QuarantineConfig, fleet_median: float | None = None) -> Reason | None:
    """Why `record`'s worker should be quarantined now, or None (also when it already is, or the
    policy is off). `fleet_median`: `fleet_median_gap` of the fleet on the record's plane; every
    gap limit adds the plane's allowance."""
    if not config.enabled or record.quarantined:
        return None
    if record.strikes >= config.canary_strikes:
        return "canary"
    if record.samples >= config.min_samples and record.disagreement_rate > config.max_disagreement_rate:
        return "reward_disagreement"
    gap = record.mean_gap
    if gap is not None and record.gap_tokens >= config.min_gap_tokens:
        allowance = config.allowance(record.plane)
        if config.max_logprob_gap is not None and gap > config.max_logprob_gap + allowance:
            return "logprob_gap"
        if (
            config.max_gap_ratio is not None
            and fleet_median is not None
            and gap > max(config.max_gap_ratio * fleet_median, config.gap_floor + allowance)
        ):
            return "logprob_gap_relative"
    return None


class Quarantine:
    """The quarantine book of one consumer: `records` (worker -> WorkerRecord, held by the
    consumer state and changed in place) judged by `config`. Each `observe_*` returns the workers
    it quarantined (usually none); `now_ms` stamps when."""

    def __init__(self, config: QuarantineConfig, records: dict[str, WorkerRecord] | None = None) -> None:
        self.config = config
        self.records: dict[str, WorkerRecord] = {} if records is None else records

    def record(self, worker: str) -> WorkerRecord:
        return self.records.setdefault(worker, WorkerRecord())

    def is_quarantined(self, worker: str) -> bool:
        r = self.records.get(worker)
        return r is not None and r.quarantined

    def quarantined(self) -> dict[str, str]:
        """{worker: reason} of every quarantined worker."""
        return {w: r.reason for w, r in sorted(self.records.items()) if r.quarantined}

    def observe_scored(self, worker: str, *, samples: int, disagreements: int, now_ms: int = 0) -> list[str]:
        """`samples` of `worker` scored, `disagreements` of them with another reward than the trainer's."""
        if samples <= 0:
            return []
        r = self.record(worker)
        f = decay(self.config.window_samples, samples)
        r.samples += samples
        r.w_samples = r.w_samples * f + samples
        r.w_disagreements = r.w_disagreements * f + min(max(disagreements, 0), samples)
        return self._judge([worker], now_ms)

    def observe_gap(
        self, worker: str, mean_abs_gap: float, tokens: int, *, plane: str = "bf16", now_ms: int = 0
    ) -> list[str]:
        """The learner measured a mean |trainer - worker| logprob of `mean_abs_gap` over `tokens`
        of `worker`'s tokens, made on `plane`. ValueError for a negative or non-finite gap, a bad
        token count or an unknown plane. Judges every worker: the fleet median may have moved."""
        if not (_number(mean_abs_gap) and mean_abs_gap >= 0):
            raise ValueError(f"mean_abs_gap must be a finite number >= 0, got {mean_abs_gap!r}")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
        if plane not in PLANES:
            raise ValueError(f"plane must be one of {PLANES}, got {plane!r}")
        if tokens == 0:
            return []
        r = self.record(worker)
        r.plane = plane
        f = decay(self.config.window_tokens, tokens)
        r.gap_tokens += tokens
        r.w_tokens = r.w_tokens * f + tokens
        r.w_gap = r.w_gap * f + float(mean_abs_gap) * tokens
        return self._judge(list(self.records), now_ms)

    def observe_canary(self, worker: str, *, passed: bool, now_ms: int = 0) -> list[str]:
        """A canary group of `worker` passed or failed its checks (a failure is a strike)."""
        if passed:
            return []
        self.record(worker).strikes += 1
        return self._judge([worker], now_ms)

    def apply_releases(self, releases: Mapping[str, int]) -> list[str]:
        """Take the operator's release counts (worker -> times released, only ever growing): lift
        the quarantine of every worker whose count rose since it was last applied, with fresh
        statistics, and remember every count (so an old release never lifts a later quarantine).
        Call it whenever the registry is read, the first time before any record is judged.
        Returns the workers released."""
        lifted = []
        for worker, count in sorted(releases.items()):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"release count of worker {worker!r} must be an int >= 0, got {count!r}")
            r = self.record(worker)
            if count <= r.releases:
                continue
            if r.quarantined:
                self.records[worker] = WorkerRecord(releases=count)
                lifted.append(worker)
            else:
                r.releases = count
        return lifted

    def _judge(self, workers: Iterable[str], now_ms: int) -> list[str]:
        medians: dict[str, float | None] = {p: fleet_median_gap(self.records, self.config, p) for p in PLANES}
        out = []
        for worker in workers:
            r = self.records[worker]
            reason = decide(r, self.config, medians.get(r.plane))
            if reason is not None:
                r.reason, r.since_ms = reason, now_ms
                out.append(worker)
        return out

    def metrics(self) -> dict[str, float]:
        """`rollout/stoa_quarantined_workers` and `worker/<id>/quarantined` (1 or 0) of every
        worker with a record."""
        out = {"rollout/stoa_quarantined_workers": float(sum(r.quarantined for r in self.records.values()))}
        for worker, r in sorted(self.records.items()):
            out[f"worker/{worker}/quarantined"] = float(r.quarantined)
        return out


# -- JSON (inside the consumer state) ----------------------------------------------------------------

_FIELDS = {f.name: f.type for f in dataclasses.fields(WorkerRecord)}


def records_to_json(records: Mapping[str, WorkerRecord]) -> dict[str, Any]:
    return {w: dataclasses.asdict(r) for w, r in sorted(records.items())}


def records_from_json(doc: Any) -> dict[str, WorkerRecord]:
    """Parse `records_to_json` output; ValueError naming the first bad entry. Fields a record
    lacks take their defaults (states written before a field existed)."""
    if not isinstance(doc, dict):
        raise ValueError("consumer state: 'quarantine' must be an object")
    out = {}
    for worker, entry in doc.items():
        if not isinstance(worker, str) or not worker or not isinstance(entry, dict):
            raise ValueError(f"consumer state: bad quarantine entry {worker!r}")
        values: dict[str, Any] = {}
        for name, value in entry.items():
            kind = _FIELDS.get(name)
            if kind is None:
                continue  # a newer consumer's field
            ok = (
                (kind == "int" and isinstance(value, int) and not isinstance(value, bool) and value >= 0)
                or (kind == "float" and _number(value) and value >= 0)
                or (kind == "str" and isinstance(value, str))
            )
            if name == "plane" and value not in PLANES:
                ok = False
            if not ok:
                raise ValueError(f"consumer state: bad quarantine field {worker!r}.{name}: {value!r}")
            values[name] = float(value) if kind == "float" else value
        out[worker] = WorkerRecord(**values)
    return out


def copy_records(records: Mapping[str, WorkerRecord]) -> dict[str, WorkerRecord]:
    return {w: dataclasses.replace(r) for w, r in records.items()}


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
