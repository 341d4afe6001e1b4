"""A model folder of a family stoa cannot run (GPT-2 here) is refused up front, in one line with
exit status 2, by every stoa command that takes one, and nothing reaches the bucket."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_stoa.cli import main as stoa
from slime_stoa.protocol.hf.architectures import unsupported_model


def model_folder(root: Path, model_type: str) -> Path:
    folder = root / f"{model_type}-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 64}))
    return folder


@pytest.fixture
def bucket(tmp_path: Path) -> Path:
    (tmp_path / "bucket").mkdir()
    return tmp_path / "bucket"


def refused_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert len(captured.err.splitlines()) == 1, captured.err
    return captured.err.strip()


def test_run_create_refuses_a_gpt2_folder(tmp_path: Path, bucket: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpt2 = model_folder(tmp_path, "gpt2")
    argv = ["run", "create", "--store", f"file://{bucket}", "--run", "r", "--task", "synthetic", "--model"]
    assert stoa([*argv, str(gpt2)]) == 2
    line = refused_line(capsys)
    assert line == f"error: {unsupported_model(gpt2)}" and "'gpt2' is not supported" in line
    assert not any(bucket.rglob("*"))  # no run.json written
    assert stoa([*argv, str(model_folder(tmp_path, "qwen2"))]) == 0  # a supported family's folder
    assert stoa([*argv[:5], "r2", *argv[6:], "Qwen/Qwen2.5-0.5B"]) == 0  # an HF id: a name, not checked here


def test_publish_anchor_refuses_a_gpt2_folder(tmp_path: Path, bucket: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpt2 = model_folder(tmp_path, "gpt2")
    assert stoa(["weights", "publish-anchor", str(gpt2), "--store", f"file://{bucket}", "--run", "r"]) == 2
    line = refused_line(capsys)
    assert line == f"error: {unsupported_model(gpt2)}" and line.startswith(f"error: {gpt2}: ")
    assert not any(bucket.rglob("*"))
