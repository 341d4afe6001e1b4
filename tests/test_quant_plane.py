"""pulse.quant: numpy affine quantization bit-exact with mx.quantize / mx.dequantize, and the
quantized plane (what mlx-lm's quantize_model serves) with its digest."""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
pytest.importorskip("mlx_lm")
pytest.importorskip("tokenizers")

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, quantize_model

from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.pulse.codec import bf16_bits_to_float32, float32_to_bf16_bits
from slime_stoa.protocol.pulse.digest import state_digest, tensor_digest
from slime_stoa.protocol.pulse.quant import (
    dequantize,
    mlx_lm_predicate,
    plane_digest,
    plane_layout,
    quantize,
    quantized_state,
    update_plane_digest,
)
from slime_stoa.quickstart.tiny_model import build_tiny_family, build_tiny_model
from tests.quant_cases import hostile_rows

PARAMS = [(64, 8), (64, 4), (32, 4), (128, 4), (32, 8), (128, 8), (64, 2)]
State = dict[str, np.ndarray]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant")
    return {
        "qwen2": build_tiny_model(root / "qwen2"),
        "lfm2_moe": build_tiny_family(root / "lfm2_moe", "lfm2_moe"),
    }


@pytest.fixture(scope="module")
def states(folders: dict[str, Path]) -> dict[str, State]:
    return {family: load_hf_state(path) for family, path in folders.items()}


