"""The trainer's last Megatron checkpoint as an HF folder: slime's own converter, LFM2 named by stoa.

    python -m slime_stoa.trainer.slime.checkpoint_to_hf --slime-dir DIR --checkpoint SAVE_DIR \
        --hf MODEL_DIR --out OUT_DIR

runs slime's `tools/convert_torch_dist_to_hf.py` on the iteration SAVE_DIR's
`latest_checkpointed_iteration.txt` names (what Megatron's own `save` wrote, slime's `--save`),
with the model's vocabulary (`--vocab-size`, from MODEL_DIR's config.json) and its files
(`--origin-hf-dir`). What it writes never went through stoa's publisher: it is the source of "the
trainer's weights" that `published_bits` compares the published ones with.

slime's converter names the families it knows (Qwen2, ...). For LFM2 and LFM2-MoE, which it does
not, slime's `convert_to_hf` is replaced for this process by stoa's naming (`lfm2.convert.to_hf`,
the one the publisher's hook uses). Megatron's checkpoint stores each parameter stacked over the
layers; an LFM2 layer has only its kind's parameters (a conv layer no attention, a dense layer no
experts), so the slots of a stacked tensor that no layer of that kind fills are left out: only the
names the model has (`lfm2.convert.megatron_names`) are converted.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: slime's converter, relative to its checkout.
TOOL = Path("tools") / "convert_torch_dist_to_hf.py"
#: The module whose `convert_to_hf` the tool imports.
SLIME_NAMING = "slime.backends.megatron_utils.megatron_to_hf"


def iteration_dir(save_dir: Path) -> Path:
    """The checkpoint folder of the latest iteration Megatron saved in `save_dir` (its
    `latest_checkpointed_iteration.txt`: a number, `iter_%07d`, or `release`). ValueError when
    there is none."""
    tracker = save_dir / "latest_checkpointed_iteration.txt"
    try:
        text = tracker.read_text().strip()
    except OSError as exc:
        raise ValueError(f"no Megatron checkpoint in {save_dir}: cannot read {tracker.name} ({exc.strerror})") from None
    if text == "release":
        folder = save_dir / "release"
    elif text.isdigit():
        folder = save_dir / f"iter_{int(text):07d}"
    else:
        raise ValueError(f"{tracker} holds {text[:40]!r}, not an iteration number or 'release'")
    if not folder.is_dir():
        raise ValueError(f"{tracker} names iteration {text}, but {folder} is not a folder")
    return folder


def lfm2_naming(hf_config: dict[str, Any]) -> Callable[..., list[tuple[str, Any]]] | None:
    """A stand-in for slime's `convert_to_hf(args, model_name, name, param, ...)` that names an
    LFM2 model's parameters as stoa's publisher does; None for a family slime names itself.
    A name the model does not have (the unfilled slot of a stacked tensor) converts to nothing."""
    from .lfm2.convert import MODEL_TYPES, Lfm2Shape, megatron_names, to_hf

    if hf_config.get("model_type") not in MODEL_TYPES:
        return None
    shape = Lfm2Shape.from_hf(hf_config)
    known = {*megatron_names(shape, "te"), "output_layer.weight"}

    def convert_to_hf(_args: Any, _model_name: str, name: str, param: Any, *_rest: Any, **_kw: Any) -> list[tuple[str, Any]]:
        bare = name
        while bare.startswith("module."):
            bare = bare.removeprefix("module.")
        if bare not in known:
            return []
        return to_hf(bare, param, shape)

    return convert_to_hf


def convert(slime_dir: Path, save_dir: Path, hf_dir: Path, out_dir: Path) -> list[str]:
    """Run slime's converter on the latest checkpoint in `save_dir`; the argv it ran with."""
    tool = slime_dir / TOOL
    if not tool.is_file():
        raise ValueError(f"slime's converter {tool} does not exist (SLIME_DIR={slime_dir})")
    try:
        hf_config = json.loads((hf_dir / "config.json").read_text())
        vocab = int(hf_config["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read vocab_size from {hf_dir / 'config.json'}: {exc}") from None
    argv = [str(tool), "--input-dir", str(iteration_dir(save_dir)), "--output-dir", str(out_dir),
            "--origin-hf-dir", str(hf_dir), "--vocab-size", str(vocab)]
    naming = lfm2_naming(hf_config)
    sys.path.insert(0, str(slime_dir))
    if naming is not None:
        import importlib

        module: Any = importlib.import_module(SLIME_NAMING)
        module.convert_to_hf = naming  # the tool imports it by name, after this
    saved = sys.argv
    sys.argv = argv
    try:
        runpy.run_path(str(tool), run_name="__main__")
    finally:
        sys.argv = saved
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slime_stoa.trainer.slime.checkpoint_to_hf",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--slime-dir", type=Path, required=True, help="slime's checkout")
    parser.add_argument("--checkpoint", type=Path, required=True, help="the run's Megatron --save folder")
    parser.add_argument("--hf", type=Path, required=True, help="the model's HF folder (--hf-checkpoint)")
    parser.add_argument("--out", type=Path, required=True, help="the HF folder to write (must not exist)")
    args = parser.parse_args(argv)
    try:
        ran = convert(args.slime_dir, args.checkpoint, args.hf, args.out)
    except ValueError as exc:
        print(f"checkpoint_to_hf: error: {exc}", file=sys.stderr)
        return 2
    print(f"converted {ran[2]} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
