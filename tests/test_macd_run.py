"""`macd join` + `macd run` as real processes: kill -9 mid-run, restart, nothing lost or doubled."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import open_store
from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model
from tests.conftest import wait_until

RUN = "macd-run"


def macd(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "macd", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


async def keys(url: str) -> list[str]:
    async with open_store(url) as store:
        return [i.key async for i in store.list(RunLayout(RUN).rollouts_prefix())]


def test_kill_and_restart_loses_and_doubles_nothing(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'bucket'}"
    (tmp_path / "bucket").mkdir()
    model = tiny_synthetic_model(tmp_path / "model")

    async def seed() -> None:
        async with open_store(url) as store:
            manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6)
            await seed_run(store, manifest, model, task_count=40)

    asyncio.run(seed())
    env = {**os.environ, "MACD_CONFIG": str(tmp_path / "macd.toml"), "MLX_DISABLE_COMPILE": "1"}
    join = macd("join", url, "--run", RUN, "--name", "ci-mac", "--data-dir", str(tmp_path / "data"), "--batch", "2", env=env)
    out, _ = join.communicate(timeout=120)
    assert join.returncode == 0, out
    assert "synthetic" in out

    worker = macd("run", "--seed", "3", env=env)
    wait_until(lambda: len(asyncio.run(keys(url))) >= 4 or worker.poll() is not None, timeout=180, interval=0.2,
               message="four records in the bucket")
    assert worker.poll() is None, "the worker exited before the kill"
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=30)
    before = asyncio.run(keys(url))
    assert len(before) >= 4

    restarted = macd("run", "--max-cohorts", "2", env=env)
    out, _ = restarted.communicate(timeout=300)
    assert restarted.returncode == 0, out
    after = asyncio.run(keys(url))
    layout = RunLayout(RUN)
    parsed = [layout.parse_rollout(k) for k in after]
    seqs = sorted(p.seq for p in parsed)
    assert len(set(seqs)) == len(seqs)  # never twice
    # A kill between reserving a sequence number and writing the group leaves at most one gap
    # (that group was never finished); every finished group is in the bucket.
    assert max(seqs) + 1 - len(seqs) <= 1
    assert len(after) >= len(before) + 2 * 2
    assert not list((tmp_path / "data" / "spool" / RUN).glob("*.rec"))  # spool drained


def test_sigterm_stops_cleanly(tmp_path: Path) -> None:
    url, env = seeded_worker(tmp_path)
    worker = macd("run", env=env)
    wait_until(lambda: asyncio.run(keys(url)) or worker.poll() is not None, timeout=180, interval=0.2,
               message="a first record in the bucket")
    worker.send_signal(signal.SIGTERM)
    try:
        out, _ = worker.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        worker.kill()
        out, _ = worker.communicate()
        raise AssertionError(f"macd run did not stop within 90 s of SIGTERM:\n{out}") from None
    assert worker.returncode == 0, out
    assert "cohort 1:" in out


def running(pid: int) -> bool:
    """Whether process `pid` runs (an exited, not yet reaped one does not)."""
    stat = Path(f"/proc/{pid}/stat")
    if Path("/proc/self").exists():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


PARENT = """
import os, subprocess, sys
log = open(sys.argv[1], "ab")
child = subprocess.Popen([sys.executable, "-m", "macd", "run", "--parent-pid", str(os.getpid())],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
print(child.pid, flush=True)
child.wait()
"""


def seeded_worker(tmp_path: Path) -> tuple[str, dict[str, str]]:
    """A seeded run in a local bucket and a joined worker config: (bucket url, env for macd)."""
    url = f"file://{tmp_path / 'bucket'}"
    (tmp_path / "bucket").mkdir()
    model = tiny_synthetic_model(tmp_path / "model")

    async def seed() -> None:
        async with open_store(url) as store:
            await seed_run(store, RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=6), model, task_count=40)

    asyncio.run(seed())
    env = {**os.environ, "MACD_CONFIG": str(tmp_path / "macd.toml"), "MLX_DISABLE_COMPILE": "1"}
    joined = macd("join", url, "--run", RUN, "--data-dir", str(tmp_path / "data"), "--batch", "2", env=env)
    out, _ = joined.communicate(timeout=120)
    assert joined.returncode == 0, out
    return url, env


def test_a_worker_stops_by_itself_when_its_parent_is_sigkilled(tmp_path: Path) -> None:
    """`macd run --parent-pid`: the parent (as the quickstart) dies by SIGKILL mid-run; the
    worker notices within a second, stops cleanly (final heartbeat "stopped") and exits."""
    from slime_stoa.protocol.heartbeat import Heartbeat

    url, env = seeded_worker(tmp_path)
    log = tmp_path / "worker.log"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(log)], env=env, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        wait_until(lambda: asyncio.run(keys(url)) or not running(child), timeout=180, interval=0.2,
                   message="a first record in the bucket")
        assert running(child), log.read_text()
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        killed = time.monotonic()
        wait_until(lambda: not running(child), timeout=20, interval=0.1,
                   message=lambda: f"the orphaned worker to exit:\n{log.read_text()[-3000:]}")
        print(f"the worker exited {time.monotonic() - killed:.1f} s after its parent was killed")
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)
    text = log.read_text()
    assert f"parent process {parent.pid} is gone: stopping" in text, text

    async def beat() -> Heartbeat:
        async with open_store(url) as store:
            return Heartbeat.from_bytes(await store.get_bytes(RunLayout(RUN).heartbeat(worker_id(env))))

    final = asyncio.run(beat())
    assert final.status == "stopped" and final.groups_spooled == 0, final


def worker_id(env: dict[str, str]) -> str:
    from macd.config import load_config

    return load_config(Path(env["MACD_CONFIG"])).worker_id


def test_a_spool_held_by_a_live_macd_is_a_one_line_error_or_a_wait(tmp_path: Path) -> None:
    """A second `macd run` on a spool in use exits 1 at once with one line naming the holder's
    pid and what to do; with `--lock-wait` it waits for the holder to let go, then runs."""
    from macd.config import load_config
    from macd.spool import Spool

    _, env = seeded_worker(tmp_path)
    config = load_config(Path(env["MACD_CONFIG"]))
    holder = Spool(config.data_dir / "spool" / RUN, worker_id=config.worker_id, run=RUN, max_bytes=1 << 20, max_items=10)
    try:
        refused = macd("run", env=env)
        out, _ = refused.communicate(timeout=120)
        assert refused.returncode == 1, out
        errors = [line for line in out.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "Traceback" not in out, out
        pid = os.getpid()
        assert f"in use by macd pid {pid}, which is still running" in errors[0]
        assert "`macd stop`" in errors[0] and f"`kill {pid}`" in errors[0]

        patient = macd("run", "--lock-wait", "120", "--max-cohorts", "1", env=env)
        assert patient.stdout is not None
        seen: list[str] = []

        def waiting() -> bool:  # reads the worker's log line by line
            seen.append(patient.stdout.readline())
            return "waiting up to 120 s for it to stop" in seen[-1] or not seen[-1]

        wait_until(waiting, timeout=120, interval=0, message=lambda: "".join(seen))
        assert patient.poll() is None, "".join(seen)
    finally:
        holder.close()
    out, _ = patient.communicate(timeout=300)
    assert patient.returncode == 0, "".join(seen) + out
    assert "cohort 1:" in out
