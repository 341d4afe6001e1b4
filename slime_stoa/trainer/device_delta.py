"""The trainer's per-version weight work in torch, where the weights live (CUDA, or the CPU), bit
for bit what the numpy path of `slime_stoa.protocol.pulse` computes.

The numpy path copies every bf16 weight to the host (~16 GiB at 8B parameters) and then diffs,
quantizes and hashes it there. Here the previous published version is kept beside the weights
(`PreviousState`) and the work runs on their device; only what the host needs crosses:

- `PreviousState.diff`: the delta from the previous version to the new one, as `codec.diff`
  gives it (names of changed tensors -> strictly increasing int64 flat indices and the uint16
  new bits). "Changed" is a bit-pattern compare of int16 views, so -0.0, NaN payloads and
  infinities count as `codec.diff` counts them. Only indices (int32 when the tensor allows) and
  values cross to the host.
- `quantize`: ``quant.quantize`` (MLX's affine quantization) on the device: the host gets the
  plane's bytes (codes, scales, biases), not the bf16 weights.
- `PreviousState.plane_delta`: the delta of a quantized plane (`plane.plane_bits` of the
  previous state to that of the new one), from both states' planes quantized on the device:
  only the plane's patch crosses. `PreviousState.plane_step` is the same for the version a
  gather diffed, as a `SparseStep` whose tensors are the new plane's, quantized on the device
  one bf16 tensor at a time (a plane published by delta).
- The state digest (`digest.StateDigest`) is xxh3-128 over each tensor's bytes. xxh3 scrambles
  its accumulators after every 1 KiB block, in order, so it has no parallel form a device could
  run; the digest stays on the host. A publisher that keeps no host copy of the state
  (`sparse_step`, `plane_step`: the slime publisher by delta) reads each changed tensor, or its
  plane arrays, from here once, one at a time, for it: with every tensor changing in an RL step,
  about the bf16 state's bytes (and each plane's) cross per version, streamed, with no host copy
  kept. A host that does keep its copy (`apply_delta` of the delta into it) moves nothing more.

Where the previous version lives (`DeviceDeltaConfig.device_budget_bytes`): tensors are kept on
their device while the running total fits the budget, the rest in pinned host memory (plain host
memory where there is no CUDA), from where a diff streams them to the device one tensor at a time.

Bit-exactness on CUDA: every float32 operation here is one IEEE-rounded operation of the numpy
path, in the same order. A division never has a host scalar as divisor (PyTorch's CUDA kernel
turns ``tensor / python_float`` into a multiplication by the reciprocal, which can differ in
the last bit): constants are device tensors. ``torch.round`` rounds half to even, as ``np.rint``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from slime_stoa.protocol.pulse.codec import Delta
from slime_stoa.protocol.pulse.plane import PLANE_PARAMS, QuantPlane, check_plane
from slime_stoa.protocol.pulse.quant import (
    EPS,
    Quantized,
    _check_shape,
    check_params,
    mlx_lm_predicate,
    plane_layout,
    plane_names,
)
from slime_stoa.protocol.pulse.quant import quantize as numpy_quantize
from slime_stoa.protocol.pulse.step_diff import SparseStep

__all__ = [
    "DEFAULT_DEVICE_BUDGET_BYTES", "DeviceDeltaConfig", "PreviousState", "Transfer", "apply_delta", "bf16_view",
    "changed_indices", "quantize",
]

#: The default budget for the previous version on the device: none. Megatron's training owns the
#: device's memory, and a copy of the model beside it can make a step run out of memory; an
#: operator who knows the headroom sets the budget (the bf16 bytes of the model keep all of it).
DEFAULT_DEVICE_BUDGET_BYTES = 0
_FLOAT_TYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
#: Quantized tensors whose plane arrays a plane reader holds while some are unread: twice the
#: publisher's default threads (`parallel.MAX_DEFAULT_THREADS`), whose reads of neighbouring keys
#: interleave; host memory of that many tensors' plane arrays at most.
PLANE_READS_HELD = 16


@dataclass(frozen=True, kw_only=True)
class DeviceDeltaConfig:
    """Where the trainer keeps the previous published version for the device diff."""

    device_budget_bytes: int = DEFAULT_DEVICE_BUDGET_BYTES
    """Bytes of the previous version kept on the weights' device (tensors in order while they
    fit); the rest in pinned host memory. 0 (the default): all of it on the host."""

    def __post_init__(self) -> None:
        if not isinstance(self.device_budget_bytes, int) or self.device_budget_bytes < 0:
            raise ValueError(f"device_budget_bytes must be an integer >= 0, got {self.device_budget_bytes!r}")


@dataclass(slots=True)
class Transfer:
    """Bytes handed from the weights' device to the host (copied when that is an accelerator; the
    same count on the CPU, where they stay put), and copied host to device, by this object's calls."""

    device_to_host: int = 0
    host_to_device: int = 0


