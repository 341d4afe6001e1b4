"""`macd`'s command line for the operator: Ctrl-C anywhere is one line and exit 130, and the
commands macd prints run as printed (every value shell-quoted)."""

from __future__ import annotations

import os
import pty
import select
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
