"""DPPO loss: values and gradients against hand-computed cases, reductions, metrics, log-prob slicing."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from slime_stoa.trainer.loss import (
    DPPOConfig,
    dppo_policy_loss,
    dppo_terms,
    reduce_per_token,
    response_logprobs,
    slime_loss_and_metrics,
)
from slime_stoa.trainer.slime.loss import config_from_args

F64 = torch.float64


def _logs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=F64).log()


def _loss_and_grad(
    p: list[float], mu: list[float], adv: list[float], config: DPPOConfig, mask: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss, d(sum loss)/d(logp) and metrics for probabilities p (trainer) and mu (worker)."""
    logp = _logs(p).requires_grad_(True)
    mask_t = torch.ones(len(p), dtype=torch.int64) if mask is None else torch.tensor(mask)
    loss, metrics = dppo_policy_loss(logp, _logs(mu), torch.tensor(adv, dtype=F64), mask_t, config)
    loss.sum().backward()
    return loss.detach(), logp.grad, metrics


# Hand-computed cases at the defaults (δ = 0.2, C = 2, c = 3): (p, μ, A, expected weight w or 0 if dropped).
# A kept token has loss −A·w and d loss/d logp = −A·w; a dropped one has 0 and 0.
CASES = {
    "pos_inside": (0.6, 0.5, 1.0, 1.2),  # p − μ = 0.1 ≤ δ_high, r = 1.2
    "pos_outside": (0.8, 0.5, 1.0, 0.0),  # p − μ = 0.3 > δ_high: gated
    "neg_moved_up": (0.8, 0.5, -1.0, 1.6),  # A < 0 and p went up: never gated, r = 1.6
    "neg_outside": (0.2, 0.5, -1.0, 0.0),  # μ − p = 0.3 > δ_low: gated
    "pos_moved_down": (0.2, 0.5, 2.0, 0.4),  # A > 0 and p went down: kept, r = 0.4
    "pos_just_inside": (0.69, 0.5, 1.0, 1.38),
    "pos_just_outside": (0.71, 0.5, 1.0, 0.0),
    "neg_just_inside": (0.31, 0.5, -1.0, 0.62),
    "neg_just_outside": (0.29, 0.5, -1.0, 0.0),
    "pos_rare_capped": (0.1, 0.01, 1.0, 2.0),  # p − μ = 0.09: kept; r = 10 capped at C = 2
    "neg_dual_clipped": (0.05, 0.01, -1.0, 0.0),  # r = 5 > c = 3: dropped
    "neg_capped_below_c": (0.025, 0.01, -1.5, 2.0),  # r = 2.5 ≤ c: kept, weight capped at 2
    "zero_advantage": (0.9, 0.1, 0.0, 2.0),  # kept (no gate for A = 0; r = 9 capped), gradient 0
}


@pytest.mark.parametrize("name", list(CASES))
def test_hand_cases_value_and_gradient(name: str) -> None:
    p, mu, adv, w = CASES[name]
    loss, grad, _ = _loss_and_grad([p], [mu], [adv], DPPOConfig())
    assert loss.item() == pytest.approx(-adv * w, abs=1e-12)
    assert grad.item() == pytest.approx(-adv * w, abs=1e-12)
    if w == 0.0:
        assert grad.item() == 0.0  # exactly zero, not merely small


def test_terms_attribute_each_drop_to_one_reason() -> None:
    names = list(CASES)
    p, mu, adv, _ = zip(*(CASES[n] for n in names), strict=True)
    t = dppo_terms(
        _logs(list(p)), _logs(list(mu)), torch.tensor(adv, dtype=F64), torch.ones(len(p)), DPPOConfig()
    )

    def by_name(mask: torch.Tensor) -> set[str]:
        return {n for n, m in zip(names, mask.tolist(), strict=True) if m}

    assert by_name(t.gated) == {"pos_outside", "neg_outside", "pos_just_outside", "neg_just_outside"}
    assert by_name(t.dual_clipped) == {"neg_dual_clipped"}
    assert by_name(t.ppo_clipped) == set()
    assert by_name(t.capped) == {"pos_rare_capped", "neg_capped_below_c", "zero_advantage"}
    assert by_name(~t.kept) == by_name(t.gated) | {"neg_dual_clipped"}


