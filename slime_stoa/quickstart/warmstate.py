"""The warm start's saved state (`<out>/warm-start.pt`): a stopped warm start resumes, not restarts.

Every `SAVE_EVERY` steps, and at a stop signal (between two steps), the learner's float32
weights and optimizer state, the step count, the losses so far and the state of the random
generator that draws the batches are written atomically. A rerun of a new run whose saved state
is of the same warm start (`key`: run, task, seed, learning rate, model folder) takes it up at
that step, so the steps it takes are the ones a run never stopped would have taken. A saved
state of a finished warm start lets a rerun skip it altogether.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slime_stoa.protocol.fsutil import atomic_write

from .interrupt import Interrupted
from .meter import StepMeter

log = logging.getLogger("stoa.quickstart")

WARM_FILE = "warm-start.pt"  # in the run folder
WARM_FORMAT = "stoa.quickstart-warm-start/1"
SAVE_EVERY = 50  # steps between two saves


@dataclass
class WarmState:
    """Where a warm start stands: `step` steps taken, their `losses`."""

    step: int
    losses: list[float]
    resumed_from: int = 0  # the step this session took it up at (0: from the start)


def save_warm_state(path: Path, learner: Any, key: dict[str, Any], state: WarmState, rng: np.random.Generator) -> None:
    import torch

    buffer = io.BytesIO()
    torch.save(
        {
            "format": WARM_FORMAT, "key": key, "step": state.step, "losses": list(state.losses),
            "rng": rng.bit_generator.state, "model": learner.model.state_dict(),
            "optimizer": learner.optimizer.state_dict(),
        },
        buffer,
    )
    atomic_write(path, buffer.getvalue())


def load_warm_state(path: Path, learner: Any, key: dict[str, Any], rng: np.random.Generator) -> WarmState | None:
    """The saved state of this warm start put into `learner` and `rng`; None (both untouched)
    when there is none, or it is of another warm start or unreadable (with a warning)."""
    import torch

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return None
    except Exception as exc:  # a damaged file costs only the steps it held
        log.warning("ignoring %s: %s; the warm start starts over", path, exc)
        return None
    if not isinstance(saved, dict) or saved.get("format") != WARM_FORMAT:
        log.warning("ignoring %s: not a %s file; the warm start starts over", path, WARM_FORMAT)
        return None
    if saved.get("key") != key:
        log.warning("ignoring %s: it is of another warm start (%s); this one starts over", path, saved.get("key"))
        return None
    model = {k: v.clone() for k, v in learner.model.state_dict().items()}
    try:
        learner.model.load_state_dict(saved["model"])
        learner.optimizer.load_state_dict(saved["optimizer"])
        rng.bit_generator.state = saved["rng"]
        step, losses = int(saved["step"]), [float(x) for x in saved["losses"]]
    except Exception as exc:
        learner.model.load_state_dict(model)
        log.warning("ignoring %s: %s; the warm start starts over", path, exc)
        return None
    return WarmState(step=step, losses=losses, resumed_from=step)


def run_warm_steps(
    learner: Any, *, steps: int, step: Callable[[int], float], rng: np.random.Generator, path: Path | None,
    key: dict[str, Any], check: Callable[[], None] = lambda: None, meter: StepMeter | None = None,
    on_resume: Callable[[WarmState], None] = lambda state: None, save_every: int = SAVE_EVERY,
) -> WarmState:
    """`step(i)` (one supervised step, its loss; it draws from `rng`) for i up to `steps`, from
    the saved state at `path` when there is one of this warm start (`on_resume` is told);
    saved every `save_every` steps and when `check()` raises `Interrupted`. `path` None: none
    saved or read."""
    state = (load_warm_state(path, learner, key, rng) if path is not None else None) or WarmState(0, [])
    if state.step:
        on_resume(state)
    if meter is not None:
        meter.start_done = meter.last_done = min(state.step, steps)
    try:
        while state.step < steps:
            check()
            state.losses.append(step(state.step))
            state.step += 1
            if meter is not None:
                meter.update(state.step, loss=float(np.mean(state.losses[-10:])))
            if path is not None and state.step % save_every == 0:
                save_warm_state(path, learner, key, state, rng)
    except Interrupted:
        if path is not None and state.step > state.resumed_from:
            save_warm_state(path, learner, key, state, rng)
        raise
    if path is not None and state.step % save_every:
        save_warm_state(path, learner, key, state, rng)
    return state
