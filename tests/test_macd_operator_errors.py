"""What retrying cannot fix stops a worker with one line (exit 2) instead of being retried forever:
a model family macd cannot run (refused at `macd join` too), a model mlx-lm cannot build, an error of
the code itself. Outages and malformed objects stay retried, and missing task data is waited for."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

import macd.following
from macd import cli
from macd import config as cfg
from macd.fatal import Fatal, permanent
from macd.worker import Worker, WorkerOptions, task_key
from slime_stoa.protocol.pulse.manifests import ManifestError
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import NotFound, Store, StoreError, open_store
from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model
from tests.test_worker import RUN, daemon_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_synthetic_model(tmp_path_factory.mktemp("tiny") / "model")


MANIFEST = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)


def seeded(tmp_path: Path, model: Path, *, task: bool = True) -> tuple[str, Path]:
    """A run of `model` in a local bucket (without its task data unless `task`), and a worker's
    config file joined to it without checking (as a worker started before any check would be)."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"

    async def seed() -> None:
        async with open_store(url) as store:
            await seed_run(store, MANIFEST, model, task_count=20)
            if not task:
                await store.delete(task_key(MANIFEST))

    asyncio.run(seed())
    path = cfg.save_config(daemon_config(url, tmp_path / "data"), tmp_path / "macd.toml")
    return url, path


def gpt2_folder(model_dir: Path, folder: Path) -> Path:
    """The tiny model with a config.json of the GPT-2 family (what the issue's worker was given)."""
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    return folder


