"""HF <-> Megatron names and tensors of LFM2 (`lfm2`) and LFM2-MoE (`lfm2_moe`), both ways.

    python -m slime_stoa.trainer.slime.lfm2.convert --hf DIR --out DIR [--layout te|local] [--check]

writes `DIR/model.safetensors` (every Megatron parameter and the expert-bias buffers under their
Megatron names, unsharded, each tensor in its HF dtype) and `DIR/lfm2_megatron.json` (the shape
and layout), and with `--check` proves the round trip HF -> Megatron -> HF bit for bit. slime
reads neither: the provider (`spec.provider`) registers `hf_tensor_for` as slime's HF loader for
both model types, so slime's `tools/convert_hf_to_torch_dist.py` with
`--custom-model-provider-path` writes the `torch_dist` checkpoint slime's `--ref-load` reads
(`scripts/run_lfm2_search.sh --convert`).

The mapping (HF checkpoint names as the folders store them; `L` a layer, `E` an expert):

| HF | Megatron | Megatron's TP / EP sharding (the provider runs TP 1) |
|---|---|---|
| model.embed_tokens.weight | embedding.word_embeddings.weight | rows (vocab, padded to Megatron's multiple) over TP |
| model.embedding_norm.weight (the final norm) | decoder.final_layernorm.weight | replicated |
| L.operator_norm.weight | L.input_layernorm.weight, or te: L.self_attention.linear_qkv.layer_norm_weight on attention layers | replicated |
| L.self_attn.{q,k,v}_proj.weight | L.self_attention.linear_qkv.weight (per KV group: its q heads, k, v) | column: KV groups over TP |
| L.self_attn.out_proj.weight | L.self_attention.linear_proj.weight | row: input dim over TP |
| L.self_attn.{q,k}_layernorm.weight | L.self_attention.{q,k}_layernorm.weight | replicated |
| L.conv.in_proj.weight | L.self_attention.in_proj.weight (B, C, x blocks) | replicated (TP must be 1) |
| L.conv.conv.weight | L.self_attention.conv.weight | replicated (TP must be 1) |
| L.conv.out_proj.weight | L.self_attention.out_proj.weight | replicated (TP must be 1) |
| L.ffn_norm.weight | L.pre_mlp_layernorm.weight, or te on a dense layer: L.mlp.linear_fc1.layer_norm_weight | replicated |
| L.feed_forward.{w1,w3}.weight (dense) | L.mlp.linear_fc1.weight = [w1; w3] | column: each of w1, w3 over TP |
| L.feed_forward.w2.weight (dense) | L.mlp.linear_fc2.weight | row over TP |
| L.feed_forward.gate.weight | L.mlp.router.weight | replicated |
| L.feed_forward.expert_bias (fp32) | L.mlp.router.expert_bias (fp32 buffer) | replicated |
| L.feed_forward.experts.E.{w1,w3}.weight | te: L.mlp.experts.linear_fc1.weightE, local: L.mlp.experts.local_experts.E.linear_fc1.weight = [w1; w3] | experts over EP (global E, rank r holds E in [r*n/EP, (r+1)*n/EP)); expert TP 1 |
| L.feed_forward.experts.E.w2.weight | ...linear_fc2... | as linear_fc1 |

`te` is the layout of Megatron's TransformerEngine spec with grouped experts (what slime runs on
a GPU: fused input norms, `--moe-grouped-gemm`); `local` the layout of its local spec (separate
norms, SequentialMLP experts). Megatron -> HF accepts either. The output head is tied (LFM2
ties it): a Megatron `output_layer.weight` (the last pipeline stage's copy) maps to
`lm_head.weight`, which the publisher leaves out (`hf_names.head_plan`). Every tensor keeps its
dtype: the fp32 expert biases stay fp32 through both directions; only the vocabulary padding is
removed (`vocab_size`).

Torch-free: tensors are numpy arrays or torch tensors, whichever the caller passes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

Layout = Literal["te", "local"]
LAYOUTS: tuple[Layout, ...] = ("te", "local")
MODEL_TYPES = ("lfm2", "lfm2_moe")
LayerKind = Literal["conv", "full_attention"]

T = TypeVar("T")

_LAYER = re.compile(r"(?:module\.)*(?:language_model\.)?decoder\.layers\.(\d+)\.(.+)")
_TE_EXPERT = re.compile(r"mlp\.experts\.linear_fc([12])\.weight(\d+)")
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")


@dataclass(frozen=True)
class Lfm2Shape:
    """What the mapping needs of an LFM2 / LFM2-MoE HF config."""

    model_type: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    layer_types: tuple[LayerKind, ...]
    num_experts: int = 0
    num_dense_layers: int = 0

    @property
    def moe(self) -> bool:
        return self.model_type == "lfm2_moe"

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe and layer >= self.num_dense_layers

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | Any) -> Lfm2Shape:
        """From an HF config (a dict or transformers' config object); ValueError if not LFM2."""
        def get(key: str, default: Any = None) -> Any:
            return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)

        model_type = get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"not an LFM2 config: model_type {model_type!r} (expected one of {MODEL_TYPES})")
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        kinds = get("layer_types")
        if kinds is None:  # older LFM2 configs name the attention layers instead
            if get("full_attn_idxs") is None:
                raise ValueError("the LFM2 config names neither layer_types nor full_attn_idxs")
            attn = set(get("full_attn_idxs"))
            kinds = ["full_attention" if i in attn else "conv" for i in range(int(get("num_hidden_layers")))]
        bad = sorted({k for k in kinds if k not in ("conv", "full_attention")})
        if bad:
            raise ValueError(f"unknown LFM2 layer types {bad}")
        moe = model_type == "lfm2_moe"
        return cls(
            model_type=model_type, hidden_size=hidden, num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim", None) or hidden // heads), vocab_size=int(get("vocab_size")),
            layer_types=tuple(kinds), num_experts=int(get("num_experts") or 0) if moe else 0,
            num_dense_layers=int(get("num_dense_layers") or 0) if moe else 0,
        )


