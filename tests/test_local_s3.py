"""`scripts/local_s3.py`: the tests' S3 server started by hand; the store works against it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slime_stoa.protocol.store import open_store
from tests.s3server import S3ServerError, find_weed

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "local_s3.py"


def weed_or_skip() -> None:
    try:
        find_weed()
    except S3ServerError as exc:
        pytest.skip(str(exc))


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start(*args: str, sigint_ignored: bool = False) -> tuple[subprocess.Popen[str], list[str]]:
    """The script as a process, and its lines up to "Ctrl-C stops the server."; `sigint_ignored`:
    started as nohup and some CI launchers start it, with SIGINT ignored (kept across exec)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=ignore_sigint if sigint_ignored else None)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("Ctrl-C stops"):
            break
    assert lines and lines[-1].startswith("Ctrl-C stops"), (lines, proc.stderr.read() if proc.stderr else "")
    return proc, lines


def stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return out + err


def test_the_script_serves_a_bucket_the_store_can_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weed_or_skip()
    proc, lines = start("--dir", str(tmp_path / "s3"))
    try:
        text = "\n".join(lines)
        endpoint = re.search(r"^endpoint: (http://127\.0\.0\.1:\d+) ", text, re.M)
        access = re.search(r"^  export AWS_ACCESS_KEY_ID=(\S+)$", text, re.M)
        secret = re.search(r"^  export AWS_SECRET_ACCESS_KEY=(\S+)$", text, re.M)
        assert endpoint and access and secret, text
        assert f"--store 's3://stoa/quickstart?endpoint={endpoint[1]}'" in text
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", access[1])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret[1])

        async def put_get() -> bytes:
            async with open_store(f"s3://stoa/by-hand?endpoint={endpoint[1]}") as store:
                await store.put("hello.txt", b"hello, s3")
                return await store.get_bytes("hello.txt")

        assert asyncio.run(put_get()) == b"hello, s3"
    finally:
        if proc.poll() is None:
            assert "stopping the local S3 server" in stop(proc)
    assert proc.returncode == 0
    assert oct((tmp_path / "s3" / "credentials.env").stat().st_mode & 0o777) == "0o600"


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (`ps` reads them the same on Linux and macOS)."""
    table = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    return [int(p) for p, parent in (line.split() for line in table.splitlines()) if int(parent) == pid]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_stops_it_and_its_server_when_started_with_sigint_ignored() -> None:
    weed_or_skip()
    proc, _ = start(sigint_ignored=True)
    server = children(proc.pid)
    try:
        assert server, "the script runs no server process"
        assert "stopping the local S3 server" in stop(proc)
        assert not [pid for pid in server if alive(pid)], "the S3 server outlived the script"
    finally:  # whatever failed, nothing is left running
        for pid in [proc.pid, *server]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
