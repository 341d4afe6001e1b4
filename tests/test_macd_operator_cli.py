"""`macd`'s command line for the operator: Ctrl-C anywhere is one line and exit 130, and the
commands macd prints run as printed (every value shell-quoted)."""

from __future__ import annotations

import argparse
import os
import pty
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from macd import cli
from slime_stoa.protocol.store.credentials import SECRET_NAMES


def _read_until(fd: int, text: bytes, timeout: float = 60.0) -> bytes:
    """What the child wrote to `fd` up to and including `text` (AssertionError after `timeout`)."""
    seen = b""
    deadline = time.monotonic() + timeout
    while text not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {text!r}; got {seen!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            assert chunk, f"the child closed its output before {text!r}; got {seen!r}"
            seen += chunk
    return seen


def test_ctrl_c_at_a_prompt_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """`macd join --access-key-id` without a secret asks for it in the terminal; Ctrl-C there (a
    real SIGINT, once the prompt shows) ends macd with one line, no traceback."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_NAMES}
    controller, terminal = pty.openpty()  # stdin a terminal: macd asks (its prompt goes to stderr)
    args = ["join", "s3://bucket/prefix?endpoint=http://127.0.0.1:9", "--run", "r", "--access-key-id", "AKIA",
            "--config", str(tmp_path / "macd.toml")]
    child = subprocess.Popen([sys.executable, "-m", "macd", *args], stdin=terminal, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env, start_new_session=True)
    os.close(terminal)
    try:
        assert child.stderr is not None
        before = _read_until(child.stderr.fileno(), b"secret access key: ")
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        os.close(controller)
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, (before, err)
    assert err.decode().strip().splitlines() == [cli.INTERRUPTED_LINE] and b"Traceback" not in before + err
    assert not (tmp_path / "macd.toml").exists()  # nothing half-written


def test_ctrl_c_in_any_command_is_exit_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import macd.doctor

    def interrupted(*_args: object, **_kw: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(macd.doctor, "main", interrupted)
    assert cli.main(["doctor"]) == 130
    assert capsys.readouterr().err == cli.INTERRUPTED_LINE + "\n"


# -- the commands macd prints run as printed -------------------------------------------------------
HOSTILE_URL = "s3://bucket/pre fix?endpoint=http://127.0.0.1:9&region=auto"  # a `?` (a glob), a `&`, a space


def _printed_command(text: str, program: str) -> list[str]:
    """The command in backquotes in `text` that starts with `program`, split as a shell would."""
    commands = [part for part in text.split("`")[1::2] if part.startswith(program + " ")]
    assert commands, f"no `{program} ...` in {text!r}"
    return shlex.split(commands[0])


def _stoa(argv: list[str]) -> argparse.Namespace:
    from slime_stoa.cli import build_parser

    assert argv[0] == "stoa"
    return build_parser().parse_args(argv[1:])


def test_join_of_a_missing_run_prints_a_run_create_that_runs_as_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket = tmp_path / "my bucket & co?"
    bucket.mkdir()
    url = f"file://{bucket}"
    assert cli.main(["join", url, "--run", "nope", "--config", str(tmp_path / "macd.toml")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    args = _stoa(_printed_command(err, "stoa"))
    assert (args.store, args.run, args.model, args.task) == (url, "nope", "MODEL", "TASK")


def test_every_printed_command_quotes_its_values(tmp_path: Path) -> None:
    from dataclasses import replace

    from macd.cmdline import run_create_command
    from macd.config import DaemonConfig
    from macd.join_cmd import join_report, no_worker_key_warning
    from macd.worker import WorkerKeyError, check_signing
    from slime_stoa.protocol.run_manifest import RunManifest
    from slime_stoa.protocol.signing import SigningKey

    args = _stoa(shlex.split(run_create_command(HOSTILE_URL, "r")))
    assert (args.store, args.run) == (HOSTILE_URL, "r")
    config = DaemonConfig(store=HOSTILE_URL, run="r", name="mac", worker_id="mac-1", data_dir=tmp_path,
                          run_key=SigningKey.generate().public.to_text())
    warning = no_worker_key_warning(config)
    assert warning is not None
    args = _stoa(_printed_command(warning, "stoa"))
    assert (args.store, args.run, args.key, args.out) == (HOSTILE_URL, "r", Path("RUN_KEY_FILE"), Path("FILE"))
    manifest = RunManifest(run="r", model="m", task="synthetic", run_key=config.run_key)
    with pytest.raises(WorkerKeyError) as refused:
        check_signing(manifest, None, HOSTILE_URL)
    args = _stoa(_printed_command(str(refused.value), "stoa"))
    assert (args.store, args.run) == (HOSTILE_URL, "r")
    path = tmp_path / "a folder" / "macd.toml"
    lines = join_report(replace(config, run_key=""), path, None, kept_id=False, creds_written=False)
    run = _printed_command(lines[-1], "macd")
    assert run == ["macd", "run", "--config", str(path)]
