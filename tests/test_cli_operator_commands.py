"""Command lines `stoa` prints for someone to run come back, word for word, when pasted into bash
or zsh (macOS's shell): a `?` or `&` in a bucket URL, a space or a quote in a path."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from macd import config as cfg
from macd.cli import main as macd
from slime_stoa.cli import main as stoa
from slime_stoa.cli.common import shell_command
from slime_stoa.cli.worker_cmd import Issued, join_command
from slime_stoa.protocol.registry import Registry, WorkerEntry
from slime_stoa.protocol.signing import SigningKey, read_key_file

HOSTILE_URL = "s3://bucket/runs?endpoint=http://127.0.0.1:9000&region=us-east-1"
SHELLS = [s for s in ("bash", "zsh") if shutil.which(s)]


def as_the_shell_reads_it(shell: str, line: str) -> list[str]:
    """The words `shell` passes to the command of `line` (the command itself stands in as a
    function printing its arguments one per line, NUL-free)."""
    program = shlex.split(line)[0]
    script = f"{program}() {{ printf '%s\\n' \"$@\"; }}\n{line}\n"
    done = subprocess.run([shell, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and not done.stderr, (shell, line, done.stderr)
    return done.stdout.splitlines()


@pytest.mark.parametrize("shell", SHELLS)
def test_a_url_with_query_and_ampersand_survives_the_shell(shell: str) -> None:
    argv = ["macd", "join", HOSTILE_URL, "--run", "r", "--worker-key", "it's here.worker-key"]
    line = shell_command(*argv)
    assert shlex.split(line) == argv
    assert as_the_shell_reads_it(shell, line) == argv[1:]


def test_the_join_line_of_worker_add_names_the_url_and_the_run_key_exactly() -> None:
    key = SigningKey.generate()
    entry = WorkerEntry(worker="mac-000001", name="mac", key=SigningKey.generate().public, added_at=0.0)
    issued = Issued(entry=entry, path=Path("/keys/mac-000001.worker-key"),
                    registry=Registry(run="r", serial=1, workers={"mac-000001": entry}), run_key=key.public.to_text())
    assert shlex.split(join_command(HOSTILE_URL, "r", issued)) == [
        "macd", "join", HOSTILE_URL, "--run", "r", "--run-key", key.public.to_text(),
        "--worker-key", "mac-000001.worker-key",
    ]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("MACD_CONFIG", "STOA_ENV_FILE", "STOA_STORE", "STOA_RUN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    return home


def signed_run(bucket: Path, run: str, run_key: Path) -> tuple[str, Path]:
    """A signed run `run` in the folder bucket `bucket`, made with `stoa`; (its URL, its key file)."""
    url = f"file://{bucket}"
    assert stoa(["keys", "create", str(run_key)]) == 0
    assert stoa(["run", "create", "--store", url, "--run", run, "--model", "m", "--task", "synthetic",
                 "--key", str(run_key)]) == 0
    return url, run_key


def test_worker_add_prints_a_join_that_macd_accepts_as_printed(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket = tmp_path / "the bucket & co's"  # a space, an `&` and a quote in the URL
    bucket.mkdir()
    url, run_key = signed_run(bucket, "demo", tmp_path / "run.key")
    mac = tmp_path / "on the mac"
    mac.mkdir()
    capsys.readouterr()
    assert stoa(["worker", "add", "studio", "--store", url, "--run", "demo", "--key", str(run_key),
                 "--out", str(mac / "studio's.worker-key")]) == 0
    line = next(ln.strip() for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("macd join"))
    argv = shlex.split(line)
    pinned = read_key_file(run_key).public.to_text()
    assert argv == ["macd", "join", url, "--run", "demo", "--run-key", pinned, "--worker-key", "studio's.worker-key"]
    for shell in SHELLS:
        assert as_the_shell_reads_it(shell, line) == argv[1:]
    monkeypatch.chdir(mac)  # where the key file was copied to
    conf = tmp_path / "conf" / "macd.toml"
    assert macd([*argv[1:], "--config", str(conf), "--data-dir", str(tmp_path / "data")]) == 0
    joined = cfg.load_config(conf)
    assert joined.run_key == pinned and joined.worker_id.startswith("studio-")
