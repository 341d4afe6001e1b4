"""A worker shows progress while it generates: its heartbeat counts the tokens generated so far
and a rate that moves before any group finishes, and it logs a progress line (so "generating,
tok/s 0" for minutes no longer hides whether a worker is slow or stuck)."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

from macd.worker import Worker, WorkerOptions
from slime_stoa.protocol.heartbeat import Heartbeat, read_heartbeat
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import Store
from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model
from tests.conftest import async_wait_until
from tests.test_worker import RUN, daemon_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_synthetic_model(tmp_path_factory.mktemp("tiny") / "model")


async def test_the_token_count_rises_before_any_group_finishes(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # One group of 8 samples of up to 4096 tokens: it finishes only once all 8 sampled an end of
    # text, so the worker generates for a long while with nothing finished (it is stopped long before).
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=8, max_tokens=4096)
    await seed_run(store, manifest, model_dir, task_count=10)
    config = replace(daemon_config(store_url, tmp_path / "data"), batch=1)
    worker = Worker(config, store, WorkerOptions(seed=1, heartbeat_s=0.05, progress_log_s=0.0))
    seen: list[tuple[Heartbeat, int]] = []  # each heartbeat with the groups finished as it was written
    worker.on_heartbeat = lambda beat: seen.append((beat, worker.groups_recorded + worker.groups_filtered))
    stop = asyncio.Event()
    caplog.set_level(logging.INFO, logger="macd")
    run = asyncio.create_task(worker.run(stop))

    def rising() -> bool:
        counted = [beat.tokens_generated for beat, finished in seen if finished == 0 and beat.tokens_generated > 0]
        return run.done() or len(set(counted)) >= 2

    await async_wait_until(rising, timeout=120, message=lambda: f"two token counts before a group finished: {seen[-3:]}")
    assert not run.done(), run
    early = [(beat, finished) for beat, finished in seen if beat.tokens_generated > 0]
    first, finished = early[0]
    assert finished == 0 and first.groups_spooled == first.groups_filtered == 0
    assert first.status == "generating" and first.tokens_per_s > 0  # a rate mid-cohort, not "tok/s 0"
    in_bucket = await async_wait_until(
        lambda: _written(store), message="a heartbeat with tokens in the bucket"
    )
    assert in_bucket.tokens_generated > 0 and in_bucket.instance == worker.reporter.instance
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("generating: ")]
    assert progress and re.fullmatch(r"generating: \d+ tokens so far, \d+ tok/s, [12] group\(s\) in flight, 0 finished",
                                     progress[0]), progress
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    final = await read_heartbeat(store, RUN, config.worker_id)
    assert final.status == "stopped" and final.tokens_generated >= early[-1][0].tokens_generated


async def _written(store: Store) -> Heartbeat | None:
    beat = await read_heartbeat(store, RUN, "test-mac-0a1b2c")
    return beat if beat.tokens_generated > 0 else None
