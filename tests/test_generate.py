"""macd.generate: batched group sampling with tempered logprobs, on a tiny random Qwen2."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
mlx_lm = pytest.importorskip("mlx_lm")
pytest.importorskip("tokenizers")

import mlx.core as mx

from macd.generate import (
    Completion,
    GenerationCancelled,
    SamplingConfig,
    generate_groups,
    teacher_forced_logprobs,
)
from slime_stoa.quickstart.tiny_model import build_tiny_model

# Tolerances (absolute, on logprobs in nats):
# - recorded vs teacher forcing, same MLX model: the batched, cached decode and one full forward
#   pass compute the same float32 log_softmax(logits / T); measured bitwise equal on CPU (float32
#   and bf16 weights); the margin allows other backends' different reduction orders.
RECORDED_VS_TEACHER_ATOL = 1e-5
# - MLX vs torch/transformers, both float32 on the same weights: measured ~1.5e-6.
MLX_VS_TORCH_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def loaded(tiny_path: Path) -> tuple[Any, Any]:
    """The tiny model as stored (bf16) and its tokenizer."""
    return mlx_lm.load(str(tiny_path))


@pytest.fixture(scope="module")
def model32(tiny_path: Path) -> Any:
    """The same weights computed in float32."""
    model, _ = mlx_lm.load(str(tiny_path))
    model.set_dtype(mx.float32)
    return model


@pytest.fixture(scope="module")
def prompts(loaded: tuple[Any, Any]) -> list[list[int]]:
    """A chat prompt and a short raw one (different lengths, so the batch is padded)."""
    _, tok = loaded
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 30? Think step by step."}],
        add_generation_prompt=True,
    )
    return [list(chat), list(tok.encode("7 + 5 ="))]


def _check_shapes(groups: list[list[Completion]], n_prompts: int, cfg: SamplingConfig) -> None:
    assert len(groups) == n_prompts
    for group in groups:
        assert len(group) == cfg.group_size
        for c in group:
            assert c.tokens.dtype == np.int32 and c.logprobs.dtype == np.float32
            assert c.tokens.ndim == c.logprobs.ndim == 1
            assert 1 <= len(c.tokens) == len(c.logprobs) <= cfg.max_tokens
            assert np.all(np.isfinite(c.logprobs)) and np.all(c.logprobs <= 0)
            assert c.finish_reason in ("stop", "length")


def test_shapes_eos_and_length(loaded: tuple[Any, Any], prompts: list[list[int]]) -> None:
    model, tok = loaded
    cfg = SamplingConfig(temperature=1.0, max_tokens=48, group_size=16, seed=3)
    groups = generate_groups(model, tok, prompts, cfg)
    _check_shapes(groups, len(prompts), cfg)
    eos = set(tok.eos_token_ids)
    n_eos = 0
    for c in (c for g in groups for c in g):
        ids = c.tokens.tolist()
        # EOS only ever ends a sequence; it is kept in tokens but left out of the text.
        assert not eos & set(ids[:-1])
        if c.finish_reason == "stop":
            assert ids[-1] in eos
            assert c.text == tok.decode(ids[:-1])
            n_eos += 1
        else:
            assert len(ids) == cfg.max_tokens and ids[-1] not in eos
            assert c.text == tok.decode(ids)
    # A random model over a ~512 vocab with 2 EOS ids stops ~20% of the time within 48 tokens.
    assert 0 < n_eos < 32


def test_max_tokens_one(loaded: tuple[Any, Any], prompts: list[list[int]]) -> None:
    model, tok = loaded
    cfg = SamplingConfig(temperature=1.0, max_tokens=1, group_size=4, seed=0)
    groups = generate_groups(model, tok, prompts, cfg)
    _check_shapes(groups, len(prompts), cfg)
    for c in (c for g in groups for c in g):
        assert len(c.tokens) == 1
        assert c.finish_reason == ("stop" if int(c.tokens[0]) in tok.eos_token_ids else "length")


def test_stop_strings(loaded: tuple[Any, Any], prompts: list[list[int]]) -> None:
    model, tok = loaded
    stop = ("e", "th")
    cfg = SamplingConfig(temperature=1.0, max_tokens=40, group_size=8, stop=stop, seed=5)
    groups = generate_groups(model, tok, prompts, cfg)
    _check_shapes(groups, len(prompts), cfg)
    eos = set(tok.eos_token_ids)
    n_string_stops = 0
    for c in (c for g in groups for c in g):
        ids = c.tokens.tolist()
        before = tok.decode(ids[:-1])
        assert not any(s in before for s in stop)  # never ran past a stop string
        if c.finish_reason == "stop" and ids[-1] not in eos:
            # Truncated at the token that completes the first stop string.
            assert any(s in tok.decode(ids) for s in stop)
            assert c.text == tok.decode(ids)
            n_string_stops += 1
        elif c.finish_reason == "length":
            assert len(ids) == cfg.max_tokens and not any(s in c.text for s in stop)
    assert n_string_stops >= 8


def test_seed_determinism(loaded: tuple[Any, Any], prompts: list[list[int]]) -> None:
    model, tok = loaded

    def run(seed: int) -> list[Completion]:
        cfg = SamplingConfig(temperature=0.8, max_tokens=16, group_size=4, seed=seed)
        return [c for g in generate_groups(model, tok, prompts, cfg) for c in g]

    a, b, other = run(11), run(11), run(12)
    for x, y in zip(a, b, strict=False):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
        assert (x.finish_reason, x.text) == (y.finish_reason, y.text)
    assert any(not np.array_equal(x.tokens, y.tokens) for x, y in zip(a, other, strict=False))
    # The G samples of a group are not copies of each other.
    assert len({x.tokens.tobytes() for x in a[:4]}) > 1


@pytest.mark.parametrize(
    ("share_prefill", "max_batch"), [(True, None), (False, None), (True, 3)],
    ids=["shared-prefill", "batched-prefill", "bounded-batch"],
)
def test_recorded_logprobs_match_teacher_forcing(
    model32: Any,
    loaded: tuple[Any, Any],
    prompts: list[list[int]],
    share_prefill: bool,
    max_batch: int | None,
) -> None:
    _, tok = loaded
    temperature = 0.7
    cfg = SamplingConfig(temperature=temperature, max_tokens=24, group_size=3, seed=7)
    groups = generate_groups(
        model32, tok, prompts, cfg, share_prefill=share_prefill, max_batch=max_batch
    )
    _check_shapes(groups, len(prompts), cfg)
    for prompt, group in zip(prompts, groups, strict=False):
        for c in group:
            ref = teacher_forced_logprobs(model32, prompt, c.tokens, temperature)
            np.testing.assert_allclose(c.logprobs, ref, rtol=0, atol=RECORDED_VS_TEACHER_ATOL)


def test_recorded_logprobs_match_teacher_forcing_bf16(
    loaded: tuple[Any, Any], prompts: list[list[int]]
) -> None:
    """With bf16 weights (as on a Mac) the recorded logprobs still equal teacher forcing."""
    model, tok = loaded
    cfg = SamplingConfig(temperature=0.9, max_tokens=16, group_size=2, seed=2)
    groups = generate_groups(model, tok, prompts, cfg)
    for prompt, group in zip(prompts, groups, strict=False):
        for c in group:
            ref = teacher_forced_logprobs(model, prompt, c.tokens, cfg.temperature)
            # bf16 activations: measured equal here, but a batched and a full pass may round
            # differently elsewhere (bf16 has ~3 significant digits).
            np.testing.assert_allclose(c.logprobs, ref, rtol=0, atol=2e-2)


def _torch_logprobs(tiny_path: Path, prompt: list[int], response: list[int], temperature: float):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + response[:-1]])).logits[0, len(prompt) - 1 :]
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        return logprobs.gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()


def test_mlx_logprobs_match_torch_float32(
    tiny_path: Path, model32: Any, loaded: tuple[Any, Any], prompts: list[list[int]]
) -> None:
    _, tok = loaded
    temperature = 0.6
    cfg = SamplingConfig(temperature=temperature, max_tokens=20, group_size=2, seed=4)
    groups = generate_groups(model32, tok, prompts[:1], cfg)
    for c in groups[0]:
        response = c.tokens.tolist()
        ref = _torch_logprobs(tiny_path, prompts[0], response, temperature)
        np.testing.assert_allclose(c.logprobs, ref, rtol=0, atol=MLX_VS_TORCH_ATOL)
        tf = teacher_forced_logprobs(model32, prompts[0], response, temperature)
        np.testing.assert_allclose(tf, ref, rtol=0, atol=MLX_VS_TORCH_ATOL)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_temperature_is_applied(
    model32: Any, loaded: tuple[Any, Any], prompts: list[list[int]]
) -> None:
    """Recorded logprobs at T=0.5 are log_softmax(logits / 0.5), computed here by hand."""
    _, tok = loaded
    prompt = prompts[1]
    cfg = SamplingConfig(temperature=0.5, max_tokens=12, group_size=2, seed=9)
    for c in generate_groups(model32, tok, [prompt], cfg)[0]:
        response = c.tokens.tolist()
        logits = np.array(model32(mx.array([prompt + response[:-1]]))[0], dtype=np.float64)
        logits = logits[len(prompt) - 1 :]
        rows = np.arange(len(response))
        at_half = _log_softmax(logits / 0.5)[rows, response]
        at_one = _log_softmax(logits)[rows, response]
        np.testing.assert_allclose(c.logprobs, at_half, rtol=0, atol=RECORDED_VS_TEACHER_ATOL)
        assert np.abs(c.logprobs - at_one).max() > 100 * RECORDED_VS_TEACHER_ATOL


def test_rejects_bad_input(loaded: tuple[Any, Any]) -> None:
    model, tok = loaded
    with pytest.raises(ValueError):
        SamplingConfig(temperature=0.0, max_tokens=4, group_size=2)
    with pytest.raises(ValueError):
        SamplingConfig(temperature=1.0, max_tokens=0, group_size=2)
    with pytest.raises(ValueError):
        SamplingConfig(temperature=1.0, max_tokens=4, group_size=2, stop=("",))
    cfg = SamplingConfig(temperature=1.0, max_tokens=4, group_size=2)
    with pytest.raises(ValueError):
        generate_groups(model, tok, [[]], cfg)
    assert generate_groups(model, tok, [], cfg) == []


class _TripsAfter(threading.Event):
    """An event that sets itself the `n`-th time it is checked (counts the decode steps)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.checks = n, 0

    def is_set(self) -> bool:
        self.checks += 1
        if self.checks >= self.n:
            self.set()
        return super().is_set()