def test_fresh_data_is_the_plain_policy_gradient() -> None:
    p = [0.9, 0.3, 0.05, 0.5]
    adv = [1.0, -2.0, 0.5, -0.25]
    loss, grad, metrics = _loss_and_grad(p, p, adv, DPPOConfig())
    assert torch.allclose(grad, -torch.tensor(adv, dtype=F64))
    assert torch.allclose(loss, -torch.tensor(adv, dtype=F64))
    assert metrics["drop_frac"].item() == 0.0
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)


def test_uncapped_ratio_and_larger_cap() -> None:
    # p − μ = 0.09 keeps the token; r = 10.
    for cap, w in ((None, 10.0), (5.0, 5.0), (20.0, 10.0)):
        _, grad, _ = _loss_and_grad([0.1], [0.01], [0.5], DPPOConfig(ratio_cap=cap))
        assert grad.item() == pytest.approx(-0.5 * w)


def test_dual_clip_bound_for_negative_advantages() -> None:
    # A < 0 with ratios 2.5, 4, 8 (all p − μ small, so the gate keeps them).
    p, mu, adv = [0.025, 0.04, 0.08], [0.01, 0.01, 0.01], [-1.0, -1.0, -1.0]
    _, grad, _ = _loss_and_grad(p, mu, adv, DPPOConfig(ratio_cap=None, dual_clip=3.0))
    assert grad.tolist() == pytest.approx([2.5, 0.0, 0.0])
    _, grad, _ = _loss_and_grad(p, mu, adv, DPPOConfig(ratio_cap=None, dual_clip=5.0))
    assert grad.tolist() == pytest.approx([2.5, 4.0, 0.0])
    _, grad, _ = _loss_and_grad(p, mu, adv, DPPOConfig(ratio_cap=None, dual_clip=None))
    assert grad.tolist() == pytest.approx([2.5, 4.0, 8.0])
    # Positive advantages are never dual-clipped.
    _, grad, _ = _loss_and_grad(p, mu, [1.0, 1.0, 1.0], DPPOConfig(ratio_cap=None, dual_clip=3.0))
    assert grad.tolist() == pytest.approx([-2.5, -4.0, -8.0])


def test_ppo_clip_gates_on_top_of_the_trust_region() -> None:
    cfg = DPPOConfig(eps_clip=0.2, eps_clip_high=0.28)
    # r = 1.2 (kept), 1.4 (> 1.28: clipped), 0.85 (A<0, ≥ 0.8: kept), 0.7 (A<0, < 0.8: clipped)
    p, mu, adv = [0.12, 0.14, 0.085, 0.07], [0.1, 0.1, 0.1, 0.1], [1.0, 1.0, -1.0, -1.0]
    _, grad, metrics = _loss_and_grad(p, mu, adv, cfg)
    assert grad.tolist() == pytest.approx([-1.2, 0.0, 0.85, 0.0])
    assert metrics["ppo_clip_frac"].item() == pytest.approx(0.5)
    assert metrics["gate_frac"].item() == 0.0
    # Without the PPO clip the same tokens all pass the DPPO gate.
    _, grad, _ = _loss_and_grad(p, mu, adv, DPPOConfig())
    assert grad.tolist() == pytest.approx([-1.2, -1.4, 0.85, 0.7])


def _dual_clip_ppo(logp, worker_logp, adv, eps_low, eps_high, c):
    """Textbook dual-clip PPO per-token loss, gradient through the ratio."""
    r = torch.exp(logp - worker_logp)
    clipped = torch.maximum(-r * adv, -r.clamp(1 - eps_low, 1 + eps_high) * adv)
    return torch.where(adv < 0, torch.minimum(clipped, -c * adv), clipped)


