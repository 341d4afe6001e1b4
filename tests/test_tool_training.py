"""The trainer side of tool episodes: the consumer, slime samples, the DPPO loss and the CPU
learner train on model tokens only; tool (observation) tokens are context."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from slime_stoa.protocol.records import RolloutGroup, Sample
from slime_stoa.protocol.store import Store
from slime_stoa.quickstart.tiny_model import build_tiny_model
from slime_stoa.trainer.consumer import sample_fields
from slime_stoa.trainer.learner import Learner, LearnerConfig, TrainSequence
from slime_stoa.trainer.loss import DPPOConfig, dppo_policy_loss, slime_loss_and_metrics
from tests import test_consumer
from tests.test_consumer import ITEMS, G, Tiny, make_group, open_consumer, setup_run, upload

tiny = test_consumer.tiny  # the consumer tests' tiny model and tokenizer fixture

# -- the consumer and slime samples ------------------------------------------------------------------


def episode_group(tiny: Tiny, **kw: object) -> RolloutGroup:
    """A v2 group: samples 0 and 2 answer at once; 1 and 3 call the tool first (model | tool | model)."""
    item = ITEMS[1]
    base = make_group(tiny, worker="w", seq=0, prompt_index=1, answers=[item.label, "x", item.label, "x"], **kw)  # type: ignore[arg-type]
    samples = list(base.samples)
    for i in (1, 3):
        call, obs, answer = tiny.encode("q?"), tiny.encode("[o]"), tiny.encode("x") + [tiny.eos]
        tokens = call + obs + answer
        mask = [1] * len(call) + [0] * len(obs) + [1] * len(answer)
        lp = [-0.5 - 0.01 * i if m else 0.0 for m in mask]
        samples[i] = Sample(response_tokens=tokens, logprobs=lp, finish_reason="stop", reward=0.0, mask=mask,
                            turns=2, tool_calls=1)
    return msgspec.structs.replace(base, samples=tuple(samples))


async def test_consumer_accepts_episodes_and_builds_masked_samples(store: Store, store_url: str, tiny: Tiny) -> None:
    await setup_run(store, tiny)
    group = episode_group(tiny)
    await upload(store, group)
    consumer = await open_consumer(store, tiny, store_url)
    consumed = (await consumer.next_batch(1, trainer_version=0)).groups[0]
    await consumer.close()
    assert consumed.group == group
    # re-scored from the whole text: model and tool tokens decoded (the final EOS stripped)
    for s, text in zip(group.samples, consumed.texts, strict=True):
        assert text == tiny.decode(s.response_tokens.tolist()[:-1])
    assert "[o]" in consumed.texts[1] and consumed.rewards == (1.0, 0.0, 1.0, 0.0)
    fields = sample_fields(consumed)
    for f, s in zip(fields, group.samples, strict=True):
        assert f["response_length"] == len(s.response_tokens) == len(f["loss_mask"]) == len(f["rollout_log_probs"])
        assert f["loss_mask"] == s.mask.tolist()
        assert f["metadata"]["stoa_turns"] == s.turns and f["metadata"]["stoa_tool_calls"] == s.tool_calls
    assert 0 in fields[1]["loss_mask"] and set(fields[0]["loss_mask"]) == {1}
    tool_positions = [i for i, m in enumerate(fields[1]["loss_mask"]) if m == 0]
    assert all(fields[1]["rollout_log_probs"][i] == 0.0 for i in tool_positions)


def test_turn_limited_episodes_are_truncated_samples(tiny: Tiny) -> None:
    from slime_stoa.trainer.consumer import ConsumedGroup

    group = episode_group(tiny)
    s = group.samples[1]
    group = msgspec.structs.replace(group, samples=(group.samples[0], msgspec.structs.replace(s, finish_reason="turns"), *group.samples[2:]))
    cg = ConsumedGroup(key="k", group=group, prompt="p", label="l", texts=("",) * G, rewards=(0.0,) * G, version_lag=0, use=1)
    assert [f["status"] for f in sample_fields(cg)] == ["completed", "truncated", "completed", "completed"]


# -- the loss ------------------------------------------------------------------------------------


def test_loss_ignores_tool_positions_whatever_they_hold() -> None:
    """Changing the trainer's or the worker's logprobs at tool positions changes neither the loss,
    its gradient nor the metrics (the logprob gap included); changing a model token's does."""
    torch.manual_seed(0)
    n = 12
    mask = torch.tensor([1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1], dtype=torch.float32)
    base = -torch.rand(n) - 0.1
    worker = base + 0.05 * torch.randn(n)
    adv = torch.randn(n)

    def run(logp0: torch.Tensor, worker_lp: torch.Tensor) -> tuple[float, torch.Tensor, dict[str, float]]:
        logp = logp0.clone().requires_grad_(True)
        per_token, metrics = dppo_policy_loss(logp, worker_lp, adv, mask, DPPOConfig())
        loss = per_token.sum() / mask.sum()
        loss.backward()
        assert logp.grad is not None
        return float(loss.detach()), logp.grad.clone(), {k: float(v) for k, v in metrics.items()}

    ref = run(base, worker)
    tool = mask == 0
    garbage = torch.where(tool, torch.full((n,), -50.0), base)
    garbage_worker = torch.where(tool, torch.full((n,), float("nan")), worker)
    other = run(garbage, garbage_worker)
    assert ref[0] == other[0] and torch.equal(ref[1], other[1]) and ref[2] == other[2]
    assert torch.all(ref[1][tool] == 0)
    moved = run(torch.where(torch.arange(n) == 0, base - 1.0, base), worker)
    assert moved[0] != ref[0]
    # slime's entry point, per sample
    lps = [base[:6].clone().requires_grad_(True), base[6:].clone().requires_grad_(True)]
    loss, _ = slime_loss_and_metrics(
        config=DPPOConfig(), log_probs=lps, rollout_log_probs=[garbage_worker[:6], garbage_worker[6:]],
        advantages=[adv[:6], adv[6:]], loss_masks=[mask[:6], mask[6:]],
        sum_of_sample_mean=lambda x: (x * mask).sum() / mask.sum(), pg_reducer=lambda x: (x * mask).sum() / mask.sum(),
    )
    loss.backward()
    assert torch.isfinite(loss) and all(lp.grad is not None and torch.isfinite(lp.grad).all() for lp in lps)


