"""The device path of the slime publish (`stoa_device_budget_bytes`): rank 0 diffs each gathered
chunk where it lives against the device's copy of the committed version (`device_delta`), and
only the delta crosses to the host.

`DevicePath` owns that copy (a `PreviousState`). It publishes one of two ways, which the publisher
tells it once open (`SyncPublisher`):

By delta (a run without quantized planes). Once a version is committed or resumed, the publisher
hands over its host baseline and keeps none (`Publisher.release_baseline`, `adopt` here); the copy
is rebuilt from it, where the weights live, at the next gather's first tensor, and the host
baseline is dropped then, the heap it freed given back to the OS (`heap.return_freed_heap`). Each
gather's `DeviceCollector.finish` gives a `DeviceDelta`: the version's change from the copy
(`PreviousState.sparse_step`: changed indices, new and old bits, and one tensor at a time on
request, for the digest of each changed tensor and, at an anchor, for every tensor), which the
publisher publishes by `publish_delta`. The copy advances when the
publisher commits (`published`); a version that did not commit is forgotten at the next gather.
When the publisher's committed state is not the copy's (`StaleBase`: a pointer write whose answer
was lost turned out to have landed), the copy is rebuilt from the committed state read back from
the bucket and the same version diffed again (`rebase`); nothing wrong is published.

With the host baseline (a run with quantized planes: a plane brought to a version it missed is
quantized from the full bf16 state, so the publisher keeps it). The copy is kept equal to the
publisher's committed bf16 state, which it tells by the state digest (`SyncPublisher.committed`,
read while no publish is in flight, before each gather):

- the copy already holds the committed state: the delta of a version that did not commit (a
  failed publish, an unanswered pointer write) is discarded;
- the version handed last committed (its digest is the committed one): its delta is applied to
  the copy (`PreviousState.commit`);
- anything else (the first version after the publisher opened, a resume, a version the
  publisher settled later, a restore's first publish): the copy is rebuilt from the publisher's
  host baseline, host to device, at the gather's first tensor (`reset_from_host`).

The state handed to the publisher is then its baseline with the delta applied (the changed
tensors new arrays, the others views of the baseline's). The publisher's `diff_step` returns that
delta and updates the digest over the host state (xxh3 runs on the host); when the publisher's
baseline is not the one the delta was taken from (it settled an unanswered commit first), it
diffs on the host instead. Views are safe only while the publisher cannot write its baseline
under them: after a version that did not commit (which may leave an unanswered commit to
settle, in place), the unchanged tensors are copied until a version commits again.

Either way a run's first version (no committed one) is the numpy path's: a full anchor from host
copies. The published bytes are the numpy path's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from slime_stoa.protocol.pulse.codec import Delta
from slime_stoa.protocol.pulse.digest import StateDigest
from slime_stoa.protocol.pulse.step_diff import SparseStep, StepDiff, diff_step

from ..device_delta import DeviceDeltaConfig, PreviousState, Transfer, apply_delta
from ..heap import return_freed_heap
from .gathered import Committed, HostCollector, NamedTensors, check_tied_head
from .hf_names import EMBEDDING, TIED_HEAD, HeadPlan

log = logging.getLogger(__name__)


class CommittedSource(Protocol):
    """What the device path reads of the publisher (`publish.SyncPublisher`)."""

    def open(self) -> object: ...

    def committed(self) -> Committed | None: ...


class Gatherer(Protocol):
    """What a gather collects slime's chunks with: `gathered.Collector`, whose `finish` gives a
    host state, or the device path's, whose `finish` gives a `DeviceDelta` when publishing by delta."""

    def add(self, chunk: NamedTensors) -> None: ...

    def finish(self) -> dict[str, np.ndarray] | DeviceDelta: ...


@dataclass(slots=True)
class DeviceDelta:
    """A version as the device path hands it when publishing by delta: its change from the
    committed state whose digest root is `base` (`PreviousState.sparse_step`). Valid until the
    next gather; `DevicePath.rebase` replaces both after a `StaleBase`."""

    base: str
    step: SparseStep


@dataclass(slots=True)
class Handed:
    """A state handed to the publisher, as the device path knows it."""

    base: str | None  # the digest root of the committed state its delta goes from (None: a host copy)
    delta: Delta | None  # the delta the device computed (None: a host copy)
    target: str | None = None  # its own digest root, once the publisher computed it


