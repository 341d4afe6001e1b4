"""The quickstart learner's checkpoints: `<out>/checkpoints/v<N>.pt`, one per published version.

Each holds what a restart from version N needs: the learner's float32 weights and optimizer
state after publishing N, N's state digest (the weights it published), and the consumer's state
of then (taken with the batch that trained N; None for the first version, before any batch).
Written atomically after every publish; only the newest `KEEP` are kept.

`stoa quickstart --restart-from N` restarts the run from checkpoint N while the pointer may be
further on, as a slime trainer restarted from an older checkpoint does: the learner publishes N's
weights first (the publisher finds them bit-identical to N's and marks the version a restore: a
new lineage epoch, the versions after N an abandoned branch), the consumer goes back to N's
state (the batches of the abandoned branch were never learnt from) and training continues.
"""

from __future__ import annotations

import io
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_stoa.protocol.fsutil import atomic_write
from slime_stoa.protocol.pulse.history import read_lineage
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.store import Store

from .config import QuickstartError

log = logging.getLogger("stoa.quickstart")

CHECKPOINTS_DIR = "checkpoints"  # in the run folder
CHECKPOINT_FORMAT = "stoa.quickstart-checkpoint/1"
KEEP = 4  # checkpoints kept: the newest versions'
_NAME = re.compile(r"v(\d+)\.pt")


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """One version's checkpoint, as read back."""

    run: str
    version: int  # the published version it is the learner of
    state_digest: str  # that version's state digest (of the bf16 weights it published)
    model: dict[str, Any]  # the learner's float32 `state_dict()`
    optimizer: dict[str, Any]  # the optimizer's `state_dict()`
    consumer: dict[str, Any] | None  # the consumer's `state_dict()` of then; None: before any batch


def checkpoint_path(folder: Path, version: int) -> Path:
    return folder / f"v{version}.pt"


def checkpoint_versions(folder: Path) -> list[int]:
    """The versions with a checkpoint in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    return sorted(int(m[1]) for p in folder.iterdir() if (m := _NAME.fullmatch(p.name)) is not None)


def save_checkpoint(
    folder: Path,
    *,
    run: str,
    version: int,
    state_digest: str,
    model: dict[str, Any],
    optimizer: dict[str, Any],
    consumer: dict[str, Any] | None,
    keep: int = KEEP,
) -> Path:
    """Write checkpoint `version` (atomic), then delete all but the newest `keep`."""
    import torch

    if keep < 1:
        raise ValueError(f"keep must be 1 or more, got {keep}")
    doc = {
        "format": CHECKPOINT_FORMAT, "run": run, "version": version, "state_digest": state_digest,
        "model": model, "optimizer": optimizer, "consumer": None if consumer is None else json.dumps(consumer),
    }  # fmt: skip
    buffer = io.BytesIO()
    torch.save(doc, buffer)
    folder.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(folder, version)
    atomic_write(path, buffer.getvalue())
    for old in checkpoint_versions(folder)[:-keep]:
        checkpoint_path(folder, old).unlink(missing_ok=True)
    return path


def load_checkpoint(folder: Path, version: int, *, run: str) -> Checkpoint:
    """Checkpoint `version` of `run`; QuickstartError naming the ones there are when it is
    missing, unreadable or of another run."""
    import torch

    path = checkpoint_path(folder, version)
    have = ", ".join(f"v{v}" for v in checkpoint_versions(folder)) or "none"
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise QuickstartError(f"--restart-from {version}: no checkpoint {path} (checkpoints kept: {have})") from None
    except Exception as exc:
        raise QuickstartError(f"--restart-from {version}: cannot read {path}: {exc} (checkpoints kept: {have})") from None
    fields = ("run", "version", "state_digest", "model", "optimizer", "consumer")
    if not isinstance(doc, dict) or doc.get("format") != CHECKPOINT_FORMAT or not all(f in doc for f in fields):
        raise QuickstartError(f"--restart-from {version}: {path} is not a {CHECKPOINT_FORMAT} file")
    if (doc["run"], doc["version"]) != (run, version):
        raise QuickstartError(
            f"--restart-from {version}: {path} is the checkpoint of v{doc['version']} of run {doc['run']!r}, not of "
            f"v{version} of run {run!r}"
        )
    consumer = None if doc["consumer"] is None else json.loads(doc["consumer"])
    return Checkpoint(
        run=run, version=version, state_digest=str(doc["state_digest"]), model=doc["model"], optimizer=doc["optimizer"],
        consumer=consumer,
    )  # fmt: skip


async def check_restorable(store: Store, run: str, checkpoint: Checkpoint, *, head: int, trust: RunTrust | None) -> None:
    """QuickstartError unless `checkpoint`'s version is on the weight lineage of the pointer (at
    version `head`) with the checkpoint's state digest: a version a restart abandoned, or one
    newer than the pointer's, cannot be restored."""
    v = checkpoint.version
    if v > head:
        raise QuickstartError(f"--restart-from {v}: run {run!r} is at v{head}, pass an earlier version")
    lineage = await read_lineage(store, run, depth=head - v + 1, trust=trust)
    found = lineage.digests.get(v)
    if found is None:
        raise QuickstartError(f"--restart-from {v}: v{v} is not on the weight lineage of run {run!r} (an earlier "
                              f"restart abandoned it): pass a version of the current lineage")
    if found != checkpoint.state_digest:
        raise QuickstartError(f"--restart-from {v}: the checkpoint's state digest is not the one v{v} published")


def apply_checkpoint(learner: Any, checkpoint: Checkpoint, *, lr: float) -> None:
    """Put the checkpoint's weights and optimizer state into `learner` (a `Learner`), at this
    run's learning rate `lr`."""
    learner.model.load_state_dict(checkpoint.model)
    learner.optimizer.load_state_dict(checkpoint.optimizer)
    for group in learner.optimizer.param_groups:
        group["lr"] = lr
