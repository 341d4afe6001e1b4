"""`stoa preflight` for the operator: every command it prints runs as printed (a bucket URL with
`?`, `&` and a space comes back word for word, and `stoa` itself accepts the command), and an
`--hf-checkpoint` of a model family workers cannot run is a FIX line."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.cli import build_parser
from slime_stoa.cli import main as stoa
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.trainer.slime import preflight
from slime_stoa.trainer.slime.preflight import FIX, Finding, StoreFacts
from tests.test_preflight import patched_slime

HOSTILE_URL = "s3://bucket/pre fix?endpoint=http://127.0.0.1:9&region=auto"  # a `?` (a glob), a `&`, a space
RUN = "r"


def printed_commands(text: str, program: str = "stoa") -> list[list[str]]:
    """Every command in backquotes in `text` that starts with `program`, split as a shell would."""
    return [shlex.split(part) for part in text.split("`")[1::2] if part.startswith(program + " ")]


def stoa_args(argv: list[str]) -> argparse.Namespace:
    """`argv` as `stoa` parses it (SystemExit if stoa would refuse it)."""
    assert argv[0] == "stoa"
    return build_parser().parse_args(argv[1:])


def fixes(findings: list[Finding]) -> dict[str, str]:
    return {f.check: f.message for f in findings if f.status == FIX}


def manifest(*, signed: bool = False, task: str = "gsm8k") -> RunManifest:
    run_key = SigningKey.generate().public.to_text() if signed else None
    return RunManifest(run=RUN, model="m", task=task, run_key=run_key)


# -- the bucket's commands ----------------------------------------------------------------------------
def test_a_missing_run_manifest_prints_a_run_create_stoa_accepts() -> None:
    facts = StoreFacts(HOSTILE_URL, RUN, manifest_error=f"runs/{RUN}/run.json does not exist")
    (command,) = printed_commands(fixes(preflight.check_store(facts))["run-manifest"])
    args = stoa_args(command)
    assert command[:3] == ["stoa", "run", "create"]
    assert (args.store, args.run, args.model, args.task) == (HOSTILE_URL, RUN, "MODEL", "TASK")


@pytest.mark.parametrize(("task", "sources"), [("gsm8k", ["FILE.jsonl"]), ("synthetic", []),
                                               ("search", ["QA_FILE", "CORPUS_FILE"])])
def test_missing_task_data_prints_the_task_prepare_of_the_runs_task(task: str, sources: list[str]) -> None:
    m = manifest(task=task)
    facts = StoreFacts(HOSTILE_URL, RUN, manifest=m, task_key="tasks/x", pointer_version=3, anchor_version=0)
    (command,) = printed_commands(fixes(preflight.check_store(facts))["task-data"])
    args = stoa_args(command)
    assert command[:3] == ["stoa", "task", "prepare"]
    assert (args.task, [str(f) for f in args.files]) == (task, sources)
    assert (args.store, args.run, args.split) == (HOSTILE_URL, RUN, m.task_split)


@pytest.mark.parametrize("signed", [False, True])
def test_missing_weights_print_a_publish_anchor_stoa_accepts(signed: bool) -> None:
    facts = StoreFacts(HOSTILE_URL, RUN, manifest=manifest(signed=signed), task_present=True)
    (command,) = printed_commands(fixes(preflight.check_store(facts))["weights"])
    args = stoa_args(command)
    assert command[:3] == ["stoa", "weights", "publish-anchor"]
    assert (args.hf_dir, args.store, args.run) == (Path("HF_DIR"), HOSTILE_URL, RUN)
    assert args.key == (Path("RUN_KEY_FILE") if signed else None)  # publish-anchor refuses a signed run unsigned


def test_unreadable_weights_print_a_verify_stoa_accepts() -> None:
    facts = StoreFacts(HOSTILE_URL, RUN, manifest=manifest(), task_present=True, pointer_error="bad pointer")
    (command,) = printed_commands(fixes(preflight.check_store(facts))["weights"])
    args = stoa_args(command)
    assert command[:3] == ["stoa", "weights", "verify"]
    assert (args.store, args.run) == (HOSTILE_URL, RUN)


# -- the HF folder -------------------------------------------------------------------------------------
def hf_folder(root: Path, *, model_type: str, names: list[str]) -> Path:
    from slime_stoa.protocol.hf.safetensors_io import write_safetensors

    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 64}))
    write_safetensors(root / "model.safetensors", {n: np.zeros((2, 2), np.float32) for n in names})
    return root


def test_an_anchor_of_other_names_prints_the_commands_of_a_new_run(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "my model & co?", model_type="llama", names=["model.w", "lm_head.weight"])
    facts = StoreFacts(HOSTILE_URL, RUN, manifest=manifest(), task_present=True, pointer_version=1,
                       anchor_version=0, anchor_tensors=("model.w",))
    findings = preflight.check_hf_names(argparse.Namespace(hf_checkpoint=str(folder)), facts)
    create, publish = printed_commands(fixes(findings)["hf-names"])
    args = stoa_args(create)
    assert create[:3] == ["stoa", "run", "create"]
    assert (args.store, args.run, args.model, args.task) == (HOSTILE_URL, preflight.NEW_RUN, str(folder), "gsm8k")
    args = stoa_args(publish)
    assert publish[:3] == ["stoa", "weights", "publish-anchor"]
    assert (args.hf_dir, args.store, args.run) == (folder, HOSTILE_URL, preflight.NEW_RUN)


def test_a_model_family_workers_cannot_run_is_a_fix(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "gpt2", model_type="gpt2", names=["wte.weight"])
    facts = StoreFacts(HOSTILE_URL, RUN, manifest=manifest(), task_present=True, pointer_version=1,
                       anchor_version=0, anchor_tensors=("wte.weight",))
    findings = preflight.check_hf_names(argparse.Namespace(hf_checkpoint=str(folder)), facts)
    assert [f.check for f in findings] == ["model-family"]
    message = fixes(findings)["model-family"]
    assert message.startswith(f"--hf-checkpoint {folder}: model_type 'gpt2' is not supported (supported: llama")
    assert "point --hf-checkpoint at a model of a supported family" in message
    supported = hf_folder(tmp_path / "llama", model_type="llama", names=["wte.weight"])
    findings = preflight.check_hf_names(argparse.Namespace(hf_checkpoint=str(supported)), facts)
    assert [(f.check, f.status) for f in findings] == [("hf-names", "ok")]


def test_stoa_preflight_fails_on_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"
    assert stoa(["run", "create", "--store", url, "--run", RUN, "--model", "m", "--task", "synthetic"]) == 0
    folder = hf_folder(tmp_path / "gpt2", model_type="gpt2", names=["wte.weight"])
    capsys.readouterr()
    assert stoa(["preflight", "--store", url, "--run", RUN, "--", "--hf-checkpoint", str(folder)]) == 1
    lines = capsys.readouterr().out.splitlines()
    (line,) = [x for x in lines if " model-family " in x]
    assert line.startswith("FIX ") and "model_type 'gpt2' is not supported" in line, line


# -- the whole report, from the command line -------------------------------------------------------------
def test_every_command_stoa_preflight_prints_runs_as_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bucket folder and a slime checkout whose paths hold a space, `&` and `?`: the run with no
    task data and no weights, the patch not applied. Each command in the report parses back."""
    bucket = tmp_path / "my bucket & co?"
    bucket.mkdir()
    url = f"file://{bucket}"
    assert stoa(["run", "create", "--store", url, "--run", RUN, "--model", "m", "--task", "gsm8k"]) == 0
    slime = patched_slime(tmp_path / "the slime & co?", applied=False)
    capsys.readouterr()
    assert stoa(["preflight", "--store", url, "--run", RUN, "--slime-dir", str(slime)]) == 1
    out = capsys.readouterr().out
    commands = printed_commands(out)
    assert {tuple(c[:3]) for c in commands} == {("stoa", "task", "prepare"), ("stoa", "weights", "publish-anchor")}
    for command in commands:
        args = stoa_args(command)
        assert (args.store, args.run) == (url, RUN)
    (apply,) = printed_commands(out, "python")
    assert apply == ["python", "scripts/apply_slime_patches.py", str(slime)]
