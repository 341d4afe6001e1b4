"""`stoa quickstart` with bad input: one `error:` line saying what to fix, no traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_stoa.cli.quickstart_cmd import add_config_options, inspect_commands
from slime_stoa.quickstart.config import QuickstartConfig


def quickstart(tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STOA_"))}
    base["HOME"] = str(tmp_path / "home")  # no credentials file of the real user
    base.pop("XDG_CONFIG_HOME", None)
    cmd = [sys.executable, "-m", "slime_stoa.cli", "quickstart", "--out", str(tmp_path / "qs"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={**base, **(env or {})}, timeout=timeout)


def assert_one_error_line(done: subprocess.CompletedProcess[str], *expected: str) -> str:
    assert done.returncode != 0, done
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def test_zero_workers(tmp_path: Path) -> None:
    assert_one_error_line(quickstart(tmp_path, "--workers", "0"), "--workers must be 1 or more", "--workers 1")
    assert not (tmp_path / "qs").exists()


def test_missing_model_folder(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    assert_one_error_line(quickstart(tmp_path, "--model", str(missing)), f"--model {missing}: no such folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_error_line(quickstart(tmp_path, "--model", str(empty)), "no config.json")
    assert not (tmp_path / "qs").exists()


def model_folder(root: Path, *, config: bytes = b'{"model_type": "qwen2"}', weights: bytes | None = None) -> Path:
    """A model folder with a config.json, a tokenizer and, when given, one weight file."""
    folder = root / "model"
    folder.mkdir()
    (folder / "config.json").write_bytes(config)
    (folder / "tokenizer.json").write_text("{}")
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights)
    return folder


def good_weights() -> bytes:
    header = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    return len(header).to_bytes(8, "little") + header + b"\0" * 4


@pytest.mark.parametrize(
    "config, weights, expected",
    [
        (b'{"model_type": "qwen2",', good_weights(), "config.json is not valid JSON"),
        (b"[1, 2]", good_weights(), "config.json is not a JSON object"),
        (b'{"model_type": "qwen2"}', None, "no weight files in it"),
        (b'{"model_type": "qwen2"}', b"not a safetensors file", "model.safetensors is not a safetensors file"),
    ],
)
def test_broken_model_folder_is_one_error_line_before_any_write(
    tmp_path: Path, config: bytes, weights: bytes | None, expected: str
) -> None:
    folder = model_folder(tmp_path, config=config, weights=weights)
    done = quickstart(tmp_path, "--model", str(folder))
    assert_one_error_line(done, f"--model {folder}: {expected}")
    assert "new run" not in done.stdout and not (tmp_path / "qs").exists()  # nothing written, bucket included


def test_a_whole_model_folder_passes_the_check(tmp_path: Path) -> None:
    QuickstartConfig(model=model_folder(tmp_path, weights=good_weights())).check_model()


URL = "s3://bkt/p?endpoint=http://127.0.0.1:9"  # nothing listens on the discard port


def test_store_without_credentials(tmp_path: Path) -> None:
    line = assert_one_error_line(quickstart(tmp_path, "--store", URL), "no credentials", "AWS_ACCESS_KEY_ID")
    assert "--store" in line


def test_unreachable_store(tmp_path: Path) -> None:
    creds = {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "never-shown-secret"}
    done = quickstart(tmp_path, "--store", URL, env=creds)
    line = assert_one_error_line(done, "could not reach http://127.0.0.1:9", "check the endpoint URL")
    assert "never-shown-secret" not in done.stdout + done.stderr
    assert "model" not in done.stdout  # it failed before building anything
    assert line


def test_bad_store_url(tmp_path: Path) -> None:
    assert_one_error_line(quickstart(tmp_path, "--store", "s3://b/p"), "not a valid bucket name")


def test_options_include_the_no_warm_start_flag() -> None:
    parser = argparse.ArgumentParser()
    add_config_options(parser)
    assert parser.parse_args([]).no_warm_start is False
    assert parser.parse_args(["--no-warm-start"]).no_warm_start is True
    assert parser.parse_args(["--workers", "3"]).workers == 3


def test_inspect_commands_are_quoted() -> None:
    cfg = QuickstartConfig(store=URL, run="demo")
    assert inspect_commands(cfg) == [
        f"stoa weights status --store '{URL}' --run demo",
        f"stoa fleet --store '{URL}' --run demo",
        f"stoa run show --store '{URL}' --run demo",
    ]


# A no-warm-start run saying where it is and how to inspect it is checked by
# tests/test_tracking.py::test_quickstart_logs_train_rollout_and_worker_metrics (the same run shape).
