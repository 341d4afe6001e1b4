"""`stoa task prepare` writes task data workers and the trainer read back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from slime_stoa.cli import main
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import open_store
from slime_stoa.tasks import load_task
from tests.shared_data import GSM8K_DIR, needs_gsm8k

GSM8K = GSM8K_DIR


def read(url: str, key: str) -> bytes:
    async def go() -> bytes:
        async with open_store(url) as store:
            return await store.get_bytes(key)

    return asyncio.run(go())


def test_synthetic(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url = f"file://{tmp_path}"
    args = ["task", "prepare", "synthetic", "--store", url, "--run", "r", "--count", "30"]
    assert main(args) == 0
    task = load_task(read(url, RunLayout("r").task_file("synthetic", "train.jsonl.zst")))
    assert task.name == "synthetic" and len(task) == 30
    assert main(args) == 0  # the same data again is fine
    assert main(args[:-1] + ["31"]) == 1
    assert "immutable" in capsys.readouterr().err


@needs_gsm8k
def test_gsm8k_from_the_real_files(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    files = [str(GSM8K / "train.jsonl"), str(GSM8K / "test.jsonl")]
    assert main(["task", "prepare", "gsm8k", *files, "--store", url, "--run", "r"]) == 0
    layout = RunLayout("r")
    train = load_task(read(url, layout.task_file("gsm8k", "train.jsonl.zst")))
    test = load_task(read(url, layout.task_file("gsm8k", "test.jsonl.zst")))
    assert (len(train), len(test)) == (7473, 1319)
    item = train.items[0]
    assert train.reward(f"... so the answer is #### {item.label}", item.label) == 1.0


def test_bad_invocations(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    assert main(["task", "prepare", "gsm8k", "--store", url, "--run", "r"]) == 1
    assert main(["task", "prepare", "synthetic", "x.jsonl", "--store", url, "--run", "r"]) == 1
