"""The CPU learner: bf16 acting weights, GRPO advantages, DPPO steps that move the policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.quickstart.tiny_model import build_tiny_model
from slime_stoa.trainer.learner import (
    Learner,
    LearnerConfig,
    TrainSequence,
    group_advantages,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_group_advantages() -> None:
    assert np.allclose(group_advantages([1, 0, 0, 1], scale=False), [0.5, -0.5, -0.5, 0.5])
    scaled = group_advantages([1, 0, 0, 1], scale=True)
    assert np.allclose(scaled, [1, -1, -1, 1], atol=1e-5)
    assert np.allclose(group_advantages([1, 1, 1], scale=True), 0)


def test_published_state_is_the_checkpoint_bits(model_dir: Path) -> None:
    learner = Learner(model_dir)
    state = learner.bf16_state()
    ref = load_hf_state(model_dir)
    assert state.keys() == ref.keys()
    assert all(np.array_equal(state[k], ref[k]) for k in ref)


def test_logprobs_match_a_plain_forward(model_dir: Path) -> None:
    learner = Learner(model_dir, LearnerConfig(temperature=0.7))
    seq = TrainSequence(np.array([3, 5, 7, 11]), np.array([13, 17, 19]), np.zeros(3, np.float32), 0.0)
    got = learner.logprobs([seq])[0]
    ids = torch.tensor([[3, 5, 7, 11, 13, 17, 19]])
    with torch.no_grad():
        logits = learner.model(ids).logits[0] / 0.7
    ref = torch.log_softmax(logits, -1)[3:6].gather(1, ids[0, 4:7, None]).squeeze(1).numpy()
    assert np.allclose(got, ref, atol=1e-5)


def test_logprobs_of_a_ragged_batch_match_each_sequence_alone(model_dir: Path) -> None:
    """Prompts and responses of different lengths in one micro-batch (right padding, the head
    run on the last positions only): each sequence's logprobs are its own plain forward's."""
    learner = Learner(model_dir, LearnerConfig(temperature=0.7, micro_batch=8))
    shapes = [(2, 5), (6, 1), (4, 3), (9, 2)]  # (prompt, response) lengths
    rng = np.random.default_rng(0)
    seqs = [TrainSequence(rng.integers(3, 40, p), rng.integers(3, 40, r), np.zeros(r, np.float32), 0.0) for p, r in shapes]
    got = learner.logprobs(seqs)
    for seq, (p, r), out in zip(seqs, shapes, got, strict=True):
        ids = torch.from_numpy(np.concatenate([seq.prompt, seq.response]).astype(np.int64))[None]
        with torch.no_grad():
            logits = learner.model(ids).logits[0] / 0.7
        ref = torch.log_softmax(logits, -1)[p - 1 : p + r - 1].gather(1, ids[0, p:, None]).squeeze(1).numpy()
        assert out.shape == (r,) and np.allclose(out, ref, atol=1e-5), (p, r)


def test_rl_step_raises_the_rewarded_response(model_dir: Path) -> None:
    learner = Learner(model_dir, LearnerConfig(lr=3e-3, scale_rewards=False))
    prompt = np.array([3, 5, 7])
    good, bad = np.array([20, 21, 22]), np.array([30, 31, 32])
    start = learner.logprobs([TrainSequence(prompt, good, np.zeros(3, np.float32), 1.0)])[0]
    for _ in range(5):
        seqs = [TrainSequence(prompt, r, lp, rew) for r, rew in ((good, 1.0), (bad, 0.0))
                for lp in learner.logprobs([TrainSequence(prompt, r, np.zeros(3, np.float32), rew)])]
        metrics = learner.step([seqs])
    end = learner.logprobs([TrainSequence(prompt, good, np.zeros(3, np.float32), 1.0)])[0]
    assert end.sum() > start.sum() + 0.1
    assert metrics["reward_mean"] == 0.5 and metrics["grad_norm"] > 0


def test_supervised_warm_start_lowers_the_loss(model_dir: Path) -> None:
    learner = Learner(model_dir, LearnerConfig(lr=3e-3))
    pairs = [(np.array([3, 5, 7]), np.array([9, 9, 2]))] * 4
    losses = [learner.supervised_step(pairs) for _ in range(10)]
    assert losses[-1] < losses[0] * 0.7
