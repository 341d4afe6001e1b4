"""A real pretrained model through both halves: SmolLM2-135M-Instruct (real BPE vocabulary, ChatML
template with its own system turn, `<|im_end|>` as the end of a turn, tied embeddings), built
offline from the packaged GGUF (`slime_stoa.quickstart.real_model`).

What a random tiny model with a tokenizer trained on the task's text cannot show: that a worker
(mlx-lm's tokenizer wrapper) and the trainer (transformers' tokenizer, `load_prompt_builder`)
build the same prompt tokens for every task under the real template; that both end a sample on
the same end-of-turn token and derive the same text from the same tokens; that a real completion's
recorded logprobs are the learner's.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("transformers")

from macd.generate import SamplingConfig, build_model, generate_groups
from macd.hf_layout import live_weights
from slime_stoa.judging.scoring import Rescorer, eos_ids_of, load_prompt_builder, load_tokenizer
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.quickstart.real_model import RealModelUnavailable, smollm2_folder
from slime_stoa.tasks import Synthetic, TaskItem, generate_items
from slime_stoa.tasks.episode import observation_tokens
from slime_stoa.tasks.gsm8k import GSM8K, load_gsm8k_jsonl
from slime_stoa.tasks.math_task import MathTask
from slime_stoa.tasks.prompting import prompt_tokens
from slime_stoa.tasks.search.task import Search
from slime_stoa.trainer.learner import Learner, LearnerConfig, TrainSequence
from tests.shared_data import GSM8K_DIR


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The real model's folder (built once per machine). CI installs its package, so there a
    missing package fails instead of skipping."""
    try:
        return smollm2_folder()
    except RealModelUnavailable as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


def gsm8k_items(limit: int) -> tuple[TaskItem, ...]:
    path = GSM8K_DIR / "test.jsonl"
    if not path.is_file():
        pytest.skip(f"no GSM8K test split at {path}")
    return load_gsm8k_jsonl(path, limit=limit)


def every_task() -> dict[str, object]:
    return {
        "gsm8k": GSM8K(gsm8k_items(8)),
        "math": MathTask([
            TaskItem(index=0, prompt=r"What is $\frac{3}{4} + \frac{1}{8}$? Express it as a fraction.", label=r"\frac78"),
            TaskItem(index=1, prompt="Let $x^2 - 5x + 6 = 0$. Find the larger root.", label="3"),
        ]),
        "search": Search([
            TaskItem(index=0, prompt="Which gene is mutated in cystic fibrosis?", label='["CFTR"]'),
            TaskItem(index=1, prompt="What does BM25 rank?  (two spaces, «quotes» and ü)", label='["documents"]'),
        ]),
        "synthetic": Synthetic(generate_items(4, seed=3)),
    }


