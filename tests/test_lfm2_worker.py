"""The MLX worker on tiny random LFM2 and LFM2-MoE models (the family of LFM2.5-8B-A1B).

What is checked, per family: the recorded logprobs equal transformers' on the same float32
weights; a batch of prompts of different lengths (right-padded while prefilling, left-padded
while decoding, as mlx-lm's `BatchGenerator` does) gives each sequence the logprobs it has alone,
and so does a left-padded prefill; multi-turn tool episodes resumed after each observation equal
a fresh forward over the whole prefix. For the MoE: the routing equals transformers'
`Lfm2MoeSparseMoeBlock` (sigmoid scores, the expert bias for the selection only, normalised
top-k weights, the routed scaling factor), and `macd.lfm2_fixes` corrects the routing of the
mlx-lm releases that compute it otherwise. Negative controls show each check would catch the
defect it is about.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
mlx_lm = pytest.importorskip("mlx_lm")
pytest.importorskip("tokenizers")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from macd.episodes import run_episodes
from macd.generate import SamplingConfig, generate_groups, load_model, teacher_forced_logprobs
from macd.lfm2_fixes import fix_moe_routing, routed_call, routing
from slime_stoa.protocol.hf.safetensors_io import read_safetensors
from slime_stoa.quickstart.tiny_model import build_tiny_lfm2
from slime_stoa.tasks.tool_format import ToolFormat
from slime_stoa.tasks.tools import LookupTool

# Tolerances (absolute, nats):
# - the same MLX model, batched/cached vs one full forward: same float32 ops on the same rows;
#   measured bitwise equal on CPU, margin for other backends' reduction orders.
RECORDED_VS_TEACHER_ATOL = 1e-5
# - MLX vs transformers, float32 on the same weights: different kernels (conv as a grouped
#   conv1d vs concatenation, fused vs unfused attention) round differently; the tiny models'
#   logits have std ~2, so f32 rounding through 4 layers reaches ~1e-5 (measured <= 1.2e-5).
MLX_VS_TORCH_ATOL = 1e-4
# - a check's negative control must move the logprobs by far more than the tolerance.
DEFECT_MIN = 100 * RECORDED_VS_TEACHER_ATOL

FAMILIES = ("lfm2", "lfm2_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lfm2")
    return {
        "lfm2": build_tiny_lfm2(root / "lfm2"),
        "lfm2_moe": build_tiny_lfm2(root / "lfm2_moe", moe=True),
        # routed scaling factor != 1 and no top-k normalisation: both must reach the weights
        "lfm2_moe_scaled": build_tiny_lfm2(root / "scaled", moe=True, routed_scaling_factor=2.5, norm_topk_prob=False),
    }


_MODELS: dict[str, tuple[Any, Any]] = {}


def model32(folders: dict[str, Path], name: str) -> tuple[Any, Any]:
    """(float32 MLX model, tokenizer) of a folder, loaded the worker's way (`load_model`)."""
    if name not in _MODELS:
        model, tok = load_model(folders[name])
        model.set_dtype(mx.float32)
        _MODELS[name] = model, tok
    return _MODELS[name]