class DevicePath:
    """The device's copy of the committed version and the delta of the version being published
    (module doc); one per publisher, used by rank 0."""

    def __init__(self, device_budget_bytes: int) -> None:
        self.previous = PreviousState(DeviceDeltaConfig(device_budget_bytes=device_budget_bytes))
        self.held: str | None = None  # the digest root of the state `previous` holds (None: none yet)
        self.handed: Handed | None = None  # the last state handed to the publisher (with its baseline)
        self.unsettled = False  # a handed version did not commit, and none has since
        self.by_delta = False  # the publisher released its baseline: versions go by delta from now on
        self.released: tuple[str, Mapping[str, np.ndarray]] | None = None  # (digest root, state) to rebuild from
        self.device: torch.device | None = None  # where the weights live (the last gather's)

    @property
    def transfer(self) -> Transfer:
        """The bytes moved each way, the host copies of a run's first version included."""
        return self.previous.transfer

    def adopt(self, baseline: Mapping[str, np.ndarray], digest: str) -> None:
        """The publisher released its committed state `baseline` (digest root `digest`) and keeps
        none (`Publisher.release_baseline`): versions go by delta from now on. The copy is rebuilt
        from it at the next gather's first tensor, where the weights live; it is not kept after."""
        self.by_delta, self.released, self.held, self.handed = True, (digest, baseline), None, None

    def published(self, handed: DeviceDelta, digest: str) -> None:
        """`handed` is committed, its state's digest root `digest`: the copy becomes that version."""
        if handed.base != self.held:
            raise RuntimeError("the published delta is not from the device's copy")
        self.previous.commit()
        self.held = digest

    def rebase(self, handed: DeviceDelta, committed: Mapping[str, np.ndarray], digest: str) -> None:
        """After a `StaleBase`: rebuild the copy from `committed` (the publisher's committed state,
        digest root `digest`, read back from the bucket) and diff `handed`'s version against it
        again, replacing its base and step. Two host copies of the state, for this call only: the
        bucket's and the version's (`_rediff`)."""
        new = self._read_version(handed)
        self.previous.reset_from_host(committed, self.device if self.device is not None else torch.device("cpu"))
        self._rediff(handed, new, digest)

    def rebase_by_step(self, handed: DeviceDelta, step: Delta, digest: str) -> None:
        """After a `StaleBase` whose committed version is the one after the copy's (a pointer write
        whose answer was lost landed): apply that version's `step` where the copy lives (its state's
        digest root `digest`) and diff `handed`'s version again, replacing its base and step."""
        new = self._read_version(handed)
        self.previous.advance(step)
        self._rediff(handed, new, digest)

    def _read_version(self, handed: DeviceDelta) -> dict[str, np.ndarray]:
        """`handed`'s version on the host, read before the copy it is read from changes: one host
        copy of the state, for a rebase only."""
        return {name: handed.step.tensor(name) for name in sorted(self.previous.names)}

    def _rediff(self, handed: DeviceDelta, new: dict[str, np.ndarray], digest: str) -> None:
        """Diff the version `new` against the copy (now the state whose digest root is `digest`),
        one tensor at a time on the weights' device, and make `handed` that step."""
        device = self.device if self.device is not None else torch.device("cpu")
        self.held = digest
        self.previous.begin()
        delta = {}
        for name in sorted(new):
            bits = new.pop(name)
            if (entry := self.previous.diff_tensor(name, torch.from_numpy(bits.view(np.int16)).to(device))) is not None:
                delta[name] = entry
        self.previous.end()
        handed.base, handed.step = digest, self.previous.sparse_step(delta)

    def collector(self, publisher: CommittedSource) -> Callable[[HeadPlan], Gatherer]:
        """How the next gather collects the state; call while no publish is in flight. Opens the
        publisher to learn its committed version (an error there: the numpy path this time, unless
        the device already holds a copy to publish by delta from)."""
        handed, self.handed = self.handed, None
        try:
            publisher.open()
            committed = publisher.committed()
        except Exception as exc:  # the publish itself retries and reports it
            log.warning("stoa: the publisher did not open (%s: %s); copying the weights to the host this time",
                        type(exc).__name__, exc)
            committed = None
        if self.by_delta and (self.held is not None or self.released is not None):
            return lambda plan: DeviceCollector(self, None, plan)
        landed = committed is not None and handed is not None and handed.target == committed.digest
        if handed is not None:
            self.unsettled = not landed
        if committed is None:
            self.held = None
            return self._host
        if self.held == committed.digest:
            self.previous.discard()
        elif landed and handed is not None and handed.delta is not None and handed.base == self.held:
            self.previous.commit()
            self.held = committed.digest
        else:
            self.held = None  # rebuilt from the publisher's baseline at the first tensor
        return lambda plan: DeviceCollector(self, committed, plan)

    def _host(self, plan: HeadPlan) -> Gatherer:
        self.handed = Handed(base=None, delta=None)
        return HostCollector(plan, counted=self._count_host_copy)

    def _count_host_copy(self, nbytes: int) -> None:
        self.previous.transfer.device_to_host += nbytes

    def diff_step(
        self, previous: Mapping[str, np.ndarray], previous_digest: StateDigest, new: Mapping[str, np.ndarray], *,
        threads: int | None = 1,
    ) -> StepDiff:
        """The publisher's `step_diff.DiffStep`: the handed delta when the publisher's baseline is
        the state it was taken from, else `step_diff.diff_step` on the host."""
        handed = self.handed
        if handed is not None and handed.delta is not None and previous_digest.root() == handed.base:
            delta = handed.delta
            step = StepDiff(delta, previous_digest.update(new, delta.keys(), threads=threads))
        else:
            if handed is not None and handed.delta is not None:
                log.info("stoa: the publisher's baseline moved since the gather; diffing this version on the host")
            step = diff_step(previous, previous_digest, new, threads=threads)
        if handed is not None:
            handed.target = step.digest.root()
        return step


