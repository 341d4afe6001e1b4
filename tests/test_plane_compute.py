"""What a worker on a quantized plane computes on MLX's CPU device: the function of the plane's
weights, in float32 (`macd.cpu_compute.use_float32_activations`), not MLX's bf16 quantized
kernel, whose scalar loop accumulates each dot product in bf16 (on SmolLM2-135M's int8 plane that
alone was 0.43 nats/token of gap to the learner, the quantization itself 0.056)."""

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

from macd.cpu_compute import ENV, computes_float32_activations, use_float32_activations
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


def served(folder: Path, plane: str) -> nn.Module:
    state = plane_bits(load_hf_state(folder), plane, json.loads((folder / "config.json").read_text())["model_type"])  # type: ignore[arg-type]
    model, _ = build_model(folder)
    PlaneWeights.from_state(model, state, plane)  # type: ignore[arg-type]
    return model


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
