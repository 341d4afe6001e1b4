"""pass@k: the unbiased estimator of Chen et al. (2021), "Evaluating Large Language Models
Trained on Code", and its mean over prompts. Pure.

With n samples of a prompt, c of them correct, the chance that k samples drawn without
replacement hold at least one correct one is 1 - C(n-c, k) / C(n, k), computed as a product so
that large n stays exact in floating point.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

DEFAULT_PASS_THRESHOLD = 1.0  # a sample passes with full credit


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k); ValueError unless 0 <= c <= n and 1 <= k <= n."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)) or not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def passes(rewards: Iterable[float], threshold: float = DEFAULT_PASS_THRESHOLD) -> int:
    """How many samples pass: reward >= threshold."""
    return sum(1 for r in rewards if r >= threshold)


def mean_pass_at_k(per_prompt: Sequence[Sequence[float]], k: int, threshold: float = DEFAULT_PASS_THRESHOLD) -> float:
    """Mean pass@k over prompts, each given its sample rewards (at least k of them)."""
    if not per_prompt:
        raise ValueError("pass@k of no prompts")
    return sum(pass_at_k(len(r), passes(r, threshold), k) for r in per_prompt) / len(per_prompt)
