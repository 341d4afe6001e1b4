"""The worker's plane choice counts the run's search index as `macd join` does (`index_plan`):
the index its manifest in the bucket describes can push a Mac from the run's bf16 plane to a
quantized plane the run publishes."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

from macd.config import decoding_sequences
from macd.plane_choice import choose_plane
from macd.shared_dir import SHARED_DIR_ENV
from macd.worker import Worker, WorkerOptions, waits_for
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.publisher import PublisherConfig
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store
from slime_stoa.protocol.task_manifest import TaskDataRefused, read_task_object
from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model
from slime_stoa.tasks.objects import put_task_objects
from slime_stoa.tasks.search.bundle import MANIFEST
from tests.test_index_plan import described_manifest, task_data
from tests.test_worker import RUN, daemon_config


async def test_the_worker_picks_its_plane_beside_the_runs_index(
    store: Store, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_synthetic_model(tmp_path / "model")
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=4, planes=("int8",))
    await seed_run(store, manifest, model_dir, task_count=4, publisher=PublisherConfig(extras_dir=model_dir, planes=("int8",)))
    config = daemon_config(store_url, tmp_path / "data")
    model_config = json.loads((model_dir / "config.json").read_text())
    sequences = decoding_sequences(config, manifest.group_size)
    monkeypatch.setattr("macd.plane_choice.plan_device", lambda: "gpu")  # a Mac's figures, on any machine
    bf16 = choose_plane(model_config, manifest, memory=1 << 40, sequences=sequences)
    int8 = choose_plane(model_config, replace(manifest, plane="int8"), memory=1 << 40, sequences=sequences)
    assert bf16 is not None and int8 is not None and int8.needed < bf16.needed
    index = bf16.needed - int8.needed  # the postings and tables of the index below
    memory = int(bf16.needed * 1.5 * 1.01)  # usable: 2/3 of it, bf16 fits with 1 % to spare, not beside the index
    monkeypatch.setattr("macd.following.memory_bytes", lambda: memory)
    monkeypatch.setenv(SHARED_DIR_ENV, str(tmp_path / "shared"))
    body = described_manifest({"postings.bin": index, "passages.zst": 1 << 30}, passages=1)
    await store.put(RunLayout(RUN).task_index_file("search", MANIFEST), body)
    await store.put(RunLayout(RUN).task_data("search", "train"), task_data("search", hashlib.sha256(body).hexdigest()))
    weights = Worker(config, store, WorkerOptions(seed=3)).weights
    assert await weights.plane_for(manifest, None) == "bf16"  # no search task: no index
    assert await weights.plane_for(replace(manifest, task="search"), None) == "int8"


async def test_a_signed_runs_replaced_split_is_waited_for_not_planned_from(
    store: Store, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signed run: a token holder replaces the split to pin a forged manifest of a tiny index (so
    this Mac would pick the bf16 plane): the plan read checks the split against the run key's task
    manifest, as the task load does, and refuses it with the task load's words."""
    key = SigningKey.generate()
    model_dir = tiny_synthetic_model(tmp_path / "model")
    manifest = RunManifest(run=RUN, model="tiny", task="search", group_size=4, max_tokens=4, planes=("int8",),
                           run_key=key.public.to_text())
    await seed_run(store, replace(manifest, task="synthetic", run_key=None), model_dir, task_count=4,
                   publisher=PublisherConfig(extras_dir=model_dir, planes=("int8",)))
    config = daemon_config(store_url, tmp_path / "data")
    model_config = json.loads((model_dir / "config.json").read_text())
    sequences = decoding_sequences(config, manifest.group_size)
    monkeypatch.setattr("macd.plane_choice.plan_device", lambda: "gpu")
    bf16 = choose_plane(model_config, replace(manifest, plane="bf16"), memory=1 << 40, sequences=sequences)
    int8 = choose_plane(model_config, replace(manifest, plane="int8"), memory=1 << 40, sequences=sequences)
    assert bf16 is not None and int8 is not None
    monkeypatch.setattr("macd.following.memory_bytes", lambda: int(bf16.needed * 1.5 * 1.01))
    monkeypatch.setenv(SHARED_DIR_ENV, str(tmp_path / "shared"))
    genuine = described_manifest({"postings.bin": bf16.needed - int8.needed, "passages.zst": 1 << 30}, passages=1)
    layout = RunLayout(RUN)
    await store.put(layout.task_index_file("search", MANIFEST), genuine)
    await put_task_objects(store, RUN, "search", {"train": task_data("search", hashlib.sha256(genuine).hexdigest())}, key=key)
    weights = Worker(config, store, WorkerOptions(seed=3)).weights
    assert await weights.plane_for(manifest, None) == "int8"  # the signed split pins the genuine index

    forged = described_manifest({}, passages=1)  # an index of nothing: bf16 would fit beside it
    await store.put(layout.task_index_file("search", MANIFEST), forged)
    await store.put(layout.task_data("search", "train"), task_data("search", hashlib.sha256(forged).hexdigest()))
    with pytest.raises(TaskDataRefused) as refused:
        await weights.plane_for(manifest, None)
    with pytest.raises(TaskDataRefused) as loaded:  # the task load's refusal: the same words
        await read_task_object(store, RUN, "search", "train", RunTrust.from_text(RUN, manifest.run_key))
    assert str(refused.value) == str(loaded.value) and "stoa task prepare search" in str(refused.value)
    assert str(waits_for(refused.value)).endswith("; this worker waits for it")