# -- tensor helpers (numpy or torch) ------------------------------------------------------------
def _cat(parts: list[T], axis: int) -> T:
    if type(parts[0]).__module__.startswith("torch"):
        import torch

        return torch.cat(parts, dim=axis)  # type: ignore[arg-type,return-value]
    import numpy as np

    return np.concatenate(parts, axis=axis)  # type: ignore[arg-type,return-value]


def merge_qkv(q: T, k: T, v: T, shape: Lfm2Shape) -> T:
    """HF q/k/v projections -> Megatron's fused linear_qkv rows: per KV group, its q heads, k, v."""
    g, d, h = shape.num_kv_heads, shape.head_dim, shape.hidden_size
    per = shape.num_heads // g
    parts = [q.reshape(g, per * d, h), k.reshape(g, d, h), v.reshape(g, d, h)]  # type: ignore[attr-defined]
    return _cat(parts, 1).reshape(-1, h)


def split_qkv(qkv: T, shape: Lfm2Shape) -> tuple[T, T, T]:
    """Megatron's fused linear_qkv -> HF q, k, v (the inverse of `merge_qkv`)."""
    g, d, h = shape.num_kv_heads, shape.head_dim, shape.hidden_size
    per = shape.num_heads // g
    x = qkv.reshape(g, per + 2, d, h)  # type: ignore[attr-defined]
    return x[:, :per].reshape(-1, h), x[:, per].reshape(-1, h), x[:, per + 1].reshape(-1, h)


def split_rows(x: T) -> tuple[T, T]:
    n = x.shape[0] // 2  # type: ignore[attr-defined]
    return x[:n], x[n:]  # type: ignore[index]


# -- names ----------------------------------------------------------------------------------------
def _norm_names(shape: Lfm2Shape, layer: int, layout: Layout) -> tuple[str, str]:
    """(operator norm, ffn norm) Megatron names of a layer."""
    attention = shape.layer_types[layer] == "full_attention"
    op = "self_attention.linear_qkv.layer_norm_weight" if layout == "te" and attention else "input_layernorm.weight"
    ffn = ("mlp.linear_fc1.layer_norm_weight" if layout == "te" and not shape.is_moe_layer(layer)
           else "pre_mlp_layernorm.weight")
    return op, ffn


def _expert_name(e: int, fc: int, layout: Layout) -> str:
    return f"mlp.experts.linear_fc{fc}.weight{e}" if layout == "te" else f"mlp.experts.local_experts.{e}.linear_fc{fc}.weight"


