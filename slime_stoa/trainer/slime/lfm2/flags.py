"""slime's model flags for an LFM2 / LFM2-MoE HF config. Torch-free.

    python -m slime_stoa.trainer.slime.lfm2.flags HF_DIR

prints them on one line (the launch script's MODEL_ARGS); `spec.transformer_config` builds the
same configuration for a model outside slime.

`--ffn-hidden-size` is the HF config's `intermediate_size`, the value slime's start-up check
(`_hf_validate_args` in slime/backends/megatron_utils/arguments.py) compares it with. A dense LFM2
with `block_auto_adjust_ff_dim` builds a narrower MLP (`dense_ffn_size`); the provider takes that
width from config.json (`model_ffn_size`), so the flag and slime's check stay as they are.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .convert import Lfm2Shape


def _get(config: Mapping[str, Any] | Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)


def intermediate_size(hf: Mapping[str, Any] | Any) -> int:
    """transformers' `intermediate_size` of the config: `Lfm2Config` takes the original configs'
    `block_ff_dim` when there is one."""
    size = _get(hf, "intermediate_size")
    if _get(hf, "model_type") == "lfm2" and _get(hf, "block_ff_dim") is not None:
        size = _get(hf, "block_ff_dim")
    if size is None:
        raise ValueError("the LFM2 config names neither intermediate_size nor block_ff_dim")
    return int(size)


def tie_word_embeddings(hf: Mapping[str, Any] | Any) -> bool:
    """transformers' `tie_word_embeddings`: the original configs' `tie_embedding` wins."""
    tie = _get(hf, "tie_embedding")
    return bool(_get(hf, "tie_word_embeddings", True) if tie is None else tie)


def dense_ffn_size(hf: Mapping[str, Any] | Any) -> int:
    """The dense feed-forward width transformers builds: `Lfm2MoeMLP` takes `intermediate_size`
    as it is; `Lfm2MLP` takes 2/3 of it, times `block_ffn_dim_multiplier` rounded up to
    `block_multiple_of` when `block_auto_adjust_ff_dim` (`Lfm2Config`'s defaults where the config
    names none: True, 1.0, 256)."""
    size = intermediate_size(hf)
    if _get(hf, "model_type") == "lfm2_moe" or not _get(hf, "block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier, multiple = _get(hf, "block_ffn_dim_multiplier", 1.0), int(_get(hf, "block_multiple_of", 256))
    if multiplier is not None:
        size = int(multiplier * size)
        size = multiple * ((size + multiple - 1) // multiple)
    return size


def model_ffn_size(flag: int, hf: Mapping[str, Any] | Any) -> int:
    """The dense MLP width to build for `--ffn-hidden-size flag`: `dense_ffn_size`, when the flag
    is the HF config's `intermediate_size` (what `slime_model_args` gives and slime checks) or
    that width itself; ValueError otherwise."""
    width = dense_ffn_size(hf)
    if flag not in (intermediate_size(hf), width):
        raise ValueError(
            f"--ffn-hidden-size {flag} is neither the HF config's intermediate_size {intermediate_size(hf)} "
            f"nor the MLP width transformers builds from it ({width}); use the flags of "
            "python -m slime_stoa.trainer.slime.lfm2.flags"
        )
    return width


def rope_theta(hf: Mapping[str, Any] | Any) -> float:
    params = _get(hf, "rope_parameters") or {}
    theta = params.get("rope_theta") if isinstance(params, Mapping) else None
    return float(theta or _get(hf, "rope_theta", 1000000.0))


def slime_model_args(hf: Mapping[str, Any] | Any) -> list[str]:
    """slime / Megatron model flags for an LFM2 HF config (the part of a slime `MODEL_ARGS`
    the config decides; parallelism and the provider flag are the launch's)."""
    shape = Lfm2Shape.from_hf(hf)
    args = [
        "--num-layers", str(len(shape.layer_types)),
        "--hidden-size", str(shape.hidden_size),
        "--ffn-hidden-size", str(intermediate_size(hf)),
        "--num-attention-heads", str(shape.num_heads),
        "--group-query-attention", "--num-query-groups", str(shape.num_kv_heads),
        "--kv-channels", str(shape.head_dim),
        "--qk-layernorm",
        "--normalization", "RMSNorm", "--norm-epsilon", repr(float(_get(hf, "norm_eps", 1e-5))),
        "--swiglu", "--disable-bias-linear",
        "--position-embedding-type", "rope", "--rotary-base", str(int(rope_theta(hf))),
        "--vocab-size", str(shape.vocab_size),
    ]
    if not tie_word_embeddings(hf):
        args.append("--untie-embeddings-and-output-weights")
    if shape.moe:
        freq = [0] * shape.num_dense_layers + [1] * (len(shape.layer_types) - shape.num_dense_layers)
        args += [
            "--num-experts", str(shape.num_experts),
            "--moe-ffn-hidden-size", str(int(_get(hf, "moe_intermediate_size"))),
            "--moe-router-topk", str(int(_get(hf, "num_experts_per_tok"))),
            "--moe-layer-freq", "[" + ",".join(map(str, freq)) + "]",
            "--moe-router-score-function", "sigmoid",
            "--moe-router-topk-scaling-factor", repr(float(_get(hf, "routed_scaling_factor", 1.0) or 1.0)),
            "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0",
            "--moe-token-dispatcher-type", "alltoall",
        ]
        if _get(hf, "use_expert_bias", True):
            args += ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0"]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m slime_stoa.trainer.slime.lfm2.flags HF_DIR", file=sys.stderr)
        return 2
    try:
        hf = json.loads((Path(argv[0]) / "config.json").read_text(encoding="utf-8"))
        print(" ".join(slime_model_args(hf)))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
