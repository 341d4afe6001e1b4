"""Counters and per-batch metrics.

The consumer keeps cumulative counters (persisted with its state); a batch reports what changed
since the previous batch plus statistics of the batch itself. Metric names are full names as
slime logs them unchanged: `rollout/stoa_*` for the run, `worker/<id>/*` per worker.

Counter names:
    rejected/<reason>                 records rejected, by reason
    stale                             groups dropped for lagging more than the staleness limit
    off_lineage                       groups dropped: drawn from a branch a trainer restart abandoned
    filtered_all_equal                groups dropped because their rewards were all equal
    admitted                          groups that entered the pool
    samples_scored                    samples re-scored
    reward_disagreements              samples whose worker reward differs from the trainer's
    groups_used / groups_reused       groups put in batches (reused: not for the first time)
    late_keys                         keys found behind the cursor by a sweep
    list_requests / get_requests      store requests
    downloads_cut                     record GETs cut at `download_deadline_s` (tried again later)
    tail_listings / tail_list_requests  listings of new keys after the cursor, and their LIST requests
    store_outage_retries              store calls tried again while the store was down
    registry_invalid / registry_rollback  reads of a signed run's worker registry ignored: not
                                      signed by the run key, or older than the one already read
    worker/<id>/groups                groups of this worker put in batches
    worker/<id>/reward_disagreements  its samples whose reward disagreed
    worker/<id>/rejected              its records rejected
    worker/<id>/clock_refused         its records refused for its clock (`timestamps`, `future_key`):
                                      `stoa fleet` shows them
    rejected/quarantined              records of a quarantined worker refused (`quarantine`)
    rejected/canary_failed            canary groups refused by the strict checks (`canary`)
    canary_gap_failures               canary groups whose learner-measured logprob gap was too large
    quarantine_dropped                groups dropped from the pool when their worker was quarantined
    quarantined_workers               quarantines decided (a worker released and quarantined again counts twice)
    worker/<id>/canary_failed         its failed canaries

A tool task's batches (record schema v2) add what the search agent did (`episode_metrics`):
    rollout/stoa_search_rate         share of samples that called the tool at least once
    rollout/stoa_tool_calls_mean     tool calls per sample
    rollout/stoa_turns_mean          model turns per sample
    rollout/stoa_tool_tokens_mean    tool (observation) tokens per sample, the mask's zeros
    rollout/stoa_format_error_rate   share of samples with no final answer: the text never
                                     closes one (`ToolFormat.answer_close`)
    worker/<id>/search_rate, worker/<id>/format_error_rate   the same per worker
Single-turn batches give no such metrics.

Pure: functions of counters, the batch's groups and the task's format.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from slime_stoa.tasks.tool_format import ToolFormat


def reject_counter(reason: str) -> str:
    return f"rejected/{reason}"


def worker_counter(worker: str, what: str) -> str:
    return f"worker/{worker}/{what}"


def rejects_by_reason(counters: Mapping[str, int]) -> dict[str, int]:
    """{reason: count} of the `rejected/<reason>` counters that are non-zero."""
    prefix = "rejected/"
    return {k[len(prefix) :]: v for k, v in sorted(counters.items()) if k.startswith(prefix) and v}


def delta(now: Mapping[str, int], before: Mapping[str, int]) -> Counter[str]:
    """What each counter gained since `before` (zero gains left out)."""
    return Counter({k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)})


def batch_metrics(
    *,
    gained: Mapping[str, int],
    lags: Sequence[int],
    rewards: Sequence[float],
    scored_rewards: Sequence[float] = (),
    workers: Mapping[str, int],
    wait_s: float,
    pool: int,
    pending: int,
) -> dict[str, float]:
    """The metrics of one batch: `gained` counters since the last batch, `lags` and `rewards`
    of the groups (per group, per sample), `scored_rewards` of every sample scored since the last
    batch before any filter (the policy's raw success rate), `workers` (groups per worker)."""
    scored = gained.get("samples_scored", 0)
    rejects = rejects_by_reason(gained)
    out: dict[str, float] = {
        "rollout/stoa_groups": float(len(lags)),
        "rollout/stoa_version_lag_mean": float(sum(lags) / len(lags)) if lags else 0.0,
        "rollout/stoa_version_lag_max": float(max(lags)) if lags else 0.0,
        "rollout/stoa_reward_mean": float(sum(rewards) / len(rewards)) if rewards else 0.0,
        "rollout/stoa_scored_reward_mean": (
            float(sum(scored_rewards) / len(scored_rewards)) if scored_rewards else 0.0
        ),
        "rollout/stoa_scored_samples": float(len(scored_rewards)),
        "rollout/stoa_reused_groups": float(gained.get("groups_reused", 0)),
        "rollout/stoa_stale_dropped": float(gained.get("stale", 0)),
        "rollout/stoa_off_lineage_dropped": float(gained.get("off_lineage", 0)),
        "rollout/stoa_filtered_all_equal": float(gained.get("filtered_all_equal", 0)),
        "rollout/stoa_rejected": float(sum(rejects.values())),
        "rollout/stoa_reward_disagreements": float(gained.get("reward_disagreements", 0)),
        "rollout/stoa_reward_disagreement_rate": (
            gained.get("reward_disagreements", 0) / scored if scored else 0.0
        ),
        "rollout/stoa_quarantine_rejected": float(rejects.get("quarantined", 0)),
        "rollout/stoa_quarantine_dropped": float(gained.get("quarantine_dropped", 0)),
        "rollout/stoa_canary_failed": float(rejects.get("canary_failed", 0) + gained.get("canary_gap_failures", 0)),
        "rollout/stoa_late_keys": float(gained.get("late_keys", 0)),
        "rollout/stoa_list_requests": float(gained.get("list_requests", 0)),
        "rollout/stoa_get_requests": float(gained.get("get_requests", 0)),
        "rollout/stoa_downloads_cut": float(gained.get("downloads_cut", 0)),
        "rollout/stoa_store_outage_retries": float(gained.get("store_outage_retries", 0)),
        "rollout/stoa_wait_s": float(wait_s),
        "rollout/stoa_pool_groups": float(pool),
        "rollout/stoa_pending_groups": float(pending),
        "rollout/stoa_workers": float(len(workers)),
    }
    for reason, count in rejects.items():
        out[f"rollout/stoa_rejected/{reason}"] = float(count)
    for worker, count in sorted(workers.items()):
        out[f"worker/{worker}/groups"] = float(count)
    for key, value in sorted(gained.items()):
        if key.startswith("worker/") and not key.endswith("/groups"):
            out[key] = float(value)
    return out


def episode_metrics(groups: Sequence[Any], tool_format: ToolFormat | None) -> dict[str, float]:
    """The episode metrics (module doc) for `groups` (each with `.group`, a RolloutGroup, `.texts` and `.worker`);
    empty for a single-turn task."""
    if tool_format is None:
        return {}
    rows: list[tuple[str, int, int, int, bool]] = []  # worker, calls, turns, tool tokens, format error
    for g in groups:
        for sample, text in zip(g.group.samples, g.texts, strict=True):
            tool_tokens = int(np.count_nonzero(np.asarray(sample.mask) == 0))
            rows.append((g.worker, sample.tool_calls, sample.turns, tool_tokens, tool_format.answer_close not in text))
    if not rows:
        return {}
    n = len(rows)
    out = {
        "rollout/stoa_search_rate": sum(r[1] > 0 for r in rows) / n,
        "rollout/stoa_tool_calls_mean": sum(r[1] for r in rows) / n,
        "rollout/stoa_turns_mean": sum(r[2] for r in rows) / n,
        "rollout/stoa_tool_tokens_mean": sum(r[3] for r in rows) / n,
        "rollout/stoa_format_error_rate": sum(r[4] for r in rows) / n,
    }
    for worker in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == worker]
        out[f"worker/{worker}/search_rate"] = sum(r[1] > 0 for r in mine) / len(mine)
        out[f"worker/{worker}/format_error_rate"] = sum(r[4] for r in mine) / len(mine)
    return {k: float(v) for k, v in out.items()}
