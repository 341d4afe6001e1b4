"""slime's custom loss for stoa: `--loss-type custom_loss --custom-loss-function-path slime_stoa.dppo_loss`.

The DPPO math is `slime_stoa.trainer.loss` (pure torch); this module reads its settings from
slime's `args` and calls slime's own log-prob and reduction helpers. It imports neither torch nor
slime until slime calls the loss, so `stoa preflight` can check the settings without them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from slime_stoa.trainer.loss_config import DPPOConfig

from .settings import DPPO_PREFIX, SLIME_FLAGS_READ, SettingsCache, StoaSettings, cached, leaves, read_section

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["SLIME_ARG_PREFIX", "config_from_args", "dppo_loss", "slime_pg_clip"]

SLIME_ARG_PREFIX = DPPO_PREFIX
# slime flags that only its built-in policy loss honours; with this loss they would do nothing.
_UNSUPPORTED_SLIME_FLAGS = ("use_kl_loss", "use_tis", "use_opsm", "custom_pg_loss_reducer_function_path")
_CACHE = SettingsCache()
# What the DPPO config is read from: its keys and the slime flags it depends on.
_READS = (
    *(leaf.key for leaf in leaves(StoaSettings) if leaf.path[0] == "dppo"), *SLIME_FLAGS_READ, *_UNSUPPORTED_SLIME_FLAGS,
)


def config_from_args(args: Any) -> DPPOConfig:
    """The DPPO config from slime's `args` (`StoaSettings.dppo`: the `dppo_*` keys of the
    `--custom-config-path` YAML), parsed once and reused while those settings stay the same.

    dppo_reduction defaults to what slime's own reducer gives: "token_mean" with
    `--calculate-per-token-loss`, "seq_mean" without. dppo_drgrpo_max_len defaults to
    `--rollout-max-response-len` when the reduction is "drgrpo".

    Raises ValueError for bad values, for a reduction that contradicts
    `--calculate-per-token-loss`, and for slime flags only its built-in policy loss honours
    (`--use-kl-loss`, `--use-tis`, `--use-opsm`, `--custom-pg-loss-reducer-function-path`),
    which this loss would otherwise ignore silently.
    """
    return cached(_CACHE, args, _READS, lambda: _config(args))


def _config(args: Any) -> DPPOConfig:
    for flag in _UNSUPPORTED_SLIME_FLAGS:
        if getattr(args, flag, None):
            raise ValueError(
                f"slime's --{flag.replace('_', '-')} is not supported by slime_stoa.dppo_loss"
            )
    per_token = bool(getattr(args, "calculate_per_token_loss", False))
    config: DPPOConfig = read_section(args, "dppo")
    if config.reduction == "token_mean" and not per_token:
        raise ValueError(
            'dppo_reduction "token_mean" needs --calculate-per-token-loss (slime then normalises '
            'by the step\'s token count); without it slime averages per sample: use "seq_mean"'
        )
    if config.reduction in ("seq_mean", "drgrpo") and per_token:
        raise ValueError(
            f'dppo_reduction "{config.reduction}" is a per-sample reduction; drop '
            '--calculate-per-token-loss or use "token_mean"'
        )
    return config


def slime_pg_clip(args: Any, config: DPPOConfig) -> tuple[float, float] | None:
    """The (ε, ε_high) slime's `pg_clipfrac` is measured with: None (the loss's own eps_clip)
    when dppo_eps_clip is set, else slime's `--eps-clip` / `--eps-clip-high` (None: its defaults)."""
    if config.eps_clip is not None:
        return None
    low = getattr(args, "eps_clip", None)
    if isinstance(low, bool) or not isinstance(low, int | float):
        return None
    high = getattr(args, "eps_clip_high", None)
    if isinstance(high, bool) or not isinstance(high, int | float):
        high = low
    return float(low), float(high)


def dppo_loss(
    args: Any, batch: dict[str, Any], logits: Tensor, sum_of_sample_mean: Callable
) -> tuple[Tensor, dict]:
    """slime custom loss: `--loss-type custom_loss --custom-loss-function-path slime_stoa.dppo_loss`.

    Called by slime per micro-batch as `fn(args, batch, logits, sum_of_sample_mean)`.

    - Current log-probs: slime's `get_log_probs_and_entropy` (the same call as its policy loss:
      logits / `--rollout-temperature`, logits row t predicting token t + 1, per-sample response
      slices, tensor- and context-parallel handling, top-p replay when `--rollout-top-p` < 1).
    - μ: `batch["rollout_log_probs"]` (the worker's, required); A: `batch["advantages"]`;
      masks: `batch["loss_masks"]`, sliced to this CP rank with slime's `slice_log_prob_with_cp`.
    - Reduction: slime's `sum_of_sample_mean`; for "drgrpo" the same reducer built by slime's
      `get_sum_of_sample_mean` with the constant denominator L for every sample.
    - The DPPO settings come from `args` (see `config_from_args`); `--entropy-coef` is honoured.
      slime flags only its built-in policy loss uses (KL loss, TIS, OPSM, custom pg reducer) are
      rejected rather than silently ignored. Pair with `--use-rollout-logprobs` so slime skips
      recomputing old log-probs this loss never reads.
    - Metrics: `slime_loss_and_metrics`; `pg_clipfrac` is slime's, measured with dppo_eps_clip
      when set, else slime's `--eps-clip` / `--eps-clip-high` (`slime_pg_clip`).
    """
    from slime.backends.megatron_utils.cp_utils import (
        get_sum_of_sample_mean,
        slice_log_prob_with_cp,
    )
    from slime.backends.megatron_utils.loss import (
        get_log_probs_and_entropy,
        get_rollout_top_p_logprob_kwargs,
    )

    from slime_stoa.trainer.loss import slime_loss_and_metrics

    config = config_from_args(args)
    if not batch.get("rollout_log_probs"):
        raise ValueError("slime_stoa.dppo_loss needs the worker log-probs (Sample.rollout_log_probs)")
    total_lengths = batch["total_lengths"]
    response_lengths = batch["response_lengths"]
    _, out = get_log_probs_and_entropy(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=total_lengths,
        response_lengths=response_lengths,
        with_entropy=True,
        **get_rollout_top_p_logprob_kwargs(args, batch),
    )
    local_masks = [
        slice_log_prob_with_cp(m, t, r)
        for m, t, r in zip(batch["loss_masks"], total_lengths, response_lengths, strict=True)
    ]
    pg_reducer = sum_of_sample_mean
    if config.reduction == "drgrpo":
        assert config.drgrpo_max_len is not None  # DPPOConfig requires it for "drgrpo"
        denom = logits.new_tensor(float(config.drgrpo_max_len))
        pg_reducer = get_sum_of_sample_mean(
            total_lengths, response_lengths, batch["loss_masks"], [denom] * len(total_lengths), False
        )
    loss, metrics = slime_loss_and_metrics(
        config=config,
        log_probs=out["log_probs"],
        rollout_log_probs=batch["rollout_log_probs"],
        advantages=batch["advantages"],
        loss_masks=local_masks,
        sum_of_sample_mean=sum_of_sample_mean,
        pg_reducer=pg_reducer,
        entropy=out["entropy"],
        entropy_coef=float(getattr(args, "entropy_coef", 0.0)),
        pg_clip=slime_pg_clip(args, config),
    )
    if sum(lp.numel() for lp in out["log_probs"]) == 0:
        loss = loss + 0 * logits.sum()  # keep the backward pass alive on an empty micro-batch
    return loss, metrics
