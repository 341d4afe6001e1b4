"""The learner's file, `<out>/learner.pt`: its float32 weights and optimizer state after each
publish (atomic), so that a rerun resumes the learner exactly when the bucket is at that version."""

from __future__ import annotations

import io
import logging
from pathlib import Path

from slime_stoa.protocol.fsutil import atomic_write
from slime_stoa.trainer.learner import Learner

from .resume import WeightsAt

log = logging.getLogger("stoa.quickstart")

LEARNER_FILE = "learner.pt"  # in the run folder: the learner's float32 weights and optimizer state
LEARNER_FORMAT = "stoa.quickstart-learner/1"


def save_learner(learner: Learner, path: Path, *, run: str, version: int, state_digest: str) -> None:
    """The learner's float32 weights and optimizer state after publishing `version` (atomic)."""
    import torch

    buffer = io.BytesIO()
    torch.save(
        {
            "format": LEARNER_FORMAT, "run": run, "version": version, "state_digest": state_digest,
            "model": learner.model.state_dict(), "optimizer": learner.optimizer.state_dict(),
        },
        buffer,
    )
    atomic_write(path, buffer.getvalue())


def saved_weights(path: Path) -> WeightsAt | None:
    """Which weights `save_learner`'s file at `path` holds, read without its tensors (mapped,
    not loaded); None (a damaged or foreign file logged) when it is missing or unreadable."""
    import torch

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        return None
    except Exception as exc:  # a damaged file only costs the optimizer state: say so, go on
        log.warning("ignoring %s: %s", path, exc)
        return None
    if not isinstance(saved, dict) or saved.get("format") != LEARNER_FORMAT:
        log.warning("ignoring %s: not a %s file", path, LEARNER_FORMAT)
        return None
    run, version, digest = saved.get("run"), saved.get("version"), saved.get("state_digest")
    if not (isinstance(run, str) and isinstance(version, int) and isinstance(digest, str)):
        log.warning("ignoring %s: its run, version or state digest is missing", path)
        return None
    return WeightsAt(run, version, digest)


def restore_learner(learner: Learner, path: Path, *, lr: float) -> None:
    """Put the weights and optimizer state of `save_learner`'s file into `learner`, with this
    run's learning rate `lr` (not the saved one)."""
    import torch

    saved = torch.load(path, map_location="cpu", weights_only=True)
    learner.model.load_state_dict(saved["model"])
    learner.optimizer.load_state_dict(saved["optimizer"])
    for group in learner.optimizer.param_groups:
        group["lr"] = lr


def log_stale(path: Path, saved: WeightsAt, version: int) -> None:
    """Why the learner resumes from the published weights although its file was readable."""
    log.info("%s is of v%s, the bucket is at v%d: resuming from the published weights", path, saved.version, version)
