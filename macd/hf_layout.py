"""Live weights for mlx-lm models whose parameters are laid out otherwise than the HF checkpoint.

The PULSE state is the checkpoint's tensors under its names; `macd.weights.LiveWeights` installs
a state whose names are the model's parameters. mlx-lm's LFM2 / LFM2-MoE models rename and
restack on load (their ``sanitize``): the feed-forward ``w1`` / ``w3`` / ``w2`` are
``gate_proj`` / ``up_proj`` / ``down_proj``, the experts ``experts.{e}.wN.weight`` are stacked
into one ``switch_mlp.<proj>.weight`` of shape ``(experts, out, in)``, and the short
convolution's kernel ``(hidden, 1, L)`` is ``(hidden, L, 1)`` (the same memory: only an axis of
size 1 moves).

`LayoutWeights` keeps a model-layout state (one array per model parameter, its "home") and
lends the checkpoint state (its `state`, which it owns as `LiveWeights` does) views into it: an expert's tensor is row ``e`` of its stack, a
kernel a reshape of its home. On the bf16 plane the homes are the model's own memory
(`LiveWeights` lends them), so a patch written into the checkpoint state writes the live
weights in place, as for any other model; on int8 they are the bf16 master that the quantized
layers are refreshed from (changed elements translated to the stack's flat indices). A
checkpoint tensor that is not the lent view (a new array after an anchor sync) is copied into
its home first. `live_weights` picks `LiveWeights` itself when the names already match.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass

import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from slime_stoa.protocol.run_manifest import Plane

from .weights import TIED_HEAD, ApplyStats, LiveWeights

_RENAME = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_LEAF = r"(?P<leaf>weight|scales|biases)"  # a quantized plane's scales and biases follow their weight
_EXPERT = re.compile(r"^(?P<ff>.*\.feed_forward)\.experts\.(?P<e>\d+)\.(?P<w>w[123])\." + _LEAF + "$")
_DENSE = re.compile(r"^(?P<ff>.*\.feed_forward)\.(?P<w>w[123])\." + _LEAF + "$")


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a checkpoint tensor lives in the model: ``target[index]`` (a stack) or ``target``
    reshaped (`index` None)."""

    target: str
    index: int | None
    shape: tuple[int, ...]  # the checkpoint tensor's


def model_name(name: str) -> tuple[str, int | None]:
    """The model parameter checkpoint tensor `name` is (`index` None) or is row `index` of."""
    if m := _EXPERT.match(name):
        return f"{m['ff']}.switch_mlp.{_RENAME[m['w']]}.{m['leaf']}", int(m["e"])
    if m := _DENSE.match(name):
        return f"{m['ff']}.{_RENAME[m['w']]}.{m['leaf']}", None
    return name, None


