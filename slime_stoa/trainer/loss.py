r"""stoa's off-policy policy loss: a DPPO trust-region gate, a capped importance weight, dual clip.

Rollouts come from Mac workers that may be several weight versions behind the trainer, so every
token is off-policy. Per response token let

    μ = exp(worker_logp)   the worker's probability of the sampled token (behaviour policy),
    p = exp(logp)          the trainer's current probability of the same token,
    r = p / μ              the importance ratio,
    A                      the token's advantage.

Both log-probs are of the temperature-scaled distribution (logits / T, T = the sampling
temperature, top_p = 1), so at T ≠ 1 the trainer must divide its logits by T exactly as the worker
did (`response_logprobs` and slime's `get_log_probs_and_entropy` both do).

The token is **dropped** (zero gradient) when any of these holds:

1. DPPO trust region, binary total-variation form (arXiv 2602.04879). Only the sampled token's
   probability is tracked, so the TV distance between the two binary distributions
   (token, not token) is |p − μ|. A step may move p *in the direction A asks for* only while it
   stays inside the region:

       A > 0 and p − μ > δ_high      (already pushed up too far)
       A < 0 and μ − p > δ_low       (already pushed down too far)

   Moves against A's direction are never blocked: they pull p back toward μ.
2. The PPO ratio clip, only if `eps_clip` is set (off by default: DPPO's gate *replaces* it;
   the ratio clip over-restricts low-probability tokens, whose r moves a lot while p barely
   moves, and under-restricts high-probability ones):

       A > 0 and r > 1 + ε_high        A < 0 and r < 1 − ε_low

   These are exactly the tokens where PPO's clipped term wins and its gradient vanishes; when
   both are on, a token must pass both (the intersection of the two trust regions).
3. Dual clip (Ye et al. 2020, "dual-clip PPO"), if `dual_clip` c is set: for A < 0 the
   per-token objective A·r is bounded below by c·A. Once r > c the bound is active, the objective
   is the constant c·A and the gradient is zero:

       A < 0 and r > c

   The test uses the raw r (as dual-clip PPO does), not the capped weight below, so c acts as a
   rejection threshold for negative-advantage tokens the trainer now likes far more than the
   worker did, while C only truncates.

Every other (kept) token gets the truncated-importance-sampling policy gradient

    ∇J = A · sg(w) · ∇log p,        w = min(r, C)    (w = r when ratio_cap is None)

with sg = stop-gradient. The per-token loss is

    ℓ = −A · sg(w) · exp(logp − sg(logp))   on kept tokens,     ℓ = 0 on dropped tokens and padding,

whose value is −A·w (the negated truncated surrogate) and whose gradient is −A·w·∇logp.
The gate and the weight use detached values: the trust region decides *whether* a token moves,
never through a gradient.

Special cases (checked in the tests):
- δ ≥ 1 disables the gate (|p − μ| ≤ 1 always), so with δ_low = δ_high = 1, ratio_cap = None,
  eps_clip = ε and dual_clip = c the gradient equals that of dual-clip PPO
  min(max(−rA, −clip(r, 1−ε_low, 1+ε_high)·A), −cA) (A < 0) / max(...) (A ≥ 0), token by token.
- On fresh data (p = μ) every token is kept with w = 1: the plain policy gradient A·∇log p.

Reductions (`reduce_per_token`), over sequences i = 1..B with valid-token masks m_i:

    token_mean:  Σ_i Σ_t m·ℓ / Σ_i Σ_t m                 (every valid token weighs the same)
    seq_mean:    (1/B) Σ_i (Σ_t m·ℓ / max(Σ_t m, 1))     (every sequence weighs the same)
    drgrpo:      (1/B) Σ_i Σ_t m·ℓ / L                   (Dr. GRPO: constant L, e.g. the
                                                          generation max length; no per-sequence
                                                          length normalisation)

Dropped tokens stay in the denominators (they contribute zero, they are not removed), so the gate
scales the update down instead of re-normalising the surviving tokens up.

Defaults: δ_low = δ_high = 0.2 (prime-rl's default for this gate); C = 2 (slime's `--tis-clip`
default for truncated importance sampling: the largest per-token weight is twice the on-policy
one, so a few rare tokens from a stale worker cannot dominate a batch; the trust region, not the
weight, controls the step size; with the gate on, r > 2 on a kept A > 0 token needs μ < δ, i.e.
only rare tokens are ever capped); c = 3 (the usual dual-clip PPO setting, arXiv 1912.09729, e.g.
verl's `clip_ratio_c` default); no PPO ratio clip.

The config dataclass lives in the torch-free `slime_stoa.trainer.loss_config`. The slime adapter
`dppo_loss` (`--loss-type custom_loss --custom-loss-function-path slime_stoa.dppo_loss`), in
`slime_stoa.trainer.slime.loss`, computes the current log-probs with slime's own helper and
reduces with slime's `sum_of_sample_mean`; see its docstring for the settings it reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .loss_config import REDUCTIONS, DPPOConfig, Reduction, real_number

__all__ = [
    "REDUCTIONS",
    "DPPOConfig",
    "DPPOTerms",
    "Reduction",
    "dppo_policy_loss",
    "dppo_terms",
    "reduce_per_token",
    "response_logprobs",
    "slime_loss_and_metrics",
]

SLIME_EPS_CLIP = (0.2, 0.2)  # slime's --eps-clip default; --eps-clip-high defaults to it


@dataclass(frozen=True)
class DPPOTerms:
    """Per-token pieces of the loss, all of the input shape.

    `loss` carries the gradient; everything else is detached. The boolean fields are False
    outside the mask; the attribution is exclusive: a token the trust region drops counts in
    `gated` only, one the PPO or dual clip drops in `ppo_clipped` / `dual_clipped`.
    """

    loss: Tensor  # ℓ: −A·sg(w)·exp(logp − sg(logp)) on kept tokens, 0 elsewhere
    ratio: Tensor  # r = p/μ (1 outside the mask)
    weight: Tensor  # w = min(r, C) on kept tokens, 0 elsewhere
    valid: Tensor  # the mask, as bool
    kept: Tensor  # valid and not dropped
    gated: Tensor  # dropped by the DPPO trust region
    ppo_clipped: Tensor  # dropped by the PPO ratio clip (not already gated)
    dual_clipped: Tensor  # dropped by the dual clip (not already gated)
    capped: Tensor  # kept with r > C (weight truncated)


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shapes differ: {shapes}")


def dppo_terms(
    logp: Tensor, worker_logp: Tensor, advantages: Tensor, mask: Tensor, config: DPPOConfig
) -> DPPOTerms:
    """The per-token DPPO loss and its gate/clip/cap decisions (see the module docstring).

    Args:
        logp: trainer log-probs of the sampled tokens, with gradient; any shape.
        worker_logp: the worker's log-probs of the same tokens (detached), same shape.
        advantages: per-token advantages A (detached), same shape.
        mask: nonzero = a trained token; padding may hold any values, even NaN, and contributes
            neither loss nor gradient.
    """
    _check_same_shape(logp=logp, worker_logp=worker_logp, advantages=advantages, mask=mask)
    valid = mask != 0
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Sanitise padding first so no NaN/inf there can reach a product in forward or backward.
    logp = torch.where(valid, logp, zero)
    lp = logp.detach()
    wlp = torch.where(valid, worker_logp.detach().to(lp.dtype), zero)
    adv = torch.where(valid, advantages.detach().to(lp.dtype), zero)

    ratio = torch.exp(lp - wlp)
    p_minus_mu = torch.exp(lp) - torch.exp(wlp)
    pos = valid & (adv > 0)
    neg = valid & (adv < 0)

    gated = (pos & (p_minus_mu > config.delta_high)) | (neg & (-p_minus_mu > config.delta_low))
    ppo_clipped = torch.zeros_like(valid)
    if config.eps_clip is not None:
        assert config.eps_clip_high is not None  # resolved in DPPOConfig.__post_init__
        ppo_clipped = (pos & (ratio > 1 + config.eps_clip_high)) | (neg & (ratio < 1 - config.eps_clip))
        ppo_clipped &= ~gated
    dual_clipped = torch.zeros_like(valid)
    if config.dual_clip is not None:
        dual_clipped = neg & (ratio > config.dual_clip) & ~gated
    kept = valid & ~(gated | ppo_clipped | dual_clipped)

    capped_ratio = ratio if config.ratio_cap is None else ratio.clamp(max=config.ratio_cap)
    weight = torch.where(kept, capped_ratio, zero)
    capped = kept & (ratio > config.ratio_cap) if config.ratio_cap is not None else torch.zeros_like(valid)
    # exp(logp − sg(logp)) is 1 in value and has gradient ∇logp.
    loss = -adv * weight * torch.exp(logp - lp)
    return DPPOTerms(
        loss=loss,
        ratio=torch.where(valid, ratio, torch.ones_like(ratio)),
        weight=weight,
        valid=valid,
        kept=kept,
        gated=gated,
        ppo_clipped=ppo_clipped,
        dual_clipped=dual_clipped,
        capped=capped,
    )


def _masked_mean(x: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, x.to(torch.float32), 0.0).sum() / valid.sum().clamp(min=1)


def dppo_policy_loss(
    logp: Tensor, worker_logp: Tensor, advantages: Tensor, mask: Tensor, config: DPPOConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token DPPO loss (zero on padding and dropped tokens) and detached scalar metrics.

    Metrics, over the valid (mask ≠ 0) tokens; all 0 when there are none:
        tokens: how many valid tokens.
        gate_frac: fraction dropped by the DPPO trust region (the gate mask rate).
        ppo_clip_frac / dual_clip_frac: fractions dropped by the PPO ratio clip / the dual clip
            (tokens the gate kept; 0 when that clip is off). clip_frac is their sum.
        drop_frac: fraction with zero gradient for any reason (gate_frac + clip_frac).
        cap_frac: fraction kept with their weight truncated at ratio_cap.
        ratio_mean / ratio_max / ratio_min: of r = p/μ.
        logprob_gap_mean: mean |logp − worker_logp| (trainer-vs-worker mismatch plus staleness).
    Reduce the loss with `reduce_per_token`.
    """
    t = dppo_terms(logp, worker_logp, advantages, mask, config)
    v = t.valid
    n = v.sum()
    gap = (logp.detach() - worker_logp.detach().to(logp.dtype)).abs()
    has = n > 0
    metrics = {
        "tokens": n.to(torch.float32),
        "gate_frac": _masked_mean(t.gated, v),
        "ppo_clip_frac": _masked_mean(t.ppo_clipped, v),
        "dual_clip_frac": _masked_mean(t.dual_clipped, v),
        "clip_frac": _masked_mean(t.ppo_clipped | t.dual_clipped, v),
        "drop_frac": _masked_mean(v & ~t.kept, v),
        "cap_frac": _masked_mean(t.capped, v),
        "ratio_mean": _masked_mean(t.ratio, v),
        "ratio_max": torch.where(v, t.ratio, -math.inf).max() if has else t.ratio.new_zeros(()),
        "ratio_min": torch.where(v, t.ratio, math.inf).min() if has else t.ratio.new_zeros(()),
        "logprob_gap_mean": _masked_mean(gap, v),
    }
    return t.loss, {k: m.detach().to(torch.float32) for k, m in metrics.items()}


