"""LFM2's gated short convolution as the token mixer of a Megatron transformer layer.

transformers' `Lfm2ShortConv` / `Lfm2MoeShortConv`: `B, C, x = in_proj(h)` (three blocks of
`hidden_size` channels), `y = C * causal_depthwise_conv(B * x)`, `out_proj(y)`; the convolution
sees only earlier tokens of the same sequence. Megatron packs a micro-batch's sequences into one
row (`packed_seq_params.cu_seqlens_q`): `position_in_sequence` gives each token its index in its own
sequence, and the convolution drops the taps that would reach into the previous sequence, so a
packed row computes exactly what each sequence alone does.

The weights are replicated over tensor-parallel ranks (TP must be 1 for these layers: `spec`
refuses more) and carry Megatron's `tensor_model_parallel = False` attributes, which slime's
weight gather requires of every parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def position_in_sequence(total: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Each of `total` packed tokens' index within its sequence ([total], long); one sequence
    when `cu_seqlens` is None. Tokens past the last boundary count on from it (padding)."""
    idx = torch.arange(total, device=device)
    if cu_seqlens is None:
        return idx
    starts = cu_seqlens[:-1].to(device=device, dtype=torch.long)
    seq = torch.searchsorted(starts, idx, right=True) - 1
    return idx - starts[seq.clamp(min=0)]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution over time of `x` [batch, time, channels] with `weight`
    [channels, kernel] (transformers' `conv.weight` squeezed): out[t] = sum_j weight[:, K-1-j] *
    x[t-j], j < K, taking only taps with j <= positions[t] (None: the whole row is one sequence)."""
    kernel = weight.shape[-1]
    out = x * weight[:, kernel - 1]
    for j in range(1, kernel):
        shifted = F.pad(x[:, :-j], (0, 0, j, 0)) if j < x.shape[1] else torch.zeros_like(x)
        tap = shifted * weight[:, kernel - 1 - j]
        if positions is not None:
            tap = tap * (positions >= j).to(x.dtype)[None, :, None]
        out = out + tap
    return out


def short_conv(
    h: torch.Tensor, in_proj: torch.Tensor, conv: torch.Tensor, out_proj: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated short-convolution block on `h` [batch, time, hidden] with transformers' weights
    (`in_proj` [3h, h], `conv` [h, 1, k], `out_proj` [h, h]; no biases, as LFM2 has none)."""
    b, c, x = F.linear(h, in_proj).chunk(3, dim=-1)
    y = c * causal_conv(b * x, conv.reshape(conv.shape[0], -1), positions)
    return F.linear(y, out_proj)


def _replicated(p: nn.Parameter) -> nn.Parameter:
    p.tensor_model_parallel = False  # type: ignore[attr-defined]
    p.partition_dim = -1  # type: ignore[attr-defined]
    p.partition_stride = 1  # type: ignore[attr-defined]
    return p


class ShortConvMixer(nn.Module):
    """The conv layers' `self_attention` submodule: Megatron's [time, batch, hidden] in, (output,
    bias=None) out, like an attention module. Parameters `in_proj.weight`, `conv.weight`,
    `out_proj.weight` (the HF shapes)."""

    def __init__(self, config: Any, layer_number: int, conv_kernel: int, **_: Any) -> None:
        super().__init__()
        h = config.hidden_size
        device = "cpu" if getattr(config, "use_cpu_initialization", True) or not torch.cuda.is_available() else "cuda"
        dtype = getattr(config, "params_dtype", torch.float32)
        std = float(getattr(config, "init_method_std", 0.02))

        def make(*shape: int) -> nn.Parameter:
            return _replicated(nn.Parameter(torch.empty(*shape, device=device, dtype=dtype).normal_(0.0, std)))

        self.config = config
        self.layer_number = layer_number
        self.in_proj = nn.Module()
        self.in_proj.weight = make(3 * h, h)
        self.conv = nn.Module()
        self.conv.weight = make(h, 1, conv_kernel)
        self.out_proj = nn.Module()
        self.out_proj.weight = make(h, h)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, *,
                packed_seq_params: Any = None, **_: Any) -> tuple[torch.Tensor, None]:
        h = hidden_states.transpose(0, 1)  # [batch, time, hidden]
        positions = None
        if packed_seq_params is not None:
            if h.shape[0] != 1:
                raise ValueError("packed sequences must come as one row (batch 1)")
            cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
            cu = cu if cu is not None else packed_seq_params.cu_seqlens_q
            positions = position_in_sequence(h.shape[1], cu, h.device)
        in_proj, conv, out_proj = (m.weight for m in (self.in_proj, self.conv, self.out_proj))
        assert isinstance(in_proj, torch.Tensor) and isinstance(conv, torch.Tensor) and isinstance(out_proj, torch.Tensor)
        out = short_conv(h, in_proj, conv, out_proj, positions)
        return out.transpose(0, 1).contiguous(), None
