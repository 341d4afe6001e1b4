"""The device path of the slime publish (`stoa_device_budget_bytes`): rank 0 diffs each gathered
chunk where it lives against the device's copy of the committed version (`device_delta`), and
only the delta crosses to the host.

`DevicePath` owns that copy (a `PreviousState`) and keeps it equal to the publisher's committed
bf16 state, which it tells by the state digest (`SyncPublisher.committed`, read while no publish
is in flight, before each gather):

- the copy already holds the committed state: the delta of a version that did not commit (a
  failed publish, an unanswered pointer write) is discarded;
- the version handed last committed (its digest is the committed one): its delta is applied to
  the copy (`PreviousState.commit`);
- anything else (the first version after the publisher opened, a resume, a version the
  publisher settled later, a restore's first publish): the copy is rebuilt from the publisher's
  host baseline, host to device, at the gather's first tensor (`reset_from_host`).

A run's first version (no committed one) is the numpy path's: a full anchor from host copies.

The state handed to the publisher is its baseline with the delta applied (the changed tensors
new arrays, the others views of the baseline's). The publisher's `diff_step` returns that delta
and updates the digest over the host state (xxh3 runs on the host); when the publisher's
baseline is not the one the delta was taken from (it settled an unanswered commit first), it
diffs on the host instead. Views are safe only while the publisher cannot write its baseline
under them: after a version that did not commit (which may leave an unanswered commit to
settle, in place), the unchanged tensors are copied until a version commits again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from slime_stoa.protocol.pulse.codec import Delta
from slime_stoa.protocol.pulse.digest import StateDigest
from slime_stoa.protocol.pulse.step_diff import StepDiff, diff_step

from ..device_delta import DeviceDeltaConfig, PreviousState, Transfer, apply_delta
from .gathered import Collector, Committed, HostCollector, NamedTensors, check_tied_head
from .hf_names import EMBEDDING, TIED_HEAD, HeadPlan

log = logging.getLogger(__name__)


class CommittedSource(Protocol):
    """What the device path reads of the publisher (`publish.SyncPublisher`)."""

    def open(self) -> object: ...

    def committed(self) -> Committed | None: ...


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
        self.handed: Handed | None = None  # the last state handed to the publisher
        self.unsettled = False  # a handed version did not commit, and none has since

    @property
    def transfer(self) -> Transfer:
        """The bytes moved each way, the host copies of a run's first version included."""
        return self.previous.transfer

    def collector(self, publisher: CommittedSource) -> Callable[[HeadPlan], Collector]:
        """How the next gather collects the state; call while no publish is in flight. Opens the
        publisher to learn its committed version (an error there: the numpy path this time)."""
        handed, self.handed = self.handed, None
        try:
            publisher.open()
            committed = publisher.committed()
        except Exception as exc:  # the publish itself retries and reports it
            log.warning("stoa: the publisher did not open (%s: %s); copying the weights to the host this time",
                        type(exc).__name__, exc)
            committed = None
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

    def _host(self, plan: HeadPlan) -> Collector:
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
    """One gather's chunks diffed against `path`'s copy of `committed`; `finish` gives the host
    state (the baseline with the delta applied) and hands it to `path`."""

    def __init__(self, path: DevicePath, committed: Committed, plan: HeadPlan) -> None:
        self.path, self.committed, self.plan = path, committed, plan
        self.order: list[str] = []  # the published names, in the chunks' order
        self.seen: set[str] = set()
        self.delta: Delta = {}
        self.head: tuple[np.ndarray, np.ndarray] | None = None  # a dropped head's delta from the embedding
        self.head_shape: tuple[int, ...] | None = None
        if path.held is not None:
            path.previous.begin()

    def add(self, chunk: NamedTensors) -> None:
        previous = self.path.previous
        for name, tensor in chunk:
            if not isinstance(name, str) or not name:
                raise ValueError(f"invalid tensor name {name!r}")
            if name in self.seen:
                raise ValueError(f"duplicate HF tensor {name!r} in slime's weight chunks")
            self.seen.add(name)
            if self.path.held is None:  # the copy is rebuilt where the weights are
                previous.reset_from_host(self.committed.baseline, tensor.device)
                self.path.held = self.committed.digest
                previous.begin()
            if self.plan.drop and name == TIED_HEAD:
                self._dropped_head(tensor)
                continue
            self._diff(name, tensor)
            if self.plan.copy and name == EMBEDDING and TIED_HEAD not in self.seen:
                self._diff(TIED_HEAD, tensor)  # the head a tied folder stores, unless a chunk brings its own
            self.order.append(name)

    def _diff(self, name: str, tensor: Any) -> None:
        entry = self.path.previous.diff_tensor(name, tensor)
        self.delta.pop(name, None)
        if entry is not None:
            self.delta[name] = entry

    def _dropped_head(self, tensor: Any) -> None:
        """Only to check the dropped head against the embedding: its delta from the committed
        embedding (what it differs in), not its bits."""
        self.head_shape = tuple(tensor.shape)
        if EMBEDDING in self.path.previous.names and self.head_shape == self.committed.baseline[EMBEDDING].shape:
            self.head = self.path.previous.diff_against(EMBEDDING, tensor)

    def finish(self) -> dict[str, np.ndarray]:
        if not self.order:
            raise ValueError("slime produced no weight tensors")
        names = list(self.order)
        if self.plan.copy and TIED_HEAD not in self.seen and EMBEDDING in self.seen:
            names.append(TIED_HEAD)
        self.path.previous.end()
        applied = apply_delta(self.committed.baseline, self.delta)
        alias = not self.path.unsettled
        state = {
            name: applied[name] if name in self.delta else applied[name].view() if alias else applied[name].copy()
            for name in names
        }
        if (mismatch := check_tied_head(state, self._head_bits(state))) is not None:
            log.warning("stoa: %s", mismatch)
        self.path.handed = Handed(base=self.committed.digest, delta=self.delta)
        return state

    def _head_bits(self, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The dropped head as host bits for `check_tied_head` (a stand-in of its shape when it
        is not the embedding's: the check then reports the shapes)."""
        if self.head_shape is None:
            return {}
        if self.head is None:
            return {TIED_HEAD: np.zeros(self.head_shape, np.uint16)}
        head = self.committed.baseline[EMBEDDING].copy()
        indices, values = self.head
        head.reshape(-1)[indices] = values
        return {TIED_HEAD: head}
