"""The diff and digest of a new state against the published one: the seam of the publisher's
compute.

`diff_step` is all a publisher computes from the full new state before encoding: which elements
changed (bits compared, `codec.diff`) and the new state digest (only changed tensors re-hashed).
A publisher takes it as a parameter (`Publisher(..., diff_step=)`), so an implementation that
computes the same delta and digest elsewhere (on the device holding the weights) can replace it;
whatever computes it, the delta must equal `codec.diff`'s and the digest `StateDigest.of(new)`'s,
or the published bytes change.

`SparseStep` is the other seam: a new state given only by its change and a way to read one
tensor of it (`ChainPublisher.publish_delta`), for a publisher that keeps no host copy of the
state; `sparse_digest` is its digest, the same as `diff_step`'s for the same state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from .codec import Delta, check_bits, diff
from .digest import StateDigest, tensor_digest
from .parallel import ordered_map
from .publish_types import PublishError


@dataclass(frozen=True, slots=True)
class StepDiff:
    delta: Delta  # tensor -> (flat indices whose bits changed, their new bits)
    digest: StateDigest  # the new state's


DiffStep = Callable[..., StepDiff]
"""`(previous, previous_digest, new, *, threads) -> StepDiff`, run off the event loop."""


def diff_step(
    previous: Mapping[str, np.ndarray], previous_digest: StateDigest, new: Mapping[str, np.ndarray], *,
    threads: int | None = 1,
) -> StepDiff:
    """The delta taking `previous` (whose digest is `previous_digest`) to `new`, and `new`'s
    digest, on `threads` threads. ValueError when the states differ in names, shapes or dtypes."""
    delta = diff(previous, new, threads=threads)
    return StepDiff(delta, previous_digest.update(new, delta.keys(), threads=threads))


# -- a new state given by its change alone ---------------------------------------------------------
class StaleBase(PublishError):
    """A `SparseStep` goes from a state that is not the committed one: nothing was written;
    diff against the publisher's `state_digest` and publish again."""


@dataclass(frozen=True, slots=True)
class SparseStep:
    """A new version as the holder of the weights (the trainer's device) gives it to a publisher
    that keeps no full copy of the state (`ChainPublisher.publish_delta`): what changed, and one
    tensor at a time on request.

    `delta` is `codec.diff(previous, new)` (strictly increasing int64 flat indices and uint16 new
    bits per changed tensor), `old` each changed tensor's previous bits at those indices (the
    base-relative step patch codes new against old). `tensor(name)` returns the new version's
    full bits of one tensor as a host uint16 array: asked for each changed tensor (its digest)
    and, when an anchor is due, for every tensor, one at a time, never kept.
    """

    delta: Delta
    old: Mapping[str, np.ndarray]
    tensor: Callable[[str], np.ndarray]


def sparse_digest(previous_digest: StateDigest, step: SparseStep, *, threads: int | None = 1) -> StateDigest:
    """The new state's digest: `previous_digest` with each changed tensor re-hashed from
    `step.tensor` (`threads` tensors on the host at a time); `StateDigest.update`'s result for the
    same new state."""
    names = sorted(step.delta)
    dtype = previous_digest.dtype
    found = ordered_map(lambda name: tensor_digest(name, check_bits(name, step.tensor(name)), dtype), names, threads)
    return previous_digest.with_digests(dict(zip(names, found, strict=True)))


class TensorsOnDemand(Mapping[str, np.ndarray]):
    """A state whose tensors are fetched when read (`SparseStep.tensor`) and not kept: what an
    anchor is written from without a host copy of the whole state. Each read fetches again."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], fetch: Callable[[str], np.ndarray]) -> None:
        self._shapes, self._fetch = dict(shapes), fetch

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Each tensor's shape, known without a fetch (the tensors are uint16 bf16 bits)."""
        return self._shapes

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._shapes:
            raise KeyError(name)
        bits = check_bits(name, self._fetch(name))
        if tuple(bits.shape) != self._shapes[name]:
            raise ValueError(f"tensor {name!r}: fetched shape {tuple(bits.shape)} != {self._shapes[name]}")
        return bits

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)
