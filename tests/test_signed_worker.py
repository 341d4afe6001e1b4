"""A worker of a signed run refuses forged weights: it keeps generating with its last good
weights and reports the refusal in its log and heartbeat (`weights_refused`, `last_error`)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from macd.config import DaemonConfig
from macd.worker import Worker, WorkerOptions
from slime_stoa.protocol.heartbeat import Heartbeat
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store
from slime_stoa.protocol.worker_keys import WorkerKeyFile, write_worker_key_file
from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model
from tests.conftest import async_wait_until

RUN = "worker-test"


def daemon_config(store_url: str, data_dir: Path) -> DaemonConfig:
    return DaemonConfig(store=store_url, run=RUN, name="test-mac", worker_id="test-mac-0a1b2c", data_dir=data_dir, batch=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_synthetic_model(tmp_path_factory.mktemp("tiny") / "model")


async def test_a_worker_refuses_an_attackers_weights_and_keeps_its_own(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    key = SigningKey.generate()
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
    await seed_run(store, manifest, model_dir, task_count=50, key=key)
    config = daemon_config(store_url, tmp_path / "data")
    worker_key = write_worker_key_file(
        tmp_path / "worker-key.json", WorkerKeyFile(run=RUN, worker=config.worker_id, key=SigningKey.generate())
    )
    config = replace(config, run_key=key.public.to_text(), worker_key=str(worker_key))
    worker = Worker(config, store, WorkerOptions(seed=8, heartbeat_s=0.3))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
    assert not run.done(), run
    digest = worker.sub.digest.root() if worker.sub and worker.sub.digest else None
    # Anyone with a bucket token publishes v1 of their own weights and moves the pointer.
    attacker = Publisher(store, RUN, PublisherConfig(extras_dir=model_dir))
    assert await attacker.open() == 0
    state = load_hf_state(model_dir)
    state["model.norm.weight"][:] ^= 3
    await attacker.publish(state)
    seen = worker.cohorts
    await async_wait_until(
        lambda: (worker.beat.weights_refused and worker.cohorts >= seen + 2) or run.done(),
        timeout=120,
        message=lambda: f"a refusal and two more cohorts ({worker.beat}, cohorts {worker.cohorts - seen})",
    )
    assert not run.done(), run
    assert worker.sub is not None and worker.sub.version == 0 and worker.sub.digest is not None
    assert worker.sub.digest.root() == digest and worker.live.digest_check(worker.live.state)
    assert worker.beat.weights_refused == 1 and "refused the pointer" in worker.beat.last_error

    async def beat_says_so() -> bool:
        beat = Heartbeat.from_bytes(await store.get_bytes(RunLayout(RUN).heartbeat(config.worker_id)))
        return beat.weights_refused == 1 and "refused" in beat.last_error

    await async_wait_until(beat_says_so, timeout=30, message="the refusal in the worker's heartbeat")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
