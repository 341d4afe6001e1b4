"""The `file://` bucket on a full disk: its writes say it in one line naming the size and the object's
path (`fsutil.DiskFull`, as every stoa writer does), leave no temp file behind and keep the object
that was there. The full disk is simulated at `os.write`, as in tests/test_cli_operator_disk_full.py."""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from slime_stoa.cli import main as stoa
from slime_stoa.protocol.fsutil import DiskFull
from slime_stoa.protocol.store.local import LocalStore
from tests.test_cli_operator_disk_full import fill_disk


def temp_files(root: Path) -> list[Path]:
    tmp = root / ".stoa-tmp"
    return sorted(tmp.iterdir()) if tmp.exists() else []


@pytest.mark.parametrize("durable", [True, False])
async def test_a_put_names_the_size_and_the_objects_path_and_keeps_the_old_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    store = LocalStore(tmp_path, durable=durable)
    await store.put("runs/r/weights.bin", b"the old weights")
    fill_disk(monkeypatch, free=5_000_000)
    with pytest.raises(DiskFull) as raised:
        await store.put("runs/r/weights.bin", bytes(12_345_678))
    assert raised.value.errno == errno.ENOSPC and isinstance(raised.value, OSError)
    assert str(raised.value) == f"no space left on device writing 12.3 MB to {tmp_path / 'runs' / 'r' / 'weights.bin'}"
    assert (await store.get_bytes("runs/r/weights.bin")) == b"the old weights"
    assert temp_files(tmp_path) == []


async def test_a_streamed_put_if_absent_counts_what_it_was_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield bytes(1_000_000)

    store = LocalStore(tmp_path)
    fill_disk(monkeypatch, free=2_500_000)
    path = tmp_path / "runs" / "r" / "new.bin"
    with pytest.raises(DiskFull, match=rf"^no space left on device writing 3\.0 MB to {path}$"):
        await store.put_if_absent("runs/r/new.bin", chunks())
    assert not path.exists() and temp_files(tmp_path) == []
    assert [info.key async for info in store.list()] == []


async def test_the_writes_that_fit_still_succeed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalStore(tmp_path)
    fill_disk(monkeypatch, free=100_000)
    await store.put_if_absent("a", bytes(60_000))
    assert (await store.head("a")).size == 60_000
    with pytest.raises(DiskFull, match=r"writing 60\.0 KB to "):
        await store.put("b", bytes(60_000))
    assert temp_files(tmp_path) == []


def test_stoa_says_it_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`stoa run create` into a file:// bucket on a full disk: one line naming the run manifest."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    fill_disk(monkeypatch, free=0)
    assert stoa(["run", "create", "--store", f"file://{bucket}", "--run", "r", "--model", "m", "--task", "synthetic"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no space left on device writing ")
    assert err.endswith(f" bytes to {bucket / 'runs' / 'r' / 'run.json'}\n"), err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not (bucket / "runs").exists() and temp_files(bucket) == []
