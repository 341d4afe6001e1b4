"""Weights & Biases logging on both halves, run for real with `WANDB_MODE=offline`.

Each W&B test reads back what wandb itself wrote: the run's `.wandb` transaction log under
`$WANDB_DIR/wandb/offline-run-*/` (a LevelDB-style log of wandb's protobuf `Record`s; wandb
0.31 ships the message definitions but no Python reader of the log, so `offline_runs` walks it:
32 KiB blocks of `crc32 | length | type` chunks). From the records: the step axes
(`define_metric`), the history rows and the run's name and group. Every test ends the wandb
service it started and checks that no `wandb-core` process of its own is left behind.

The pure parts (a heartbeat as metrics, the fleet's totals, reading a run's heartbeats) are
tested without wandb, and so is everything that must keep working when wandb is not installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slime_stoa.protocol.heartbeat import Heartbeat, read_heartbeats, worker_metrics
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import Store
from slime_stoa.trainer import tracking
from slime_stoa.trainer.slime import rollout
from tests.conftest import wait_until
from tests.test_consumer import RUN, G, make_group, setup_run, tiny, upload
from tests.test_rollout_resilience import rollout_args, slime

__all__ = ["slime", "tiny"]  # fixtures

REPO = Path(__file__).resolve().parent.parent
NOW = 1_800_000_000.0
#: slime's own axes (slime/observability/wandb_utils.py, `_init_wandb_common`)
SLIME_AXES = (
    ("train/step", None), ("train/*", "train/step"), ("rollout/step", None), ("rollout/*", "rollout/step"),
    ("multi_turn/*", "rollout/step"), ("passrate/*", "rollout/step"), ("eval/step", None),
    ("eval/*", "eval/step"), ("perf/*", "rollout/step"),
)


def beat(worker: str = "mac-1", **fields: Any) -> Heartbeat:
    values: dict[str, Any] = dict(
        worker_id=worker, name=worker, status="generating", version=3, pointer_version=4, tokens_per_s=120.5,
        groups_uploaded=7, groups_spooled=2, groups_quarantined=1, swaps=3, last_swap_s=0.25, errors=1,
        memory_gb=1.5, updated_at=NOW - 5,
    )
    values.update(fields)
    return Heartbeat(**values)


# -- offline W&B: the fixture and the reader ----------------------------------------------------------
def wandb_env(tmp_path: Path) -> dict[str, str]:
    """An offline wandb that writes only under `tmp_path` and prints nothing."""
    return {
        "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb-files"), "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "WANDB_DISABLE_GIT": "true",
    }


def wandb_services(pid: int) -> list[int]:
    """The `wandb-core` processes started for process `pid` (they carry `--pid <pid>`)."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"wandb-core") and b"--pid" in argv and str(pid).encode() in argv:
            out.append(int(proc.name))
    return out


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """wandb offline in this process; yields its WANDB_DIR. Afterwards the service is torn down."""
    wandb = pytest.importorskip("wandb")
    if not Path("/proc/self").exists():
        pytest.skip("needs /proc to check that the wandb service is gone")
    env = wandb_env(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    Path(env["WANDB_DIR"]).mkdir()
    yield Path(env["WANDB_DIR"])
    wandb.teardown()
    wait_until(lambda: not wandb_services(os.getpid()), timeout=30, interval=0.1, message="the wandb service to exit")


@dataclass
class OfflineRun:
    name: str
    group: str
    job_type: str
    run_id: str
    axes: dict[str, str | None]  # metric or glob -> the step metric it is plotted against (None: a step)
    rows: list[dict[str, Any]]  # history, one dict per wandb.log call


BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: Path) -> Iterator[Any]:
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    pos, chunks = 7, []  # the file header: ":W&B", a 2-byte magic number, a version byte
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # too little room left in the block for a chunk header: padding
            pos += room
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0:  # zeros up to the block's end
            pos += room
            continue
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (FULL, LAST):
            record = Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def offline_runs(folder: Path) -> list[OfflineRun]:
    """Every offline run wandb wrote under `folder`, oldest first."""
    runs = []
    for path in sorted(folder.rglob("offline-run-*/run-*.wandb")):
        run: OfflineRun | None = None
        axes: dict[str, str | None] = {}
        rows: list[dict[str, Any]] = []
        for record in _records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                r = record.run
                run = OfflineRun(r.display_name, r.run_group, r.job_type, r.run_id, axes, rows)
            elif kind == "metric":
                m = record.metric
                axes[m.name or m.glob_name] = m.step_metric or None
            elif kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
        assert run is not None, f"no run record in {path}"
        runs.append(run)
    return runs


