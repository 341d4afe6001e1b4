"""What a weight publish returns, and what it raises when it does not commit."""

from __future__ import annotations

from dataclasses import dataclass

from slime_stoa.protocol.layout import QuantPlane


class PublishError(Exception):
    """A publish failed; the pointer did not move and the baseline is unchanged."""


class PublishConflict(PublishError):
    """Another publisher moved the run's pointer first."""


class UntrustedState(PublishError):
    """A publisher with a run key refuses the bucket: the state it would resume from is not
    signed by the run's keys, or its key is not the run's current key."""


@dataclass(frozen=True, slots=True)
class PublishResult:
    version: int
    anchored: bool
    changed: int  # elements whose bits changed since the previous version
    elements: int
    patch_bytes: int  # the step patch (what an up-to-date worker downloads)
    catchup_bytes: int
    anchor_bytes: int  # written this version (0 if none)
    seconds: float
    epoch: int = 0  # the lineage branch (see `manifests.Origin`)
    restored_from: int | None = None  # the version whose weights this one restores (a trainer restart)
    planes: tuple[QuantPlane, ...] = ()  # the quantized planes published at this version

    @property
    def density(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    @property
    def full_bytes(self) -> int:
        return 2 * self.elements