def bf16_view(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bf16 bit patterns as a contiguous int16 tensor on its device: bf16 tensors as
    they are, float16/32/64 cast to bf16 first (round to nearest even, as `publish.tensor_bits`)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype == torch.int16:
        return tensor.detach().contiguous()
    if tensor.dtype not in _FLOAT_TYPES:
        raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}; stoa publishes bf16 weights only")
    return tensor.detach().to(torch.bfloat16).contiguous().view(torch.int16)


def _to_host(tensor: torch.Tensor, transfer: Transfer | None) -> np.ndarray:
    if transfer is not None:
        transfer.device_to_host += tensor.numel() * tensor.element_size()
    return tensor.cpu().numpy()


def _device_of(device: torch.device | str) -> torch.device:
    """`device` with its index (``cuda`` is the current CUDA device): compared with a tensor's
    device, an index-less one would never be equal, and every tensor would seem to cross."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def changed_indices(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Sorted flat indices (on the tensors' device) where two same-shaped int16 tensors differ;
    int32 when the tensor has fewer than 2**31 elements (half the bytes to move), else int64."""
    hits = torch.nonzero(old.reshape(-1) != new.reshape(-1)).reshape(-1)  # row-major order, sorted
    return hits.to(torch.int32) if new.numel() < 1 << 31 else hits


def _entry(found: torch.Tensor, values: torch.Tensor, transfer: Transfer | None) -> tuple[np.ndarray, np.ndarray]:
    """A delta entry on the host: int64 indices and uint16 values."""
    indices = _to_host(found, transfer).astype(np.int64, copy=False)
    return indices, _to_host(values, transfer).view(np.uint16)


def apply_delta(state: Mapping[str, np.ndarray], delta: Delta) -> dict[str, np.ndarray]:
    """The host state `state` with `delta` applied: changed tensors as new arrays, the others as
    they are (the host's copy of the new version, whose digest `StateDigest.update` takes)."""
    out = dict(state)
    for name, (indices, values) in delta.items():
        bits = state[name].copy()
        bits.reshape(-1)[indices] = values
        out[name] = bits
    return out


