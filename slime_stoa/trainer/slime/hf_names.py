"""The HF tensor names the publisher must produce: exactly the HF folder's (`--hf-checkpoint`).

slime's converter (`slime/backends/megatron_utils/megatron_to_hf/`) maps every Megatron
parameter the weight iterator gathers to HF names; the iterator gathers the union of the
parameters of every pipeline stage (`_get_megatron_local_param_infos` in
`update_weight/hf_weight_iterator_direct.py`). With tied embeddings
(no `--untie-embeddings-and-output-weights`) and `--pipeline-model-parallel-size` 1, Megatron
allocates no output-layer weight, so nothing becomes `lm_head.weight`. With more than one stage,
the last stage holds its own copy, `output_layer.weight` (kept equal to the embedding by
Megatron's embedding-gradient all-reduce), and the converter emits it as `lm_head.weight`, a
tensor a tied HF folder (Qwen2.5-0.5B/1.5B/3B, `tie_word_embeddings: true`) does not have.
`head_plan` says what the publisher does: leave it out (a tied folder without a head tensor),
add it as a copy of the embedding (a tied folder that stores one, at one stage), or refuse
(Megatron's tying contradicts the folder's config). The published state then has the folder's
names.

Families slime has no converter for (LFM2, LFM2-MoE: `Unsupported model` in slime's
`convert_to_hf`) get stoa's own Megatron -> HF naming (`family_converter`), so what the publisher
emits does not depend on slime knowing the family.

Torch-free: preflight uses it on a box without torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_stoa.protocol.hf.folders import INDEX_NAME
from slime_stoa.protocol.hf.safetensors_io import read_header

TIED_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


def read_config(folder: Path) -> dict[str, Any] | None:
    """The folder's config.json, or None when it has none that parses as an object."""
    try:
        doc = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def config_ties(config: Mapping[str, Any] | Any) -> bool:
    """Whether an HF config ties the output head to the embedding: `tie_word_embeddings`, at the
    top or in `text_config`; transformers' default (True) when neither sets it."""
    get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
    value = get("tie_word_embeddings", None)
    if value is None:
        text = get("text_config", None)
        if isinstance(text, Mapping):
            value = text.get("tie_word_embeddings")
        elif text is not None:
            value = getattr(text, "tie_word_embeddings", None)
    return True if value is None else bool(value)


def folder_tensor_names(folder: Path) -> frozenset[str] | None:
    """The tensor names of an HF folder's weights: the index's `weight_map`, else every
    `*.safetensors` header; None when the folder has neither (or one does not parse)."""
    try:
        index = json.loads((folder / INDEX_NAME).read_text(encoding="utf-8"))
    except OSError:
        index = None
    except ValueError:
        return None
    if index is not None:
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        return frozenset(weight_map) if isinstance(weight_map, dict) else None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    try:
        for path in files:
            names.update(t.name for t in read_header(path).tensors)
    except (OSError, ValueError):
        return None
    return frozenset(names)


@dataclass(frozen=True)
class HeadPlan:
    """How the gathered state's output head is made the HF folder's (`head_plan`)."""

    drop: bool = False
    """Leave `lm_head.weight` out (the folder ties the head and has no such tensor)."""
    copy: bool = False
    """Add `lm_head.weight` as a copy of the embedding (the folder ties the head but stores it)."""
    error: str | None = None
    """Megatron's tying contradicts the folder's: training a different model than the folder's."""


def head_plan(folder: Path | None, *, untied: bool, hf_config: Any = None) -> HeadPlan:
    """The `HeadPlan` for slime's HF folder, given whether Megatron unties the head
    (`--untie-embeddings-and-output-weights`). The folder's config.json, else `hf_config`
    (slime's `AutoConfig` of it), says whether it ties; its tensor names whether it stores a head
    (unknown: a tied config stores none)."""
    config = read_config(folder) if folder is not None else None
    if config is None and hf_config is None:
        return HeadPlan()
    ties = config_ties(config if config is not None else hf_config)
    names = folder_tensor_names(folder) if folder is not None else None
    stored = names is not None and TIED_HEAD in names
    where = f"the HF folder {folder}" if folder is not None else "the HF config"
    if ties and untied:
        return HeadPlan(error=(
            f"--untie-embeddings-and-output-weights trains a separate output head, but {where} ties it to the "
            "embedding (tie_word_embeddings): remove --untie-embeddings-and-output-weights"
        ))
    if not ties and not untied:
        return HeadPlan(error=(
            f"{where} has its own output head (tie_word_embeddings false) but Megatron ties it to the embedding: "
            "add --untie-embeddings-and-output-weights"
        ))
    if ties:
        return HeadPlan(copy=True) if stored else HeadPlan(drop=True)
    return HeadPlan()


#: A replacement for slime's `HfWeightIteratorDirect._convert_to_hf_named_tensors`: (the gathered
#: full Megatron tensors, their ParamInfos) -> [(HF name, tensor)].
HfConverter = Callable[[Sequence[Any], Sequence[Any]], list[tuple[str, Any]]]


def family_converter(hf_config: Mapping[str, Any] | Any) -> HfConverter | None:
    """stoa's Megatron -> HF naming for a family slime cannot convert (`lfm2`, `lfm2_moe`, by the
    config's `model_type`); None for every other family (slime's converter names those).

    The tensors keep their dtype (the fp32 expert biases stay fp32 until the publisher's bf16
    cast) and the embedding loses Megatron's vocabulary padding (`vocab_size`)."""
    from .lfm2.convert import MODEL_TYPES, Lfm2Shape, to_hf

    get = hf_config.get if isinstance(hf_config, Mapping) else (lambda k, d=None: getattr(hf_config, k, d))
    if get("model_type", None) not in MODEL_TYPES:
        return None
    shape = Lfm2Shape.from_hf(hf_config)

    def convert(params: Sequence[Any], infos: Sequence[Any]) -> list[tuple[str, Any]]:
        return [pair for info, param in zip(infos, params, strict=True) for pair in to_hf(info.name, param, shape)]

    return convert
