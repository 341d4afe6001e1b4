"""`stoa quickstart --family`: a tiny LFM2-MoE through the CPU learner (transformers), PULSE and
`macd run` workers (MLX), and the layout and dtype differences in between.

- The learner publishes the checkpoint's tensors, names and shapes, although transformers fuses
  the experts and holds the expert bias as a float32 buffer (`trainer.param_map`).
- The worker installs that state into mlx-lm's layout (stacked experts, renamed feed-forward,
  reshaped conv kernels: `macd.hf_layout`) and computes what mlx-lm's own loader computes.
- The expert bias: the bf16 plane carries it as its bf16 rounding; the learner acts with that
  rounding too, so both halves route every token alike.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
pytest.importorskip("mlx_lm")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

import mlx.core as mx

from slime_stoa.protocol.hf.folders import bf16_bits_to_f32, load_hf_state
from slime_stoa.protocol.hf.safetensors_io import read_safetensors
from slime_stoa.quickstart.tiny_model import build_tiny_family

BIAS = "model.layers.2.feed_forward.expert_bias"  # the first MoE layer of the tiny LFM2-MoE
EXPERT = "model.layers.3.feed_forward.experts.5.w3.weight"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_family(tmp_path_factory.mktemp("lfm2_moe") / "model", "lfm2_moe")


def test_the_learner_publishes_the_checkpoints_tensors(folder: Path) -> None:
    from slime_stoa.trainer.learner import Learner

    learner = Learner(folder)
    checkpoint = load_hf_state(folder)
    published = learner.bf16_state()
    assert list(published) == list(checkpoint)  # fused experts split, the bias buffer included
    assert all(np.array_equal(published[n], checkpoint[n]) for n in checkpoint)
    # the float32 bias buffer acts with the bf16 the workers get (the checkpoint's float32 differs)
    stored = read_safetensors(folder / "model.safetensors")[BIAS]
    assert stored[0] == "F32" and not np.array_equal(stored[1], bf16_bits_to_f32(checkpoint[BIAS]))
    buffer = dict(learner.model.named_buffers())[BIAS].numpy()
    assert np.array_equal(buffer, bf16_bits_to_f32(checkpoint[BIAS]))
    # a resume writes every published tensor back into its slot
    moved = {n: a ^ np.uint16(1) for n, a in published.items()}
    learner.load_bf16_state(moved)
    again = learner.bf16_state()
    assert all(np.array_equal(again[n], moved[n]) for n in moved)


@pytest.mark.parametrize("plane", ["bf16", "int8"])
def test_the_worker_serves_the_checkpoint_as_mlx_lm_loads_it(folder: Path, plane: str) -> None:
    from macd.generate import build_model, load_model
    from macd.hf_layout import LayoutWeights, live_weights

    state = load_hf_state(folder)
    model, _ = build_model(folder)
    live = live_weights(model, state, plane)  # type: ignore[arg-type]
    assert isinstance(live, LayoutWeights) and live.digest_check(state)
    reference, _ = load_model(folder)  # mlx-lm's own loader: sanitize stacks and renames
    if plane == "bf16":
        from macd.cpu_compute import computes_in_float32, use_float32_compute

        reference.set_dtype(mx.bfloat16)
        if computes_in_float32(model):  # a fast BLAS under MLX on the CPU: compare like with like
            use_float32_compute(reference)
        assert live.shares(state)
        tokens = mx.array([[5, 17, 42, 99, 3, 250, 7, 11]])
        assert mx.array_equal(model(tokens), reference(tokens)).item()
    # a patch written into the state in place reaches the stacked expert (bf16: it is its memory)
    at = np.array([0, 7, 100], np.int64)
    state[EXPERT].reshape(-1)[at] ^= np.uint16(0x0400)
    live.apply(state, {EXPERT: at}, [EXPERT])
    assert live.digest_check(state)
    stack = model.model.layers[3].feed_forward.switch_mlp.up_proj
    if plane == "bf16":
        served = np.array(stack.weight[5].view(mx.uint16))
        assert np.array_equal(served, state[EXPERT])
    # a tensor replaced by a new array (an anchor sync) is installed too
    state[EXPERT] = state[EXPERT].copy()
    state[EXPERT].reshape(-1)[:64] ^= np.uint16(0x0400)
    live.apply(state, {EXPERT: np.arange(64)}, [EXPERT])
    assert live.digest_check(state) and (plane != "bf16" or live.shares(state))
    # and the check catches a served tensor that differs from the master
    other = dict(state)
    other[EXPERT] = state[EXPERT].copy()
    other[EXPERT].reshape(-1)[:64] ^= np.uint16(0x4000)
    assert EXPERT in live.mismatches(other)


def test_the_served_expert_bias_routes_as_the_learner(folder: Path) -> None:
    """The worker's bias is the published bf16 and routing adds it in float32: every token picks
    the experts the learner's `Lfm2MoeTopKRouter` picks with its (rounded) float32 buffer. The
    unrounded float32 bias of the checkpoint would pick otherwise for some near-tied tokens: that
    is why the learner acts with the rounding, and the control below shows this check sees it."""
    from transformers import AutoModelForCausalLM

    from macd.generate import build_model
    from macd.hf_layout import live_weights
    from macd.lfm2_fixes import routing
    from slime_stoa.trainer.learner import Learner

    state = load_hf_state(folder)
    model, _ = build_model(folder)
    live_weights(model, state, "bf16")  # type: ignore[arg-type]
    block = model.model.layers[2].feed_forward
    learner_router = Learner(folder).model.model.layers[2].feed_forward
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 1.0, size=(20_000, 64)).astype(np.float32)  # hidden states, float32 on both sides
    gate = np.array(block.gate.weight.astype(mx.float32))
    assert np.array_equal(gate, learner_router.gate.weight.detach().numpy())
    logits = mx.array(x) @ mx.array(gate).T
    served, _ = routing(logits, block.expert_bias, block.top_k, block.norm_topk_prob, 1.0)

    def torch_experts(bias: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            _, _, picked = learner_router.gate(torch.from_numpy(x), bias)
        return np.sort(picked.numpy(), axis=1)

    assert block.expert_bias.dtype == mx.bfloat16
    ours = np.sort(np.array(served), axis=1)
    assert np.array_equal(ours, torch_experts(learner_router.expert_bias))
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).model.layers[2].feed_forward.expert_bias
    flips = int((ours != torch_experts(original)).any(axis=1).sum())
    assert 0 < flips < 100, flips  # the rounding moves a few near-ties of 20k tokens (measured 5-30)


def run_family_quickstart(tmp_path: Path, *args: str) -> dict:
    from slime_stoa.cli import main

    summary = tmp_path / "summary.json"
    assert main(["quickstart", "--out", str(tmp_path / "qs"), "--family", "lfm2_moe", "--minutes", "30",
                 "--json", str(summary), *args]) == 0
    return json.loads(summary.read_text())


@pytest.mark.slow  # ~40-80 s on two cores (two MLX eval processes, a worker, the learner)
def test_lfm2_moe_quickstart_mechanics(tmp_path: Path) -> None:
    """Bounded by versions: 3 versions, one worker, a small batch; the worker serves every
    version it reports with the learner's published digest, nothing is lost, and every expert
    tensor travels in the patches. (Learning: `test_lfm2_moe_quickstart_learns`, --slow.)"""
    s = run_family_quickstart(tmp_path, "--max-versions", "3", "--target", "2", "--warmup-steps", "30",
                              "--workers", "1", "--batch-groups", "4", "--group-size", "4")
    model = tmp_path / "qs" / "model"
    assert json.loads((model / "config.json").read_text())["model_type"] == "lfm2_moe"
    assert s["family"] == "lfm2_moe" and s["versions"] == 3 and s["groups_used"] == 12 and s["groups_lost"] == 0
    assert s["digests_checked"] >= 1 and s["digest_mismatches"] == 0
    assert s["tensors"] == len(load_hf_state(model)) > 60  # 2 MoE layers x 8 experts x 3 + the rest
    assert 0 < s["patch_bytes_mean"] < s["full_bytes"]
    assert s["publish_seconds_mean"] > 0
    # 3 versions within the staleness limit need not make the worker install one
    assert s["worker_syncs_seen"] == 0 or s["worker_sync_seconds_mean"] > 0
    # worker (MLX, bf16 activations) and learner (torch, float32 on the same bf16 weights):
    # numerics and the odd near-tied routing decision, far from a wrong layout (measured ~1e-2;
    # a mis-stacked expert gives > 0.5)
    assert math.isfinite(s["mean_abs_logprob_gap"]) and s["mean_abs_logprob_gap"] < 0.1


@pytest.mark.slow  # several minutes on two cores: python -m pytest --slow tests/test_quickstart_family.py
def test_lfm2_moe_quickstart_learns(tmp_path: Path) -> None:
    s = run_family_quickstart(tmp_path, "--max-versions", "40", "--target", "0.6")
    # the target is measured on the learner's last batches; `reward_last` (by drawing version)
    # trails it by the groups in flight, so it is held to a margin (see test_the_quickstart_learns)
    assert s["target_reached"] and s["reward_recent_batches"] >= 0.6, s
    assert s["reward_first"] < 0.4 and s["reward_last"] >= 0.5, s
    assert s["groups_lost"] == 0 and s["digest_mismatches"] == 0
    # past the staleness limit the workers must have installed new versions, each timed
    assert s["worker_syncs_seen"] >= 1 and s["worker_sync_seconds_mean"] > 0