def test_gate_off_and_no_cap_reduces_to_dual_clip_ppo_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 4000
    logp = -torch.rand(n, generator=gen, dtype=F64) * 4
    worker_logp = (logp + torch.randn(n, generator=gen, dtype=F64) * 0.8).clamp(max=0)
    adv = torch.randn(n, generator=gen, dtype=F64)
    cfg = DPPOConfig(
        delta_low=1.0, delta_high=1.0, ratio_cap=None, dual_clip=3.0, eps_clip=0.2, eps_clip_high=0.28
    )
    t = dppo_terms(logp, worker_logp, adv, torch.ones(n), cfg)
    # The random data exercises every region.
    assert t.ppo_clipped.any() and t.dual_clipped.any() and t.kept.any() and not t.gated.any()

    a = logp.clone().requires_grad_(True)
    dppo_policy_loss(a, worker_logp, adv, torch.ones(n), cfg)[0].sum().backward()
    b = logp.clone().requires_grad_(True)
    _dual_clip_ppo(b, worker_logp, adv, 0.2, 0.28, 3.0).sum().backward()
    assert torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_padding_contributes_nothing_even_with_garbage() -> None:
    logp = torch.tensor([math.log(0.6), -1.0, math.log(0.3), math.nan], dtype=F64, requires_grad=True)
    worker_logp = torch.tensor([math.log(0.5), math.nan, math.log(0.3), -math.inf], dtype=F64)
    adv = torch.tensor([1.0, math.inf, -2.0, math.nan], dtype=F64)
    mask = torch.tensor([1, 0, 1, 0])
    loss, metrics = dppo_policy_loss(logp, worker_logp, adv, mask, DPPOConfig())
    red = reduce_per_token(loss, mask, [2, 2], reduction="seq_mean")
    red.backward()
    assert loss.tolist() == pytest.approx([-1.2, 0.0, 2.0, 0.0])
    assert logp.grad.tolist() == pytest.approx([-1.2 / 2, 0.0, 2.0 / 2, 0.0])
    assert logp.grad[1].item() == 0.0 and logp.grad[3].item() == 0.0
    assert red.item() == pytest.approx(((-1.2) / 1 + 2.0 / 1) / 2)
    assert all(math.isfinite(v.item()) for v in metrics.values())
    assert metrics["tokens"].item() == 2


def test_metrics_on_a_tiny_example() -> None:
    # pos_inside, pos_outside, neg_moved_up, pos_rare_capped, neg_dual_clipped, and one padding token.
    p = [0.6, 0.8, 0.8, 0.1, 0.05, 0.3]
    mu = [0.5, 0.5, 0.5, 0.01, 0.01, 0.9]
    adv = [1.0, 1.0, -1.0, 1.0, -1.0, 1.0]
    _, _, m = _loss_and_grad(p, mu, adv, DPPOConfig(), mask=[1, 1, 1, 1, 1, 0])
    ratios = [1.2, 1.6, 1.6, 10.0, 5.0]
    expected = {
        "tokens": 5.0,
        "gate_frac": 1 / 5,
        "ppo_clip_frac": 0.0,
        "dual_clip_frac": 1 / 5,
        "clip_frac": 1 / 5,
        "drop_frac": 2 / 5,
        "cap_frac": 1 / 5,
        "ratio_mean": sum(ratios) / 5,
        "ratio_max": 10.0,
        "ratio_min": 1.2,
        "logprob_gap_mean": sum(math.log(r) for r in ratios) / 5,
    }
    assert m.keys() == expected.keys()
    for key, value in expected.items():
        assert m[key].item() == pytest.approx(value, rel=1e-6), key
        assert m[key].dim() == 0 and not m[key].requires_grad


def test_metrics_with_no_valid_tokens_are_zero() -> None:
    _, _, m = _loss_and_grad([0.5, 0.5], [0.1, 0.9], [1.0, -1.0], DPPOConfig(), mask=[0, 0])
    assert all(v.item() == 0.0 for v in m.values())


# ---------------------------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------------------------

VALUES = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
MASK = [1, 1, 0, 1, 0, 0]  # sequences of lengths 3, 1, 2; the last one fully masked
LENGTHS = [3, 1, 2]


