"""A ready version is installed within `swap_drain_s` plus one decode step: the drain's clock is
read after every decode step, and groups restarted at the last swap no longer hold the install
past the drain's time. Measured in decode steps, never in wall time."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from macd.generate import ContinuousGenerator, SamplingConfig, build_model
from macd.generation import _insert_and_advance, at_safe_point
from macd.worker import Worker, WorkerOptions
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import Store
from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model
from tests.conftest import async_wait_until
from tests.test_worker import RUN, daemon_config, scrambled


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_synthetic_model(tmp_path_factory.mktemp("tiny") / "model")


def test_the_drain_ends_when_its_time_is_up_even_with_restarted_groups_in_flight() -> None:
    assert at_safe_point(0, True, 0, 32)  # nothing in flight
    assert not at_safe_point(3, False, 5, 32)  # the short drain is still running
    assert at_safe_point(3, False, 32, 32)
    assert not at_safe_point(3, True, 32, 32)  # restarted groups get the drain's whole time...
    assert at_safe_point(3, True, 7, 32, expired=True)  # ...and no more


def test_a_deadline_stops_decoding_within_one_step(model_dir: Path) -> None:
    """`_insert_and_advance` on a real tiny model: a passed deadline takes no decode step, a far
    one the steps asked for (one at a time, the clock read after each)."""
    model, tokenizer = build_model(model_dir)
    gen = ContinuousGenerator(model, tokenizer, SamplingConfig(temperature=1.0, max_tokens=64, group_size=2, seed=0),
                              max_batch=4)
    poke, released = threading.Event(), []
    prompt = tokenizer.encode("what is 2 plus 3?")
    finished, steps = _insert_and_advance(gen, [(prompt, "a")], 5, poke, lambda: released.append(1),
                                          deadline=time.perf_counter() - 1)
    assert (finished, steps) == ([], 0)
    finished, steps = _insert_and_advance(gen, [], 5, poke, lambda: released.append(1),
                                          deadline=time.perf_counter() + 3600)
    assert steps == 5 or finished  # a group may finish first (an early EOS)
    poke.set()
    assert _insert_and_advance(gen, [], 5, poke, lambda: None, deadline=time.perf_counter() + 3600) == ([], 0)
    gen.close()


async def test_versions_are_installed_within_one_decode_step_of_an_expired_drain(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    """A real worker with `swap_drain_s` = 0 and a long step drain, fed versions while its groups
    (restarted ones included) decode: every install comes at most one decode step after the
    version was ready. Before the bound, an install waited for the groups restarted at the last
    swap to finish (up to `max_tokens` steps)."""
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=64, temperature=1.0)
    pub = await seed_run(store, manifest, model_dir, task_count=50)
    options = WorkerOptions(seed=5, swap_drain_steps=1000, swap_drain_s=0.0, weights_poll_s=0.02, heartbeat_s=0.5)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), store, options)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.groups_recorded >= 1 or run.done(), timeout=120, message="a first group")
    state = load_hf_state(model_dir)
    rng = np.random.default_rng(1)
    for version in range(1, 5):
        state = scrambled(state, rng, share=0.01)
        await pub.publish(state)
        await async_wait_until(lambda v=version: worker.weights.installed[0] >= v or run.done(), timeout=120,
                               interval=0.02, message=f"v{version} installed")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    swaps = list(worker.swaps)
    assert [s.version for s in swaps] == [1, 2, 3, 4]
    assert sum(s.dropped for s in swaps) >= 1  # groups were in flight at the swaps
    assert all(s.drain_steps <= 1 for s in swaps), [(s.version, s.drain_steps, s.dropped) for s in swaps]