def test_cancel_stops_generation_at_the_next_decode_step(
    loaded: tuple[Any, Any], prompts: list[list[int]]
) -> None:
    model, tok = loaded
    cfg = SamplingConfig(temperature=1.0, max_tokens=48, group_size=16, seed=3)
    cancel = _TripsAfter(3)
    with pytest.raises(GenerationCancelled):
        generate_groups(model, tok, prompts, cfg, cancel=cancel)
    assert cancel.checks == 3  # checked once per step, stopped at the step it was set
    untouched = threading.Event()
    _check_shapes(generate_groups(model, tok, prompts, cfg, cancel=untouched), len(prompts), cfg)


# -- continuous generation --------------------------------------------------------------------------


def _perturbed(model: Any, seed: int) -> list[tuple[str, mx.array]]:
    """The model's parameters with noise of a quarter of each tensor's spread added."""
    from mlx.utils import tree_flatten

    key = mx.random.key(seed)
    out = []
    for name, a in tree_flatten(model.parameters()):
        key, sub = mx.random.split(key)
        out.append((name, a + 0.25 * (mx.std(a) + 1e-3) * mx.random.normal(a.shape, key=sub)))
    return out


def test_continuous_generation_keeps_every_group_on_the_weights_it_started_with(
    tiny_path: Path, loaded: tuple[Any, Any], prompts: list[list[int]]
) -> None:
    """Groups enter while others decode; at a weight change the unfinished ones are dropped
    (`quiesce`) and the rest restart on the new weights. Every finished group's logprobs equal
    teacher forcing under the weights it was tagged with, and not under the other ones."""
    from mlx.utils import tree_flatten

    from macd.generate import ContinuousGenerator

    _, tok = loaded
    model, _ = mlx_lm.load(str(tiny_path))
    model.set_dtype(mx.float32)
    weights = {0: list(tree_flatten(model.parameters())), 1: _perturbed(model, 0)}
    mx.eval([a for _, a in weights[1]])
    temperature = 0.8
    cfg = SamplingConfig(temperature=temperature, max_tokens=24, group_size=3, seed=1)
    gen = ContinuousGenerator(model, tok, cfg, max_batch=4)  # fewer slots than sequences: some queue
    finished = []
    gen.insert(prompts[0], (0, 0))  # tags: (weights version, prompt index)
    finished += gen.advance(3)[0]
    gen.insert(prompts[1], (0, 1))  # joins a batch already decoding
    while not finished:
        finished += gen.advance(8)[0]
    gen.insert(prompts[0], (0, 0))
    finished += gen.advance(2)[0]
    sampled = gen.tokens
    dropped = gen.quiesce()  # the weights change now
    assert dropped and gen.groups == gen.sequences == 0 and 0 < gen.tokens_dropped <= sampled
    model.load_weights(weights[1])
    mx.eval(model.parameters())
    for _, n in dropped:
        gen.insert(prompts[n], (1, n))
    gen.insert(prompts[1], (1, 1))
    while gen.groups:
        finished += gen.advance(8)[0]
    gen.close()
    assert {version for version, _ in (f.tag for f in finished)} == {0, 1}
    assert len(finished) == 4  # every group inserted, less those dropped (each restarted once)
    assert sum(f.tag[0] == 0 for f in finished) == 3 - len(dropped)

    samples = [(f.tag, c) for f in finished for c in f.completions]
    forced = {}
    for version in (0, 1):
        model.load_weights(weights[version])
        forced[version] = [teacher_forced_logprobs(model, prompts[n], c.tokens, temperature) for (_, n), c in samples]
    for i, ((version, _), c) in enumerate(samples):
        np.testing.assert_allclose(c.logprobs, forced[version][i], rtol=0, atol=RECORDED_VS_TEACHER_ATOL)
        assert np.abs(c.logprobs - forced[1 - version][i]).max() > 100 * RECORDED_VS_TEACHER_ATOL


