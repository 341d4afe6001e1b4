"""`stoa store check`: passes on both real backends, and fails on a store that breaks stoa's
semantics even under `python -O` (the checks are exceptions, not asserts)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slime_stoa.cli import main

pytestmark = pytest.mark.both_backends  # the store itself: every test on both backends


def test_store_check_passes_on_a_real_store(
    store_url: str, store_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in store_env.items():
        monkeypatch.setenv(name, value)
    assert main(["store", "check", store_url]) == 0
    out = capsys.readouterr().out
    assert "put-if-absent again (refused)" in out and "store OK" in out


# A local store whose put-if-absent overwrites (If-None-Match ignored), checked with -O.
_BROKEN = textwrap.dedent(
    """
    import argparse, pathlib, sys
    from slime_stoa.cli import store_cmd
    from slime_stoa.protocol.store.local import LocalStore

    class Overwriting(LocalStore):
        async def put_if_absent(self, key, data):
            return await self.put(key, data)

    store_cmd.open_store = lambda url, create=False: Overwriting(pathlib.Path(sys.argv[1]))
    sys.exit(store_cmd.run_check(argparse.Namespace(url="file://" + sys.argv[1], store=None, create=False)))
    """
)


@pytest.mark.file_only
def test_store_check_fails_under_python_O_on_broken_semantics(tmp_path: Path) -> None:
    root = tmp_path / "bucket"
    root.mkdir()
    done = subprocess.run(
        [sys.executable, "-O", "-c", _BROKEN, str(root)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "store check FAILED" in done.stderr and "If-None-Match is not honoured" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.file_only
def test_store_commands_take_the_bucket_from_stoa_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "bucket"
    (root / "runs" / "demo").mkdir(parents=True)
    (root / "runs" / "demo" / "current.json").write_text("{}")
    (root / "other.txt").write_text("x")
    monkeypatch.setenv("STOA_STORE", f"file://{root}")
    assert main(["store", "check"]) == 0 and "store OK" in capsys.readouterr().out
    assert main(["store", "ls", "runs/demo/"]) == 0  # a lone argument without a scheme is the prefix
    assert capsys.readouterr().out.split() == ["2", "runs/demo/current.json"]
    assert main(["store", "ls"]) == 0
    assert "other.txt" in capsys.readouterr().out
    monkeypatch.delenv("STOA_STORE")
    with pytest.raises(SystemExit, match="no bucket given: pass --store URL or set STOA_STORE"):
        main(["store", "ls"])
    assert main(["store", "ls", "--store", f"file://{root}", "runs/"]) == 0


def test_a_file_url_with_two_slashes_points_at_the_missing_slash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bucket").mkdir()
    monkeypatch.chdir(tmp_path / "bucket")  # here, tmp/... relative does not exist; /tmp does
    assert main(["store", "ls", "file://tmp/stoa-x"]) == 1
    err = capsys.readouterr().err
    assert "(two slashes) is the folder tmp/stoa-x relative to here; for /tmp/stoa-x write file:///tmp/stoa-x" in err
    assert main(["store", "ls", f"file://{tmp_path}/missing"]) == 1
    assert f"mkdir -p {tmp_path}/missing" in capsys.readouterr().err
