"""`stoa preflight` and the trainer launch script.

A consistent setup (a real local bucket with a run manifest, task data and an anchor published
by `Publisher` on a tiny random state; slime flags; the custom-config YAML; a stand-in slime
checkout with stoa's patch applied) passes every check; each inconsistency fails its check with
a message that says what to change.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.cli import preflight_cmd
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import open_store
from slime_stoa.tasks.objects import put_task_objects, task_objects
from slime_stoa.trainer.slime import preflight
from slime_stoa.trainer.slime.preflight import (
    FIX,
    OK,
    WARN,
    Finding,
    inspect_store,
    run_checks,
)

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "run_qwen25_gsm8k.sh"
RUN = "demo"
ROLLOUT_FN = "slime_stoa.trainer.slime.rollout.generate_rollout"  # the module path; the launch script uses STOA_FN
STOA_FN = preflight.STOA_ROLLOUT_FUNCTION
SLIME_DEFAULT = preflight.SLIME_DEFAULT_ROLLOUT_FUNCTION


# -- fixtures -------------------------------------------------------------------------------------
async def seed_bucket(url: str, manifest: RunManifest | None, *, extras: Path | None, anchor: bool, task: bool) -> None:
    """Write a run manifest, synthetic task data and an anchor (tiny random bf16 state)."""
    async with open_store(url) as store:
        if manifest is not None:
            await store.put_if_absent(manifest.layout.run_manifest, manifest.to_bytes())
            if task:
                objects = task_objects("synthetic", [], split=manifest.task_split, count=8, seed=0, limit=None)
                await put_task_objects(store, manifest.run, manifest.task, objects)
        if anchor:
            rng = np.random.default_rng(0)
            state = {"model.w": rng.integers(0, 1 << 16, size=(8, 8), dtype=np.uint16)}
            await Publisher(store, manifest.run if manifest else RUN, PublisherConfig(extras_dir=extras)).publish(state)


def make_bucket(
    root: Path, manifest: RunManifest | None, *, anchor: bool = True, task: bool = True, tokenizer: bool = True
) -> str:
    bucket = root / "bucket"
    bucket.mkdir(parents=True)
    extras = root / "hf"
    extras.mkdir()
    (extras / "config.json").write_text('{"vocab_size": 64}')
    if tokenizer:
        (extras / "tokenizer.json").write_text("{}")
    url = f"file://{bucket}"
    asyncio.run(seed_bucket(url, manifest, extras=extras, anchor=anchor, task=task))
    return url


def manifest_for(run: str = RUN, **kw) -> RunManifest:
    fields = dict(run=run, model="tiny", task="synthetic", temperature=0.7, group_size=4, max_tokens=256)
    return RunManifest(**{**fields, **kw})


def write_yaml(path: Path, settings: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(settings))
    return path


def good_settings(url: str) -> dict:
    return {
        "stoa_publish": True,
        "stoa_bucket": url,
        "stoa_run": RUN,
        "stoa_staleness_limit": 2,
        "dppo_delta_low": 0.2,
        "dppo_delta_high": 0.2,
        "dppo_reduction": "token_mean",
    }


def good_flags(config: Path, save: Path) -> list[str]:
    return [
        "--rollout-num-gpus", "0",
        "--rollout-function-path", ROLLOUT_FN,
        "--data-source-path", "slime_stoa.StoaDataSource",
        "--rollout-batch-size", "8",
        "--n-samples-per-prompt", "4",
        "--global-batch-size", "32",
        "--rollout-temperature", "0.7",
        "--rollout-top-p", "1.0",
        "--rollout-max-response-len", "256",
        "--num-rollout", "10",
        "--loss-type", "custom_loss",
        "--custom-loss-function-path", "slime_stoa.dppo_loss",
        "--use-rollout-logprobs",
        "--calculate-per-token-loss",
        "--advantage-estimator", "grpo",
        "--custom-config-path", str(config),
        "--save", str(save),
    ]  # fmt: skip


def patched_slime(root: Path, *, applied: bool = True) -> Path:
    """A stand-in slime checkout: the patched file holds the old side of stoa's patch."""
    from slime_stoa.trainer.slime import patching as aps

    (patch,) = aps.load_patches(sorted(aps.PATCH_DIR.glob(aps.PATCH_GLOB)))
    for fp in patch.files:
        target = root / fp.path
        target.parent.mkdir(parents=True, exist_ok=True)
        body = [line for hunk in fp.hunks for line in ["# slime code", *hunk.old]]
        target.write_text("\n".join(body) + "\n")
    if applied:
        aps.apply_patch(root, patch)
    return root


