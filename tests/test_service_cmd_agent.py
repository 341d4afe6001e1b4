"""`macd start | stop | uninstall` for real (not dry runs), against a stand-in `launchctl` on
PATH that keeps the agent's loaded state in a file: what each command does and says."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from macd.cli import main as macd

FAKE_LAUNCHCTL = """#!/bin/sh
echo "$*" >> "$FAKE_LAUNCHCTL_CALLS"
case "$1" in
  print) [ -f "$FAKE_LAUNCHCTL_LOADED" ] || exit 1 ;;
  bootstrap) touch "$FAKE_LAUNCHCTL_LOADED" ;;
  bootout) rm -f "$FAKE_LAUNCHCTL_LOADED" ;;
esac
exit 0
"""


@pytest.fixture
def launchd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private HOME and a stand-in launchctl first on PATH; the file its calls are logged to."""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bin_dir.mkdir()
    tool = bin_dir / "launchctl"
    tool.write_text(FAKE_LAUNCHCTL)
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "calls"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LAUNCHCTL_CALLS", str(calls))
    monkeypatch.setenv("FAKE_LAUNCHCTL_LOADED", str(tmp_path / "loaded"))
    return calls


def test_start_stop_uninstall_say_what_they_did(launchd: Path, capsys) -> None:
    uid = os.getuid()
    target = f"user/{uid}/dev.stoa.macd"
    plist = Path(os.environ["HOME"]) / "Library" / "LaunchAgents" / "dev.stoa.macd.plist"
    log = Path(os.environ["HOME"]) / "Library" / "Logs" / "stoa" / "macd.log"

    def run(command: str) -> tuple[int, str, str]:
        rc = macd([command, "--domain", "user"])
        out, err = capsys.readouterr()
        return rc, out, err

    assert run("stop") == (0, "dev.stoa.macd was not running; it stays stopped until `macd start`\n", "")
    rc, out, err = run("start")
    assert (rc, out) == (1, "") and "does not exist: run `macd install` first" in err

    plist.parent.mkdir(parents=True)
    plist.write_text("<plist/>")
    assert run("start") == (0, "dev.stoa.macd started; see `macd status` and `macd logs -f`\n", "")
    assert run("start") == (0, "dev.stoa.macd restarted; see `macd status` and `macd logs -f`\n", "")
    assert run("stop") == (0, "dev.stoa.macd stopped; it stays stopped until `macd start`\n", "")
    assert run("uninstall") == (
        0, f"dev.stoa.macd removed ({plist})\nthe config, credentials, data and log ({log}) are kept\n", "")
    assert not plist.exists()
    assert run("uninstall") == (
        0, f"dev.stoa.macd was not installed\nthe config, credentials, data and log ({log}) are kept\n", "")
    assert f"kickstart -k {target}" in launchd.read_text().splitlines()
