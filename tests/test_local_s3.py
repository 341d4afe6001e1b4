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


def start(*args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """The script as a process, and its lines up to "Ctrl-C stops the server."."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
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
