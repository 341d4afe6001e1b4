"""The device path of the slime publish (`stoa_device_budget_bytes`): rank 0 diffs each gathered
chunk where it lives against the device's copy of the committed version (`device_delta`), and
only the delta crosses to the host.

`DevicePath` owns that copy (a `PreviousState`). A run's first version (no committed one) is the
numpy path's: a full anchor from host copies (`HostCollector`). Once a version is committed or
resumed, the publisher hands over its host baseline and keeps none, nor any quantized plane's
(`Publisher.release_baseline`, `adopt` here); the copy is rebuilt from it, where the weights
live, at the next gather's first tensor, and the host baseline is dropped then, the heap it freed
given back to the OS (`heap.return_freed_heap`). From then on every version goes by delta: each
gather's `DeviceCollector.finish` gives a `DeviceDelta`, the version's change from the copy
(`PreviousState.sparse_step`: changed indices, new and old bits, and one tensor at a time on
request, for the digest of each changed tensor and, at an anchor, for every tensor), and with
quantized planes each plane's change from the plane of the copy (`PreviousState.plane_step`:
both versions' planes of each changed tensor quantized on the device, only the plane's patch
crossing; the new plane's tensors quantized on the device one at a time on request, for their
digests and a plane's anchor), which the publisher publishes by `publish_delta`. The copy advances
when the publisher commits (`published`); a version that did not commit is forgotten at the next
gather. When the publisher's committed state is not the copy's (`StaleBase`: a pointer write whose
answer was lost turned out to have landed), the copy is brought to the committed state (by its
step, or rebuilt from it read back from the bucket) and the same version diffed again, planes
included (`rebase_by_step`, `rebase`); nothing wrong is published. The published bytes are the
numpy path's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from slime_stoa.protocol.layout import QuantPlane
from slime_stoa.protocol.pulse.codec import Delta
from slime_stoa.protocol.pulse.plane import plane_shapes
from slime_stoa.protocol.pulse.plane_siblings import PlaneSteps
from slime_stoa.protocol.pulse.step_diff import SparseStep

from ..device_delta import DeviceDeltaConfig, PreviousState, Transfer
from ..heap import return_freed_heap
from .gathered import HostCollector, NamedTensors, check_tied_head
from .hf_names import EMBEDDING, TIED_HEAD, HeadPlan

log = logging.getLogger(__name__)


class Opener(Protocol):
    """What the device path asks of the publisher (`publish.SyncPublisher`): to open (a resumed
    publisher then releases its state here, `adopt`)."""

    def open(self) -> object: ...


class Gatherer(Protocol):
    """What a gather collects slime's chunks with: `gathered.HostCollector`, whose `finish` gives a
    host state, or the device path's, whose `finish` gives a `DeviceDelta`."""

    def add(self, chunk: NamedTensors) -> None: ...

    def finish(self) -> dict[str, np.ndarray] | DeviceDelta: ...


@dataclass(slots=True)
class DeviceDelta:
    """A version as the device path hands it: its change from the committed state whose digest
    root is `base` (`PreviousState.sparse_step`), and each quantized plane's from the plane of
    that state (None: the run publishes no planes). Valid until the next gather;
    `DevicePath.rebase` replaces all three after a `StaleBase`."""

    base: str
    step: SparseStep
    planes: PlaneSteps | None = None


