"""scripts/gpu_check.sh without a GPU: it converts the tiny models and launches them with the recipes
themselves (run_lfm2_search.sh, run_qwen25_gsm8k.sh), prints every command in a dry run, and never
reports PASS for a check that did not run (a check it needs failed, or the time budget is spent).

python, slime, ray and (in the slow test) slime's converter and train.py are stand-ins on PATH or
in a stand-in slime checkout; everything else (the recipes, the stoa and macd commands, the tiny
models) is real."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from slime_stoa.protocol.layout import check_worker_id

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
CHECKS = ["gpu", "imports", "patch", "tiny_models", "lfm2_provider", "worker_env", "convert_lfm2_moe", "e2e_lfm2_moe",
          "bits_lfm2_moe", "convert_qwen2", "e2e_qwen2", "bits_qwen2"]


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _recorder(path: Path, log: Path, rc: int = 1) -> Path:
    """An executable that records its arguments in `log` and exits `rc`."""
    return _executable(path, f'#!/bin/sh\necho "$0 $*" >> {shlex.quote(str(log))}\nexit {rc}\n')


def _gpu_check(*args: str, path: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": path or os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), *args], env={**base, **env}, capture_output=True,
                          text=True, timeout=600)


def _results(stdout: str) -> dict[str, str]:
    """{check: "PASS ..." / "FAIL ..."} from the result lines."""
    out = {}
    for line in stdout.splitlines():
        if m := re.match(r"(PASS|FAIL)  (\S+)\s+(.*)", line):
            assert m[2] not in out, f"{m[2]} reported twice"
            out[m[2]] = f"{m[1]} {m[3]}"
    return out


def test_the_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_check.sh")]).returncode == 0


def test_dry_run_prints_each_recipes_conversion_before_its_launch_and_runs_nothing(tmp_path: Path) -> None:
    calls = tmp_path / "calls.log"
    python, worker_python = _recorder(tmp_path / "py", calls), _recorder(tmp_path / "worker-py", calls)
    _recorder(tmp_path / "bin" / "ray", calls)
    work = tmp_path / "work"
    proc = _gpu_check("--dry-run", path=f"{tmp_path / 'bin'}:{os.environ['PATH']}", WORK=str(work), PYTHON=str(python),
                      WORKER_PYTHON=str(worker_python), SLIME_DIR="/s")
    assert proc.returncode == 0, proc.stderr
    assert not calls.exists() and not work.exists()  # nothing ran, nothing was written
    assert _results(proc.stdout) == {}
    lines = proc.stdout.splitlines()
    sections: dict[str, list[str]] = {}
    for line in lines[1:]:
        if line.startswith("# ") and line[2:] in CHECKS:
            sections[line[2:]] = []
        else:
            sections[list(sections)[-1]].append(line)
    assert list(sections) == CHECKS

    for family, script, provider in (("lfm2_moe", "run_lfm2_search.sh", True), ("qwen2", "run_qwen25_gsm8k.sh", False)):
        # the conversion is the recipe's own --convert
        convert = shlex.split(sections[f"convert_{family}"][-1])
        assert convert[2:4] == [str(python), "/s/tools/convert_hf_to_torch_dist.py"]
        assert convert[-4:] == ["--hf-checkpoint", f"{work}/{family}", "--save", f"{work}/{family}_torch_dist"]
        assert ("slime_stoa.trainer.slime.lfm2.spec.provider" in convert) is provider
        # the launch is the recipe's, from that checkpoint, with the tiny run's shape
        e2e = sections[f"e2e_{family}"]
        assert f"# written by {script}; keys documented in" in "\n".join(e2e)
        submit = shlex.split(e2e[-1])
        assert submit[:2] == ["ray", "job"] and submit[submit.index("--") + 1:][:2] == ["python3", "/s/train.py"]
        flags = submit[submit.index("--") + 1:]
        for flag, value in (("--ref-load", f"{work}/{family}_torch_dist"), ("--load", f"{work}/ckpt-{family}"),
                            ("--num-rollout", "3"), ("--n-samples-per-prompt", "4"), ("--rollout-max-response-len", "32"),
                            ("--custom-config-path", f"{work}/ckpt-{family}/stoa-config.yaml")):
            assert flags[flags.index(flag) + 1] == value, flag
        assert ("--custom-model-provider-path" in flags) is provider
        # slime's own gate on the trainer-vs-worker logprob gap, at every training step
        assert flags[-5:] == ["--ci-test", "--ci-disable-kl-checker", "--ci-train-rollout-logprob-abs-diff-threshold", "0.5",
                              "--use-tensorboard"]
        preflight = shlex.split(next(line for line in e2e if " preflight " in line))
        assert preflight[:2] == [f"{work}/bin/stoa", "preflight"] and preflight[preflight.index("--") + 1:] == flags[2:]
        join = shlex.split(next(line for line in e2e if " macd join " in line))
        check_worker_id(join[join.index("--worker-id") + 1])  # a valid worker id
        assert join[join.index("--run") + 1] == f"gpucheck-{family}"


def test_a_check_that_cannot_run_is_never_a_pass(tmp_path: Path) -> None:
    """Every command fails: each check is one FAIL line, those that need a failed check say "not run"."""
    calls = tmp_path / "calls.log"
    python = _recorder(tmp_path / "py", calls)
    _recorder(tmp_path / "bin" / "ray", calls)
    proc = _gpu_check(path=f"{tmp_path / 'bin'}:{os.environ['PATH']}", WORK=str(tmp_path / "work"), PYTHON=str(python),
                      WORKER_PYTHON=str(python), SLIME_DIR=str(tmp_path / "no-slime"))
    assert proc.returncode == 1
    results = _results(proc.stdout)
    assert list(results) == CHECKS and all(r.startswith("FAIL") for r in results.values())
    assert results["lfm2_provider"] == "FAIL (not run: gpu did not pass)"
    assert results["convert_lfm2_moe"] == results["convert_qwen2"] == "FAIL (not run: gpu did not pass)"
    assert results["e2e_lfm2_moe"] == "FAIL (not run: worker_env did not pass)"
    assert proc.stdout.splitlines()[-1].startswith("0 of 12 checks passed")
    ran = calls.read_text()
    assert "convert_hf_to_torch_dist" not in ran and "job submit" not in ran and "-m macd" not in ran


def test_past_the_time_budget_no_check_runs(tmp_path: Path) -> None:
    """BUDGET=1: the first check is stopped when the budget ends (or, when the script's start took
    the second, not run), every later one is a FAIL "not run"."""
    python = _executable(tmp_path / "py", "#!/bin/sh\nexec sleep 60\n")
    proc = _gpu_check(WORK=str(tmp_path / "work"), PYTHON=str(python), WORKER_PYTHON=str(python), BUDGET="1")
    assert proc.returncode == 1
    results = _results(proc.stdout)
    assert list(results) == CHECKS and results["gpu"].startswith("FAIL")
    if "not run" not in results["gpu"]:
        assert "stopped after 1 s: " in (tmp_path / "work" / "gpu.log").read_text()
    for check in ("imports", "patch", "tiny_models", "worker_env"):
        assert results[check] == "FAIL (not run: the time budget BUDGET=1 s is spent)"


@pytest.mark.parametrize("setting", ["WORK", "BUDGET", "GAP_LIMIT"])
def test_bad_settings_stop_before_any_check(tmp_path: Path, setting: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "current.json").write_text("{}")  # an earlier check's folder
    bad = {"BUDGET": "ten", "GAP_LIMIT": "0.0"}
    env = {"WORK": str(work)} if setting == "WORK" else {"WORK": str(tmp_path / "new"), setting: bad[setting]}
    proc = _gpu_check(**env)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert {"WORK": f"WORK={work} is not empty", "BUDGET": "BUDGET must be a positive whole number, got 'ten'",
            "GAP_LIMIT": "GAP_LIMIT must be a positive number (nats per token), got '0.0'"}[setting] in proc.stderr
    assert not (tmp_path / "new").exists()


# -- the whole script on the CPU ----------------------------------------------------------------------
STAND_IN_TRAIN = """\
import json, os, sys
args = sys.argv[1:]
flag = lambda name: args[args.index(name) + 1]
ref = flag("--ref-load")
record = {"argv": args, "converted": os.path.exists(os.path.join(ref, "latest_checkpointed_iteration.txt"))}
with open(os.path.join(os.path.dirname(ref), "train-" + os.path.basename(flag("--hf-checkpoint")) + ".json"), "w") as f:
    json.dump(record, f)
