"""The trainer side of the weight plane: publish each new bf16 state as a PULSE patch, and its
quantized planes beside it.

`Publisher` is what the trainer calls. It drives the bf16 weights' chain publisher
(`chain.ChainPublisher`: diff, patches, anchors, the signed commit by compare-and-swap, resume,
lineage, retention, unsure commits) and, as its siblings, one chain publisher per quantized plane
(`plane_siblings`): after each bf16 version is committed, each plane is published as the same
version of its own chain, and a plane left behind is brought to the bf16 version before the next
one and when the publisher opens.

The parts, each one concept: `publish_config` (the knobs), `publish_types` (result and errors),
`step_diff` (the delta and digest of a new state: the seam a device-side implementation
replaces), `version_patches` (step and catch-up patches), `anchor_policy` (when a version is also
an anchor), `commit` (signing, freshness and the pointer's CAS), `restore` (lineage),
`catchup_union` (the catch-up union rebuilt on resume), `unsure` (a pointer write without an
answer), `retention` (old objects deleted after an anchor).

The diff, digest update, catch-up merge and encode of a version run on `PublisherConfig.threads`
threads, off the event loop (tensors, segments of a large one and frames at a time,
`pulse.parallel`); the bytes published do not depend on the thread count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from slime_stoa.protocol.layout import QuantPlane, RunLayout
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store

from .catchup_union import patch_delta
from .chain import ChainPublisher
from .commit import publisher_trust
from .manifests import Ref
from .plane_siblings import (
    PlaneSteps,
    bring_planes_by_delta,
    bring_planes_to,
    offered_planes,
    plane_publishers,
    release_planes,
    step_planes_behind,
)
from .publish_config import PublisherConfig
from .publish_types import PublishConflict, PublishError, PublishResult, UntrustedState
from .restore import version_ref
from .retention import retention_floor
from .step_diff import DiffStep, SparseStep, StaleBase, diff_step

__all__ = [
    "PlaneSteps", "PublishConflict", "PublishError", "PublishResult", "Publisher", "PublisherConfig", "SparseStep",
    "StaleBase",
    "UntrustedState",
    "patch_delta", "publisher_trust", "retention_floor",
]

DEFAULT_CONFIG = PublisherConfig()


class Publisher:
    def __init__(
        self, store: Store, run: str, config: PublisherConfig = DEFAULT_CONFIG, *, key: SigningKey | None = None,
        plane: QuantPlane | None = None, diff_step: DiffStep = diff_step,
    ):
        """The publisher of run `run`'s bf16 weights and of `config.planes` (None: those the run
        manifest offers, read by `open`), signing with the run key `key` (None: an unsigned run);
        with `plane`, of that quantized plane alone (whose versions name their bf16 `source`).
        `diff_step` computes each bf16 version's delta and digest (`step_diff`)."""
        if plane is not None and config.planes:
            raise ValueError("a plane's publisher publishes no planes of its own")
        self.store = store
        self.config = config
        self.key = key
        self.weights = ChainPublisher(store, run, config, key=key, plane=plane, diff_step=diff_step)
        self.planes: dict[QuantPlane, ChainPublisher] = plane_publishers(store, run, config, key, config.planes or ())
        self._opened = False

    @property
    def layout(self) -> RunLayout:
        return self.weights.layout

    @property
    def version(self) -> int | None:
        """The last committed version (None before `open` or for a new run)."""
        return self.weights.version

    @property
    def trust(self) -> RunTrust | None:
        """The run keys `open` resumed under (with a key)."""
        return self.weights.trust

    @property
    def state_digest(self) -> str | None:
        return self.weights.state_digest

    async def open(self) -> int | None:
        """Resume from the run's pointer (baseline = the published state) and bring the planes
        to its version; None for a new run."""
        await self.weights.authenticate()
        if self.config.planes is None and self.layout.plane is None and not self._opened:
            self.planes = plane_publishers(
                self.store, self.layout.run, self.config, self.key, await offered_planes(self.store, self.layout.run)
            )
        self._opened = True
        version = await self.weights.resume()
        if version is not None and not self.weights.baseline_lost:  # else brought with the next version
            await self._complete_planes(self.weights.baseline)
        return version

    async def publish(self, state: Mapping[str, np.ndarray], *, source: Ref | None = None) -> PublishResult:
        """Publish `state` (bf16 bits as uint16 arrays) as the next version, then its quantized
        planes. With `plane`, publish the plane's `state` (from `plane.plane_bits`) as version
        `source.version`, the bf16 version it quantizes."""
        if not self._opened:
            await self.open()
        checked = self.weights.checked(state, source)
        if self.planes and not self.weights.baseline_lost:
            await self._complete_planes(self.weights.baseline)  # planes left behind the published version
        result = await self.weights.publish_checked(checked, source)
        return replace(result, planes=await self._complete_planes(checked)) if self.planes else result

    def release_baseline(self) -> dict[str, np.ndarray]:
        """Hand over the published bf16 state and keep none (`ChainPublisher.release_baseline`),
        nor any plane's (the holder of the weights computes them): the next versions come by
        `publish_delta`."""
        released = self.weights.release_baseline()
        release_planes(self.planes)
        return released

    async def publish_delta(
        self, step: SparseStep, *, base: str, planes: PlaneSteps | None = None, step_behind: bool = True
    ) -> PublishResult:
        """Publish the next bf16 version by its change from the committed state (digest root
        `base`), holding no copy of the state (`ChainPublisher.publish_delta`), then its quantized
        planes from `planes`, each plane's change from the plane of `base`
        (`plane_siblings.bring_planes_by_delta`); the bytes are `publish`'s for the same state.
        First, with `step_behind`, a plane left one version behind the committed one is stepped to
        it (`step_planes_behind`), as `publish` does before it settles an unanswered commit: pass
        False when publishing the same version again after a `StaleBase` (the version that settle
        adopted is one `publish` leaves its planes behind at). ValueError when a plane's step is
        missing."""
        if self.planes and (planes is None or not set(self.planes) <= set(planes.steps)):
            raise ValueError(f"publishing planes {sorted(self.planes)} by delta needs each plane's step")
        if self.planes and step_behind:
            assert planes is not None
            await step_planes_behind(self.planes, self.weights, base, planes)
        result = await self.weights.publish_delta(step, base=base)
        if not self.planes:
            return result
        assert planes is not None and self.weights.head is not None
        source = version_ref(self.layout, self.weights.head)
        return replace(result, planes=await bring_planes_by_delta(self.planes, source, base, planes))

    async def _complete_planes(self, state: Mapping[str, np.ndarray]) -> tuple[QuantPlane, ...]:
        """Bring the planes to the committed bf16 version, whose state is `state`."""
        head = self.weights.head
        if head is None or not self.planes:
            return ()
        source = version_ref(self.layout, head)
        return await bring_planes_to(self.planes, source, state, self.weights.last_delta, self.config)