def reduce_per_token(
    values: Tensor,
    mask: Tensor,
    lengths: Sequence[int],
    *,
    reduction: Reduction,
    drgrpo_max_len: int | None = None,
) -> Tensor:
    """Reduce flat per-token values of B packed sequences to a scalar.

    `values` and `mask` are 1-D of length sum(lengths); sequence i is the i-th run of
    lengths[i] entries. Fully masked sequences still count in B (as in slime).

        token_mean:  Σ m·x / max(Σ m, 1)
        seq_mean:    (1/B) Σ_i Σ_t m·x / max(Σ_t m, 1)
        drgrpo:      (1/B) Σ_i Σ_t m·x / L,   L = drgrpo_max_len
    """
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D (packed sequences), got shape {tuple(values.shape)}")
    _check_same_shape(values=values, mask=mask)
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths) or sum(lengths) != values.numel():
        raise ValueError(f"lengths {lengths} do not partition {values.numel()} tokens")
    if not lengths:
        raise ValueError("need at least one sequence")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    valid = mask != 0
    x = torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if reduction == "token_mean":
        return x.sum() / valid.sum().clamp(min=1)
    num_seqs = len(lengths)
    if reduction == "drgrpo":
        if drgrpo_max_len is None or drgrpo_max_len <= 0:
            raise ValueError(f"drgrpo needs a positive drgrpo_max_len, got {drgrpo_max_len!r}")
        return x.sum() / (num_seqs * drgrpo_max_len)
    sums = torch.stack([s.sum() for s in x.split(lengths)])
    counts = torch.stack([c.sum() for c in valid.split(lengths)]).clamp(min=1)
    return (sums / counts).sum() / num_seqs