def hf32(folder: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def prompts_of(tok: Any) -> list[list[int]]:
    """Prompts of 3 to ~30 tokens: a batch of them is padded by up to ~27 positions."""
    chat = tok.apply_chat_template([{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"}],
                                   add_generation_prompt=True)
    return [list(tok.encode("7 + 5 =")), list(chat), list(tok.encode("The answer is 12 and the sum is"))]


def test_the_folder_is_a_real_lfm2_checkpoint(folders: dict[str, Path]) -> None:
    """transformers and mlx-lm both load it, with the same tokenizer ids; the MoE keeps its
    expert biases in float32, under the checkpoints' names."""
    for name in FAMILIES:
        config = json.loads((folders[name] / "config.json").read_text())
        assert config["model_type"] == name and {"conv", "full_attention"} <= set(config["layer_types"])
        model, tok = model32(folders, name)
        hf_tok = transformers.AutoTokenizer.from_pretrained(folders[name])
        text = "Tom has 3 apples and buys 4 more. How many?"
        assert hf_tok.encode(text) == tok.encode(text)
        header = {n: dtype for n, (dtype, _) in read_safetensors(folders[name] / "model.safetensors").items()}
        biases = {n: dtype for n, dtype in header.items() if n.endswith("expert_bias")}
        if name == "lfm2_moe":
            dense = config["num_dense_layers"]
            assert len(biases) == len(config["layer_types"]) - dense and set(biases.values()) == {"F32"}
            assert f"model.layers.{dense}.feed_forward.experts.0.w1.weight" in header
            assert f"model.layers.{dense - 1}.feed_forward.w1.weight" in header
        else:
            assert not biases
        assert type(model.layers[0]).__module__.endswith(name)


def test_mlx_logprobs_match_torch_float32(folders: dict[str, Path], family: str) -> None:
    model, tok = model32(folders, family)
    hf = hf32(folders[family])
    temperature = 0.7
    cfg = SamplingConfig(temperature=temperature, max_tokens=24, group_size=2, seed=4)
    prompts = prompts_of(tok)
    worst = 0.0
    for prompt, group in zip(prompts, generate_groups(model, tok, prompts, cfg), strict=True):
        for c in group:
            response = c.tokens.tolist()
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + response[:-1]])).logits[0, len(prompt) - 1 :]
            ref = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()
            worst = max(worst, float(np.abs(c.logprobs - ref).max()))
    assert worst <= MLX_VS_TORCH_ATOL, worst


@pytest.mark.parametrize("share_prefill", [False, True], ids=["batched-prefill", "shared-prefill"])
def test_padded_batch_equals_each_sequence_alone(folders: dict[str, Path], family: str, share_prefill: bool) -> None:
    """Prompts of 3 to ~30 tokens decoded together (batched prefill: right padding and per-row
    lengths; decode: left-padded caches) record the logprobs of each sequence run alone."""
    model, tok = model32(folders, family)
    prompts = prompts_of(tok)
    cfg = SamplingConfig(temperature=0.8, max_tokens=16, group_size=2, seed=7)
    groups = generate_groups(model, tok, prompts, cfg, share_prefill=share_prefill, max_batch=4)
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            alone = teacher_forced_logprobs(model, prompt, c.tokens, cfg.temperature)
            np.testing.assert_allclose(c.logprobs, alone, rtol=0, atol=RECORDED_VS_TEACHER_ATOL)