# -- quantization -----------------------------------------------------------------------------------
def quantize(
    w: torch.Tensor, group_size: int = 64, bits: int = 8, *, name: str = "w", transfer: Transfer | None = None
) -> Quantized:
    """``quant.quantize`` of a bf16 weight (a torch tensor on any device; int16 views of bf16 bits
    too), computed on its device; the codes, scales and biases come back as numpy arrays, bit
    for bit those of ``quant.quantize``. ValueError as ``quant.quantize`` raises it (a weight with
    a non-finite value or a group beyond float32 arithmetic: the error is ``quant.quantize``'s own,
    from the host copy of that one tensor)."""
    check_params(group_size, bits)
    view = bf16_view(name, w)
    _check_shape(np.broadcast_to(np.uint8(0), tuple(view.shape)), group_size, name)  # a shape, no memory
    packed, scales, biases = _quantize_bits(view, group_size, bits, name, transfer)
    lead, k = tuple(view.shape[:-1]), view.shape[-1]
    codes = packed.view("<u4").astype(np.uint32, copy=False)
    return Quantized(
        codes.reshape(*lead, k * bits // 32), scales.reshape(*lead, k // group_size),
        biases.reshape(*lead, k // group_size), group_size, bits,
    )


def _quantize_device(view: torch.Tensor, group_size: int, bits: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed code bytes (groups, group_size * bits / 8) uint8, int16 scales and biases stacked
    (2, groups)) of an int16 bf16 view, on its device; the numpy arithmetic, step for step."""
    groups = view.reshape(-1, group_size)
    device = view.device
    values = (groups.to(torch.int32) << 16).view(torch.float32)  # bf16 -> float32, exact
    n_bins = torch.tensor(float((1 << bits) - 1), dtype=torch.float32, device=device)
    eps = torch.tensor(float(EPS), dtype=torch.float32, device=device)
    w_max, w_min = values.amax(dim=1), values.amin(dim=1)  # which zero a group's extreme is does not matter
    scale = torch.maximum((w_max - w_min) / n_bins.expand_as(w_max), eps)
    low = w_min.abs() > w_max.abs()
    scale = torch.where(low, scale, -scale)
    edge = torch.where(low, w_min, w_max)
    q0 = torch.round(edge / scale)
    at_zero = q0 == 0
    scale = torch.where(at_zero, scale, edge / q0)
    bias = torch.where(at_zero, torch.zeros_like(edge), edge)
    broken = ~torch.isfinite(scale) | (scale == 0)  # also every group holding a NaN or an infinity
    if bool(broken.any()):
        host = view.cpu().numpy().view(np.uint16)
        numpy_quantize(host, group_size, bits, name=name)  # raises the numpy path's ValueError
        raise AssertionError(f"tensor {name!r}: the device refused a group the numpy quantizer accepts")
    codes = torch.clamp(torch.round((values - bias[:, None]) / scale[:, None]), 0, (1 << bits) - 1).to(torch.uint8)
    if bits == 4:
        pairs = codes.reshape(codes.shape[0], -1, 2)
        codes = pairs[..., 0] | (pairs[..., 1] << 4)
    elif bits == 2:
        quads = codes.reshape(codes.shape[0], -1, 4)
        codes = quads[..., 0] | (quads[..., 1] << 2) | (quads[..., 2] << 4) | (quads[..., 3] << 6)
    scales_biases = torch.stack((scale, bias)).to(torch.bfloat16).view(torch.int16)  # round to nearest even
    return codes.contiguous(), scales_biases


def _quantize_bits(
    view: torch.Tensor, group_size: int, bits: int, name: str, transfer: Transfer | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    packed, scales_biases = _quantize_device(view, group_size, bits, name)
    host = _to_host(scales_biases, transfer).view(np.uint16)
    return _to_host(packed, transfer), host[0], host[1]


def _plane_arrays(view: torch.Tensor, group_size: int, bits: int, name: str) -> tuple[torch.Tensor, ...]:
    """The plane's arrays of a quantized weight, on the device, as the int16 views the plane's
    delta compares: the codes' uint16 halves (little-endian: byte pairs), scales, biases."""
    packed, scales_biases = _quantize_device(view, group_size, bits, name)
    return packed.view(torch.int16), scales_biases[0], scales_biases[1]  # byte pairs in the device's (and host's) order


def _keys(name: str, params: tuple[int, int] | None) -> tuple[str, ...]:
    """The plane's names for bf16 tensor `name`: a quantized weight's codes, scales and biases
    (`params`: its group size and bits), else the tensor's own."""
    return (name,) if params is None else plane_names(name)


def _plane_of(name: str, view: torch.Tensor, params: tuple[int, int] | None) -> tuple[torch.Tensor, ...]:
    """The plane's arrays of bf16 tensor `name` (an int16 view on its device), in `_keys` order."""
    return (view,) if params is None else _plane_arrays(view, *params, name)


def _plane_shapes(shape: tuple[int, ...], params: tuple[int, int] | None) -> tuple[tuple[int, ...], ...]:
    """The shapes `plane.plane_bits` gives the arrays of `_plane_of` (codes as uint16 halves)."""
    if params is None:
        return (shape,)
    group_size, bits = params
    lead, k = shape[:-1], shape[-1]
    return (*lead, k * bits // 16), (*lead, k // group_size), (*lead, k // group_size)


def _plane_pairs(
    name: str, old: torch.Tensor, new: torch.Tensor, params: tuple[int, int] | None
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(plane name, its array from `old`, from `new`) for bf16 tensor `name` of both versions."""
    return list(zip(_keys(name, params), _plane_of(name, old, params), _plane_of(name, new, params), strict=True))


# -- the previous version ---------------------------------------------------------------------------
class PreviousState:
    """The previous published bf16 version, kept for the device diff (module doc): on the weights'
    device while the tensors fit `config.device_budget_bytes`, the rest in pinned host memory.

    `reset(state)` keeps a copy of a whole state (the first version, or after a resume), and
    `reset_from_host` one of the publisher's host baseline; `diff(state)` gives the delta to a new
    state and remembers it (`begin`, `diff_tensor` and `end` the same a tensor at a time, as a
    gather streams them); `commit()` applies the remembered delta once the version is published
    (the previous version advances only after the pointer moved, as the publisher's baseline),
    `discard()` forgets it. `transfer` counts the bytes each way.
    """

    def __init__(self, config: DeviceDeltaConfig = DeviceDeltaConfig()) -> None:
        self.config = config
        self.transfer = Transfer()
        self._kept: dict[str, torch.Tensor] = {}
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._diffed: set[str] = set()  # the names `diff_tensor` gave since `begin`

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._kept)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of the previous version's tensor `name` (KeyError: not one of its tensors)."""
        return tuple(self._kept[name].shape)

    def previous_bits(self, name: str) -> np.ndarray:
        """The previous version's tensor `name` as a new host array of uint16 bf16 bits (counted)."""
        kept = self._kept[name]
        return np.array(self._host_bits(kept, kept), copy=True).view(np.uint16)

    def _host_bits(self, tensor: torch.Tensor, kept: torch.Tensor) -> np.ndarray:
        """`tensor`, made from the kept tensor `kept` where that lives, on the host: counted as
        handed from the weights' device unless `kept` is a pinned host copy (the previous
        version's share kept in host memory beside an accelerator's weights), where it already is."""
        if kept.device.type == "cpu" and kept.is_pinned():
            return tensor.numpy()
        return _to_host(tensor, self.transfer)

    def _moved(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`tensor` on `device`, its bytes counted when it crosses between an accelerator and the host."""
        if tensor.device.type != device.type:
            nbytes = tensor.numel() * tensor.element_size()
            if device.type == "cpu":
                self.transfer.device_to_host += nbytes
            else:
                self.transfer.host_to_device += nbytes
        return tensor.to(device)

    def device_bytes(self) -> int:
        """Bytes of the previous version kept on an accelerator."""
        return sum(t.numel() * 2 for t in self._kept.values() if t.device.type != "cpu")

    def reset(self, state: Mapping[str, torch.Tensor]) -> None:
        """Keep a copy of `state` (name -> bf16 tensor) as the previous version."""
        kept: dict[str, torch.Tensor] = {}
        used = 0
        for name in sorted(state):
            view = bf16_view(name, state[name])
            size = view.numel() * 2
            if view.device.type != "cpu" and used + size <= self.config.device_budget_bytes:
                kept[name] = view.clone()
                used += size
            elif view.device.type != "cpu":
                host = torch.empty(view.shape, dtype=torch.int16, pin_memory=True)
                host.copy_(view)
                self.transfer.device_to_host += size
                kept[name] = host
            else:
                kept[name] = view.clone()
        self._kept, self._pending = kept, None

    def reset_from_host(
        self, state: Mapping[str, np.ndarray], device: torch.device | str, *, consume: bool = False
    ) -> None:
        """Keep a copy of the host state `state` (name -> uint16 bf16 bits, the publisher's
        baseline) as the previous version, for weights on `device`: as `reset` places them, the
        tensors that fit the budget copied to `device` (counted host to device), the rest in pinned
        host memory. Nothing crosses from the device. `consume`: `state` is a dict handed over (the
        publisher's released baseline, a state read back from the bucket) and each tensor leaves it
        once copied, so the host holds one copy of the model and a tensor while the copy is made,
        not two (a tensor too large for malloc's heap goes back to the OS as it leaves)."""
        if consume and not isinstance(state, MutableMapping):
            raise TypeError("consume=True needs a mutable mapping (a dict handed over)")
        owned = cast(MutableMapping[str, np.ndarray], state) if consume else None
        device = _device_of(device)
        kept: dict[str, torch.Tensor] = {}
        used = 0
        for name in sorted(state):
            bits = np.ascontiguousarray(state[name])
            if bits.dtype != np.uint16:
                raise ValueError(f"tensor {name!r}: expected uint16 bf16 bits, got {bits.dtype}")
            host = torch.from_numpy(bits.view(np.int16))
            size = host.numel() * 2
            if device.type != "cpu" and used + size <= self.config.device_budget_bytes:
                kept[name] = host.to(device, copy=True)
                self.transfer.host_to_device += size
                used += size
            elif device.type != "cpu":
                pinned = torch.empty(host.shape, dtype=torch.int16, pin_memory=True)
                pinned.copy_(host)
                kept[name] = pinned
            else:
                kept[name] = host.clone()
            if owned is not None:
                del owned[name]
        self._kept, self._pending = kept, None

    def _previous_on(self, name: str, device: torch.device) -> torch.Tensor:
        kept = self._kept[name]
        if kept.device == device:
            return kept
        self.transfer.host_to_device += kept.numel() * 2
        return kept.to(device, non_blocking=kept.is_pinned())

    def _check(self, state: Mapping[str, torch.Tensor]) -> list[str]:
        if state.keys() != self._kept.keys():
            missing = sorted(set(self._kept) - set(state))
            extra = sorted(set(state) - set(self._kept))
            raise ValueError(f"states differ in tensor names: missing {missing}, extra {extra}")
        names = sorted(state)
        for name in names:
            if tuple(state[name].shape) != tuple(self._kept[name].shape):
                raise ValueError(f"tensor {name!r}: shape {tuple(self._kept[name].shape)} != {tuple(state[name].shape)}")
        return names

    def diff(self, state: Mapping[str, torch.Tensor]) -> Delta:
        """`codec.diff(previous, state)` on the device, remembered for `commit`. ValueError when the
        states differ in names or shapes, or a tensor is not a float tensor."""
        if not self._kept and state:
            raise ValueError("no previous version: reset() with the published state first")
        names = self._check(state)
        self.begin()
        delta: Delta = {}
        for name in names:
            if (entry := self.diff_tensor(name, state[name])) is not None:
                delta[name] = entry
        return delta

    def begin(self) -> None:
        """Start the delta of a new version given one tensor at a time (`diff_tensor`, then
        `end`), as a gather streams them: what `diff` does for a whole state."""
        self._pending, self._diffed = {}, set()

    def diff_tensor(self, name: str, tensor: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
        """Tensor `name`'s entry of the delta begun by `begin` (None: its bits did not change),
        remembered for `commit`; diffing a name again replaces its entry. ValueError for a name
        the previous version lacks, another shape, or a tensor that is not a float tensor."""
        if self._pending is None:
            raise RuntimeError("diff_tensor() without begin()")
        new = self._checked_view(name, name, tensor)
        found = changed_indices(self._previous_on(name, new.device), new)
        self._diffed.add(name)
        self._pending.pop(name, None)
        if not found.numel():
            return None
        values = new.reshape(-1)[found]
        self._pending[name] = (found, values)
        return _entry(found, values, self.transfer)

    def end(self) -> None:
        """Check that `diff_tensor` gave every tensor of the previous version since `begin`."""
        if self._pending is None:
            raise RuntimeError("end() without begin()")
        if missing := sorted(set(self._kept) - self._diffed):
            raise ValueError(f"states differ in tensor names: missing {missing}, extra []")

    def diff_against(self, kept: str, tensor: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The delta entry from the previous version's tensor `kept` to `tensor` (empty arrays:
        equal bits), not remembered: how another tensor differs from it, moving only that."""
        new = self._checked_view(kept, "another tensor", tensor)
        found = changed_indices(self._previous_on(kept, new.device), new)
        return _entry(found, new.reshape(-1)[found], self.transfer)

    def _checked_view(self, kept: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        previous = self._kept.get(kept)
        if previous is None:
            raise ValueError(f"states differ in tensor names: {kept!r} is not in the previous version")
        new = bf16_view(name, tensor)
        if tuple(new.shape) != tuple(previous.shape):
            raise ValueError(f"tensor {kept!r}: shape {tuple(previous.shape)} != {tuple(new.shape)}")
        return new

    def discard(self) -> None:
        """Forget the delta of a version that was not committed: the previous version stays."""
        self._pending = None

    def commit(self) -> None:
        """The version `diff` was last called for is published: it becomes the previous one."""
        if self._pending is None:
            raise RuntimeError("commit() without a diff() since the last reset or commit")
        for name, (found, values) in self._pending.items():
            kept = self._kept[name].reshape(-1)
            kept[self._moved(found, kept.device).long()] = self._moved(values, kept.device)
        self._pending = None

    def advance(self, delta: Delta) -> None:
        """Apply `delta` (a committed step from the kept version, not diffed here) to the kept
        version, forgetting any pending diff: the copy follows a version another call published."""
        for name, (indices, values) in delta.items():
            kept = self._kept[name].reshape(-1)
            kept[self._moved(torch.from_numpy(np.asarray(indices, np.int64)), kept.device)] = self._moved(
                torch.from_numpy(np.ascontiguousarray(values, np.uint16).view(np.int16)), kept.device
            )
        self._pending = None

    def sparse_step(self, delta: Delta) -> SparseStep:
        """The version `diff` (or `begin` ... `end`) last gave as a `step_diff.SparseStep` for a
        publisher that keeps no copy of the state (`ChainPublisher.publish_delta`): `delta` (what
        the diff returned), the previous bits at its indices (read here, beside the previous
        version), and each tensor of the new version on request, one at a time: the previous
        version's tensor with its changes applied on its device, then copied to the host. Valid
        until the next `diff`/`begin` (after `commit` too: the kept copy then is that version)."""
        if self._pending is None:
            raise RuntimeError("sparse_step() without a diff() since the last reset or commit")
        pending = dict(self._pending)
        if delta.keys() != pending.keys():
            raise ValueError("the delta is not the pending diff's")
        old: dict[str, np.ndarray] = {}
        for name, (found, _) in pending.items():
            kept = self._kept[name].reshape(-1)
            old[name] = self._host_bits(kept[self._moved(found, kept.device).long()], kept).view(np.uint16)
        return SparseStep(delta, old, lambda name: self._new_bits(name, pending))

    def _new_bits(self, name: str, pending: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> np.ndarray:
        """Tensor `name` of the previous version with `pending`'s changes, on the host."""
        if name not in self._kept:
            raise KeyError(name)
        kept = self._kept[name]
        bits = kept.clone()
        if name in pending:
            found, values = pending[name]
            bits.reshape(-1)[self._moved(found, bits.device).long()] = self._moved(values, bits.device)
        return self._host_bits(bits, kept).view(np.uint16)

    def plane_step(self, plane: QuantPlane, model_type: str | None, device: torch.device | str) -> SparseStep:
        """The plane of the version `diff` (or `begin` ... `end`) last gave, as its change from
        the plane of the previous version (`plane.plane_bits` of each, compared): each changed
        quantized weight's plane arrays are computed from both versions on `device` (the
        weights'), and only the changed elements and their old bits cross. `tensor(name)` gives
        one tensor of the new version's plane on the host, quantized on `device` (the three arrays
        of a quantized weight from one quantization). Call before `commit`; valid as
        `sparse_step`'s (until the next `diff`/`begin`)."""
        if self._pending is None:
            raise RuntimeError("plane_step() without a diff() since the last reset or commit")
        pending = dict(self._pending)
        device = _device_of(device)
        group_size, bits = PLANE_PARAMS[check_plane(plane)]
        layout = plane_layout(
            {name: tuple(t.shape) for name, t in self._kept.items()}, group_size, bits, mlx_lm_predicate(model_type)
        )
        delta: Delta = {}
        old: dict[str, np.ndarray] = {}
        for name in sorted(pending):
            before = self._previous_on(name, device)
            after = self._with_changes(name, pending, device)
            for key, a, b in _plane_pairs(name, before, after, layout.get(name)):
                found = changed_indices(a, b)
                if found.numel():
                    delta[key] = _entry(found, b.reshape(-1)[found], self.transfer)
                    old[key] = _to_host(a.reshape(-1)[found], self.transfer).view(np.uint16)
        return SparseStep(delta, old, self._plane_reader(layout, pending, device))

    def plane_reader(
        self, plane: QuantPlane, model_type: str | None, device: torch.device | str
    ) -> Callable[[str], np.ndarray]:
        """The previous version's plane (`plane.plane_bits` of it), one tensor at a time on the
        host, quantized on `device` (the three arrays of a quantized weight from one
        quantization). Valid until the next `commit`, `advance` or `reset`."""
        group_size, bits = PLANE_PARAMS[check_plane(plane)]
        layout = plane_layout(
            {name: tuple(t.shape) for name, t in self._kept.items()}, group_size, bits, mlx_lm_predicate(model_type)
        )
        return self._plane_reader(layout, {}, _device_of(device))

    def _plane_reader(
        self, layout: Mapping[str, tuple[int, int]], pending: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
    ) -> Callable[[str], np.ndarray]:
        """Plane tensors of the previous version with `pending`'s changes, one at a time on the host.

        A quantized weight's codes, scales and biases come from one quantization: its arrays are
        held until each was read, or until `PLANE_READS_HELD` newer tensors pushed them out (a
        reader that asks for only some of them), so the digest's threads, reading neighbouring
        keys out of order, quantize and copy each tensor once."""
        owners = {key: (name, i) for name in self._kept for i, key in enumerate(_keys(name, layout.get(name)))}
        held: OrderedDict[str, tuple[tuple[np.ndarray, ...], set[int]]] = OrderedDict()  # name -> arrays, unread
        lock = threading.Lock()  # readers on several threads quantize one tensor at a time

        def tensor(key: str) -> np.ndarray:
            if key not in owners:
                raise KeyError(key)
            name, i = owners[key]
            with lock:
                if name not in held:
                    new = self._with_changes(name, pending, device)
                    params = layout.get(name)
                    shapes = _plane_shapes(tuple(new.shape), params)
                    arrays = tuple(
                        _to_host(a, self.transfer).view(np.uint16).reshape(shape)
                        for a, shape in zip(_plane_of(name, new, params), shapes, strict=True)
                    )
                    held[name] = (arrays, set(range(len(arrays))))
                    while len(held) > PLANE_READS_HELD:
                        held.popitem(last=False)
                arrays, unread = held[name]
                unread.discard(i)
                if not unread:
                    del held[name]
                return arrays[i]

        return tensor

    def _with_changes(
        self, name: str, pending: Mapping[str, tuple[torch.Tensor, torch.Tensor]], device: torch.device
    ) -> torch.Tensor:
        """A new tensor on `device`: the previous version's `name` with `pending`'s changes."""
        kept = self._kept[name]
        bits = kept.to(device, copy=True, non_blocking=kept.is_pinned())
        if kept.device != device:
            self.transfer.host_to_device += kept.numel() * 2
        if name in pending:
            found, values = pending[name]
            bits.reshape(-1)[self._moved(found, device).long()] = self._moved(values, device)
        return bits

    def plane_delta(
        self, state: Mapping[str, torch.Tensor], changed: Iterable[str], plane: QuantPlane, model_type: str | None = None
    ) -> Delta:
        """The delta from `plane.plane_bits` of the previous version to that of `state`, given the
        bf16 tensors that changed (`changed`, a bf16 delta's names): each changed quantized
        weight's plane arrays are computed from both versions on the device and compared; a
        changed bf16 tensor the plane keeps as it is changes as in the bf16 delta. Call before
        `commit`."""
        group_size, bits = PLANE_PARAMS[check_plane(plane)]
        names = self._check(state)
        shapes = {name: tuple(state[name].shape) for name in names}
        layout = plane_layout(shapes, group_size, bits, mlx_lm_predicate(model_type))
        delta: Delta = {}
        for name in sorted(set(changed)):
            if name not in shapes:
                raise ValueError(f"{name}: changed, but not a tensor of the state")
            new = bf16_view(name, state[name])
            old = self._previous_on(name, new.device)
            for key, a, b in _plane_pairs(name, old, new, layout.get(name)):
                found = changed_indices(a, b)
                if found.numel():
                    delta[key] = _entry(found, b.reshape(-1)[found], self.transfer)
        return delta