class DevicePath:
    """The device's copy of the committed version and the delta of the version being published
    (module doc); one per publisher, used by rank 0."""

    def __init__(self, device_budget_bytes: int) -> None:
        self.previous = PreviousState(DeviceDeltaConfig(device_budget_bytes=device_budget_bytes))
        self.held: str | None = None  # the digest root of the state `previous` holds (None: none yet)
        self.by_delta = False  # the publisher released its baseline: versions go by delta from now on
        self.released: tuple[str, Mapping[str, np.ndarray]] | None = None  # (digest root, state) to rebuild from
        self.device: torch.device | None = None  # where the weights live (the last gather's)
        self.planes: tuple[QuantPlane, ...] = ()  # the quantized planes the publisher publishes
        self.model_type: str | None = None  # the model type the planes' quantization predicate is for
        self.order: list[str] = []  # the last gather's published names, in its order (a plane anchor's)

    @property
    def transfer(self) -> Transfer:
        """The bytes moved each way, the host copies of a run's first version included."""
        return self.previous.transfer

    def adopt(
        self, baseline: Mapping[str, np.ndarray], digest: str, *, planes: tuple[QuantPlane, ...] = (),
        model_type: str | None = None,
    ) -> None:
        """The publisher released its committed state `baseline` (digest root `digest`) and keeps
        none, nor any of `planes` (quantized for `model_type`) (`Publisher.release_baseline`):
        versions go by delta from now on. The copy is rebuilt from it at the next gather's first
        tensor, where the weights live; it is not kept after."""
        self.by_delta, self.released, self.held = True, (digest, baseline), None
        self.planes, self.model_type = planes, model_type

    def published(self, handed: DeviceDelta, digest: str) -> None:
        """`handed` is committed, its state's digest root `digest`: the copy becomes that version."""
        if handed.base != self.held:
            raise RuntimeError("the published delta is not from the device's copy")
        self.previous.commit()
        self.held = digest

    def rebase(self, handed: DeviceDelta, committed: Mapping[str, np.ndarray], digest: str) -> None:
        """After a `StaleBase`: rebuild the copy from `committed` (the publisher's committed state,
        digest root `digest`, read back from the bucket) and diff `handed`'s version against it
        again, replacing its base and steps. Two host copies of the state, for this call only: the
        bucket's and the version's (`_rediff`)."""
        new = self._read_version(handed)
        self.previous.reset_from_host(committed, self._device(), consume=isinstance(committed, dict))
        self._rediff(handed, new, digest)

    def rebase_by_step(self, handed: DeviceDelta, step: Delta, digest: str) -> None:
        """After a `StaleBase` whose committed version is the one after the copy's (a pointer write
        whose answer was lost landed): apply that version's `step` where the copy lives (its state's
        digest root `digest`) and diff `handed`'s version again, replacing its base and steps."""
        new = self._read_version(handed)
        self.previous.advance(step)
        self._rediff(handed, new, digest)

    def version_on_host(self, handed: DeviceDelta) -> dict[str, np.ndarray]:
        """`handed`'s whole version on the host (one host copy of the state): for a version the
        publisher must publish in full, its committed state lost (`SyncPublisher._publish_as_anchor`)."""
        return self._read_version(handed)

    def forget(self) -> None:
        """The copy is no committed version any more (the publisher lost it): the next committed
        version is handed over by `adopt`, and until then gathers are host copies."""
        self.by_delta, self.released, self.held = False, None, None

    def _device(self) -> torch.device:
        return self.device if self.device is not None else torch.device("cpu")

    def _read_version(self, handed: DeviceDelta) -> dict[str, np.ndarray]:
        """`handed`'s version on the host, read before the copy it is read from changes: one host
        copy of the state, for a rebase only."""
        return {name: handed.step.tensor(name) for name in sorted(self.previous.names)}

    def _rediff(self, handed: DeviceDelta, new: dict[str, np.ndarray], digest: str) -> None:
        """Diff the version `new` against the copy (now the state whose digest root is `digest`),
        one tensor at a time on the weights' device, and make `handed` that step."""
        device = self._device()
        self.held = digest
        self.previous.begin()
        delta = {}
        for name in sorted(new):
            bits = new.pop(name)
            if (entry := self.previous.diff_tensor(name, torch.from_numpy(bits.view(np.int16)).to(device))) is not None:
                delta[name] = entry
        self.previous.end()
        handed.base, handed.step, handed.planes = digest, self.previous.sparse_step(delta), self.plane_steps()

    def plane_steps(self) -> PlaneSteps | None:
        """Each plane's change from the plane of the copy to that of the version last diffed
        (`PreviousState.plane_step`, on the weights' device), its tensors in the last gather's
        order (as `plane.plane_bits` orders the gathered state's: an anchor's shards follow it),
        and the copy's own plane (`plane_reader`, for a plane left one version behind); None
        without planes."""
        if not self.planes:
            return None
        device = self._device()
        order = self.order if set(self.order) == self.previous.names else sorted(self.previous.names)
        shapes = {name: self.previous.shape(name) for name in order}
        return PlaneSteps(
            steps={plane: self.previous.plane_step(plane, self.model_type, device) for plane in self.planes},
            shapes={plane: plane_shapes(shapes, plane, self.model_type) for plane in self.planes},
            committed={plane: self.previous.plane_reader(plane, self.model_type, device) for plane in self.planes},
        )

    def collector(self, publisher: Opener) -> Callable[[HeadPlan], Gatherer]:
        """How the next gather collects the state; call while no publish is in flight. Opens the
        publisher (a resumed one releases its state here): by delta once a version is committed
        or resumed, else host copies (a run's first version, or a publisher that did not open
        before any version was committed)."""
        try:
            publisher.open()
        except Exception as exc:  # the publish itself retries and reports it
            log.warning("stoa: the publisher did not open (%s: %s)", type(exc).__name__, exc)
        if self.by_delta and (self.held is not None or self.released is not None):
            return lambda plan: DeviceCollector(self, plan)
        return self._host

    def _host(self, plan: HeadPlan) -> Gatherer:
        return HostCollector(plan, counted=self._count_host_copy)

    def _count_host_copy(self, nbytes: int) -> None:
        self.previous.transfer.device_to_host += nbytes


