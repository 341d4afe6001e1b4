"""The model flags stoa gives slime for LFM2 / LFM2-MoE (`lfm2.flags`) pass slime's start-up check
of them against the HF config, and the provider builds the dense MLP as wide as transformers does.

slime cannot be installed here, so the check is restated: `SLIME_HF_CHECKS` is the list of pairs
slime's `_hf_validate_args` (slime/backends/megatron_utils/arguments.py, slime HEAD) compares, with
its rule for skipping the dense width on MoE configs without dense layers and its rope_theta lookup.
The HF side is transformers' config object, as slime reads it (`AutoConfig.from_pretrained`); the
Megatron side is our flags parsed with the types Megatron-LM declares for them
(megatron/training/arguments.py)."""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

from macd.memory_plan import LFM2_5_8B_A1B
from slime_stoa.quickstart.tiny_model import build_tiny_family
from slime_stoa.trainer.slime.lfm2.flags import dense_ffn_size, model_ffn_size, slime_model_args

# (HF config attribute, Megatron arg, comparison): slime's `_hf_validate_args`, in its order.
SLIME_HF_CHECKS: list[tuple[str, str, Callable[[Any, Any], bool]]] = [
    ("hidden_size", "hidden_size", operator.eq),
    ("num_attention_heads", "num_attention_heads", operator.eq),
    ("num_hidden_layers", "num_layers", operator.eq),
    ("intermediate_size", "ffn_hidden_size", operator.eq),
    ("moe_intermediate_size", "moe_ffn_hidden_size", operator.eq),
    ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", operator.eq),
    ("tie_word_embeddings", "untie_embeddings_and_output_weights", operator.ne),
    ("rms_norm_eps", "norm_epsilon", operator.eq),
    ("rms_norm_eps", "layernorm_epsilon", operator.eq),
]


def megatron_args(flags: list[str]) -> argparse.Namespace:
    """Our flags as Megatron parses them (its types and defaults for the args slime checks)."""
    parser = argparse.ArgumentParser()
    for name in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
                 "--kv-channels", "--vocab-size", "--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk",
                 "--moe-shared-expert-intermediate-size"):
        parser.add_argument(name, type=int)
    parser.add_argument("--rotary-base", type=int, default=10000)
    parser.add_argument("--norm-epsilon", type=float, default=1e-5)
    parser.add_argument("--moe-layer-freq", type=lambda s: ast.literal_eval(s) if s.startswith("[") else int(s),
                        default=1)
    for name in ("--untie-embeddings-and-output-weights", "--group-query-attention", "--qk-layernorm", "--swiglu",
                 "--disable-bias-linear", "--moe-router-enable-expert-bias"):
        parser.add_argument(name, action="store_true")
    args, _rest = parser.parse_known_args(flags)
    return args


def slime_hf_check(args: argparse.Namespace, hf: Any) -> list[str]:
    """What slime's `_hf_validate_args` would report (empty: it passes)."""
    hf = getattr(hf, "text_config", hf)
    params = getattr(hf, "rope_parameters", None)
    theta = params["rope_theta"] if isinstance(params, dict) and "rope_theta" in params else getattr(hf, "rope_theta", None)
    is_moe = any(hasattr(hf, a) for a in ("moe_intermediate_size", "num_experts", "n_routed_experts", "num_local_experts"))
    freq = args.moe_layer_freq
    has_dense = any(int(f) == 0 for f in freq) if isinstance(freq, list) else int(freq) == 0
    errors = []
    for hf_name, arg_name, compare in SLIME_HF_CHECKS:
        if hf_name == "intermediate_size" and is_moe and not has_dense:
            continue
        if hasattr(hf, hf_name) and hasattr(args, arg_name) and not compare(getattr(hf, hf_name), getattr(args, arg_name)):
            errors.append(f"{hf_name} {getattr(hf, hf_name)} vs {arg_name} {getattr(args, arg_name)}")
    if theta is not None and theta != args.rotary_base:
        errors.append(f"rope_theta {theta} vs rotary_base {args.rotary_base}")
    return errors


def _folder(root: Path, config: dict[str, Any]) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


