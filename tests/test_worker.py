"""`macd run`'s worker loop for real: MLX generation, weight hot-swap, spool and upload."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from macd.config import DaemonConfig
from macd.worker import Worker, WorkerOptions, task_key
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import Store
from slime_stoa.protocol.validate import RecordLimits, load_record
from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model
from slime_stoa.tasks import TASKS, Task, TaskItem, encode_task_data
from slime_stoa.trainer.consumer.counting import CountingStore
from tests.conftest import async_wait_until

RUN = "worker-test"


class Parity(Task):
    """A test task a random model solves about half the time: reward 1 for an even-length text."""

    name = "parity"

    def reward(self, completion: str, label: str) -> float:
        return 1.0 if len(completion) % 2 == 0 else 0.0


async def seed_parity_run(store: Store, manifest: RunManifest, model_dir: Path, monkeypatch, count: int = 40):
    """Like `seed_run`, with the parity task (registered for this test): returns the publisher."""
    from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig

    monkeypatch.setitem(TASKS, Parity.name, Parity)
    await store.put(RunLayout(RUN).run_manifest, manifest.to_bytes())
    items = [TaskItem(index=i, prompt=f"Say anything, number {i}.", label="") for i in range(count)]
    await store.put(task_key(manifest), encode_task_data(Parity.name, items, meta={}))
    pub = Publisher(store, RUN, PublisherConfig(extras_dir=model_dir))
    await pub.open()
    await pub.publish(load_hf_state(model_dir))
    return pub


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_synthetic_model(tmp_path_factory.mktemp("tiny") / "model")


def daemon_config(store_url: str, data_dir: Path) -> DaemonConfig:
    return DaemonConfig(store=store_url, run=RUN, name="test-mac", worker_id="test-mac-0a1b2c", data_dir=data_dir, batch=3)


async def records(store: Store) -> list:
    layout = RunLayout(RUN)
    limits = RecordLimits(vocab_size=1024, expected_group_size=4)
    return [load_record(await store.get_bytes(i.key), limits) async for i in store.list(layout.rollouts_prefix())]


class PointerPolls(CountingStore):
    """Forwards to a real store and counts the worker's pointer polls: each is one turn of its loop,
    a chance to start a cohort."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.polls = 0

    async def get(self, key: str, **kw):  # type: ignore[override]
        if key == RunLayout(RUN).pointer:
            self.polls += 1
        return await super().get(key, **kw)


@pytest.mark.both_backends
async def test_worker_generates_uploads_and_hot_swaps(store: Store, store_url: str, model_dir: Path, tmp_path: Path) -> None:
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6, temperature=1.0)
    pub = await seed_run(store, manifest, model_dir, task_count=50)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), store, WorkerOptions(seed=1, heartbeat_s=0.5))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))

    async def landed(version: int) -> bool:
        return run.done() or any(g.weight_version == version for g in await records(store))

    # Publish v1 once the first groups landed; stop once groups made at v1 landed too.
    await async_wait_until(lambda: landed(0), timeout=300, interval=0.1, message="a v0 group in the bucket")
    assert not run.done(), run
    state = load_hf_state(model_dir)
    rng = np.random.default_rng(0)
    for bits in state.values():
        flat = bits.reshape(-1)
        flat[rng.random(flat.size) < 0.02] ^= 1
    await pub.publish(state)
    await async_wait_until(lambda: landed(1), timeout=300, interval=0.1, message="a v1 group in the bucket")
    stop.set()
    assert await asyncio.wait_for(run, 300) == 0

    got = await records(store)
    assert len(got) == worker.groups_recorded  # every finished group, exactly once
    assert {g.worker_id for g in got} == {"test-mac-0a1b2c"}
    assert sorted(g.seq for g in got) == list(range(len(got)))
    versions = [g.weight_version for g in sorted(got, key=lambda g: g.seq)]
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    for g in got:
        assert len(g.samples) == 4 and g.task_id == "synthetic"
        assert all(s.finish_reason in ("stop", "length") and len(s.response_tokens) <= 6 for s in g.samples)
    # The live MLX weights are the pointer's version, bit for bit.
    assert worker.sub is not None and worker.sub.digest.root() == pub.state_digest
    assert worker.live.digest_check(worker.live.state)
    beat = await store.get_bytes(RunLayout(RUN).heartbeat("test-mac-0a1b2c"))
    assert b'"status":"stopped"' in beat.replace(b" ", b"")