def test_conv_state_of_a_right_padded_row_is_its_own(
    folders: dict[str, Path], family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control of the batched prefill: without the per-row lengths a conv layer keeps
    the last positions of the padded row (padding) as its state, and the shorter prompts'
    logprobs move by far more than the tolerance."""
    model, tok = model32(folders, family)
    prompts = prompts_of(tok)
    cfg = SamplingConfig(temperature=0.8, max_tokens=6, group_size=1, seed=7)
    monkeypatch.setattr(ArraysCache, "prepare", lambda self, **kw: None)  # lengths never set
    groups = generate_groups(model, tok, prompts, cfg, share_prefill=False)
    shortest = min(range(len(prompts)), key=lambda i: len(prompts[i]))
    c = groups[shortest][0]
    alone = teacher_forced_logprobs(model, prompts[shortest], c.tokens, cfg.temperature)
    assert np.abs(c.logprobs - alone).max() > DEFECT_MIN


def _left_padded_logits(model: Any, prompts: list[list[int]], *, conv_masked: bool) -> list[np.ndarray]:
    """Each prompt's logits from one left-padded forward (pad id 0). The attention layers' caches
    always know the padding (mlx-lm's `BatchKVCache`); the conv layers' know it when
    `conv_masked` (`ArraysCache(left_padding=...)`, as mlx-lm's batch caches are)."""
    n = max(len(p) for p in prompts)
    pad = [n - len(p) for p in prompts]
    tokens = mx.array([[0] * k + p for k, p in zip(pad, prompts, strict=True)])
    cache = [BatchKVCache(pad) if isinstance(c, KVCache) else ArraysCache(1, left_padding=pad if conv_masked else None)
             for c in model.make_cache()]
    logits = model(tokens, cache=cache)
    return [np.array(logits[i, k:]) for i, k in enumerate(pad)]


def test_left_padded_prefill_equals_each_sequence_alone(folders: dict[str, Path], family: str) -> None:
    """A left-padded batch (the padding comes first, inside a conv layer's window and state):
    with the padding masked each row's logits are its own; with only attention masked, the
    padding's B*x reaches the conv layers and the padded rows' logits move."""
    model, tok = model32(folders, family)
    prompts = prompts_of(tok)
    alone = [np.array(model(mx.array([p]))[0]) for p in prompts]
    for a, b in zip(alone, _left_padded_logits(model, prompts, conv_masked=True), strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=RECORDED_VS_TEACHER_ATOL)
    unmasked = _left_padded_logits(model, prompts, conv_masked=False)
    shortest = min(range(len(prompts)), key=lambda i: len(prompts[i]))
    assert np.abs(unmasked[shortest] - alone[shortest]).max() > DEFECT_MIN


# -- episodes --------------------------------------------------------------------------------------

# The random models write "e" often: as the call tag it makes tool calls in most episodes.
FORMAT = ToolFormat(call_open="<q>", call_close="e", answer_close="<|im_start|>", observation_open="[",
                    observation_close="]", max_turns=3, max_observation_tokens=6)


def test_episodes_resume_with_the_conv_state_and_kv_cache_they_left_with(folders: dict[str, Path], family: str) -> None:
    """Tool episodes leave the batch at each call with their caches (KV for attention layers,
    the last positions for conv layers) and re-enter with the observation prefilled: at every
    model token the recorded logprob equals a fresh forward over prompt + the whole episode."""
    model, tok = model32(folders, family)
    prompts = prompts_of(tok)[:2]
    cfg = SamplingConfig(temperature=1.0, max_tokens=40, group_size=3, seed=3)
    tool = LookupTool({}, default="look: the answer is 12")
    groups = asyncio.run(run_episodes(model, tok, prompts, cfg, FORMAT, tool, max_batch=4))
    resumed = 0
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            forced = teacher_forced_logprobs(model, prompt, c.tokens, cfg.temperature)
            own = c.mask == 1
            np.testing.assert_allclose(c.logprobs[own], forced[own], rtol=0, atol=RECORDED_VS_TEACHER_ATOL)
            resumed += int(c.tool_calls > 0 and bool(own[-1]))  # a model turn after an observation
    assert resumed >= 2


# -- LFM2-MoE routing --------------------------------------------------------------------------------


def _blocks(folders: dict[str, Path], name: str) -> tuple[Any, Any, int]:
    """(an MLX MoE block, transformers' block of the same layer, layer index)."""
    model, _ = model32(folders, name)
    layer = json.loads((folders[name] / "config.json").read_text())["num_dense_layers"]
    return model.layers[layer].feed_forward, hf32(folders[name]).model.layers[layer].feed_forward, layer


def _hf_routing(hf_block: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        _, weights, inds = hf_block.gate(torch.tensor(x), hf_block.expert_bias)
    order = torch.argsort(inds, -1)
    return inds.gather(-1, order).numpy(), weights.gather(-1, order).numpy()


def _sorted(inds: mx.array, weights: mx.array) -> tuple[np.ndarray, np.ndarray]:
    i, w = np.array(inds), np.array(weights)
    order = np.argsort(i, -1)
    return np.take_along_axis(i, order, -1), np.take_along_axis(w, order, -1)


def _tokens(n: int, dim: int) -> np.ndarray:
    return np.random.default_rng(1).normal(size=(n, dim)).astype(np.float32)


@pytest.mark.parametrize("name", ["lfm2_moe", "lfm2_moe_scaled"])
def test_moe_block_routes_as_transformers(folders: dict[str, Path], name: str) -> None:
    """The same experts with the same weights, and the same block output, for 256 tokens; the
    expert bias does change the selection of some (so selection-only use is exercised)."""
    block, hf_block, _ = _blocks(folders, name)
    x = _tokens(256, block.gate.weight.shape[1])
    hf_inds, hf_weights = _hf_routing(hf_block, x)
    inds, weights = _sorted(*routing(block.gate(mx.array(x)), block.expert_bias, block.top_k,
                                     block.norm_topk_prob, block.routed_scaling_factor))
    np.testing.assert_array_equal(inds, hf_inds)
    np.testing.assert_allclose(weights, hf_weights, rtol=0, atol=1e-6)
    unbiased, _ = _sorted(*routing(block.gate(mx.array(x)), None, block.top_k, True, 1.0))
    assert (unbiased != inds).any(axis=-1).mean() > 0.05
    with torch.no_grad():
        hf_out = hf_block(torch.tensor(x)[None])[0].numpy()
    np.testing.assert_allclose(np.array(block(mx.array(x)[None])[0]), hf_out, rtol=0, atol=1e-5)
    scale = json.loads((folders[name] / "config.json").read_text())["routed_scaling_factor"]
    assert block.routed_scaling_factor == scale and (scale == 1.0) == (name == "lfm2_moe")


def _mlx_lm_031_call(block: Any, x: mx.array) -> mx.array:
    """mlx-lm 0.31.x's routing: softmax scores, the bias added to the weights, no scaling."""
    gates = mx.softmax(block.gate(x).astype(mx.float32), axis=-1)
    if block.use_expert_bias:
        gates = gates + block.expert_bias
    k = block.top_k
    inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if block.norm_topk_prob:
        scores = scores / (mx.sum(scores, axis=-1, keepdims=True) + 1e-20)
    y = block.switch_mlp(x, inds)
    return (y * scores.astype(x.dtype)[..., None]).sum(axis=-2)


def test_moe_routing_of_mlx_lm_031_is_fixed_at_load(folders: dict[str, Path], tmp_path: Path) -> None:
    """A block class routing as mlx-lm 0.31.x does (and lacking the scaling factor, as its
    ModelArgs did) diverges from transformers; `fix_moe_routing`, which the worker's loaders
    apply, finds it by probing and makes the model's logits transformers' again."""
    name = "lfm2_moe_scaled"
    config = json.loads((folders[name] / "config.json").read_text())
    model, tok = load_model(folders[name])
    model.set_dtype(mx.float32)
    prompt = mx.array([prompts_of(tok)[1]])
    with torch.no_grad():
        hf_logits = hf32(folders[name])(torch.tensor(np.array(prompt))).logits[0].numpy()
    assert np.abs(np.array(model(prompt)[0]) - hf_logits).max() < MLX_VS_TORCH_ATOL
    assert not fix_moe_routing(model, config)  # the installed mlx-lm routes correctly: untouched

    blocks = [layer.feed_forward for layer in model.layers if hasattr(layer.feed_forward, "switch_mlp")]
    old = type("Lfm2MoeSparseMoeBlock031", (type(blocks[0]),), {"__call__": _mlx_lm_031_call})
    for b in blocks:
        b.__class__ = old
        del b.routed_scaling_factor
    assert np.abs(np.array(model(prompt)[0]) - hf_logits).max() > 1e-2
    assert fix_moe_routing(model, config)
    assert all(type(b).__call__ is routed_call and b.routed_scaling_factor == 2.5 for b in blocks)
    assert np.abs(np.array(model(prompt)[0]) - hf_logits).max() < MLX_VS_TORCH_ATOL
    assert not fix_moe_routing(model, config)  # once
