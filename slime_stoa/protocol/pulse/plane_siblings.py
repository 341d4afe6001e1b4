"""The quantized planes' publishers, siblings of the bf16 one (`PublisherConfig.planes`;
`pulse.plane`, `layout.RunLayout(run, plane)`).

After each bf16 version v is committed, each plane of it (MLX affine codes, scales and biases of
the same weights) is published as version v of that plane by a chain publisher of its own, under
the plane's folder: its own patches, catch-ups on its own schedule and anchors, signed by the
same key, with state digests over the plane, and each version manifest naming the bf16 version
it quantizes (`source`). A plane that is not at the bf16 version (a crash between the two
commits, a plane publish that failed, a plane added to a running run) is brought to it before the
next bf16 version and when the publisher opens: as a step from the version before, or as a new
chain from an anchor when it is further behind.

Publishing by delta (`Publisher.release_baseline`), no host copy of the bf16 state or of a plane
is kept: the holder of the weights gives each plane of a new version as its change from the plane
of the committed bf16 state (`PlaneSteps`, computed where the weights live), published by the
plane's `ChainPublisher.publish_delta`; a plane that is not one step behind is brought to the
version as a new chain from an anchor read one tensor at a time (`publish_streamed`), as the host
path brings a plane further behind. A plane left one version behind by a failed publish is
stepped to the committed bf16 version before the next one, as on the host path
(`step_planes_behind`): its committed plane read back from the bucket (one host copy of the
plane, for that failure only) against the holder's plane of the committed bf16 state. A plane
commit whose answer was lost is settled first, and when it landed the plane steps on from it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from slime_stoa.protocol.layout import QuantPlane
from slime_stoa.protocol.run_manifest import RunNotFound, read_run_manifest
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store, StoreError

from .chain import ChainPublisher
from .codec import Delta, diff
from .manifests import Ref
from .plane import plane_bits, updated_plane_bits
from .publish_config import PublisherConfig
from .publish_types import PublishError
from .restore import version_ref
from .step_diff import SparseStep, TensorsOnDemand

log = logging.getLogger("stoa.pulse")


def plane_publishers(
    store: Store, run: str, config: PublisherConfig, key: SigningKey | None, planes: tuple[QuantPlane, ...]
) -> dict[QuantPlane, ChainPublisher]:
    """A chain publisher per plane, with the bf16 publisher's config."""
    config = replace(config, planes=())
    return {p: ChainPublisher(store, run, config, key=key, plane=p) for p in planes}


async def bring_planes_to(
    planes: Mapping[QuantPlane, ChainPublisher], source: Ref, state: Mapping[str, np.ndarray],
    last_delta: tuple[int, Delta] | None, config: PublisherConfig,
) -> tuple[QuantPlane, ...]:
    """Bring every plane not at the committed bf16 version `source` (whose state is `state`) to
    it; the planes published. `last_delta`: the bf16 publisher's latest committed step, which
    re-quantizes only the groups it changed for a plane one version behind. A plane that fails
    is logged and left to the next call."""
    done = []
    for plane, pub in planes.items():
        try:
            if not pub.opened:
                await pub.open()
            if pub.version is not None and pub.version >= source.version:
                continue
            if last_delta is not None and last_delta[0] == source.version and pub.version == source.version - 1 \
                    and not pub.baseline_lost:
                # One step behind: re-quantize only the groups the step changed.
                changed = {name: indices for name, (indices, _) in last_delta[1].items()}
                bits = await asyncio.to_thread(
                    updated_plane_bits, pub.baseline, state, changed, plane, model_type_of(config),
                    threads=config.threads,
                )
            else:
                bits = await asyncio.to_thread(plane_bits, state, plane, model_type_of(config), threads=config.threads)
            await pub.publish(bits, source=source)
            done.append(plane)
        except (PublishError, StoreError) as exc:
            log.warning(
                "run %s: plane %s of v%d not published (%s); retried before the next version",
                pub.layout.run, plane, source.version, exc,
            )
    return tuple(done)


@dataclass(frozen=True, slots=True)
class PlaneSteps:
    """Each quantized plane of a bf16 version published by delta, as the holder of the weights
    gives it: `steps[plane]` is the plane's change from the plane of the bf16 state the version's
    step goes from (`SparseStep`: its `tensor` reads one tensor of the new version's plane),
    `shapes[plane]` the plane's tensor shapes (`plane.plane_shapes`), and `committed[plane]` reads
    one tensor of the plane of that bf16 state (for a plane left behind at the version before)."""

    steps: Mapping[QuantPlane, SparseStep]
    shapes: Mapping[QuantPlane, Mapping[str, tuple[int, ...]]]
    committed: Mapping[QuantPlane, Callable[[str], np.ndarray]]


