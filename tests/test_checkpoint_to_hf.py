"""checkpoint_to_hf: the trainer's last Megatron checkpoint through slime's own converter, with
LFM2 named as stoa's provider names it. slime is not installed here: a stand-in converter with
slime's file name and import (`from slime.backends.megatron_utils.megatron_to_hf import
convert_to_hf`) hands every name of its checkpoint, the stacked slots no LFM2 layer has and an
optimizer entry included, to `convert_to_hf` and saves what it returns, as slime's does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file

from slime_stoa.quickstart.tiny_model import build_tiny_family
from slime_stoa.trainer.slime import checkpoint_to_hf
from slime_stoa.trainer.slime.lfm2.convert import Lfm2Shape, hf_to_megatron

STAND_IN_TOOL = """
import argparse, json, sys
from safetensors.torch import load_file, save_file
from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf

p = argparse.ArgumentParser()
for flag in ("--input-dir", "--output-dir", "--origin-hf-dir", "--vocab-size"):
    p.add_argument(flag, required=True)
a = p.parse_args()
out = {}
for name, param in load_file(a.input_dir + "/state.safetensors").items():
    for hf_name, tensor in convert_to_hf(a, "model", "module.module." + name, param):
        out[hf_name] = tensor.contiguous()
import os
os.makedirs(a.output_dir)
save_file(out, a.output_dir + "/model.safetensors")
json.dump(sys.argv[1:], open(a.output_dir + "/argv.json", "w"))
"""

# slime's own naming for the families it knows: here, names as they are.
STAND_IN_NAMING = """
def convert_to_hf(args, model_name, name, param):
    return [(name.removeprefix("module.module."), param)]
"""


@pytest.fixture
def slime(tmp_path: Path):
    root = tmp_path / "slime"
    (root / "tools").mkdir(parents=True)
    (root / "tools" / "convert_torch_dist_to_hf.py").write_text(STAND_IN_TOOL)
    naming = root / "slime" / "backends" / "megatron_utils"
    naming.mkdir(parents=True)
    for folder in (root / "slime", root / "slime" / "backends", naming):
        (folder / "__init__.py").write_text("")
    (naming / "megatron_to_hf.py").write_text(STAND_IN_NAMING)
    yield root
    for name in [m for m in sys.modules if m == "slime" or m.startswith("slime.")]:
        del sys.modules[name]  # the next test's stand-in is another folder
    sys.path[:] = [p for p in sys.path if p != str(root)]


def checkpoint(save_dir: Path, state: dict[str, object], tracker: str = "3") -> Path:
    folder = save_dir / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    folder.mkdir(parents=True)
    save_file(state, str(folder / "state.safetensors"))
    (save_dir / "latest_checkpointed_iteration.txt").write_text(tracker + "\n")
    return folder


def test_an_lfm2_checkpoint_converts_back_to_the_models_own_names_and_tensors(slime: Path, tmp_path: Path) -> None:
    hf = build_tiny_family(tmp_path / "lfm2_moe", "lfm2_moe")
    config = json.loads((hf / "config.json").read_text())
    original = load_file(str(hf / "model.safetensors"))
    megatron = hf_to_megatron(original, Lfm2Shape.from_hf(config))
    # what a stacked checkpoint also holds: a slot no conv layer fills, an optimizer entry
    megatron["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.zeros(3, 3)
    megatron["optimizer.state.exp_avg"] = torch.zeros(4)
    folder = checkpoint(tmp_path / "ckpt", {n: t.contiguous() for n, t in megatron.items()})
    out = tmp_path / "trainer-hf"
    assert checkpoint_to_hf.main(["--slime-dir", str(slime), "--checkpoint", str(tmp_path / "ckpt"),
                                  "--hf", str(hf), "--out", str(out)]) == 0
    argv = json.loads((out / "argv.json").read_text())
    assert argv[argv.index("--input-dir") + 1] == str(folder)
    assert argv[argv.index("--vocab-size") + 1] == str(config["vocab_size"])
    converted = load_file(str(out / "model.safetensors"))
    assert converted.keys() == original.keys()  # tied: no head in either, none made up
    for name, tensor in converted.items():
        assert torch.equal(tensor, original[name]), name


def test_a_family_slime_knows_keeps_slimes_naming(slime: Path, tmp_path: Path) -> None:
    hf = build_tiny_family(tmp_path / "qwen2", "qwen2")
    checkpoint(tmp_path / "ckpt", {"decoder.final_layernorm.weight": torch.ones(4)}, tracker="release")
    out = tmp_path / "trainer-hf"
    checkpoint_to_hf.convert(slime, tmp_path / "ckpt", hf, out)
    assert list(load_file(str(out / "model.safetensors"))) == ["decoder.final_layernorm.weight"]


@pytest.mark.parametrize(("tracker", "error"), [
    (None, "no Megatron checkpoint in"),
    ("iter_x", "not an iteration number or 'release'"),
    ("7", "is not a folder"),
])
def test_a_missing_checkpoint_is_one_line(tmp_path: Path, capsys, tracker: str | None, error: str) -> None:
    save = tmp_path / "ckpt"
    save.mkdir()
    if tracker is not None:
        (save / "latest_checkpointed_iteration.txt").write_text(tracker)
    (tmp_path / "slime" / "tools").mkdir(parents=True)
    (tmp_path / "slime" / "tools" / "convert_torch_dist_to_hf.py").write_text("")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"vocab_size": 8}')
    rc = checkpoint_to_hf.main(["--slime-dir", str(tmp_path / "slime"), "--checkpoint", str(save), "--hf", str(hf),
                                "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and error in err[0], err
    assert not (tmp_path / "out").exists()


def test_iteration_numbers_are_megatrons_folder_names(tmp_path: Path) -> None:
    checkpoint(tmp_path, {"x": torch.zeros(1)}, tracker="12")
    assert checkpoint_to_hf.iteration_dir(tmp_path) == tmp_path / "iter_0000012"
