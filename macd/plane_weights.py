"""The daemon's live MLX weights on a quantized plane the run publishes, held alone.

A run that publishes a quantized plane (`RunManifest.planes`; `pulse.plane`) lets a worker on it
download and hold that plane only: the weights' `state` is the plane (each quantized layer's
uint32 codes as their uint16 halves, its bf16 scales and biases, every other tensor bf16), and
the served model is mlx-lm's quantized model (``nn.QuantizedLinear``, ``QuantizedEmbedding``,
``QuantizedSwitchLinear``; groups of 64, each layer at the bits its codes and scales imply, e.g.
an MoE router at 8 on the 4-bit plane): parameter for parameter, what mlx-lm's
``quantize_model`` makes of the trainer's bf16 weights. As on the bf16 plane (`weights.py`) the state *is* the model: `from_state`
installs each tensor into MLX and replaces it, in the caller's state mapping, by a writable
numpy uint16 view of the parameter's memory (codes through a uint16 view of their words), so a
patch committed into the state writes the served weights in place, the digest covers exactly the
bytes the model computes with, and no bf16 master of the quantized layers exists anywhere:
memory is the plane's bytes (int8: ~1.06 per quantized weight, 4-bit: ~0.56) plus 2 per other
weight. Nothing may write into the state while the model computes: the worker installs a staged
version at a safe point, on the MLX thread (`LiveWeights.install_version`, `macd.following`).

The plane is published under the checkpoint's names. A model that renames or restacks them on
load (LFM2 / LFM2-MoE, `macd.hf_layout`: the experts' codes, scales and biases are rows of
``switch_mlp`` stacks, the feed-forward ``w1``/``w2``/``w3`` are ``gate``/``down``/``up_proj``, a
conv kernel is a reshape) gets each checkpoint tensor lent as its row or reshape of the stacked
parameter's memory, so a patch still writes the served weights in place.

Compute on MLX's CPU device (a Linux machine, CI): MLX's CPU ``quantized_matmul`` and
``gather_qmm`` on bf16 input run a scalar loop that accumulates each dot product in bf16 (every
partial sum rounded to 8 bits of mantissa; its float32 kernel accumulates in float32): 2-4%
relative error per output at K = 576-1536, ~20x a bf16 matmul's. On SmolLM2-135M's int8 plane that
alone put the worker's logprobs 0.43 nats/token from the learner's, where the plane's weights
computed exactly are 0.056 away. So there `from_state` makes the quantized layers compute with
float32 activations (`cpu_compute.use_float32_activations`: the embedding's rows dequantized in float32,
every quantized layer's input cast to float32; MLX then dequantizes with the bf16 scales and
biases widened, exactly, and accumulates in float32: the plane's function to float32 rounding,
and 5-8x faster than the bf16 loop). Where a fast BLAS serves MLX (`cpu_compute.float32_compute_wanted`)
each quantized layer multiplies instead with a float32 copy of its weight dequantized, w = s * q + b:
the same values the quantized kernel computes from the codes for float32 input, so the same
function (only the summation order differs), through the BLAS's sgemm instead of MLX's quantized
loop, ~35x faster per matmul (`cpu_compute.use_float32_activations` has the figures). The copies
cost 4 bytes per quantized weight (`copy_nbytes`); they are made at the install and made anew,
at the same safe point, for every layer whose arrays a version replaced or wrote in place
(`apply`). The served bytes do not change; ``STOA_CPU_COMPUTE=bfloat16``
(`cpu_compute.ENV`) keeps MLX's stock compute. A GPU device computes as mlx-lm does (Metal's
quantized kernels accumulate in float32, by MLX's source).

Threading: plain synchronous MLX code. Call it only from the thread that owns MLX.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from slime_stoa.protocol.layout import QuantPlane, check_plane

from . import cpu_compute
from .hf_layout import Slot, checkpoint_layout, model_name
from .weights import ApplyStats, LiveWeights, check_shape, touched_bits

GROUP_SIZE = 64  # every published plane's (`pulse.plane.PLANE_PARAMS`)
_BITS = (2, 4, 8)


def plane_structure(state: Mapping[str, np.ndarray]) -> dict[str, int]:
    """The quantized layers of a plane state: module path -> bits, from the shapes of its codes
    (uint16 halves, ``K * bits / 16`` per row) and scales (``K / 64`` per row); ValueError for a
    layer whose arrays do not fit together."""
    layers: dict[str, int] = {}
    for name, scales in state.items():
        path, _, leaf = name.rpartition(".")
        if leaf != "scales":
            continue
        codes, biases = state.get(f"{path}.weight"), state.get(f"{path}.biases")
        if codes is None or biases is None or biases.shape != scales.shape or codes.ndim != scales.ndim:
            raise ValueError(f"{path}: a quantized layer needs its weight codes, scales and biases of one shape")
        k = scales.shape[-1] * GROUP_SIZE
        bits, rest = divmod(codes.shape[-1] * 16, k)
        if rest or bits not in _BITS or codes.shape[:-1] != scales.shape[:-1]:
            raise ValueError(f"{path}: codes {codes.shape} do not fit scales {scales.shape} at group size {GROUP_SIZE}")
        layers[path] = bits
    return layers


def quantize_structure(model: nn.Module, layers: Mapping[str, int]) -> None:
    """Swap the `layers` of `model` for affine quantized ones (their arrays stay unevaluated
    until installed); ValueError when one is not a quantizable layer of the model."""
    modules = dict(model.named_modules())
    for path in layers:
        if not hasattr(modules.get(path), "to_quantized"):
            raise ValueError(f"{path}: the plane quantizes it, but the model has no quantizable layer there")

    def predicate(path: str, module: nn.Module) -> Any:
        bits = layers.get(path)
        return False if bits is None else {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}

    nn.quantize(model, class_predicate=predicate)


class PlaneWeights(LiveWeights):
    """An mlx-lm quantized model serving a plane state it shares its memory with (module doc).
    The interface of `LiveWeights` (the one owner of these bytes, installed by its
    `install_version`); `master_apart` is False: the state is the model."""

    def __init__(self, model: nn.Module, plane: QuantPlane, slots: Mapping[str, Slot] | None = None):
        """Wrap `model` (already quantized as its plane) as it is; `slots`: the checkpoint tensors
        the model holds under another name or stacked (`hf_layout.checkpoint_layout`)."""
        self.model = model
        self.plane = check_plane(plane)
        self.slots = dict(slots or {})
        params: dict[str, mx.array] = tree_flatten(model.parameters(), destination={})  # type: ignore[assignment]
        self._dtypes: dict[str, Any] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}  # model parameter -> shape of its uint16 view
        for name, array in params.items():
            if array.dtype == mx.uint32:
                self._shapes[name] = (*array.shape[:-1], array.shape[-1] * 2)
            elif array.dtype == mx.bfloat16:
                self._shapes[name] = tuple(array.shape)
            else:
                raise ValueError(f"{name}: the model holds {array.dtype}; a plane serves uint32 codes and bfloat16")
            self._dtypes[name] = array.dtype
        self.state: MutableMapping[str, np.ndarray] = {}  # the plane's bits: views of the model's memory
        self.digest: str | None = None  # their state digest's root, when they are a verified version
        self._views: dict[str, np.ndarray] = {}  # checkpoint name -> the view of its parameter lent to the state
        self._arrays: dict[str, mx.array] = {}  # model parameter -> the MLX array those views show

    @property
    def master_apart(self) -> bool:
        return False

    @classmethod
    def from_state(  # type: ignore[override]
        cls, model: nn.Module, state: dict[str, np.ndarray], plane: QuantPlane, digest: str | None = None
    ) -> PlaneWeights:
        """Quantize `model` (a bf16 mlx-lm model built from its config) as the plane `state`
        says and install the state into it, sharing its memory (module doc); on the CPU device its
        quantized layers compute with float32 activations (`cpu_compute.float32_activations_wanted`),
        with a fast BLAS through float32 copies of their weights dequantized.
        ValueError naming the first tensor that does not fit; the model is then left unusable."""
        layers: dict[str, int] = {}
        for path, bits in plane_structure(state).items():
            module = model_name(f"{path}.scales")[0].rpartition(".")[0]
            if layers.setdefault(module, bits) != bits:
                raise ValueError(f"{path}: {bits} bits, but another tensor of {module} has {layers[module]}")
        quantize_structure(model, layers)
        live = cls(model, plane)
        live.slots = checkpoint_layout(live._shapes, {n: tuple(a.shape) for n, a in state.items()})
        live._validate(state, list(state), None)
        live._check_complete(state)
        if cpu_compute.float32_activations_wanted():
            cpu_compute.use_float32_activations(model)  # before the install, which makes the float32 copies
        live._install(state)
        live.digest = digest
        return live

    def _target(self, name: str) -> str:
        slot = self.slots.get(name)
        return name if slot is None else slot.target

    def _members(self, state: Mapping[str, np.ndarray]) -> dict[str, list[str]]:
        """Model parameter -> the checkpoint tensors of `state` it holds."""
        members: dict[str, list[str]] = {}
        for name in state:
            members.setdefault(self._target(name), []).append(name)
        return members

    def _check_complete(self, state: Mapping[str, np.ndarray]) -> None:
        held = self._members(state)
        missing = [name for name in self._shapes if name not in held]
        if missing:
            raise ValueError(f"{missing[0]}: the model has this parameter but the plane lacks it")

    def shares(self, state: Mapping[str, np.ndarray]) -> bool:
        """True when every tensor of `state` is (a view of) the model's own memory."""
        held = self._members(state)
        return held.keys() == self._shapes.keys() and all(self._is_live(state, name) for name in state)

    # -- refresh ---------------------------------------------------------------------------
    def apply(
        self,
        state: MutableMapping[str, np.ndarray],
        changed: Mapping[str, np.ndarray] | None,
        touched: Iterable[str],
    ) -> ApplyStats:
        """After a sync: tensors committed into the lent memory are live already; a parameter
        with any other touched tensor (or, with `changed` None, any at all) is installed again
        from the state and shared. Either way each layer of a touched tensor dequantizes its
        float32 copy anew, if it computes with one (module doc)."""
        start = time.perf_counter()
        names = sorted(state) if changed is None else sorted(set(touched) | set(changed))
        self._validate(state, names, changed)
        if changed is None:
            self._check_complete(state)
        stale = sorted({self._target(name) for name in names if not self._is_live(state, name)})
        members = self._members(state)
        modules = dict(self.model.named_modules())
        paths = sorted({self._target(name).rpartition(".")[0] for name in names} & modules.keys())
        held = {path: cpu_compute.drop_dequantized(modules[path]) for path in paths}  # old arrays go as new come in
        for target in stale:
            self._share(state, target, members[target])
        for path in paths:  # once per layer, after all its arrays are in
            cpu_compute.redequantize(modules[path], held[path])
        if changed is None:
            self.state = state
        return ApplyStats(len(stale), 0, changed is None, time.perf_counter() - start)

    def check_whole(self, state: Mapping[str, np.ndarray]) -> None:
        self._validate(state, list(state), None)
        self._check_complete(state)

    def install(self, state: MutableMapping[str, np.ndarray]) -> ApplyStats:
        return self.apply(state, None, ())

    def _install(self, state: MutableMapping[str, np.ndarray], start: float | None = None) -> ApplyStats:
        """Install every parameter, one at a time, each shared as soon as it is in MLX (the
        state's own arrays are freed as it goes unless the caller holds on to them)."""
        return self.apply(state, None, ())

    def _share(self, state: MutableMapping[str, np.ndarray], target: str, members: list[str]) -> None:
        """Install parameter `target` from its checkpoint tensors and lend them views of it."""
        if members == [target] and target not in self.slots:
            home = state[target]
        else:
            home = np.empty(self._shapes[target], np.uint16)
            for name in members:
                self._part(home, name)[...] = state[name]
        array = mx.array(home).view(self._dtypes[target])
        del home
        self.model.load_weights([(target, array)], strict=False)
        mx.eval(array)
        view = np.array(array.view(mx.uint16), copy=False)  # the parameter's memory, no copy
        assert view.flags.writeable and view.flags.c_contiguous and view.shape == self._shapes[target], target
        self._arrays[target] = array
        for name in members:
            lent = self._part(view, name)
            assert lent.shape == state[name].shape, name
            state[name] = self._views[name] = lent

    def _part(self, whole: np.ndarray, name: str) -> np.ndarray:
        """Checkpoint tensor `name`'s part of its parameter `whole` (a view)."""
        slot = self.slots.get(name)
        if slot is None:
            return whole
        return whole[slot.index] if slot.index is not None else whole.reshape(slot.shape)

    def _is_live(self, state: Mapping[str, np.ndarray], name: str) -> bool:
        view, target = self._views.get(name), self._target(name)
        return view is not None and state.get(name) is view and self._param(target) is self._arrays.get(target)

    # -- validation and read back ------------------------------------------------------------
    def _validate(
        self, state: Mapping[str, np.ndarray], names: Iterable[str], changed: Mapping[str, np.ndarray] | None
    ) -> None:
        for name in names:
            bits = touched_bits(state, name, "plane bits", changed)
            slot = self.slots.get(name)
            check_shape(name, bits, slot.shape if slot is not None else self._shapes.get(name))

    @property
    def nbytes(self) -> int:
        params: dict[str, mx.array] = tree_flatten(self.model.parameters(), destination={})  # type: ignore[assignment]
        return sum(a.nbytes for a in params.values())

    def mismatches(self, state: Mapping[str, np.ndarray]) -> list[str]:
        """Checkpoint names whose served bytes differ from the plane state's, and model
        parameters or state tensors that one side lacks."""
        bad: list[str] = []
        held = self._members(state)
        bad += sorted(name for name in self._shapes if name not in held)
        for target, members in held.items():
            if target not in self._shapes:
                bad += members
                continue
            served = np.array(self._param(target).view(mx.uint16))
            for name in members:
                bits, part = state[name], self._part(served, name)
                if tuple(bits.shape) != part.shape or not np.array_equal(part, bits):
                    bad.append(name)
        return sorted(bad)

    def digest_check(self, state: Mapping[str, np.ndarray]) -> bool:
        return not self.mismatches(state)
