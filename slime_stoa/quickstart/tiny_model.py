"""A tiny random Qwen2 model folder for tests, built offline in well under a second.

The folder holds a Qwen2 ``config.json``, random bf16 weights under the HF parameter names, a
byte-level BPE tokenizer trained with ``tokenizers`` and a ``tokenizer_config.json`` with a
ChatML chat template, so both ``mlx_lm.load`` and transformers' ``from_pretrained`` load it.
Only numpy, ``tokenizers`` and the standard library are used.

`build_tiny_llama` and `build_tiny_lfm2` (dense LFM2 and LFM2-MoE, the family of LFM2.5-8B-A1B)
write folders of the other families with the same tokenizer; `build_tiny_family` picks one by
model type.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from slime_stoa.protocol.hf.folders import f32_to_bf16_bits, save_hf_folder
from slime_stoa.protocol.hf.safetensors_io import write_safetensors

if TYPE_CHECKING:
    from tokenizers import Tokenizer

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

#: ChatML, as Qwen2 instruct models use it (without the default system prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: Qwen2's pre-tokenization split (single digits, words with one leading non-letter, ...).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_WORDS = ["the", "a", "an", "and", "or", "of", "to", "in", "is", "was", "are", "were", "has", "had", "have", "for", "with", "on", "at", "by", "from", "as", "it", "this", "that", "which", "who", "what", "how", "many", "much", "more", "less", "than", "each", "every", "total", "left", "right", "answer", "question", "number", "numbers", "sum", "difference", "product", "times", "plus", "minus", "equals", "apples", "oranges", "books", "pens", "cookies", "dollars", "cents", "hours", "minutes", "days", "weeks", "friends", "students", "teacher", "mother", "father", "sister", "brother", "store", "bought", "sold", "gave", "kept", "buys", "sells", "costs", "pays", "earns", "spends", "twice", "half", "double", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "hundred", "thousand", "so", "therefore", "first", "then", "finally", "step", "think", "user", "assistant", "system", "you", "are", "helpful"]


def default_corpus() -> list[str]:
    """A small deterministic corpus of arithmetic strings and English sentences."""
    rng = np.random.default_rng(1234)
    lines = []
    for i in range(300):
        a, b = int(rng.integers(0, 1000)), int(rng.integers(0, 100))
        op = "+-*"[i % 3]
        res = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"{a} {op} {b} = {res}")
        words = rng.choice(_WORDS, size=12)
        lines.append(" ".join(words).capitalize() + f". The answer is {res}.")
    lines.append(" ".join(_WORDS))
    return lines


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (all 256 bytes in the alphabet) with the ChatML special tokens.

    The normalizer and pre-tokenizer are Qwen2's, because transformers (5.x) rebuilds them that
    way for ``model_type: qwen2`` whatever tokenizer.json says; with the same pipeline here,
    ``tokenizers``, transformers and mlx-lm all produce the same ids.
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    return tok


def qwen2_param_shapes(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    tie_word_embeddings: bool,
) -> dict[str, tuple[int, ...]]:
    """HF Qwen2ForCausalLM parameter names and shapes, in a stable order."""
    head_dim = hidden_size // num_heads
    q, kv, h, i = num_heads * head_dim, num_kv_heads * head_dim, hidden_size, intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    shapes["model.norm.weight"] = (h,)
    if not tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab_size, h)
    return shapes


def random_state(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """bf16 bits: norm weights 1.0, everything else N(0, 0.02)."""
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in shapes.items():
        if "norm" in name:
            values = np.ones(shape, np.float32)
        else:
            values = rng.normal(0.0, 0.02, size=shape).astype(np.float32)
        state[name] = f32_to_bf16_bits(values)
    return state


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _check_heads(hidden_size: int, num_heads: int, num_kv_heads: int) -> None:
    if hidden_size % num_heads or num_heads % num_kv_heads or (hidden_size // num_heads) % 2:
        raise ValueError(
            "need hidden_size divisible by num_heads into an even head_dim, and num_heads "
            f"divisible by num_kv_heads; got {hidden_size=}, {num_heads=}, {num_kv_heads=}"
        )


def _write_tokenizer(
    out: Path, texts: Iterable[str] | None, vocab_size: int, added_tokens: Sequence[str]
) -> tuple[dict[str, int], int]:
    """Train the tokenizer on `texts` (default: `default_corpus()`), add `added_tokens` whole and
    write the tokenizer and generation config files; (special token ids, model vocab size)."""
    tok = train_tokenizer(default_corpus() if texts is None else texts, vocab_size)
    if added_tokens:
        tok.add_tokens(list(added_tokens))
    tok.save(str(out / "tokenizer.json"))
    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        i = tok.token_to_id(t)
        if i is None:
            raise RuntimeError(f"the trained tokenizer lacks {t!r}")
        ids[t] = i
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1024,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "extra_special_tokens": {},
    })
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
        "pad_token_id": ids[ENDOFTEXT],
    })
    return ids, max(vocab_size, tok.get_vocab_size())


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    family: Literal["qwen2", "llama"] = "qwen2",
    texts: Iterable[str] | None = None,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    added_tokens: Sequence[str] = (),
) -> Path:
    """Write a tiny random Qwen2 model folder (a Llama one with ``family="llama"``: the same
    model without the q/k/v biases) to `out_dir` and return its path.

    The tokenizer is trained on `texts` (default: `default_corpus()`) up to `vocab_size`
    tokens, then `added_tokens` (e.g. a tool task's tags) are added whole, so that each is one
    token wherever it occurs; the model's vocab is the larger of `vocab_size` and the
    tokenizer's. Deterministic for given arguments.
    """
    _check_heads(hidden_size, num_heads, num_kv_heads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids, n_vocab = _write_tokenizer(out, texts, vocab_size, added_tokens)
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM" if family == "llama" else "Qwen2ForCausalLM"],
        "model_type": family,
        "vocab_size": n_vocab,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
    }
    if family == "llama":
        config.update(head_dim=hidden_size // num_heads, attention_bias=False, mlp_bias=False)
    else:
        config.update(
            attention_dropout=0.0, use_cache=True, use_sliding_window=False, sliding_window=None,
            max_window_layers=num_layers,
        )
    _write_json(out / "config.json", config)
    shapes = qwen2_param_shapes(
        vocab_size=n_vocab,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
    )
    if family == "llama":
        shapes = {k: v for k, v in shapes.items() if not k.endswith(".bias")}
    save_hf_folder(random_state(shapes, seed), out)
    return out


def build_tiny_llama(out_dir: str | os.PathLike[str], **kwargs: Any) -> Path:
    """A tiny random Llama folder: `build_tiny_model` with ``family="llama"``."""
    return build_tiny_model(out_dir, family="llama", **kwargs)


# -- LFM2 and LFM2-MoE ----------------------------------------------------------------------------

#: The model families `build_tiny_family` builds.
FAMILIES = ("qwen2", "llama", "lfm2", "lfm2_moe")

#: Layer types of the tiny LFM2 models. Like the real configs, conv layers outnumber attention
#: layers and the MoE model opens with conv layers (its dense layers, as in LFM2-8B-A1B); the
#: dense model's attention layer comes second, so the first conv and attention layers differ.
LFM2_LAYER_TYPES = ("conv", "full_attention", "conv", "conv")
LFM2_MOE_LAYER_TYPES = ("conv", "conv", "full_attention", "conv")


def lfm2_ff_dim(intermediate_size: int, multiple_of: int, multiplier: float | None, auto_adjust: bool) -> int:
    """The width of an LFM2 dense feed-forward block: 2/3 of `intermediate_size`, times the
    multiplier, rounded up to `multiple_of` when `auto_adjust` (transformers' `Lfm2MLP` rounds
    only with a multiplier, mlx-lm's always: the tiny configs always name one)."""
    if not auto_adjust:
        return intermediate_size
    ff = int(2 * intermediate_size / 3)
    if multiplier is not None:
        ff = int(multiplier * ff)
    return multiple_of * ((ff + multiple_of - 1) // multiple_of)


def lfm2_param_shapes(
    *,
    vocab_size: int,
    hidden_size: int,
    layer_types: Sequence[str],
    num_heads: int,
    num_kv_heads: int,
    ff_dim: int,
    conv_kernel: int,
    num_experts: int = 0,
    moe_intermediate_size: int = 0,
    num_dense_layers: int = 0,
) -> dict[str, tuple[int, ...]]:
    """HF Lfm2ForCausalLM (``num_experts == 0``) or Lfm2MoeForCausalLM parameter names and shapes,
    as the checkpoints store them (experts one by one, w1/w3/w2; embeddings tied)."""
    h, head_dim = hidden_size, hidden_size // num_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for layer, kind in enumerate(layer_types):
        p = f"model.layers.{layer}."
        shapes[p + "operator_norm.weight"] = (h,)
        if kind == "full_attention":
            shapes.update({
                p + "self_attn.q_proj.weight": (num_heads * head_dim, h),
                p + "self_attn.k_proj.weight": (num_kv_heads * head_dim, h),
                p + "self_attn.v_proj.weight": (num_kv_heads * head_dim, h),
                p + "self_attn.out_proj.weight": (h, num_heads * head_dim),
                p + "self_attn.q_layernorm.weight": (head_dim,),
                p + "self_attn.k_layernorm.weight": (head_dim,),
            })
        elif kind == "conv":
            shapes.update({
                p + "conv.conv.weight": (h, 1, conv_kernel),
                p + "conv.in_proj.weight": (3 * h, h),
                p + "conv.out_proj.weight": (h, h),
            })
        else:
            raise ValueError(f"unknown LFM2 layer type {kind!r}")
        shapes[p + "ffn_norm.weight"] = (h,)
        if num_experts and layer >= num_dense_layers:
            shapes[p + "feed_forward.gate.weight"] = (num_experts, h)
            shapes[p + "feed_forward.expert_bias"] = (num_experts,)
            for e in range(num_experts):
                q = f"{p}feed_forward.experts.{e}."
                shapes.update({
                    q + "w1.weight": (moe_intermediate_size, h),
                    q + "w3.weight": (moe_intermediate_size, h),
                    q + "w2.weight": (h, moe_intermediate_size),
                })
        else:
            shapes.update({
                p + "feed_forward.w1.weight": (ff_dim, h),
                p + "feed_forward.w3.weight": (ff_dim, h),
                p + "feed_forward.w2.weight": (h, ff_dim),
            })
    shapes["model.embedding_norm.weight"] = (h,)
    return shapes


def lfm2_random_state(
    shapes: dict[str, tuple[int, ...]], seed: int, *, expert_bias_std: float = 0.1
) -> dict[str, np.ndarray]:
    """float32 values: norm weights 1.0, the embedding N(0, 0.25), the expert biases
    N(0, `expert_bias_std`), every other weight N(0, 1/fan_in) (a conv kernel's fan-in is its
    width), so each block moves the logits visibly and the biases move the expert selection."""
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in shapes.items():
        if "norm" in name:
            values = np.ones(shape, np.float32)
        elif name.endswith("expert_bias"):
            values = rng.normal(0.0, expert_bias_std, size=shape).astype(np.float32)
        elif name == "model.embed_tokens.weight":
            values = rng.normal(0.0, 0.25, size=shape).astype(np.float32)
        else:
            values = rng.normal(0.0, shape[-1] ** -0.5, size=shape).astype(np.float32)
        state[name] = values
    return state


def build_tiny_lfm2(
    out_dir: str | os.PathLike[str],
    *,
    moe: bool = False,
    texts: Iterable[str] | None = None,
    vocab_size: int = 512,
    hidden_size: int = 64,
    layer_types: Sequence[str] | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 192,
    conv_kernel: int = 3,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    num_dense_layers: int = 2,
    routed_scaling_factor: float = 1.0,
    norm_topk_prob: bool = True,
    expert_bias_std: float = 0.1,
    expert_bias_f32: bool = True,
    seed: int = 0,
    added_tokens: Sequence[str] = (),
) -> Path:
    """Write a tiny random LFM2 (``moe=False``, model type ``lfm2``) or LFM2-MoE (``lfm2_moe``,
    the family of LFM2.5-8B-A1B) folder to `out_dir` and return its path.

    Gated short-convolution and GQA attention layers (with their q/k norms) as `layer_types`
    says (default `LFM2_LAYER_TYPES` / `LFM2_MOE_LAYER_TYPES`); for the MoE, the first
    `num_dense_layers` layers have a dense feed-forward block and the others `num_experts`
    experts of which `num_experts_per_tok` are routed per token (sigmoid scores, the expert bias
    for the selection only, top-k weights normalised with `norm_topk_prob`, times
    `routed_scaling_factor`). Weights under the checkpoints' HF names in bf16, the expert biases
    in float32 (the dtype of transformers' buffer) unless `expert_bias_f32` is false; tied
    embeddings; the tokenizer files of `build_tiny_model`. Deterministic for given arguments.
    """
    kinds = tuple(layer_types or (LFM2_MOE_LAYER_TYPES if moe else LFM2_LAYER_TYPES))
    _check_heads(hidden_size, num_heads, num_kv_heads)
    if "full_attention" not in kinds or "conv" not in kinds:
        raise ValueError(f"layer_types needs conv and full_attention layers, got {kinds}")
    if moe and not (0 <= num_dense_layers < len(kinds) and 0 < num_experts_per_tok <= num_experts):
        raise ValueError("need num_dense_layers < num_layers and 0 < num_experts_per_tok <= num_experts")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids, n_vocab = _write_tokenizer(out, texts, vocab_size, added_tokens)
    multiple_of, multiplier = 16, 1.0
    config: dict[str, object] = {
        "architectures": ["Lfm2MoeForCausalLM" if moe else "Lfm2ForCausalLM"],
        "model_type": "lfm2_moe" if moe else "lfm2",
        "vocab_size": n_vocab,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": len(kinds),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": 1024,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": conv_kernel,
        "layer_types": list(kinds),
        "rope_theta": 1000000.0,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "use_cache": True,
        "pad_token_id": ids[ENDOFTEXT],
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
    }
    if moe:
        ff_dim = intermediate_size  # Lfm2MoeMLP takes intermediate_size as it is
        config.update({
            "moe_intermediate_size": moe_intermediate_size,
            "num_experts": num_experts,
            "num_experts_per_tok": num_experts_per_tok,
            "num_dense_layers": num_dense_layers,
            "norm_topk_prob": norm_topk_prob,
            "use_expert_bias": True,
            "routed_scaling_factor": routed_scaling_factor,
        })
    else:
        ff_dim = lfm2_ff_dim(intermediate_size, multiple_of, multiplier, True)
        config.update({
            "block_dim": hidden_size,
            "block_ff_dim": intermediate_size,
            "block_multiple_of": multiple_of,
            "block_ffn_dim_multiplier": multiplier,
            "block_auto_adjust_ff_dim": True,
            "full_attn_idxs": [i for i, k in enumerate(kinds) if k == "full_attention"],
        })
    _write_json(out / "config.json", config)
    shapes = lfm2_param_shapes(
        vocab_size=n_vocab, hidden_size=hidden_size, layer_types=kinds, num_heads=num_heads,
        num_kv_heads=num_kv_heads, ff_dim=ff_dim, conv_kernel=conv_kernel,
        num_experts=num_experts if moe else 0, moe_intermediate_size=moe_intermediate_size,
        num_dense_layers=num_dense_layers,
    )
    values = lfm2_random_state(shapes, seed, expert_bias_std=expert_bias_std)
    state: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, v in values.items():
        if name.endswith("expert_bias") and expert_bias_f32:
            state[name], dtypes[name] = v, "F32"
        else:
            state[name], dtypes[name] = f32_to_bf16_bits(v), "BF16"
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    write_safetensors(out / "model.safetensors", state, dtypes=dtypes, metadata={"format": "pt"})
    return out


def build_tiny_family(out_dir: str | os.PathLike[str], family: str, **kwargs: object) -> Path:
    """A tiny random model folder of `family` (one of `FAMILIES`), by its builder's defaults."""
    builders = {
        "qwen2": build_tiny_model,
        "llama": build_tiny_llama,
        "lfm2": lambda out, **kw: build_tiny_lfm2(out, moe=False, **kw),
        "lfm2_moe": lambda out, **kw: build_tiny_lfm2(out, moe=True, **kw),
    }
    if family not in builders:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    return builders[family](out_dir, **kwargs)  # type: ignore[operator]