class Setup:
    """A consistent setup under `root`; `findings` runs every check with changed flags or YAML."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = make_bucket(root, manifest_for())
        self.config = write_yaml(root / "stoa.yaml", good_settings(self.url))
        self.slime = patched_slime(root / "slime")
        self.flags = good_flags(self.config, root / "ckpt")
        self._facts = asyncio.run(inspect_store(self.url, RUN))

    def findings(
        self, extra: tuple[str, ...] | list[str] = (), *, drop: tuple[str, ...] = (), settings: dict | None = None
    ) -> list[Finding]:
        flags = list(self.flags)
        for flag in drop:  # remove a flag and its value
            i = flags.index(flag)
            del flags[i : i + (1 if i + 1 == len(flags) or flags[i + 1].startswith("--") else 2)]
        if settings is not None:
            write_yaml(self.config, settings)
        return run_checks(self.url, RUN, flags + list(extra), slime_dir=self.slime, facts=self._facts)


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


def by_check(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in findings}


def assert_fix(findings: list[Finding], check: str, *needles: str) -> None:
    found = by_check(findings)
    assert check in found, f"no {check} finding in {[f.check for f in findings]}"
    f = found[check]
    assert f.status == FIX, f
    for needle in needles:
        assert needle in f.message, f.message


def stoa(argv: list[str]) -> int:
    """Parse and run like `stoa` does: a top-level parser with the sub-command, parse_args."""
    top = argparse.ArgumentParser(prog="stoa")
    preflight_cmd.add_parser(top.add_subparsers(required=True))
    args = top.parse_args(argv)
    return args.handler(args)


# -- the consistent setup ---------------------------------------------------------------------------
def test_a_consistent_setup_passes_every_check(setup: Setup) -> None:
    findings = setup.findings()
    assert all(f.status == OK for f in findings), preflight.format_findings(findings)
    checks = {f.check for f in findings}
    for expected in (
        "bucket", "run-manifest", "task-data", "weights", "tokenizer", "rollout-num-gpus", "rollout-temperature",
        "rollout-top-p", "n-samples-per-prompt", "rollout-max-response-len", "global-batch-size",
        "rollout-function-path", "loss-type", "custom-loss-function-path", "stoa-bucket", "stoa-run",
        "stoa-publish", "rollout-settings", "publisher-settings", "dppo-settings", "slime-patch", "data-source-path",
        "slime-flags",
    ):  # fmt: skip
        assert expected in checks
    assert "0 to fix; ready to launch" in preflight.format_findings(findings)


def test_cli_exit_codes_and_unknown_slime_flags(setup: Setup, capsys: pytest.CaptureFixture) -> None:
    unknown = ["--lr", "1e-6", "--adam-eps", "-1e-8", "--tensor-model-parallel-size", "2", "--future-flag"]
    base = ["preflight", "--store", setup.url, "--run", RUN, "--slime-dir", str(setup.slime)]
    assert stoa(base + setup.flags + unknown) == 0
    assert "ready to launch" in capsys.readouterr().out
    assert stoa(base + ["--"] + unknown + setup.flags) == 0  # after `--`, in any order
    capsys.readouterr()
    assert stoa(base + setup.flags + ["--rollout-num-gpus", "2"]) == 1
    assert "FIX" in capsys.readouterr().out


def test_stoa_runs_it_once_registered(setup: Setup, capsys: pytest.CaptureFixture) -> None:
    from slime_stoa import cli

    if preflight_cmd not in cli.GROUPS:
        pytest.skip("preflight_cmd is not registered in slime_stoa.cli.GROUPS yet")
    argv = ["preflight", "--store", setup.url, "--run", RUN, "--slime-dir", str(setup.slime), *setup.flags, "--lr", "1"]
    assert cli.main(argv) == 0
    assert "ready to launch" in capsys.readouterr().out


def test_slime_args_file(setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args_file = tmp_path / "slime.args"
    args_file.write_text("# slime flags\n" + " \\\n".join(shlex.quote(t) for t in setup.flags) + "\n--lr 1e-6\n")
    base = ["preflight", "--store", setup.url, "--run", RUN, "--slime-dir", str(setup.slime)]
    assert stoa(base + ["--slime-args-file", str(args_file)]) == 0
    # the command line comes after the file: its flags win
    assert stoa(base + ["--slime-args-file", str(args_file), "--n-samples-per-prompt", "8"]) == 1
    assert "set --n-samples-per-prompt 4" in capsys.readouterr().out


# -- each inconsistent slime flag fails its check ----------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "check", "needle"),
    [
        (["--rollout-num-gpus", "1"], "rollout-num-gpus", "add --rollout-num-gpus 0"),
        (["--colocate"], "colocate", "remove it"),
        (["--debug-train-only"], "debug-train-only", "remove it"),
        (["--rollout-temperature", "1.0"], "rollout-temperature", "set --rollout-temperature 0.7"),
        (["--rollout-top-p", "0.9"], "rollout-top-p", "set --rollout-top-p 1.0"),
        (["--n-samples-per-prompt", "8"], "n-samples-per-prompt", "set --n-samples-per-prompt 4"),
        (["--rollout-max-response-len", "128"], "rollout-max-response-len", "set --rollout-max-response-len 256"),
        (["--rollout-function-path", "slime_stoa.nope.fn"], "rollout-function-path", "import module 'slime_stoa.nope'"),
        (["--rollout-function-path", "slime_stoa.trainer.slime.rollout.nope"], "rollout-function-path", "has no attribute 'nope'"),
        (["--rollout-function-path", SLIME_DEFAULT], "rollout-function-path", f"add --rollout-function-path {STOA_FN}"),
        (["--custom-loss-function-path", "slime_stoa.trainer.slime.loss.nope"], "custom-loss-function-path", "no attribute 'nope'"),
        (["--loss-type", "policy_loss"], "loss-type", "set --loss-type custom_loss"),
        (["--advantage-estimator", "ppo"], "advantage-estimator", "use --advantage-estimator grpo"),
        (["--global-batch-size", "24"], "global-batch-size", "does not divide the 32 samples"),
        (["--global-batch-size", "64"], "global-batch-size", "set --global-batch-size 32"),
        (["--num-steps-per-rollout", "2"], "global-batch-size", "contradicts --num-steps-per-rollout 2"),
        (["--num-steps-per-rollout", "3"], "global-batch-size", "pick a divisor of 32"),
        (["--eval-interval", "5"], "eval-interval", "--eval-prompt-data NAME SPLIT"),
        (["--eval-interval", "5", "--eval-prompt-data", "gsm8k-test"], "eval-interval", "--eval-prompt-data NAME SPLIT"),
        (["--eval-interval", "5", "--eval-prompt-data", "g", "test", "--eval-temperature", "0"], "eval-interval",
         "temperature 0"),
        (["--eval-interval", "5", "--eval-prompt-data", "g", "test", "--eval-top-p", "0.9"], "eval-interval", "top_p"),
        (["--get-mismatch-metrics"], "get-mismatch-metrics", "remove it"),
        (["--use-kl-loss"], "dppo-settings", "--use-kl-loss is not supported"),
    ],
)  # fmt: skip
def test_an_inconsistent_flag_fails_with_what_to_change(
    setup: Setup, extra: list[str], check: str, needle: str
) -> None:
    findings = setup.findings(extra)
    assert_fix(findings, check, needle)
    assert preflight.failed(findings)


def test_evaluation_with_prompt_data_splits_passes(setup: Setup) -> None:
    findings = setup.findings(["--eval-interval", "5", "--eval-prompt-data", "gsm8k-test", "test"])
    assert by_check(findings)["eval-interval"].message == (
        "eval every 5 rollouts on gsm8k-test (split test, 1 per prompt, temperature 0.7, max 256 tokens), "
        "answered by the fleet"
    )


def test_evaluation_reads_the_eval_config_per_dataset(setup: Setup) -> None:
    """slime's --eval-config: each dataset's own settings, then eval.defaults, then the flags."""
    config = write_yaml(setup.root / "eval.yaml", {"eval": {
        "defaults": {"temperature": 0.6},
        "datasets": [
            {"name": "a", "path": "test", "n_samples_per_eval_prompt": 4, "max_response_len": 64},
            {"name": "b", "path": "dev", "temperature": 1.0},
        ],
    }})
    findings = setup.findings(["--eval-interval", "2", "--eval-config", str(config), "--eval-max-response-len", "99"])
    message = by_check(findings)["eval-interval"].message
    assert "a (split test, 4 per prompt, temperature 0.6, max 64 tokens)" in message
    assert "b (split dev, 1 per prompt, temperature 1, max 99 tokens)" in message
    write_yaml(config, {"eval": {"datasets": [{"name": "a", "path": "test", "temperature": 0}]}})
    assert_fix(setup.findings(["--eval-interval", "2", "--eval-config", str(config)]), "eval-interval", "temperature 0")


def test_missing_flags(setup: Setup) -> None:
    assert_fix(setup.findings(drop=("--rollout-num-gpus",)), "rollout-num-gpus", "unset")
    assert_fix(setup.findings(drop=("--global-batch-size",)), "global-batch-size", "add --global-batch-size 32")
    assert_fix(setup.findings(drop=("--rollout-max-response-len",)), "rollout-max-response-len", "unset")
    assert_fix(setup.findings(drop=("--rollout-batch-size",)), "rollout-batch-size", "set it")
    assert_fix(setup.findings(drop=("--num-rollout",)), "num-rollout", "--num-rollout 500")
    assert_fix(
        setup.findings(drop=("--custom-loss-function-path",)), "custom-loss-function-path", "slime_stoa.dppo_loss"
    )
    assert_fix(setup.findings(drop=("--custom-config-path",)), "custom-config", "--custom-config-path FILE")
    ok_flags = setup.findings(drop=("--global-batch-size",), extra=["--num-steps-per-rollout", "4"])
    assert by_check(ok_flags)["global-batch-size"].message == "32 samples per rollout = 4 optimizer step(s) of 8"


def test_warnings_do_not_fail(setup: Setup) -> None:
    findings = setup.findings(
        ["--prompt-data", "x.jsonl", "--disable-rollout-global-dataset"], drop=("--use-rollout-logprobs", "--save")
    )
    statuses = {f.check: f.status for f in findings}
    for check in ("use-rollout-logprobs", "prompt-data", "rollout-global-dataset", "save"):
        assert statuses[check] == WARN
    assert not preflight.failed(findings)


def test_a_bad_flag_value_is_a_finding(setup: Setup) -> None:
    assert_fix(setup.findings(["--rollout-batch-size", "many"]), "slime-flags", "--rollout-batch-size")


# -- the custom-config YAML --------------------------------------------------------------------------
def test_yaml_must_name_this_bucket_and_run_with_publishing_on(setup: Setup) -> None:
    good = good_settings(setup.url)
    assert_fix(
        setup.findings(settings={**good, "stoa_bucket": "file:///elsewhere"}),
        "stoa-bucket",
        f"stoa_bucket: {setup.url}",
    )
    assert_fix(setup.findings(settings={**good, "stoa_run": "other"}), "stoa-run", f"stoa_run: {RUN}")
    no_publish = {k: v for k, v in good.items() if k != "stoa_publish"}
    assert_fix(setup.findings(settings=no_publish), "stoa-publish", "stoa_publish: true")
    assert_fix(setup.findings(settings={**good, "stoa_publish": "yes"}), "stoa-publish", "a YAML boolean")
    assert_fix(
        setup.findings(settings={**good, "stoa_stalenes_limit": 3}),
        "custom-config-keys",
        "stoa_stalenes_limit (did you mean stoa_staleness_limit?)",
    )
    assert_fix(setup.findings(settings={**good, "stoa_staleness_limit": -1}), "rollout-settings", "staleness_limit")
    assert_fix(setup.findings(settings={**good, "stoa_anchor_every": 0}), "publisher-settings", "anchor_every")
    assert_fix(setup.findings(settings={**good, "dppo_delta_low": -1}), "dppo-settings", "delta_low")
    assert_fix(
        setup.findings(settings={**good, "dppo_reduction": "seq_mean"}), "dppo-settings", "--calculate-per-token-loss"
    )


def test_missing_stoa_publish_and_the_liveness_settings(setup: Setup) -> None:
    good = good_settings(setup.url)
    no_publish = {k: v for k, v in good.items() if k != "stoa_publish"}
    findings = setup.findings(settings=no_publish)
    assert_fix(findings, "stoa-publish", "has no stoa_publish", "stoa_publish: true", "pointer does not move")
    assert "check-publishing" not in by_check(findings)  # on by default: nothing to say
    off = setup.findings(settings={**good, "stoa_check_publishing": False, "stoa_publish_grace_s": 30})
    assert by_check(off)["check-publishing"].status == WARN and "train_async.py" in by_check(off)["check-publishing"].message
    assert not preflight.failed(off)
    assert_fix(setup.findings(settings={**good, "stoa_publish_grace_s": -1}), "rollout-settings", "stoa_publish_grace_s")
    assert_fix(setup.findings(settings={**good, "stoa_check_publishing": "maybe"}), "rollout-settings", "stoa_check_publishing")


def test_the_data_source_check(setup: Setup) -> None:
    assert by_check(setup.findings())["data-source-path"].status == OK
    default = by_check(setup.findings(drop=("--data-source-path",)))["data-source-path"]
    assert default.status == WARN and "--data-source-path slime_stoa.StoaDataSource" in default.message
    long_name = ["--data-source-path", "slime_stoa.trainer.slime.data_source.StoaDataSource"]
    assert by_check(setup.findings(long_name))["data-source-path"].status == OK
    assert_fix(setup.findings(["--data-source-path", "no.such.Source"]), "data-source-path", "does not import")
    other = by_check(setup.findings(["--data-source-path", "argparse.Namespace"]))["data-source-path"]
    assert other.status == WARN and "is not stoa's" in other.message


def test_yaml_keys_override_flags_as_in_slime(setup: Setup) -> None:
    good = good_settings(setup.url)
    findings = setup.findings(settings={**good, "rollout_temperature": 1.0})
    assert_fix(findings, "rollout-temperature", "the custom-config key rollout_temperature", "0.7")
    setup.config.write_text("stoa_publish: [unclosed\n")
    assert_fix(setup.findings(), "custom-config", "not valid YAML")


def test_store_urls_compare_once_parsed() -> None:
    assert preflight.same_store("file:///data/bucket", "file:///data/bucket")
    assert preflight.same_store("file:///data/bucket/", "file:///data/bucket")
    assert preflight.same_store("s3://bkt/p/?endpoint=http://h:1", "s3://bkt/p?endpoint=http://h:1")
    assert not preflight.same_store("s3://bkt/p?endpoint=http://h:1", "s3://bkt/q?endpoint=http://h:1")
    assert not preflight.same_store(None, "file:///data/bucket")


# -- the bucket ------------------------------------------------------------------------------------
def test_an_unreachable_bucket(tmp_path: Path) -> None:
    facts = asyncio.run(inspect_store(f"file://{tmp_path}/missing", RUN))
    findings = preflight.check_store(facts)
    assert [f.check for f in findings] == ["bucket"]
    assert_fix(findings, "bucket", f"cannot read file://{tmp_path}/missing")


def test_a_missing_run_manifest(tmp_path: Path) -> None:
    url = make_bucket(tmp_path, None, anchor=False)
    findings = preflight.check_store(asyncio.run(inspect_store(url, RUN)))
    assert by_check(findings)["bucket"].status == OK
    assert_fix(findings, "run-manifest", "stoa run create", f"--run {RUN}")


def test_missing_weights_say_to_publish_an_anchor(tmp_path: Path) -> None:
    url = make_bucket(tmp_path, manifest_for(), anchor=False)
    findings = preflight.check_store(asyncio.run(inspect_store(url, RUN)))
    assert_fix(findings, "weights", f"stoa weights publish-anchor HF_DIR --store {url} --run {RUN}")
    assert by_check(findings)["task-data"].status == OK


def test_missing_task_data_and_tokenizer(tmp_path: Path) -> None:
    url = make_bucket(tmp_path, manifest_for(), task=False, tokenizer=False)
    facts = asyncio.run(inspect_store(url, RUN))
    assert_fix(preflight.check_store(facts), "task-data", "stoa task prepare synthetic")
    args = argparse.Namespace()
    tokenizer = preflight.check_tokenizer(args, facts)
    assert tokenizer is not None and tokenizer.status == FIX and "stoa_tokenizer_dir" in tokenizer.message
    args.stoa_tokenizer_dir = str(tmp_path / "hf")
    assert preflight.check_tokenizer(args, facts).status == FIX  # that folder has no tokenizer.json either
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    assert preflight.check_tokenizer(args, facts).status == OK


# -- the slime checkout -----------------------------------------------------------------------------
def test_the_patch_check(tmp_path: Path) -> None:
    assert preflight.check_patch(patched_slime(tmp_path / "a")).status == OK
    assert_fix(
        [preflight.check_patch(patched_slime(tmp_path / "b", applied=False))], "slime-patch", "apply_slime_patches.py"
    )
    changed = patched_slime(tmp_path / "c", applied=False)
    for path in changed.rglob("*.py"):
        path.write_text("# slime changed\n")
    assert_fix([preflight.check_patch(changed)], "slime-patch", "does not fit")
    assert_fix([preflight.check_patch(tmp_path / "nowhere")], "slime-patch", "not a folder")
    assert preflight.check_patch(None).status == WARN


# -- the launch script ------------------------------------------------------------------------------
def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env={**base, **(env or {})}, capture_output=True, text=True, timeout=30
    )


def test_the_script_parses_and_has_help() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    result = run_script("--help")
    assert result.returncode == 0 and "usage:" in result.stdout and "--dry-run" in result.stdout
    assert run_script("--bogus").returncode == 2


def dry_run(tmp_path: Path, **env: str) -> tuple[str, list[str], str]:
    """(stdout, the slime flags given to train.py, the YAML) of a dry run without a slime checkout."""
    base = {"SLIME_DIR": str(tmp_path / "no-slime"), "SAVE_DIR": str(tmp_path / "ckpt")}
    result = run_script("--dry-run", "--", "--lr", "2e-6", env={**base, **env})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert not (tmp_path / "ckpt").exists()  # nothing written
    submit = next(line for line in out.splitlines() if line.startswith("ray job submit"))
    words = shlex.split(submit)
    flags = words[words.index(str(tmp_path / "no-slime" / "train.py")) + 1 :]
    yaml_text = out.split("# custom config", 1)[1].split("\n", 1)[1].split("# commands:", 1)[0]
    return out, flags, yaml_text


def test_the_dry_run_prints_the_launch(tmp_path: Path) -> None:
    out, flags, yaml_text = dry_run(tmp_path, STOA_STORE="file:///b", STOA_RUN="r1")
    for needle in (
        "--rollout-num-gpus 0", "--rollout-function-path slime_stoa.generate_rollout",
        "--loss-type custom_loss", "--custom-loss-function-path slime_stoa.dppo_loss",
        "--advantage-estimator grpo", "--use-rollout-logprobs", "--n-samples-per-prompt 8",
        "--rollout-temperature 1.0", "--rollout-max-response-len 1024", "--rollout-batch-size 32",
        "--global-batch-size 256", "--lr 1e-6", "--hf-checkpoint /root/Qwen2.5-1.5B-Instruct",
        "--ref-load /root/Qwen2.5-1.5B-Instruct_torch_dist", "--custom-config-path", "--rotary-base 1000000",
        "ray start --head", "ray job submit", "--runtime-env-json=", "PYTHONPATH", "apply_slime_patches.py",
        "--check", "stoa preflight --store file:///b --run r1",
    ):  # fmt: skip
        assert needle in out, needle
    assert "<MODEL_ARGS from" in out and flags[-2:] == ["--lr", "2e-6"]
    assert (
        "stoa_publish: true" in yaml_text and 'stoa_bucket: "file:///b"' in yaml_text and 'stoa_run: "r1"' in yaml_text
    )


def test_the_dry_run_sources_slimes_model_args(tmp_path: Path) -> None:
    models = tmp_path / "slime" / "scripts" / "models"
    models.mkdir(parents=True)
    (models / "qwen2.5-1.5B.sh").write_text("MODEL_ARGS=(\n   --num-layers 28\n   --rotary-base 10000\n)\n")
    result = run_script("--dry-run", env={"SLIME_DIR": str(tmp_path / "slime"), "SAVE_DIR": str(tmp_path / "ckpt")})
    assert result.returncode == 0, result.stderr
    assert "--num-layers 28 --rotary-base 10000 --rotary-base 1000000" in result.stdout
    assert "<MODEL_ARGS" not in result.stdout


def test_the_scripts_flags_and_yaml_pass_preflight(tmp_path: Path) -> None:
    manifest = manifest_for(temperature=1.0, group_size=8, max_tokens=1024)
    url = make_bucket(tmp_path / "store", manifest)
    _, flags, yaml_text = dry_run(tmp_path, STOA_STORE=url, STOA_RUN=RUN)
    config = tmp_path / "stoa.yaml"
    config.write_text(yaml_text)
    flags = flags + ["--custom-config-path", str(config)]
    findings = run_checks(url, RUN, flags, slime_dir=None, facts=asyncio.run(inspect_store(url, RUN)))
    problems = [f for f in findings if f.status != OK and f.check not in ("slime-patch", "hf-names")]
    assert not problems, preflight.format_findings(findings)
    assert "is not a local folder here" in by_check(findings)["hf-names"].message  # the model is not on this box


# -- the published tensor names: the HF folder's, and the anchor's ------------------------------------
def hf_folder(root: Path, names: list[str], *, tie: bool | None) -> Path:
    from slime_stoa.protocol.hf.safetensors_io import write_safetensors

    root.mkdir(parents=True)
    config = {"model_type": "llama", "vocab_size": 64}
    if tie is not None:
        config["tie_word_embeddings"] = tie
    (root / "config.json").write_text(__import__("json").dumps(config))
    write_safetensors(root / "model.safetensors", {n: np.zeros((2, 2), np.float32) for n in names})
    return root


def test_the_anchor_must_have_the_hf_folders_tensor_names(setup: Setup) -> None:
    assert setup._facts.anchor_tensors == ("model.w",)  # read from the anchor's safetensors header
    same = hf_folder(setup.root / "same", ["model.w"], tie=True)
    for pp in ("1", "4"):
        findings = setup.findings(["--hf-checkpoint", str(same), "--pipeline-model-parallel-size", pp])
        f = by_check(findings)["hf-names"]
        assert f.status == OK and "the 1 tensor names" in f.message, f
        assert ("last stage's copy is left out" in f.message) == (pp == "4")
    tied_with_head = hf_folder(setup.root / "head", ["model.w", "lm_head.weight"], tie=True)
    assert_fix(setup.findings(["--hf-checkpoint", str(tied_with_head)]), "hf-names", "lacks lm_head.weight")
    assert_fix(
        setup.findings(["--hf-checkpoint", str(same), "--untie-embeddings-and-output-weights"]),
        "untie-embeddings", "remove --untie-embeddings-and-output-weights",
    )
    untied = hf_folder(setup.root / "untied", ["model.w"], tie=False)
    assert_fix(setup.findings(["--hf-checkpoint", str(untied)]), "untie-embeddings",
               "add --untie-embeddings-and-output-weights")
    f = by_check(setup.findings(["--hf-checkpoint", str(untied), "--untie-embeddings-and-output-weights"]))["hf-names"]
    assert f.status == OK and "untied output head" in f.message


def test_a_bad_key_of_a_piece_not_in_use_is_reported_as_it_fails_the_piece_in_use() -> None:
    """Every stoa piece builds the whole settings object: with only the rollout function in use,
    a bad publisher key fails it; with only the publisher, a bad rollout key does."""
    from slime_stoa.trainer.slime.preflight import check_settings

    base = dict(stoa_bucket="file:///b", stoa_run="r")
    rollout_only = argparse.Namespace(**base, rollout_function_path="slime_stoa.generate_rollout", stoa_anchor_every=0)
    publisher_only = argparse.Namespace(**base, stoa_publish=True, stoa_admission_order="lifo")
    assert_fix(check_settings(rollout_only), "publisher-settings", "anchor_every", "read by the rollout function too")
    assert_fix(check_settings(publisher_only), "rollout-settings", "admission_order", "read by the publisher too")
    clean = argparse.Namespace(**base, stoa_publish=True, rollout_function_path="slime_stoa.generate_rollout")
    assert all(f.status == "ok" for f in check_settings(clean) if f.check.endswith("-settings")), check_settings(clean)


def test_the_launch_names_the_slime_commit_and_warns_on_another(tmp_path: Path) -> None:
    """The launch scripts name the slime commit stoa is tested against (preflight's own), print it
    in a dry run, and warn before launching from a slime checkout at another commit."""
    from slime_stoa.trainer.slime.preflight_slime_api import SLIME_COMMIT

    out, _, _ = dry_run(tmp_path)
    assert f"# slime: stoa is tested against commit {SLIME_COMMIT} " in out
    slime = tmp_path / "slime"
    (slime / "scripts" / "models").mkdir(parents=True)
    (slime / "scripts" / "models" / "qwen2.5-1.5B.sh").write_text("MODEL_ARGS=(--num-layers 28)\n")
    (slime / "train.py").write_text("# not slime\n")
    git = ["git", "-C", str(slime), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "x"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    result = run_script(env={"SLIME_DIR": str(slime), "SAVE_DIR": str(tmp_path / "ckpt")})
    assert result.returncode != 0  # no Megatron checkpoint: it stops before anything runs
    warning = next(line for line in result.stderr.splitlines() if "warning: slime" in line)
    assert f"is at {head[:12]}, stoa is tested against {SLIME_COMMIT[:12]}" in warning
    assert f"git -C {slime} checkout {SLIME_COMMIT}" in warning