async def step_planes_behind(
    planes: Mapping[QuantPlane, ChainPublisher], weights: ChainPublisher, base: str, given: PlaneSteps,
) -> tuple[QuantPlane, ...]:
    """Before the next bf16 version goes from the committed state whose digest root is `base`:
    step every plane at the version before the committed one (its publish failed) to it, as the
    host path does (`bring_planes_to` from the bf16 step): the plane's committed state read back
    from the bucket (checked like any reader's, not kept) against `given.committed[plane]`, one
    tensor at a time. Nothing when `base` is not the committed state. The planes stepped; a plane
    that fails is logged and left to the next version."""
    head = weights.head
    if head is None or head.parent is None or base != weights.state_digest:
        return ()
    source = version_ref(weights.layout, head)
    done = []
    for plane, pub in planes.items():
        try:
            if not pub.opened:
                await pub.open()
            await pub.settle()
            at = pub.head
            if at is None or pub.baseline_lost or at.version != head.version - 1 or at.source is None \
                    or at.source.state_digest != head.parent.state_digest:
                continue
            if pub.holds_state:
                pub.release_baseline()
            old = await pub.committed_state()
            step = await asyncio.to_thread(_step_to, old, given.shapes[plane], given.committed[plane])
            del old
            assert pub.state_digest is not None
            await pub.publish_delta(step, base=pub.state_digest, source=source)
            done.append(plane)
        except (PublishError, StoreError) as exc:
            log.warning("run %s: plane %s of v%d not published (%s); retried before the next version",
                        pub.layout.run, plane, source.version, exc)
    return tuple(done)


def _step_to(
    old: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]], read: Callable[[str], np.ndarray]
) -> SparseStep:
    """The step from the plane state `old` to the plane `read` gives, one tensor read at a time."""
    if old.keys() != shapes.keys():
        raise PublishError("the committed plane does not hold the tensors of the weights' plane")
    delta: Delta = {}
    before: dict[str, np.ndarray] = {}
    for name in shapes:
        found = diff({name: old[name]}, {name: read(name)})
        if name in found:
            delta[name] = found[name]
            before[name] = old[name].reshape(-1)[found[name][0]]
    return SparseStep(delta, before, read)


async def bring_planes_by_delta(
    planes: Mapping[QuantPlane, ChainPublisher], source: Ref, base: str, given: PlaneSteps
) -> tuple[QuantPlane, ...]:
    """Publish every plane not at the committed bf16 version `source` (reached from the bf16 state
    whose digest root is `base`) by delta: `given.steps[plane]` when the plane is at the version
    before and quantizes `base` (its head's source), else a new chain from the new plane read one
    tensor at a time. The planes published; a plane that fails is logged and left behind."""
    done = []
    for plane, pub in planes.items():
        try:
            if not pub.opened:
                await pub.open()
            await pub.settle()  # a plane version whose commit got no answer may have landed: step on from it
            if pub.version is not None and pub.version >= source.version:
                continue
            step = given.steps[plane]
            head = pub.head
            if head is not None and head.version == source.version - 1 and head.source is not None \
                    and head.source.state_digest == base and not pub.baseline_lost:
                if pub.holds_state:  # opened since the release (a plane that failed to open before)
                    pub.release_baseline()
                assert pub.state_digest is not None
                await pub.publish_delta(step, base=pub.state_digest, source=source)
            else:
                await pub.publish_streamed(TensorsOnDemand(given.shapes[plane], step.tensor), source=source)
            done.append(plane)
        except (PublishError, StoreError) as exc:
            log.warning(
                "run %s: plane %s of v%d not published (%s); published with the next version (a step from where "
                "it is, else a new chain)",
                pub.layout.run, plane, source.version, exc,
            )
    return tuple(done)


def release_planes(planes: Mapping[QuantPlane, ChainPublisher]) -> None:
    """Drop every plane's committed state (publishing by delta: the holder of the weights
    computes the planes); a plane without a committed version holds none to drop."""
    for pub in planes.values():
        if pub.head is not None and pub.holds_state and not pub.baseline_lost:
            pub.release_baseline()


def model_type_of(config: PublisherConfig) -> str | None:
    """`PublisherConfig.model_type`, else the `model_type` of `extras_dir`'s config.json."""
    if config.model_type is not None or config.extras_dir is None:
        return config.model_type
    try:
        found = json.loads((Path(config.extras_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


async def offered_planes(store: Store, run: str) -> tuple[QuantPlane, ...]:
    """The quantized planes the run manifest offers; none without a readable one (a warning
    says why when it does not parse)."""
    try:
        return (await read_run_manifest(store, run)).planes
    except RunNotFound:
        return ()
    except ValueError as exc:
        log.warning("%s; publishing no quantized plane until it is fixed", exc)
        return ()
