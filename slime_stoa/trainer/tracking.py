"""Experiment tracking (Weights & Biases) on the trainer side, in slime's conventions.

Metric families and the step each is plotted against (slime's own `define_metric` calls, plus
`worker/*`, which slime does not define):

    train/*    train/step     one point per optimizer step (loss, grad norm, DPPO gate, logprob gap)
    rollout/*  rollout/step   one point per rollout: the consumer's `rollout/stoa_*` (staleness,
                              reuse, rejects by reason, scored reward, ...) and the fleet totals
    worker/*   rollout/step   per worker, `worker/<id>/<name>`: the consumer's counts of its
                              groups, and its heartbeat (`slime_stoa.protocol.heartbeat.worker_metrics`:
                              throughput, version, lag, uploads, spool, errors, ...; in a signed
                              run `untrusted` and `revoked`, and an untrusted one never running)

On slime's path slime owns the W&B run (`--use-wandb`): it logs what the rollout function
returns, with `rollout/step`, from the rollout process, which joined the primary run
(`init_tracking(args, primary=False)`). So the rollout function returns every number above in
its metrics and only adds the `worker/*` axis to that run (`attach_worker_axis`); `train/*` is
slime's own. The quickstart has no slime: it opens a run of its own with the same axes
(`TrackedRun`).

wandb is imported only when tracking is asked for; without the package nothing here is needed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from slime_stoa.protocol.fsutil import atomic_write
from slime_stoa.protocol.heartbeat import Heartbeat, HeartbeatTrust, read_fleet, worker_metrics
from slime_stoa.protocol.registry import Registry
from slime_stoa.protocol.store import Store

log = logging.getLogger(__name__)

WANDB_MISSING = (
    "Weights & Biases logging needs the wandb package, which is not installed: pip install wandb "
    "(from a checkout: pip install -e '.[wandb]')"
)
#: (metric or glob, the step metric it is plotted against; None: it is a step itself)
STEP_AXES: tuple[tuple[str, str | None], ...] = (
    ("train/step", None),
    ("train/*", "train/step"),
    ("rollout/step", None),
    ("rollout/*", "rollout/step"),
    ("worker/*", "rollout/step"),
)


class TrackingUnavailable(RuntimeError):
    """Tracking was asked for but cannot start (no wandb package, no W&B login); the message says
    what to do."""


def import_wandb() -> ModuleType:
    try:
        import wandb
    except ImportError:
        raise TrackingUnavailable(WANDB_MISSING) from None
    return wandb


# -- the numbers -------------------------------------------------------------------------------
#: heartbeat number -> the fleet total summed from it
FLEET_TOTALS = {
    "running": "rollout/stoa_fleet_running",
    "tokens_per_s": "rollout/stoa_fleet_tokens_per_s",
    "errors": "rollout/stoa_fleet_errors",
    "groups_spooled": "rollout/stoa_fleet_spooled",
}


#: ... and, in a signed run, the heartbeats not trusted (`heartbeat.judge_heartbeat`)
UNTRUSTED_TOTAL = "rollout/stoa_fleet_untrusted"


def fleet_metrics(
    beats: Iterable[Heartbeat], now: float, *, head: int | None = None, trust: Mapping[str, HeartbeatTrust] | None = None
) -> dict[str, float]:
    """`worker/<id>/*` for each heartbeat (lag against `head`, the trainer's version), the sums
    in `FLEET_TOTALS` and `rollout/stoa_fleet_lag_max` (over the running workers). `trust`: a
    signed run's verdict on each worker's heartbeat (an untrusted one counts as not running,
    0 tok/s, in `UNTRUSTED_TOTAL`); None for an unsigned run."""
    out: dict[str, float] = {}
    totals = dict.fromkeys(FLEET_TOTALS.values(), 0.0)
    if trust is not None:
        totals[UNTRUSTED_TOTAL] = 0.0
    lag_max = 0.0
    for beat in beats:
        prefix = f"worker/{beat.worker_id}"
        verdict = None if trust is None else trust.get(beat.worker_id, "unknown")
        mine = worker_metrics(beat, now, prefix=prefix, head=head, trust=verdict)
        out.update(mine)
        for name, total in FLEET_TOTALS.items():
            totals[total] += mine[f"{prefix}/{name}"]
        if trust is not None:
            totals[UNTRUSTED_TOTAL] += mine[f"{prefix}/untrusted"]
        lag_max = max(lag_max, mine.get(f"{prefix}/lag", 0.0))
    return {**out, **totals, "rollout/stoa_fleet_lag_max": lag_max}


async def read_fleet_metrics(
    store: Store, run: str, now: float, *, head: int | None = None, registry: Registry | None = None
) -> dict[str, float]:
    """`fleet_metrics` of the run's heartbeats in `store`, judged against a signed run's
    `registry`, plus `rollout/stoa_fleet_bad_heartbeats` (objects that could not be read or
    parsed). Raises the listing's StoreError."""
    judged, bad = await read_fleet(store, run, registry)
    trust = None if registry is None else {b.worker_id: t or "unknown" for b, t in judged}
    beats = [b for b, _ in judged]
    return {**fleet_metrics(beats, now, head=head, trust=trust), "rollout/stoa_fleet_bad_heartbeats": float(bad)}


# -- slime's run ---------------------------------------------------------------------------------
_ATTACHED: set[str] = set()  # ids of the runs given the worker/* axis in this process


def attach_worker_axis(args: Any) -> bool:
    """In slime's rollout process with `--use-wandb`: plot `worker/*` against `rollout/step` in the
    run slime joined there (once per run). False when slime tracks nothing here (no
    `--use-wandb`, or no run open in this process)."""
    if not getattr(args, "use_wandb", False):
        return False
    run = import_wandb().run
    if run is None:
        return False
    if run.id not in _ATTACHED:
        run.define_metric("worker/*", step_metric="rollout/step")
        _ATTACHED.add(run.id)
    return True


# -- a run of our own (the quickstart) -------------------------------------------------------------
class TrackedRun:
    """A W&B run with slime's step axes (`STEP_AXES`); `log` as slime's `logging_utils.log`."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self._warned = False

    @classmethod
    def open(
        cls,
        *,
        project: str,
        name: str,
        group: str,
        config: Mapping[str, Any],
        folder: Path | None = None,
        id_file: Path | None = None,
    ) -> TrackedRun:
        """Start (or, with the run id kept in `id_file`, resume) a run; its files go under
        `folder` (None: wandb's default, $WANDB_DIR or the current folder). TrackingUnavailable
        when wandb is missing or refuses to start (e.g. online without a login)."""
        wandb = import_wandb()
        run_id = id_file.read_text().strip() if id_file is not None and id_file.is_file() else None
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        try:
            run = wandb.init(
                project=project, name=name, group=group, job_type="trainer", config=dict(config),
                dir=None if folder is None else str(folder), id=run_id, resume="allow" if run_id else None,
            )
        except Exception as exc:  # wandb's errors have no common base worth naming here
            raise TrackingUnavailable(
                f"cannot start the Weights & Biases run: {exc} (log in with `wandb login`, "
                "or set WANDB_MODE=offline to keep the run on this machine)"
            ) from None
        if id_file is not None:
            atomic_write(id_file, f"{run.id}\n".encode())
        for metric, step in STEP_AXES:
            if step is None:
                run.define_metric(metric)
            else:
                run.define_metric(metric, step_metric=step)
        return cls(run)

    def log(self, metrics: Mapping[str, float], *, step_key: str, step: int) -> None:
        """One point of `metrics` at `step_key` = `step`. A failure is logged once, never raised:
        tracking must not stop training."""
        try:
            self.run.log({**metrics, step_key: step})
        except Exception as exc:
            if not self._warned:
                self._warned = True
                log.warning("Weights & Biases logging failed (training goes on): %s", exc)

    def close(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)