@pytest.mark.parametrize(
    ("reduction", "value", "token_grads"),
    [
        ("token_mean", (1 + 2 + 4) / 3, [1 / 3, 1 / 3, 0, 1 / 3, 0, 0]),
        ("seq_mean", ((1 + 2) / 2 + 4 / 1 + 0) / 3, [1 / 6, 1 / 6, 0, 1 / 3, 0, 0]),
        ("drgrpo", (1 + 2 + 4) / (3 * 4), [1 / 12, 1 / 12, 0, 1 / 12, 0, 0]),
    ],
)
def test_reductions(reduction: str, value: float, token_grads: list[float]) -> None:
    x = torch.tensor(VALUES, dtype=F64, requires_grad=True)
    out = reduce_per_token(x, torch.tensor(MASK), LENGTHS, reduction=reduction, drgrpo_max_len=4)
    out.backward()
    assert out.item() == pytest.approx(value)
    assert x.grad.tolist() == pytest.approx(token_grads)


def test_dropped_tokens_stay_in_the_denominator() -> None:
    # Two valid tokens; the gate drops the second one: the kept token's loss is divided by 2, not 1.
    loss, _, _ = _loss_and_grad([0.6, 0.8], [0.5, 0.5], [1.0, 1.0], DPPOConfig())
    assert reduce_per_token(loss, torch.ones(2), [2], reduction="token_mean").item() == pytest.approx(
        -1.2 / 2
    )


def test_reduction_errors() -> None:
    x, m = torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError):
        reduce_per_token(x, m, [1, 1], reduction="token_mean")
    with pytest.raises(ValueError):
        reduce_per_token(x, m, [3], reduction="mean")
    with pytest.raises(ValueError):
        reduce_per_token(x, m, [3], reduction="drgrpo")
    with pytest.raises(ValueError):
        reduce_per_token(x.view(1, 3), m.view(1, 3), [3], reduction="seq_mean")
    with pytest.raises(ValueError):
        reduce_per_token(x, torch.ones(2), [3], reduction="seq_mean")


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"delta_low": -0.1},
        {"delta_high": math.nan},
        {"delta_high": True},
        {"delta_low": "0.2"},
        {"ratio_cap": 0.5},
        {"ratio_cap": math.inf},
        {"dual_clip": 1.0},
        {"eps_clip": 0.0},
        {"eps_clip": 1.0},
        {"eps_clip_high": 0.28},
        {"eps_clip": 0.2, "eps_clip_high": 0.0},
        {"reduction": "mean"},
        {"reduction": "drgrpo"},
        {"reduction": "drgrpo", "drgrpo_max_len": 0},
        {"reduction": "drgrpo", "drgrpo_max_len": 2.5},
    ],
)
def test_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DPPOConfig(**kwargs)


def test_config_defaults_and_eps_high_fallback() -> None:
    cfg = DPPOConfig()
    assert (cfg.delta_low, cfg.delta_high, cfg.ratio_cap, cfg.dual_clip) == (0.2, 0.2, 2.0, 3.0)
    assert cfg.eps_clip is None and cfg.eps_clip_high is None and cfg.reduction == "token_mean"
    assert DPPOConfig(eps_clip=0.2).eps_clip_high == 0.2
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.delta_low = 0.3  # type: ignore[misc]


def test_config_from_args() -> None:
    base = {"calculate_per_token_loss": False, "rollout_max_response_len": 512}
    assert config_from_args(SimpleNamespace(**base)) == DPPOConfig(reduction="seq_mean")
    assert config_from_args(SimpleNamespace(calculate_per_token_loss=True)) == DPPOConfig(
        reduction="token_mean"
    )
    cfg = config_from_args(
        SimpleNamespace(
            **base, dppo_delta_low=0.1, dppo_ratio_cap=None, dppo_eps_clip=0.2, dppo_reduction="drgrpo"
        )
    )
    assert cfg == DPPOConfig(
        delta_low=0.1, ratio_cap=None, eps_clip=0.2, eps_clip_high=0.2, reduction="drgrpo", drgrpo_max_len=512
    )
    assert (
        config_from_args(
            SimpleNamespace(**base, dppo_reduction="drgrpo", dppo_drgrpo_max_len=64)
        ).drgrpo_max_len
        == 64
    )


