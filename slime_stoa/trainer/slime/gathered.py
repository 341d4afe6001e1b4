"""slime's gathered weight chunks as the host state stoa publishes: bf16 bits per HF tensor name.

The pieces both publish paths share (`publish`'s numpy path and `device_publish`'s device path):
the cast to bf16 bits, the collector protocol `gather_state` fills, the numpy collector, the tied
output head check, and what the publisher last committed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .hf_names import EMBEDDING, TIED_HEAD, HeadPlan

log = logging.getLogger("slime_stoa.trainer.slime.publish")  # the publish path's one logger

NamedTensors = Iterable[tuple[str, Any]]  # (HF name, torch.Tensor) pairs: one slime chunk


# -- tensors -> bf16 bits ------------------------------------------------------------------------
def tensor_bits(name: str, tensor: Any) -> np.ndarray:
    """A torch tensor's bf16 bit patterns as a new uint16 numpy array on the CPU.

    bf16 tensors keep their bits exactly; float16/float32/float64 tensors are cast to bf16 (round
    to nearest even, torch's cast). The result never shares memory with `tensor`.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(
            f"tensor {name!r} has dtype {tensor.dtype}; stoa publishes bf16 weights only "
            f"(quantized or integer tensors are not supported)"
        )
    bits = tensor.detach().to(torch.bfloat16).contiguous().view(torch.int16)
    return bits.to("cpu", copy=True).numpy().view(np.uint16)


def add_chunk(
    state: dict[str, np.ndarray], chunk: NamedTensors, *, drop: Collection[str] = (),
    dropped: dict[str, np.ndarray] | None = None,
) -> None:
    """Add one chunk of (HF name, tensor) pairs to `state` as bf16 bits; ValueError on a duplicate.
    Names in `drop` are left out (their bits go to `dropped`, when given)."""
    for name, tensor in chunk:
        if not isinstance(name, str) or not name:
            raise ValueError(f"invalid tensor name {name!r}")
        if name in state or (dropped is not None and name in dropped):
            raise ValueError(f"duplicate HF tensor {name!r} in slime's weight chunks")
        if name in drop:
            if dropped is not None:
                dropped[name] = tensor_bits(name, tensor)
            continue
        state[name] = tensor_bits(name, tensor)


def check_tied_head(state: Mapping[str, np.ndarray], dropped: Mapping[str, np.ndarray]) -> str | None:
    """A warning when a dropped tied head differs from the embedding it is tied to (None: equal,
    or nothing to compare)."""
    head, embedding = dropped.get(TIED_HEAD), state.get(EMBEDDING)
    if head is None or embedding is None:
        return None
    if head.shape != embedding.shape:
        return f"{TIED_HEAD} has shape {head.shape}, {EMBEDDING} {embedding.shape}"
    differ = int(np.count_nonzero(head != embedding))
    if not differ:
        return None
    return (
        f"the last pipeline stage's output layer ({TIED_HEAD}) differs from {EMBEDDING} in {differ} of "
        f"{head.size} elements; the tied HF model uses the embedding for both (published)"
    )


def chunks_to_state(chunks: Iterable[NamedTensors]) -> dict[str, np.ndarray]:
    """slime's HF weight chunks -> {name: uint16 bf16 bits}; ValueError if empty or inconsistent."""
    state: dict[str, np.ndarray] = {}
    for chunk in chunks:
        add_chunk(state, chunk)
    if not state:
        raise ValueError("slime produced no weight tensors")
    return state


class Collector(Protocol):
    """What `gather_state` turns slime's chunks into the published host state with."""

    def add(self, chunk: NamedTensors) -> None:
        """Take one chunk; ValueError for a bad or duplicate tensor."""

    def finish(self) -> dict[str, np.ndarray]:
        """The state (uint16 bf16 bits, in the chunks' order); ValueError when it is unusable."""


class HostCollector:
    """The numpy path: every gathered tensor copied to the host as bf16 bits, its output head as
    `plan` says. `counted` (when given) is called with the bytes each copy took off the device."""

    def __init__(self, plan: HeadPlan, counted: Callable[[int], None] | None = None) -> None:
        self.plan, self.counted = plan, counted
        self.state: dict[str, np.ndarray] = {}
        self.dropped: dict[str, np.ndarray] = {}

    def add(self, chunk: NamedTensors) -> None:
        add_chunk(self.state, chunk, drop=frozenset({TIED_HEAD}) if self.plan.drop else frozenset(),
                  dropped=self.dropped)

    def finish(self) -> dict[str, np.ndarray]:
        state = self.state
        if not state:
            raise ValueError("slime produced no weight tensors")
        if self.counted is not None:
            self.counted(sum(bits.nbytes for bits in [*state.values(), *self.dropped.values()]))
        if mismatch := check_tied_head(state, self.dropped):
            log.warning("stoa: %s", mismatch)
        if self.plan.copy and TIED_HEAD not in state and EMBEDDING in state:
            state[TIED_HEAD] = state[EMBEDDING].copy()  # a tied folder that stores its head
        return state


@dataclass(frozen=True, slots=True)
class Committed:
    """The publisher's last committed bf16 version (`SyncPublisher.committed`)."""

    version: int
    digest: str  # its state digest's root
    baseline: Mapping[str, np.ndarray]  # its state: the publisher's own arrays, not to be written