if "--use-tensorboard" in args and os.environ.get("STAND_IN_LOGS_GAP", "1") == "1":  # slime's tensorboard scalars
    os.makedirs(os.environ["TENSORBOARD_DIR"], exist_ok=True)
    with open(os.path.join(os.environ["TENSORBOARD_DIR"], "events.out.tfevents.stand-in"), "wb") as f:
        f.write(b"train/train_rollout_logprob_abs_diff")  # a scalar tag, as it sits in an event file
if "lfm2" in ref:  # publishes the versions a trainer would (the pointer only); the Qwen2 one publishes none
    lines = open(flag("--custom-config-path")).read().splitlines()
    config = dict(line.split(": ", 1) for line in lines if not line.startswith("#"))
    path = os.path.join(json.loads(config["stoa_bucket"])[len("file://"):], "runs", json.loads(config["stoa_run"]),
                        "current.json")
    doc = json.load(open(path))
    doc["version"] = int(flag("--num-rollout"))
    json.dump(doc, open(path, "w"))
"""

STAND_IN_CONVERTER = """\
import json, os, pathlib, sys
save = pathlib.Path(sys.argv[sys.argv.index("--save") + 1])
save.mkdir(parents=True)
(save / "latest_checkpointed_iteration.txt").write_text("release")
(save / "argv.json").write_text(json.dumps(sys.argv[1:]))
"""


def _stand_in_box(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """gpu_check.sh with a stand-in GPU (`torch.cuda` answers), slime (its converter and train.py)
    and Ray (`ray job submit` runs the entrypoint); the tiny models, the run, the worker and the
    recipes are real. Its work folder is tmp_path / "work"."""
    slime = tmp_path / "slime"
    _executable(slime / "train.py", STAND_IN_TRAIN)
    _executable(slime / "tools" / "convert_hf_to_torch_dist.py", STAND_IN_CONVERTER)
    python = _executable(tmp_path / "py", f"""#!/bin/sh
