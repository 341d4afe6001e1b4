"""The DPPO loss settings, importable without torch (preflight checks them on a box without it).

The formula and the meaning of each field are in `slime_stoa.trainer.loss`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from slime_stoa.protocol.cli_fields import setting

Reduction = Literal["token_mean", "seq_mean", "drgrpo"]
REDUCTIONS: tuple[Reduction, ...] = get_args(Reduction)


def real_number(name: str, value: object) -> float:
    """`value` as a finite float, or ValueError (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class DPPOConfig:
    """Settings of the DPPO loss; see `slime_stoa.trainer.loss` for the formula."""

    delta_low: float = setting(
        "δ_low ≥ 0, the trust-region half-width below μ for negative advantages: a token with A < 0 is "
        "dropped once μ − p > δ_low. Any value ≥ 1 turns this side off.",
        0.2,
    )
    delta_high: float = setting(
        "δ_high ≥ 0, the same above μ for positive advantages: a token with A > 0 is dropped once p − μ > "
        "δ_high.",
        0.2,
    )
    ratio_cap: float | None = setting(
        "C ≥ 1 or None. The importance weight of a kept token is min(p/μ, C); None means uncapped (the "
        "raw ratio, unbounded with stale data). C < 1 would down-weight on-policy tokens and is rejected.",
        2.0,
    )
    dual_clip: float | None = setting(
        "c > 1 or None (off). Tokens with A < 0 and p/μ > c are dropped (dual-clip PPO's lower bound c·A "
        "on the objective).",
        3.0,
    )
    eps_clip: float | None = setting(
        "ε_low in (0, 1) or None (off, the default). If set, PPO's ratio clip also gates: A < 0 tokens "
        "with p/μ < 1 − ε_low and A > 0 tokens with p/μ > 1 + ε_high are dropped.",
        None,
    )
    eps_clip_high: float | None = setting(
        "ε_high > 0 or None (then equal to eps_clip, as in slime). Needs eps_clip. 0.28 gives DAPO's "
        "\"clip higher\".",
        None,
    )
    reduction: Reduction = setting('"token_mean", "seq_mean" or "drgrpo"; see `reduce_per_token`.', "token_mean")
    drgrpo_max_len: int | None = setting(
        "The constant L > 0 dividing every sequence's token sum under \"drgrpo\" (normally the generation "
        "max length); required for \"drgrpo\", unused otherwise.",
        None,
    )

    def __post_init__(self) -> None:
        for name in ("delta_low", "delta_high"):
            if real_number(name, getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.ratio_cap is not None and real_number("ratio_cap", self.ratio_cap) < 1:
            raise ValueError(f"ratio_cap must be >= 1 or None, got {self.ratio_cap!r}")
        if self.dual_clip is not None and real_number("dual_clip", self.dual_clip) <= 1:
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual_clip!r}")
        if self.eps_clip is None:
            if self.eps_clip_high is not None:
                raise ValueError("eps_clip_high needs eps_clip (the PPO ratio clip is off)")
        else:
            if not 0 < real_number("eps_clip", self.eps_clip) < 1:
                raise ValueError(f"eps_clip must be in (0, 1) or None, got {self.eps_clip!r}")
            if self.eps_clip_high is None:
                object.__setattr__(self, "eps_clip_high", self.eps_clip)
            elif real_number("eps_clip_high", self.eps_clip_high) <= 0:
                raise ValueError(f"eps_clip_high must be > 0, got {self.eps_clip_high!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.drgrpo_max_len is not None and (
            isinstance(self.drgrpo_max_len, bool)
            or not isinstance(self.drgrpo_max_len, int)
            or self.drgrpo_max_len <= 0
        ):
            raise ValueError(f"drgrpo_max_len must be a positive int, got {self.drgrpo_max_len!r}")
        if self.reduction == "drgrpo" and self.drgrpo_max_len is None:
            raise ValueError('reduction "drgrpo" needs drgrpo_max_len (the constant length L)')
