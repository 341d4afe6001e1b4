"""Which plane a Mac serves a run on: the run's plane when it fits the Mac's memory, else the
first smaller plane that does, among those this Mac can serve for the run.

Planes from the largest: ``bf16``, ``int8``, ``int4``. A Mac can always serve bf16; a quantized
plane only where the run manifest names it (the trainer takes records of no other plane): held
alone where the run publishes it (`RunManifest.planes`), or int8 as the run's own `plane`
unpublished, quantized here from the bf16 weights (kept as its master). Weights per plane
(bytes, `memory_plan.param_count`: q quantizable parameters, o others):

- bf16: ``2 (q + o)``;
- int8, published: ``(1 + 4/64) q + 2 o`` (8-bit codes, a bf16 scale and bias per 64);
- int8, the run's plane, quantized here: the bf16 master ``2 (q + o)`` plus that;
- int4, published: ``(0.5 + 4/64) q + 2 o``.

The cache, activations and index are `memory_plan.plan`'s (the index at the size its manifest in
the bucket gives, `index_plan`), the limit `memory_plan.usable_bytes` of the Mac's memory. A Mac never serves a larger plane than the run's (the operator's choice), and
when none fits it serves the run's plane (the memory plan's warning says what to change).
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from slime_stoa.protocol.run_manifest import PLANES, Plane, RunManifest

from .memory_plan import GIB, config_plan, param_count, usable_bytes, weights_by_plane


@dataclass(frozen=True, slots=True)
class PlaneChoice:
    plane: Plane
    held: bool  # the run publishes it: the Mac holds that plane alone
    fits: bool
    needed: int  # bytes: weights, cache, activations, index
    usable: int

    def describe(self) -> str:
        how = "the run's published plane, held alone" if self.held else (
            "quantized here from the bf16 weights" if self.plane == "int8" else "the bf16 weights")
        verdict = "fits" if self.fits else "does not fit"
        return f"{self.plane} ({how}): {self.needed / GIB:.1f} of {self.usable / GIB:.1f} GiB usable, {verdict}"


def weights_bytes(model_config: Mapping[str, Any], manifest: RunManifest, device: str = "gpu") -> dict[Plane, int]:
    """Bytes of the weights of each plane this Mac can serve the run on, computing on `device`
    (module docstring)."""
    published = [plane for plane in PLANES if manifest.offers(plane)]
    return cast(dict[Plane, int], weights_by_plane(param_count(model_config), published, device, manifest.plane))


def plan_device() -> str:
    """Where MLX computes on this machine, as `memory_plan.DEVICES` names it: "gpu" (a Mac's
    Metal GPU) or "cpu" (MLX's CPU device: float32 compute, `macd.cpu_compute`). Without MLX
    importable, by the platform: only an Apple silicon Mac has the GPU."""
    try:
        import mlx.core as mx
    except ImportError:
        return "gpu" if sys.platform == "darwin" and platform.machine() == "arm64" else "cpu"
    return "cpu" if mx.default_device().type == mx.cpu else "gpu"



def choose_plane(
    model_config: Mapping[str, Any], manifest: RunManifest, *, memory: int, sequences: int,
    usable: int | None = None, index_bytes: int = 0, device: str | None = None,
) -> PlaneChoice | None:
    """The plane to serve the run on a Mac with `memory` bytes decoding `sequences` at once
    (module docstring), computing on `device` (`memory_plan.DEVICES`; None: this machine's,
    `plan_device`); None when the model config lacks the sizes a plan needs."""
    device = device or plan_device()
    config = model_config.get("text_config")
    config = config if isinstance(config, Mapping) else model_config
    plan = config_plan(
        config, group_size=max(sequences, 1), prompt_tokens=manifest.max_prompt_tokens,
        response_tokens=manifest.max_tokens, index_bytes=index_bytes, mac_sizes_gb=(), device=device,
    )
    if plan is None:
        return None
    limit = usable if usable is not None else usable_bytes(memory / GIB, device)
    weights = weights_bytes(config, manifest, device)
    others = plan.cache + plan.activations + plan.index
    order = [p for p in PLANES[PLANES.index(manifest.plane):] if p in weights]
    choices = [PlaneChoice(p, manifest.offers(p), weights[p] + others <= limit, weights[p] + others, limit) for p in order]
    return next((c for c in choices if c.fits), choices[0])
