"""What a worker on a quantized plane computes on MLX's CPU device: the function of the plane's
weights, in float32 (`macd.cpu_compute.use_float32_activations`), not MLX's bf16 quantized
kernel, whose scalar loop accumulates each dot product in bf16 (on SmolLM2-135M's int8 plane that
alone was 0.43 nats/token of gap to the learner, the quantization itself 0.056); with a fast BLAS
through float32 copies of the weights dequantized, the same function, kept equal to the served
arrays across installs and patches written in place."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from macd import cpu_compute
from macd.cpu_compute import (
    ENV,
    computes_dequantized,
    computes_float32_activations,
    copy_matches,
    use_float32_activations,
)
from macd.generate import build_model
from macd.plane_weights import PlaneWeights
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.pulse.plane import plane_bits
from slime_stoa.quickstart.seeding import tiny_synthetic_model

TOKENS = mx.array([[1, 5, 9, 2, 7, 3, 11, 4]])


@pytest.fixture(autouse=True)
def cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """MLX's CPU device, its compute setting unset."""
    monkeypatch.delenv(ENV, raising=False)
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (tied head, as SmolLM2) whose dot products are long enough for bf16
    accumulation to show: K = 256 and 1024."""
    return tiny_synthetic_model(tmp_path_factory.mktemp("llama") / "model", "llama", hidden_size=256,
                                intermediate_size=1024, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_synthetic_model(tmp_path_factory.mktemp("moe") / "model", "lfm2_moe", num_layers=2)


def plane_state(folder: Path, plane: str) -> dict[str, np.ndarray]:
    return plane_bits(load_hf_state(folder), plane, json.loads((folder / "config.json").read_text())["model_type"])  # type: ignore[arg-type]


def serve(folder: Path, plane: str) -> PlaneWeights:
    model, _ = build_model(folder)
    return PlaneWeights.from_state(model, plane_state(folder, plane), plane)  # type: ignore[arg-type]


def served(folder: Path, plane: str) -> nn.Module:
    return serve(folder, plane).model


def exact(folder: Path, plane_model: nn.Module) -> nn.Module:
    """The model of `folder` in float32 holding the plane's weights dequantized in float32
    (code * scale + bias, the bf16 scales and biases widened): the function the plane states."""
    params: dict[str, mx.array] = dict(tree_flatten(plane_model.parameters()))
    modules = dict(plane_model.named_modules())
    weights = []
    for name, array in params.items():
        path, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases"):
            continue
        if array.dtype == mx.uint32:
            layer = modules[path]
            array = mx.dequantize(array, params[f"{path}.scales"].astype(mx.float32),
                                  params[f"{path}.biases"].astype(mx.float32), layer.group_size, layer.bits)
        weights.append((name, array.astype(mx.float32)))
    model, _ = build_model(folder)
    model.set_dtype(mx.float32)
    model.load_weights(weights)
    return model


def logprobs(model: nn.Module) -> np.ndarray:
    logits = model(TOKENS).astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


@pytest.mark.parametrize("plane", ["int8", "int4"])
def test_a_plane_model_on_the_cpu_computes_its_weights_function_in_float32(wide_llama: Path, plane: str) -> None:
    model = served(wide_llama, plane)
    gap = np.abs(logprobs(model) - logprobs(exact(wide_llama, model))).max()
    assert gap < 1e-4, gap  # summation order only; MLX's bf16 kernel: ~1e-2
    assert computes_float32_activations(model) and model(TOKENS).dtype == mx.float32
    # The stock compute, kept on request, is that far off: what the float32 activations remove.
    with pytest.MonkeyPatch.context() as m:
        m.setenv(ENV, "bfloat16")
        stock = served(wide_llama, plane)
    assert not computes_float32_activations(stock) and stock(TOKENS).dtype == mx.bfloat16
    assert np.abs(logprobs(stock) - logprobs(exact(wide_llama, stock))).max() > 20 * max(gap, 1e-5)


def test_moe_experts_compute_in_float32_too(moe: Path) -> None:
    model = served(moe, "int4")
    gap = np.abs(logprobs(model) - logprobs(exact(moe, model))).max()
    assert gap < 1e-4, gap
    kinds = {type(m).__name__ for _, m in model.named_modules()}
    assert "Float32ActivationsQuantizedSwitchLinear" in kinds and "Float32ActivationsQuantizedLinear" in kinds


def test_the_mechanism_mlxs_cpu_quantized_matmul_accumulates_bf16_in_bf16() -> None:
    """Why: one int8 layer with K = 1536 (SmolLM2's down projection), against numpy in float64."""
    rng = np.random.default_rng(0)
    layer = nn.QuantizedLinear(1536, 64, bias=False, group_size=64, bits=8)
    codes, scales, biases = mx.quantize(mx.array(rng.normal(0, 0.05, (64, 1536)), mx.bfloat16), 64, 8)
    layer.update({"weight": codes, "scales": scales, "biases": biases})  # bf16 scales and biases, as a plane's
    w = np.array(mx.dequantize(codes, scales.astype(mx.float32), biases.astype(mx.float32), 64, 8), np.float64)
    x = mx.array(rng.normal(0, 1, (4, 1536)), mx.bfloat16)
    want = np.array(x.astype(mx.float32), np.float64) @ w.T

    def error(y: mx.array) -> float:
        return float(np.abs(np.array(y.astype(mx.float32)) - want).mean() / np.abs(want).mean())

    assert error(layer(x)) > 0.01  # bf16 partial sums: each rounded to 8 bits of mantissa
    assert use_float32_activations(layer) == 1 and use_float32_activations(layer) == 0
    assert error(layer(x)) < 1e-5


# -- with a fast BLAS: float32 copies of the weights, dequantized -----------------------------------
@pytest.fixture
def dequantizing(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a CPU worker with a fast BLAS (``float32`` asks for it without one)."""
    monkeypatch.setenv(ENV, "float32")


def kernel_served(folder: Path, plane: str) -> nn.Module:
    """The plane served through MLX's quantized kernels with float32 activations (no fast BLAS)."""
    with pytest.MonkeyPatch.context() as m:
        m.delenv(ENV, raising=False)
        m.setattr(cpu_compute, "sgemm_provider", lambda: None)
        model = served(folder, plane)
    assert computes_float32_activations(model) and not computes_dequantized(model)
    return model


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {path: m for path, m in model.named_modules() if "scales" in m}


@pytest.mark.parametrize("plane", ["int8", "int4"])
def test_dequantized_copies_compute_the_quantized_kernels_function(wide_llama: Path, plane: str, dequantizing: None) -> None:
    live = serve(wide_llama, plane)
    model = live.model
    assert computes_dequantized(model) and model(TOKENS).dtype == mx.float32
    kinds = {type(m).__name__ for m in quantized_layers(model).values()}
    assert kinds == {"Float32DequantizedQuantizedLinear", "Float32DequantizedQuantizedEmbedding"}
    kernel = logprobs(kernel_served(wide_llama, plane))
    assert np.abs(logprobs(model) - kernel).max() < 1e-4  # the summation order only
    assert np.abs(logprobs(model) - logprobs(exact(wide_llama, model))).max() < 1e-4
    # 4 bytes per weight of every quantized layer: the linear ones' made at the install, the tied
    # head's at its first call (the forward above)
    weights = sum(m["scales"].size * m.group_size for m in quantized_layers(model).values())
    assert live.copy_nbytes == 4 * weights
    assert all(copy_matches(m) for m in quantized_layers(model).values())


def test_moe_experts_multiply_with_their_dequantized_copy(moe: Path, dequantizing: None) -> None:
    model = served(moe, "int4")
    kinds = {type(m).__name__ for m in quantized_layers(model).values()}
    assert "Float32DequantizedQuantizedSwitchLinear" in kinds and "Float32DequantizedQuantizedLinear" in kinds
    assert np.abs(logprobs(model) - logprobs(kernel_served(moe, "int4"))).max() < 1e-4
    assert np.abs(logprobs(model) - logprobs(exact(moe, model))).max() < 1e-4


def scrambled(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Another plane of the same shapes: every quantized layer's codes reversed along their rows."""
    layers = {name.rpartition(".")[0] for name in state if name.endswith(".scales")}
    return {name: np.ascontiguousarray(bits[..., ::-1]) if name.rpartition(".")[0] in layers and name.endswith(".weight")
            else bits.copy() for name, bits in state.items()}


def test_a_new_plane_installed_is_computed_not_the_stale_copies(wide_llama: Path, dequantizing: None) -> None:
    live = serve(wide_llama, "int8")
    before = logprobs(live.model)  # the tied head's copy made too
    held = live.copy_nbytes
    live.install(scrambled(plane_state(wide_llama, "int8")))
    assert live.copy_nbytes == held  # every copy made anew at the install, of the new arrays
    after = logprobs(live.model)
    assert np.abs(after - before).max() > 0.1
    assert np.abs(after - logprobs(exact(wide_llama, live.model))).max() < 1e-4
    assert all(copy_matches(m) for m in quantized_layers(live.model).values())


def test_a_patch_written_in_place_is_dequantized_anew_at_apply(wide_llama: Path, dequantizing: None) -> None:
    live = serve(wide_llama, "int8")
    before = logprobs(live.model)
    layers = quantized_layers(live.model)
    written = ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.scales"]
    changed = {}
    for name in written:
        view = live.state[name].reshape(-1)  # the served memory itself
        changed[name] = np.arange(0, view.size, 7, dtype=np.int64)
        view[changed[name]] ^= np.uint16(0x2A2A) if name.endswith(".weight") else np.uint16(0x0100)
    # written in place: the served arrays are the same objects, only `apply` can know
    assert not copy_matches(layers["model.embed_tokens"]) and not copy_matches(layers["model.layers.0.mlp.down_proj"])
    stats = live.apply(live.state, changed, written)
    assert stats.tensors == 0  # nothing installed: the bytes were live already
    assert all(copy_matches(m) for m in layers.values())
    after = logprobs(live.model)
    assert np.abs(after - before).max() > 0.01
    assert np.abs(after - logprobs(exact(wide_llama, live.model))).max() < 1e-4


def test_the_stock_compute_on_request_holds_no_copies(wide_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "bfloat16")
    live = serve(wide_llama, "int4")
    assert live.model(TOKENS).dtype == mx.bfloat16 and live.copy_nbytes == 0
    assert not computes_float32_activations(live.model)
