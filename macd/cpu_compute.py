"""Float32 compute of bf16 weights on MLX's CPU device (a Linux machine, CI).

Why: MLX's CPU backend has no fast bfloat16 matmul. A bf16 matmul runs MLX's own loop (~5
GFLOP/s measured on an x86-64 CPU, one thread), a float32 one calls the BLAS's `cblas_sgemm`,
which a fast BLAS (`macd.cpu_blas`) runs at 40-100 GFLOP/s on one core. So on the CPU device
the matmul layers compute with a float32 copy of their weight, and the activations are float32
from the embedding on: every other op (norms, convolutions, biases, attention, the KV cache)
then computes in float32 too, each bf16 parameter promoted against float32 input.

The weights are the same: bf16 -> float32 is exact, so a float32 copy *is* the served bf16
weights; only the arithmetic is more precise (float32 activations instead of bf16-rounded ones),
which brings the recorded logprobs closer to the exact function of the weights, not away from
the learner's. The bf16 arrays stay the model's parameters and the master: `LiveWeights` lends
their memory to the subscriber's state and the digest covers their bits. The copies are held
beside them, out of the parameter tree (`model.parameters()` never shows them): 4 more bytes per
weight of those layers, so ~6 bytes per weight on the CPU device instead of 2.

Which layers: `nn.Linear` (and subclasses), `nn.Embedding` (its lookup widens the rows it
gathers, no copy; `as_linear`, a tied output head, multiplies with the copy), and layers a
`macd.cpu_fixes` fix computes in float32 (mlx-lm's `SwitchLinear` experts). Quantized layers
are other classes: with float32 activations, and where a fast BLAS serves MLX, a float32 copy of
their weight dequantized (the section at the end, `use_float32_activations`).

Keeping a copy equal to its weight: a copy is made at the layer's first call and remembers the
bf16 array it widened; a layer whose weight array was replaced (a load, an install of a new
tensor) widens the new one at its next call. A weight written *in place* (a patch committed
into the live bf16 memory keeps the array) must be refreshed by whoever wrote it:
`refresh(layer, indices)` rewidens the written elements in place (`LiveWeights.apply` does so
after each commit, at the same safe point). `copy_matches` is the read-back check.

When: on the CPU device with a fast BLAS under MLX (`float32_compute_wanted`). MLX's bundled
reference BLAS makes float32 *slower* than its bf16 loop (SmolLM2-135M, batch 16, measured: 7
tok/s against 17), so without a fast one the model computes as it always did.
``STOA_CPU_COMPUTE=float32`` forces float32 (tests), ``bfloat16`` keeps the stock compute.
Nothing changes on a GPU device (an Apple silicon Mac: Metal's kernels take bf16).

Measured (SmolLM2-135M, bf16 plane, batch 16, MKL on one thread, 2 shared cores): decoding
17 -> 77-98 tok/s against the stock bf16 compute; widening the weights at every call instead of
keeping copies saves their 4 bytes per weight but decodes at 45-62 tok/s. Rewidening a 1% patch
(1.3M elements) at the safe point takes 50-75 ms. The learner's logprobs (torch, float32 compute
of the bf16 weights) of the worker's samples differ from the recorded ones by 8.5e-5 nats per
token on average, 2.5e-4 at most, against 0.029 and 0.20 with the bf16 compute.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cpu_blas import sgemm_provider

ENV = "STOA_CPU_COMPUTE"  # "auto" (default), "float32" or "bfloat16" (stock MLX compute)
CHOICES = ("auto", "float32", "bfloat16")
NARROW = (mx.bfloat16, mx.float16)  # weight dtypes a copy widens (exactly) to float32


def float32_compute_wanted() -> bool:
    """Whether layers should compute in float32 here: on the CPU device, when a fast BLAS serves
    MLX's float32 matmuls (`macd.cpu_blas`) or `ENV` says float32; never when it says bfloat16.
    ValueError on another value of `ENV` (a typo must not silently pick the slow path)."""
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(CHOICES)}")
    if choice == "bfloat16" or mx.default_device().type != mx.cpu:
        return False
    return choice == "float32" or sgemm_provider() is not None


@dataclass(slots=True)
class _Copy:
    """A layer's float32 copy of its weight, and the bf16 array it was widened from."""

    source: mx.array
    array: mx.array


