"""Mixture-of-experts layers on MLX's CPU backend, whose `gather_mm` computes only in float32.

mlx-lm's `SwitchLinear` (the stacked experts of LFM2-MoE, Qwen-MoE, ...) multiplies with
``mx.gather_mm``; on the CPU backend (a Linux machine, CI) that kernel refuses bfloat16
("[GatherMM::eval] Currently only supports float32"), so a bf16 worker could not run an MoE
model there at all. `fix_cpu_expert_matmul` gives such a model's unquantized expert layers a
subclass whose call widens the input and the experts' weights to float32 (exact for bf16),
multiplies, and rounds the result back to the input's dtype. The experts' float32 weights are
the layer's `macd.cpu_compute` copy, made once and kept equal to the bf16 weights the way every
float32 copy is (widening a whole expert stack at every call would cost more than the matmul).
It does nothing on a GPU device, where the kernel takes bf16 (an Apple silicon Mac), and leaves
quantized layers alone.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .cpu_compute import wide_weight


def float32_switch_call(layer: Any, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
    """`SwitchLinear.__call__` computed in float32, returned in `x`'s dtype."""
    y = mx.gather_mm(
        x.astype(mx.float32),
        wide_weight(layer).swapaxes(-1, -2),
        rhs_indices=indices,
        sorted_indices=sorted_indices,
    )
    if "bias" in layer:
        y = y + mx.expand_dims(layer["bias"][indices].astype(mx.float32), -2)
    return y.astype(x.dtype)


_FIXED: dict[type, type] = {}


def fix_cpu_expert_matmul(model: Any) -> bool:
    """On the CPU device, make every unquantized mlx-lm `SwitchLinear` of `model` compute in
    float32 (module docstring); whether any was changed."""
    if mx.default_device().type != mx.cpu:
        return False
    changed = False
    for _, module in model.named_modules():
        cls = type(module)
        is_switch = any(c.__name__ == "SwitchLinear" for c in cls.__mro__)  # mlx-lm's, not its quantized one
        if is_switch and cls not in _FIXED.values():
            module.__class__ = _FIXED.setdefault(cls, type(f"Float32{cls.__name__}", (cls,), {"__call__": float32_switch_call}))
            changed = True
    return changed
