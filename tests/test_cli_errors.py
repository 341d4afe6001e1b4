"""Bad input to `stoa` gives one clean `error:` line that says what to do, never a traceback."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.cli import main
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.store import open_store


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.fixture
def bucket(tmp_path: Path) -> str:
    (tmp_path / "bucket").mkdir()
    return f"file://{tmp_path / 'bucket'}"


def test_run_create_refuses_an_unknown_task(bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "create", "--store", bucket, "--run", "r", "--model", "m", "--task", "gsm9k"]) == 1
    assert "unknown task 'gsm9k': choose one of gsm8k, math, search, synthetic" in one_error_line(capsys)


def test_run_commands_take_store_like_every_other_command(
    bucket: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["run", "create", "--store", bucket, "--run", "r", "--model", "m", "--task", "synthetic"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("STOA_STORE", bucket)
    monkeypatch.setenv("STOA_RUN", "r")
    assert main(["run", "show"]) == 0 and '"task": "synthetic"' in capsys.readouterr().out
    capsys.readouterr()
    with pytest.raises(SystemExit):  # the bucket is a --store option, never a positional
        main(["run", "show", bucket, "--run", "r"])


def test_fleet_of_a_misspelled_run_is_an_error(bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "--store", bucket, "--run", "nope"]) == 1
    assert "run 'nope' does not exist" in one_error_line(capsys)


def test_publish_anchor_of_a_missing_folder_says_so(
    bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["weights", "publish-anchor", str(tmp_path / "nowhere"), "--store", bucket, "--run", "r"]) == 1
    assert "nowhere does not exist" in one_error_line(capsys)


def test_os_errors_read_as_sentences(bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "train.jsonl"
    assert main(["task", "prepare", "gsm8k", str(missing), "--store", bucket, "--run", "r"]) == 1
    err = one_error_line(capsys)
    assert err == f"error: {missing}: no such file or directory" and "Errno" not in err


def test_export_of_a_pruned_version_names_the_versions_kept(
    bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def publish() -> None:
        rng = np.random.default_rng(0)
        state = {"w": rng.integers(0, 1 << 15, size=(64,), dtype=np.uint16)}
        async with open_store(bucket) as store:
            pub = Publisher(store, "r", PublisherConfig(anchor_every=2, retain_anchors=1, retain_versions=1))
            for _ in range(5):
                await pub.publish(dict(state))
                state["w"] = state["w"] ^ np.uint16(1)

    asyncio.run(publish())
    assert main(["weights", "export", "--store", bucket, "--run", "r", "--version", "0", str(tmp_path / "out")]) == 1
    err = one_error_line(capsys)
    assert "v0" in err and "the versions that can be exported are v4..v4" in err, err


def test_broken_pipe_is_not_a_traceback(bucket: str) -> None:
    """`stoa store ls ... | head -1`: the reader goes away mid-output; stoa ends quietly."""

    async def fill() -> None:
        async with open_store(bucket) as store:
            for start in range(0, 3000, 50):  # a few files open at a time
                await asyncio.gather(*(store.put(f"many/{i:05d}-{'x' * 60}", b"") for i in range(start, start + 50)))

    asyncio.run(fill())  # ~250 KB of listing: more than a pipe holds
    pipeline = f"{sys.executable} -m slime_stoa.cli store ls {bucket} many/ | head -1"
    done = subprocess.run(["bash", "-c", pipeline], capture_output=True, text=True, timeout=120)
    assert done.stdout.count("\n") == 1
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
