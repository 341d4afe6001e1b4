"""Hugging Face model folders <-> stoa weight state, with numpy alone.

A weight state is ``dict[str, np.ndarray]`` of dtype ``uint16`` holding bf16 bit patterns in the
tensor's logical shape, under the HF parameter names (which mlx-lm uses too).

`load_hf_state` reads ``model.safetensors`` or the shards named by
``model.safetensors.index.json``; `save_hf_folder` writes bf16 shards (and the index) plus the
config and tokenizer files, so the folder loads with transformers and ``mlx_lm.load``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from slime_stoa.protocol.fsutil import atomic_file, atomic_write
from slime_stoa.protocol.hf.safetensors_io import (
    FILE_MODE,
    read_safetensors,
    write_safetensors,
)
from slime_stoa.protocol.layout import check_name

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

#: Non-weight files of a model folder worth shipping with the weights.
CONFIG_FILE_NAMES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


# ---------------------------------------------------------------------------- bf16 conversion


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bf16 (round to nearest, ties to even); return the uint16 bits.

    Matches torch's ``.to(torch.bfloat16)`` and MLX's ``astype(mx.bfloat16)`` on every non-NaN
    value: overflow rounds to ±inf and subnormals are kept. Every NaN becomes the canonical quiet
    NaN ``0x7FC0`` (as in MLX and torch's scalar path; torch's vectorised CPU path yields 0xFFFF).
    """
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise ValueError(f"f32_to_bf16_bits wants a float32 array, got {x.dtype}")
    u = x.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half to even; no finite value overflows uint32.
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    bits = np.array(rounded).astype(np.uint16)  # np.array: 0-d ops yield scalars
    bits[np.isnan(x)] = np.uint16(0x7FC0)
    return bits


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns (uint16) to float32 exactly."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise ValueError(f"bf16_bits_to_f32 wants a uint16 array, got {bits.dtype}")
    return np.array(bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _to_bf16_bits(name: str, dtype: str, arr: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        return arr
    if dtype == "F32":
        return f32_to_bf16_bits(arr)
    if dtype == "F16":
        return f32_to_bf16_bits(arr.astype(np.float32))  # f16 -> f32 is exact
    raise ValueError(
        f"tensor {name!r} has dtype {dtype}; stoa loads only BF16, F32 or F16 weights"
    )


# ----------------------------------------------------------------------------- file names


def safe_child(folder: str | os.PathLike[str], name: str) -> Path:
    """`folder / name`, for a `name` that is one safe path component staying inside `folder`.

    The name must follow the layout's file-name grammar (`check_name`: ASCII letters, digits,
    `.`, `_`, `-`; no separator, no `.`/`..`, no NUL, no device name), and the resolved path must
    lie directly inside the resolved folder. ValueError otherwise. This is the defence at the
    write site; names from the bucket are also checked where they are parsed.
    """
    check_name("file", name)
    base = Path(folder).resolve()
    path = base / name
    if path.parent != base or os.path.isabs(name):
        raise ValueError(f"file name {name!r} would leave the folder {base}")
    return path


# ----------------------------------------------------------------------------------- loading


def _weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model folder, the single file preferred over an index."""
    single = model_dir / WEIGHTS_NAME
    if single.is_file():
        return [single]
    index = model_dir / INDEX_NAME
    if not index.is_file():
        raise ValueError(f"{model_dir} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a valid safetensors index ({e})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: weight_map must be a non-empty object")
    if not all(isinstance(name, str) for name in weight_map.values()):
        raise ValueError(f"{index}: shard names must be strings")
    files = sorted(set(weight_map.values()))
    try:
        return [safe_child(model_dir, name) for name in files]
    except ValueError as exc:
        raise ValueError(f"{index}: shard name must be a plain file name ({exc})") from None


def load_hf_state(model_dir: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Read a model folder's weights as bf16 bits: ``{name: uint16 array}``.

    BF16 tensors are kept bit-exact; F32 and F16 are rounded to bf16 (round to nearest even).
    Raises ValueError for other dtypes, a missing file, a name in two shards, or an index whose
    weight_map disagrees with the shards.
    """
    model_dir = Path(model_dir)
    files = _weight_files(model_dir)
    state: dict[str, np.ndarray] = {}
    where: dict[str, str] = {}
    for path in files:
        if not path.is_file():
            raise ValueError(f"shard {path.name} named in {INDEX_NAME} is missing from {model_dir}")
        for name, (dtype, arr) in read_safetensors(path).items():
            if name in state:
                raise ValueError(f"tensor {name!r} is in both {where[name]} and {path.name}")
            state[name] = _to_bf16_bits(name, dtype, arr)
            where[name] = path.name
    if len(files) > 1 or files[0].name != WEIGHTS_NAME:
        weight_map = json.loads((model_dir / INDEX_NAME).read_text())["weight_map"]
        if weight_map != where:
            diff = sorted(set(weight_map.items()) ^ set(where.items()))[:5]
            raise ValueError(f"{INDEX_NAME} disagrees with the shards' contents, e.g. {diff}")
    return state


# ----------------------------------------------------------------------------------- saving


def hf_config_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The non-weight files (config, generation config, tokenizer, chat template) present."""
    model_dir = Path(model_dir)
    return [model_dir / n for n in CONFIG_FILE_NAMES if (model_dir / n).is_file()]


def _check_state(state: Mapping[str, np.ndarray]) -> None:
    if not state:
        raise ValueError("cannot save an empty weight state")
    for name, arr in state.items():
        if not isinstance(arr, np.ndarray) or arr.dtype != np.uint16:
            got = getattr(arr, "dtype", type(arr).__name__)
            raise ValueError(f"tensor {name!r} must be a uint16 array of bf16 bits, got {got}")


def plan_shards(state: Mapping[str, np.ndarray], shard_bytes: int) -> list[list[str]]:
    """Split tensor names, in order, into shards of at most `shard_bytes` each.

    A tensor bigger than `shard_bytes` gets a shard of its own.
    """
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    shards: list[list[str]] = [[]]
    size = 0
    for name, arr in state.items():
        if shards[-1] and size + arr.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += arr.nbytes
    return shards


def _shard_name(i: int, n: int) -> str:
    return WEIGHTS_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _is_weight_file(name: str) -> bool:
    return name == INDEX_NAME or (name.startswith("model") and name.endswith(".safetensors"))


def _copy_atomic(src: Path, dst: Path) -> None:
    with atomic_file(dst, mode=FILE_MODE, durable=False) as f, open(src, "rb") as source:
        shutil.copyfileobj(source, f, 8 << 20)


def _write_json_atomic(path: Path, obj: object) -> None:
    atomic_write(path, (json.dumps(obj, indent=2) + "\n").encode(), mode=FILE_MODE, durable=False)


def save_hf_folder(
    state: Mapping[str, np.ndarray],
    out_dir: str | os.PathLike[str],
    *,
    source_dir: str | os.PathLike[str] | None = None,
    shard_bytes: int = 2 << 30,
) -> Path:
    """Write `state` (bf16 bits) as an HF model folder and return its path.

    Weights go to ``model.safetensors``, or to ``model-0000i-of-0000n.safetensors`` shards of at
    most `shard_bytes` plus ``model.safetensors.index.json`` (with ``metadata.total_size``).
    Weight files of an earlier save in `out_dir` that this save did not write are removed, since
    ``mlx_lm`` loads every ``model*.safetensors``. With `source_dir`, the files of
    `hf_config_files(source_dir)` are copied (it must hold ``config.json``). Tied embeddings
    need nothing special: whatever tensors the state has are saved.
    """
    _check_state(state)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if source_dir is not None:
        src = Path(source_dir)
        if not (src / "config.json").is_file():
            raise ValueError(f"source_dir {src} has no config.json to copy")
        for path in hf_config_files(src):
            dst = safe_child(out, path.name)
            if not (dst.exists() and dst.samefile(path)):
                _copy_atomic(path, dst)
    shards = plan_shards(state, shard_bytes)
    written = {_shard_name(i, len(shards)) for i in range(len(shards))}
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        fname = _shard_name(i, len(shards))
        write_safetensors(out / fname, {n: state[n] for n in names}, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    if len(shards) > 1:
        total = sum(int(a.nbytes) for a in state.values())
        _write_json_atomic(
            out / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map}
        )
        written.add(INDEX_NAME)
    for stale in out.iterdir():
        if stale.is_file() and _is_weight_file(stale.name) and stale.name not in written:
            stale.unlink()
    return out
