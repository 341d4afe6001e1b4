"""`stoa quickstart`, short: real workers, real PULSE sync, a local bucket, one SIGKILL."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from slime_stoa.cli import main


def test_short_quickstart_learns_and_survives_a_killed_worker(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    summary_path = tmp_path / "summary.json"
    args = ["quickstart", "--out", str(out), "--minutes", "2.5", "--max-versions", "45",
            "--kill-worker-at", "4", "--json", str(summary_path)]
    assert main(args) == 0
    s = json.loads(summary_path.read_text())
    # Learning: the warm start teaches the format only (a random shown digit scores 0.25), and
    # the RL part takes the reward of every generated group from there to >= 0.6 (measured
    # ~0.9 after 40 versions).
    assert s["reward_first"] < 0.4 and s["reward_last"] >= 0.6, s
    assert s["versions"] >= 10
    # Every (worker, version) seen in the heartbeats held the published digest.
    assert s["digests_checked"] >= 4 and s["digest_mismatches"] == 0
    # The killed worker lost nothing: no sequence gaps, empty spools.
    assert s["groups_lost"] == 0 and s["groups_used"] >= 10 * 8
    # Worker (MLX) and learner (torch) logprobs of the same tokens at the same version:
    # both act with the same bf16 weights; the gap is compute numerics, far below bf16's ~4e-3
    # relative step (the test allows 2e-2).
    assert math.isfinite(s["mean_abs_logprob_gap"]) and s["mean_abs_logprob_gap"] < 2e-2
    assert s["patch_bytes_mean"] < s["full_bytes"]
    assert (out / "learning_curve.png").stat().st_size > 10_000
    # Rerunning the same command resumes the run from the bucket.
    assert main(["quickstart", "--out", str(out), "--minutes", "0.3", "--max-versions", "2", "--json", str(summary_path)]) == 0
    again = json.loads(summary_path.read_text())
    assert again["versions"] >= 1 and again["digest_mismatches"] == 0 and again["groups_lost"] == 0


def test_ctrl_c_stops_workers_and_learner_cleanly(tmp_path: Path) -> None:
    """SIGINT (Ctrl-C) mid-run: exit 130, both workers stop cleanly (their last heartbeat says
    so) and no `macd run` process is left; the run stays resumable."""
    import asyncio
    import queue
    import re
    import signal
    import subprocess
    import sys
    import threading
    import time

    from slime_stoa.protocol.store import open_store
    from slime_stoa.quickstart.run import read_worker_states

    out = tmp_path / "qs"
    cmd = [sys.executable, "-m", "slime_stoa.cli", "quickstart", "--out", str(out), "--minutes", "5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    seen, deadline = [], time.time() + 300
    try:
        while time.time() < deadline and not any(re.match(r"\s*v3\s", line) for line in seen):
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                assert proc.poll() is None, "".join(seen)
        assert any(re.match(r"\s*v3\s", line) for line in seen), "".join(seen)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=30)  # it ends at the end of the output
    while not lines.empty():
        seen.append(lines.get())
    assert "interrupted" in "".join(seen)

    async def beats() -> list:
        async with open_store(f"file://{out / 'bucket'}") as store:
            return await read_worker_states(store, "quickstart", 2)

    assert [b.status for b in asyncio.run(beats())] == ["stopped", "stopped"]
    if Path("/proc").is_dir():
        workers = str(out / "workers")
        left = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if workers in cmdline.read_bytes().decode(errors="replace"):
                    left.append(cmdline.parent.name)
            except OSError:
                continue
        assert not left, f"macd processes left running: {left}"


def test_quickstart_over_a_real_s3_server(
    tmp_path: Path, s3_server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--store s3://...`: learner, publisher and `macd run` workers all meet in an S3 bucket."""
    creds = s3_server.credentials()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", creds.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", creds.secret_access_key)
    url = f"s3://{s3_bucket}/quickstart-{tmp_path.name}?endpoint={s3_server.endpoint_url}"
    summary_path = tmp_path / "summary.json"
    args = ["quickstart", "--out", str(tmp_path / "qs"), "--store", url, "--minutes", "2",
            "--max-versions", "4", "--json", str(summary_path)]
    assert main(args) == 0
    s = json.loads(summary_path.read_text())
    assert s["versions"] == 4 and s["groups_used"] == 4 * 16
    assert s["digests_checked"] >= 2 and s["digest_mismatches"] == 0 and s["groups_lost"] == 0
    assert not (tmp_path / "qs" / "bucket").exists()  # nothing went to the local default
