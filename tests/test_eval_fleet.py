"""Fleet eval end to end: a real macd worker answers an eval request with eval records of the
requested version, the requester collects and re-scores them, and the trainer never trains on them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

from macd.config import DaemonConfig
from macd.worker import Worker, WorkerOptions
from slime_stoa.evaluation.collect import EvalCollector, open_eval_context
from slime_stoa.evaluation.fleet import EvalTimeout, await_answers, post_request, read_request, version_result
from slime_stoa.protocol.eval_request import EvalRequest
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.records import decode_group
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import Store
from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model
from slime_stoa.tasks.objects import put_task_objects, task_objects
from slime_stoa.trainer.consumer import ConsumerConfig, RolloutConsumer

RUN = "eval-fleet"
K = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_synthetic_model(tmp_path_factory.mktemp("tiny") / "model")


async def seed_eval_run(store: Store, model_dir: Path) -> RunManifest:
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6, temperature=1.0)
    await seed_run(store, manifest, model_dir, task_count=40)
    await put_task_objects(store, RUN, "synthetic", task_objects("synthetic", [], split="test", count=12, seed=7, limit=None))
    return manifest


def request(prompts: range | tuple[int, ...], version: int = 0) -> EvalRequest:
    return EvalRequest(run=RUN, version=version, split="test", k=K, prompts=tuple(prompts), max_tokens=6, temperature=1.0)


async def test_worker_answers_an_eval_request_and_the_trainer_never_trains_on_it(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    await seed_eval_run(store, model_dir)
    config = DaemonConfig(store=store_url, run=RUN, name="eval-mac", worker_id="eval-mac-1", data_dir=tmp_path / "d", batch=2)
    worker = Worker(config, store, WorkerOptions(seed=3, heartbeat_s=0.5, eval_poll_s=0.2))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    try:
        wanted = request(range(5))
        posted = await post_request(store, wanted, signing_key=None)
        ctx = await open_eval_context(store, posted, tokenizer_dir=model_dir)
        collector = EvalCollector(store, ctx, posted)
        await await_answers(collector, signing_key=None, timeout_s=240, poll_s=0.2, narrow_s=0.5)
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 300) == 0

    result = version_result(collector, threshold=1.0)
    row = result.row()
    assert (row["version"], row["split"], row["k"], row["n_prompts"]) == (0, "test", K, 5)
    assert 0.0 <= row["pass@1"] <= row["pass@k"] <= 1.0 and row["search_rate"] is None
    assert [p.prompt_index for p in result.prompts] == list(range(5))
    assert all(len(p.rewards) == K for p in result.prompts)
    assert not collector.rejects
    # The trainer's rewards, from the split's labels: they equal a fresh scoring of the kept texts.
    for p in range(5):
        for g in collector.kept(p):
            assert g.rewards == tuple(ctx.task.reward(t, ctx.task.item(p).label) for t in g.texts)
    # The request is closed: no prompt left for workers.
    closed = await read_request(store, RUN, posted.key, None)
    assert closed is not None and closed.prompts == () and closed.revision > posted.revision

    layout = RunLayout(RUN)
    evals = [decode_group(await store.get_bytes(i.key)) async for i in store.list(layout.rollouts_prefix("eval"))]
    trains = [i.key async for i in store.list(layout.rollouts_prefix("train"))]
    assert evals and all(g.kind == "eval" and g.weight_version == 0 and len(g.samples) == K for g in evals)
    assert {g.prompt_index for g in evals} <= set(range(5)) and worker.evals is not None and worker.evals.groups == len(evals)
    assert trains, "the worker kept generating training groups"
    # The consumer lists the train prefix only: every group it hands out is a train record.
    consumer = await RolloutConsumer.open(
        store, ConsumerConfig(store_url=store_url, run=RUN, poll_interval_s=0.05, wait_timeout_s=30, filter_all_equal=False),
        tokenizer_dir=model_dir,
    )
    try:
        batch = await consumer.next_batch(min(2, len(trains)), trainer_version=0)
    finally:
        await consumer.close()
    assert all(g.key.startswith(layout.rollouts_prefix("train")) and g.group.kind == "train" for g in batch.groups)


async def test_an_unanswered_request_times_out_naming_the_version(store: Store, model_dir: Path) -> None:
    await seed_eval_run(store, model_dir)
    posted = await post_request(store, request(range(2)), signing_key=None)
    ctx = await open_eval_context(store, posted, tokenizer_dir=model_dir)
    with pytest.raises(EvalTimeout, match="v0"):
        await await_answers(EvalCollector(store, ctx, posted), signing_key=None, timeout_s=0.3, poll_s=0.05)


async def test_a_signed_run_evaluates_signed_records_of_workers_registered_later(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    """A signed run: the request is signed with the run key and the worker signs its eval records
    with its registered key. A forged registry when the collector opens does not end the eval
    (it is ignored), and a worker registered after that is learned from its records' key."""
    from slime_stoa.protocol.registry import add_worker, update_registry
    from slime_stoa.protocol.signing import SigningKey
    from slime_stoa.protocol.worker_keys import WorkerKeyFile, write_worker_key_file

    run_key, worker_key = SigningKey.generate(), SigningKey.generate()
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6, temperature=1.0)
    await seed_run(store, manifest, model_dir, task_count=40, key=run_key)
    test_split = task_objects("synthetic", [], split="test", count=12, seed=7, limit=None)
    await put_task_objects(store, RUN, "synthetic", test_split, key=run_key)  # a signed run: its task manifest too
    posted = await post_request(store, request(range(3)), signing_key=run_key)
    registry = RunLayout(RUN).registry
    await store.put(registry, b'{"format": "stoa.registry/1", "forged": true}')  # a worker's token can
    ctx = await open_eval_context(store, posted, tokenizer_dir=model_dir, registry_refresh_s=0.01)
    assert ctx.registry is not None and not ctx.registry.workers  # the forgery ignored, not fatal
    await store.delete(registry)
    await update_registry(store, RUN, run_key, lambda r: add_worker(r, worker="eval-mac-1", name="eval-mac", key=worker_key.public, now=1.0))
    key_file = write_worker_key_file(tmp_path / "w.key", WorkerKeyFile(run=RUN, worker="eval-mac-1", key=worker_key))
    config = DaemonConfig(
        store=store_url, run=RUN, name="eval-mac", worker_id="eval-mac-1", data_dir=tmp_path / "d", batch=2,
        run_key=run_key.public.to_text(), worker_key=str(key_file),
    )
    worker = Worker(config, store, WorkerOptions(seed=4, heartbeat_s=0.5, eval_poll_s=0.2))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    try:
        collector = EvalCollector(store, ctx, posted)
        await await_answers(collector, signing_key=run_key, timeout_s=240, poll_s=0.2, narrow_s=0.5)
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 300) == 0
    assert not collector.rejects and [p.prompt_index for p in version_result(collector, threshold=1.0).prompts] == [0, 1, 2]
    assert "eval-mac-1" in ctx.registry.workers