# Dense LFM2 as the original checkpoints spell it (`block_ff_dim`, `tie_embedding`,
# `full_attn_idxs`, a top-level `rope_theta`), with the widths of LFM2-1.2B.
ORIGINAL_STYLE_LFM2 = {
    "model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "vocab_size": 65536, "hidden_size": 2048,
    "block_ff_dim": 12288, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "norm_eps": 1e-5,
    "full_attn_idxs": [2, 5, 8, 10, 12, 14], "rope_theta": 1000000.0, "tie_embedding": True, "conv_L_cache": 3,
}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lfm2-configs")
    folders = {f: build_tiny_family(root / f, f) for f in ("lfm2", "lfm2_moe")}
    folders["LFM2.5-8B-A1B"] = _folder(root / "moe8b", {**LFM2_5_8B_A1B, "architectures": ["Lfm2MoeForCausalLM"]})
    folders["Lfm2Config()"] = root / "dense-defaults"
    transformers.Lfm2Config().save_pretrained(folders["Lfm2Config()"])
    folders["original-style lfm2"] = _folder(root / "orig", ORIGINAL_STYLE_LFM2)
    return folders


CONFIGS = ["lfm2", "lfm2_moe", "LFM2.5-8B-A1B", "Lfm2Config()", "original-style lfm2"]


@pytest.mark.parametrize("name", CONFIGS)
def test_our_flags_pass_slimes_hf_check(hf_folders: dict[str, Path], name: str) -> None:
    folder = hf_folders[name]
    flags = slime_model_args(json.loads((folder / "config.json").read_text()))
    hf = transformers.AutoConfig.from_pretrained(folder)
    args = megatron_args(flags)
    assert slime_hf_check(args, hf) == []
    # the pairs slime compares for these configs are there on both sides (the check is not vacuous)
    assert args.ffn_hidden_size == hf.intermediate_size and args.num_layers == hf.num_hidden_layers
    assert args.untie_embeddings_and_output_weights is not hf.tie_word_embeddings
    if hf.model_type == "lfm2_moe":
        assert args.moe_ffn_hidden_size == hf.moe_intermediate_size and 0 in args.moe_layer_freq


@pytest.mark.parametrize("name", ["lfm2", "Lfm2Config()", "original-style lfm2"])
def test_dense_lfm2_builds_transformers_width_not_the_flag(hf_folders: dict[str, Path], name: str) -> None:
    """Dense LFM2 shrinks its MLP (`block_auto_adjust_ff_dim`): slime's check wants the config's
    `intermediate_size` as `--ffn-hidden-size`, the model the width transformers builds."""
    folder = hf_folders[name]
    config = json.loads((folder / "config.json").read_text())
    hf = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):  # shapes only
        built = Lfm2MLP(hf).w1.weight.shape[0]
    assert dense_ffn_size(config) == built != hf.intermediate_size
    flags = slime_model_args(config)
    assert model_ffn_size(megatron_args(flags).ffn_hidden_size, config) == built == model_ffn_size(built, config)
    # the width itself as the flag is what slime's check refuses
    assert slime_hf_check(megatron_args([*flags, "--ffn-hidden-size", str(built)]), hf) == [
        f"intermediate_size {hf.intermediate_size} vs ffn_hidden_size {built}"]
    with pytest.raises(ValueError, match="--ffn-hidden-size 100 is neither"):
        model_ffn_size(100, config)


def test_moe_widths_are_the_configs(hf_folders: dict[str, Path]) -> None:
    config = dict(LFM2_5_8B_A1B)
    assert dense_ffn_size(config) == model_ffn_size(7168, config) == 7168
    with pytest.raises(ValueError, match="neither"):
        model_ffn_size(4864, config)


def test_the_check_catches_what_slime_catches() -> None:
    hf = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_hidden_layers=2, intermediate_size=16,
                         moe_intermediate_size=4, num_experts=4, tie_word_embeddings=True,
                         rope_parameters={"rope_theta": 1e6})
    ok = ["--hidden-size", "8", "--num-attention-heads", "2", "--num-layers", "2", "--ffn-hidden-size", "16",
          "--moe-ffn-hidden-size", "4", "--moe-layer-freq", "[0,1]", "--rotary-base", "1000000"]
    assert slime_hf_check(megatron_args(ok), hf) == []
    all_moe = [*ok, "--moe-layer-freq", "[1,1]", "--ffn-hidden-size", "99"]
    assert slime_hf_check(megatron_args(all_moe), hf) == []  # no dense layer: the dense width is not compared
    bad = [*ok, "--ffn-hidden-size", "99", "--untie-embeddings-and-output-weights", "--rotary-base", "10000"]
    assert [e.split()[0] for e in slime_hf_check(megatron_args(bad), hf)] == [
        "intermediate_size", "tie_word_embeddings", "rope_theta"]


