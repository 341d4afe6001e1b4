"""The worker's own heartbeat stream in Weights & Biases (opt-in).

With `wandb_project` in the config, or `macd run --wandb-project NAME`, each `macd run` process
is one W&B run, named after the worker, grouped by the stoa run, job type "worker", and every
heartbeat the worker writes is logged as `worker/*` numbers
(`slime_stoa.protocol.heartbeat.worker_metrics`: running, tokens/s, weight version and lag,
uploads, spool, errors, swaps, memory) against `worker/step` (heartbeats so far). The same keys
in every worker's run let W&B draw the workers of a project side by side. The trainer's run
gets the same numbers from the bucket as `worker/<id>/*`; this stream is the worker's own view
and keeps coming while the bucket cannot be reached (the spool grows).

The run's files go to the data folder unless $WANDB_DIR says otherwise; WANDB_MODE=offline keeps
them on the Mac (`wandb sync` uploads them later), WANDB_ENTITY picks the team. wandb is
imported only when asked for.
"""

from __future__ import annotations

import logging
import os
import time
from types import ModuleType
from typing import Any

from slime_stoa.protocol.heartbeat import Heartbeat, worker_metrics

from .config import DaemonConfig

log = logging.getLogger("macd")

WANDB_MISSING = (
    "Weights & Biases logging (wandb_project, --wandb-project) needs the wandb package, which is not "
    "installed: pip install wandb (or leave wandb_project out)"
)
STEP = "worker/step"


class TrackingUnavailable(RuntimeError):
    """W&B logging was asked for but cannot start; the message says what to do."""


def import_wandb() -> ModuleType:
    try:
        import wandb
    except ImportError:
        raise TrackingUnavailable(WANDB_MISSING) from None
    return wandb


class HeartbeatLog:
    """One W&B run of this worker; `log` is called with every heartbeat it writes."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.step = 0
        self._warned = False

    @classmethod
    def open(cls, config: DaemonConfig, project: str) -> HeartbeatLog:
        """Start the run (blocking: call it from a thread); TrackingUnavailable when wandb is
        missing or refuses to start (e.g. online without a login)."""
        wandb = import_wandb()
        folder = None if os.environ.get("WANDB_DIR") else config.data_dir
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        try:
            run = wandb.init(
                project=project, name=config.name, group=config.run, job_type="worker",
                config={"run": config.run, "worker_id": config.worker_id, "store": config.store,
                        "batch": config.batch, "max_decode": config.max_decode},
                dir=None if folder is None else str(folder),
            )
        except Exception as exc:  # wandb's errors have no common base worth naming here
            raise TrackingUnavailable(
                f"cannot start the Weights & Biases run: {exc} (log in with `wandb login`, "
                "set WANDB_MODE=offline to keep the run on this Mac, or leave wandb_project out)"
            ) from None
        run.define_metric(STEP)
        run.define_metric("worker/*", step_metric=STEP)
        return cls(run)

    def log(self, beat: Heartbeat) -> None:
        """One point per heartbeat. A failure is logged once, never raised: tracking must not
        stop the worker."""
        try:
            self.run.log({**worker_metrics(beat, time.time()), STEP: self.step})
            self.step += 1
        except Exception as exc:
            if not self._warned:
                self._warned = True
                log.warning("Weights & Biases logging failed (the worker goes on): %s", exc)

    def close(self) -> None:
        self.run.finish()