async def test_stop_flushes_and_exits_cleanly(store: Store, store_url: str, model_dir: Path, tmp_path: Path) -> None:
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
    await seed_run(store, manifest, model_dir, task_count=50)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), store, WorkerOptions(seed=2))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.cohorts >= 2 or run.done(), timeout=120, message="two cohorts")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert len(await records(store)) == worker.groups_recorded


async def test_worker_waits_for_a_new_version_once_its_budget_is_spent(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    manifest = RunManifest(run=RUN, model="tiny", task="parity", group_size=4, max_tokens=6, worker_groups_per_version=1)
    pub = await seed_parity_run(store, manifest, model_dir, monkeypatch)
    options = WorkerOptions(seed=4, budget_patience_s=60.0, heartbeat_s=0.2)
    polled = PointerPolls(store)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), polled, options)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    # Until one group with a reward signal was made at v0 and the groups in flight then finished.
    await async_wait_until(
        lambda: (worker.beat.status == "waiting" and worker.groups_in_flight == 0) or run.done(),
        timeout=120, message="status waiting, nothing in flight",
    )
    assert not run.done(), run
    started, polls = worker.groups_started, polled.polls
    # Budget spent: three more pointer polls, and no new group started.
    await async_wait_until(lambda: polled.polls >= polls + 3 or run.done(), timeout=30, message="three pointer polls")
    assert worker.beat.status == "waiting" and worker.groups_started == started and worker.groups_in_flight == 0
    v0 = await records(store)
    assert v0 and {g.weight_version for g in v0} == {0}
    assert any(len({s.reward for s in g.samples}) > 1 for g in v0)  # the budget counts signal groups
    state = load_hf_state(model_dir)
    state["model.norm.weight"][0] ^= 1
    await pub.publish(state)

    async def v1_landed() -> bool:
        return run.done() or any(g.weight_version == 1 for g in await records(store))

    await async_wait_until(v1_landed, timeout=120, interval=0.1, message="a v1 group in the bucket")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert max(g.weight_version for g in await records(store)) == 1


async def test_a_pointer_to_missing_objects_keeps_the_last_good_version(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    from slime_stoa.protocol.pulse.manifests import Pointer

    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
    await seed_run(store, manifest, model_dir, task_count=50)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), store, WorkerOptions(seed=5))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
    layout = RunLayout(RUN)
    got = await store.get(layout.pointer)
    pointer = Pointer.from_bytes(got.data)
    broken = Pointer(
        run=RUN, version=1, state_digest="ab" * 16, manifest=layout.version_manifest(1, "0badf00d"),
        anchor=pointer.anchor, updated_at=0.0,
    )
    await store.put(layout.pointer, broken.to_bytes(), if_match=got.etag)
    seen = worker.cohorts
    # The worker notices at its next pointer poll and keeps generating.
    await async_wait_until(
        lambda: (worker.beat.errors and worker.cohorts > seen + 1) or run.done(),
        timeout=60,
        message=lambda: f"an error and two more cohorts (errors {worker.beat.errors}, cohorts {worker.cohorts - seen})",
    )
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert worker.sub.version == 0 and worker.live.digest_check(worker.live.state)
    assert {g.weight_version for g in await records(store)} == {0}
    assert worker.beat.errors >= 1 and "manifest is unreadable" in worker.beat.last_error


async def test_int8_plane_serves_quantized_weights_from_the_bf16_master(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6, plane="int8")
    pub = await seed_run(store, manifest, model_dir, task_count=50)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), store, WorkerOptions(seed=6))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
    state = load_hf_state(model_dir)
    state["model.layers.0.mlp.up_proj.weight"].reshape(-1)[:100] ^= 1
    await pub.publish(state)
    # Stop once the int8 weights were swapped to v1 and a cohort was made with them.
    await async_wait_until(lambda: worker.beat.swaps >= 1 or run.done(), timeout=120, message="the swap to v1")

    async def v1_landed() -> bool:
        return run.done() or any(g.weight_version == 1 for g in await records(store))

    await async_wait_until(v1_landed, timeout=120, interval=0.1, message="a v1 group in the bucket")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert worker.sub.version == 1
    assert worker.live.plane == "int8" and worker.live.digest_check(worker.live.state)
    got = await records(store)
    assert len(got) == worker.groups_recorded and {g.weight_version for g in got} == {0, 1}


