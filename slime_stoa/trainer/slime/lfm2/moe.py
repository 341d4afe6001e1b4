"""LFM2-MoE's routing, exactly as transformers' `Lfm2MoeTopKRouter` computes it.

scores = sigmoid(router logits) (in the logits' dtype); the experts are the top k of
`scores + expert_bias` (the fp32 bias only selects: it promotes the sum to fp32); their weights
are the selected *scores*, normalised to sum 1 with an epsilon of 1e-6 when `norm_topk_prob`,
then times `routed_scaling_factor`. Megatron's own sigmoid routing differs in the epsilon (1e-20)
and in computing the sigmoid in fp32, so the provider's router uses this function instead.
"""

from __future__ import annotations

import torch

NORM_EPS = 1e-6


def lfm2_topk(
    logits: torch.Tensor, expert_bias: torch.Tensor | None, top_k: int, *, norm_topk_prob: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, k] in the logits' dtype, expert indices [tokens, k]) for `logits`
    [tokens, experts]; without a bias the top k of the scores themselves."""
    scores = logits.sigmoid()
    if expert_bias is not None:
        _, selected = torch.topk(scores + expert_bias, k=top_k, dim=-1)
        weights = torch.gather(scores, dim=1, index=selected).type_as(logits)
    else:
        weights, selected = torch.topk(scores, k=top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPS)
    return weights * scaling, selected


def dense_routing(weights: torch.Tensor, selected: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's router output from `lfm2_topk`'s: (probs [tokens, experts], zero where not
    routed; routing_map [tokens, experts] bool)."""
    shape = (weights.shape[0], num_experts)
    probs = torch.zeros(shape, dtype=weights.dtype, device=weights.device).scatter(1, selected, weights)
    routing_map = torch.zeros(shape, dtype=torch.bool, device=weights.device).scatter(1, selected, True)
    return probs, routing_map