class DeviceCollector:
    """One gather's chunks diffed against `path`'s copy of the committed version; `finish` gives
    the `DeviceDelta` (the copy is the only committed state: the publisher released its own)."""

    def __init__(self, path: DevicePath, plan: HeadPlan) -> None:
        if not path.by_delta:
            raise ValueError("the device collector diffs against a committed state the publisher released")
        self.path, self.plan = path, plan
        self.order: list[str] = []  # the published names, in the chunks' order
        self.seen: set[str] = set()
        self.delta: Delta = {}
        self.head: tuple[np.ndarray, np.ndarray] | None = None  # a dropped head's delta from the embedding
        self.head_shape: tuple[int, ...] | None = None
        if path.held is not None:
            path.previous.begin()

    def add(self, chunk: NamedTensors) -> None:
        for name, tensor in chunk:
            if not isinstance(name, str) or not name:
                raise ValueError(f"invalid tensor name {name!r}")
            if name in self.seen:
                raise ValueError(f"duplicate HF tensor {name!r} in slime's weight chunks")
            self.seen.add(name)
            if len(self.seen) == 1:
                self.path.device = tensor.device
            if self.path.held is None:  # the copy is rebuilt where the weights are
                self._rebuild(tensor.device)
            if self.plan.drop and name == TIED_HEAD:
                self._dropped_head(tensor)
                continue
            self._diff(name, tensor)
            if self.plan.copy and name == EMBEDDING and TIED_HEAD not in self.seen:
                self._diff(TIED_HEAD, tensor)  # the head a tied folder stores, unless a chunk brings its own
            self.order.append(name)

    def _rebuild(self, device: torch.device) -> None:
        """The copy from the host state the publisher released, dropped here."""
        path = self.path
        assert path.released is not None
        (digest, baseline), path.released = path.released, None
        # each tensor leaves the released state once copied: one host copy of the model, not two
        path.previous.reset_from_host(baseline, device, consume=isinstance(baseline, dict))
        del baseline
        return_freed_heap()  # else glibc keeps it resident (`heap`)
        path.held = digest
        path.previous.begin()

    def _diff(self, name: str, tensor: Any) -> None:
        entry = self.path.previous.diff_tensor(name, tensor)
        self.delta.pop(name, None)
        if entry is not None:
            self.delta[name] = entry

    def _dropped_head(self, tensor: Any) -> None:
        """Only to check the dropped head against the embedding: its delta from the committed
        embedding (what it differs in), not its bits."""
        self.head_shape = tuple(tensor.shape)
        previous = self.path.previous
        if EMBEDDING in previous.names and self.head_shape == previous.shape(EMBEDDING):
            self.head = previous.diff_against(EMBEDDING, tensor)

    def finish(self) -> DeviceDelta:
        if not self.order:
            raise ValueError("slime produced no weight tensors")
        path = self.path
        path.previous.end()
        if (mismatch := self._head_mismatch()) is not None:
            log.warning("stoa: %s", mismatch)
        assert path.held is not None
        path.order = list(self.order)
        if self.plan.copy and TIED_HEAD not in self.seen and EMBEDDING in self.seen:
            path.order.append(TIED_HEAD)  # where the host collector adds the embedding's copy
        return DeviceDelta(base=path.held, step=path.previous.sparse_step(self.delta), planes=path.plane_steps())

    def _head_mismatch(self) -> str | None:
        """`check_tied_head`'s warning for a dropped head. Both the head and the new embedding are
        known by their deltas from the committed embedding: equal deltas, equal tensors, and
        nothing more is read; else both are built on the host from the device's copy of the
        committed embedding to say how they differ (a stand-in of the head's shape when it is not
        the embedding's: the check then reports the shapes)."""
        if self.head_shape is None or EMBEDDING not in self.seen:
            return None
        previous = self.path.previous
        if self.head is None:  # another shape than the embedding's: stand-ins of both shapes say so
            return check_tied_head({EMBEDDING: _stand_in(previous.shape(EMBEDDING))},
                                   {TIED_HEAD: _stand_in(self.head_shape)})
        empty = (np.empty(0, np.int64), np.empty(0, np.uint16))
        embedding = self.delta.get(EMBEDDING, empty)
        if all(np.array_equal(a, b) for a, b in zip(self.head, embedding, strict=True)):
            return None
        base = previous.previous_bits(EMBEDDING)
        head, new = base.copy(), base.copy()
        head.reshape(-1)[self.head[0]] = self.head[1]
        new.reshape(-1)[embedding[0]] = embedding[1]
        return check_tied_head({EMBEDDING: new}, {TIED_HEAD: head})


def _stand_in(shape: tuple[int, ...]) -> np.ndarray:
    """An array of `shape` that takes no memory (zeros, read-only)."""
    return np.broadcast_to(np.uint16(0), shape)