def wide_weight(layer: nn.Module) -> mx.array:
    """`layer`'s weight in float32: its copy, made (or made anew, if the weight array was
    replaced since) here. A float32 weight is returned as it is."""
    weight = layer["weight"]
    if weight.dtype not in NARROW:
        return weight
    copy: _Copy | None = layer.__dict__.get("_wide")
    if copy is None or copy.source is not weight:
        wide = weight.astype(mx.float32)
        mx.eval(wide)  # its own buffer now, which `refresh` may write in place
        copy = _Copy(weight, wide)
        object.__setattr__(layer, "_wide", copy)  # not an mx.array attribute: no parameter
    return copy.array


def _linear_call(self: Any, x: mx.array) -> mx.array:
    """`nn.Linear.__call__` with the float32 weight (float32 output)."""
    w = wide_weight(self)
    if "bias" in self:
        return mx.addmm(self["bias"].astype(mx.float32), x, w.T)
    return x @ w.T


def _embedding_call(self: Any, x: mx.array) -> mx.array:
    """`nn.Embedding.__call__` widened: the gathered rows in float32 (exact; no copy needed)."""
    return self["weight"][x].astype(mx.float32)


def _embedding_as_linear(self: Any, x: mx.array) -> mx.array:
    """`nn.Embedding.as_linear` (a tied output head) with the float32 weight."""
    return x @ wide_weight(self).T


_METHODS: dict[type, dict[str, Any]] = {
    nn.Linear: {"__call__": _linear_call},
    nn.Embedding: {"__call__": _embedding_call, "as_linear": _embedding_as_linear},
}
_SWITCHED: dict[type, type] = {}  # stock class -> its float32 subclass


def use_float32_compute(model: nn.Module) -> int:
    """Make `model`'s Linear and Embedding layers compute in float32 (module docstring), in place
    (each layer's class is swapped for a subclass); how many layers were switched now.
    Idempotent; quantized layers and other classes are left as they are."""
    switched = 0
    for _, module in model.named_modules():
        cls = type(module)
        if cls in _SWITCHED.values():
            continue
        base = next((b for b in _METHODS if issubclass(cls, b)), None)
        if base is None:
            continue
        methods = {k: v for k, v in _METHODS[base].items() if getattr(cls, k) is getattr(base, k)}
        if not methods:  # the class computes its own way: leave it
            continue
        module.__class__ = _SWITCHED.setdefault(cls, type(f"Float32{cls.__name__}", (cls,), methods))
        switched += 1
    return switched


def computes_in_float32(model: nn.Module) -> bool:
    """Whether `use_float32_compute` switched any layer of `model`."""
    return any(type(m) in _SWITCHED.values() for _, m in model.named_modules())


def has_copy(layer: nn.Module) -> bool:
    """Whether `layer` holds a float32 copy of its current weight array."""
    copy: _Copy | None = layer.__dict__.get("_wide")
    return copy is not None and "weight" in layer and copy.source is layer["weight"]


