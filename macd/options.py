"""The worker loop's timing knobs (the daemon config holds the rest)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    """Timing knobs of the loop (the daemon config holds the rest)."""

    heartbeat_s: float = 10.0  # seconds between heartbeat writes
    idle_poll_s: float = 2.0  # wait between pointer polls while no weights are published yet
    flush_timeout_s: float = 30.0  # on stop: how long to keep uploading the spool
    final_beat_timeout_s: float = 10.0  # on stop: how long the last heartbeat write may take
    max_cohorts: int | None = None  # stop after this many cohorts (tests, benchmarks)
    seed: int | None = None  # prompt choice and sampling seed (None: random)
    budget_poll_s: float = 0.25  # pointer poll interval while waiting for a new version
    budget_patience_s: float = 10.0  # after this long without a new version, generate another round
    weights_poll_s: float = 1.0  # pointer poll interval while generating (syncs run beside generation)
    swap_drain_steps: int = 32  # at a new version: decode steps in-flight groups get to finish before the rest are dropped
    swap_drain_s: float = 2.0  # ... and the longest that drain lasts, waits for tools included
    setup_retry_max_s: float = 30.0  # longest wait between two tries to read the run and its weights
    lock_wait_s: float = 0.0  # spool in use by a live process: wait this long for it to stop, then fail
    repeat_log_s: float = 60.0  # the same error again within this long is counted, not logged again
    eval_poll_s: float = 10.0  # how often the eval requests are listed (macd/evaluate.py)
    progress_log_s: float = 30.0  # while generating, one log line this often: tokens so far, tok/s, groups in flight
    registry_poll_s: float = 30.0  # how often a signed run's worker registry is read for a revocation (macd/revocation.py)
