"""The run manifest and `stoa run create/show`."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.cli import main
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig, retention_floor
from slime_stoa.protocol.run_manifest import DEFAULT_RETAIN_ANCHORS, RunManifest
from slime_stoa.protocol.store import open_store


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
    args = ["run", "create", "--store", url, "--run", "demo", "--model", "tiny", "--task", "synthetic", "--group-size", "4"]
    assert main(args) == 0
    assert main(args) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["run", "show", "--store", url, "--run", "demo"]) == 0
    shown = RunManifest.from_bytes(capsys.readouterr().out.encode())
    assert (shown.run, shown.task, shown.group_size) == ("demo", "synthetic", 4)
    assert main(["run", "show", "--store", url, "--run", "nope"]) == 1
    assert "stoa run create" in capsys.readouterr().err


# -- weight retention: a run setting ---------------------------------------------------------------


def test_a_manifest_without_retention_reads_as_the_default() -> None:
    """Manifests written before `retain_anchors` existed keep what the publisher always kept."""
    doc = json.loads(RunManifest(run="r", model="m", task="t", retain_anchors=7).to_bytes())
    del doc["retain_anchors"]
    assert RunManifest.from_bytes(json.dumps(doc).encode()).retain_anchors == DEFAULT_RETAIN_ANCHORS == 2


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2", None, 2**31])
def test_bad_retention_is_refused(bad: object) -> None:
    doc = json.loads(RunManifest(run="r", model="m", task="t").to_bytes())
    doc["retain_anchors"] = bad
    with pytest.raises(ValueError, match="retain_anchors"):
        RunManifest.from_bytes(json.dumps(doc).encode())


def test_cli_create_sets_and_show_prints_the_retention(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url = f"file://{tmp_path}"
    base = ["run", "create", "--store", url, "--model", "m", "--task", "synthetic"]
    assert main([*base, "--run", "keep5", "--retain-anchors", "5"]) == 0
    assert "weights kept from the oldest of the last 5 anchor(s) on" in capsys.readouterr().out
    assert main([*base, "--run", "all", "--retain-anchors", "0"]) == 0
    assert "every weight version kept" in capsys.readouterr().out
    assert main(["run", "show", "--store", url, "--run", "keep5"]) == 0
    out = capsys.readouterr().out
    assert '"retain_anchors": 5' in out and RunManifest.from_bytes(out.encode()).retain_anchors == 5
    assert main([*base, "--run", "bad", "--retain-anchors", "-1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "retain_anchors must be >= 0" in err and len(err.splitlines()) == 1, err
    assert "Traceback" not in err


async def _publish_five(url: str, run: str, config: PublisherConfig, versions: int = 5) -> list[int]:
    """Five versions with an anchor every second one (v0, v2, v4); the anchor versions left."""
    rng = np.random.default_rng(0)
    state = {"w": rng.integers(0, 1 << 15, size=(64,), dtype=np.uint16)}
    layout = RunLayout(run)
    async with open_store(url) as store:
        pub = Publisher(store, run, config)
        for _ in range(versions):
            await pub.publish(dict(state))
            state["w"] = state["w"] ^ np.uint16(1)
        keys = [info.key async for info in store.list(layout.anchors_prefix)]
    return sorted({parsed[0] for key in keys if (parsed := layout.weight_object_version(key)) is not None})


@pytest.mark.parametrize(
    "run_retention, setting, kept",
    [
        (3, None, [4, 6, 8]),  # the run's value
        (1, None, [6, 8]),  # one anchor, and the one v7 (in the staleness window) needs
        (0, None, [0, 2, 4, 6, 8]),  # the run keeps everything
        (None, None, [6, 8]),  # a manifest without the field: the default, 2
        (3, 0, [0, 2, 4, 6, 8]),  # the trainer's setting overrides the run's
        (0, 3, [4, 6, 8]),
    ],
)
def test_the_publisher_keeps_what_the_run_says(
    tmp_path: Path, run_retention: int | None, setting: int | None, kept: list[int]
) -> None:
    url = f"file://{tmp_path}"
    manifest = RunManifest(run="r", model="m", task="synthetic", retain_anchors=run_retention or 0, staleness_limit=0)
    doc = json.loads(manifest.to_bytes())
    if run_retention is None:
        del doc["retain_anchors"]
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "run.json").write_text(json.dumps(doc))
    config = PublisherConfig(anchor_every=2, anchor_fraction=100.0, retain_anchors=setting, retain_versions=1)
    assert asyncio.run(_publish_five(url, "r", config, versions=9)) == kept  # anchors v0, v2, .., v8


def test_retention_keeps_the_versions_a_consumer_checks_records_against(tmp_path: Path) -> None:
    """An anchor every version: retention still keeps the staleness window (staleness_limit + 2
    versions behind the head), so an honest record that is fresh enough stays checkable."""
    url = f"file://{tmp_path}"
    doc = json.loads(RunManifest(run="r", model="m", task="synthetic", retain_anchors=2, staleness_limit=4).to_bytes())
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "run.json").write_text(json.dumps(doc))
    config = PublisherConfig(anchor_every=1, anchor_fraction=100.0, retain_versions=1)
    assert asyncio.run(_publish_five(url, "r", config, versions=12)) == [6, 7, 8, 9, 10, 11]
    manifests = [p for p in (tmp_path / "runs" / "r").rglob("*.json") if "versions" in p.parts]
    assert len(manifests) == 6, manifests  # v6..v11


@pytest.mark.parametrize(
    "anchors, retain, head, window, floor",
    [
        ([0, 5, 10], 2, 12, 8, 5),  # the 2nd newest anchor (5) is outside the window: kept from it
        (list(range(20)), 2, 19, 8, 12),  # anchors every version: the window decides
        ([0, 10, 20, 30], 2, 35, 8, 20),  # the window is inside the anchors kept
        ([0, 3], 1, 4, 8, None),  # everything is in the window: nothing deleted
        ([0], 1, 9, 2, None),
    ],
)
def test_retention_floor(anchors: list[int], retain: int, head: int, window: int, floor: int | None) -> None:
    assert retention_floor(anchors, retain=retain, head=head, window=window) == floor


def test_without_a_readable_manifest(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No manifest at all (a bare publisher): the default; an unreadable one: nothing deleted."""
    config = PublisherConfig(anchor_every=2, anchor_fraction=100.0, retain_versions=1)
    (tmp_path / "a").mkdir()
    assert asyncio.run(_publish_five(f"file://{tmp_path / 'a'}", "r", config)) == [2, 4]
    (tmp_path / "b" / "runs" / "r").mkdir(parents=True)
    (tmp_path / "b" / "runs" / "r" / "run.json").write_text('{"format": "stoa.run/1", "retain_anchors": 1}')
    with caplog.at_level(logging.WARNING):
        assert asyncio.run(_publish_five(f"file://{tmp_path / 'b'}", "r", config)) == [0, 2, 4]
    assert "keeping every anchor until it is fixed" in caplog.text
