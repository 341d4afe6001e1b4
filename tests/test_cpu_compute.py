"""macd.cpu_compute: on MLX's CPU device a bf16-plane model computes in float32 with exact
copies of its bf16 weights, which follow every install (in place or replaced)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
mlx_lm = pytest.importorskip("mlx_lm")
pytest.importorskip("tokenizers")

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from macd import cpu_compute
from macd.generate import ContinuousGenerator, SamplingConfig, build_model, teacher_forced_logprobs
from macd.weights import LiveWeights
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.quickstart.tiny_model import build_tiny_model

PROMPT = mx.array([[5, 17, 42, 99, 3, 250, 7, 11]])
EMBED = "model.embed_tokens.weight"  # also the tied output head
LINEAR = "model.layers.1.mlp.up_proj.weight"

pytestmark = pytest.mark.skipif(mx.default_device().type != mx.cpu, reason="the CPU device's compute path")


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # qwen2: q/k/v biases, tied head; llama: no biases, its own head
    return build_tiny_model(tmp_path_factory.mktemp(request.param), family=request.param,
                            tie_word_embeddings=request.param == "qwen2")


@pytest.fixture(autouse=True)
def _float32_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float32 compute whatever BLAS this process has (by default it needs a fast one)."""
    monkeypatch.setenv(cpu_compute.ENV, "float32")


def live_model(tiny: Path, state: dict[str, np.ndarray] | None = None) -> tuple[LiveWeights, dict[str, np.ndarray]]:
    state = dict(load_hf_state(tiny) if state is None else state)
    model, _ = build_model(tiny)
    return LiveWeights.from_state(model, state, "bf16"), state


def float32_reference(tiny: Path, state: dict[str, np.ndarray]) -> nn.Module:
    """A stock mlx-lm model holding `state` widened to float32 (no copies: float32 parameters)."""
    model, _ = build_model(tiny)
    model.load_weights([(n, mx.array(b).view(mx.bfloat16).astype(mx.float32)) for n, b in state.items()
                        if n != "lm_head.weight" or "lm_head" in dict(model.named_modules())])
    mx.eval(model.parameters())
    return model


def assert_logits_of(model: nn.Module, tiny: Path, state: dict[str, np.ndarray]) -> None:
    """`model` computes what the float32 widening of `state` computes, bit for bit."""
    got, want = model(PROMPT), float32_reference(tiny, state)(PROMPT)
    assert got.dtype == want.dtype == mx.float32
    assert bool(mx.array_equal(got, want).item())


def layer(live: LiveWeights, name: str) -> Any:
    return dict(live.model.named_modules())[name.rpartition(".")[0]]


def test_the_served_weights_are_the_bf16_master_computed_in_float32(tiny: Path) -> None:
    live, state = live_model(tiny)
    assert cpu_compute.computes_in_float32(live.model)
    assert live.copy_nbytes == 0  # copies are made at each layer's first call
    assert_logits_of(live.model, tiny, state)
    params = dict(tree_flatten(live.model.parameters()))
    assert params.keys() in (state.keys(), state.keys() - {"lm_head.weight"})  # a tied head is the embedding
    assert all(a.dtype == mx.bfloat16 for a in params.values())  # the master stays the parameters
    assert live.shares(state) and live.digest_check(state)
    widened = sum(m.weight.size for _, m in live.model.named_modules()
                  if isinstance(m, nn.Linear) or (isinstance(m, nn.Embedding) and "lm_head.weight" not in params))
    assert live.copy_nbytes == 4 * widened
    assert live.nbytes == sum(b.nbytes for n, b in state.items() if n in params)


@pytest.mark.parametrize("whole", [False, True])
def test_a_patch_written_in_place_is_rewidened_at_apply(tiny: Path, whole: bool) -> None:
    live, state = live_model(tiny)
    assert_logits_of(live.model, tiny, state)  # copies made
    rng = np.random.default_rng(3)
    changed = {}
    for name in (EMBED, LINEAR):
        flat = state[name].reshape(-1)  # the live weights' memory: a commit writes here
        at = np.unique(rng.integers(0, flat.size, size=max(1, flat.size // 50)))
        flat[at] ^= np.uint16(3)
        changed[name] = at
    copied = {n for n in changed if cpu_compute.has_copy(layer(live, n))}  # an untied embedding has none
    assert LINEAR in copied and set(live.mismatches(state)) == copied  # the copies lag until apply
    stats = live.apply(state, {} if whole else changed, list(changed))  # touched, no indices: whole
    assert stats.tensors == 0 and live.shares(state)
    assert live.mismatches(state) == []
    assert_logits_of(live.model, tiny, state)


def test_a_replaced_tensor_is_widened_anew(tiny: Path) -> None:
    live, state = live_model(tiny)
    assert_logits_of(live.model, tiny, state)
    before = live.copy_nbytes
    new = state[LINEAR] ^ np.uint16(1)  # a new array (an anchor's): installed, not written in place
    state[LINEAR] = new
    live.apply(state, {LINEAR: np.arange(new.size)}, [LINEAR])
    assert live.shares(state) and not cpu_compute.has_copy(layer(live, LINEAR))
    assert live.copy_nbytes == before - 4 * new.size  # the stale copy's memory went at once
    assert_logits_of(live.model, tiny, state)
    assert live.copy_nbytes == before and live.digest_check(state)


def test_recorded_logprobs_are_the_float32_models(tiny: Path) -> None:
    """The batched decode (float32 KV cache) records what one float32 forward pass gives."""
    live, state = live_model(tiny)
    tokenizer = build_model(tiny)[1]
    cfg = SamplingConfig(temperature=0.7, max_tokens=12, group_size=3, seed=5)
    gen = ContinuousGenerator(live.model, tokenizer, cfg, max_batch=6)
    prompts = [list(tokenizer.encode("12 plus 30 is")), list(tokenizer.encode("seven"))]
    for i, p in enumerate(prompts):
        gen.insert(p, i)
    finished = []
    while len(finished) < len(prompts):
        finished += gen.advance(16)[0]
    gen.close()
    reference = float32_reference(tiny, state)
    for group in finished:
        for c in group.completions:
            forced = teacher_forced_logprobs(reference, prompts[group.tag], c.tokens.tolist(), cfg.temperature)
            np.testing.assert_allclose(c.logprobs, forced, rtol=0, atol=1e-5)


def test_float32_only_on_the_cpu_with_a_fast_blas_or_when_asked(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_compute.ENV, "bfloat16")
    live, _ = live_model(tiny)
    assert not cpu_compute.computes_in_float32(live.model) and live.model(PROMPT).dtype == mx.bfloat16
    monkeypatch.setenv(cpu_compute.ENV, "fp32")
    with pytest.raises(ValueError, match=cpu_compute.ENV):
        cpu_compute.float32_compute_wanted()
    monkeypatch.delenv(cpu_compute.ENV)  # auto: float32 when a fast BLAS serves MLX's matmuls
    monkeypatch.setattr(cpu_compute, "sgemm_provider", lambda: None)
    assert not cpu_compute.float32_compute_wanted()
    monkeypatch.setattr(cpu_compute, "sgemm_provider", lambda: "libmkl_rt.so.3")
    assert cpu_compute.float32_compute_wanted()
    monkeypatch.setattr(cpu_compute.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert not cpu_compute.float32_compute_wanted()


def test_other_planes_keep_their_kernels(tiny: Path) -> None:
    model, _ = build_model(tiny)
    live = LiveWeights.from_state(model, dict(load_hf_state(tiny)), "int8")
    assert not cpu_compute.computes_in_float32(live.model)