def test_the_real_model_is_built_once_and_whole(real_model: Path) -> None:
    names = {p.name for p in real_model.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert smollm2_folder() == real_model  # the cached folder, not a rebuild
    assert not [p for p in real_model.parent.iterdir() if p.name.startswith(".")]  # no half-built folder left


def test_worker_and_trainer_build_the_same_prompt_tokens_for_every_task(real_model: Path) -> None:
    _, worker_tokenizer = build_model(real_model)
    for name, task in every_task().items():
        trainer_prompt = load_prompt_builder(real_model, task)  # type: ignore[arg-type]
        for item in task.items:  # type: ignore[attr-defined]
            worker = prompt_tokens(worker_tokenizer, task, item)  # type: ignore[arg-type]
            assert worker == [int(t) for t in trainer_prompt(item)], (name, item.index)
            text = worker_tokenizer.decode(worker)
            # the task's own system prompt replaces the template's default one, and the prompt
            # ends where the assistant's turn starts
            assert text.startswith("<|im_start|>system\n" + (task.system_prompt or "")), name  # type: ignore[attr-defined]
            assert "You are a helpful AI assistant named SmolLM" not in text or task.system_prompt is None  # type: ignore[attr-defined]
            assert text.endswith("<|im_start|>assistant\n"), name


def test_observation_tokens_are_encoded_alike_on_both_sides(real_model: Path) -> None:
    from transformers import AutoTokenizer

    _, worker_tokenizer = build_model(real_model)
    trainer_tokenizer = AutoTokenizer.from_pretrained(real_model)
    search = every_task()["search"]
    fmt = search.tool_format  # type: ignore[attr-defined]
    passage = 'Doc 1 (Title: "Cystic fibrosis") CFTR — the cystic fibrosis transmembrane conductance regulator.'
    encode_worker = lambda s: [int(t) for t in worker_tokenizer.encode(s, add_special_tokens=False)]  # noqa: E731
    encode_trainer = lambda s: [int(t) for t in trainer_tokenizer.encode(s, add_special_tokens=False)]  # noqa: E731
    worker = observation_tokens(fmt, encode_worker, passage, ())
    assert worker == observation_tokens(fmt, encode_trainer, passage, ())
    assert trainer_tokenizer.decode(worker).startswith("\n<information>")


def test_both_sides_end_a_turn_on_im_end(real_model: Path) -> None:
    _, worker_tokenizer = build_model(real_model)
    _, trainer_eos = load_tokenizer(real_model)
    im_end = worker_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert set(worker_tokenizer.eos_token_ids) == set(trainer_eos) == set(eos_ids_of(real_model)) == {im_end}
    # <|endoftext|> is not an end of turn for this model: a worker that stopped on it would
    # record a "stop" the trainer calls a contradiction
    assert worker_tokenizer.convert_tokens_to_ids("<|endoftext|>") not in trainer_eos


@pytest.fixture(scope="module")
def real_completions(real_model: Path) -> tuple[list[list[int]], list[list[object]]]:
    """Real sampled completions of two GSM8K prompts by the worker's generator on the bf16 weights."""
    model, tokenizer = build_model(real_model)
    live_weights(model, dict(load_hf_state(real_model)), "bf16")
    task = GSM8K(gsm8k_items(2))
    prompts = [prompt_tokens(tokenizer, task, item) for item in task.items]
    sampling = SamplingConfig(temperature=1.0, max_tokens=40, group_size=2, seed=11)
    return prompts, generate_groups(model, tokenizer, prompts, sampling)  # type: ignore[return-value]


@pytest.mark.slow  # ~40 s with the next: real completions sampled on MLX's stock CPU path
def test_a_real_completion_reads_the_same_on_both_sides(real_model: Path, real_completions) -> None:  # type: ignore[no-untyped-def]
    _, groups = real_completions
    decode, eos = load_tokenizer(real_model)
    rescorer = Rescorer(task=GSM8K(gsm8k_items(2)), decode=decode, eos_ids=eos)
    finishes = set()
    for group in groups:
        for c in group:
            assert len(c.tokens) == len(c.logprobs) > 0
            assert rescorer.completion_text(c.tokens, c.finish_reason) == c.text
            assert "<|im_end|>" not in c.text  # the final end of turn is not text
            finishes.add(c.finish_reason)
            if c.finish_reason == "stop":
                assert int(c.tokens[-1]) in eos
    assert finishes <= {"stop", "length"}


@pytest.mark.slow
def test_recorded_logprobs_of_real_completions_are_the_learners(real_model: Path, real_completions) -> None:  # type: ignore[no-untyped-def]
    prompts, groups = real_completions
    learner = Learner(real_model, LearnerConfig(temperature=1.0))
    seqs = [
        TrainSequence(prompt=np.asarray(prompt), response=np.asarray(c.tokens), worker_logprobs=c.logprobs, reward=0.0)
        for prompt, group in zip(prompts, groups, strict=True)
        for c in group
    ]
    gaps = np.concatenate([np.abs(lp - s.worker_logprobs) for lp, s in zip(learner.logprobs(seqs), seqs, strict=True)])
    # bf16 weights on both sides, float32 (learner) vs MLX's compute: numerical noise only. A
    # wrong template, a shifted token or other weights would put this at nats per token.
    assert float(np.mean(gaps)) < 0.05, float(np.mean(gaps))
    assert float(np.quantile(gaps, 0.99)) < 0.5, float(np.quantile(gaps, 0.99))
