"""The run manifest and `stoa run create/show`."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_stoa.cli import main
from slime_stoa.protocol.run_manifest import RunManifest


def test_round_trip() -> None:
    m = RunManifest(run="r1", model="tiny", task="gsm8k", group_size=4, stop=("\n\n",), created_at=1.0)
    assert RunManifest.from_bytes(m.to_bytes()) == m


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"plane": "fp8"}, "plane"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 0.9}, "top_p"),
        ({"group_size": 1}, "group_size"),
        ({"run": "bad name"}, "invalid run name"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_bad_settings_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunManifest(**{"run": "r", "model": "m", "task": "t", **changes})


def test_from_bytes_rejects_foreign_documents() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        RunManifest.from_bytes(b"{")
    with pytest.raises(ValueError, match=r"stoa\.run/1"):
        RunManifest.from_bytes(b'{"format": "other"}')
    doc = RunManifest(run="r", model="m", task="t").to_bytes().replace(b'"model"', b'"colour": 1, "model"')
    with pytest.raises(ValueError, match="unknown fields"):
        RunManifest.from_bytes(doc)


def test_cli_create_and_show(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url = f"file://{tmp_path}"
    args = ["run", "create", url, "--run", "demo", "--model", "tiny", "--task", "synthetic", "--group-size", "4"]
    assert main(args) == 0
    assert main(args) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["run", "show", url, "--run", "demo"]) == 0
    shown = RunManifest.from_bytes(capsys.readouterr().out.encode())
    assert (shown.run, shown.task, shown.group_size) == ("demo", "synthetic", 4)
    assert main(["run", "show", url, "--run", "nope"]) == 1
    assert "stoa run create" in capsys.readouterr().err
