"""LFM2-MoE expert routing as transformers computes it, for the mlx-lm releases that route otherwise.

transformers' `Lfm2MoeSparseMoeBlock` (the trainer's recomputation) routes a token by
``s = sigmoid(gate(x))``: the top-k experts of ``s + expert_bias`` (the bias moves the selection
only), weighted by their unbiased ``s``, normalised to sum 1 (``norm_topk_prob``, with 1e-6 in the
denominator), times ``routed_scaling_factor``. mlx-lm 0.31.x (0.31.2 and 0.31.3, inside this
project's pin) takes a softmax of the gate instead, adds the bias to the scores it then weights
by, and drops ``routed_scaling_factor``: every MoE layer's output differs from the trainer's.
mlx-lm 0.32.0 and later route as transformers does.

`fix_moe_routing` probes the model's block class on random weights and, where it routes
otherwise, gives the model's blocks a subclass whose ``__call__`` is `routed_call` (this module
never imports mlx-lm: the class comes from the model). Dense LFM2 has no router; its short
convolutions need no fix in any supported release (tests/test_lfm2_worker.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

PROBE_ATOL = 1e-5  # float32, same arithmetic: an agreeing class matches to rounding (measured 0)


def routing(
    gate_logits: mx.array, expert_bias: mx.array | None, top_k: int, norm_topk_prob: bool, scale: float
) -> tuple[mx.array, mx.array]:
    """(expert indices, their weights) of each token, as transformers' `Lfm2MoeTopKRouter`."""
    weights = mx.sigmoid(gate_logits)
    chooser = weights if expert_bias is None else weights.astype(mx.float32) + expert_bias
    inds = mx.stop_gradient(mx.argpartition(chooser, kth=-top_k, axis=-1)[..., -top_k:])
    scores = mx.take_along_axis(weights, inds, axis=-1)
    if norm_topk_prob:
        scores = scores / (mx.sum(scores, axis=-1, keepdims=True) + 1e-6)
    return inds, scores * scale


def routed_call(block: Any, x: mx.array) -> mx.array:
    """An mlx-lm `Lfm2MoeSparseMoeBlock.__call__` that routes as `routing` does."""
    bias = block.expert_bias if getattr(block, "use_expert_bias", False) else None
    scale = float(getattr(block, "routed_scaling_factor", 1.0))
    inds, scores = routing(block.gate(x), bias, block.top_k, block.norm_topk_prob, scale)
    y = block.switch_mlp(x, inds)
    return (y * scores.astype(x.dtype)[..., None]).sum(axis=-2)


def _moe_blocks(model: Any) -> list[Any]:
    layers = getattr(model, "layers", None) or []
    return [ff for ff in (getattr(layer, "feed_forward", None) for layer in layers) if hasattr(ff, "switch_mlp")]


def routes_like_transformers(block_cls: type, args: Any, scale: float) -> bool:
    """Whether `block_cls` (built from the model's `args`) computes `routed_call` on random weights
    and input, its routed scaling factor included."""
    probe = block_cls(args)
    probe.set_dtype(mx.float32)
    k_bias, k_x = mx.random.split(mx.random.key(0))
    if getattr(probe, "use_expert_bias", False):
        probe.expert_bias = 0.1 * mx.random.normal(probe.expert_bias.shape, key=k_bias)
    x = mx.random.normal((1, 16, probe.gate.weight.shape[1]), key=k_x)
    if float(getattr(probe, "routed_scaling_factor", 1.0)) != scale:
        return False
    return bool(mx.allclose(probe(x), routed_call(probe, x), rtol=0, atol=PROBE_ATOL).item())


_FIXED: dict[type, type] = {}


def fix_moe_routing(model: Any, config: Mapping[str, Any]) -> bool:
    """For an ``lfm2_moe`` model whose mlx-lm block class routes otherwise than transformers, make
    every MoE block route as `routing` does, with `config`'s ``routed_scaling_factor``; whether it
    did. Other models are left as they are."""
    if config.get("model_type") != "lfm2_moe":
        return False
    blocks = _moe_blocks(model)
    if not blocks:
        return False
    scale = float(config.get("routed_scaling_factor", 1.0))
    cls = type(blocks[0])
    if cls in _FIXED.values() or routes_like_transformers(cls, model.args, scale):
        return False
    fixed = _FIXED.setdefault(cls, type(f"Routed{cls.__name__}", (cls,), {"__call__": routed_call}))
    for block in blocks:
        block.__class__ = fixed
        block.routed_scaling_factor = scale
    return True
