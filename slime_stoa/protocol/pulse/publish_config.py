"""How the trainer publishes weights: the knobs of one run's publisher, checked on creation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slime_stoa.protocol.cli_fields import setting
from slime_stoa.protocol.layout import QuantPlane, check_plane

from .parallel import check_threads


@dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    """How the trainer publishes weights (one per run)."""

    anchor_every: int = setting("Write a full anchor at least every this many versions.", 50)
    anchor_fraction: float = setting("... or once the step patches since the last anchor exceed this share of it.", 0.5)
    catchup: bool = setting(
        "Publish merged catch-up patches (2, 4, 8, ... versions past the anchor: the newest one is more "
        "than halfway from the anchor to any head, and those of an anchor interval cost about two steps' "
        "worth per version at most; see `pulse/catchup.py`), so a lagging worker downloads one catch-up "
        "and a short chain instead of a long chain or an anchor.",
        True,
    )
    catchup_budget: float = setting(
        "Catch-up bytes written since the anchor stay at most this many times the step bytes written "
        "since it (a due catch-up over the budget, or as large as the steps since the anchor, is "
        "skipped); `inf`: every due catch-up is written.",
        1.5,
    )
    frame_bytes: int = setting("Target uncompressed bytes per independently compressed frame.", 16 << 20)
    shard_bytes: int = setting("Anchor safetensors shard size.", 1 << 30)
    retain_anchors: int | None = setting(
        "Keep this many anchors and everything after the oldest (0: keep all); None: the run's "
        "`retain_anchors` (`stoa run create --retain-anchors`), read from its manifest.",
        None,
    )
    retain_versions: int = setting(
        "Versions behind the head always kept, whatever retain_anchors says: a consumer checks a record "
        "against the published versions of its staleness window (staleness_limit + version_ahead_slack + "
        "1 back), so deleting them would refuse honest, fresh records. The publisher keeps max(this, the "
        "run's staleness_limit + 2).",
        8,
    )
    extras_dir: Path | None = setting(
        'An HF folder whose config and tokenizer files ship with anchors (`""`: none).',
        None,
    )
    keep_dir: Path | None = setting(
        "The trainer's own folder for its copies of the run manifest, its key rotations, each pointer and version "
        "manifest it commits "
        "(`slime_stoa.protocol.kept`) and of its live weight chain (patches, version and anchor manifests, each "
        "object's size and ETag: `pulse.kept_chain`), put back when a bucket writer deletes or overwrites them. "
        "None: no copies.",
        None,
    )
    concurrency: int = setting("Uploads in flight.", 8)
    threads: int | None = setting(
        "Threads the diff, digest, merge and encode of a version run on (numpy, xxh3 and zstd release the "
        "GIL; the bytes published do not depend on it). None: one per CPU, at most 8.",
        None,
    )
    planes: tuple[QuantPlane, ...] | None = setting(
        'Quantized planes published beside the bf16 weights, each version after its bf16 version: "int8", '
        '"int4" (MLX affine, groups of 64; a worker on one holds that plane alone); None: the planes the '
        "run manifest offers (`stoa run create --planes`), none without one.",
        None,
    )
    model_type: str | None = setting(
        "The model type whose mlx-lm quantization rule the planes follow (its overrides, e.g. an MoE "
        "router kept at 8 bits); None: `extras_dir`'s config.json says, else no overrides.",
        None,
    )

    def __post_init__(self) -> None:
        if self.anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1, got {self.anchor_every}")
        if not self.anchor_fraction > 0:
            raise ValueError(f"anchor_fraction must be positive, got {self.anchor_fraction}")
        if self.retain_anchors is not None and self.retain_anchors < 0:
            raise ValueError("retain_anchors must be >= 0")
        if self.retain_versions < 1:
            raise ValueError(f"retain_versions must be >= 1, got {self.retain_versions}")
        if not self.catchup_budget >= 0:
            raise ValueError(f"catchup_budget must be >= 0, got {self.catchup_budget}")
        check_threads(self.threads)
        if self.planes is not None:
            if not isinstance(self.planes, tuple) or len(set(self.planes)) != len(self.planes):
                raise ValueError(f"planes must be a tuple of distinct plane names, got {self.planes!r}")
            for plane in self.planes:
                check_plane(plane)