def written_runs(folder: Path) -> list[OfflineRun]:
    """`offline_runs` of this process, once its wandb service has written everything (a
    finished run's log is complete on disk only when the service has shut down)."""
    import wandb

    wandb.teardown()
    return offline_runs(folder)


def rows_with(run: OfflineRun, key: str) -> list[dict[str, Any]]:
    return [row for row in run.rows if key in row]


# -- a heartbeat as metrics (pure) ------------------------------------------------------------------
def test_a_running_workers_heartbeat_as_metrics() -> None:
    got = worker_metrics(beat(), NOW, prefix="worker/mac-1", head=6)
    assert got == {
        "worker/mac-1/running": 1.0, "worker/mac-1/tokens_per_s": 120.5, "worker/mac-1/tokens_generated": 0.0,
        "worker/mac-1/groups_uploaded": 7.0,
        "worker/mac-1/groups_spooled": 2.0, "worker/mac-1/groups_quarantined": 1.0, "worker/mac-1/errors": 1.0,
        "worker/mac-1/groups_filtered": 0.0, "worker/mac-1/prompts_solved": 0.0, "worker/mac-1/weights_refused": 0.0,
        "worker/mac-1/swaps": 3.0, "worker/mac-1/last_swap_s": 0.25, "worker/mac-1/memory_gb": 1.5,
        "worker/mac-1/heartbeat_age_s": 5.0, "worker/mac-1/version": 3.0, "worker/mac-1/lag": 3.0,
    }
    own_view = worker_metrics(beat(), NOW)  # macd's own stream: no worker id, lag against the pointer it saw
    assert own_view["worker/lag"] == 1.0 and own_view["worker/tokens_per_s"] == 120.5
    assert all(isinstance(v, float) for v in got.values())


@pytest.mark.parametrize(
    "fields", [dict(status="stopped"), dict(updated_at=NOW - 600)], ids=["stopped", "silent"]
)
def test_a_worker_that_does_not_run_has_no_throughput_and_no_lag(fields: dict[str, Any]) -> None:
    got = worker_metrics(beat(**fields), NOW, prefix="w", head=6)
    assert got["w/running"] == 0.0 and got["w/tokens_per_s"] == 0.0
    assert "w/lag" not in got and got["w/version"] == 3.0  # its version is history, not lag


def test_unknown_versions_are_left_out() -> None:
    got = worker_metrics(beat(version=None, pointer_version=None), NOW, prefix="w")
    assert "w/version" not in got and "w/lag" not in got


def test_fleet_metrics_per_worker_and_totals_of_the_running() -> None:
    beats = [
        beat("a", version=5, tokens_per_s=100.0, errors=2, groups_spooled=1),
        beat("b", version=2, tokens_per_s=50.0, errors=0, groups_spooled=4),
        beat("c", status="stopped", version=1, tokens_per_s=999.0, errors=3, groups_spooled=0),
    ]
    got = tracking.fleet_metrics(beats, NOW, head=6)
    assert got["worker/a/lag"] == 1.0 and got["worker/b/lag"] == 4.0 and "worker/c/lag" not in got
    assert got["rollout/stoa_fleet_running"] == 2.0
    assert got["rollout/stoa_fleet_tokens_per_s"] == 150.0  # the stopped worker's last rate is not counted
    assert got["rollout/stoa_fleet_lag_max"] == 4.0
    assert got["rollout/stoa_fleet_errors"] == 5.0 and got["rollout/stoa_fleet_spooled"] == 5.0
    assert tracking.fleet_metrics([], NOW)["rollout/stoa_fleet_running"] == 0.0


