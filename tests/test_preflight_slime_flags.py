"""preflight reads the launch flags with slime's own parser where slime imports: a stand-in
`slime.utils.arguments` (and `megatron.training.arguments`) built the way slime's are, with
slime's `get_slime_extra_args_provider(add_custom_arguments)` returning a function that adds
slime's flags to a parser; where slime is not importable, one line says the flags were read
with preflight's copy."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import pytest

from slime_stoa.trainer.slime import preflight
from slime_stoa.trainer.slime.preflight_slime_api import SLIME_COMMIT
from tests import slime_standins


def _slime_provider(add_custom_arguments: object = None) -> object:
    def add_slime_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        # as slime declares them, except a default of its own that preflight's copy does not have
        parser.add_argument("--rollout-temperature", type=float, default=0.8)
        parser.add_argument("--advantage-estimator", type=str, choices=["grpo", "gspo", "ppo"], default="grpo")
        parser.add_argument("--rollout-batch-size", type=int, default=None)
        parser.add_argument("--slime-only", type=int, default=7)  # a flag preflight's copy does not know
        return parser

    return add_slime_arguments


def _megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=4)
    return parser


def install(monkeypatch: pytest.MonkeyPatch, *, slime: bool, megatron: bool = False) -> None:
    for name in [n for n in sys.modules if n.split(".")[0] in ("slime", "megatron")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not Path(p, "slime").is_dir()])
    modules: dict[str, types.ModuleType] = {}
    if slime:
        modules.update(slime_standins.modules())
        arguments = types.ModuleType("slime.utils.arguments")
        arguments.get_slime_extra_args_provider = _slime_provider  # type: ignore[attr-defined]
        modules["slime.utils.arguments"] = arguments
    if megatron:
        for name in ("megatron", "megatron.training"):
            modules[name] = types.ModuleType(name)
        megatron_arguments = types.ModuleType("megatron.training.arguments")
        megatron_arguments.add_megatron_arguments = _megatron_arguments  # type: ignore[attr-defined]
        modules["megatron.training.arguments"] = megatron_arguments
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_where_slime_imports_its_own_parser_reads_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, slime=True)
    flag_parser = preflight.slime_flag_parser()
    assert flag_parser.unavailable == ""
    flags, unknown = preflight.parse_slime_args(["--rollout-batch-size", "8", "--debug-train-only", "--", "--x"], flag_parser)
    assert flags.rollout_temperature == 0.8  # slime's default, not the copy's 1.0
    assert flags.slime_only == 7 and flags.rollout_batch_size == 8 and unknown == ["--x"]
    assert flags.debug_train_only is True  # slime parses it in a pre-pass: the copy adds it
    assert flags.pipeline_model_parallel_size == 1  # Megatron's, not importable here: from the copy
    with pytest.raises(ValueError, match="slime flags: argument --advantage-estimator: invalid choice: 'nope'"):
        preflight.parse_slime_args(["--advantage-estimator", "nope"])  # the copy alone would take it
    line = preflight.check_flag_parser(flag_parser)
    assert line.status == preflight.OK and "slime's own parser" in line.message


def test_megatrons_arguments_come_first_where_megatron_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, slime=True, megatron=True)
    flags, _ = preflight.parse_slime_args([])
    assert flags.pipeline_model_parallel_size == 4 and flags.rollout_temperature == 0.8


def test_without_slime_the_copy_reads_the_flags_and_one_line_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, slime=False)
    flag_parser = preflight.slime_flag_parser()
    assert "ModuleNotFoundError" in flag_parser.unavailable and "slime" in flag_parser.unavailable
    flags, _ = preflight.parse_slime_args(["--advantage-estimator", "nope"], flag_parser)
    assert flags.advantage_estimator == "nope" and flags.rollout_temperature == 1.0
    line = preflight.check_flag_parser(flag_parser)
    assert line.status == preflight.OK and line.check == "slime-flags" and "\n" not in line.message
    assert line.message.startswith("slime is not importable here") and SLIME_COMMIT[:12] in line.message
    with pytest.raises(ValueError, match="slime flags: argument --rollout-batch-size: invalid int value: 'x'"):
        preflight.parse_slime_args(["--rollout-batch-size", "x"], flag_parser)