def mlx_quantize(bits16: np.ndarray, group_size: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    wq, scales, biases = mx.quantize(mx.array(bits16).view(mx.bfloat16), group_size, bits)
    assert scales.dtype == mx.bfloat16 and biases.dtype == mx.bfloat16 and wq.dtype == mx.uint32
    return np.array(wq), np.array(scales.view(mx.uint16)), np.array(biases.view(mx.uint16))


def assert_matches_mlx(bits16: np.ndarray, group_size: int, bits: int, what: str) -> None:
    """numpy quantize and dequantize equal MLX's, bit for bit."""
    q = quantize(bits16, group_size, bits)
    wq, scales, biases = mlx_quantize(bits16, group_size, bits)
    for label, ours, theirs in (("codes", q.codes, wq), ("scales", q.scales, scales), ("biases", q.biases, biases)):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (what, label)
        bad = np.flatnonzero(ours != theirs)
        assert bad.size == 0, f"{what} ({group_size}, {bits}): {bad.size} {label} differ, first at {bad[0]}"
    ours_d = dequantize(q.codes, q.scales, q.biases, group_size, bits)
    theirs_d = mx.dequantize(
        mx.array(wq), mx.array(scales).view(mx.bfloat16), mx.array(biases).view(mx.bfloat16), group_size, bits
    )
    assert theirs_d.dtype == mx.bfloat16
    assert np.array_equal(ours_d, np.array(theirs_d.view(mx.uint16))), f"{what} ({group_size}, {bits}): dequantize"
    # float32 values of the same bf16 weight give the same bytes
    again = quantize(bf16_bits_to_float32(bits16), group_size, bits)
    assert np.array_equal(again.codes, q.codes) and np.array_equal(again.scales, q.scales)


def model_shapes(states: dict[str, State]) -> list[tuple[int, ...]]:
    return sorted({tuple(a.shape) for s in states.values() for a in s.values() if a.ndim >= 2})


# -- bit-exactness -------------------------------------------------------------------------
@pytest.mark.parametrize(("group_size", "bits"), PARAMS)
def test_every_model_shape_matches_mx_quantize(states: dict[str, State], group_size: int, bits: int) -> None:
    rng = np.random.default_rng(group_size * 10 + bits)
    shapes = model_shapes(states) + [(2, 3, 256)]  # and a 3-D stack, as SwitchLinear holds
    tested = 0
    for shape in shapes:
        values = rng.normal(0.0, 0.05, size=shape).astype(np.float32)
        bits16 = float32_to_bf16_bits(values)
        if shape[-1] % group_size:
            with pytest.raises(ValueError, match="divisible by the group size"):
                quantize(bits16, group_size, bits)
            with pytest.raises(ValueError):
                mlx_quantize(bits16, group_size, bits)
            continue
        assert_matches_mlx(bits16, group_size, bits, f"shape {shape}")
        tested += 1
    assert tested >= 2


@pytest.mark.parametrize(("group_size", "bits"), PARAMS)
def test_model_weights_match_mx_quantize(states: dict[str, State], group_size: int, bits: int) -> None:
    """The tiny models' own weights, tensor by tensor."""
    for family, state in states.items():
        for name, bits16 in state.items():
            if bits16.ndim >= 2 and bits16.shape[-1] % group_size == 0:
                assert_matches_mlx(bits16, group_size, bits, f"{family} {name}")


@pytest.mark.parametrize(("group_size", "bits"), PARAMS)
def test_hostile_values_match_mx_quantize(group_size: int, bits: int) -> None:
    rng = np.random.default_rng(7 + bits)
    rows = hostile_rows(group_size, rng)
    assert_matches_mlx(rows, group_size, bits, "hostile groups")
    # the same groups side by side in longer rows
    assert_matches_mlx(rows[: rows.shape[0] // 4 * 4].reshape(-1, 4 * group_size), group_size, bits, "hostile rows")


@pytest.mark.parametrize(("group_size", "bits"), [(64, 8), (32, 4)])
def test_refusals(group_size: int, bits: int) -> None:
    ok = float32_to_bf16_bits(np.random.default_rng(0).normal(size=(4, 2 * group_size)).astype(np.float32))
    for bad in (np.inf, -np.inf, np.nan):
        w = ok.copy()
        w[2, 5] = float32_to_bf16_bits(np.array([bad], np.float32))[0]
        with pytest.raises(ValueError, match=f"non-finite value at flat index {2 * 2 * group_size + 5}"):
            quantize(w, group_size, bits, name="layer.weight")
    w = ok.copy()
    w[1, :2] = float32_to_bf16_bits(np.array([-2e38, 2e38], np.float32))  # the range overflows
    with pytest.raises(ValueError, match="group 2: MLX's scale for it would be inf"):
        quantize(w, group_size, bits)
    w = ok.copy()
    w[1, group_size:] = float32_to_bf16_bits(np.array([3e38], np.float32))  # edge / eps overflows
    with pytest.raises(ValueError, match="group 3: MLX's scale for it would be 0"):
        quantize(w, group_size, bits)
    with pytest.raises(ValueError, match=r"last dimension \(40\) must be divisible by the group size"):
        quantize(np.zeros((3, 40), np.uint16), group_size, bits)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        quantize(np.zeros(2 * group_size, np.uint16), group_size, bits)
    with pytest.raises(ValueError, match="not representable in bf16"):
        quantize(np.full((2, group_size), 1.0 + 2.0**-12, np.float32), group_size, bits)
    with pytest.raises(ValueError, match="group size must be one of"):
        quantize(ok, 16, bits)
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize(ok, group_size, 3)
    with pytest.raises(ValueError, match="bf16 bits"):
        quantize(ok.astype(np.int32), group_size, bits)


# -- the plane -----------------------------------------------------------------------------
_EXPERT = re.compile(r"^(.*\.feed_forward)\.experts\.(\d+)\.(w[123])\.(weight|scales|biases)$")
_DENSE = re.compile(r"^(.*\.feed_forward)\.(w[123])\.(weight|scales|biases)$")
_RENAME = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def as_mlx_lm(plane: State) -> State:
    """A plane under HF names renamed as mlx-lm's sanitize does (LFM2: w1/w2/w3 renamed, the
    experts stacked into switch_mlp), the conv kernels left out (transposed, never quantized)."""
    out: State = {}
    experts: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    for name, a in plane.items():
        if name.endswith("conv.conv.weight"):
            continue
        if m := _EXPERT.match(name):
            experts[f"{m[1]}.switch_mlp.{_RENAME[m[3]]}.{m[4]}"][int(m[2])] = a
        elif m := _DENSE.match(name):
            out[f"{m[1]}.{_RENAME[m[2]]}.{m[3]}"] = a
        else:
            out[name] = a
    for name, by_index in experts.items():
        out[name] = np.stack([by_index[i] for i in sorted(by_index)])
    return out


def mlx_lm_plane(folder: Path, group_size: int, bits: int) -> State:
    """mlx-lm's own quantized model of a folder, as numpy bits (conv kernels left out)."""
    model, config = load_model(folder)
    model, _ = quantize_model(model, config, group_size, bits)
    out: State = {}
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for name, a in params:
        if name.endswith("conv.conv.weight"):
            continue
        out[name] = np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)
    return out


@pytest.mark.parametrize(("group_size", "bits"), [(64, 8), (64, 4), (32, 4), (128, 8)])
def test_quantized_state_is_mlx_lm_quantize_model(
    folders: dict[str, Path], states: dict[str, State], group_size: int, bits: int
) -> None:
    """The plane equals mlx-lm's quantize_model of the same folder: which tensors are quantized,
    with which parameters (the LFM2-MoE router at 8 bits), and every byte."""
    for family, folder in folders.items():
        plane = quantized_state(states[family], group_size, bits, mlx_lm_predicate(family))
        ours, theirs = as_mlx_lm(plane), mlx_lm_plane(folder, group_size, bits)
        if family == "lfm2_moe":  # mlx-lm keeps the expert bias float32; ours is the bf16 state's
            for name in [n for n in theirs if n.endswith("expert_bias")]:
                assert np.array_equal(ours.pop(name), float32_to_bf16_bits(theirs.pop(name)))
        assert sorted(ours) == sorted(theirs), family
        for name, a in theirs.items():
            assert ours[name].dtype == a.dtype and np.array_equal(ours[name], a), (family, name)
        quantized = [n for n in plane if n.endswith(".scales")]
        assert quantized or family != "qwen2", family
        if family == "lfm2_moe" and group_size == 64:
            router = "model.layers.3.feed_forward.gate.weight"
            assert plane[router].shape == (8, 64 * 8 // 32)  # 8 bits whatever the plane's width


def test_plane_layout_keeps_what_mlx_lm_keeps(states: dict[str, State]) -> None:
    state = states["lfm2_moe"]
    layout = plane_layout({n: a.shape for n, a in state.items()}, 64, 4, mlx_lm_predicate("lfm2_moe"))
    kept = sorted(n for n in state if n not in layout)
    assert all(("norm" in n or n.endswith(("expert_bias", "conv.conv.weight", "w2.weight"))) for n in kept), kept
    assert layout["model.layers.3.feed_forward.gate.weight"] == (64, 8)
    assert layout["model.layers.0.feed_forward.w1.weight"] == (64, 4)
    assert "model.layers.3.feed_forward.experts.0.w2.weight" not in layout  # input 32 < group 64
    # a predicate of one's own, and the checks on it
    only_embed = plane_layout({n: a.shape for n, a in state.items()}, 64, 8, lambda n, s: "embed" in n)
    assert list(only_embed) == ["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="not divisible by group size 128"):
        plane_layout({"a.weight": (4, 64)}, 64, 8, lambda n, s: (128, 4))
    with pytest.raises(ValueError, match="taken by a tensor"):
        plane_layout({"a.weight": (4, 64), "a.scales": (4, 1)}, 64, 8)


def test_plane_digest(states: dict[str, State]) -> None:
    state = states["qwen2"]
    plane = quantized_state(state, 64, 4)
    digest = plane_digest(plane)
    assert digest.root() == plane_digest(quantized_state(state, 64, 4)).root()
    assert digest.root() != state_digest(state)
    assert digest.root() != plane_digest(quantized_state(state, 64, 8)).root()
    # codes are labelled uint32: the same bytes seen as bf16 halves digest otherwise
    name = "model.layers.0.mlp.up_proj.weight"
    assert tensor_digest(name, plane[name].view(np.uint16)) != digest.digests[name]
    # a changed weight changes its group's tensors; re-hashing only those gives the full digest
    new = {n: a.copy() for n, a in state.items()}
    new[name].reshape(-1)[:3] ^= np.uint16(0x0100)
    new_plane = quantized_state(new, 64, 4)
    changed = [n for n in plane if not np.array_equal(plane[n], new_plane[n])]
    assert set(changed) <= {name, "model.layers.0.mlp.up_proj.scales", "model.layers.0.mlp.up_proj.biases"}
    assert name in changed
    assert update_plane_digest(digest, new_plane, changed).root() == plane_digest(new_plane).root()
    with pytest.raises(ValueError, match="2-byte dtype"):
        digest.update(new_plane, [name])  # the bf16-only update refuses codes


# -- what a patch over the plane costs -----------------------------------------------------
def halves(plane: State) -> State:
    """The plane as the codec patches it: uint16 arrays (codes as two halves per word)."""
    return {n: a.view(np.uint16) if a.dtype == np.uint32 else a for n, a in plane.items()}


@pytest.mark.parametrize(("group_size", "bits"), [(64, 8), (64, 4)])
def test_plane_change_per_percent_of_weights(states: dict[str, State], group_size: int, bits: int) -> None:
    """Change 1% of the bf16 weights (each by 1-7 ULP, an optimizer step's size) and count the
    plane's changed uint16 elements, which a PULSE patch over the plane carries."""
    rng = np.random.default_rng(3)
    state = states["qwen2"]
    new = {n: a.copy() for n, a in state.items()}
    changed_weights = total_weights = 0
    for bits16 in new.values():
        flat = bits16.reshape(-1)
        at = np.flatnonzero(rng.random(flat.size) < 0.01)
        flat[at] ^= rng.integers(1, 8, size=at.size, dtype=np.uint16)
        changed_weights += at.size
        total_weights += flat.size
    plane = quantized_state(state, group_size, bits)
    quantized = {n for n, a in plane.items() if a.dtype == np.uint32}
    quantized |= {n.rpartition(".")[0] + leaf for n in quantized for leaf in (".scales", ".biases")}
    old_plane, new_plane = halves(plane), halves(quantized_state(new, group_size, bits))
    diff = {n: int(np.count_nonzero(old_plane[n] != new_plane[n])) for n in new_plane}
    total = sum(a.size for a in new_plane.values())
    q_total = sum(new_plane[n].size for n in quantized)
    fraction, q_fraction = sum(diff.values()) / total, sum(diff[n] for n in quantized) / q_total
    changed_bytes = sum(
        int(np.count_nonzero(old_plane[n].view(np.uint8) != new_plane[n].view(np.uint8))) for n in new_plane
    )
    print(
        f"\n({group_size}, {bits}): {changed_weights / total_weights:.2%} of bf16 weights changed -> "
        f"{fraction:.2%} of the plane's {total} uint16 elements ({q_fraction:.2%} of its quantized part, "
        f"{changed_bytes / (2 * total):.2%} of its bytes); "
        f"{sum(diff.values()) / changed_weights:.2f} plane elements per changed weight"
    )
    assert 0 < fraction < 0.05
