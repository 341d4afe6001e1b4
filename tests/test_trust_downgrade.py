"""A worker that pinned a run key, or holds a worker key, refuses an unsigned or re-keyed run:
one log line, the heartbeat's status "refused", no weights taken from that run."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from macd.config import DaemonConfig
from macd.run_pin import pin_path, remember_run_key, remembered_run_key
from macd.worker import Worker, WorkerOptions
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import run_key_refusal
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store
from slime_stoa.protocol.worker_keys import WorkerKeyFile, write_worker_key_file
from tests.conftest import async_wait_until

RUN = "trust-run"
MANIFEST = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)


def test_the_run_key_policy() -> None:
    a, b = SigningKey.generate().public.to_text(), SigningKey.generate().public.to_text()
    assert run_key_refusal(RUN, a, a, holds_worker_key=True) is None
    assert run_key_refusal(RUN, a, None, holds_worker_key=True) is None  # first use
    assert run_key_refusal(RUN, None, None, holds_worker_key=False) is None  # an unsigned run, a keyless worker
    assert "downgraded" in (run_key_refusal(RUN, None, None, holds_worker_key=True) or "")
    assert "downgraded" in (run_key_refusal(RUN, None, a, holds_worker_key=False) or "")
    assert "re-keyed" in (run_key_refusal(RUN, b, a, holds_worker_key=False) or "")
    assert "re-keyed" in (run_key_refusal(RUN, "ed25519:junk", a, holds_worker_key=False) or "")


def test_the_first_trusted_key_is_kept_and_junk_is_ignored(tmp_path: Path) -> None:
    key = SigningKey.generate().public.to_text()
    assert remembered_run_key(tmp_path, RUN) is None
    remember_run_key(tmp_path, RUN, key)
    assert remembered_run_key(tmp_path, RUN) == key
    pin_path(tmp_path, RUN).write_bytes(b"\xff" * 10_000)
    assert remembered_run_key(tmp_path, RUN) is None


def _config(store_url: str, tmp_path: Path, *, worker_key: bool, run_key: str = "") -> DaemonConfig:
    config = DaemonConfig(
        store=store_url, run=RUN, name="mac", worker_id="mac-0a1b2c", data_dir=tmp_path / "data", batch=2, run_key=run_key
    )
    if worker_key:
        path = write_worker_key_file(
            tmp_path / "worker-key.json", WorkerKeyFile(run=RUN, worker=config.worker_id, key=SigningKey.generate())
        )
        config = replace(config, worker_key=str(path))
    return config


async def _refused(worker: Worker, caplog: pytest.LogCaptureFixture) -> str:
    """Run `worker` until its heartbeat says it refused the run; the refusal's log lines."""
    stop = asyncio.Event()
    with caplog.at_level(logging.WARNING, logger="macd"):
        run = asyncio.create_task(worker.run(stop))
        await async_wait_until(lambda: (worker.beat.status == "refused" and worker.beat.errors >= 2) or run.done(),
                               timeout=30, message=lambda: f"two refusals ({worker.beat})")
        stop.set()
        assert await asyncio.wait_for(run, 30) == 0
    assert worker.live is None and (worker.sub is None or worker.sub.version is None)  # nothing taken from the refused run
    lines = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
    assert len(lines) == 1, lines  # counted at every retry, logged once
    return lines[0]


async def test_a_worker_holding_a_worker_key_refuses_an_unsigned_run(
    store: Store, store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await store.put(RunLayout(RUN).run_manifest, MANIFEST.to_bytes())
    worker = Worker(_config(store_url, tmp_path, worker_key=True), store, WorkerOptions(idle_poll_s=0.05, heartbeat_s=0.2))
    assert "unsigned but this worker holds a worker key" in await _refused(worker, caplog)


async def test_a_worker_refuses_a_run_re_keyed_after_it_first_trusted_it(
    store: Store, store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, attacker = SigningKey.generate(), SigningKey.generate()
    config = _config(store_url, tmp_path, worker_key=True)
    remember_run_key(config.data_dir, RUN, first.public.to_text())  # trusted at an earlier start
    rekeyed = replace(MANIFEST, run_key=attacker.public.to_text())
    await store.put(RunLayout(RUN).run_manifest, rekeyed.to_bytes(attacker))
    worker = Worker(config, store, WorkerOptions(idle_poll_s=0.05, heartbeat_s=0.2))
    line = await _refused(worker, caplog)
    assert "re-keyed" in line and first.key_id in line and attacker.key_id in line
    assert remembered_run_key(config.data_dir, RUN) == first.public.to_text()  # the attacker's key is not kept


async def test_a_pinned_worker_refuses_an_unsigned_run(
    store: Store, store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pinned = SigningKey.generate().public.to_text()
    await store.put(RunLayout(RUN).run_manifest, MANIFEST.to_bytes())
    worker = Worker(_config(store_url, tmp_path, worker_key=False, run_key=pinned), store,
                    WorkerOptions(idle_poll_s=0.05, heartbeat_s=0.2))
    assert "unsigned, this worker pinned" in await _refused(worker, caplog)