def test_room_keeps_one_group_queued_behind_a_full_batch(loaded: tuple[Any, Any], prompts: list[list[int]]) -> None:
    from macd.generate import ContinuousGenerator

    model, tok = loaded
    cfg = SamplingConfig(temperature=1.0, max_tokens=8, group_size=4, seed=0)
    gen = ContinuousGenerator(model, tok, cfg, max_batch=8)
    assert gen.room(8) == 3 and gen.cache_bytes == 0  # two groups decode, a third waits
    for _ in range(gen.room(8)):
        gen.insert(prompts[1])
    assert (gen.groups, gen.sequences, gen.room(8)) == (3, 12, 0)
    assert gen.cache_bytes > 0  # the queued group's prefilled prompt
    gen.advance(1)
    assert gen.room(8) == 0
    while gen.groups:
        gen.advance(8)
    assert gen.room(8) == 3 and gen.tokens >= 12
    gen.close()


def test_a_model_built_from_the_config_alone_takes_the_folders_weights(
    tiny_path: Path, loaded: tuple[Any, Any], tmp_path: Path
) -> None:
    """`build_model` reads config.json and the tokenizer files only (a folder without weight
    files is enough); installed in memory, the folder's state gives the loaded model's logits."""
    import shutil

    from mlx.utils import tree_flatten

    from macd.generate import build_model
    from macd.weights import LiveWeights
    from slime_stoa.protocol.hf.folders import hf_config_files, load_hf_state

    bare = tmp_path / "bare"
    bare.mkdir()
    for path in hf_config_files(tiny_path):
        shutil.copy(path, bare / path.name)
    assert not list(bare.glob("*.safetensors"))
    model, tokenizer = build_model(bare)
    params = dict(tree_flatten(model.parameters()))
    reference, ref_tok = loaded
    assert params.keys() == dict(tree_flatten(reference.parameters())).keys()
    assert {a.dtype for a in params.values()} == {mx.bfloat16}
    assert tokenizer.eos_token_ids == ref_tok.eos_token_ids and tokenizer.encode("7 + 5 =") == ref_tok.encode("7 + 5 =")
    state = load_hf_state(tiny_path)
    live = LiveWeights.from_state(model, state, "bf16")
    assert live.shares(state) and live.digest_check(state)
    prompt = mx.array([ref_tok.encode("7 + 5 =")])
    assert bool(mx.array_equal(model(prompt), reference(prompt)).item())