@pytest.mark.parametrize(
    "attrs",
    [
        {"dppo_reduction": "token_mean"},  # slime would average per sample
        {"calculate_per_token_loss": True, "dppo_reduction": "seq_mean"},
        {"calculate_per_token_loss": True, "dppo_reduction": "drgrpo", "dppo_drgrpo_max_len": 8},
        {"dppo_reduction": "drgrpo"},  # no --rollout-max-response-len to fall back on
        {"dppo_dual_clip": 0.5},
        {"use_kl_loss": True},
        {"use_tis": True},
        {"use_opsm": True},
        {"custom_pg_loss_reducer_function_path": "pkg.fn"},
    ],
)
def test_config_from_args_rejects(attrs: dict) -> None:
    with pytest.raises(ValueError):
        config_from_args(SimpleNamespace(**attrs))


# ---------------------------------------------------------------------------------------------
# log-probs from packed logits (slime's layout) and the slime-side reduction
# ---------------------------------------------------------------------------------------------

TOTALS, RESPONSES, VOCAB, ROWS = [4, 3], [2, 2], 7, 9  # 2 padding rows at the end


def _packed(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=gen, dtype=torch.float32)
    tokens = [torch.randint(0, VOCAB, (n,), generator=gen) for n in TOTALS]
    return logits, tokens


def test_response_logprobs_match_log_softmax_by_hand() -> None:
    logits, tokens = _packed()
    temp = 0.7
    got = response_logprobs(logits, tokens, TOTALS, RESPONSES, temp)
    offset = 0
    for toks, total, resp, lp in zip(tokens, TOTALS, RESPONSES, got, strict=True):
        expected = []
        for pos in range(total - resp, total):  # position inside the sample
            row = offset + pos - 1  # the previous position's logits predict this token
            expected.append(torch.log_softmax(logits[row] / temp, dim=-1)[toks[pos]])
        assert torch.allclose(lp, torch.stack(expected), atol=1e-6)
        offset += total
    batched = response_logprobs(logits.unsqueeze(0), tokens, TOTALS, RESPONSES, temp)
    assert all(torch.equal(a, b) for a, b in zip(got, batched, strict=True))


def test_response_logprobs_gradient_reaches_only_predicting_rows() -> None:
    logits, tokens = _packed(1)
    logits.requires_grad_(True)
    torch.cat(response_logprobs(logits, tokens, TOTALS, RESPONSES)).sum().backward()
    touched = {i for i in range(ROWS) if logits.grad[i].abs().sum() > 0}
    assert touched == {1, 2, 4, 5}  # sample 0: rows 1-2 predict tokens 2-3; sample 1: rows 4-5


def test_logits_gradient_end_to_end() -> None:
    """d loss/d z = −A·w/N · (onehot(y) − softmax(z/T)) / T on each predicting row."""
    logits, tokens = _packed(2)
    logits = logits.double().requires_grad_(True)
    temp = 0.8
    logp = torch.cat(response_logprobs(logits, tokens, TOTALS, RESPONSES, temp))
    worker_logp = logp.detach() + torch.tensor([0.05, -0.1, 0.0, 0.15], dtype=F64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=F64)
    mask = torch.tensor([1, 1, 0, 1])
    loss, _ = dppo_policy_loss(logp, worker_logp, adv, mask, DPPOConfig())
    reduce_per_token(loss, mask, RESPONSES, reduction="token_mean").backward()

    rows = [1, 2, 4, 5]
    targets = [tokens[0][2], tokens[0][3], tokens[1][1], tokens[1][2]]
    w = torch.exp(logp.detach() - worker_logp)  # all inside the trust region, below the cap
    for k, (row, y) in enumerate(zip(rows, targets, strict=True)):
        coef = -adv[k] * w[k] / 3 if mask[k] else 0.0
        expected = (
            coef
            * (torch.nn.functional.one_hot(y, VOCAB).double() - torch.softmax(logits[row] / temp, -1))
            / temp
        )
        assert torch.allclose(logits.grad[row], expected.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("totals", "responses", "rows", "temp"),
    [
        ([4, 3], [4, 2], ROWS, 1.0),  # no prompt token
        ([4, 3], [2, 2], 6, 1.0),  # too few rows
        ([4, 3], [2, 2], ROWS, 0.0),
    ],
)
def test_response_logprobs_errors(totals, responses, rows, temp) -> None:
    logits, tokens = _packed()
    with pytest.raises(ValueError):
        response_logprobs(logits[:rows], tokens, totals, responses, temp)


