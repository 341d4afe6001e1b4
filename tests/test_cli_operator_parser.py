"""A mistyped flag is reported by the command that got it: its usage, one error line naming the
closest flag it has, exit status 2; never `stoa`'s top-level usage."""

from __future__ import annotations

import argparse

import pytest

from slime_stoa.cli import build_parser, main

TOLERANT = {("preflight",)}  # takes unknown flags on purpose: they are slime's


def leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command that runs something, as (its words after `stoa`, its parser)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(path, parser)]
    return [leaf for name, child in subs[0].choices.items() for leaf in leaves(child, (*path, name))]


def typo(flag: str) -> str:
    """`--store` -> `--sotre`: two letters after the dashes swapped."""
    return flag[:3] + flag[4] + flag[3] + flag[5:]


def error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_run_create_with_store_mistyped(capsys: pytest.CaptureFixture[str]) -> None:
    err = error_of(["run", "create", "--stroe", "x"], capsys)
    assert err.startswith("usage: stoa run create ")
    assert err.splitlines()[-1] == "stoa run create: error: unrecognized arguments: --stroe x; did you mean --store?"
    assert "Traceback" not in err and "usage: stoa [-h]" not in err


def test_the_typo_comes_before_what_it_left_missing(capsys: pytest.CaptureFixture[str]) -> None:
    """`--tsak` is why `--task` is missing: the line names the typo, not the missing flag."""
    err = error_of(["run", "create", "--store", "file:///b", "--run", "r", "--model", "m", "--tsak=gsm8k"], capsys)
    assert err.splitlines()[-1].endswith("unrecognized arguments: --tsak=gsm8k; did you mean --task?")
    assert error_of(["run", "create", "--store", "file:///b"], capsys).splitlines()[-1] == (
        "stoa run create: error: the following arguments are required: --model, --task"
    )


def test_every_command_suggests_its_own_flag(capsys: pytest.CaptureFixture[str]) -> None:
    commands = [(path, p) for path, p in leaves(build_parser()) if path not in TOLERANT]
    assert len(commands) > 15, [path for path, _ in commands]
    for path, parser in commands:
        flag = max((o for a in parser._actions for o in a.option_strings if o.startswith("--") and len(o) > 5), key=len)
        err = error_of([*path, typo(flag)], capsys)
        prog = " ".join(("stoa", *path))
        assert err.startswith(f"usage: {prog} "), (path, err)
        assert err.splitlines()[-1] == f"{prog}: error: unrecognized arguments: {typo(flag)}; did you mean {flag}?", err
