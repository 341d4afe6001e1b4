"""One `stoa quickstart` per run folder: a second one on the same --out is refused at start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slime_stoa.quickstart.config import QuickstartError
from slime_stoa.quickstart.lock import LOCK_FILE, holder_pid, run_lock
from tests.conftest import wait_until
from tests.test_quickstart_errors import assert_one_error_line, quickstart

HOLD = "import sys, time; from pathlib import Path; from slime_stoa.quickstart.lock import run_lock\n" \
       "with run_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)"


def test_a_held_lock_is_refused_and_a_dead_ones_taken_over(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert holder_pid(out / LOCK_FILE) == holder.pid
        with pytest.raises(QuickstartError, match=rf"\(pid {holder.pid}\) is running on --out {out}"), run_lock(out):
            pass
        holder.send_signal(signal.SIGKILL)  # no cleanup: the file stays, its pid is dead
        holder.wait()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert (out / LOCK_FILE).exists()
    with run_lock(out):
        assert holder_pid(out / LOCK_FILE) == os.getpid()


def test_a_second_quickstart_on_the_same_folder_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "qs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STOA_"))}
    env["HOME"] = str(tmp_path / "home")
    # The first stays in its warm start (no worker, no bucket write) until it is stopped.
    first = subprocess.Popen(
        [sys.executable, "-m", "slime_stoa.cli", "quickstart", "--out", str(out), "--warmup-steps", "1000000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        wait_until(lambda: holder_pid(out / LOCK_FILE) == first.pid or first.poll() is not None, timeout=120,
                   interval=0.1, message="the first quickstart to take the lock")
        assert first.poll() is None
        second = quickstart(tmp_path, "--warmup-steps", "10")
        assert second.returncode == 1
        line = assert_one_error_line(second, f"(pid {first.pid}) is running on --out {out}", f"kill -INT {first.pid}")
        assert "another `stoa quickstart`" in line and "new run" not in second.stdout
        assert first.poll() is None and holder_pid(out / LOCK_FILE) == first.pid  # the first is unharmed
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=60) == 130
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.stdout is not None
    text = first.stdout.read()
    assert "interrupted" in text and "Traceback" not in text, text
