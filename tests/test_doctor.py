"""`macd doctor`: local checks and, once joined, the bucket's credentials and latency."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from slime_stoa.cli import main as stoa


def doctor(tmp_path: Path, config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MACD_CONFIG": str(config)}
    return subprocess.run([sys.executable, "-m", "macd", "doctor", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120)


def test_doctor_before_and_after_join(tmp_path: Path) -> None:
    config = tmp_path / "macd.toml"
    before = doctor(tmp_path, config)
    assert "memory" in before.stdout and "not joined yet" in before.stdout
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"
    assert stoa(["run", "create", "--store", url, "--run", "r", "--model", "m", "--task", "synthetic"]) == 0
    env = {**os.environ, "MACD_CONFIG": str(config)}
    join = subprocess.run([sys.executable, "-m", "macd", "join", url, "--run", "r", "--no-check",
                           "--data-dir", str(tmp_path / "data")], capture_output=True, text=True, env=env, timeout=120)
    assert join.returncode == 0, join.stdout + join.stderr
    after = doctor(tmp_path, config)
    assert "credentials ok" in after.stdout and "ms per request" in after.stdout
    (bucket / "runs" / "r" / "run.json").unlink()
    missing = doctor(tmp_path, config)
    assert missing.returncode == 1 and "stoa run create" in missing.stdout
