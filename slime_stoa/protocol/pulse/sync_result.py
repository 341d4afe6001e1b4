"""What a sync of the weight plane gives: its result, its errors, and the version a deferred
subscriber staged.

`Subscriber.sync` returns a `SyncResult` (None when nothing changed) or raises `SyncError`
(`WeightsRefused` for a forgery); a deferred subscriber's result carries the verified version
(`StagedSync`) that the owner of the weights' bytes installs (`StagedPatch.commit`, or taking
the new state), after which it tells the subscriber (`Subscriber.advance`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .digest import StateDigest
from .manifests import VersionManifest
from .staged import StagedPatch


class SyncError(Exception):
    """No path reached the target version; the state was left as it was."""


class WeightsRefused(SyncError):
    """The weights were refused: a pointer, manifest or object failed its signature or content
    hash (a forgery or tampering, see `Subscriber.refused`); the state was left as it was."""


@dataclass(frozen=True, slots=True)
class StagedSync:
    """A verified version a deferred subscriber staged; the owner of the bytes writes it.

    `patch`: the verified writes that take the held state, whose root digest is `base`, to
    `digest` (patch paths); `state`: a whole new verified state (anchor paths)."""

    manifest: VersionManifest
    digest: StateDigest
    base: str | None = None
    patch: StagedPatch | None = None
    state: dict[str, np.ndarray] | None = None

    @property
    def version(self) -> int:
        return self.manifest.version


@dataclass(frozen=True, slots=True)
class SyncResult:
    version: int
    previous: int | None
    path: str  # "step", "chain", "catchup", "catchup+chain" or "anchor" (+ how the anchor was advanced)
    bytes: int  # downloaded
    touched: tuple[str, ...]  # tensors whose bits may have changed
    seconds: float
    # Flat indices written per tensor (sorted, unique, read-only, computed on first access);
    # None when the whole state was replaced (anchor paths). Lets a receiver refresh only what
    # changed, e.g. re-quantize touched groups.
    changed: Mapping[str, np.ndarray] | None = None
    estimate_s: float = 0.0  # what path choice expected the path to take
    staged: StagedSync | None = None  # a deferred subscriber's: what the bytes' owner installs
