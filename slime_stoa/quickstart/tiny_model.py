"""A tiny random Qwen2 model folder for tests, built offline in well under a second.

The folder holds a Qwen2 ``config.json``, random bf16 weights under the HF parameter names, a
byte-level BPE tokenizer trained with ``tokenizers`` and a ``tokenizer_config.json`` with a
ChatML chat template, so both ``mlx_lm.load`` and transformers' ``from_pretrained`` load it.
Only numpy, ``tokenizers`` and the standard library are used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from slime_stoa.protocol.hf.folders import f32_to_bf16_bits, save_hf_folder

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


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
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
    """Write a tiny random Qwen2 model folder to `out_dir` and return its path.

    The tokenizer is trained on `texts` (default: `default_corpus()`) up to `vocab_size`
    tokens, then `added_tokens` (e.g. a tool task's tags) are added whole, so that each is one
    token wherever it occurs; the model's vocab is the larger of `vocab_size` and the
    tokenizer's. Deterministic for given arguments.
    """
    if hidden_size % num_heads or num_heads % num_kv_heads or (hidden_size // num_heads) % 2:
        raise ValueError(
            "need hidden_size divisible by num_heads into an even head_dim, and num_heads "
            f"divisible by num_kv_heads; got {hidden_size=}, {num_heads=}, {num_kv_heads=}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(default_corpus() if texts is None else texts, vocab_size)
    if added_tokens:
        tok.add_tokens(list(added_tokens))
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    n_vocab = max(vocab_size, tok.get_vocab_size())
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
    _write_json(out / "config.json", {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
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
        "attention_dropout": 0.0,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
    })
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
        "pad_token_id": ids[ENDOFTEXT],
    })
    shapes = qwen2_param_shapes(
        vocab_size=n_vocab,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
    )
    save_hf_folder(random_state(shapes, seed), out)
    return out
