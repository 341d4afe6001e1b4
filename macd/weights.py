"""The daemon's live MLX weights, following the PULSE bf16 master state version after version.

Who owns which bytes, and which thread touches them
---------------------------------------------------
`LiveWeights` (and its subclasses `hf_layout.LayoutWeights`, `plane_weights.PlaneWeights`) is
the one owner of a worker's weight bytes: the MLX parameters and `state`, the uint16 bits of
the verified version they hold (`digest`, its root). The protocol layer's deferred subscriber
holds none of them: for the length of a sync it reads them through `bits()` (read-only views)
to stage the next version beside generation, and returns it verified
(`pulse.sync_result.StagedSync`). Everything that writes them runs on the MLX thread
(`mlx_thread.MLXThread`), where nothing computes with the model (a safe point of the
generation loop): `install_version` takes a staged version in one call, `from_state` a first
one. Reads for staging may run on any thread meanwhile: no write happens while a sync runs
(the follower installs only between syncs).

`LiveWeights` serves an mlx-lm model on one of two planes:

- ``"bf16"``: one copy of the weights. The state *is* the model: `from_state` installs each
  tensor into MLX and replaces it, in the state mapping, by a writable numpy view of the MLX
  parameter's memory (uint16 bits), so a patch written into the state writes the live weights
  in place and the digest covers exactly the bits the model computes with. Memory: 2 bytes per
  weight. A state tensor that is not the live view (a new state, from an anchor) is installed
  and shared in its turn by `apply`.
- ``"int8"``: Linear/Embedding layers are MLX affine-quantized (8 bits, groups of 64 along the
  input axis), chosen by mlx-lm's rule: a layer is quantized when it can be (``to_quantized``)
  and its input size is a multiple of the group size, subject to the model's own
  ``quant_predicate``; the other tensors (norms, biases, misfit layers) stay bf16. After a sync
  only the *groups* holding changed elements are re-quantized from the master. The plane keeps
  the bf16 master beside the model (``state``: separate numpy arrays, its own, which it
  re-quantizes from): 2 bytes per weight for the master plus ~1.06 for the served int8 weights
  (8 bits and a bf16 scale and bias per 64) and 2 for each tensor left in bf16, so ~3.06 bytes
  per weight, against 2 on the bf16 plane.

On a quantized plane the run publishes, the worker holds that plane alone instead
(`macd.plane_weights.PlaneWeights`, a subclass of this one, the 4-bit plane only that way).

On MLX's CPU device (a Linux machine), the bf16 plane's model computes in float32
(`macd.cpu_compute`: MLX has no fast bf16 matmul there): its matmul layers hold a float32 copy
of their bf16 weight beside it (~6 bytes per weight in all), exact, so the model serves the same
weights. The bf16 parameters stay the master the state shares; a tensor written in place is
rewidened into its copy at the same safe point (`apply`), a replaced one at its layer's next
call, and `mismatches` checks the copies too.

Installing a version (`install_version`, the one install path of every plane): a staged patch
is committed into ``state`` (`pulse.staged.StagedPatch.commit`: on bf16 and a held plane that
is the model's memory, on int8 the master) and the model refreshed from it (`apply`: float32
copies rewidened, int8 groups re-quantized); a new state (an anchor) is installed whole. On a
failure nothing changed: the patch's undo log restores ``state`` and the model is refreshed from
it again. When even that fails, or a whole install stopped half-way, `digest` becomes None:
the model holds no verified version, and the follower restores it from an anchor.

Why re-quantizing a subset of groups equals quantizing the whole tensor
-----------------------------------------------------------------------
Affine quantization is computed per group: a group's scale and bias come from that group's 64
values alone (its min and max), and each code from its own value and that scale and bias. With
``bits * group_size`` a multiple of 32, a group's codes fill whole uint32 words, and with the
input size a multiple of the group size no group straddles two rows. So ``mx.quantize`` of a
``(out, in)`` weight is, row-major, the concatenation of the independent per-group results: group
``g = flat_index // group_size`` owns packed row ``g`` of ``weight.reshape(-1, words)``,
``scales.reshape(-1)[g]`` and ``biases.reshape(-1)[g]``. Groups whose 64 inputs did not change
keep their outputs; quantizing a stack of the changed groups (``(n, 64)``) with the same kernel
yields exactly their rows, which are scattered back. Tests check the result bit for bit against
quantizing the master from scratch.

Threading: plain synchronous MLX code. Call it only from the thread that owns MLX.
Build the model from its folder's config alone (`macd.generate.build_model`: no weights read,
its placeholders never computed) and install the master with `from_state`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from slime_stoa.protocol.pulse.sync_result import StagedSync
from slime_stoa.protocol.run_manifest import PLANES, Plane

from . import cpu_compute

INT8_BITS = 8
INT8_GROUP_SIZE = 64
MASTER_PLANES = ("bf16", "int8")  # planes served from a bf16 master held here
TIED_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


@dataclass(frozen=True, slots=True)
class ApplyStats:
    """What one refresh did."""

    tensors: int  # tensors refreshed (replaced, or with groups re-quantized)
    groups: int  # quantized groups re-quantized (0 on the bf16 plane)
    full: bool  # the whole state was installed
    seconds: float


@dataclass(frozen=True, slots=True)
class _QuantizedWeight:
    """A quantized layer's weight, seen from the master as a bf16 tensor."""

    module: str  # the layer's path, e.g. "model.layers.0.mlp.up_proj"
    shape: tuple[int, ...]  # logical (bf16) shape
    group_size: int
    bits: int

    @property
    def groups(self) -> int:
        return int(np.prod(self.shape)) // self.group_size

    @property
    def words(self) -> int:
        """uint32 words per packed group."""
        return self.group_size * self.bits // 32