def megatron_names(shape: Lfm2Shape, layout: Layout = "te") -> list[str]:
    """Every Megatron parameter (and expert-bias buffer) name of the model, at one pipeline stage,
    experts by their global index, without slime's `module.module.` prefix."""
    names = ["embedding.word_embeddings.weight"]
    for layer, kind in enumerate(shape.layer_types):
        p = f"decoder.layers.{layer}."
        op, ffn = _norm_names(shape, layer, layout)
        names += [p + op, p + ffn]
        if kind == "full_attention":
            names += [p + f"self_attention.{n}.weight" for n in ("linear_qkv", "linear_proj", "q_layernorm", "k_layernorm")]
        else:
            names += [p + f"self_attention.{n}.weight" for n in ("in_proj", "conv", "out_proj")]
        if shape.is_moe_layer(layer):
            names += [p + "mlp.router.weight", p + "mlp.router.expert_bias"]
            names += [p + _expert_name(e, fc, layout) for e in range(shape.num_experts) for fc in (1, 2)]
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    return names


#: A layer's Megatron parameters that are one HF tensor as it is (names after the layer prefix).
_DIRECT = {
    "self_attention.linear_proj.weight": "self_attn.out_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_layernorm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_layernorm.weight",
    "self_attention.in_proj.weight": "conv.in_proj.weight",
    "self_attention.conv.weight": "conv.conv.weight",
    "self_attention.out_proj.weight": "conv.out_proj.weight",
    "mlp.router.weight": "feed_forward.gate.weight",
    "mlp.router.expert_bias": "feed_forward.expert_bias",
    "mlp.linear_fc2.weight": "feed_forward.w2.weight",
}