# -- the launch scripts: the torch_dist checkpoint slime starts from ------------------------------------
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPTS / script), *args], env={**base, **env}, capture_output=True, text=True,
                          timeout=60)


def _stand_in_slime(root: Path) -> Path:
    """A slime checkout as far as the launch touches it: train.py, and a converter that records
    its arguments and writes what Megatron's checkpoint loader looks for."""
    (root / "tools").mkdir(parents=True)
    (root / "train.py").write_text("")
    (root / "tools" / "convert_hf_to_torch_dist.py").write_text(
        "import json, os, pathlib, sys\n"
        "save = pathlib.Path(sys.argv[sys.argv.index('--save') + 1])\n"
        "save.mkdir(parents=True)\n"
        "(save / 'latest_checkpointed_iteration.txt').write_text('release')\n"
        "(save / 'argv.json').write_text(json.dumps([sys.argv[1:], os.environ['PYTHONPATH']]))\n"
    )
    return root


def test_lfm2_convert_dry_run_prints_slimes_converter_with_the_provider(hf_folders: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    model = hf_folders["lfm2_moe"]
    proc = _run("run_lfm2_search.sh", "--convert", "--dry-run", MODEL_DIR=str(model), SAVE_DIR=str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr
    command = shlex.split(proc.stdout.strip().splitlines()[-1])
    assert command[2:4] == [sys.executable, "/root/slime/tools/convert_hf_to_torch_dist.py"]
    model_args = slime_model_args(json.loads((model / "config.json").read_text()))
    flags = command[4:]
    assert flags[: len(model_args)] == model_args
    assert flags[len(model_args):] == ["--custom-model-provider-path", "slime_stoa.trainer.slime.lfm2.spec.provider",
                          "--moe-grouped-gemm", "--hf-checkpoint", str(model), "--save", f"{model}_torch_dist"]
    assert not any(tmp_path.iterdir())


def test_a_launch_without_a_megatron_checkpoint_stops_and_says_to_convert(hf_folders: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    model, slime = hf_folders["lfm2_moe"], _stand_in_slime(tmp_path / "slime")
    env = {"MODEL_DIR": str(model), "SLIME_DIR": str(slime), "SAVE_DIR": str(tmp_path / "ckpt"),
           "REF_LOAD": str(tmp_path / "ref")}
    proc = _run("run_lfm2_search.sh", **env)
    assert proc.returncode == 1 and not (tmp_path / "ckpt").exists()
    assert proc.stderr.count("\n") == 1 and f"no Megatron checkpoint in REF_LOAD={tmp_path / 'ref'}" in proc.stderr
    assert "`run_lfm2_search.sh --convert`" in proc.stderr

    converted = _run("run_lfm2_search.sh", "--convert", **env)
    assert converted.returncode == 0, converted.stderr
    argv, pythonpath = json.loads((tmp_path / "ref" / "argv.json").read_text())
    assert argv[argv.index("--custom-model-provider-path") + 1] == "slime_stoa.trainer.slime.lfm2.spec.provider"
    assert str(SCRIPTS.parent) in pythonpath.split(":") and str(slime) in pythonpath.split(":")

    bin_dir = tmp_path / "bin"  # a `ray` that answers and records the job
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "ray.log"}\n')
    (bin_dir / "ray").chmod(0o755)
    launched = _run("run_lfm2_search.sh", **env, SKIP_PREFLIGHT="1", PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert launched.returncode == 0, launched.stderr
    assert f"--ref-load {tmp_path / 'ref'}" in (tmp_path / "ray.log").read_text()
    # the trainer keeps its own copies of what it signs beside its checkpoints
    assert f'stoa_keep_dir: "{tmp_path / "ckpt" / "stoa-kept"}"' in (tmp_path / "ckpt" / "stoa-config.yaml").read_text()


def test_qwen_convert_dry_run_uses_the_same_model_args(tmp_path: Path) -> None:
    models = tmp_path / "slime" / "scripts" / "models"
    models.mkdir(parents=True)
    (models / "qwen2.5-1.5B.sh").write_text("MODEL_ARGS=(--num-layers 28 --rotary-base 10000)\n")
    proc = _run("run_qwen25_gsm8k.sh", "--convert", "--dry-run", SLIME_DIR=str(tmp_path / "slime"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].endswith(
        "convert_hf_to_torch_dist.py --num-layers 28 --rotary-base 10000 --rotary-base 1000000 "
        "--hf-checkpoint /root/Qwen2.5-1.5B-Instruct --save /root/Qwen2.5-1.5B-Instruct_torch_dist")
