"""MLX's affine quantization in numpy, bit-exact with ``mx.quantize`` on bf16 weights, and the
quantized weight plane a worker serves.

Arithmetic (that of ``mx.quantize`` on MLX's CPU backend; everything in float32, each step
rounded as IEEE float32, rounding to integers half to even):

- a weight of shape ``(..., K)`` is cut into groups of `group_size` consecutive elements along
  its last axis (K must be a multiple of it: ValueError otherwise, as MLX raises);
- per group: ``w_max``, ``w_min`` of its values; ``n_bins = 2**bits - 1``, ``eps = 1e-7``;
  ``scale = max((w_max - w_min) / n_bins, eps)``; the *edge* is the endpoint of larger
  magnitude (``w_min`` if ``|w_min| > |w_max|``, else ``w_max``), and the scale takes the sign
  that maps the edge to a positive code: ``+scale`` when the edge is ``w_min``, ``-scale``
  otherwise; ``q0 = rint(edge / scale)``; if ``q0 != 0``: ``scale = edge / q0`` and
  ``bias = edge`` (the edge is then represented exactly by code 0), else ``bias = 0`` (a group
  of zeros, or one whose range is within ``eps * n_bins`` and whose values are within half an
  eps of zero);
- per element: ``code = clip(rint((w - bias) / scale), 0, n_bins)`` with the float32 scale and
  bias (not their bf16 roundings);
- `32 // bits` codes per uint32 word, the first in the lowest bits;
- scales and biases are stored in the input's dtype, bf16 (float32 rounded to nearest even).

NaN and infinity are refused (ValueError): MLX does not define their codes (its reduction skips
NaNs and the cast of a NaN code is undefined behaviour in C++), so no bit-exact answer exists. So
is a group whose float32 arithmetic breaks down, which needs values beyond ~3.4e31: its range
overflows (e.g. -2e38 and 2e38: MLX's scale is inf, and it dequantizes to NaN), or ``edge / scale``
does (a narrow group near 3e38: the scale becomes 0 and the codes 0 / 0).

`dequantize` equals ``mx.dequantize`` on the CPU backend: codes times the bf16 scale, rounded
to bf16, plus the bf16 bias, rounded to bf16 (two roundings, as MLX computes in the output dtype).

MLX's Metal kernel (by its source; untested on a Mac) differs from its CPU backend in two places, so a
Mac's GPU ``mx.quantize`` can disagree with this (and with MLX on CPU): it starts its maximum at 0, not -inf (a group of
negative values is quantized over ``[w_min, 0]``), and its ``round`` takes halves away from zero.
A worker on a published plane serves the plane's bytes and never re-quantizes, so its digest does
not depend on its backend.

The plane
---------
`quantized_state` maps a bf16 state to the tensors a worker on a quantized plane serves, named
as mlx-lm names a quantized layer's arrays: a quantized ``<module>.weight`` becomes the uint32
codes under the same name plus ``<module>.scales`` and ``<module>.biases`` (bf16 bits); every
other tensor stays as it is (bf16). Which tensors are quantized follows mlx-lm's
``quantize_model`` (`mlx_lm_predicate`).

A PULSE patch over the plane
----------------------------
The codec patches uint16 arrays, so a plane is patched through a uint16 view of its codes
(``codes.view(np.uint16)``, two halves per word; scales and biases are bf16 already). When a few
bf16 weights change, only their groups can change: each changed weight's code may change (and
with it one half-word of codes); when the group's min or max moved, its scale and bias change and
any of its codes can (`quantize_groups_into` re-quantizes just those groups, in place). A patch is
the diff of the old and the new plane; nothing else travels. The
fraction of the plane that changes per 1% of bf16 weights changed is measured in the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from .codec import bf16_bits_to_float32, float32_to_bf16_bits
from .digest import StateDigest, tensor_digest
from .parallel import ordered_map

GROUP_SIZES = (32, 64, 128)
BITS = (2, 4, 8)  # the power-of-two widths, whose codes fill uint32 words exactly
DEFAULT_GROUP_SIZE = 64
EPS = np.float32(1e-7)
CANONICAL_NAN = np.uint16(0x7FC0)
SCALES = "scales"
BIASES = "biases"

# Groups per pass: the buffers of one pass (keys and their transposed copy, or float32 values and codes) stay in cache.
_GROUPS_PER_PASS = 1 << 11

#: A predicate on a tensor's (name, shape): False to keep it bf16, True to quantize it with the
#: plane's (group_size, bits), or a (group_size, bits) pair of its own.
Predicate = Callable[[str, tuple[int, ...]], "bool | tuple[int, int]"]

#: Layers that mlx-lm's models quantize with their own parameters (``Model.quant_predicate``):
#: model type -> [(module path suffix, (group_size, bits))]. MoE routers stay at 8 bits.
MODEL_OVERRIDES: dict[str, list[tuple[str, tuple[int, int]]]] = {
    "lfm2_moe": [("feed_forward.gate", (64, 8))],
    "qwen3_moe": [("mlp.gate", (64, 8))],
}


@dataclass(frozen=True, slots=True)
class Quantized:
    """One quantized weight: uint32 `codes` (..., K * bits // 32), bf16-bit `scales` and
    `biases` (..., K // group_size), as ``mx.quantize`` returns them."""

    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    group_size: int
    bits: int


def check_params(group_size: int, bits: int) -> None:
    """ValueError unless (group_size, bits) is supported."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group size must be one of {GROUP_SIZES}, got {group_size}")
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")


def _bf16_bits(w: np.ndarray, name: str) -> np.ndarray:
    """`w` as bf16 bits: uint16 as it is, float32 values rounded to bf16 (ValueError unless exactly
    representable), anything else refused."""
    if not isinstance(w, np.ndarray):
        raise ValueError(f"tensor {name!r}: expected a numpy array, got {type(w).__name__}")
    if w.dtype == np.uint16:
        return w
    if w.dtype != np.float32:
        raise ValueError(f"tensor {name!r}: expected bf16 bits (uint16) or float32 values, got {w.dtype}")
    bits16 = float32_to_bf16_bits(w)
    if not np.array_equal(bf16_bits_to_float32(bits16), w, equal_nan=True):
        raise ValueError(f"tensor {name!r}: float32 values not representable in bf16; round them first")
    return bits16


def _check_shape(w: np.ndarray, group_size: int, name: str) -> None:
    if w.ndim < 2:
        raise ValueError(f"tensor {name!r}: quantizing needs at least 2 dimensions, got shape {w.shape}")
    if w.shape[-1] % group_size:
        raise ValueError(
            f"tensor {name!r}: the last dimension ({w.shape[-1]}) must be divisible by the group size "
            f"{group_size}; shape {w.shape}"
        )


def quantize(w: np.ndarray, group_size: int = DEFAULT_GROUP_SIZE, bits: int = 8, *, name: str = "w") -> Quantized:
    """``mx.quantize(w, group_size, bits)`` (affine) of a bf16 weight, bit for bit.

    `w` is bf16 bits (uint16) or float32 values exactly representable in bf16, with at least two
    dimensions and a last dimension divisible by `group_size`. ValueError (naming `name`) for
    other shapes, unsupported parameters and non-finite values.
    """
    check_params(group_size, bits)
    bits16 = _bf16_bits(w, name)
    _check_shape(bits16, group_size, name)
    groups = bits16.reshape(-1, group_size)
    n = groups.shape[0]
    codes = np.empty((n, group_size * bits // 32), dtype=np.uint32)
    scales = np.empty(n, dtype=np.uint16)
    biases = np.empty(n, dtype=np.uint16)
    _quantize_groups(groups, None, bits, codes, scales, biases, name)
    lead, k = w.shape[:-1], w.shape[-1]
    return Quantized(
        codes.reshape(*lead, k * bits // 32),
        scales.reshape(*lead, k // group_size),
        biases.reshape(*lead, k // group_size),
        group_size,
        bits,
    )


def quantize_groups_into(
    w: np.ndarray,
    rows: np.ndarray,
    codes: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    group_size: int = DEFAULT_GROUP_SIZE,
    bits: int = 8,
    *,
    name: str = "w",
) -> None:
    """Quantize only the groups `rows` of bf16 weight `w` (indices into ``w.reshape(-1,
    group_size)``) into those rows of `codes` (uint32, one row of words per group), `scales` and
    `biases` (uint16, one per group), in place: afterwards they hold `quantize(w)`'s rows there,
    and their other rows are untouched. ValueError as `quantize` (for the chosen groups' values
    alone), and for out-of-range rows or outputs that do not fit `w`'s groups; nothing is written
    then."""
    check_params(group_size, bits)
    bits16 = _bf16_bits(w, name)
    _check_shape(bits16, group_size, name)
    groups = bits16.reshape(-1, group_size)
    n = groups.shape[0]
    rows = np.asarray(rows)
    if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"tensor {name!r}: rows must be a 1-D integer array, got {rows.dtype} of shape {rows.shape}")
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= n):
        raise ValueError(f"tensor {name!r}: group rows out of range for {n} groups")
    words = group_size * bits // 32
    fits = (
        codes.dtype == np.uint32 and codes.shape == (n, words)
        and scales.dtype == np.uint16 and biases.dtype == np.uint16 and scales.shape == biases.shape == (n,)
    )
    if not fits:
        raise ValueError(
            f"tensor {name!r}: outputs must be uint32 codes {(n, words)} and uint16 scales and biases {(n,)}, got "
            f"{codes.dtype} {codes.shape}, {scales.dtype} {scales.shape}, {biases.dtype} {biases.shape}"
        )
    _quantize_groups(groups, rows.astype(np.intp, copy=False), bits, codes, scales, biases, name)


def _quantize_groups(
    groups: np.ndarray,
    rows: np.ndarray | None,
    bits: int,
    codes: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    name: str,
) -> None:
    """Quantize bf16 bit groups (n, group_size) into codes / scales / biases: every group (rows
    None) or those `rows`, in two sweeps of passes whose buffers stay in cache.

    The first sweep finds each group's max and min (`_group_max_min`); then every group's scale
    and bias at once, refusing the tensor before anything is written; the second sweep widens
    the bits to float32, does the element arithmetic in place, casts it to bytes and packs them."""
    size = groups.shape[1]
    total = groups.shape[0] if rows is None else rows.size
    per_pass = min(_GROUPS_PER_PASS, max(total, 1))
    gathered = np.empty((0 if rows is None else per_pass, size), dtype=np.uint16)

    def passes() -> Iterator[tuple[slice, slice | np.ndarray, np.ndarray]]:
        """(where in the pass order, which groups, their bits) per pass."""
        for start in range(0, total, per_pass):
            part = slice(start, min(start + per_pass, total))
            if rows is None:
                yield part, part, groups[part]
            else:
                at = rows[part]
                yield part, at, np.take(groups, at, axis=0, out=gathered[: at.size], mode="clip")  # rows checked

    high_keys = np.empty(total, dtype=np.int16)
    low_keys = np.empty(total, dtype=np.int16)
    keys = np.empty((per_pass, size), dtype=np.int16)
    blocks = np.empty((size // 4, per_pass), dtype=np.uint64)
    lanes = np.empty((2, 4 * per_pass), dtype=np.int16)
    for part, _, source in passes():
        _group_max_min(source, keys, blocks, lanes, high_keys[part], low_keys[part])
    n_bins = np.float32((1 << bits) - 1)
    w_max, w_min = (bf16_bits_to_float32(_order_key(k).view(np.uint16)) for k in (high_keys, low_keys))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        s, b = _scale_bias(w_max, w_min, n_bins)
    broken = ~np.isfinite(s) | (s == 0)  # also every group holding a NaN or an infinity
    if broken.any():
        _refuse(groups, rows, w_max, w_min, s, broken, name)

    values = np.empty((per_pass, size), dtype=np.float32)
    packed = np.empty((per_pass, size * bits // 32), dtype="<u4")  # little-endian words: byte j holds codes from j
    packed_bytes = packed.view(np.uint8)
    codes8 = packed_bytes if bits == 8 else np.empty((per_pass, size), dtype=np.uint8)
    with np.errstate(over="ignore"):
        for part, at, source in passes():
            m = part.stop - part.start
            v = values[:m]
            np.left_shift(source, 16, out=v.view(np.uint32), dtype=np.uint32)  # bf16 bits -> float32, exact
            np.subtract(v, b[part, None], out=v)
            np.divide(v, s[part, None], out=v)
            np.rint(v, out=v)
            np.clip(v, 0, n_bins, out=v)
            np.copyto(codes8[:m], v, casting="unsafe")  # integers 0..n_bins
            if bits != 8:
                _pack(codes8[:m], bits, packed_bytes[:m])
            codes[at] = packed[:m]
    every: slice | np.ndarray = slice(None) if rows is None else rows
    scales[every], biases[every] = float32_to_bf16_bits(np.stack((s, b)))


def _refuse(
    groups: np.ndarray, rows: np.ndarray | None, w_max: np.ndarray, w_min: np.ndarray, s: np.ndarray,
    broken: np.ndarray, name: str,
) -> NoReturn:
    """ValueError for `broken` groups: the first non-finite value if any group holds one (its max
    or min is then not finite), else the first group whose scale breaks."""
    holding = ~(np.isfinite(w_max) & np.isfinite(w_min))
    if holding.any():
        i = int(np.flatnonzero(holding)[0])
        row = i if rows is None else int(rows[i])
        where = row * groups.shape[1] + int(np.flatnonzero((groups[row] & 0x7F80) == 0x7F80)[0])  # exponent all ones
        raise ValueError(f"tensor {name!r}: non-finite value at flat index {where}; MLX's codes for it are undefined")
    i = int(np.flatnonzero(broken)[0])
    raise ValueError(
        f"tensor {name!r}: group {i if rows is None else int(rows[i])}: MLX's scale for it would be "
        f"{abs(float(s[i]))} (values too large for float32 arithmetic), so its codes are undefined"
    )


def _order_key(bits16: np.ndarray) -> np.ndarray:
    """bf16 bits <-> int16 keys in the values' order (its own inverse; 16-bit arrays in, int16
    out): a negative value's magnitude bits are flipped. NaNs sort beyond the infinities of their
    sign; -0 just below +0 (which zero a group's max or min is does not change its scale, bias or
    codes)."""
    signed = bits16.view(np.int16)
    return signed ^ ((signed >> 15) & 0x7FFF)


def _group_max_min(
    source: np.ndarray, keys: np.ndarray, blocks: np.ndarray, lanes: np.ndarray, high: np.ndarray, low: np.ndarray
) -> None:
    """The order keys (`_order_key`, as int16) of the max and the min of each bf16 group of
    `source` (m, size) into `high` and `low` (m,); `keys`, `blocks`, `lanes`: work buffers.

    The keys are copied as 8-byte blocks (four keys) into `blocks`, transposed (size / 4, m),
    so the max and min run down its columns across all m groups at once rather than along
    each group; each group's four lanes then meet."""
    m = source.shape[0]
    signed, k = source.view(np.int16), keys[:m]
    np.right_shift(signed, 15, out=k)  # -1 for a negative value, else 0
    np.bitwise_and(k, 0x7FFF, out=k)
    np.bitwise_xor(k, signed, out=k)
    np.copyto(blocks[:, :m], k.view(np.uint64).T)
    columns = blocks[:, :m].view(np.int16)  # (size / 4, 4m): group i's lanes at 4i .. 4i + 3
    highs, lows = lanes[0, : 4 * m], lanes[1, : 4 * m]
    np.max(columns, axis=0, out=highs)
    np.min(columns, axis=0, out=lows)
    np.maximum(np.maximum(highs[0::4], highs[1::4]), np.maximum(highs[2::4], highs[3::4]), out=high)
    np.minimum(np.minimum(lows[0::4], lows[1::4]), np.minimum(lows[2::4], lows[3::4]), out=low)


def _pack(codes8: np.ndarray, bits: int, out: np.ndarray) -> None:
    """Pack byte codes (m, size) below 2**bits into `out` (m, size * bits / 8): `8 // bits` codes
    per byte, the first in the lowest bits (little-endian words then hold them as MLX packs)."""
    if bits == 4:  # byte pairs as little-endian uint16: c0 | c1 << 8 -> low byte c0 | c1 << 4
        pairs = codes8.reshape(-1).view("<u2")
        pairs |= pairs >> 4
        np.copyto(out.reshape(-1), pairs, casting="unsafe")  # the low byte
    else:  # 2 bits, byte quads as little-endian uint32
        quads = codes8.reshape(-1).view("<u4")
        quads |= quads >> 6  # bytes 0 and 2: c0 | c1 << 2, c2 | c3 << 2
        quads |= quads >> 12  # byte 0: c0 | c1 << 2 | c2 << 4 | c3 << 6
        np.copyto(out.reshape(-1), quads, casting="unsafe")


def _scale_bias(w_max: np.ndarray, w_min: np.ndarray, n_bins: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """float32 (scale, bias) of groups with these max and min (see the module docstring)."""
    scale = np.maximum((w_max - w_min) / n_bins, EPS)
    low = np.abs(w_min) > np.abs(w_max)
    scale = np.where(low, scale, -scale)
    edge = np.where(low, w_min, w_max)
    q0 = np.rint(edge / scale)
    at_zero = q0 == 0
    scale = np.where(at_zero, scale, edge / q0)
    bias = np.where(at_zero, np.float32(0), edge)
    return scale.astype(np.float32, copy=False), bias.astype(np.float32, copy=False)


def dequantize(
    codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int = DEFAULT_GROUP_SIZE, bits: int = 8
) -> np.ndarray:
    """``mx.dequantize`` (affine, bf16 scales and biases) as bf16 bits of shape (..., K)."""
    check_params(group_size, bits)
    if codes.dtype != np.uint32 or scales.dtype != np.uint16 or biases.dtype != np.uint16:
        raise ValueError("dequantize needs uint32 codes and bf16-bit (uint16) scales and biases")
    per_word = 32 // bits
    k = codes.shape[-1] * per_word
    if scales.shape != biases.shape or scales.shape[:-1] != codes.shape[:-1] or scales.shape[-1] * group_size != k:
        raise ValueError(
            f"shapes do not fit group size {group_size} and {bits} bits: codes {codes.shape}, "
            f"scales {scales.shape}, biases {biases.shape}"
        )
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    mask = np.uint32((1 << bits) - 1)
    q = ((codes[..., None] >> shifts) & mask).astype(np.float32).reshape(-1, group_size)
    s = bf16_bits_to_float32(scales).reshape(-1, 1)
    b = bf16_bits_to_float32(biases).reshape(-1, 1)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = bf16_bits_to_float32(float32_to_bf16_bits(q * s))  # exact product, rounded to bf16
        total = scaled + b
    out = float32_to_bf16_bits(total)
    out[np.isnan(total)] = CANONICAL_NAN  # as MLX casts any NaN to bf16
    return out.reshape(*codes.shape[:-1], k)


# -- the plane -----------------------------------------------------------------------------
def mlx_lm_predicate(model_type: str | None = None) -> Predicate:
    """Which tensors mlx-lm's ``quantize_model`` quantizes, from names and shapes alone.

    mlx-lm quantizes the weights of layers with ``to_quantized`` (Linear, Embedding, the MoE
    experts' SwitchLinear; a state under HF names holds each expert's 2-D weight, and quantizing
    rows is the same stacked or not) whose last dimension is divisible by the plane's group size,
    with the model type's overrides (`MODEL_OVERRIDES`). Everything else stays bf16: norms,
    biases, the MoE expert bias, convolution kernels. Here a tensor is a layer weight when its
    name ends in ``.weight``, it has at least two dimensions and it is not a convolution kernel
    (a module path ending in ``conv``, as LFM2's ``conv.conv``); the divisibility check is
    `quantized_state`'s.
    """
    overrides = MODEL_OVERRIDES.get(model_type or "", [])

    def predicate(name: str, shape: tuple[int, ...]) -> bool | tuple[int, int]:
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(shape) < 2 or module.endswith("conv"):
            return False
        for suffix, params in overrides:
            if module.endswith(suffix):
                return params
        return True

    return predicate


def plane_names(name: str) -> tuple[str, str, str]:
    """(codes, scales, biases) names of quantized weight `name` (``<module>.weight``)."""
    module = name.rpartition(".")[0] if name.endswith(".weight") else name
    join = (module + ".") if module else ""
    return name, join + SCALES, join + BIASES


def plane_layout(
    shapes: Mapping[str, tuple[int, ...]], group_size: int, bits: int, predicate: Predicate | None = None
) -> dict[str, tuple[int, int]]:
    """The quantized tensors of a state with these shapes: name -> (group_size, bits).

    As mlx-lm decides: a weight whose last dimension is not divisible by the plane's
    `group_size` stays bf16, whatever the predicate says; a predicate's own parameters must then
    fit too (ValueError, as ``mx.quantize`` raises)."""
    check_params(group_size, bits)
    rule = predicate or mlx_lm_predicate()
    layout: dict[str, tuple[int, int]] = {}
    for name, shape in shapes.items():
        shape = tuple(shape)
        if len(shape) < 2 or shape[-1] % group_size:
            continue
        verdict = rule(name, shape)
        if verdict is False:
            continue
        params = (group_size, bits) if verdict is True else (int(verdict[0]), int(verdict[1]))
        check_params(*params)
        if shape[-1] % params[0]:
            raise ValueError(f"tensor {name!r}: last dimension {shape[-1]} not divisible by group size {params[0]}")
        layout[name] = params
    for name in layout:
        for extra in plane_names(name)[1:]:
            if extra in shapes:
                raise ValueError(f"tensor {name!r}: its plane name {extra!r} is taken by a tensor of the state")
    return layout


def quantized_state(
    bf16_state: Mapping[str, np.ndarray],
    group_size: int = DEFAULT_GROUP_SIZE,
    bits: int = 8,
    predicate: Predicate | None = None,
    *,
    threads: int | None = 1,
) -> dict[str, np.ndarray]:
    """The plane a worker serves for a bf16 state (uint16 bits): each quantized weight as its
    uint32 codes (same name) and bf16-bit ``<module>.scales`` / ``<module>.biases``, every other
    tensor as it is. `predicate` defaults to `mlx_lm_predicate()` (no model overrides); `threads`
    tensors are quantized at a time (`parallel.thread_count`; the result does not depend on it)."""
    layout = plane_layout({n: a.shape for n, a in bf16_state.items()}, group_size, bits, predicate)
    names = list(layout)
    by_name = dict(zip(names, ordered_map(lambda n: quantize(bf16_state[n], *layout[n], name=n), names, threads), strict=True))
    plane: dict[str, np.ndarray] = {}
    for name, bits_ in bf16_state.items():
        q = by_name.get(name)
        if q is None:
            plane[name] = bits_
            continue
        codes, scales, biases = plane_names(name)
        plane[codes], plane[scales], plane[biases] = q.codes, q.scales, q.biases
    return plane


def plane_dtype(array: np.ndarray) -> str:
    """The digest label of a plane tensor: ``uint32`` for codes, ``bfloat16`` for the rest."""
    if array.dtype == np.uint32:
        return "uint32"
    if array.dtype == np.uint16:
        return "bfloat16"
    raise ValueError(f"plane tensors are uint32 codes or bf16 bits, got {array.dtype}")


def plane_digest(plane: Mapping[str, np.ndarray]) -> StateDigest:
    """Per-tensor digests of a plane (`digest.tensor_digest`, each labelled by `plane_dtype`).

    Its ``update`` labels every tensor bfloat16 and refuses uint32 codes; re-hash changed
    tensors with `update_plane_digest`."""
    return StateDigest({name: tensor_digest(name, a, plane_dtype(a)) for name, a in plane.items()})


def update_plane_digest(digest: StateDigest, plane: Mapping[str, np.ndarray], names: Iterable[str]) -> StateDigest:
    """`digest` with the plane tensors `names` re-hashed (equals `plane_digest(plane)` when
    `names` covers every tensor that changed; the plane's names must not change)."""
    return digest.with_digests({n: tensor_digest(n, plane[n], plane_dtype(plane[n])) for n in names})