# -- the learner -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def step_params(model_dir: Path, groups: list[list[TrainSequence]]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    learner = Learner(model_dir, LearnerConfig(lr=1e-2, scale_rewards=False))
    metrics = learner.step(groups)
    return metrics, {n: p.detach().numpy().copy() for n, p in learner.model.named_parameters()}


def test_learner_trains_on_model_tokens_only(model_dir: Path) -> None:
    prompt = np.array([3, 5, 7])
    response = np.array([20, 21, 90, 91, 92, 22])  # model, model, tool x3, model
    mask = np.array([1, 1, 0, 0, 0, 1], np.uint8)
    learner = Learner(model_dir)
    other = np.array([30, 31])
    trainer_lp, other_lp = learner.logprobs([TrainSequence(prompt, r, np.zeros(len(r), np.float32), 0.0)
                                             for r in (response, other)])

    def group(tool_lp: float, tool_tokens: tuple[int, ...] = (90, 91, 92), m: np.ndarray | None = mask) -> list[list[TrainSequence]]:
        r = response.copy()
        r[2:5] = tool_tokens
        lp = trainer_lp.copy()
        lp[2:5] = tool_lp
        return [[TrainSequence(prompt, r, lp, 1.0, m), TrainSequence(prompt, other, other_lp, 0.0)]]

    m1, p1 = step_params(model_dir, group(0.0))
    m2, p2 = step_params(model_dir, group(-30.0))  # the worker's tool logprobs are never read
    assert all(np.array_equal(p1[k], p2[k]) for k in p1) and m1 == m2
    assert m1["tokens"] == 3 + 2  # model tokens only
    assert m1["logprob_gap_mean"] < 1e-2  # aligned on model tokens; the tool positions' -30 would show
    _, p3 = step_params(model_dir, group(-30.0, m=None))  # the same data with tool tokens trained on
    assert not all(np.array_equal(p1[k], p3[k]) for k in p1)
    with pytest.raises(ValueError, match="mask"):
        TrainSequence(prompt, response, trainer_lp, 1.0, mask[:3]).loss_mask()