def _per_sample_mean(masks: list[torch.Tensor], denoms: list[float] | None = None):
    """slime's documented per-sample reducer at CP = 1: Σ_i Σ_t x·m / max(denom_i, 1)."""
    lengths = [len(m) for m in masks]
    denoms = denoms or [float(m.sum()) for m in masks]

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return sum(
            (xi * mi).sum() / max(d, 1.0) for xi, mi, d in zip(x.split(lengths), masks, denoms, strict=True)
        )

    return reduce


def test_slime_side_loss_and_metrics() -> None:
    masks = [torch.tensor([1, 1, 0]), torch.tensor([1, 1])]
    logp = _logs([0.6, 0.8, 0.3, 0.1, 0.05]).requires_grad_(True)
    per_sample_logp = list(logp.split([3, 2]))
    worker = list(_logs([0.5, 0.5, 0.9, 0.01, 0.01]).split([3, 2]))
    adv = list(torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0], dtype=F64).split([3, 2]))
    entropy = list(torch.tensor([1.0, 2.0, 9.0, 3.0, 5.0], dtype=F64).split([3, 2]))
    reducer = _per_sample_mean(masks)
    cfg = DPPOConfig(reduction="seq_mean")

    loss, metrics = slime_loss_and_metrics(
        config=cfg,
        log_probs=per_sample_logp,
        rollout_log_probs=worker,
        advantages=adv,
        loss_masks=masks,
        sum_of_sample_mean=reducer,
        pg_reducer=reducer,
        entropy=entropy,
        entropy_coef=0.01,
        pg_clip=(0.2, 0.28),
    )
    loss.backward()
    # Sample 0: pos_inside (w 1.2) and pos_outside (gated); sample 1: capped (w 2) and dual-clipped.
    pg = (-1.2 + 0) / 2 + (-2.0 + 0) / 2
    ent = (1 + 2) / 2 + (3 + 5) / 2
    assert loss.item() == pytest.approx(pg - 0.01 * ent)
    assert logp.grad.tolist() == pytest.approx([-1.2 / 2, 0, 0, -2.0 / 2, 0])
    # The slime reducer sums per-sample means, so it is B × the seq_mean of the pure core.
    flat_loss, _ = dppo_policy_loss(logp.detach(), torch.cat(worker), torch.cat(adv), torch.cat(masks), cfg)
    assert metrics["pg_loss"].item() == pytest.approx(
        2 * reduce_per_token(flat_loss, torch.cat(masks), [3, 2], reduction="seq_mean").item()
    )
    expected = {
        "loss": pg - 0.01 * ent,
        "pg_loss": pg,
        "entropy_loss": ent,
        "pg_clipfrac": 1 / 2 + 1 / 2,  # slime's PPO clip: r 1.6 and r 10 (A > 0); not r 1.2, not A < 0 at r 5
        "ppo_kl": -(math.log(1.2) + math.log(1.6)) / 2 - (math.log(10) + math.log(5)) / 2,
        "train_rollout_logprob_abs_diff": (math.log(1.2) + math.log(1.6)) / 2
        + (math.log(10) + math.log(5)) / 2,
        "dppo_gate_frac": 1 / 2,
        "dppo_clip_frac": 1 / 2,
        "dppo_drop_frac": 1 / 2 + 1 / 2,
        "dppo_cap_frac": 1 / 2,
        "dppo_ratio_mean": (1.2 + 1.6) / 2 + (10 + 5) / 2,
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key].item() == pytest.approx(value), key
        assert metrics[key].dim() == 0 and not metrics[key].requires_grad

    # Dr. GRPO: the same reducer with the constant denominator L = 8 for every sample.
    drgrpo = _per_sample_mean(masks, [8.0, 8.0])
    loss, metrics = slime_loss_and_metrics(
        config=DPPOConfig(reduction="drgrpo", drgrpo_max_len=8),
        log_probs=[x.detach() for x in per_sample_logp],
        rollout_log_probs=worker,
        advantages=adv,
        loss_masks=masks,
        sum_of_sample_mean=reducer,
        pg_reducer=drgrpo,
    )
    assert loss.item() == pytest.approx((-1.2 - 2.0) / 8)
    assert "entropy_loss" not in metrics