def response_logprobs(
    logits: Tensor,
    tokens: Sequence[Tensor],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    temperature: float = 1.0,
) -> list[Tensor]:
    """Log-probs of each sample's response tokens from packed logits (slime's layout, CP = 1).

    Samples are packed back to back: sample i covers rows [o_i, o_i + total_i) of `logits`
    ([T, V] or [1, T, V]; rows past the last sample are padding). Row t holds the logits that
    predict token t + 1, so response token j of sample i (absolute position
    s = o_i + total_i − R_i + j) gets

        log_softmax(logits[s − 1] / temperature)[tokens_i[total_i − R_i + j]].

    Returns one 1-D tensor of R_i log-probs per sample, differentiable w.r.t. `logits`.
    """
    if logits.dim() == 3:
        if logits.size(0) != 1:
            raise ValueError(f"packed logits must have batch size 1, got shape {tuple(logits.shape)}")
        logits = logits[0]
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V] or [1, T, V], got shape {tuple(logits.shape)}")
    if not len(tokens) == len(total_lengths) == len(response_lengths):
        raise ValueError("tokens, total_lengths and response_lengths differ in length")
    temperature = real_number("temperature", temperature)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if sum(total_lengths) > logits.size(0):
        raise ValueError(f"samples need {sum(total_lengths)} rows, logits have {logits.size(0)}")
    out: list[Tensor] = []
    end = 0
    for toks, total, resp in zip(tokens, total_lengths, response_lengths, strict=True):
        if len(toks) != total:
            raise ValueError(f"a sample has {len(toks)} tokens but total_length {total}")
        if not 0 <= resp < total:
            raise ValueError(f"response_length {resp} needs a prompt: 0 <= it < total_length {total}")
        end += total
        rows = logits[end - resp - 1 : end - 1]
        rows = rows.to(torch.promote_types(rows.dtype, torch.float32))  # at least float32
        if temperature != 1.0:
            rows = rows / temperature
        targets = toks[total - resp :].to(device=rows.device, dtype=torch.long)
        out.append(rows.log_softmax(dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    return out


def slime_loss_and_metrics(
    *,
    config: DPPOConfig,
    log_probs: Sequence[Tensor],
    rollout_log_probs: Sequence[Tensor],
    advantages: Sequence[Tensor],
    loss_masks: Sequence[Tensor],
    sum_of_sample_mean: Callable[[Tensor], Tensor],
    pg_reducer: Callable[[Tensor], Tensor],
    entropy: Sequence[Tensor] | None = None,
    entropy_coef: float = 0.0,
    pg_clip: tuple[float, float] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The slime-independent part of `dppo_loss`: per-sample lists in, (loss, metrics) out.

    Per-sample tensors are the ones slime hands a loss (CP-local slices, response tokens only;
    `loss_masks` sliced the same way). `sum_of_sample_mean` is slime's reducer (the per-sample
    mean, or the token sum under --calculate-per-token-loss) and reduces the metrics;
    `pg_reducer` reduces the policy loss (the same reducer, or the Dr. GRPO one).

        loss = pg_reducer(ℓ) − entropy_coef · sum_of_sample_mean(entropy)

    Metrics (detached 0-dim tensors, reduced like slime's own so slime can all-reduce them):
    loss, pg_loss, entropy_loss (if entropy is given), pg_clipfrac, ppo_kl (mean worker_logp −
    logp, slime's definition with --use-rollout-logprobs), train_rollout_logprob_abs_diff (mean
    |logp − worker_logp|), dppo_gate_frac (dropped by the trust region), dppo_clip_frac (dropped
    by the PPO or dual clip, not gated), dppo_drop_frac (zero gradient for any reason),
    dppo_cap_frac, dppo_ratio_mean. Max/min are left out: slime sums metrics across ranks and
    micro-batches.

    pg_clipfrac is slime's (`compute_policy_loss` in slime/utils/ppo_utils.py): the fraction of
    tokens where PPO's clipped term is active, A > 0 and r > 1 + ε_high or A < 0 and r < 1 − ε,
    whatever the gate decided. `pg_clip` = (ε, ε_high); None: the config's eps_clip when set,
    else slime's defaults (0.2, 0.2). With the PPO clip off it is the share of tokens slime's
    clip would have cut, comparable with a run of slime's own loss.
    """
    logp = torch.cat(list(log_probs))
    worker_logp = torch.cat(list(rollout_log_probs)).to(device=logp.device)
    adv = torch.cat(list(advantages)).to(device=logp.device)
    mask = torch.cat(list(loss_masks)).to(device=logp.device)
    if not worker_logp.shape == adv.shape == mask.shape == logp.shape:
        raise ValueError(
            f"token counts differ: log_probs {logp.numel()}, rollout_log_probs {worker_logp.numel()}, "
            f"advantages {adv.numel()}, loss_masks {mask.numel()}"
        )
    t = dppo_terms(logp, worker_logp, adv, mask, config)
    pg_loss = pg_reducer(t.loss)
    loss = pg_loss
    metrics: dict[str, Tensor] = {}
    if entropy is not None:
        entropy_loss = sum_of_sample_mean(torch.cat(list(entropy)))
        loss = loss - entropy_coef * entropy_loss
        metrics["entropy_loss"] = entropy_loss
    lp = logp.detach()
    wlp = torch.where(t.valid, worker_logp.to(lp.dtype), lp)  # padding: gap 0, never NaN
    if pg_clip is None:
        pg_clip = (config.eps_clip, config.eps_clip_high) if config.eps_clip is not None else SLIME_EPS_CLIP  # type: ignore[assignment]
    assert pg_clip is not None
    eps_low, eps_high = (real_number("pg_clip", e) for e in pg_clip)
    adv_v = torch.where(t.valid, adv.detach().to(lp.dtype), 0)
    ppo_active = t.valid & (
        ((adv_v > 0) & (t.ratio > 1 + eps_high)) | ((adv_v < 0) & (t.ratio < 1 - eps_low))
    )
    per_token = {
        "pg_clipfrac": ppo_active,
        "ppo_kl": wlp - lp,
        "train_rollout_logprob_abs_diff": (lp - wlp).abs(),
        "dppo_gate_frac": t.gated,
        "dppo_clip_frac": t.ppo_clipped | t.dual_clipped,
        "dppo_drop_frac": t.valid & ~t.kept,
        "dppo_cap_frac": t.capped,
        "dppo_ratio_mean": t.ratio,
    }
    metrics.update({k: sum_of_sample_mean(v.to(lp.dtype)) for k, v in per_token.items()})
    metrics = {"loss": loss, "pg_loss": pg_loss, **metrics}
    return loss, {k: torch.as_tensor(v).detach().clone() for k, v in metrics.items()}
