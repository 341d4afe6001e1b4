"""A quantized weight plane as PULSE carries it: the bf16-bit state the publisher diffs and the
subscriber holds, and the arrays a worker serves from it.

A plane (`QUANT_PLANES`: "int8", "int4"; MLX affine quantization, groups of 64 as mlx-lm's
default) is `quant.quantized_state` of the trainer's bf16 state with mlx-lm's predicate for the
model type: each quantized ``<module>.weight`` becomes its uint32 codes plus bf16
``<module>.scales`` / ``<module>.biases``, every other tensor stays bf16. The PULSE codec patches
uint16 arrays, so `plane_bits` gives the codes as their uint16 halves (two per word, a
little-endian view); a patch over it carries exactly the changed halves of the codes and the
changed scales and biases. `served` views the held halves as the uint32 codes again, without a
copy: a subscriber on a plane holds the plane alone (no bf16 master of the quantized tensors),
and its state digest is over the bytes the worker serves.

`updated_plane_bits` gives the plane of a new bf16 state from the plane of the previous one and
the bf16 elements that changed, re-quantizing only the groups holding them (a group's codes,
scale and bias depend on its own elements alone, so the result equals `plane_bits` of the new
state bit for bit); the publisher publishes a plane's next version that way.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from slime_stoa.protocol.layout import QUANT_PLANES, QuantPlane, check_plane

from .parallel import ordered_map
from .quant import (
    DEFAULT_GROUP_SIZE,
    mlx_lm_predicate,
    plane_layout,
    plane_names,
    quantize,
    quantize_groups_into,
    quantized_state,
)

__all__ = [
    "PLANE_PARAMS", "QUANT_PLANES", "QuantPlane", "check_plane", "code_names", "plane_bits", "plane_shapes", "served",
    "updated_plane_bits",
]
PLANE_PARAMS: dict[QuantPlane, tuple[int, int]] = {"int8": (DEFAULT_GROUP_SIZE, 8), "int4": (DEFAULT_GROUP_SIZE, 4)}
#: From this share of a tensor's groups touched on, `updated_plane_bits` quantizes the whole tensor
#: into new arrays: cheaper then than copying the previous arrays and gathering and scattering
#: the touched groups (a step changing ~2% of the weights touches ~70% of the groups of 64).
WHOLE_TENSOR_SHARE = 0.7


def plane_bits(
    bf16_state: Mapping[str, np.ndarray], plane: QuantPlane, model_type: str | None = None, *, threads: int | None = 1
) -> dict[str, np.ndarray]:
    """The plane of a bf16 state (uint16 bits) as uint16 arrays: codes as their halves; `threads`
    tensors at a time (`parallel.thread_count`)."""
    group_size, bits = PLANE_PARAMS[check_plane(plane)]
    quantized = quantized_state(bf16_state, group_size, bits, mlx_lm_predicate(model_type), threads=threads)
    return {name: a.view(np.uint16) if a.dtype == np.uint32 else a for name, a in quantized.items()}


def updated_plane_bits(
    previous: Mapping[str, np.ndarray],
    bf16_state: Mapping[str, np.ndarray],
    changed: Mapping[str, np.ndarray],
    plane: QuantPlane,
    model_type: str | None = None,
    *,
    threads: int | None = 1,
) -> dict[str, np.ndarray]:
    """`plane_bits(bf16_state, ...)`, from `previous` (`plane_bits` of the bf16 state before)
    and `changed` (bf16 tensor name -> flat indices of the elements that changed, as a `Delta`'s):
    only the groups holding changed elements are quantized again (the whole tensor when they are
    `WHOLE_TENSOR_SHARE` of its groups or more). Unchanged tensors are
    `previous`'s own arrays; changed ones new arrays. `threads` tensors at a time
    (`parallel.thread_count`). ValueError when `previous` is not a plane of a state shaped like `bf16_state`."""
    group_size, bits = PLANE_PARAMS[check_plane(plane)]
    layout = plane_layout({n: a.shape for n, a in bf16_state.items()}, group_size, bits, mlx_lm_predicate(model_type))
    expected = {p for name in layout for p in plane_names(name)} | (bf16_state.keys() - layout.keys())
    if previous.keys() != expected:
        raise ValueError("the previous plane does not hold the tensors of this state's plane")
    out = dict(previous)

    def one(name: str) -> dict[str, np.ndarray]:
        indices = np.asarray(changed[name], dtype=np.int64)
        new = bf16_state[name]
        params = layout.get(name)
        if params is None:
            if previous[name].shape != new.shape:
                raise ValueError(f"{name}: shape {new.shape} is not the previous plane's {previous[name].shape}")
            return {name: new}
        size, width = params
        codes_name, scales_name, biases_name = plane_names(name)
        if previous[codes_name].size != new.size * width // 16 or previous[scales_name].size != new.size // size:
            raise ValueError(f"{name}: the previous plane's arrays do not fit its shape {new.shape}")
        if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= new.size):
            raise ValueError(f"{name}: changed indices out of range for {new.size} elements")
        touched = np.zeros(new.size // size, dtype=bool)
        touched[indices // size] = True
        rows = np.flatnonzero(touched)
        if rows.size >= WHOLE_TENSOR_SHARE * touched.size:
            q = quantize(new, size, width, name=name)
            return {codes_name: q.codes.view(np.uint16), scales_name: q.scales, biases_name: q.biases}
        codes, scales, biases = previous[codes_name].copy(), previous[scales_name].copy(), previous[biases_name].copy()
        quantize_groups_into(
            new, rows, codes.reshape(-1, size * width // 16).view(np.uint32), scales.reshape(-1), biases.reshape(-1),
            size, width, name=name,
        )
        return {codes_name: codes, scales_name: scales, biases_name: biases}

    names = [name for name, indices in changed.items() if len(indices)]
    unknown = [name for name in names if name not in bf16_state]
    if unknown:
        raise ValueError(f"{unknown[0]}: changed, but not a tensor of the state")
    for part in ordered_map(one, names, threads):
        out.update(part)
    return out


def code_names(
    bf16_shapes: Mapping[str, tuple[int, ...]], plane: QuantPlane, model_type: str | None = None
) -> frozenset[str]:
    """The plane tensors that are uint32 codes (the quantized weights' names)."""
    group_size, bits = PLANE_PARAMS[check_plane(plane)]
    return frozenset(plane_layout(bf16_shapes, group_size, bits, mlx_lm_predicate(model_type)))


def plane_shapes(
    bf16_shapes: Mapping[str, tuple[int, ...]], plane: QuantPlane, model_type: str | None = None
) -> dict[str, tuple[int, ...]]:
    """The shapes of `plane_bits`' arrays for a bf16 state of these shapes, without quantizing:
    a quantized ``(..., k)`` weight's codes ``(..., k * bits / 16)`` (uint16 halves), its scales
    and biases ``(..., k / group_size)``; every other tensor its own shape."""
    group_size, bits = PLANE_PARAMS[check_plane(plane)]
    layout = plane_layout(bf16_shapes, group_size, bits, mlx_lm_predicate(model_type))
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in bf16_shapes.items():
        params = layout.get(name)
        if params is None:
            out[name] = tuple(shape)
            continue
        size, width = params
        lead, k = tuple(shape[:-1]), shape[-1]
        codes, scales, biases = plane_names(name)
        out[codes], out[scales], out[biases] = (*lead, k * width // 16), (*lead, k // size), (*lead, k // size)
    return out


def served(held: Mapping[str, np.ndarray], codes: frozenset[str]) -> dict[str, np.ndarray]:
    """The arrays a worker serves from a held plane state: `codes` viewed as uint32 (no copy),
    the rest as held. ValueError when a code tensor is missing or cannot be viewed as words."""
    out = dict(held)
    for name in codes:
        halves = held.get(name)
        if halves is None or halves.dtype != np.uint16 or halves.ndim < 1 or halves.shape[-1] % 2:
            raise ValueError(f"{name}: expected the uint16 halves of uint32 codes")
        out[name] = halves.view(np.uint32)
    return out