@pytest.mark.parametrize("plane", ["bf16", "int8"])
async def test_a_failed_install_is_reported_and_changes_nothing(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, plane: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An install that raises half-way (an MLX error after the patch was committed, not a patch
    that does not fit) leaves the model on the version it holds, bit for bit, says so in the
    heartbeat, and the weights keep being followed: the next version is installed and the live
    weights are its, bit for bit."""
    from macd.weights import LiveWeights

    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6, plane=plane)  # type: ignore[arg-type]
    pub = await seed_run(store, manifest, model_dir, task_count=50)
    failures: list[int] = []
    real_apply = LiveWeights.apply

    def apply_failing_once(self, state, changed, touched):  # type: ignore[no-untyped-def]
        if changed is not None and not failures:
            failures.append(1)
            raise RuntimeError("out of memory (a test's)")
        return real_apply(self, state, changed, touched)

    monkeypatch.setattr(LiveWeights, "apply", apply_failing_once)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), store, WorkerOptions(seed=8, heartbeat_s=0.2))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
    state = load_hf_state(model_dir)
    state["model.layers.0.mlp.up_proj.weight"].reshape(-1)[:100] ^= 1
    await pub.publish(state)  # v1: its install fails
    await async_wait_until(lambda: failures or run.done(), timeout=120, message="the failed install of v1")
    await async_wait_until(lambda: "failed to install" in (worker.beat.last_error or "") or run.done(), timeout=60,
                           message=lambda: f"the failure in the heartbeat (last_error {worker.beat.last_error!r})")
    assert not run.done() and worker.weights.installed[0] == 0  # still serving v0
    # the subscriber stands where the model is: v0, and the live weights are v0's bit for bit
    assert worker.sub is not None and worker.sub.version == 0 and worker.live is not None
    assert worker.live.digest_check(worker.live.state)
    state["model.layers.1.mlp.up_proj.weight"].reshape(-1)[:100] ^= 1
    await pub.publish(state)  # v2: installed
    await async_wait_until(lambda: worker.weights.installed[0] == 2 or run.done(), timeout=120, message="the install of v2")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert worker.sub.version == 2 and worker.sub.digest.root() == pub.state_digest
    assert worker.live.digest_check(worker.live.state)


async def test_heartbeat_reports_quarantined_groups(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    """A group set aside in the spool for good shows in the heartbeat, the final one included
    (the quickstart counts lost groups from it); old heartbeats without the field still parse."""
    from macd.spool import Spool
    from slime_stoa.protocol.heartbeat import Heartbeat

    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
    await seed_run(store, manifest, model_dir, task_count=50)
    config = daemon_config(store_url, tmp_path / "data")
    spool = Spool(config.data_dir / "spool" / RUN, worker_id=config.worker_id, run=RUN,
                  max_bytes=1 << 20, max_items=10)
    spool.quarantine(spool.add(b"not a record"), "test: the key held other bytes")
    spool.close()
    worker = Worker(config, store, WorkerOptions(seed=7, max_cohorts=1))
    assert await asyncio.wait_for(worker.run(asyncio.Event()), 120) == 0
    data = await store.get_bytes(RunLayout(RUN).heartbeat(config.worker_id))
    beat = Heartbeat.from_bytes(data)
    assert (beat.status, beat.groups_spooled, beat.groups_quarantined, beat.groups_uploaded) == ("stopped", 0, 1, 3)
    old = data.replace(b'"groups_quarantined": 1, ', b"")
    assert b"groups_quarantined" not in old and Heartbeat.from_bytes(old).groups_quarantined == 0


@pytest.mark.parametrize("ticks", [0, 1, 2, 3])
async def test_wait_never_swallows_a_cancellation(ticks: int) -> None:
    """A cancel that lands just as the stop event fires still cancels (a 3.11 wait_for pitfall)."""
    from macd.aio import wait as _wait

    stop = asyncio.Event()
    waiting = asyncio.create_task(_wait(stop, 30))
    await asyncio.sleep(0)
    stop.set()
    for _ in range(ticks):
        await asyncio.sleep(0)
    if not waiting.cancel():
        assert waiting.done()  # it returned before the cancel: nothing to swallow
        return
    with pytest.raises(asyncio.CancelledError):
        await waiting


# -- continuous generation, one weight copy, dynamic sampling ----------------------------------------


def scrambled(state: dict[str, np.ndarray], rng: np.random.Generator, share: float = 0.05) -> dict[str, np.ndarray]:
    """A copy with `share` of each tensor's elements replaced by other elements of the same tensor:
    a patch, not an anchor, yet logprobs that differ clearly from the original's."""
    new = {}
    for name, bits in state.items():
        flat = bits.reshape(-1).copy()
        at = np.flatnonzero(rng.random(flat.size) < share)
        flat[at] = flat[rng.integers(0, flat.size, size=at.size)]
        new[name] = flat.reshape(bits.shape)
    return new


def bf16_model(model_dir: Path, state: dict[str, np.ndarray]):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir, lazy=True)
    model.load_weights([(n, mx.array(b).view(mx.bfloat16)) for n, b in state.items()], strict=True)
    mx.eval(model.parameters())
    return model