def touched_bits(
    state: Mapping[str, np.ndarray], name: str, what: str, changed: Mapping[str, np.ndarray] | None
) -> np.ndarray:
    """`state[name]` as a patch left it: a uint16 array (`what` it holds, for the error), its
    `changed` indices sorted and inside it; ValueError naming the tensor otherwise."""
    bits = state.get(name)
    if bits is None:
        raise ValueError(f"{name}: touched but not in the state")
    if not isinstance(bits, np.ndarray) or bits.dtype != np.uint16:
        got = getattr(bits, "dtype", type(bits).__name__)
        raise ValueError(f"{name}: expected {what} as a uint16 array, got {got}")
    indices = changed.get(name) if changed is not None else None
    if indices is not None and indices.size and not 0 <= indices[0] <= indices[-1] < bits.size:
        raise ValueError(f"{name}: changed indices outside its {bits.size} elements (or unsorted)")
    return bits


def check_shape(name: str, bits: np.ndarray, shape: tuple[int, ...] | None) -> None:
    """ValueError unless `bits` has the model's `shape` for `name` (None: no such parameter)."""
    if shape is None:
        raise ValueError(f"{name}: not a parameter of the model")
    if tuple(bits.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(bits.shape)} does not match the model's {shape}")


class LiveWeights:
    """An mlx-lm model whose weights follow a bf16 master state (see the module docstring)."""

    def __init__(self, model: nn.Module, plane: Plane):
        """Wrap `model` as it is; use `from_state` to install a master into it."""
        if plane not in PLANES:
            raise ValueError(f"plane must be one of {PLANES}, got {plane!r}")
        if plane not in MASTER_PLANES:
            raise ValueError(f"plane {plane} is served only from the run's published {plane} plane (PlaneWeights)")
        self.model = model
        self.plane = plane
        self.state: MutableMapping[str, np.ndarray] = {}  # the bits it holds (module doc); filled by `from_state`
        self.digest: str | None = None  # their state digest's root, when they are a verified version
        self._index()

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_state(
        cls, model: nn.Module, state: dict[str, np.ndarray], plane: Plane, digest: str | None = None
    ) -> LiveWeights:
        """Install the full bf16 master `state` into `model`, quantizing it for the int8 plane;
        the weights own `state` from then on (`digest`: its root, when a verified version).

        On bf16 the state's tensors are replaced, in `state` itself, by views of the model's
        memory (see the module docstring): from then on the state and the model are one copy.

        `model` is an mlx-lm model of the same architecture (bf16, or already quantized for
        int8). Every state tensor must be a model parameter of the same shape (a tied model
        accepts an ``lm_head.weight`` equal to the embedding) and every parameter must be in the
        state; ValueError names the first offender and the model is left unchanged.
        """
        live = cls(model, plane)
        live._validate_full(state)
        if plane == "int8" and not live._quantized:
            _quantize_structure(model)
            live._index()
        live._install(state)
        live.digest = digest
        if plane == "bf16" and cpu_compute.float32_compute_wanted():
            cpu_compute.use_float32_compute(model)  # copies made at each layer's first call
        if plane == "int8" and cpu_compute.float32_activations_wanted():
            cpu_compute.use_float32_activations(model)  # MLX's CPU quantized kernel sums bf16 input in bf16
        return live

    @property
    def master_apart(self) -> bool:
        """Whether `state` is kept apart from the served weights (int8: the bf16 master they are
        quantized from), a second copy of the weights in memory."""
        return self.plane != "bf16"

    def bits(self) -> Mapping[str, np.ndarray]:
        """The bits held, read-only, for a deferred sync to stage the next version on (module doc)."""
        return MappingProxyType({name: _read_only(bits) for name, bits in self.state.items()})

    def install_version(self, staged: StagedSync) -> ApplyStats:
        """Install a verified version in one call (module doc); on the MLX thread, where nothing
        computes with the model. ValueError when a patch was staged on another version than the
        one held or does not fit the model; on any error nothing changed (`digest` None when the
        model could not be brought back: it then holds no verified version)."""
        held = self.digest
        if staged.patch is None:
            assert staged.state is not None
            self.check_whole(staged.state)  # ValueError with nothing written when it does not fit
            self.digest = None  # from here the old bits go as the new ones come in (no second copy)
            self.state = {}
            stats = self.apply(staged.state, None, ())
            self.digest = staged.digest.root()
            return stats
        if held is None or staged.base != held:
            raise ValueError(f"v{staged.version} was staged on state {staged.base}, the model holds {held}")
        patch = staged.patch
        undo = patch.commit(self.state)  # ValueError with nothing written when it does not fit
        self.digest = None
        try:
            stats = self.apply(self.state, patch.written, patch.touched)
        except BaseException:
            undo.rollback(self.state)
            self.apply(self.state, patch.written, patch.touched)  # copies and groups back from the bits
            self.digest = held
            raise
        self.digest = staged.digest.root()
        return stats

    def shares(self, state: Mapping[str, np.ndarray]) -> bool:
        """True when every bf16 tensor of `state` the model holds is the model's own memory
        (so writing into the state writes the live weights). Always False on int8."""
        if self.plane != "bf16":
            return False
        return all(state.get(name) is view and self._param(name) is self._arrays[name]
                   for name, view in self._views.items()) and len(self._views) == len(self._shapes)

    @property
    def nbytes(self) -> int:
        """Bytes of the model's parameters (what MLX holds for the weights)."""
        params: dict[str, mx.array] = tree_flatten(self.model.parameters(), destination={})  # type: ignore[assignment]
        return sum(a.nbytes for a in params.values())

    @property
    def copy_nbytes(self) -> int:
        """Bytes of the float32 copies the layers compute with on the CPU device (0 elsewhere)."""
        return cpu_compute.copies_nbytes(self.model)

    def _index(self) -> None:
        """Tabulate the model's tensors as the master sees them: name -> logical shape."""
        modules = dict(self.model.named_modules())
        params: dict[str, Any] = tree_flatten(self.model.parameters(), destination={})  # type: ignore[assignment]
        quantized: dict[str, _QuantizedWeight] = {}
        for path, module in modules.items():
            if "scales" not in module or not hasattr(module, "bits"):
                continue
            if self.plane != "int8":
                raise ValueError(f"{path} is quantized: the bf16 plane needs a bf16 model")
            if getattr(module, "mode", "affine") != "affine" or module.get("biases") is None:
                raise ValueError(f"{path}: only affine quantization (with biases) is supported")
            weight = module["weight"]
            logical = (*weight.shape[:-1], weight.shape[-1] * 32 // module.bits)
            q = _QuantizedWeight(path, logical, module.group_size, module.bits)
            assert logical[-1] % q.group_size == 0 and (q.group_size * q.bits) % 32 == 0, path
            quantized[_join(path, "weight")] = q
        shapes: dict[str, tuple[int, ...]] = {}
        for name, value in params.items():
            path, _, leaf = name.rpartition(".")
            if _join(path, "weight") in quantized and leaf in ("scales", "biases"):
                continue
            found = quantized.get(name)
            shapes[name] = found.shape if found else tuple(value.shape)
        self._modules = modules
        self._quantized = quantized
        self._shapes = shapes
        self._views: dict[str, np.ndarray] = {}  # bf16: name -> numpy view lent to the state
        self._arrays: dict[str, mx.array] = {}  # bf16: name -> the MLX parameter that view shows

    # -- refresh ---------------------------------------------------------------------------
    def apply(
        self,
        state: MutableMapping[str, np.ndarray],
        changed: Mapping[str, np.ndarray] | None,
        touched: Iterable[str],
    ) -> ApplyStats:
        """Refresh the model from the master `state` (`install_version`'s second half).

        `changed` maps tensor names to the sorted unique flat indices written into `state` (the
        one held); None means `state` is a whole new one: everything is installed from it and the
        weights own it from then on. A touched tensor without indices is
        refreshed whole. On bf16 a tensor that is the model's own memory is already live (nothing
        to do); any other is installed and shared (replaced in `state` by the live view).
        ValueError (model unchanged) if a tensor does not fit the model.
        """
        start = time.perf_counter()
        if changed is None:
            self._validate_full(state)
            return self._install(state, start)
        wanted = set(touched) | set(changed)
        if EMBEDDING in wanted and TIED_HEAD in state and self._is_tied_head(TIED_HEAD):
            wanted.add(TIED_HEAD)  # the state's head must follow the embedding it is tied to
        names = sorted(wanted)
        self._validate(state, names, changed)
        pairs: list[tuple[str, mx.array]] = []
        tensors = groups = 0
        for name in names:
            indices = changed.get(name)
            if name not in self._shapes or (indices is not None and indices.size == 0):
                continue  # a tied head (checked) or nothing written
            q = self._quantized.get(name)
            if q is None:
                if self._is_live(state, name):  # written in place: the model computes with it
                    self._rewiden(name, indices)  # and with its float32 copy, if it has one
                    continue
                pairs.append((name, _bf16(state[name])))
            elif indices is None or self._modules[q.module]["scales"].dtype != mx.bfloat16:
                # whole tensor (also when scales of another dtype came with a pre-quantized model)
                pairs += self._quantize_full(q, state[name])
                groups += q.groups
            else:
                ids = _group_ids(indices, q.group_size)
                pairs += self._quantize_groups(q, state[name], ids)
                groups += ids.size
            tensors += 1
        self._load(pairs, state)
        return ApplyStats(tensors, groups, False, time.perf_counter() - start)

    def install(self, state: MutableMapping[str, np.ndarray]) -> ApplyStats:
        """Re-install the whole master (same checks as `from_state`)."""
        return self.apply(state, None, ())

    def check_whole(self, state: Mapping[str, np.ndarray]) -> None:
        """ValueError naming the first tensor of a whole new `state` that does not fit the model."""
        self._validate_full(state)

    def _install(self, state: MutableMapping[str, np.ndarray], start: float | None = None) -> ApplyStats:
        """Write every tensor of an already validated state, which the weights hold from then on.
        On bf16 one tensor at a time, each shared as soon as it is in MLX, so the state's own
        arrays are freed as it goes (peak: one tensor more than the weights) unless the caller
        holds on to them."""
        start = time.perf_counter() if start is None else start
        groups = 0
        for name in self._shapes:
            q = self._quantized.get(name)
            if q is None:
                if not self._is_live(state, name):
                    self._load([(name, _bf16(state[name]))], state)
                else:
                    self._rewiden(name, None)
            else:
                self._load(self._quantize_full(q, state[name]))
                groups += q.groups
        self.state = state
        return ApplyStats(len(self._shapes), groups, True, time.perf_counter() - start)

    def _layer(self, name: str) -> nn.Module | None:
        """The layer whose weight is parameter `name` (None for any other parameter)."""
        path, _, leaf = name.rpartition(".")
        return self._modules.get(path) if leaf == "weight" else None

    def _rewiden(self, name: str, indices: np.ndarray | None) -> None:
        """Parameter `name` was written in place (at `indices`, None: anywhere): its layer's
        float32 copy, if it holds one, follows (`cpu_compute.refresh`)."""
        layer = self._layer(name)
        if layer is not None:
            cpu_compute.refresh(layer, indices)

    def _is_live(self, state: Mapping[str, np.ndarray], name: str) -> bool:
        """Whether state[name] is the live parameter's own memory (bf16)."""
        view = self._views.get(name)
        return view is not None and state.get(name) is view and self._param(name) is self._arrays[name]

    def _quantize_full(self, q: _QuantizedWeight, bits: np.ndarray) -> list[tuple[str, mx.array]]:
        weight, scales, biases = mx.quantize(_bf16(bits), group_size=q.group_size, bits=q.bits)
        return _quant_pairs(q, weight, scales, biases)

    def _quantize_groups(
        self, q: _QuantizedWeight, bits: np.ndarray, ids: np.ndarray
    ) -> list[tuple[str, mx.array]]:
        """Re-quantize groups `ids` of the master and scatter them into the layer's arrays."""
        rows = np.ascontiguousarray(bits.reshape(-1, q.group_size)[ids])
        packed, scales, biases = mx.quantize(_bf16(rows), group_size=q.group_size, bits=q.bits)
        layer = self._modules[q.module]
        at = mx.array(ids.astype(np.int32) if q.groups < 2**31 else ids)
        return _quant_pairs(
            q,
            _scatter(layer["weight"], (q.groups, q.words), at, packed),
            _scatter(layer["scales"], (q.groups,), at, scales.reshape(-1)),
            _scatter(layer["biases"], (q.groups,), at, biases.reshape(-1)),
        )

    def _load(self, pairs: list[tuple[str, mx.array]], state: MutableMapping[str, np.ndarray] | None = None) -> None:
        """Put `pairs` into the model; on bf16 lend each bf16 tensor's memory to `state`."""
        if not pairs:
            return
        self.model.load_weights(pairs, strict=False)
        mx.eval([a for _, a in pairs])
        for name, _ in pairs:  # a copy of a replaced weight is stale: let its memory go now
            layer = self._layer(name)
            if layer is not None:
                cpu_compute.forget(layer)
        if self.plane != "bf16" or state is None:
            return
        for name, array in pairs:
            view = np.array(array.view(mx.uint16), copy=False)  # the parameter's memory, no copy
            assert view.flags.writeable and view.flags.c_contiguous and view.shape == state[name].shape, name
            self._views[name], self._arrays[name] = view, array
            state[name] = view

    # -- validation ------------------------------------------------------------------------
    def _validate_full(self, state: Mapping[str, np.ndarray]) -> None:
        missing = [name for name in self._shapes if name not in state]
        if missing:
            raise ValueError(f"{missing[0]}: the model has this parameter but the state lacks it")
        self._validate(state, list(state), None)

    def _validate(
        self,
        state: Mapping[str, np.ndarray],
        names: Iterable[str],
        changed: Mapping[str, np.ndarray] | None,
    ) -> None:
        """ValueError naming the first tensor that does not fit the model."""
        for name in names:
            bits = touched_bits(state, name, "bf16 bits", changed)
            if name not in self._shapes and self._is_tied_head(name):
                self._check_tied_head(state, changed)
                continue
            check_shape(name, bits, self._shapes.get(name))
            if name not in self._quantized:
                dtype = self._param(name).dtype
                if dtype != mx.bfloat16:
                    raise ValueError(f"{name}: the model holds {dtype}, the master is bfloat16")

    def _is_tied_head(self, name: str) -> bool:
        """Whether `name` is an output head the model ties to its embedding (it has none of its own)."""
        return name == TIED_HEAD and TIED_HEAD not in self._shapes and EMBEDDING in self._shapes

    def _check_tied_head(
        self, state: Mapping[str, np.ndarray], changed: Mapping[str, np.ndarray] | None
    ) -> None:
        """A tied model has no head of its own: the state's head must equal the embedding."""
        head, embed = state[TIED_HEAD], state.get(EMBEDDING)
        if embed is None or head.shape != embed.shape:
            raise ValueError(f"{TIED_HEAD}: the model ties it to {EMBEDDING}, which the state lacks or shapes otherwise")
        if changed is None:
            same = np.array_equal(head, embed)
        else:  # only the written elements can have diverged
            at = np.union1d(changed.get(TIED_HEAD, []), changed.get(EMBEDDING, [])).astype(np.int64)
            same = np.array_equal(head.reshape(-1)[at], embed.reshape(-1)[at])
        if not same:
            raise ValueError(f"{TIED_HEAD}: differs from {EMBEDDING}, but the model ties them")

    def _param(self, name: str) -> mx.array:
        """The model's array at a dotted parameter name."""
        node: Any = self.model
        for part in name.split("."):
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node

    # -- read back -------------------------------------------------------------------------
    def mismatches(self, state: Mapping[str, np.ndarray]) -> list[str]:
        """Names whose model tensors differ from the master's bits (quantized: from quantizing
        the master from scratch), or that one side lacks. Empty when in sync."""
        bad = sorted(
            name for name in state if name not in self._shapes and not self._is_tied_head(name)
        )
        tied = TIED_HEAD in state and self._is_tied_head(TIED_HEAD)
        if tied and not np.array_equal(state[TIED_HEAD], state.get(EMBEDDING, np.empty(0, np.uint16))):
            bad.append(TIED_HEAD)
        for name, shape in self._shapes.items():
            bits = state.get(name)
            if bits is None or tuple(bits.shape) != shape or not self._matches(name, bits):
                bad.append(name)
        return bad

    def digest_check(self, state: Mapping[str, np.ndarray]) -> bool:
        """True when the model is bit-identical to (the quantization of) the master `state`."""
        return not self.mismatches(state)

    def _matches(self, name: str, bits: np.ndarray) -> bool:
        q = self._quantized.get(name)
        if q is None:
            param, layer = self._param(name), self._layer(name)
            same = param.dtype == mx.bfloat16 and np.array_equal(bf16_bits(param), bits)
            return same and (layer is None or cpu_compute.copy_matches(layer))
        expected = dict(self._quantize_full(q, bits))
        layer = self._modules[q.module]
        return all(_same_bits(layer[_leaf(key)], value) for key, value in expected.items())


# -- helpers -------------------------------------------------------------------------------
def bf16_bits(a: mx.array) -> np.ndarray:
    """A bf16 MLX array's bits as a uint16 numpy array."""
    if a.dtype != mx.bfloat16:
        raise ValueError(f"expected a bfloat16 array, got {a.dtype}")
    return np.array(a.view(mx.uint16))


def _read_only(bits: np.ndarray) -> np.ndarray:
    view = bits.view()
    view.flags.writeable = False
    return view


def _bf16(bits: np.ndarray) -> mx.array:
    return mx.array(bits).view(mx.bfloat16)


def _group_ids(indices: np.ndarray, group_size: int) -> np.ndarray:
    """Sorted unique groups of sorted flat indices."""
    g = np.asarray(indices, dtype=np.int64) // group_size
    if g.size <= 1:
        return g
    return g[np.concatenate(([True], g[1:] != g[:-1]))]


def _quant_pairs(
    q: _QuantizedWeight, weight: mx.array, scales: mx.array, biases: mx.array
) -> list[tuple[str, mx.array]]:
    return [(_join(q.module, leaf), a) for leaf, a in (("weight", weight), ("scales", scales), ("biases", biases))]


def _scatter(a: mx.array, shape: tuple[int, ...], at: mx.array, rows: mx.array) -> mx.array:
    """A copy of `a` seen as `shape` with rows `at` replaced (the module keeps `a` until the swap)."""
    flat = a.reshape(shape)
    flat[at] = rows
    return flat.reshape(a.shape)


def _same_bits(a: mx.array, b: mx.array) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (mx.bfloat16, mx.float16):
        a, b = a.view(mx.uint16), b.view(mx.uint16)
    elif a.dtype == mx.float32:
        a, b = a.view(mx.uint32), b.view(mx.uint32)
    return bool(mx.array_equal(a, b).item())


def _quantize_structure(model: nn.Module) -> None:
    """Swap quantizable layers for affine int8 ones, by mlx-lm's rule (`quantize_model`).

    The new layers' arrays stay unevaluated until `_install` overwrites them."""
    custom = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module) -> Any:
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % INT8_GROUP_SIZE:
            return False
        return custom(path, module) if custom is not None else True

    nn.quantize(model, INT8_GROUP_SIZE, INT8_BITS, mode="affine", class_predicate=predicate)


def _join(path: str, leaf: str) -> str:
    return f"{path}.{leaf}" if path else leaf


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]
