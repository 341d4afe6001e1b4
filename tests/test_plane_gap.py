"""The learner-vs-worker logprob gap per weight plane, measured on the tiny models, and the
quarantine's plane-aware limits: an honest worker on the int8 or int4 plane is never struck, a
worker that makes its logprobs up still is.

The trainer's logprobs are the CPU learner's (torch, bf16-rounded weights); the worker's are an
MLX `ContinuousGenerator`'s on the bf16 weights or on the run's published int8 / int4 plane
(`plane_bits`, served by `PlaneWeights`), for the tokens that worker sampled. Run with `-s` to
print the table (mean / max gap per token, the share of tokens the DPPO gate drops)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("transformers")

from macd.generate import ContinuousGenerator, SamplingConfig, build_model
from macd.hf_layout import live_weights
from macd.plane_weights import PlaneWeights
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.pulse.plane import plane_bits
from slime_stoa.quickstart.seeding import tiny_synthetic_model
from slime_stoa.trainer.consumer.canary import CanaryConfig
from slime_stoa.trainer.consumer.quarantine import Quarantine, QuarantineConfig
from slime_stoa.trainer.learner import Learner, LearnerConfig, TrainSequence
from slime_stoa.trainer.loss_config import DPPOConfig

PLANES = ("bf16", "int8", "int4")
GROUPS, GROUP_SIZE, MAX_TOKENS = 6, 4, 32


@dataclass
class Measured:
    """One plane's gaps: per token, and each group's mean (what the consumer is fed)."""

    tokens: np.ndarray  # |trainer - worker| per sampled token
    groups: list[tuple[float, int]]  # (mean gap, tokens) per group
    trainer: list[np.ndarray]  # the trainer's logprobs per sample
    worker: list[np.ndarray]  # the worker's
    gated: float  # share of tokens with |p - mu| > the DPPO trust region (default delta 0.2)


def measure(model_dir: Path) -> dict[str, Measured]:
    state = load_hf_state(model_dir)
    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    learner = Learner(model_dir, LearnerConfig(temperature=1.0))
    delta = DPPOConfig().delta_high
    out = {}
    for plane in PLANES:
        model, tokenizer = build_model(model_dir)
        if plane == "bf16":
            live_weights(model, dict(state), "bf16")
        else:
            PlaneWeights.from_state(model, dict(plane_bits(state, plane, model_type)), plane)
        sampling = SamplingConfig(temperature=1.0, max_tokens=MAX_TOKENS, group_size=GROUP_SIZE, seed=7)
        gen = ContinuousGenerator(model, tokenizer, sampling, max_batch=GROUPS * GROUP_SIZE)
        prompts = [tokenizer.encode(f"what is {i} plus {2 * i + 1}?") for i in range(GROUPS)]
        for i, prompt in enumerate(prompts):
            gen.insert(prompt, i)
        finished = []
        while len(finished) < GROUPS:
            finished += gen.advance(MAX_TOKENS)[0]
        gen.close()
        groups, trainer, worker, tokens = [], [], [], []
        for group in sorted(finished, key=lambda g: g.tag):
            seqs = [
                TrainSequence(prompt=np.asarray(prompts[group.tag]), response=np.asarray(c.tokens),
                              worker_logprobs=c.logprobs, reward=0.0)
                for c in group.completions
            ]
            lps = learner.logprobs(seqs)
            gaps = np.concatenate([np.abs(lp - s.worker_logprobs) for lp, s in zip(lps, seqs, strict=True)])
            groups.append((float(gaps.mean()), int(gaps.size)))
            trainer += lps
            worker += [s.worker_logprobs for s in seqs]
            tokens.append(gaps)
        p, mu = np.exp(np.concatenate(trainer)), np.exp(np.concatenate(worker))
        out[plane] = Measured(np.concatenate(tokens), groups, trainer, worker, float(np.mean(np.abs(p - mu) > delta)))
    return out


@pytest.fixture(scope="module", params=["qwen2", "lfm2_moe"])
def gaps(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Measured]]:
    family = request.param
    return family, measure(tiny_synthetic_model(tmp_path_factory.mktemp(family) / "model", family))


def judge(config: QuarantineConfig, workers: dict[str, tuple[str, list[tuple[float, int]]]]) -> dict[str, str]:
    """Feed each worker's group gaps as the consumer does (one observation per group, on the
    plane its records name); the workers quarantined, with their reasons."""
    book = Quarantine(config)
    for worker, (plane, groups) in workers.items():
        for gap, tokens in groups:
            book.observe_gap(worker, gap, tokens, plane=plane)
    return book.quarantined()


@pytest.mark.slow  # ~30 s: a learner and three MLX models per family
def test_the_gap_per_plane(gaps: tuple[str, dict[str, Measured]]) -> None:
    family, measured = gaps
    for plane, m in measured.items():
        print(f"{family:>9} {plane:>5}: gap mean {m.tokens.mean():.4f} max {m.tokens.max():.4f} nats/token "
              f"over {m.tokens.size} tokens; largest group mean {max(g for g, _ in m.groups):.4f}; "
              f"DPPO gate drops {m.gated:.1%}")
    means = [measured[p].tokens.mean() for p in PLANES]
    assert means[0] < means[2] and means[1] < means[2]  # 4 bits are coarser than bf16 and int8
    assert means[0] < 0.1  # bf16: numerical noise (and the tiny MoE's routing ties)


@pytest.mark.slow
def test_honest_quantized_workers_pass_and_a_tampered_one_is_caught(gaps: tuple[str, dict[str, Measured]]) -> None:
    family, measured = gaps
    config = QuarantineConfig(min_gap_tokens=64)
    honest = {f"mac-{plane}": (plane, measured[plane].groups) for plane in PLANES}
    assert judge(config, honest) == {}
    canary = CanaryConfig()
    for plane in PLANES:  # no canary group of an honest worker fails the gap check
        limit = canary.max_logprob_gap + config.allowance(plane)
        assert max(g for g, _ in measured[plane].groups) <= limit, (family, plane)

    # A worker on the int4 plane that makes its logprobs up (reports every sampled token as
    # certain): its gap is the trainer's |logprob| itself.
    m = measured["int4"]
    made_up = [(float(np.mean(np.abs(t))), t.size) for t in m.trainer]
    assert judge(config, {**honest, "liar": ("int4", made_up)}) == {"liar": "logprob_gap"}
    # A worker claiming bf16 while serving int4 is held to bf16's limit.
    claimed = judge(config, {"mac-bf16": ("bf16", measured["bf16"].groups), "int4-as-bf16": ("bf16", m.groups)})
    if family == "lfm2_moe":  # the tiny MoE's int4 gap is above bf16's limit
        assert claimed == {"int4-as-bf16": "logprob_gap"}


def test_relative_limits_compare_a_worker_with_its_own_plane() -> None:
    """Three honest int4 workers and three bf16 ones: the int4 gaps are not judged against the
    bf16 median (they would all be ten times it), a tenfold int4 gap still is against int4's."""
    config = QuarantineConfig(min_gap_tokens=10, max_logprob_gap=None)
    book = Quarantine(config)
    for i in range(3):
        book.observe_gap(f"bf16-{i}", 0.001, 100, plane="bf16")
        book.observe_gap(f"int4-{i}", 0.3, 100, plane="int4")
    assert book.quarantined() == {}
    book.observe_gap("int4-odd", 3.5, 100, plane="int4")
    assert book.quarantined() == {"int4-odd": "logprob_gap_relative"}
    with pytest.raises(ValueError, match="plane"):
        book.observe_gap("x", 0.1, 10, plane="fp8")
    with pytest.raises(ValueError, match="int4_gap_allowance"):
        QuarantineConfig(int4_gap_allowance=-1.0)
