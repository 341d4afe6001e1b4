"""The memory plan on MLX's CPU device (`macd.memory_plan`, device "cpu"): the bf16 plane's matmul
weights held twice (bf16 and an exact float32 copy, `macd.cpu_compute`), float32 KV cache, conv
state and prefill logits; the figures checked against what a real model holds on the CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from macd.memory_plan import GIB, describe, param_count, plan, this_mac, usable_bytes

#: A small GQA config (tied embedding): every term computable by hand.
SMALL: dict[str, Any] = {
    "model_type": "qwen2", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
}
SHAPE = dict(group_size=4, prompt_tokens=100, response_tokens=100, mac_sizes_gb=(16,))


def test_the_cpu_plan_counts_the_float32_copies_and_a_float32_cache() -> None:
    h, v, ff, hd = 128, 1024, 256, 32
    per_layer = h * h + 2 * (2 * hd) * h + h * h + 2 * ff * h + h * ff  # q, k+v, o, gate+up, down
    counts = param_count(SMALL)
    assert counts.widened == v * h + 2 * per_layer  # every matmul weight, the tied head included
    gpu, cpu = plan(SMALL, **SHAPE), plan(SMALL, **SHAPE, device="cpu")
    assert gpu.weights["bf16"] == 2 * counts.total
    assert cpu.weights["bf16"] == 2 * counts.total + 4 * counts.widened  # ~6 bytes per matmul weight
    published = dict(SHAPE, published=("int8", "int4"))  # a held plane: its dequantized copies
    assert plan(SMALL, **published, device="cpu").weights == {
        plane: size + 4 * counts.widened for plane, size in plan(SMALL, **published).weights.items()
    }
    assert gpu.kv_bytes_per_token == 2 * 2 * 2 * hd * 2 and cpu.kv_bytes_per_token == 2 * gpu.kv_bytes_per_token
    assert cpu.cache == 4 * cpu.kv_bytes_per_token * 256 == 2 * gpu.cache
    assert cpu.activations - gpu.activations == 100 * v * 2  # the prefill chunk's logits in float32
    assert usable_bytes(16, "cpu") == 16 * GIB and usable_bytes(16) < 16 * GIB  # nothing wired on the CPU
    untied = param_count({**SMALL, "tie_word_embeddings": False})
    assert untied.total == counts.total + v * h and untied.widened == counts.widened  # the lookup is not copied
    with pytest.raises(ValueError, match="device must be one of gpu, cpu"):
        plan(SMALL, **SHAPE, device="metal")


def test_the_plan_lines_say_which_device_they_are_for() -> None:
    cpu = describe(plan(SMALL, **SHAPE, device="cpu"))
    assert cpu[0].startswith("device: the CPU (MLX float32 compute)")
    assert "bf16 0.0 GiB (with float32 copies)" in cpu[1]
    assert [line.split(":")[0] for line in cpu[3:]] == ["16 GB CPU machine, bf16"]
    assert describe(plan(SMALL, **SHAPE))[0].startswith("device: the GPU (Metal)")
    shape = {"group_size": 4, "groups": 1, "prompt_tokens": 100, "response_tokens": 100}
    lines, warning = this_mac(SMALL, memory=GIB // 1024, plane="bf16", device="cpu", **shape)
    assert lines[0].startswith("device: the CPU") and any(line.startswith("this machine, bf16: needs") for line in lines)
    assert warning is not None and "does not fit this machine's usable memory" in warning


def test_doctor_plans_for_either_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from macd.cli import main as macd

    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    assert macd(["doctor", "--plan-for", "16", "--plan-config", str(config), "--plan-device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "device: the CPU (MLX float32 compute)" in out and "16 GB CPU machine, bf16: needs" in out


@pytest.mark.parametrize("family", ["qwen2", "lfm2"])
def test_the_cpu_figures_are_what_a_real_model_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """A tiny model loaded as a worker on the CPU loads it (float32 compute), after a forward pass:
    its float32 copies are `4 x widened` bytes, its KV cache and conv state float32 at the plan's
    bytes per token and per sequence."""
    pytest.importorskip("mlx_lm")
    monkeypatch.setenv("STOA_CPU_COMPUTE", "float32")
    os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from macd import cpu_compute
    from macd.generate import load_model
    from slime_stoa.quickstart.seeding import tiny_family_model, tiny_synthetic_model

    if mx.default_device().type != mx.cpu:
        pytest.skip("MLX computes on a GPU here")
    if family == "qwen2":
        folder = tiny_synthetic_model(tmp_path / "model")
    else:
        folder = tiny_family_model(tmp_path / "model", "lfm2", texts=["a b c d"] * 50, num_layers=3)
    config = json.loads((folder / "config.json").read_text())
    model, _ = load_model(folder)
    cache = make_prompt_cache(model)
    logits = model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    mx.eval(logits)
    p = plan(config, group_size=1, prompt_tokens=5, response_tokens=1, device="cpu")
    counts = param_count(config)
    assert cpu_compute.copies_nbytes(model) == 4 * counts.widened == p.weights["bf16"] - 2 * counts.total
    kv = [c for c in cache if getattr(c, "keys", None) is not None]
    assert kv and all(c.keys.dtype == mx.float32 and c.values.dtype == mx.float32 for c in kv)
    allocated = kv[0].keys.shape[2]
    assert sum(c.keys.nbytes + c.values.nbytes for c in kv) == p.kv_bytes_per_token * allocated
    conv = [a for c in cache if getattr(c, "keys", None) is None for a in c.cache if a is not None]  # ArraysCache
    assert sum(a.nbytes for a in conv) == p.conv_bytes_per_sequence
    assert all(a.dtype == mx.float32 for a in conv) and (family == "lfm2") == bool(conv)
    assert logits.dtype == mx.float32

    # a quantized plane's worker on the CPU: its codes, and float32 copies of the dequantized
    # weights (the misfit layers' bf16 ones widened) for the same matmul layers
    import mlx.nn as nn

    quantized, _ = load_model(folder)
    nn.quantize(quantized, 64, 8, class_predicate=lambda _p, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0)
    cpu_compute.use_float32_activations(quantized, dequantized=True)  # as a plane worker with a fast BLAS
    mx.eval(quantized(mx.array([[1, 2, 3, 4, 5]]), cache=make_prompt_cache(quantized)))
    held = plan(config, group_size=1, prompt_tokens=5, response_tokens=1, device="cpu", published=("int8",))
    on_gpu = plan(config, group_size=1, prompt_tokens=5, response_tokens=1, published=("int8",))
    assert cpu_compute.copies_nbytes(quantized) == 4 * counts.widened == held.weights["int8"] - on_gpu.weights["int8"]