async def test_groups_straddling_a_swap_are_dropped_and_every_record_is_exact(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, caplog, monkeypatch
) -> None:
    """A version published while groups decode: with no drain allowed, the groups in flight are
    dropped and restarted on the new weights; every record's logprobs are those of the weights of
    the version it names (teacher forcing), never of the other version."""
    from macd.generate import teacher_forced_logprobs
    from slime_stoa.protocol.pulse.digest import state_digest
    from slime_stoa.protocol.pulse.route import SpeedMeter

    caplog.set_level("INFO", logger="macd")
    monkeypatch.setattr(SpeedMeter, "MIN_CHANGES", 1)  # the tiny model's patch is too small to time otherwise
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=24, temperature=0.9)
    pub = await seed_run(store, manifest, model_dir, task_count=50)
    options = WorkerOptions(seed=12, swap_drain_steps=0, weights_poll_s=0.05, heartbeat_s=0.5)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), store, options)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.groups_recorded >= 3 or run.done(), timeout=120, message="three groups")
    states = {0: load_hf_state(model_dir)}
    states[1] = scrambled(states[0], np.random.default_rng(0))
    await pub.publish(states[1])

    async def v1_landed() -> bool:
        return run.done() or sum(g.weight_version == 1 for g in await records(store)) >= 3

    await async_wait_until(v1_landed, timeout=120, interval=0.1, message="three v1 groups in the bucket")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert worker.groups_dropped >= 1  # generation was continuous: groups were in flight at the swap
    assert "via step" in caplog.text  # staged beside generation, written into the live weights
    assert worker.live.shares(worker.live.state) and worker.live.digest_check(worker.live.state)
    assert "apply_s_per_change" in worker.sub.meter.measured  # the staging was timed for the path choice
    got = sorted(await records(store), key=lambda g: g.seq)
    assert len(got) == worker.groups_recorded
    versions = [g.weight_version for g in got]
    assert versions == sorted(versions) and set(versions) == {0, 1}
    models = {v: bf16_model(model_dir, state) for v, state in states.items()}
    digests = {v: state_digest(state) for v, state in states.items()}
    for g in got:
        assert g.state_digest == digests[g.weight_version]
        off = 0.0  # how far the other version's logprobs are, over the group
        for sample in g.samples:
            forced = {v: teacher_forced_logprobs(m, g.prompt_tokens, sample.response_tokens, 0.9) for v, m in models.items()}
            # bf16 activations: the batched decode and one full pass measured equal here
            np.testing.assert_allclose(sample.logprobs, forced[g.weight_version], rtol=0, atol=2e-2)
            off = max(off, float(np.abs(sample.logprobs - forced[1 - g.weight_version]).max()))
        assert off > 0.1