def test_slime_side_rejects_misaligned_inputs() -> None:
    with pytest.raises(ValueError):
        slime_loss_and_metrics(
            config=DPPOConfig(),
            log_probs=[torch.zeros(3)],
            rollout_log_probs=[torch.zeros(2)],
            advantages=[torch.zeros(3)],
            loss_masks=[torch.ones(3)],
            sum_of_sample_mean=torch.sum,
            pg_reducer=torch.sum,
        )


def test_pg_clipfrac_is_slimes_ppo_clip_and_the_gate_has_its_own_name() -> None:
    """slime's `compute_policy_loss`: clipfrac = pg_losses2 > pg_losses1, i.e. A > 0 and
    r > 1 + ε_high or A < 0 and r < 1 − ε, whatever drops the token; the DPPO drops are
    dppo_gate_frac / dppo_clip_frac / dppo_drop_frac."""
    # token: (p, μ, A)  gate δ 0.2, dual clip 3, pg_clip (0.3, 0.3)
    tokens = [
        (0.69, 0.9, -1.0),  # gated (μ − p 0.21), r 0.77 inside [0.7, 1.3]: not slime-clipped
        (0.5, 0.1, -1.0),  # dual-clipped (r 5), A < 0 and r > 1: not slime-clipped
        (0.55, 0.4, 1.0),  # kept, r 1.375 > 1.3: slime-clipped
        (0.3, 0.5, -1.0),  # kept? μ − p 0.2 is not > 0.2: kept; r 0.6 < 0.7: slime-clipped
    ]
    p, mu, a = (torch.tensor(col, dtype=F64) for col in zip(*tokens, strict=True))
    mask = torch.ones(4)
    reducer = _per_sample_mean([mask])
    _, metrics = slime_loss_and_metrics(
        config=DPPOConfig(reduction="seq_mean"), log_probs=[p.log()], rollout_log_probs=[mu.log()],
        advantages=[a], loss_masks=[mask], sum_of_sample_mean=reducer, pg_reducer=reducer, pg_clip=(0.3, 0.3),
    )
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 4)
    assert metrics["dppo_gate_frac"].item() == pytest.approx(1 / 4)
    assert metrics["dppo_clip_frac"].item() == pytest.approx(1 / 4)
    assert metrics["dppo_drop_frac"].item() == pytest.approx(2 / 4)
    # Without pg_clip: the loss's own PPO clip when set, else slime's default ε = 0.2.
    _, own = slime_loss_and_metrics(
        config=DPPOConfig(reduction="seq_mean", eps_clip=0.38), log_probs=[p.log()], rollout_log_probs=[mu.log()],
        advantages=[a], loss_masks=[mask], sum_of_sample_mean=reducer, pg_reducer=reducer,
    )
    assert own["pg_clipfrac"].item() == pytest.approx(1 / 4)  # r 0.6 < 0.62; r 1.375 < 1.38
    _, default = slime_loss_and_metrics(
        config=DPPOConfig(reduction="seq_mean"), log_probs=[p.log()], rollout_log_probs=[mu.log()],
        advantages=[a], loss_masks=[mask], sum_of_sample_mean=reducer, pg_reducer=reducer,
    )
    assert default["pg_clipfrac"].item() == pytest.approx(3 / 4)  # r 0.77 < 0.8 too


def test_the_adapter_measures_pg_clipfrac_with_slimes_eps_clip_flags() -> None:
    from types import SimpleNamespace

    from slime_stoa.trainer.slime.loss import slime_pg_clip

    assert slime_pg_clip(SimpleNamespace(eps_clip=0.2, eps_clip_high=0.28), DPPOConfig()) == (0.2, 0.28)
    assert slime_pg_clip(SimpleNamespace(eps_clip=0.1, eps_clip_high=None), DPPOConfig()) == (0.1, 0.1)
    assert slime_pg_clip(SimpleNamespace(), DPPOConfig()) is None  # slime's defaults
    assert slime_pg_clip(SimpleNamespace(eps_clip=0.2), DPPOConfig(eps_clip=0.3)) is None  # the loss's own
