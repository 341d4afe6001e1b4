"""A full disk is one line naming the size and the path, and leaves no partial file: in the atomic
write every stoa writer uses (`fsutil.atomic_file`), and at the `stoa` command line.

The full disk is simulated at the OS boundary: `os.write` to a regular file takes what room is left
(a short write), then fails with ENOSPC, as a file system does."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from slime_stoa.cli import main as stoa
from slime_stoa.protocol.fsutil import DiskFull, atomic_file, atomic_write
from tests.test_cli_operator_commands import signed_run


def fill_disk(monkeypatch: pytest.MonkeyPatch, free: int) -> Callable[[], int]:
    """From now on regular files get `free` more bytes in all; returns how many are left."""
    real_write = os.write
    left = [free]

    def write(fd: int, data: bytes | memoryview) -> int:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return real_write(fd, data)  # a pipe or a terminal: not on the disk
        if left[0] == 0 and len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = real_write(fd, memoryview(data)[: left[0]])
        left[0] -= written
        return written

    monkeypatch.setattr(os, "write", write)
    return lambda: left[0]


def test_atomic_write_names_the_size_and_the_path_and_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"the old weights")
    fill_disk(monkeypatch, free=5_000_000)
    with pytest.raises(DiskFull) as raised:
        atomic_write(path, bytes(12_345_678))
    assert raised.value.errno == errno.ENOSPC and isinstance(raised.value, OSError)
    assert str(raised.value) == f"no space left on device writing 12.3 MB to {path}"
    assert path.read_bytes() == b"the old weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temp file left


def test_a_streamed_write_counts_what_it_was_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fill_disk(monkeypatch, free=2_500_000)
    path = tmp_path / "copy.bin"
    expected = rf"^no space left on device writing 3\.0 MB to {path}$"
    with pytest.raises(DiskFull, match=expected), atomic_file(path, durable=False) as f:
        for _ in range(10):
            f.write(bytes(1_000_000))
    assert list(tmp_path.iterdir()) == []


def test_other_write_errors_pass_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fd: int, data: bytes) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "write", broken)
    with pytest.raises(OSError) as raised:
        atomic_write(tmp_path / "x", bytes(10_000))
    assert raised.value.errno == errno.EIO and not isinstance(raised.value, DiskFull)
    assert list(tmp_path.iterdir()) == []


def test_stoa_says_it_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`stoa worker add` writing the worker key file onto a full disk: one line, status 1, no file."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url, run_key = signed_run(bucket, "r", tmp_path / "run.key")
    keys = tmp_path / "keys"
    keys.mkdir()
    capsys.readouterr()
    fill_disk(monkeypatch, free=0)
    assert stoa(["worker", "add", "mac", "--store", url, "--run", "r", "--key", str(run_key),
                 "--out", str(keys / "mac.worker-key")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no space left on device writing ") and err.endswith(f" bytes to {keys / 'mac.worker-key'}\n")
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert list(keys.iterdir()) == []


def test_the_real_full_device_says_the_same(tmp_path: Path) -> None:
    """Where the system has /dev/full (Linux), its ENOSPC comes out as the same line."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    expected = rf"^no space left on device writing 4\.2 KB to {tmp_path / 'x'}$"
    with pytest.raises(DiskFull, match=expected), atomic_file(tmp_path / "x", durable=False) as f:
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, f.fileno())  # the temp file's descriptor now writes to /dev/full
        os.close(full)
        f.write(bytes(4096))
        f.write(bytes(100))
    assert list(tmp_path.iterdir()) == []