async def test_dynamic_sampling_uploads_only_groups_with_a_reward_signal(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    from slime_stoa.protocol.heartbeat import Heartbeat

    manifest = RunManifest(run=RUN, model="tiny", task="parity", group_size=4, max_tokens=6, dynamic_sampling=True)
    await seed_parity_run(store, manifest, model_dir, monkeypatch)
    config = daemon_config(store_url, tmp_path / "data")
    worker = Worker(config, store, WorkerOptions(seed=13, heartbeat_s=0.3))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(
        lambda: (worker.groups_filtered >= 2 and worker.groups_recorded >= 3) or run.done(),
        timeout=120, message=lambda: f"groups filtered and kept ({worker.groups_filtered}, {worker.groups_recorded})",
    )
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    got = await records(store)
    assert len(got) == worker.groups_recorded
    assert all(len({s.reward for s in g.samples}) > 1 for g in got)
    beat = Heartbeat.from_bytes(await store.get_bytes(RunLayout(RUN).heartbeat(config.worker_id)))
    assert beat.groups_filtered == worker.groups_filtered >= 2 and beat.groups_uploaded == len(got)


async def test_prompts_solved_in_a_row_are_no_longer_drawn(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    from slime_stoa.protocol.heartbeat import Heartbeat

    manifest = RunManifest(run=RUN, model="tiny", task="parity", group_size=4, max_tokens=6, skip_solved_after=1)
    await seed_parity_run(store, manifest, model_dir, monkeypatch, count=8)
    config = daemon_config(store_url, tmp_path / "data")
    worker = Worker(config, store, WorkerOptions(seed=14, heartbeat_s=0.3))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.beat.prompts_solved >= 2 or run.done(), timeout=120, message="two prompts solved")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    beat = Heartbeat.from_bytes(await store.get_bytes(RunLayout(RUN).heartbeat(config.worker_id)))
    assert 2 <= beat.prompts_solved == worker.beat.prompts_solved
    got = await records(store)
    solved_at: dict[int, float] = {}
    for g in sorted(got, key=lambda g: g.finished_at):
        if all(s.reward == 1.0 for s in g.samples):
            solved_at.setdefault(g.prompt_index, g.finished_at)
    assert len(solved_at) == beat.prompts_solved
    if beat.prompts_solved < 8:  # (with every prompt solved, all are drawn again)
        assert not [g for g in got if g.prompt_index in solved_at and g.started_at > solved_at[g.prompt_index]]


# -- malformed objects and outages: reported, skipped, never fatal ----------------------------------


async def test_a_malformed_pointer_mid_run_keeps_the_last_good_version_until_a_good_one(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    """Garbage in current.json while the worker runs: it says so once (log and heartbeat), keeps
    generating with v0, and moves to v1 as soon as a good pointer names it."""
    from slime_stoa.protocol.heartbeat import Heartbeat
    from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig

    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
    await seed_run(store, manifest, model_dir, task_count=50)
    config = daemon_config(store_url, tmp_path / "data")
    worker = Worker(config, store, WorkerOptions(seed=8, heartbeat_s=0.3))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
    layout = RunLayout(RUN)
    good = await store.get(layout.pointer)
    assert good is not None
    bad_etag = await store.put(layout.pointer, b'{"format": "stoa.pointer/1", "version": "soon"', if_match=good.etag)
    seen = worker.cohorts
    await async_wait_until(
        lambda: (worker.beat.errors and worker.cohorts >= seen + 2) or run.done(),
        timeout=120,
        message=lambda: f"an error and two more cohorts (errors {worker.beat.errors}, cohorts {worker.cohorts - seen})",
    )
    assert not run.done(), run
    assert worker.beat.errors == 1  # reported once, not at every poll
    assert "malformed pointer" in worker.beat.last_error and "keeping weights v0" in worker.beat.last_error
    assert worker.sub is not None and worker.sub.version == 0

    async def beat_says_so() -> bool:
        beat = Heartbeat.from_bytes(await store.get_bytes(layout.heartbeat(config.worker_id)))
        return beat.errors >= 1 and "malformed pointer" in beat.last_error

    await async_wait_until(beat_says_so, timeout=30, message="the error in the worker's heartbeat")
    # A good pointer again, then v1: the worker follows.
    await store.put(layout.pointer, good.data, if_match=bad_etag)
    pub = Publisher(store, RUN, PublisherConfig(extras_dir=model_dir))
    assert await pub.open() == 0
    state = load_hf_state(model_dir)
    state["model.norm.weight"][:4] ^= 1
    await pub.publish(state)

    async def v1_landed() -> bool:
        return run.done() or any(g.weight_version == 1 for g in await records(store))

    await async_wait_until(v1_landed, timeout=120, interval=0.1, message="a v1 group in the bucket")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert worker.sub.version == 1 and worker.sub.digest.root() == pub.state_digest
    assert worker.live.digest_check(worker.live.state)
    versions = [g.weight_version for g in sorted(await records(store), key=lambda g: g.seq)]
    assert versions == sorted(versions) and versions.count(0) >= seen + 2 and versions[-1] == 1


async def test_a_malformed_run_manifest_at_start_is_reported_until_a_good_one(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    """A run.json that does not parse: the worker does not exit; it reports it in its heartbeat
    (written from the start) and joins once the manifest is good."""
    from slime_stoa.protocol.heartbeat import Heartbeat

    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
    await seed_run(store, manifest, model_dir, task_count=50)
    layout = RunLayout(RUN)
    good = await store.get_bytes(layout.run_manifest)
    await store.put(layout.run_manifest, good[: len(good) // 2])
    config = daemon_config(store_url, tmp_path / "data")
    worker = Worker(config, store, WorkerOptions(seed=9, heartbeat_s=0.2, idle_poll_s=0.2, setup_retry_max_s=0.5))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))

    async def reported() -> bool:
        if run.done():
            return True
        try:
            beat = Heartbeat.from_bytes(await store.get_bytes(layout.heartbeat(config.worker_id)))
        except Exception:
            return False
        return beat.status == "starting" and beat.errors >= 1 and beat.last_error.startswith("run:")

    await async_wait_until(reported, timeout=60, message="the run manifest's error in the heartbeat")
    assert not run.done(), run
    await store.put(layout.run_manifest, good)
    await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert worker.cohorts >= 1 and len(await records(store)) == worker.groups_recorded


async def test_a_store_outage_mid_run_only_delays_uploads(
    s3_server, s3_bucket: str, model_dir: Path, tmp_path: Path
) -> None:
    """The network to the bucket goes away while the worker runs: it keeps generating into its
    spool (pointer polls and heartbeats fail, and are reported), and the spool drains once the
    bucket is reachable again."""
    import random as stdlib_random

    from slime_stoa.protocol.store.retry import RetryPolicy
    from slime_stoa.protocol.store.s3 import S3Store
    from tests.test_spool_uploader import TcpGate

    prefix = f"outage-{stdlib_random.randrange(1 << 30):x}"
    gate = TcpGate(s3_server.endpoint_url)
    await gate.open()
    url = f"s3://{s3_bucket}/{prefix}?endpoint={gate.url}"
    through_gate = S3Store(
        bucket=s3_bucket, prefix=prefix, endpoint_url=gate.url, region=s3_server.region,
        credentials=s3_server.credentials(), url=url,
        retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02), connect_timeout=1,
    )
    async with through_gate, s3_server.store(s3_bucket, prefix) as direct:
        manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
        await seed_run(direct, manifest, model_dir, task_count=50)
        worker = Worker(daemon_config(url, tmp_path / "data"), through_gate, WorkerOptions(seed=10, heartbeat_s=0.3))
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run(stop))
        try:
            await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
            await gate.close()  # the bucket is unreachable from here on
            seen = worker.cohorts
            spool = tmp_path / "data" / "spool" / RUN

            def spooled() -> int:
                return len(list(spool.glob("*.rec")))

            await async_wait_until(
                lambda: (worker.cohorts >= seen + 3 and worker.beat.errors and spooled() >= 6) or run.done(),
                timeout=120,
                message=lambda: f"three cohorts spooled during the outage (cohorts {worker.cohorts - seen}, "
                f"errors {worker.beat.errors}, spooled {spooled()})",
            )
            assert not run.done(), run
            assert "StoreUnavailable" in worker.beat.last_error
            await gate.open()  # back
            await async_wait_until(lambda: spooled() == 0 or run.done(), timeout=120, message="the spool drained")
        finally:
            stop.set()
            code = await asyncio.wait_for(run, 120)
            await gate.close()
        assert code == 0
        got = await records(direct)
        assert len(got) == worker.groups_recorded  # every group, generated online or offline, once
        assert sorted(g.seq for g in got) == list(range(len(got)))


def test_a_group_is_dropped_at_most_once_within_the_drain_time() -> None:
    from macd.generation import at_safe_point

    assert at_safe_point(0, False, 0, 32)  # nothing in flight
    assert not at_safe_point(3, False, 31, 32)  # draining
    assert at_safe_point(3, False, 32, 32)  # drained: the rest is dropped
    assert at_safe_point(3, False, 0, 32, expired=True)  # out of time (e.g. every episode waits for its tool)
    assert at_safe_point(3, True, 0, 32, expired=True)  # the drain's time bounds the install, restarted or not
    assert not at_safe_point(3, True, 500, 32)  # a restarted group runs: wait for it, within the drain's time
    assert at_safe_point(0, True, 0, 32)


def test_versions_faster_than_groups_cannot_starve_generation(model_dir: Path) -> None:
    """A version asked for at every step with no drain allowed: each group is dropped at most
    once, so every prompt's group still finishes (with drop-and-restart alone none would)."""
    import mlx_lm

    from macd.generate import ContinuousGenerator, SamplingConfig
    from macd.generation import at_safe_point

    model, tok = mlx_lm.load(str(model_dir))
    gen = ContinuousGenerator(model, tok, SamplingConfig(temperature=1.0, max_tokens=24, group_size=4, seed=0),
                              max_batch=8)
    prompt = list(tok.encode("1 + 2 ="))
    queue = [(i, False) for i in range(6)]
    finished, drops = [], dict.fromkeys(range(6), 0)
    for _ in range(2000):  # decode steps at most
        if not queue and not gen.groups:
            break
        if at_safe_point(gen.groups, any(r for _, r in gen.tags()), 0, 0):  # always asked, never drained
            for i, _ in gen.quiesce():
                drops[i] += 1
                queue.insert(0, (i, True))
        for _ in range(gen.room(8)):
            if queue:
                gen.insert(prompt, queue.pop(0))
        finished += [f.tag[0] for f in gen.advance(1)[0]]
    gen.close()
    assert sorted(finished) == list(range(6)) and max(drops.values()) == 1


def test_inserted_and_finished_groups_hand_their_buffers_back(model_dir: Path) -> None:
    """The generation loop's decode call: once groups are inserted or a group finishes, MLX keeps
    no freed buffers around (its cache would otherwise hold the ended sequences' KV cache, or the
    batch cache the new groups were merged out of, as much again)."""
    import threading

    import mlx.core as mx
    import mlx_lm

    from macd.generate import ContinuousGenerator, SamplingConfig
    from macd.generation import _insert_and_advance
    from macd.mlx_thread import MemoryReleaser

    model, tok = mlx_lm.load(str(model_dir))
    gen = ContinuousGenerator(model, tok, SamplingConfig(temperature=1.0, max_tokens=24, group_size=4, seed=0),
                              max_batch=8)
    prompt = list(tok.encode("1 + 2 ="))
    inserts = [(prompt, i) for i in range(2)]
    finished: list = []
    for _ in range(200):
        inserted = bool(inserts)
        done, _ = _insert_and_advance(gen, inserts, 4, threading.Event(), MemoryReleaser(every_s=0.0))
        inserts = []
        if inserted:  # the prefill's buffers and the batch cache the inserts' caches were merged out of
            assert mx.get_cache_memory() == 0
        if done:
            finished += done
            assert mx.get_cache_memory() == 0
        if len(finished) == 2:
            break
    gen.close()
    assert len(finished) == 2


def test_memory_is_released_at_most_every_so_often() -> None:
    from macd.mlx_thread import MemoryReleaser

    release = MemoryReleaser(every_s=3600.0)
    assert release() and not release() and not release()  # the first call releases, then it waits
    assert MemoryReleaser(every_s=0.0)() and MemoryReleaser(every_s=0.0)()