def refresh(layer: nn.Module, indices: np.ndarray | None = None) -> int:
    """After `layer`'s 16-bit weight was written in place: rewiden the elements at the sorted
    flat `indices` (None: all) into its float32 copy, in place; the elements rewidened (0 when
    the layer holds no copy of this weight: its next call makes one). Call it where the write
    happened, before the layer computes again (nothing may compute with the copy meanwhile)."""
    if not has_copy(layer):
        forget(layer)
        return 0
    copy: _Copy = layer.__dict__["_wide"]
    bits = np.array(copy.source.view(mx.uint16), copy=False).reshape(-1)
    wide = np.array(copy.array, copy=False).reshape(-1).view(np.uint32)  # the copy's memory
    assert wide.flags.writeable and wide.size == bits.size
    if indices is None and copy.source.dtype == mx.bfloat16:
        np.copyto(wide, bits)  # no temporary the size of the tensor
        wide <<= 16
    elif indices is None:
        wide[...] = _widened_bits(bits, copy.source.dtype)
    else:
        wide[indices] = _widened_bits(bits[indices], copy.source.dtype)
    return int(bits.size if indices is None else np.asarray(indices).size)


def _widened_bits(bits: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
    """The float32 bit patterns of 16-bit floats' bits."""
    if dtype == mx.bfloat16:
        return bits.astype(np.uint32) << 16
    return bits.view(np.float16).astype(np.float32).view(np.uint32)


def forget(layer: nn.Module) -> None:
    """Drop `layer`'s copy, widened or dequantized (after its weight array was replaced: the next
    call makes one of the new arrays, and the old copy's memory is not held until then)."""
    layer.__dict__.pop("_wide", None)
    layer.__dict__.pop(_DEQUANTIZED, None)


def copy_matches(layer: nn.Module) -> bool:
    """True unless `layer` holds a copy of its current weight that is not exactly that weight
    widened, or dequantized (a write in place that was not `refresh`ed or `redequantize`d)."""
    dequantized = _dequantized_copy(layer)
    if dequantized is not None:
        return bool(mx.array_equal(_dequantize(layer, *dequantized.sources), dequantized.array).item())
    if not has_copy(layer):
        return True
    copy: _Copy = layer.__dict__["_wide"]
    return bool(mx.array_equal(copy.source.astype(mx.float32), copy.array).item())


def copies_nbytes(model: nn.Module) -> int:
    """Bytes of the float32 copies `model`'s layers hold, widened or dequantized."""
    total = 0
    for _, m in model.named_modules():
        dequantized = _dequantized_copy(m)
        total += dequantized.array.nbytes if dequantized is not None else 0
        total += m.__dict__["_wide"].array.nbytes if has_copy(m) else 0
    return total


# -- quantized planes: float32 activations, float32 dequantized weights -----------------------------
def float32_activations_wanted() -> bool:
    """Whether a quantized model should compute with float32 activations here (MLX's CPU
    quantized kernels accumulate bf16 input in bf16: `macd.plane_weights`' module doc): on MLX's
    CPU device unless `ENV` says ``bfloat16``; ValueError on a misspelt setting."""
    if mx.default_device().type != mx.cpu:
        return False
    float32_compute_wanted()  # refuses a value of the setting it does not know
    return os.environ.get(ENV, "").strip().lower() != "bfloat16"


@dataclass(slots=True)
class _Dequantized:
    """A quantized layer's weight dequantized in float32, and the arrays it was made from."""

    sources: tuple[mx.array, mx.array, mx.array]  # codes, scales, biases
    array: mx.array


_DEQUANTIZED = "_dequantized"  # the layer attribute holding its `_Dequantized` (not an mx.array: no parameter)


def _quantized_arrays(layer: nn.Module) -> tuple[mx.array, mx.array, mx.array]:
    return layer["weight"], layer["scales"], layer["biases"]


def _dequantize(layer: nn.Module, codes: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    """w = s * q + b per element, in float32 (the bf16 scales and biases widened, exactly): the
    values MLX's quantized kernels multiply float32 input with."""
    return mx.dequantize(codes, scales=scales.astype(mx.float32), biases=biases.astype(mx.float32),
                         group_size=layer.group_size, bits=layer.bits, mode=layer.mode)


def dequantized_weight(layer: nn.Module) -> mx.array:
    """Quantized `layer`'s weight dequantized in float32: its copy, made (or made anew, if any of
    its codes, scales or biases arrays was replaced since) here."""
    copy = _dequantized_copy(layer)
    if copy is None:
        layer.__dict__.pop(_DEQUANTIZED, None)  # a stale copy's memory goes before the new one is made
        sources = _quantized_arrays(layer)
        array = _dequantize(layer, *sources)
        mx.eval(array)
        copy = _Dequantized(sources, array)
        object.__setattr__(layer, _DEQUANTIZED, copy)
    return copy.array


def _dequantized_copy(layer: nn.Module) -> _Dequantized | None:
    """`layer`'s dequantized copy when it is of the layer's current arrays."""
    copy: _Dequantized | None = layer.__dict__.get(_DEQUANTIZED)
    if copy is None or "scales" not in layer:
        return None
    current = all(held is now for held, now in zip(copy.sources, _quantized_arrays(layer), strict=True))
    return copy if current else None


def drop_dequantized(layer: nn.Module) -> bool:
    """Let `layer`'s dequantized copy go, its memory and its hold on the arrays it was made from
    (before they are replaced: the old ones are then freed as the new ones come in); whether it
    held one (`redequantize`'s `held`)."""
    return layer.__dict__.pop(_DEQUANTIZED, None) is not None


def redequantize(layer: nn.Module, held: bool = False) -> int:
    """After quantized `layer`'s arrays were written in place or replaced: its float32 copy made
    anew now, at the caller's safe point, if the layer computes with one; a ``QuantizedEmbedding``
    only if it held one (now, or `held`: before the caller dropped it), as its copy serves only a
    tied head and is made at its first `as_linear`. The elements dequantized (0: none)."""
    held = drop_dequantized(layer) or held
    if type(layer) not in _DEQUANTIZING.values():
        return 0
    if isinstance(layer, nn.QuantizedEmbedding) and not held:
        return 0  # an untied input embedding never multiplies: no copy until a tied head's first call
    return int(dequantized_weight(layer).size)


def _quantized_embedding_call(self: Any, x: mx.array) -> mx.array:
    """The rows of `x` dequantized in float32 (stock: in bf16, each row rounded twice), as the
    float32 kernel dequantizes them for a tied head."""
    return _dequantize(self, self["weight"][x], self["scales"][x], self["biases"][x])


def _quantized_embedding_as_linear(self: Any, x: mx.array) -> mx.array:
    return nn.QuantizedEmbedding.as_linear(self, x.astype(mx.float32))


def _quantized_linear_call(self: Any, x: mx.array) -> mx.array:
    return nn.QuantizedLinear.__call__(self, x.astype(mx.float32))


def _quantized_switch_call(self: Any, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
    stock = type(self).__bases__[0]  # mlx-lm's QuantizedSwitchLinear (the subclass adds only this)
    return stock.__call__(self, x.astype(mx.float32), indices, sorted_indices)


def _dequantized_embedding_as_linear(self: Any, x: mx.array) -> mx.array:
    return x.astype(mx.float32) @ dequantized_weight(self).T


def _dequantized_linear_call(self: Any, x: mx.array) -> mx.array:
    w = dequantized_weight(self)
    if "bias" in self:
        return mx.addmm(self["bias"].astype(mx.float32), x.astype(mx.float32), w.T)
    return x.astype(mx.float32) @ w.T


def _dequantized_switch_call(self: Any, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
    """mlx-lm's ``QuantizedSwitchLinear.__call__`` with the experts' float32 copy (`gather_mm`)."""
    y = mx.gather_mm(x.astype(mx.float32), dequantized_weight(self).swapaxes(-1, -2), rhs_indices=indices,
                     sorted_indices=sorted_indices)
    if "bias" in self:
        y = y + mx.expand_dims(self["bias"][indices].astype(mx.float32), -2)
    return y


_SWITCH_NAME = "QuantizedSwitchLinear"  # mlx-lm's quantized experts, known by name: only macd.generate imports mlx-lm


def _wide_methods(cls: type, dequantized: bool) -> dict[str, Any] | None:
    """The methods the float32 subclass of quantized layer class `cls` overrides: with float32
    activations through MLX's quantized kernels, or (`dequantized`) through a float32 copy of the
    weight (None: not such a class, or one switched already)."""
    if cls is nn.QuantizedEmbedding:
        linear = _dequantized_embedding_as_linear if dequantized else _quantized_embedding_as_linear
        return {"__call__": _quantized_embedding_call, "as_linear": linear}
    if cls is nn.QuantizedLinear:
        return {"__call__": _dequantized_linear_call if dequantized else _quantized_linear_call}
    if cls.__name__ == _SWITCH_NAME and cls.__module__.startswith("mlx_lm."):
        return {"__call__": _dequantized_switch_call if dequantized else _quantized_switch_call}
    return None


_ACTIVATIONS: dict[type, type] = {}  # quantized layer class -> its float32-activation subclass
_DEQUANTIZING: dict[type, type] = {}  # quantized layer class -> its float32-copy subclass


def use_float32_activations(model: nn.Module, dequantized: bool | None = None) -> int:
    """Make `model`'s affine quantized layers (``QuantizedLinear``, ``QuantizedEmbedding``,
    mlx-lm's ``QuantizedSwitchLinear``) compute with float32 activations, in place (each layer's
    class swapped for a subclass; module doc); how many layers were switched now. Idempotent.
    Parameters and their memory are untouched, so a state lent the model's memory stays live.

    `dequantized` (default: `float32_compute_wanted`, a fast BLAS on the CPU device): the layers
    multiply with a float32 copy of their weight dequantized, ``w = s * q + b`` (`dequantized_weight`),
    the same values MLX's quantized kernel computes from the codes for float32 input (its bf16
    scales and biases widened, exactly), so the same function of the served plane: only the
    summation order differs (a float32 ulp or so per output). MLX's CPU ``quantized_matmul`` and
    ``gather_qmm`` are plain loops (~2 GFLOP/s, one thread) where the copy goes through the BLAS's
    ``cblas_sgemm`` (measured, 576x1536 int8 or int4, MKL on one thread: 12.5 ms -> 0.45 ms at 16
    rows, 155 -> 3.6 ms at 200; through MLX's bundled reference BLAS no faster than the loop, so
    not there). The cost: 4 bytes per weight of those layers beside the plane's (`copies_nbytes`).
    A copy is made at its layer's first call, or at the weights' install (`redequantize`), and
    made anew when the layer's arrays were replaced; a write into them in place must be followed
    by `redequantize` (`PlaneWeights.apply` does so)."""
    if dequantized is None:
        dequantized = float32_compute_wanted()
    switched = 0
    for _, module in model.named_modules():
        cls = type(module)
        methods = _wide_methods(cls, dequantized)
        if methods is None or getattr(module, "mode", "affine") != "affine" or module.get("biases") is None:
            continue  # another class (or one switched already) computes its own way
        family, prefix = (_DEQUANTIZING, "Float32Dequantized") if dequantized else (_ACTIVATIONS, "Float32Activations")
        module.__class__ = family.setdefault(cls, type(f"{prefix}{cls.__name__}", (cls,), methods))
        switched += 1
    return switched


def computes_float32_activations(model: nn.Module) -> bool:
    """Whether `use_float32_activations` switched any layer of `model`."""
    switched = (*_ACTIVATIONS.values(), *_DEQUANTIZING.values())
    return any(type(m) in switched for _, m in model.named_modules())


def computes_dequantized(model: nn.Module) -> bool:
    """Whether `use_float32_activations` made any layer of `model` compute with a float32 copy."""
    return any(type(m) in _DEQUANTIZING.values() for _, m in model.named_modules())


def redequantize_all(model: nn.Module) -> int:
    """`redequantize` every layer of `model` (after an install); the elements dequantized."""
    return sum(redequantize(m) for _, m in model.named_modules())