def macd_run(path: Path) -> tuple[int, list[str], str]:
    """`macd run --config path` as a process (bounded: a worker that retries forever fails the
    test instead of hanging it): its exit status, its ERROR lines, all it wrote."""
    env = {**os.environ, "MLX_DISABLE_COMPILE": "1"}
    child = subprocess.Popen([sys.executable, "-m", "macd", "run", "--config", str(path)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
        out, _ = child.communicate()
        raise AssertionError(f"macd run did not stop by itself:\n{out[-3000:]}") from None
    errors = [line.split(" ERROR macd: ", 1)[1] for line in out.splitlines() if " ERROR macd: " in line]
    return child.returncode, errors, out


def test_an_unsupported_architecture_stops_macd_run_with_one_line(model_dir: Path, tmp_path: Path) -> None:
    _, path = seeded(tmp_path, gpt2_folder(model_dir, tmp_path / "gpt2"))
    rc, errors, out = macd_run(path)
    assert rc == 2 and len(errors) == 1, out
    assert "model_type 'gpt2' is not supported" in errors[0] and "stoa run create --store" in errors[0]
    assert "retrying" not in out and "Traceback" not in out  # stopped at once, with its one line


def test_join_refuses_an_unsupported_architecture(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = seeded(tmp_path, gpt2_folder(model_dir, tmp_path / "gpt2"))
    assert cli.main(["join", url, "--run", RUN, "--config", str(tmp_path / "joined.toml")]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "model_type 'gpt2' is not supported" in line
    assert not (tmp_path / "joined.toml").exists()


async def test_a_worker_waits_for_missing_task_data_naming_stoa_task_prepare(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Task data deleted (or never prepared) is healable: the worker says the exact `stoa task
    prepare` command at tries 1, 2, 4, 8, ... and generates once the task is back."""
    from slime_stoa.cli import build_parser

    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"
    async with open_store(url) as store:
        await seed_run(store, MANIFEST, model_dir, task_count=20)
        data = await store.get_bytes(task_key(MANIFEST))
        await store.delete(task_key(MANIFEST))
        options = WorkerOptions(seed=1, idle_poll_s=0.001, setup_retry_max_s=0.002, max_cohorts=1)
        worker = Worker(daemon_config(url, tmp_path / "data"), store, options)
        caplog.set_level("INFO", logger="macd")
        running = asyncio.create_task(worker.run(asyncio.Event()))
        while worker.beat.errors < 9 and not running.done():  # nine tries found no task
            await asyncio.sleep(0.001)
        said = [r.getMessage() for r in caplog.records if "has no task data" in r.getMessage()]
        tries = worker.beat.errors  # read with the lines, nothing awaited between
        assert not running.done() and worker.cohorts == 0
        assert len(said) == tries.bit_length() < tries  # tries 1, 2, 4, 8: a backoff, not a line per poll
        assert len(set(said)) == 1 and worker.beat.last_error == said[0] and "\n" not in said[0]
        command = next(part for part in said[0].split("`")[1::2] if part.startswith("stoa task prepare"))
        args: argparse.Namespace = build_parser().parse_args(shlex.split(command)[1:])
        assert (args.task, args.files, args.store, args.run, args.split) == ("synthetic", [], url, RUN, "train")
        await store.put(task_key(MANIFEST), data)  # the operator prepared it again
        assert await asyncio.wait_for(running, 120) == 0
    assert worker.cohorts == 1 and worker.groups_recorded + worker.groups_filtered > 0
    assert any("its task data is there now" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("error", [TypeError("build() got an unexpected keyword"), ValueError("shape (4, 8) != (8, 4)")])
async def test_a_model_mlx_lm_cannot_build_stops_the_worker(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    await seed_run(store, MANIFEST, model_dir, task_count=20)
    calls = []

    def refuse(*args: object) -> None:
        calls.append(args)
        raise error

    monkeypatch.setattr(macd.following, "_build_model", refuse)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), store, WorkerOptions(seed=1, idle_poll_s=0.01))
    with pytest.raises(Fatal, match=type(error).__name__) as stopped:
        await asyncio.wait_for(worker.run(asyncio.Event()), 120)
    assert len(calls) == 1 and "\n" not in str(stopped.value) and "could not build its model" in str(stopped.value)
    assert worker.beat.status == "stopped" and worker.beat.last_error == str(stopped.value)


async def test_an_outage_while_building_is_still_retried(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await seed_run(store, MANIFEST, model_dir, task_count=20)
    build = macd.following._build_model
    calls = []

    def flaky(*args: object) -> object:
        calls.append(args)
        if len(calls) == 1:
            raise OSError("disk busy")
        return build(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(macd.following, "_build_model", flaky)
    worker = Worker(daemon_config(store_url, tmp_path / "data"), store, WorkerOptions(seed=1, idle_poll_s=0.01, max_cohorts=1))
    assert await asyncio.wait_for(worker.run(asyncio.Event()), 120) == 0
    assert len(calls) == 2 and worker.cohorts == 1 and "disk busy" in worker.beat.last_error


@pytest.mark.parametrize("exc", [
    StoreError("503"), NotFound("runs/x/pointer.json"), OSError("reset"), TimeoutError(), ConnectionError(),
    ValueError("malformed"), ManifestError("bad pointer"),
])
def test_what_may_pass_is_not_permanent(exc: Exception) -> None:
    assert permanent(exc, "run") is None


@pytest.mark.parametrize("exc", [TypeError("x"), AttributeError("x"), ImportError("no mlx_lm"), NotImplementedError()])
def test_errors_of_the_code_are_permanent(exc: Exception) -> None:
    fatal = permanent(exc, "weights")
    assert fatal is not None and str(fatal).startswith(f"weights: {type(exc).__name__}") and "\n" not in str(fatal)
    assert permanent(fatal, "run") is fatal


async def test_a_plane_the_run_cannot_serve_stops_the_worker(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path
) -> None:
    """The config's `plane` asks for int4 of a run that does not publish it: a config error."""
    from dataclasses import replace

    await seed_run(store, MANIFEST, model_dir, task_count=20)
    config = replace(daemon_config(store_url, tmp_path / "data"), plane="int4")
    worker = Worker(config, store, WorkerOptions(seed=1, idle_poll_s=0.01))
    with pytest.raises(Fatal, match=r"does not publish the int4 plane.*change `plane` in the config"):
        await asyncio.wait_for(worker.run(asyncio.Event()), 120)
