"""Ctrl-C ends `stoa` with one line and exit status 130, never a traceback: during a command, and
during its start-up (the command modules' imports)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# `stoa` with an import hook that sends this process a real SIGINT the moment the module named in
# argv[1] starts to import: the Ctrl-C lands inside the import machinery, as a person's would.
INTERRUPT_AT_IMPORT = """
import os, signal, sys

class InterruptAt:
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, InterruptAt())
from slime_stoa.cli import main
sys.exit(main(sys.argv[2:]))
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STOA_"))}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def assert_interrupted(proc: subprocess.Popen[str] | subprocess.CompletedProcess[str], err: str) -> None:
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and err.strip() == "stoa: interrupted", err


def test_ctrl_c_while_a_command_module_imports(tmp_path: Path) -> None:
    argv = ["weights", "status", "--store", f"file://{tmp_path}", "--run", "r"]
    done = subprocess.run([sys.executable, "-c", INTERRUPT_AT_IMPORT, "slime_stoa.cli.weights_cmd", *argv],
                          capture_output=True, text=True, env=clean_env(), timeout=120)
    assert_interrupted(done, done.stderr)


def test_ctrl_c_while_publish_anchor_waits_on_the_bucket(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    # A bucket endpoint that takes the connection and never answers: stoa is then, observably,
    # waiting on the bucket when the SIGINT comes.
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(120)
        url = f"s3://bucket/runs?endpoint=http://127.0.0.1:{server.getsockname()[1]}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "slime_stoa.cli", "weights", "publish-anchor", str(model), "--store", url, "--run", "r"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=clean_env(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test"),
        )
        try:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(120)
                assert conn.recv(4096).startswith((b"GET ", b"HEAD ", b"PUT ")), "not an S3 request"
                proc.send_signal(signal.SIGINT)
                _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert_interrupted(proc, err)