def hf_tensor_for(name: str, get: Callable[[str], T], shape: Lfm2Shape) -> T:
    """The tensor of Megatron parameter `name` (any prefix, experts by global index), built from
    the HF checkpoint's tensors read by `get(hf_name)`. KeyError for a name LFM2 has not."""
    bare = name
    while bare.startswith("module."):
        bare = bare.removeprefix("module.")
    bare = bare.removeprefix("language_model.")
    if bare == "embedding.word_embeddings.weight" or bare == "output_layer.weight":
        return get("model.embed_tokens.weight")  # tied head: the last stage's copy is the embedding
    if bare == "decoder.final_layernorm.weight":
        return get("model.embedding_norm.weight")
    match = _LAYER.fullmatch(bare)
    if not match:
        raise KeyError(f"not an LFM2 Megatron parameter: {name!r}")
    layer, rest = int(match.group(1)), match.group(2)
    p = f"model.layers.{layer}."
    if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
        return get(p + "operator_norm.weight")
    if rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
        return get(p + "ffn_norm.weight")
    if rest == "self_attention.linear_qkv.weight":
        a = p + "self_attn."
        return merge_qkv(get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight"), shape)
    if rest in _DIRECT:
        return get(p + _DIRECT[rest])
    if rest == "mlp.linear_fc1.weight":
        return _cat([get(p + "feed_forward.w1.weight"), get(p + "feed_forward.w3.weight")], 0)
    expert = _expert(rest)
    if expert is not None:
        e, fc = expert
        q = f"{p}feed_forward.experts.{e}."
        if fc == 2:
            return get(q + "w2.weight")
        return _cat([get(q + "w1.weight"), get(q + "w3.weight")], 0)
    raise KeyError(f"not an LFM2 Megatron parameter: {name!r}")


def _expert(rest: str) -> tuple[int, int] | None:
    if m := _TE_EXPERT.fullmatch(rest):
        return int(m.group(2)), int(m.group(1))
    if m := _LOCAL_EXPERT.fullmatch(rest):
        return int(m.group(1)), int(m.group(2))
    return None


def to_hf(name: str, tensor: T, shape: Lfm2Shape) -> list[tuple[str, T]]:
    """One Megatron parameter (full, unsharded; any prefix; experts by global index) -> its HF
    (name, tensor) pairs; the embedding and head lose Megatron's vocabulary padding. KeyError
    for a name LFM2 has not."""
    bare = name
    while bare.startswith("module."):
        bare = bare.removeprefix("module.")
    bare = bare.removeprefix("language_model.")
    if bare == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", tensor[: shape.vocab_size])]  # type: ignore[index]
    if bare == "output_layer.weight":
        return [("lm_head.weight", tensor[: shape.vocab_size])]  # type: ignore[index]
    if bare == "decoder.final_layernorm.weight":
        return [("model.embedding_norm.weight", tensor)]
    match = _LAYER.fullmatch(bare)
    if not match:
        raise KeyError(f"not an LFM2 Megatron parameter: {name!r}")
    layer, rest = int(match.group(1)), match.group(2)
    p = f"model.layers.{layer}."
    if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
        return [(p + "operator_norm.weight", tensor)]
    if rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
        return [(p + "ffn_norm.weight", tensor)]
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = split_qkv(tensor, shape)
        return [(p + "self_attn.q_proj.weight", q), (p + "self_attn.k_proj.weight", k), (p + "self_attn.v_proj.weight", v)]
    if rest in _DIRECT:
        return [(p + _DIRECT[rest], tensor)]
    if rest == "mlp.linear_fc1.weight":
        w1, w3 = split_rows(tensor)
        return [(p + "feed_forward.w1.weight", w1), (p + "feed_forward.w3.weight", w3)]
    expert = _expert(rest)
    if expert is not None:
        e, fc = expert
        ex = f"{p}feed_forward.experts.{e}."
        if fc == 2:
            return [(ex + "w2.weight", tensor)]
        w1, w3 = split_rows(tensor)
        return [(ex + "w1.weight", w1), (ex + "w3.weight", w3)]
    raise KeyError(f"not an LFM2 Megatron parameter: {name!r}")


def hf_to_megatron(hf: Mapping[str, T], shape: Lfm2Shape, layout: Layout = "te") -> dict[str, T]:
    """A whole HF state -> Megatron names (`megatron_names`); KeyError if a tensor is missing,
    ValueError if one is left unused (a checkpoint that is not this shape)."""
    used: set[str] = set()

    def get(hf_name: str) -> T:
        used.add(hf_name)
        return hf[hf_name]

    out = {name: hf_tensor_for(name, get, shape) for name in megatron_names(shape, layout)}
    extra = sorted(set(hf) - used - {"lm_head.weight"})
    if extra:
        raise ValueError(f"{len(extra)} HF tensors have no Megatron parameter, e.g. {extra[:3]}")
    return out


def megatron_to_hf(state: Mapping[str, T], shape: Lfm2Shape) -> dict[str, T]:
    """A whole Megatron state (full tensors) -> HF names; ValueError on a duplicate HF name."""
    out: dict[str, T] = {}
    for name, tensor in state.items():
        for hf_name, value in to_hf(name, tensor, shape):
            if hf_name in out:
                raise ValueError(f"two Megatron parameters map to {hf_name!r}")
            out[hf_name] = value
    return out


def iter_hf(named: Iterator[tuple[str, T]] | list[tuple[str, T]], shape: Lfm2Shape) -> Iterator[tuple[str, T]]:
    """`to_hf` over (Megatron name, tensor) pairs, in order."""
    for name, tensor in named:
        yield from to_hf(name, tensor, shape)


# -- the command ------------------------------------------------------------------------------------
def _read_folder(folder: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(str(path)))
    return state


def convert_folder(hf_dir: Path, out_dir: Path, *, layout: Layout = "te", check: bool = False) -> dict[str, Any]:
    """Write the Megatron-named state of `hf_dir` to `out_dir` (see the module doc); with `check`,
    also map it back and compare with the HF tensors bit for bit (ValueError on a difference).
    Returns the summary written to `lfm2_megatron.json`."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    shape = Lfm2Shape.from_hf(config)
    hf = _read_folder(hf_dir)
    mega = hf_to_megatron(hf, shape, layout)
    summary: dict[str, Any] = {"shape": asdict(shape), "layout": layout, "tensors": len(mega),
                               "dtypes": sorted({str(t.dtype) for t in mega.values()})}
    if check:
        back = megatron_to_hf(mega, shape)
        want = {k: v for k, v in hf.items() if k != "lm_head.weight"}
        if set(back) != set(want):
            raise ValueError(f"round trip changed the names: {sorted(set(back) ^ set(want))[:5]}")
        for k, v in want.items():
            if back[k].dtype != v.dtype or not torch.equal(back[k], v):
                raise ValueError(f"round trip changed {k}")
        summary["round_trip_equal"] = True
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in mega.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "lfm2_megatron.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="LFM2 / LFM2-MoE: HF folder -> Megatron-named safetensors")
    parser.add_argument("--hf", type=Path, required=True, help="the HF folder (config.json, *.safetensors)")
    parser.add_argument("--out", type=Path, required=True, help="write model.safetensors and lfm2_megatron.json here")
    parser.add_argument("--layout", choices=LAYOUTS, default="te",
                        help="te: TransformerEngine spec, grouped experts (slime on a GPU); local: local spec")
    parser.add_argument("--check", action="store_true", help="also prove the round trip HF -> Megatron -> HF exact")
    args = parser.parse_args(argv)
    try:
        summary = convert_folder(args.hf, args.out, layout=args.layout, check=args.check)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
