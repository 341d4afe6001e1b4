"""What a worker's memory holds for a model, and whether that fits a Mac: a pure function of the
model's config.json, the run's group size and lengths.

Device (`DEVICES`): what a worker holds depends on where MLX computes.

- ``gpu`` (a Mac's Metal GPU; MLX's CUDA device likewise): the terms below as they are.
- ``cpu`` (MLX's CPU device: Linux, CI; `macd.cpu_compute`): the bf16 plane's matmul layers
  (every Linear, the experts, and a tied embedding used as the output head; not an untied input
  embedding, whose lookup widens only the rows it gathers) keep exact float32 copies of their bf16
  weights beside them, 4 more bytes per such weight (~6 in all); a quantized plane keeps its codes
  and, for the same layers, float32 copies of their dequantized weights (`macd.cpu_compute`: a
  fast BLAS multiply instead of MLX's quantized loop), 4 more bytes per such weight too (~5 for
  int8, ~4.6 for int4). Every plane's activations are float32 from the
  embedding on, so its KV cache, conv state and prefill logits are float32: 4 bytes per value.
  (Without a fast BLAS no plane holds copies: the plan is then an upper bound.) Nothing is wired on the CPU: the usable memory is the machine's RAM.

Terms (bytes), as on the GPU:

- weights, per plane (`macd.weights`): ``bf16`` 2 per parameter (the master is the model);
  a quantized plane only where the run manifest names it (the trainer takes records of no
  other): where the run publishes it (`published`, `RunManifest.planes`) held alone, no master:
  ``int8`` 1 + 4/64 per quantizable parameter (Linear/Embedding/expert weights whose input size
  is a multiple of 64: 8-bit codes, a bf16 scale and bias per group of 64), ``int4`` 0.5 + 4/64,
  2 per other parameter (norms, conv kernels, biases); int8 as the run's own plane unpublished
  (`run_plane`), quantized here: the bf16 master (2 per parameter) plus that copy.
- KV cache, attention layers only: K and V, ``num_key_value_heads * head_dim`` bf16 values each,
  per token of every live sequence, allocated in steps of 256 tokens (mlx-lm's `KVCache.step`);
  a batch's cache is as long as its longest sequence (left padding), so every sequence is
  counted at prompt + response length.
- conv state, conv layers only: ``conv_L_cache - 1`` positions of ``hidden_size`` bf16 values
  per sequence, whatever its length.
- activations: the logits of one prefill chunk (``prefill_step * vocab`` bf16, mlx-lm computes
  every position's) and of one decode step (float32, tempered), plus one chunk's widest
  intermediate.
- the search index (`index_bytes`, `macd.index_plan` reads it from the index manifest in the
  bucket): the compact index's packed postings, block and term tables and norms (memory-mapped:
  a query reads every posting of its terms, and a run's queries reach most of them), each file
  counted whole, the upper bound of what stays resident, plus the working memory of the queries
  this worker runs at once (a score per passage each). The zstd passage blocks are mapped too,
  but a query reads only its top hits, pages macOS drops first: named, not counted.

Usable memory: what MLX may wire on the GPU, macOS's recommended working set (about 2/3 of RAM
below 64 GB, 3/4 from 64 GB); on the CPU the RAM itself; unless the caller passes the device's own
figure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
KV_STEP = 256  # mlx-lm KVCache allocation step (tokens)
QUANT_GROUP = 64
INT8_BYTES = 1 + 4 / QUANT_GROUP  # 8-bit code, bf16 scale and bias per 64
INT4_BYTES = 0.5 + 4 / QUANT_GROUP  # 4-bit code, bf16 scale and bias per 64
#: Bytes per quantizable parameter of a quantized plane held alone.
HELD_BYTES = {"int8": INT8_BYTES, "int4": INT4_BYTES}
#: More parameters than any model a Mac could serve (10^14: 200 TB of bf16): a config claiming more
#: is absurd, planned as no plan rather than as arithmetic on sizes no model has.
MAX_PARAMS = 10**14
PREFILL_STEP = 2048  # macd.generate.PREFILL_STEP
#: Where MLX computes (module doc): a GPU (Metal on a Mac) or MLX's CPU device (float32 compute).
DEVICES = ("gpu", "cpu")
#: Bytes of an activation, KV cache or conv state value on each device.
ACTIVATION_BYTES = {"gpu": 2, "cpu": 4}
WIDE_BYTES = 4  # a float32 copy of a bf16 weight (`macd.cpu_compute`)

#: LFM2.5-8B-A1B as published (LiquidAI/LFM2.5-8B-A1B config.json): 24 layers, 18 conv and 6
#: attention. transformers' `Lfm2MoeConfig()` defaults differ (32 layers, vocab 65536, no
#: layer_types, so no model can be built from them alone).
LFM2_5_8B_A1B: dict[str, Any] = {
    "model_type": "lfm2_moe",
    "vocab_size": 128000,
    "hidden_size": 2048,
    "intermediate_size": 7168,
    "moe_intermediate_size": 1792,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "num_dense_layers": 2,
    "conv_L_cache": 3,
    "tie_word_embeddings": True,
    "layer_types": [
        "conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv",
        "conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv",
        "conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
    ],
}

MAC_SIZES_GB = (16, 24, 32, 64)


def usable_bytes(ram_gb: float, device: str = "gpu") -> int:
    """macOS's default GPU working-set limit for a Mac with `ram_gb` of memory (approximate); on
    the CPU device (nothing wired) the whole RAM."""
    if device == "cpu":
        return int(ram_gb * GIB)
    return int(ram_gb * GIB * (0.75 if ram_gb >= 64 else 2 / 3))


def _layer_types(config: Mapping[str, Any]) -> list[str]:
    n = int(config["num_hidden_layers"])
    if config.get("layer_types"):
        return list(config["layer_types"])
    if config.get("full_attn_idxs") is not None:
        return ["full_attention" if i in config["full_attn_idxs"] else "conv" for i in range(n)]
    return ["full_attention"] * n  # attention-only families


#: `Lfm2Config`'s defaults for what decides dense LFM2's MLP width (transformers'
#: configuration_lfm2.py), taken where a config.json names none.
LFM2_FF_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 12288, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
}


def _dense_ff(config: Mapping[str, Any]) -> int:
    """The dense feed-forward width, as transformers builds it: ``intermediate_size``, except for
    dense LFM2 (`Lfm2MLP`), whose width is ``block_ff_dim`` (the original configs' name) or else
    ``intermediate_size``, and, with ``block_auto_adjust_ff_dim``, 2/3 of that, times
    ``block_ffn_dim_multiplier`` rounded up to a multiple of ``block_multiple_of`` (no rounding when
    the multiplier is null); `LFM2_FF_DEFAULTS` where the config names none. mlx-lm, which needs
    the keys, builds the same width, except that it rounds with a null multiplier too."""
    if config.get("model_type") != "lfm2":
        return int(config["intermediate_size"])
    lfm2 = {**LFM2_FF_DEFAULTS, **{k: v for k, v in config.items() if k in LFM2_FF_DEFAULTS}}
    ff = int(config["block_ff_dim"] if config.get("block_ff_dim") is not None else lfm2["intermediate_size"])
    if lfm2["block_auto_adjust_ff_dim"]:
        ff = int(2 * ff / 3)
        if lfm2["block_ffn_dim_multiplier"] is not None:
            multiple = int(lfm2["block_multiple_of"])
            ff = int(lfm2["block_ffn_dim_multiplier"] * ff)
            ff = multiple * ((ff + multiple - 1) // multiple)
    return ff


@dataclass(frozen=True)
class ParamCount:
    quantizable: int  # Linear/Embedding/expert weights with an input size divisible by 64
    other: int  # norms, conv kernels, biases, misfit layers
    widened: int = 0  # weights the CPU device keeps float32 copies of: matmul layers, a tied head

    @property
    def total(self) -> int:
        return self.quantizable + self.other


def param_count(config: Mapping[str, Any]) -> ParamCount:
    """Parameters of an LFM2 / LFM2-MoE (or a plain GQA transformer) config, split by whether
    the int8 plane quantizes them; `widened`: those of the layers that compute with a float32 copy
    on the CPU device (module doc)."""
    h, v = int(config["hidden_size"]), int(config["vocab_size"])
    heads, kv = int(config["num_attention_heads"]), int(config.get("num_key_value_heads") or config["num_attention_heads"])
    hd = int(config.get("head_dim") or h // heads)
    kernel = int(config.get("conv_L_cache", 3))
    experts = int(config.get("num_experts") or 0)
    dense_layers = int(config.get("num_dense_layers", 0)) if experts else 10**9
    ff = _dense_ff(config)
    moe_ff = int(config.get("moe_intermediate_size") or 0)
    q = o = wide = 0

    def linear(n_out: int, n_in: int, *, matmul: bool = True) -> None:
        nonlocal q, o, wide
        if n_in % QUANT_GROUP == 0:
            q += n_out * n_in
        else:
            o += n_out * n_in
        if matmul:
            wide += n_out * n_in

    tied = bool(config.get("tie_word_embeddings", True))
    linear(v, h, matmul=tied)  # embedding (quantized along its rows of h); tied: the output head too
    if not tied:
        linear(v, h)  # the output head
    o += h  # final norm
    for i, kind in enumerate(_layer_types(config)):
        o += 2 * h  # operator / ffn norms
        if kind == "conv":
            linear(3 * h, h)
            linear(h, h)
            o += h * kernel
        else:
            linear(heads * hd, h)
            linear(2 * kv * hd, h)
            linear(h, heads * hd)
            o += 2 * hd  # q / k norms
        if i < dense_layers:
            linear(2 * ff, h)
            linear(h, ff)
        else:
            linear(experts, h)  # router
            o += experts  # expert bias
            linear(2 * experts * moe_ff, h)
            linear(experts * h, moe_ff)
    return ParamCount(q, o, wide)


def weights_by_plane(
    counts: ParamCount, published: Sequence[str] = (), device: str = "gpu", run_plane: str = "bf16"
) -> dict[str, int]:
    """Bytes of the weights of each plane a worker can serve on `device` (module doc): bf16, and
    a quantized plane only where the run
    manifest names it (the trainer takes records of no other plane: a claimed plane widens its
    logprob-gap bound): held alone when `published`, or, int8 as the run's own `run_plane`
    without publishing it, quantized here beside the bf16 master. On the CPU every plane adds
    the float32 copies of its matmul weights (the served plane's: bf16 widened, or dequantized)."""
    _check_device(device)
    copies = WIDE_BYTES * counts.widened if device == "cpu" else 0
    out = {"bf16": 2 * counts.total + copies}
    for plane, per in HELD_BYTES.items():
        alone = int(per * counts.quantizable + 2 * counts.other)
        if plane in published:
            out[plane] = alone + copies
        elif plane == run_plane:
            out[plane] = 2 * counts.total + alone + copies
    return out


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes a worker holds for one model and run shape, and what fits where."""

    params: int
    weights: dict[str, int]  # per plane
    published: tuple[str, ...]  # the quantized planes the run publishes (held alone)
    kv_bytes_per_token: int  # all attention layers, one sequence
    conv_bytes_per_sequence: int  # all conv layers
    sequences: int  # live sequences planned for (group size x concurrent groups)
    cache: int  # KV + conv state of every live sequence at full length
    activations: int
    index: int
    macs: list[dict[str, Any]] = field(default_factory=list)  # one row per (RAM, plane)
    index_line: str = ""  # what the index is and why its size counts so (`macd.index_plan`)
    device: str = "gpu"  # where MLX computes (`DEVICES`)

    def total(self, plane: str) -> int:
        return self.weights[plane] + self.cache + self.activations + self.index


def plan(
    config: Mapping[str, Any],
    *,
    group_size: int,
    groups: int = 1,
    prompt_tokens: int,
    response_tokens: int,
    index_bytes: int = 0,
    mac_sizes_gb: Sequence[float] = MAC_SIZES_GB,
    usable: Mapping[float, int] | None = None,
    published: Sequence[str] = (),
    index_line: str = "",
    device: str = "gpu",
    run_plane: str = "bf16",
) -> MemoryPlan:
    """The memory plan of `config` for `groups` concurrent groups of `group_size` sequences of at
    most `prompt_tokens + response_tokens` tokens, on each Mac of `mac_sizes_gb` (usable bytes
    from `usable` where given, else `usable_bytes`), with the quantized planes the run
    `published` held alone (int8 quantized here when it is the run's `run_plane` unpublished)
    and a search index of `index_bytes` (`index_line` says which). Per
    (RAM, plane) row: ``fits``, the headroom, and ``max_sequences``: how many full-length
    sequences would fit beside the weights and the index. `device`: where MLX computes (`DEVICES`,
    module doc), which decides the float32 terms and the usable memory."""
    _check_device(device)
    if index_bytes < 0:
        raise ValueError(f"the search index's size must be >= 0 bytes, got {index_bytes}")
    if min(group_size, groups, prompt_tokens + response_tokens) < 1:
        raise ValueError("need group_size, groups >= 1 and a positive length")
    counts = param_count(config)
    if counts.total > MAX_PARAMS:  # a config.json from the bucket with sizes no model has
        raise ValueError(f"{counts.total:.3g} parameters: no model this plan is for has that many")
    types = _layer_types(config)
    h, v = int(config["hidden_size"]), int(config["vocab_size"])
    heads, kv = int(config["num_attention_heads"]), int(config.get("num_key_value_heads") or config["num_attention_heads"])
    hd = int(config.get("head_dim") or h // heads)
    act = ACTIVATION_BYTES[device]
    kv_token = types.count("full_attention") * 2 * kv * hd * act
    conv_seq = types.count("conv") * (int(config.get("conv_L_cache", 3)) - 1) * h * act
    seqs = group_size * groups
    length = KV_STEP * math.ceil((prompt_tokens + response_tokens) / KV_STEP)
    per_seq = kv_token * length + conv_seq
    chunk = min(PREFILL_STEP, prompt_tokens)
    widest = max(3 * h, 2 * _dense_ff(config),
                 2 * int(config.get("num_experts_per_tok") or 0) * int(config.get("moe_intermediate_size") or 0))
    activations = chunk * v * act + seqs * v * 4 + chunk * widest * 4
    offered = tuple(p for p in ("int8", "int4") if p in published)
    weights = weights_by_plane(counts, offered, device, run_plane)
    result = MemoryPlan(
        counts.total, weights, offered, kv_token, conv_seq, seqs, seqs * per_seq, activations, index_bytes,
        index_line=index_line, device=device,
    )
    for gb in mac_sizes_gb:
        limit = (usable or {}).get(gb, usable_bytes(gb, device))
        for plane in weights:
            room = limit - weights[plane] - activations - index_bytes
            result.macs.append({
                "ram_gb": gb, "plane": plane, "usable_bytes": limit, "total_bytes": result.total(plane),
                "fits": result.total(plane) <= limit, "headroom_bytes": limit - result.total(plane),
                "max_sequences": max(0, room // per_seq),
            })
    return result


def _verdict(row: Mapping[str, Any]) -> str:
    """A (RAM, plane) row's verdict: fits, fits only N sequences, or does not fit."""
    if row["fits"]:
        return "fits"
    return "does not fit" if row["max_sequences"] == 0 else f"fits only {row['max_sequences']} sequences"


#: What each device's figures count, the first line of a plan (`describe`).
DEVICE_LINES = {
    "gpu": "device: the GPU (Metal): bf16 weights, KV cache and activations",
    "cpu": "device: the CPU (MLX float32 compute): bf16 weights plus float32 copies of the matmul weights "
           "(bf16 plane), float32 KV cache and activations; usable: all of RAM",
}


def machine(ram_gb: float, device: str) -> str:
    """How a plan's row names a machine of `ram_gb` GB: a Mac (GPU), or a CPU machine."""
    return f"{ram_gb:g} GB Mac" if device == "gpu" else f"{ram_gb:g} GB CPU machine"


def describe(p: MemoryPlan) -> list[str]:
    """Lines for `macd doctor` / `macd join`: the device the figures are for, the terms (the
    index's own line when it has one), then one line per (RAM, plane)."""
    sizes = [f"bf16 {p.weights['bf16'] / GIB:.1f} GiB" + (" (with float32 copies)" if p.device == "cpu" else "")] + [
        f"{plane} {p.weights[plane] / GIB:.1f} GiB "
        + ("(published, held alone)" if plane in p.published else "(bf16 master + int8 copy)")
        for plane in ("int8", "int4") if plane in p.weights
    ]
    lines = [
        DEVICE_LINES[p.device],
        f"model: {p.params / 1e9:.2f}B parameters; weights {', '.join(sizes)}",
        f"cache: {p.sequences} sequences, KV {p.kv_bytes_per_token / 1024:.0f} KiB/token (attention layers), "
        f"conv state {p.conv_bytes_per_sequence / 1024:.0f} KiB/sequence: {p.cache / GIB:.2f} GiB; "
        f"activations {p.activations / GIB:.2f} GiB; search index {p.index / GIB:.2f} GiB",
    ] + ([p.index_line] if p.index_line else [])
    for row in p.macs:
        lines.append(f"{machine(row['ram_gb'], p.device)}, {row['plane']}: needs {row['total_bytes'] / GIB:.1f} of "
                     f"{row['usable_bytes'] / GIB:.1f} GiB usable: {_verdict(row)}")
    return lines


def config_plan(config: Mapping[str, Any], **shape: Any) -> MemoryPlan | None:
    """`plan` of an HF config.json (a multimodal one's ``text_config``), or None when it lacks the
    sizes a plan needs (hidden size, vocabulary, layers, heads)."""
    text = config.get("text_config")
    model = text if isinstance(text, Mapping) else config
    try:
        return plan(model, **shape)
    except (KeyError, TypeError, ValueError, ArithmeticError):  # a size missing, malformed or absurd
        return None


def this_mac(
    config: Mapping[str, Any], *, memory: int, plane: str, group_size: int, groups: int, prompt_tokens: int,
    response_tokens: int, index_bytes: int = 0, index_line: str = "", published: Sequence[str] = (),
    served: str | None = None, device: str = "gpu",
) -> tuple[list[str], str | None]:
    """(plan lines, warning or None) for serving `config` on this Mac (`memory` bytes): the weights
    of each plane (those the run `published` held alone), the cache and the index, then total vs
    usable per plane, the run's `plane` marked. `served`: the plane this Mac will serve, when not
    the run's (`plane_choice` picks a smaller one the run publishes, or the config sets one): one
    more line names it and says whether it fits. The warning says what to change when the served
    plane does not fit. `device`: where MLX computes here (`DEVICES`; "cpu": the lines say "this
    machine"). ([], None): not plannable."""
    served = served or plane
    here = "this Mac" if device == "gpu" else "this machine"
    ram_gb = memory / GIB
    p = config_plan(
        config, group_size=group_size, groups=groups, prompt_tokens=prompt_tokens, response_tokens=response_tokens,
        index_bytes=index_bytes, index_line=index_line, mac_sizes_gb=(ram_gb,), published=published, device=device,
        run_plane=plane,
    )
    if p is None:
        return [], None
    mac = f"{machine(ram_gb, device)}, "
    marks = {plane: " (the run's plane)"} | ({served: " (served here)"} if served != plane else {})
    lines = [line.replace(mac, f"{here}, ", 1) + next((m for pl, m in marks.items() if line.startswith(f"{mac}{pl}:")), "")
             if line.startswith(mac) else line for line in describe(p)]
    rows = {r["plane"]: r for r in p.macs}
    row, run_row = rows.get(served), rows.get(plane)
    if row is not None and served != plane:
        lines.append(
            f"{here} will serve the {served} plane: needs {row['total_bytes'] / GIB:.1f} of "
            f"{row['usable_bytes'] / GIB:.1f} GiB usable: {_verdict(row)}"
            + ("" if run_row is None else f" (the run's {plane} plane: {_verdict(run_row)})")
        )
    if row is None or row["fits"]:
        return lines, None
    fit = row["max_sequences"]
    warning = (
        f"warning: the run's model does not fit {here}'s usable memory on the {served} plane"
        f"{'' if served == plane else ' it serves'} ({row['total_bytes'] / GIB:.1f} of {row['usable_bytes'] / GIB:.1f} GiB): "
        + (f"lower `batch` (or set `max_decode`) to at most {fit} sequences decoding" if fit else
           f"its {'weights and search index' if p.index else 'weights'} alone do not fit; join a run of a smaller "
           "model or use a Mac with more memory")
    )
    return lines, warning
