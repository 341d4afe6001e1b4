"""Which model architectures a run can use: one answer for every command that takes a model.

A run's weights travel under their Hugging Face names and a worker installs them into mlx-lm's
model of the same family; the trainer learns with transformers (CPU learner) or Megatron
(slime). A family is supported when all three agree on the tensors: its HF names map onto
mlx-lm's parameters one to one (or through `macd.hf_layout`, as LFM2's do) and the loop has run on
it. Any other family would be accepted by the bucket and fail later, far from its cause (a GPT-2
checkpoint stores its projections transposed from mlx-lm's, so a worker cannot install it), so
`stoa run create`, `stoa weights publish-anchor`, `stoa quickstart --model` and `macd join` refuse
it up front with `unsupported_model`'s line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: model_type of config.json -> what the family is, for the refusal's list.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "Llama, SmolLM2",
    "qwen2": "Qwen2, Qwen2.5",
    "lfm2": "LFM2",
    "lfm2_moe": "LFM2-MoE, LFM2.5-8B-A1B",
}

_MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KB; a larger one is not read


def supported_list() -> str:
    """The supported families, for a message."""
    return ", ".join(f"{t} ({what})" for t, what in SUPPORTED_MODEL_TYPES.items())


def unsupported_config(config: Mapping[str, Any]) -> str:
    """Why a model of this config.json cannot run ("" when its model_type is supported)."""
    model_type = config.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return ""
    shown = repr(model_type) if isinstance(model_type, str) else "missing"
    return f"model_type {shown[:80]} is not supported (supported: {supported_list()})"


def unsupported_model(folder: Path) -> str:
    """Why the model folder `folder` cannot run ("" when it can): its config.json is missing,
    unreadable, or names an unsupported model_type. One line, naming the folder."""
    path = Path(folder) / "config.json"
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        return f"{folder}: cannot read config.json ({exc.strerror or exc})"
    if len(raw) > _MAX_CONFIG_BYTES:
        return f"{path}: larger than {_MAX_CONFIG_BYTES} bytes, not a model config"
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        return f"{path}: not valid JSON ({exc})"
    if not isinstance(config, dict):
        return f"{path}: not a JSON object"
    why = unsupported_config(config)
    return f"{folder}: {why}" if why else ""
