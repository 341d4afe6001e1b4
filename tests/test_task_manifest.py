"""A signed run's task data is signed: the run key's task manifest names each task object's size
and sha256; the trainer, workers and evaluation refuse a split a bucket writer replaced."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from macd.config import DaemonConfig
from macd.worker import TaskNotPrepared, Worker
from slime_stoa.cli import main
from slime_stoa.judging.run_data import read_task
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust, Untrusted, rotation_bytes, rotation_document
from slime_stoa.protocol.signing import SigningKey, write_key_file
from slime_stoa.protocol.store import NotFound, Store, open_store
from slime_stoa.protocol.task_manifest import (
    MAX_TASK_MANIFEST_BYTES,
    TaskDataRefused,
    empty_manifest,
    parse_task_manifest,
    read_task_object,
    task_manifest_bytes,
)
from slime_stoa.tasks import generate_items, make_task
from slime_stoa.tasks.objects import put_task_objects
from slime_stoa.trainer.consumer import RolloutConsumer
from slime_stoa.trainer.consumer.pause import Broken
from slime_stoa.trainer.consumer.run_context import signed_task
from tests.test_consumer import RUN, Tiny, config, tiny
from tests.test_signed_records import setup_signed_run

__all__ = ["tiny"]  # the fixture, used by name

TASK = "synthetic"
LAYOUT = RunLayout(RUN)
TRAIN = LAYOUT.task_data(TASK, "train")


def task_bytes(seed: int, count: int = 6) -> bytes:
    return make_task(TASK, generate_items(count, seed=seed)).encode()


async def signed_run(store: Store, key: SigningKey) -> RunManifest:
    manifest = RunManifest(run=RUN, model="tiny", task=TASK, group_size=2, max_tokens=8, run_key=key.public.to_text())
    await store.put_if_absent(LAYOUT.run_manifest, manifest.to_bytes(key))
    await put_task_objects(store, RUN, TASK, {"train": task_bytes(1), "test": task_bytes(2)}, key=key)
    return manifest


# -- the codec ------------------------------------------------------------------------------------
def test_the_manifest_round_trips_and_refuses_what_its_key_did_not_sign() -> None:
    key, other = SigningKey.generate(), SigningKey.generate()
    manifest = empty_manifest(RUN, TASK).with_objects({"train.jsonl.zst": b"abc"})
    data = task_manifest_bytes(manifest, key)
    got = parse_task_manifest(data, run=RUN, task=TASK, keys=key.public, where="m")
    assert got.objects == manifest.objects and got.objects["train.jsonl.zst"].size == 3
    with pytest.raises(Untrusted, match="unknown key"):
        parse_task_manifest(data, run=RUN, task=TASK, keys=other.public, where="m")
    with pytest.raises(Untrusted, match="not of task 'gsm8k'"):
        parse_task_manifest(data, run=RUN, task="gsm8k", keys=key.public, where="m")
    doc = json.loads(data)
    doc["objects"]["train.jsonl.zst"]["size"] = 4  # one field changed after signing
    with pytest.raises(Untrusted, match="does not verify"):
        parse_task_manifest(json.dumps(doc).encode(), run=RUN, task=TASK, keys=key.public, where="m")
    with pytest.raises(Untrusted, match="limit"):  # refused by size before it is parsed
        parse_task_manifest(b" " * (MAX_TASK_MANIFEST_BYTES + 1), run=RUN, task=TASK, keys=key.public, where="m")
    bad_name = sign_doc_with(doc, key, objects={"../x": {"size": 1, "sha256": "0" * 64}})
    with pytest.raises(Untrusted, match="invalid file name"):
        parse_task_manifest(bad_name, run=RUN, task=TASK, keys=key.public, where="m")


def sign_doc_with(doc: dict, key: SigningKey, **changes: object) -> bytes:
    from slime_stoa.protocol.signing import canonical_json, sign_document

    return canonical_json(sign_document({**doc, **changes}, key))


# -- readers on the real store -------------------------------------------------------------------
async def test_a_forged_split_or_a_missing_manifest_is_refused_unsigned_runs_read_as_before(store: Store) -> None:
    key = SigningKey.generate()
    manifest = await signed_run(store, key)
    assert len(await read_task(store, manifest)) == 6
    assert len(await read_task(store, manifest, "test")) == 6  # evaluation's splits too
    genuine = await store.get_bytes(TRAIN)
    await store.put(TRAIN, genuine[:-1] + bytes([genuine[-1] ^ 1]))  # a worker token changes it, same size
    with pytest.raises(TaskDataRefused, match=rf"{TRAIN}: not the task data the run key signed.*--key") as exc:
        await read_task(store, manifest)
    assert exc.value.key == TRAIN
    await store.put(TRAIN, task_bytes(1) + b"grown")  # larger than signed: refused without reading it all
    with pytest.raises(TaskDataRefused, match="larger than"):
        await read_task(store, manifest)
    await store.put(TRAIN, task_bytes(1))
    await store.put(LAYOUT.task_manifest(TASK), task_manifest_bytes(empty_manifest(RUN, TASK).with_objects(
        {"train.jsonl.zst": task_bytes(9)}), SigningKey.generate()))  # a manifest signed by a forger's key
    with pytest.raises(TaskDataRefused, match="its task manifest is refused"):
        await read_task(store, manifest)
    await store.delete(LAYOUT.task_manifest(TASK))
    with pytest.raises(TaskDataRefused, match=r"has no task manifest.*stoa task prepare synthetic"):
        await read_task(store, manifest)
    await store.delete(TRAIN)
    with pytest.raises(NotFound):  # nothing prepared at all: the "not prepared yet" wait, not a forgery
        await read_task_object(store, RUN, TASK, "train", RunTrust(RUN, key.public))
    unsigned = RunManifest(run=RUN, model="tiny", task=TASK)
    await store.put(TRAIN, task_bytes(9))
    assert len(await read_task(store, unsigned)) == 6  # an unsigned run: no manifest needed


async def test_a_manifest_signed_before_a_rotation_still_verifies(store: Store) -> None:
    old, new = SigningKey.generate(), SigningKey.generate()
    manifest = await signed_run(store, old)
    await store.put(LAYOUT.key_rotation(1), rotation_bytes(rotation_document(RUN, 1, new.public, 3, old)))
    assert len(await read_task(store, manifest)) == 6
    trust = RunTrust(RUN, old.public)
    await put_task_objects(store, RUN, TASK, {"eval": task_bytes(3)}, key=new, trust=trust)  # prepared after it
    assert trust.rotations == 1
    assert len(await read_task(store, manifest, "eval")) == len(await read_task(store, manifest, "test")) == 6


async def test_the_worker_waits_on_a_forged_split_naming_the_repair(store: Store, store_url: str, tmp_path: Path) -> None:
    key = SigningKey.generate()
    await signed_run(store, key)
    config = DaemonConfig(store=store_url, run=RUN, name="mac", worker_id="mac-a", data_dir=tmp_path / "data", batch=1,
                          run_key=key.public.to_text())
    worker = Worker(config, store)
    _, task = await worker._load_run()
    assert len(task) == 6
    await store.put(TRAIN, task_bytes(9, count=60))  # other labels
    with pytest.raises(TaskNotPrepared, match=rf"{TRAIN}: larger than the task data.*--key RUN_KEY_FILE.*waits"):
        await worker._load_run()
    await store.delete(LAYOUT.task_manifest(TASK))
    with pytest.raises(TaskNotPrepared, match="has no task manifest"):
        await worker._load_run()


async def test_the_trainer_pauses_on_a_forged_split_and_resumes_once_it_is_put_back(
    store: Store, store_url: str, tiny: Tiny
) -> None:
    run = await setup_signed_run(store, tiny)
    genuine = await store.get_bytes(TRAIN)
    forged = make_task(TASK, generate_items(64, seed=99)).encode()
    await store.put(TRAIN, forged)
    with pytest.raises(Broken, match=r"task data .* is refused"):  # one try: a pause, never a crash
        await signed_task(store, config(store_url), (await _manifest(store)))
    broken: list[Broken] = []

    async def operator_puts_it_back(_: float) -> None:  # the pause's sleep: bounded by tries, not time
        assert len(broken) <= 2, "still refused after the genuine split was put back"
        await store.put(TRAIN, genuine)

    consumer = await RolloutConsumer.open(
        store, config(store_url, run_key=run.run_key.public.to_text()), decode=tiny.decode, eos_ids=frozenset({tiny.eos}),
        prompt_of=tiny.prompt, restore=False, on_try=broken.append, sleep=operator_puts_it_back,
    )
    assert len(broken) == 1 and consumer.config.run == RUN
    assert "stoa task prepare synthetic" in broken[0].repair and "--key" in broken[0].repair


async def _manifest(store: Store) -> RunManifest:
    from slime_stoa.protocol.run_manifest import read_run_manifest

    return await read_run_manifest(store, RUN)


# -- stoa task prepare ----------------------------------------------------------------------------
def test_prepare_signs_with_the_run_key_and_refuses_a_signed_run_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    url, key_file = f"file://{tmp_path / 'bucket'}", tmp_path / "run.key"
    (tmp_path / "bucket").mkdir()
    write_key_file(key_file, SigningKey.generate())
    assert main(["run", "create", "--store", url, "--run", "r", "--model", "m", "--task", TASK, "--key", str(key_file)]) == 0
    prepare = ["task", "prepare", TASK, "--store", url, "--run", "r", "--count", "8"]
    capsys.readouterr()
    assert main(prepare) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is signed" in err and "--key PATH" in err
    assert main([*prepare, "--key", str(key_file)]) == 0
    assert "signed runs/r/tasks/synthetic/task.json" in capsys.readouterr().out
    assert main([*prepare, "--split", "test", "--key", str(key_file)]) == 0  # a second split kept beside the first

    async def read_back() -> tuple[int, int]:
        async with open_store(url) as store:
            from slime_stoa.protocol.run_manifest import read_run_manifest

            manifest = await read_run_manifest(store, "r")
            return len(await read_task(store, manifest)), len(await read_task(store, manifest, "test"))

    assert asyncio.run(read_back()) == (8, 8)
    other = tmp_path / "other.key"
    write_key_file(other, SigningKey.generate())
    assert main([*prepare, "--key", str(other)]) == 1
    assert "is not a key of run 'r'" in capsys.readouterr().err


def test_prepare_of_an_unsigned_run_is_unchanged(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url, key_file = f"file://{tmp_path / 'bucket'}", tmp_path / "run.key"
    (tmp_path / "bucket").mkdir()
    assert main(["run", "create", "--store", url, "--run", "r", "--model", "m", "--task", TASK]) == 0
    assert main(["task", "prepare", TASK, "--store", url, "--run", "r", "--count", "8"]) == 0
    assert not (tmp_path / "bucket" / "runs" / "r" / "tasks" / TASK / "task.json").exists()
    write_key_file(key_file, SigningKey.generate())
    capsys.readouterr()
    assert main(["task", "prepare", TASK, "--store", url, "--run", "r", "--count", "8", "--key", str(key_file)]) == 1
    assert "unsigned" in capsys.readouterr().err
