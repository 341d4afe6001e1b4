"""stoa: RL post-training with a fleet of Macs generating rollouts in MLX and a slime trainer,
meeting only in an S3-compatible bucket.

    protocol/   the bucket contract both halves share (no torch, mlx or slime)
    tasks/      prompts and rewards, pure functions of text and label
    trainer/    the rollout consumer, the DPPO loss, the CPU learner; trainer/slime/ talks to slime
    quickstart/ the whole loop on one machine
    cli/        the `stoa` command

The names slime is given are attributes of this package, imported on first use:
`slime_stoa.generate_rollout` (`--rollout-function-path`), `slime_stoa.StoaDataSource`
(`--data-source-path`), `slime_stoa.dppo_loss` (`--custom-loss-function-path`) and
`slime_stoa.publish_weights` (called by stoa's slime patch).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_ENTRY_POINTS = {
    "generate_rollout": "slime_stoa.trainer.slime.rollout",
    "StoaDataSource": "slime_stoa.trainer.slime.data_source",
    "dppo_loss": "slime_stoa.trainer.slime.loss",
    "publish_weights": "slime_stoa.trainer.slime.publish",
}


def __getattr__(name: str) -> Any:
    if name in _ENTRY_POINTS:
        return getattr(importlib.import_module(_ENTRY_POINTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