async def test_read_heartbeats_skips_and_counts_what_it_cannot_parse(store: Store) -> None:
    layout = RunLayout("hb")
    await store.put(layout.heartbeat("mac-1"), beat("mac-1").to_bytes())
    await store.put(layout.heartbeat("mac-2"), beat("mac-2").to_bytes())
    await store.put(layout.heartbeat("mac-3"), b"{not json")
    await store.put(layout.heartbeat("mac-4"), beat("mac-1").to_bytes())  # another worker's heartbeat
    beats, bad = await read_heartbeats(store, "hb", concurrency=2)
    assert sorted(b.worker_id for b in beats) == ["mac-1", "mac-2"] and bad == 2
    assert await read_heartbeats(store, "no-such-run") == ([], 0)


# -- slime's path: the rollout function's metrics, logged the way slime logs them ----------------------
def open_like_slime(wandb: Any) -> Any:
    """The run slime's rollout process has joined (offline: `init_wandb_primary`/`_secondary`,
    then `_init_wandb_common`'s axes)."""
    run = wandb.init(project="stoa-test", group="slime-run", name="slime-run", settings=wandb.Settings(mode="offline"))
    for metric, step in SLIME_AXES:
        if step is None:
            run.define_metric(metric)
        else:
            run.define_metric(metric, step_metric=step)
    return run


def log_like_slime(wandb: Any, rollout_id: int, metrics: dict[str, float]) -> None:
    """slime's `log_rollout_data`: the rollout function's metrics with `rollout/step`."""
    wandb.log({**metrics, "rollout/step": rollout_id})


async def write_beat(store: Store, heartbeat: Heartbeat) -> None:
    await store.put(RunLayout(RUN).heartbeat(heartbeat.worker_id), heartbeat.to_bytes())


async def test_slime_logs_rollout_and_worker_metrics_on_rollout_step(
    store: Store, store_url: str, tiny: Any, slime: None, offline_wandb: Path
) -> None:
    import wandb

    await setup_run(store, tiny)
    for i in range(2):
        await upload(store, make_group(tiny, worker="w", seq=i, prompt_index=i))
    await write_beat(store, beat("w", version=0, pointer_version=0, tokens_per_s=88.0, errors=2, updated_at=time.time()))
    await write_beat(store, beat("gone", status="stopped", updated_at=time.time() - 3600))
    run = open_like_slime(wandb)
    args = rollout_args(store_url, tiny, use_wandb=True)
    out = await asyncio.to_thread(rollout.generate_rollout, args, 0, rollout.StoaDataSource(args))
    log_like_slime(wandb, 0, out.metrics)
    run.finish()

    (logged,) = written_runs(offline_wandb)
    assert logged.axes["worker/*"] == "rollout/step"  # stoa's one addition to slime's axes
    assert all(logged.axes[m] == s for m, s in SLIME_AXES)
    (row,) = rows_with(logged, "rollout/step")
    assert row["rollout/step"] == 0
    assert row["rollout/stoa_groups"] == 2 and row["rollout/stoa_scored_samples"] == 2 * G
    assert row["worker/w/groups"] == 2  # the consumer's count of the worker's groups
    assert row["worker/w/tokens_per_s"] == 88.0 and row["worker/w/errors"] == 2 and row["worker/w/lag"] == 0
    assert row["worker/gone/running"] == 0 and "worker/gone/lag" not in row
    assert row["rollout/stoa_fleet_running"] == 1 and row["rollout/stoa_fleet_tokens_per_s"] == 88.0
    assert row["rollout/stoa_fleet_bad_heartbeats"] == 0


async def test_without_tracking_the_rollout_reads_no_heartbeats(store: Store, store_url: str, tiny: Any, slime: None) -> None:
    await setup_run(store, tiny)
    for i in range(4):
        await upload(store, make_group(tiny, worker="w", seq=i, prompt_index=i))
    await write_beat(store, beat("w", version=0, updated_at=time.time()))
    args = rollout_args(store_url, tiny)  # neither --use-wandb nor --use-tensorboard
    source = rollout.StoaDataSource(args)
    plain = await asyncio.to_thread(rollout.generate_rollout, args, 0, source)
    assert "worker/w/groups" in plain.metrics and not any(k.startswith("rollout/stoa_fleet") for k in plain.metrics)
    assert "worker/w/tokens_per_s" not in plain.metrics
    asked = rollout_args(store_url, tiny, stoa_worker_metrics="true", use_tensorboard=False)
    out = await asyncio.to_thread(rollout.generate_rollout, asked, 1, source)
    assert out.metrics["worker/w/tokens_per_s"] == 120.5 and out.metrics["rollout/stoa_fleet_running"] == 1


