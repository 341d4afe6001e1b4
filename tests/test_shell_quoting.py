"""One helper quotes every command line stoa and macd print (`slime_stoa.protocol.shell`): both
sides use it, nothing else in the code joins or quotes shell words, and what it prints comes back
word for word, in bash and zsh too, for a URL holding `?`, `&` and a space."""

from __future__ import annotations

import ast
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from macd import cmdline
from macd import service as svc
from macd.join_cmd import join_report
from slime_stoa.cli import common
from slime_stoa.cli.quickstart_cmd import inspect_commands
from slime_stoa.protocol import shell
from slime_stoa.protocol.shell import run_create_command, shell_command, task_prepare_command
from slime_stoa.quickstart.config import QuickstartConfig

REPO = Path(__file__).resolve().parent.parent
HOSTILE_URL = "s3://bucket/pre fix?endpoint=http://127.0.0.1:9000&region=auto"
SHELLS = [s for s in ("bash", "zsh") if shutil.which(s)]


def as_the_shell_reads_it(shell_name: str, line: str) -> list[str]:
    """The words `shell_name` passes to the command of `line` (the command stands in as a function
    printing its arguments one per line)."""
    program = shlex.split(line)[0]
    script = f"{program}() {{ printf '%s\\n' \"$@\"; }}\n{line}\n"
    done = subprocess.run([shell_name, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and not done.stderr, (shell_name, line, done.stderr)
    return done.stdout.splitlines()


def test_both_sides_use_the_one_helper() -> None:
    assert common.shell_command is shell_command
    assert cmdline.run_create_command is run_create_command
    assert cmdline.task_prepare_command is task_prepare_command
    assert cmdline.TASK_SOURCES is shell.TASK_SOURCES


def test_no_other_code_joins_or_quotes_shell_words() -> None:
    """`shlex.join` and `shlex.quote` appear only in protocol/shell.py (`shlex.split`, reading
    shell words, is another job)."""
    found = []
    for package in ("slime_stoa", "macd"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path == REPO / "slime_stoa" / "protocol" / "shell.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "shlex"
                    and node.attr in ("join", "quote")
                ) or (isinstance(node, ast.ImportFrom) and node.module == "shlex"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"quote printed commands with slime_stoa.protocol.shell.shell_command: {found}"


@pytest.mark.parametrize(
    "argv",
    [
        ["stoa", "fleet", "--store", HOSTILE_URL, "--run", "r"],
        ["macd", "run", "--config", "/Users/me/a folder/it's macd.toml"],
        ["stoa", "worker", "add", "NAME", "--store", "file:///tmp/b&c?", "--run", "r;x", "--key", "$HOME/k"],
    ],
)
def test_a_command_comes_back_word_for_word(argv: list[str]) -> None:
    line = shell_command(*argv)
    assert shlex.split(line) == argv
    for name in SHELLS:
        assert as_the_shell_reads_it(name, line) == argv[1:]


def test_a_path_is_a_word() -> None:
    assert shell_command("rm", "-f", Path("/a b/c")) == "rm -f '/a b/c'"


def test_the_shared_commands() -> None:
    assert shlex.split(run_create_command(HOSTILE_URL, "r")) == [
        "stoa", "run", "create", "--store", HOSTILE_URL, "--run", "r", "--model", "MODEL", "--task", "TASK",
    ]
    assert shlex.split(task_prepare_command("search", "train", HOSTILE_URL, "r")) == [
        "stoa", "task", "prepare", "search", "QA_FILE", "CORPUS_FILE", "--store", HOSTILE_URL, "--run", "r",
        "--split", "train",
    ]


def test_the_quickstarts_inspect_commands() -> None:
    cfg = QuickstartConfig(store=HOSTILE_URL, run="demo")
    for line, command in zip(inspect_commands(cfg), (["weights", "status"], ["fleet"], ["run", "show"]), strict=True):
        assert shlex.split(line) == ["stoa", *command, "--store", HOSTILE_URL, "--run", "demo"]


def test_macds_service_dry_run_prints_commands_that_run_as_printed(tmp_path: Path) -> None:
    printed: list[str] = []
    launchctl = svc.Launchctl(dry_run=True, echo=printed.append)
    agent = svc.Agent(label="dev.stoa.macd", domain="gui/501", plist=tmp_path / "a folder" / "x.plist",
                      log=tmp_path / "log")
    svc.uninstall(agent, launchctl)
    assert shlex.split(printed[-1]) == ["rm", "-f", str(agent.plist)]


def test_macd_joins_next_line_quotes_the_config_path(tmp_path: Path) -> None:
    from macd.config import DaemonConfig

    config = DaemonConfig(store=HOSTILE_URL, run="r", name="mac", worker_id="mac-1", data_dir=tmp_path)
    path = tmp_path / "it's here" / "macd.toml"
    last = join_report(config, path, None, kept_id=False, creds_written=False)[-1]
    run = last.split("`")[1]
    assert shlex.split(run) == ["macd", "run", "--config", str(path)]