def _squeezed(shape: Iterable[int]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def checkpoint_layout(
    model_shapes: Mapping[str, tuple[int, ...]], state_shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, Slot]:
    """The slot of every checkpoint tensor that is not a model parameter under its own name and
    shape; ValueError naming the first one that fits nowhere, or a stack left incomplete."""
    slots: dict[str, Slot] = {}
    for name, shape in state_shapes.items():
        if model_shapes.get(name) == tuple(shape) or name == TIED_HEAD:
            continue
        slot = Slot(*model_name(name), tuple(shape))
        target = model_shapes.get(slot.target)
        if target is None:
            raise ValueError(f"{name}: not a parameter of the model")
        if slot.index is None:
            ok = _squeezed(target) == _squeezed(shape)  # only axes of size 1 move: the same memory
        else:
            ok = target[1:] == tuple(shape) and slot.index < target[0]
        if not ok:
            raise ValueError(f"{name}: shape {tuple(shape)} does not fit the model's {slot.target} {target}")
        slots[name] = slot
    members: dict[str, set[int | None]] = defaultdict(set)
    for slot in slots.values():
        members[slot.target].add(slot.index)
    for name, held in members.items():
        stack = model_shapes[name][0] if None not in held else 1
        if len(held) != stack:
            raise ValueError(f"{name}: the state holds {len(held)} of its {stack} tensors")
    return slots


def _model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    params = tree_flatten(model.parameters(), destination={})
    assert isinstance(params, dict)
    return {name: tuple(a.shape) for name, a in params.items()}


def live_weights(
    model: nn.Module, state: dict[str, np.ndarray], plane: Plane, digest: str | None = None
) -> LiveWeights:
    """`LiveWeights.from_state`, through `LayoutWeights` when the model lays the checkpoint out
    otherwise (module docstring)."""
    slots = checkpoint_layout(_model_shapes(model), {n: tuple(a.shape) for n, a in state.items()})
    if not slots:
        return LiveWeights.from_state(model, state, plane, digest)
    live = LayoutWeights.from_layout(model, state, plane, slots)
    live.digest = digest
    return live


class LayoutWeights(LiveWeights):
    """`LiveWeights` of a checkpoint state whose tensors the model holds under other names or
    stacked (module docstring). Same interface; `inner` is the model-layout `LiveWeights`."""

    def __init__(self, inner: LiveWeights, slots: dict[str, Slot], homes: dict[str, np.ndarray]):
        self.inner, self.slots, self.homes = inner, slots, homes
        self.model, self.plane = inner.model, inner.plane
        self.state: MutableMapping[str, np.ndarray] = {}  # the checkpoint state, lent views of the homes
        self.digest: str | None = None
        self._lent: dict[str, np.ndarray] = {}  # checkpoint name -> the view of its home lent to the state
        self._model_state_cache: dict[str, np.ndarray] = {}  # what `inner` was last handed

    @classmethod
    def from_layout(
        cls, model: nn.Module, state: MutableMapping[str, np.ndarray], plane: Plane, slots: dict[str, Slot]
    ) -> LayoutWeights:
        shapes = _model_shapes(model)
        missing = [n for n in shapes if n not in state and n not in {s.target for s in slots.values()}]
        if missing:
            raise ValueError(f"{missing[0]}: the model has this parameter but the state lacks it")
        homes: dict[str, np.ndarray] = {}
        for name, slot in slots.items():
            if slot.target not in homes:
                homes[slot.target] = np.empty(shapes[slot.target], np.uint16)
            _check_bits(name, state[name], slot.shape)
        self = cls(LiveWeights(model, plane), slots, homes)
        self._fill(state, slots)
        self.inner = LiveWeights.from_state(model, self._model_state(state), plane)
        self._sync_back(state)
        self._lend(state, slots)
        self.state = state
        return self

    # -- the model-layout state ------------------------------------------------------------
    def _view(self, name: str) -> np.ndarray:
        slot = self.slots[name]
        home = self.homes[slot.target]
        return home[slot.index] if slot.index is not None else home.reshape(slot.shape)

    def _fill(self, state: Mapping[str, np.ndarray], names: Iterable[str]) -> None:
        """Copy each checkpoint tensor that is not its lent view into its home."""
        for name in names:
            bits = state[name]
            if bits is not self._lent.get(name):
                _check_bits(name, bits, self.slots[name].shape)
                self._view(name)[...] = bits

    def _lend(self, state: MutableMapping[str, np.ndarray], names: Iterable[str]) -> None:
        """Take back the homes `inner` may have replaced by the model's memory; lend views of them."""
        for target in {self.slots[n].target for n in names}:
            self.homes[target] = self._model_state_cache[target]
        for name in names:
            state[name] = self._lent[name] = self._view(name)

    def _model_state(self, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The state `inner` sees: the homes and every checkpoint tensor the model holds as it is."""
        out = {n: a for n, a in state.items() if n not in self.slots}
        out.update(self.homes)
        self._model_state_cache = out
        return out

    # -- LiveWeights' interface --------------------------------------------------------------
    def apply(
        self,
        state: MutableMapping[str, np.ndarray],
        changed: Mapping[str, np.ndarray] | None,
        touched: Iterable[str],
    ) -> ApplyStats:
        if changed is None:
            self._fill(state, self.slots)
            stats = self.inner.apply(self._model_state(state), None, ())
            self._sync_back(state)
            self._lend(state, self.slots)
            self.state = state
            return stats
        names = set(touched) | set(changed)
        mapped = [n for n in names if n in self.slots]
        self._fill(state, mapped)
        moved: dict[str, list[np.ndarray]] = defaultdict(list)
        whole: set[str] = set()
        for name in names:
            slot = self.slots.get(name)
            if slot is None:
                continue
            indices = changed.get(name)
            if indices is None:
                whole.add(slot.target)
            else:
                offset = 0 if slot.index is None else slot.index * int(np.prod(slot.shape))
                moved[slot.target].append(np.asarray(indices, np.int64) + offset)
        target_changed = {n: a for n, a in changed.items() if n not in self.slots}
        for target, parts in moved.items():
            if target not in whole:
                target_changed[target] = np.unique(np.concatenate(parts))
        target_touched = [n for n in names if n not in self.slots] + sorted(whole | set(moved))
        stats = self.inner.apply(self._model_state(state), target_changed, target_touched)
        self._sync_back(state)
        self._lend(state, mapped)
        return stats

    def install(self, state: MutableMapping[str, np.ndarray]) -> ApplyStats:
        return self.apply(state, None, ())

    def check_whole(self, state: Mapping[str, np.ndarray]) -> None:
        missing = [name for name in self.slots if name not in state]
        if missing:
            raise ValueError(f"{missing[0]}: the model holds this tensor but the state lacks it")
        for name, slot in self.slots.items():
            _check_bits(name, state[name], slot.shape)
        self.inner.check_whole({**{n: a for n, a in state.items() if n not in self.slots}, **self.homes})

    def _sync_back(self, state: MutableMapping[str, np.ndarray]) -> None:
        """The tensors `inner` lent the model's memory under their own names go back to `state`."""
        for name, array in self._model_state_cache.items():
            if name not in self.homes:
                state[name] = array

    def shares(self, state: Mapping[str, np.ndarray]) -> bool:
        lent = all(state.get(n) is self._lent.get(n) for n in self.slots)
        return lent and self.inner.shares(self._model_state(state))

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def mismatches(self, state: Mapping[str, np.ndarray]) -> list[str]:
        """Checkpoint names whose model tensors differ from the master's bits (every member of
        a stack that differs), or that one side lacks."""
        bad: list[str] = []
        view: dict[str, np.ndarray] = {n: a for n, a in state.items() if n not in self.slots}
        for name, slot in self.slots.items():
            bits = state.get(name)
            if bits is None or tuple(bits.shape) != slot.shape:
                bad.append(name)
                continue
            home = view.setdefault(slot.target, np.empty(self.homes[slot.target].shape, np.uint16))
            (home[slot.index] if slot.index is not None else home.reshape(slot.shape))[...] = bits
        inner_bad = set(self.inner.mismatches(view))
        for name, slot in self.slots.items():
            if slot.target in inner_bad and name not in bad:
                bad.append(name)
        bad += [n for n in inner_bad if n not in self.homes]
        return sorted(bad)

    def digest_check(self, state: Mapping[str, np.ndarray]) -> bool:
        return not self.mismatches(state)


def _check_bits(name: str, bits: np.ndarray, shape: tuple[int, ...]) -> None:
    if not isinstance(bits, np.ndarray) or bits.dtype != np.uint16:
        got = getattr(bits, "dtype", type(bits).__name__)
        raise ValueError(f"{name}: expected bf16 bits as a uint16 array, got {got}")
    if tuple(bits.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(bits.shape)} does not match the checkpoint's {shape}")
