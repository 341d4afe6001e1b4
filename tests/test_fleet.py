"""Heartbeats and the `stoa fleet` table."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from slime_stoa.cli import main
from slime_stoa.cli.fleet_cmd import fleet_rows
from slime_stoa.protocol.heartbeat import SILENT_AFTER_S, Heartbeat, ago, shown_lag, shown_status
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import open_store


def beat(worker: str, **kw) -> Heartbeat:
    return Heartbeat(worker_id=worker, name=kw.pop("name", worker), status=kw.pop("status", "generating"), **kw)


def test_round_trip_and_lag() -> None:
    b = beat("mac-1", version=3, pointer_version=5, tokens_per_s=812.5, updated_at=10.0)
    again = Heartbeat.from_bytes(b.to_bytes())
    assert again == b and again.lag == 2
    assert beat("x").lag is None


@pytest.mark.parametrize("data", [b"{", b'{"format": "x"}', b'{"format": "stoa.heartbeat/1"}'])
def test_bad_heartbeats_are_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        Heartbeat.from_bytes(data)


def test_rows() -> None:
    now = time.time()
    rows = fleet_rows([beat("b-2", updated_at=now - 300, errors=1, last_error="boom"), beat("a-1", version=1, pointer_version=1, updated_at=now - 2)], now)
    assert [r[0] for r in rows] == ["a-1", "b-2"]
    assert rows[0][4:6] == ("v1", "0") and rows[0][10] == "2s ago"
    assert rows[1][10] == "5m ago" and rows[1][11] == "1 (boom)"
    assert rows[1][2] == "silent"  # no heartbeat for 5 minutes: not running, whatever it said last


def test_a_stopped_worker_shows_as_stopped_without_lag() -> None:
    now = time.time()
    stopped = beat("a-1", status="stopped", version=2, pointer_version=2, updated_at=now - 3600)
    running = beat("b-2", version=5, pointer_version=5, updated_at=now - 1)
    rows = fleet_rows([stopped, running], now, pointer_version=7)
    assert rows[0][2:6] == ("stopped", "", "v2", "-")  # not "lag 0" at an old version
    assert rows[1][2] == "generating" and rows[1][5] == "2"  # lag against the run's current version


def test_status_and_lag_as_of_now() -> None:
    """The one reading of a heartbeat that `stoa fleet` and `macd status` share."""
    now = 1000.0
    running = beat("a", version=3, pointer_version=5, updated_at=now - SILENT_AFTER_S + 1)
    assert shown_status(running, now) == "generating" and shown_lag(running, now) == 2  # vs the pointer it saw
    assert shown_lag(running, now, head=9) == 6  # vs the run's current version
    gone = beat("b", version=3, pointer_version=3, updated_at=now - SILENT_AFTER_S - 1)
    assert shown_status(gone, now) == "silent" and shown_lag(gone, now, head=9) is None
    stopped = beat("c", status="stopped", version=3, pointer_version=3, updated_at=now - 10_000)
    assert shown_status(stopped, now) == "stopped" and shown_lag(stopped, now, head=9) is None
    assert [ago(s) for s in (-1, 42, 300, 7200)] == ["0s ago", "42s ago", "5m ago", "2.0h ago"]


def test_cli_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url = f"file://{tmp_path}"
    layout = RunLayout("demo")

    async def seed() -> None:
        async with open_store(url) as store:
            manifest = RunManifest(run="demo", model="m", task="synthetic")
            await store.put(layout.run_manifest, manifest.to_bytes())
            await store.put(layout.heartbeat("mac-a"), beat("mac-a", name="studio", version=4, pointer_version=5, updated_at=time.time()).to_bytes())
            await store.put(layout.heartbeat("mac-b"), b"not json")

    asyncio.run(seed())
    assert main(["fleet", "--store", url, "--run", "demo"]) == 0
    out = capsys.readouterr().out
    assert "run demo no weights published yet: 1 worker(s), 1 running, 1 unreadable heartbeat(s)" in out
    assert "studio" in out and "v4" in out