class DeviceCollector:
    """One gather's chunks diffed against `path`'s copy of the committed version. `finish` gives,
    when publishing by delta (`committed` None), the `DeviceDelta`; else the host state (the
    publisher's baseline `committed.baseline` with the delta applied), handed to `path`."""

    def __init__(self, path: DevicePath, committed: Committed | None, plan: HeadPlan) -> None:
        if committed is None and not path.by_delta:
            raise ValueError("a device collector without the committed state publishes by delta")
        self.path, self.committed, self.plan = path, committed, plan
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
        """The copy from the publisher's host state: the one it released (by delta, then dropped
        here), or its baseline (the publisher keeps it)."""
        path = self.path
        if self.committed is None:
            assert path.released is not None
            (digest, baseline), path.released = path.released, None
            path.previous.reset_from_host(baseline, device)
            del baseline  # the released state's last reference: one bf16 copy of the model freed
            return_freed_heap()  # else glibc keeps it resident (`heap`)
        else:
            digest = self.committed.digest
            path.previous.reset_from_host(self.committed.baseline, device)
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

    def finish(self) -> dict[str, np.ndarray] | DeviceDelta:
        if not self.order:
            raise ValueError("slime produced no weight tensors")
        self.path.previous.end()
        if (mismatch := self._head_mismatch()) is not None:
            log.warning("stoa: %s", mismatch)
        if self.committed is None:
            assert self.path.held is not None
            return DeviceDelta(base=self.path.held, step=self.path.previous.sparse_step(self.delta))
        names = list(self.order)
        if self.plan.copy and TIED_HEAD not in self.seen and EMBEDDING in self.seen:
            names.append(TIED_HEAD)
        applied = apply_delta(self.committed.baseline, self.delta)
        alias = not self.path.unsettled
        state = {
            name: applied[name] if name in self.delta else applied[name].view() if alias else applied[name].copy()
            for name in names
        }
        self.path.handed = Handed(base=self.committed.digest, delta=self.delta)
        return state

    def _head_mismatch(self) -> str | None:
        """`check_tied_head`'s warning for a dropped head. Both the head and the new embedding are
        known by their deltas from the committed embedding: equal deltas, equal tensors, and
        nothing more is read; else both are built on the host to say how they differ (a stand-in
        of the head's shape when it is not the embedding's: the check then reports the shapes)."""
        if self.head_shape is None or EMBEDDING not in self.seen:
            return None
        if self.head is None:  # another shape than the embedding's: stand-ins of both shapes say so
            return check_tied_head({EMBEDDING: _stand_in(self.path.previous.shape(EMBEDDING))},
                                   {TIED_HEAD: _stand_in(self.head_shape)})
        empty = (np.empty(0, np.int64), np.empty(0, np.uint16))
        embedding = self.delta.get(EMBEDDING, empty)
        if all(np.array_equal(a, b) for a, b in zip(self.head, embedding, strict=True)):
            return None
        base = self._base_bits(EMBEDDING)
        head, new = base.copy(), base.copy()
        head.reshape(-1)[self.head[0]] = self.head[1]
        new.reshape(-1)[embedding[0]] = embedding[1]
        return check_tied_head({EMBEDDING: new}, {TIED_HEAD: head})

    def _base_bits(self, name: str) -> np.ndarray:
        """The committed version's tensor `name` on the host: the publisher's baseline, or read
        from the device's copy when publishing by delta."""
        if self.committed is not None:
            return np.asarray(self.committed.baseline[name])
        return self.path.previous.previous_bits(name)


def _stand_in(shape: tuple[int, ...]) -> np.ndarray:
    """An array of `shape` that takes no memory (zeros, read-only)."""
    return np.broadcast_to(np.uint16(0), shape)