case "$*" in
  *torch.cuda.is_available*) echo "stand-in GPU"; exit 0 ;;
  *transformer_engine*) echo "no transformer_engine here"; exit 1 ;;
esac
exec {shlex.quote(sys.executable)} "$@"
""")
    bin_dir = tmp_path / "bin"
    _executable(bin_dir / "python3", f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    _executable(bin_dir / "ray", f"""#!/bin/bash
echo "ray $*" >> {shlex.quote(str(tmp_path / 'ray.log'))}
case "$1 $2" in
  "status "*) exit 1 ;;
  "job submit") while [ "$1" != -- ]; do shift; done; shift; exec "$@" ;;
esac
""")
    return _gpu_check(path=f"{bin_dir}:{os.environ['PATH']}", WORK=str(tmp_path / "work"), PYTHON=str(python),
                      WORKER_PYTHON=sys.executable, SLIME_DIR=str(slime), SKIP_PREFLIGHT="1", E2E_TIMEOUT="120", **env)


@pytest.mark.slow
def test_on_the_cpu_the_recipes_convert_then_launch_and_only_a_published_version_passes(tmp_path: Path) -> None:
    """The LFM2 launch publishes v3, logs the gap metric and passes; the Qwen2 launch exits 0 but
    publishes nothing: FAIL."""
    from slime_stoa.trainer.slime.lfm2.flags import slime_model_args

    work = tmp_path / "work"
    proc = _stand_in_box(tmp_path)
    results = _results(proc.stdout)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert [c for c, r in results.items() if r.startswith("PASS")] == [
        "gpu", "tiny_models", "worker_env", "convert_lfm2_moe", "e2e_lfm2_moe", "convert_qwen2"], proc.stdout
    assert "v0 < NUM_ROLLOUT=3" in (work / "e2e-qwen2.log").read_text()
    assert f"slime's gap gate ran: train/train_rollout_logprob_abs_diff within GAP_LIMIT=0.5 at every step " \
           f"(tensorboard: {work / 'tb-lfm2_moe'})" in (work / "e2e-lfm2_moe.log").read_text()
    # the bits check ran after the passed launch (the stand-in slime has no checkpoint converter)
    assert results["bits_lfm2_moe"].startswith("FAIL (") and results["bits_qwen2"] == "FAIL (not run: e2e_qwen2 did not pass)"
    assert "convert_torch_dist_to_hf.py does not exist" in (work / "bits-lfm2_moe.log").read_text()
    assert proc.stdout.splitlines()[-1].startswith("6 of 12 checks passed")

    config = json.loads((work / "lfm2_moe" / "config.json").read_text())
    assert json.loads((work / "lfm2_moe_torch_dist" / "argv.json").read_text()) == [
        *slime_model_args(config), "--custom-model-provider-path", "slime_stoa.trainer.slime.lfm2.spec.provider",
        "--moe-grouped-gemm", "--hf-checkpoint", str(work / "lfm2_moe"), "--save", str(work / "lfm2_moe_torch_dist")]
    qwen_convert = json.loads((work / "qwen2_torch_dist" / "argv.json").read_text())
    assert qwen_convert[qwen_convert.index("--hidden-size") + 1] == "64"
    assert qwen_convert[-6:] == ["--rotary-base", "10000", "--hf-checkpoint", str(work / "qwen2"), "--save",
                                 str(work / "qwen2_torch_dist")]
    for family in ("lfm2_moe", "qwen2"):
        launched = json.loads((work / f"train-{family}.json").read_text())
        assert launched["converted"]  # the launch came after its conversion, from its checkpoint
        assert launched["argv"][launched["argv"].index("--ref-load") + 1] == str(work / f"{family}_torch_dist")
        assert "--use-tensorboard" in launched["argv"]
    assert "ray start --head" in (tmp_path / "ray.log").read_text()
    assert '"TENSORBOARD_DIR": ' in (tmp_path / "ray.log").read_text()  # the Ray job gets it


@pytest.mark.slow
def test_a_launch_whose_gap_metric_never_reached_slimes_log_fails(tmp_path: Path) -> None:
    """slime's --ci-test asserts on the gap only when the metric is in its log: a launch that
    publishes every version but logged no gap metric is a FAIL, not a pass."""
    proc = _stand_in_box(tmp_path, STAND_IN_LOGS_GAP="0")
    results = _results(proc.stdout)
    assert results["e2e_lfm2_moe"].startswith("FAIL ("), proc.stdout
    log = (tmp_path / "work" / "e2e-lfm2_moe.log").read_text()
    assert "published weight version: v3" in log
    assert "slime logged no train/train_rollout_logprob_abs_diff" in log and "its gap gate (--ci-test) never ran" in log


# -- the time budget ----------------------------------------------------------------------------------
def _time_plan(stdout: str) -> tuple[int, dict[str, int]]:
    """(BUDGET, {check: cap}) from the line that states them."""
    m = re.search(r"time budget BUDGET=(\d+) s; the checks' caps add up to (\d+) s \(([^)]*)\)", stdout)
    assert m, stdout[:500]
    caps = {name: int(cap) for name, cap in (item.rsplit(" ", 1) for item in m[3].split(", "))}
    assert sum(caps.values()) == int(m[2])
    return int(m[1]), caps


@pytest.mark.parametrize("worker_python", [False, True])
def test_the_default_budget_is_the_checks_caps_added_up(tmp_path: Path, worker_python: bool) -> None:
    env = {"WORK": str(tmp_path / "work"), "SLIME_DIR": "/s"}
    if worker_python:
        env["WORKER_PYTHON"] = str(_recorder(tmp_path / "worker-py", tmp_path / "calls.log"))
    proc = _gpu_check("--dry-run", **env)
    assert proc.returncode == 0, proc.stderr
    budget, caps = _time_plan(proc.stdout.splitlines()[0])
    assert list(caps) == CHECKS and budget == sum(caps.values())
    assert caps["worker_env"] == (120 if worker_python else 60 + 300 + 120)
    assert caps["e2e_lfm2_moe"] == caps["e2e_qwen2"] == 4 * 60 + 240 and caps["convert_qwen2"] == 60 + 150
    assert budget <= 2760  # the header's promise: 46 minutes at most
    assert "not run" not in proc.stdout.splitlines()[0]

    small = _gpu_check("--dry-run", BUDGET="600", CONVERT_TIMEOUT="100", **env)
    budget, caps = _time_plan(small.stdout.splitlines()[0])
    assert budget == 600 and caps["convert_lfm2_moe"] == 100
    assert 'BUDGET is smaller: the last checks may be reported "not run"' in small.stdout.splitlines()[0]


def test_each_checks_cap_is_the_caps_of_the_commands_it_runs(tmp_path: Path) -> None:
    """A stand-in `timeout` records the cap of every command the checks run (and runs none): the
    caps a check's log shows add up to the cap the time plan states for it."""
    calls = tmp_path / "calls.log"
    python = _recorder(tmp_path / "py", calls, rc=0)
    _recorder(tmp_path / "bin" / "ray", calls)
    _executable(tmp_path / "bin" / "timeout", '#!/bin/sh\necho "cap=$3"\nexit 0\n')
    work = tmp_path / "work"
    proc = _gpu_check(path=f"{tmp_path / 'bin'}:{os.environ['PATH']}", WORK=str(work), PYTHON=str(python),
                      SLIME_DIR=str(tmp_path / "slime"))
    _, caps = _time_plan(proc.stdout.splitlines()[0])
    results = _results(proc.stdout)
    logs = {"gpu": "gpu", "imports": "imports", "patch": "patch", "tiny_models": "tiny", "lfm2_provider": "provider",
            "worker_env": "worker_env", "convert_lfm2_moe": "convert-lfm2_moe"}
    for check, log in logs.items():
        ran = [int(c) for c in re.findall(r"^cap=(\d+)$", (work / f"{log}.log").read_text(), re.M)]
        assert ran and sum(ran) == caps[check], (check, ran)
    # every command of these checks "ran" (the conversion wrote no checkpoint: a FAIL)
    assert all(results[c].startswith("PASS") for c in logs if c != "convert_lfm2_moe"), results
    assert results["convert_lfm2_moe"].startswith("FAIL")