def test_the_worker_metrics_setting() -> None:
    from slime_stoa.trainer.slime.settings import StoaSettings

    def parse(**keys: object) -> bool:
        return StoaSettings.from_args(types.SimpleNamespace(stoa_bucket="file:///b", stoa_run="r", **keys)).worker_metrics

    assert parse() is False
    assert parse(use_wandb=True) is True
    assert parse(use_tensorboard=True) is True
    assert parse(use_wandb=True, stoa_worker_metrics=False) is False
    with pytest.raises(ValueError, match="stoa_worker_metrics must be true or false"):
        parse(stoa_worker_metrics="sometimes")
    from slime_stoa.trainer.slime.preflight import known_settings

    assert "stoa_worker_metrics" in known_settings()


# -- without wandb installed -------------------------------------------------------------------------
@pytest.fixture
def no_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import wandb` fails in this process, as where the package is not installed."""
    monkeypatch.setitem(sys.modules, "wandb", None)


def test_wandb_is_imported_only_when_asked_for() -> None:
    code = (
        "import sys\n"
        "import slime_stoa.trainer.slime.rollout, slime_stoa.trainer.tracking, slime_stoa.quickstart.run\n"
        "import macd.run_cmd, macd.tracking\n"
        "assert 'wandb' not in sys.modules, 'wandb imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


async def test_a_rollout_with_use_wandb_but_no_wandb_still_returns_its_metrics(
    store: Store, store_url: str, tiny: Any, slime: None, no_wandb: None, caplog: pytest.LogCaptureFixture
) -> None:
    await setup_run(store, tiny)
    for i in range(2):
        await upload(store, make_group(tiny, worker="w", seq=i, prompt_index=i))
    args = rollout_args(store_url, tiny, use_wandb=True)
    out = await asyncio.to_thread(rollout.generate_rollout, args, 0, rollout.StoaDataSource(args))
    assert out.metrics["rollout/stoa_groups"] == 2 and out.metrics["rollout/stoa_fleet_running"] == 0
    assert any("pip install wandb" in r.getMessage() for r in caplog.records)


def test_opening_a_run_without_wandb_says_how_to_install_it(no_wandb: None, tmp_path: Path) -> None:
    with pytest.raises(tracking.TrackingUnavailable, match=r"pip install wandb"):
        tracking.TrackedRun.open(project="p", name="n", group="g", config={}, folder=tmp_path)
    from macd import tracking as macd_tracking

    with pytest.raises(macd_tracking.TrackingUnavailable, match=r"pip install wandb"):
        macd_tracking.import_wandb()


def one_error_line(err: str, *expected: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def test_quickstart_wandb_without_wandb_is_one_error_line(
    tmp_path: Path, no_wandb: None, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    from slime_stoa.cli import main

    out = tmp_path / "qs"
    assert main(["quickstart", "--out", str(out), "--wandb"]) == 1
    one_error_line(capsys.readouterr().err, "--wandb:", "pip install wandb")
    assert not out.exists()  # it failed before doing anything


def test_quickstart_has_the_wandb_options() -> None:
    import argparse

    from slime_stoa.cli.quickstart_cmd import add_config_options

    parser = argparse.ArgumentParser()
    add_config_options(parser)
    assert parser.parse_args([]).wandb is False
    got = parser.parse_args(["--wandb", "--wandb-project", "mine"])
    assert got.wandb is True and got.wandb_project == "mine"


def joined_config(tmp_path: Path, **fields: Any) -> Path:
    from macd.config import DaemonConfig, save_config

    config = DaemonConfig(
        store=f"file://{tmp_path / 'bucket'}", run=RUN, name="ci-mac", worker_id="ci-mac-000001",
        data_dir=tmp_path / "data", batch=2, **fields,
    )
    return save_config(config, tmp_path / "macd.toml")


def test_macd_run_wandb_without_wandb_is_one_error_line(
    tmp_path: Path, no_wandb: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from macd.cli import main

    path = joined_config(tmp_path)
    assert main(["run", "--config", str(path), "--wandb-project", "fleet"]) == 1
    one_error_line(capsys.readouterr().err, "needs the wandb package", "pip install wandb")
    with_key = joined_config(tmp_path, wandb_project="fleet")
    assert main(["run", "--config", str(with_key)]) == 1
    one_error_line(capsys.readouterr().err, "pip install wandb")
    assert main(["run", "--config", str(path), "--wandb-project", "a/b"]) == 1
    one_error_line(capsys.readouterr().err, "invalid wandb_project 'a/b'")


def test_macd_config_keeps_and_checks_the_wandb_project(tmp_path: Path) -> None:
    from macd.config import ConfigError, DaemonConfig, load_config

    assert load_config(joined_config(tmp_path, wandb_project="fleet-1")).wandb_project == "fleet-1"
    assert "wandb_project" not in joined_config(tmp_path).read_text()  # off: not written at all
    assert load_config(joined_config(tmp_path)).wandb_project is None
    bad = joined_config(tmp_path).read_text() + 'wandb_project = "a/b"\n'
    with pytest.raises(ConfigError, match="invalid wandb_project 'a/b'"):
        DaemonConfig.from_toml(bad, "macd.toml")


# -- the quickstart's own run ------------------------------------------------------------------------
def test_a_tracked_run_logs_on_slimes_axes_and_resumes_from_its_id_file(offline_wandb: Path, tmp_path: Path) -> None:
    id_file = tmp_path / "run-id"
    first = tracking.TrackedRun.open(project="p", name="qs", group="qs", config={"lr": 0.1}, id_file=id_file)
    first.log({"train/loss": 1.5}, step_key="train/step", step=0)
    first.log({"rollout/stoa_groups": 16.0, "worker/w/tokens_per_s": 9.0}, step_key="rollout/step", step=0)
    first.close()
    run_id = id_file.read_text().strip()
    again = tracking.TrackedRun.open(project="p", name="qs", group="qs", config={"lr": 0.1}, id_file=id_file)
    again.log({"train/loss": 1.25}, step_key="train/step", step=1)
    again.close()
    runs = written_runs(offline_wandb)
    assert [r.run_id for r in runs] == [run_id, run_id]  # the rerun resumed the same W&B run
    assert runs[0].axes == dict(tracking.STEP_AXES) and runs[0].job_type == "trainer"
    (trained,) = rows_with(runs[0], "train/loss")
    assert trained["train/loss"] == 1.5 and trained["train/step"] == 0 and "rollout/step" not in trained
    (rolled,) = rows_with(runs[0], "rollout/step")
    assert rolled["worker/w/tokens_per_s"] == 9.0 and "train/step" not in rolled
    assert [row["train/step"] for row in rows_with(runs[1], "train/loss")] == [1]


def test_a_failing_log_never_stops_training(offline_wandb: Path, caplog: pytest.LogCaptureFixture) -> None:
    tracked = tracking.TrackedRun.open(project="p", name="qs", group="qs", config={})
    tracked.close()
    tracked.log({"train/loss": 1.0}, step_key="train/step", step=0)  # the run is finished: wandb refuses
    tracked.log({"train/loss": 1.0}, step_key="train/step", step=1)
    assert len([r for r in caplog.records if "Weights & Biases logging failed" in r.getMessage()]) == 1


def finish(proc: subprocess.Popen[str], timeout: float) -> str:
    """Its output once it exits; killed (its workers follow it) when it runs past `timeout`."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running after {timeout:.0f} s:\n{proc.communicate()[0][-3000:]}") from None


@pytest.mark.slow  # ~35 s: python -m pytest --slow tests/test_tracking.py (slime's and macd's metrics are checked by the fast tests)
def test_quickstart_logs_train_rollout_and_worker_metrics(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("mlx_lm")
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    env = {**os.environ, **wandb_env(tmp_path)}
    out = tmp_path / "qs"
    cmd = [sys.executable, "-m", "slime_stoa.cli", "quickstart", "--out", str(out), "--no-warm-start", "--workers", "1",
           "--minutes", "30", "--max-versions", "1", "--batch-groups", "2", "--wandb", "--wandb-project", "qs-test"]
    quickstart = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    printed = finish(quickstart, timeout=300)
    assert quickstart.returncode == 0, printed
    # what a no-warm-start run prints: where the run is and how to look inside it
    bucket = f"file://{(out / 'bucket').resolve()}"
    assert f"new run 'quickstart' in bucket {bucket}" in printed
    assert "no warm start: RL starts from" in printed and "supervised warm start" not in printed
    assert not (out / "warm-start").exists()
    for command in ("weights status", "fleet", "run show"):
        assert f"stoa {command} --store {bucket} --run quickstart" in printed, printed
    wait_until(lambda: not wandb_services(quickstart.pid), timeout=30, interval=0.1, message="its wandb service to exit")
    (run,) = offline_runs(Path(env["WANDB_DIR"]))
    assert run.name == "quickstart" and run.group == "quickstart"
    assert run.run_id == (out / "wandb-run-id").read_text().strip()
    assert run.axes == dict(tracking.STEP_AXES)
    trained = rows_with(run, "train/step")
    assert len(trained) == 1 and all("train/loss" in r and "train/logprob_gap_mean" in r for r in trained)
    rolled = rows_with(run, "rollout/step")
    assert [r["rollout/step"] for r in rolled] == [r["train/step"] for r in trained] == [0]  # the version trained from
    for row in rolled:
        assert row["rollout/stoa_groups"] == 2  # --batch-groups: a never warm-started model's groups are mostly all-equal
        assert "rollout/stoa_version_lag_mean" in row and "rollout/stoa_scored_reward_mean" in row
        assert "worker/quickstart-0/tokens_per_s" in row and "worker/quickstart-0/groups_uploaded" in row
        assert row["rollout/stoa_fleet_running"] == 1
        assert row["rollout/stoa_logprob_gap"] < 0.1  # the first batch is all of v0: the gap is measured


# -- macd's own stream -------------------------------------------------------------------------------
def test_macd_run_logs_each_heartbeat_it_writes(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("mlx_lm")
    from tests.test_macd_run import RUN as MACD_RUN
    from tests.test_macd_run import seeded_worker, worker_id

    _, env = seeded_worker(tmp_path)
    env.update(wandb_env(tmp_path))
    cmd = [sys.executable, "-m", "macd", "run", "--max-cohorts", "2", "--seed", "1", "--wandb-project", "fleet"]
    worker = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = finish(worker, timeout=300)
    assert worker.returncode == 0, log
    wait_until(lambda: not wandb_services(worker.pid), timeout=30, interval=0.1, message="the worker's wandb service to exit")
    (run,) = offline_runs(Path(env["WANDB_DIR"]))
    assert run.group == MACD_RUN and run.job_type == "worker"
    assert run.axes == {"worker/step": None, "worker/*": "worker/step"}
    beats = rows_with(run, "worker/step")
    assert len(beats) >= 2 and [r["worker/step"] for r in beats] == list(range(len(beats)))
    assert all(not any(k.startswith(f"worker/{worker_id(env)}/") for k in r) for r in beats)  # the worker's own keys
    assert beats[0]["worker/running"] == 1  # "starting"
    assert beats[-1]["worker/running"] == 0 and beats[-1]["worker/groups_spooled"] == 0  # the final "stopped" heartbeat
    assert beats[-1]["worker/groups_uploaded"] >= 2 * 2 and beats[-1]["worker/version"] == 0



def test_a_rejoin_keeps_the_wandb_project(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from macd.cli import main
    from macd.config import load_config

    path, bucket = tmp_path / "macd.toml", tmp_path / "bucket"
    bucket.mkdir()
    join = ["join", f"file://{bucket}", "--run", RUN, "--config", str(path), "--data-dir", str(tmp_path / "data"),
            "--batch", "2", "--no-check"]
    assert main(join) == 0
    path.write_text(path.read_text() + 'wandb_project = "fleet"\n')  # the operator turns it on
    assert main(join) == 0
    assert load_config(path).wandb_project == "fleet"
    capsys.readouterr()
