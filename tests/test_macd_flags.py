"""The options of `macd join` and `macd run` come from `DaemonConfig`'s fields, theirs and
`macd doctor`'s from their own dataclasses (`slime_stoa.protocol.cli_fields`), and that helper itself."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from macd.cli import build_parser
from macd.cli import main as macd
from macd.config import DaemonConfig
from macd.doctor import DoctorInputs
from macd.join_cmd import KEPT_ON_REJOIN, JoinInputs
from macd.run_cmd import RunInputs
from slime_stoa.protocol.cli_fields import Flag, add_field_options, field_values, flag_of, help_of, option_name, setting
from slime_stoa.quickstart.config import TASKS, QuickstartConfig
from tests.scripts_loader import load_script

#: Every option of `macd join` as users type it (`store` is the positional BUCKET_URL).
JOIN_OPTIONS = {
    "store": [],
    "run": ["--run"],
    "name": ["--name"],
    "worker_id": ["--worker-id"],
    "data_dir": ["--data-dir"],
    "credentials_file": ["--credentials-file"],
    "batch": ["--batch"],
    "run_key": ["--run-key"],
    "worker_key": ["--worker-key"],
    "rollouts_store": ["--rollouts-store"],
    "rollouts_credentials_file": ["--rollouts-credentials-file"],
    "plane": ["--plane"],
    "access_key_id": ["--access-key-id"],
    "secret_access_key": ["--secret-access-key"],
    "credentials_stdin": ["--credentials-stdin"],
    "no_check": ["--no-check"],
    "config": ["--config"],
}
#: Every option of `macd run` as users type it (the launchd agent and the quickstart pass them).
RUN_OPTIONS = {
    "config": ["--config"],
    "max_cohorts": ["--max-cohorts"],
    "seed": ["--seed"],
    "parent_pid": ["--parent-pid"],
    "lock_wait": ["--lock-wait"],
    "wandb_project": ["--wandb-project"],
}
#: Every option of `macd doctor` as users type it (README, docs and the quickstart's messages name them).
DOCTOR_OPTIONS = {
    "config": ["--config"],
    "data_dir": ["--data-dir"],
    "plan_for": ["--plan-for"],
    "plan_config": ["--plan-config"],
    "plan_device": ["--plan-device"],
    "plan_planes": ["--plan-planes"],
    "plan_group_size": ["--plan-group-size"],
    "plan_batch": ["--plan-batch"],
    "plan_prompt_tokens": ["--plan-prompt-tokens"],
    "plan_response_tokens": ["--plan-response-tokens"],
    "plan_index_gb": ["--plan-index-gb"],
}


def command(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if not isinstance(a, argparse._HelpAction)}


def names(cls: type, key: str) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if flag_of(f, key) is not None}


def test_every_join_flag_is_a_field_and_every_join_field_a_flag() -> None:
    join = options(command("join"))
    config_fields = names(DaemonConfig, "join")
    assert set(join) == config_fields | {f.name for f in dataclasses.fields(JoinInputs)} | {"config"}
    assert {name: join[name].option_strings for name in join} == JOIN_OPTIONS
    # a field join does not set is kept from the previous config: none is lost on a re-join
    assert {f.name for f in dataclasses.fields(DaemonConfig)} - config_fields == set(KEPT_ON_REJOIN) - config_fields
    for name in config_fields:  # the rule, as no join field needs an override
        assert join[name].option_strings in ([], [option_name(name)])
        flag = flag_of(DaemonConfig.__dataclass_fields__[name], "join")
        assert flag is not None and join[name].help == flag.help


def test_join_flags_take_the_fields_types_and_default_to_not_given() -> None:
    join = command("join")
    got = join.parse_args(["file:///b", "--run", "r"])
    assert got.store == "file:///b" and got.run == "r"
    assert all(getattr(got, name) is None for name in names(DaemonConfig, "join") - {"store", "run"})
    assert got.credentials_stdin is False and got.no_check is False
    got = join.parse_args([
        "s3://b/p", "--run", "r", "--batch", "3", "--data-dir", "d", "--worker-key", "k.json",
        "--credentials-file", "c.env", "--rollouts-credentials-file", "w.env", "--no-check", "--credentials-stdin",
    ])
    assert got.batch == 3 and got.data_dir == Path("d") and got.worker_key == Path("k.json")
    assert got.credentials_file == Path("c.env") and got.rollouts_credentials_file == Path("w.env")
    assert got.no_check is True and got.credentials_stdin is True
    assert options(join)["store"].metavar == "BUCKET_URL" and options(join)["run_key"].metavar == "TEXT"
    with pytest.raises(SystemExit):
        join.parse_args(["file:///b"])  # --run is required
    with pytest.raises(SystemExit):
        join.parse_args(["file:///b", "--run", "r", "--batch", "many"])


def test_every_run_flag_is_a_field_and_every_run_field_a_flag() -> None:
    """No option of `macd run` is declared by hand: each is a `RunInputs` field or a `DaemonConfig`
    field with `run=`, and every `RunInputs` field is one (`--config` is every command's)."""
    run = options(command("run"))
    own = {f.name for f in dataclasses.fields(RunInputs)}
    assert names(RunInputs, "run") == own
    assert set(run) == own | names(DaemonConfig, "run") | {"config"}
    assert names(DaemonConfig, "run") == {"wandb_project"}
    assert {name: run[name].option_strings for name in run} == RUN_OPTIONS
    for cls in (RunInputs, DaemonConfig):
        for name in names(cls, "run"):
            flag = flag_of(cls.__dataclass_fields__[name], "run")
            assert flag is not None and run[name].help.startswith(flag.help)


def test_run_flags_take_the_fields_types_and_defaults() -> None:
    run = command("run")
    got = run.parse_args([])
    assert field_values(got, RunInputs, "run") == dataclasses.asdict(RunInputs())
    assert (got.max_cohorts, got.seed, got.parent_pid, got.lock_wait, got.wandb_project) == (None, None, None, 0.0, None)
    got = run.parse_args(["--max-cohorts", "2", "--seed", "3", "--parent-pid", "17", "--lock-wait", "1.5",
                          "--wandb-project", "p"])
    assert RunInputs(**field_values(got, RunInputs, "run")) == RunInputs(max_cohorts=2, seed=3, parent_pid=17, lock_wait=1.5)
    assert got.wandb_project == "p"
    assert options(run)["parent_pid"].metavar == "PID" and options(run)["lock_wait"].metavar == "SECONDS"
    assert options(run)["wandb_project"].default is None and options(run)["wandb_project"].metavar == "NAME"
    assert options(run)["lock_wait"].help.endswith("naming its pid (default: 0.0)")
    for bad in (["--parent-pid", "0"], ["--seed", "x"], ["--lock-wait", "soon"]):
        with pytest.raises(SystemExit):
            run.parse_args(bad)


def test_every_doctor_flag_is_a_field_and_every_doctor_field_a_flag() -> None:
    """No option of `macd doctor` is declared by hand: each is a `DoctorInputs` field, and every
    field is one (`--config` is every command's)."""
    doctor = options(command("doctor"))
    own = {f.name for f in dataclasses.fields(DoctorInputs)}
    assert names(DoctorInputs, "doctor") == own
    assert set(doctor) == own | {"config"}
    assert {name: doctor[name].option_strings for name in doctor} == DOCTOR_OPTIONS
    for name in own:
        flag = flag_of(DoctorInputs.__dataclass_fields__[name], "doctor")
        assert flag is not None and doctor[name].help.startswith(flag.help)


def test_doctor_flags_take_the_fields_types_and_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    doctor = command("doctor")  # the data folder is read when the parser is built, not at import
    got = doctor.parse_args([])
    assert field_values(got, DoctorInputs, "doctor") == dataclasses.asdict(DoctorInputs())
    assert got.data_dir == tmp_path / "stoa" and got.config is None
    assert (got.plan_for, got.plan_config, got.plan_device, got.plan_planes, got.plan_index_gb) == (None, None, "gpu", "", None)
    assert (got.plan_group_size, got.plan_batch, got.plan_prompt_tokens, got.plan_response_tokens) == (8, 2, 512, 1536)
    got = doctor.parse_args([
        "--data-dir", "d", "--plan-for", "16,24", "--plan-config", "c.json", "--plan-device", "cpu",
        "--plan-planes", "int8", "--plan-group-size", "4", "--plan-batch", "3", "--plan-prompt-tokens", "64",
        "--plan-response-tokens", "128", "--plan-index-gb", "2.5",
    ])
    assert DoctorInputs(**field_values(got, DoctorInputs, "doctor")) == DoctorInputs(
        data_dir=Path("d"), plan_for="16,24", plan_config=Path("c.json"), plan_device="cpu", plan_planes="int8",
        plan_group_size=4, plan_batch=3, plan_prompt_tokens=64, plan_response_tokens=128, plan_index_gb=2.5,
    )
    shown = options(doctor)
    assert shown["plan_for"].metavar == "GB[,GB...]" and shown["plan_planes"].metavar == "PLANE[,PLANE...]"
    assert shown["plan_device"].choices == ("gpu", "cpu")
    assert shown["plan_batch"].help == "prompts decoding at once (default: 2)"
    assert shown["plan_planes"].help.endswith("(default: none)")  # not an empty "(default: )"
    assert "(default: ~/Library/Application Support/stoa on macOS" in shown["data_dir"].help
    for bad in (["--plan-device", "tpu"], ["--plan-batch", "x"], ["--plan-index-gb", "big"]):
        with pytest.raises(SystemExit):
            doctor.parse_args(bad)


def test_every_doctor_option_has_its_row_in_the_docs() -> None:
    table = load_script("settings_docs").macd_doctor_table()  # tests/test_settings_docs.py: docs/macd.md holds it
    for f in dataclasses.fields(DoctorInputs):
        assert f"| `{option_name(f.name)}` |" in table
    assert "| `--plan-batch` | `2` | prompts decoding at once |" in table and "| `--data-dir` | — |" in table


@pytest.mark.parametrize("flag", ["--plan-group-size", "--plan-batch", "--plan-prompt-tokens", "--plan-response-tokens"])
def test_a_doctor_count_below_one_is_named_as_typed(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert macd(["doctor", "--plan-for", "16", flag, "0"]) == 1
    assert capsys.readouterr().err == f"error: {flag} must be 1 or more (got 0)\n"


# -- the helper ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    where: str = dataclasses.field(metadata={"cmd": Flag(positional=True, metavar="URL", help="where")})
    level: Literal["low", "high"] = dataclasses.field(default="low", metadata={"cmd": "how hard"})
    count: int | None = dataclasses.field(default=None, metadata={"cmd": "how many"})
    folder: Path = dataclasses.field(default=Path("out"), metadata={"cmd": "folder"})
    lines: int = dataclasses.field(default=50, metadata={"cmd": Flag(aliases=("-n",), help="lines")})
    quiet: bool = dataclasses.field(default=False, metadata={"cmd": "say less"})
    colour: str = dataclasses.field(default="red", metadata={"cmd": Flag(option="--color", help="colour")})
    ident: str = dataclasses.field(default="", metadata={"cmd": Flag(type=int, required=True, help="id")})
    hidden: int = 0  # no metadata for the command: no option


def sample_parser(**kwargs: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    assert add_field_options(parser, Sample, "cmd", **kwargs) == [
        "where", "level", "count", "folder", "lines", "quiet", "colour", "ident"
    ]
    return parser


def test_options_follow_the_fields() -> None:
    parser = sample_parser()
    got = parser.parse_args(["x", "--ident", "7"])
    assert field_values(got, Sample, "cmd") == {
        "where": "x", "level": "low", "count": None, "folder": Path("out"), "lines": 50, "quiet": False,
        "colour": "red", "ident": 7,
    }
    got = parser.parse_args(["x", "--level", "high", "--count", "2", "--folder", "f", "-n", "3", "--quiet",
                             "--color", "blue", "--ident", "1"])
    assert (got.level, got.count, got.folder, got.lines, got.quiet, got.colour) == ("high", 2, Path("f"), 3, True, "blue")
    assert not hasattr(got, "hidden")
    with pytest.raises(SystemExit):
        parser.parse_args(["x", "--ident", "1", "--level", "mid"])  # not a choice
    with pytest.raises(SystemExit):
        parser.parse_args(["x"])  # --ident is required
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["level"] == "how hard (default: low)" and helps["count"] == "how many" and helps["quiet"] == "say less"


def test_without_defaults_every_option_is_not_given() -> None:
    got = sample_parser(with_defaults=False).parse_args(["x", "--ident", "1"])
    assert (got.level, got.count, got.folder, got.lines, got.quiet, got.colour) == (None, None, None, None, False, None)
    helps = {a.dest: a.help for a in sample_parser(with_defaults=False)._actions}
    assert helps["level"] == "how hard"


def test_bad_metadata_is_a_type_error() -> None:
    @dataclasses.dataclass
    class Bad:
        x: int = dataclasses.field(default=0, metadata={"cmd": 3})

    with pytest.raises(TypeError, match="help text or a Flag"):
        add_field_options(argparse.ArgumentParser(), Bad, "cmd")


def test_a_setting_is_documented_once_and_an_option_where_its_metadata_says() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Conf:
        depth: int = setting("how deep", 3, cmd=True)  # the option takes the field's own help
        name: str = setting("what it is called", "x", cmd="the option's own words")
        kept: int = setting("edited in the file only", 1)

    assert [help_of(f) for f in dataclasses.fields(Conf)] == ["how deep", "what it is called", "edited in the file only"]
    parser = argparse.ArgumentParser()
    assert add_field_options(parser, Conf, "cmd") == ["depth", "name"]
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["depth"] == "how deep (default: 3)" and helps["name"] == "the option's own words (default: x)"
    everything = argparse.ArgumentParser()  # under HELP every documented field is an option, with its help
    assert add_field_options(everything, Conf) == ["depth", "name", "kept"]
    assert field_values(everything.parse_args(["--kept", "5"]), Conf) == {"depth": 3, "name": "x", "kept": 5}

    @dataclasses.dataclass
    class Undocumented:
        x: int = dataclasses.field(default=0, metadata={"cmd": True})  # True needs a help text to show

    with pytest.raises(TypeError, match="help text or a Flag"):
        add_field_options(argparse.ArgumentParser(), Undocumented, "cmd")

    @dataclasses.dataclass
    class BareFlag:
        x: int = dataclasses.field(default=0, metadata={"cmd": Flag(metavar="N")})  # nor does a Flag without help

    with pytest.raises(TypeError, match="help text or a Flag"):
        add_field_options(argparse.ArgumentParser(), BareFlag, "cmd")


def test_an_empty_text_default_is_not_shown_in_the_help() -> None:
    """An empty default says nothing: no " (default: )"; the parsed value is still the field's."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Conf:
        planes: str = setting("planes to plan (default: none)", "", cmd=True)
        name: str = setting("what it is called", "x", cmd=True)

    parser = argparse.ArgumentParser()
    add_field_options(parser, Conf, "cmd")
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["planes"] == "planes to plan (default: none)" and helps["name"] == "what it is called (default: x)"
    assert field_values(parser.parse_args([]), Conf, "cmd") == {"planes": "", "name": "x"}


def test_a_flag_without_help_takes_the_fields_own() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Conf:
        wait: float = setting("how long to wait", 0.0, cmd=Flag(metavar="SECONDS"))
        pid: int | None = setting("whose end to watch", None, cmd=Flag(metavar="PID", help="the option's words"))

    parser = argparse.ArgumentParser()
    add_field_options(parser, Conf, "cmd")
    helps = {a.dest: (a.help, a.metavar) for a in parser._actions}
    assert helps["wait"] == ("how long to wait (default: 0.0)", "SECONDS")
    assert helps["pid"] == ("the option's words", "PID")


def test_quickstart_options_come_from_the_same_helper() -> None:
    parser = argparse.ArgumentParser()
    assert add_field_options(parser, QuickstartConfig) == [f.name for f in dataclasses.fields(QuickstartConfig)]
    task = options(parser)["task"]
    assert task.choices == TASKS and task.default == "synthetic" and task.help.endswith("(default: synthetic)")
    assert parser.parse_args(["--max-versions", "3"]).max_versions == 3
