"""scripts/gpu_day.py on the CPU at a tiny scale: its checks' lines and JSON, device_delta bit-exact
here, the DPPO and Megatron comparisons rehearsed CPU against CPU (SKIP "no CUDA device"), a missing
package a SKIP, and a mismatch injected into the code under check (or the time budget spent) a FAIL
with a non-zero exit. The script's main() runs in-process; one test runs it as a command."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.hidden_modules import run_hiding
from tests.scripts_loader import SCRIPTS, load_script

gpu_day = load_script("gpu_day")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU's results (no CUDA device)")
TINY = ["--delta-shape", "smoke", "--delta-versions", "2", "--threads", "1"]


def run(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "gpu-day.json"
    rc = gpu_day.main([*TINY, "--json", str(out), *args])
    return rc, json.loads(out.read_text())


def test_device_delta_is_bit_exact_and_dppo_is_rehearsed_cpu_against_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = run(tmp_path, "--only", "wheels,cuda,device_delta,dppo_step")
    assert rc == 0 and doc["pass"] and doc["device"] == "cpu" and doc["why_not_cuda"] == "no CUDA device"
    checks = doc["checks"]
    assert {n: c["status"] for n, c in checks.items()} == {
        "wheels": "SKIP", "cuda": "SKIP", "device_delta": "PASS", "dppo_step": "SKIP"}
    assert checks["cuda"]["detail"] == "no CUDA device"
    assert checks["dppo_step"]["detail"].startswith("no CUDA device (CPU rehearsal: ")

    delta = checks["device_delta"]
    assert delta["deltas_compared"] == 3 * delta["versions"] * delta["batches"] > 0
    assert delta["deltas_mismatched"] == 0 and delta["digests_mismatched"] == 0
    # the quick sample stands for the whole model: every layer of a kind counted as its first
    assert delta["elements_per_version"] == delta["model_elements"] and delta["tensors_streamed"] < delta["model_tensors"]
    assert 0.01 < delta["changed_fraction"] < 0.02
    for path in ("device", "numpy"):
        assert len(delta["seconds_per_version"][path]) == 2
    device_bytes, numpy_bytes = (delta["bytes_device_to_host_per_version"][p] for p in ("device", "numpy"))
    assert numpy_bytes == [2 * delta["model_elements"]] * 2  # the numpy path moves every bf16 weight
    # the device path: the patches and old bits, and each changed tensor and its plane arrays read
    # once for the digests (at 1.5% of the elements every tensor changes): more than the bf16
    # state, less than it with both planes' arrays
    assert all(n < d < 3 * n for d, n in zip(device_bytes, numpy_bytes, strict=True)), (device_bytes, numpy_bytes)

    dppo = checks["dppo_step"]
    assert dppo["cpu_terms_are_the_learner_step"] and dppo["same_gradients"]
    assert dppo["loss_diff"] == dppo["max_logprob_diff"] == dppo["max_rel_grad_diff"] == 0.0
    metrics = dppo["metrics"]["cpu"]
    assert metrics["gate_frac"] > 0 and metrics["cap_frac"] > 0  # the trust region and the cap both acted

    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines if line[:4] in ("PASS", "FAIL", "SKIP")] == [
        ["SKIP", "wheels"], ["SKIP", "cuda"], ["PASS", "device_delta"], ["SKIP", "dppo_step"]]


def test_a_device_delta_mismatch_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device diff loses the last changed element of each tensor: no longer codec.diff's."""
    from slime_stoa.trainer import device_delta

    real = device_delta.changed_indices
    monkeypatch.setattr(device_delta, "changed_indices", lambda old, new: real(old, new)[:-1])
    rc, doc = run(tmp_path, "--only", "device_delta", "--delta-versions", "1")
    check = doc["checks"]["device_delta"]
    assert rc == 1 and not doc["pass"] and check["status"] == "FAIL"
    assert check["deltas_mismatched"] > 0 and check["mismatched"][0].startswith("v1 bf16: ")


def test_published_bits_are_the_learners_rehearsed_on_the_cpu(tmp_path: Path) -> None:
    """The learner steps, each version goes out by delta, a real Subscriber installs it: its state
    is the learner's bf16 weights bit for bit and a CPU reader of it gives the learner's logprobs
    (exactly, CPU against CPU)."""
    rc, doc = run(tmp_path, "--only", "published_bits")
    assert rc == 0, doc
    got = doc["checks"]["published_bits"]
    assert got["status"] == "SKIP" and got["detail"].startswith("no CUDA device (CPU rehearsal: cpu: 2 versions")
    assert got["bits_mismatched"] == [[], []] and got["max_logprob_gap"] == [0.0, 0.0]
    assert got["planes_mismatched"] == [{"int8": [], "int4": []}] * 2  # both planes, installed by their readers
    assert all(c > 0 for c in got["changed"]) and got["anchored"] == [False, True]


def test_a_published_bit_off_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device diff gets one element's new bits wrong in each changed tensor (consistently: the
    patch, the digest, the planes and the device's copy agree): readers install a state that is
    not the learner's, and the check fails even as a rehearsal."""
    from slime_stoa.trainer.device_delta import PreviousState

    real = PreviousState.diff_tensor

    def flipped(self: Any, name: str, tensor: Any) -> Any:
        entry = real(self, name, tensor)
        if entry is None:
            return None
        found, values = self._pending[name]
        self._pending[name] = (found, values ^ 1)
        indices, bits = entry
        return indices, bits ^ np.uint16(1)

    monkeypatch.setattr(PreviousState, "diff_tensor", flipped)
    rc, doc = run(tmp_path, "--only", "published_bits")
    got = doc["checks"]["published_bits"]
    assert rc == 1 and got["status"] == "FAIL" and all(got["bits_mismatched"]), got
    assert all(off for by_plane in got["planes_mismatched"] for off in by_plane.values())


def test_a_dppo_mismatch_fails_even_as_a_rehearsal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second learner's (the "device" side's) gradients are off by 1%."""
    real = gpu_day.step_terms
    calls: list[str] = []

    def perturbed(learner: Any, groups: Any, device: str) -> Any:
        terms = real(learner, groups, device)
        calls.append(device)
        if len(calls) == 2:
            terms.grads = {n: g * 1.01 for n, g in terms.grads.items()}
        return terms

    monkeypatch.setattr(gpu_day, "step_terms", perturbed)
    rc, doc = run(tmp_path, "--only", "dppo_step")
    check = doc["checks"]["dppo_step"]
    assert rc == 1 and check["status"] == "FAIL" and len(calls) == 2
    assert check["max_rel_grad_diff"] == pytest.approx(0.01, rel=1e-3)


def test_missing_packages_are_skips_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "megatron.core", None)  # an import of it fails as when not installed
    monkeypatch.setitem(sys.modules, "transformers", None)
    rc, doc = run(tmp_path, "--only", "dppo_step,megatron_local")
    checks = doc["checks"]
    assert rc == 0 and [c["status"] for c in checks.values()] == ["SKIP", "SKIP"]
    assert checks["dppo_step"]["detail"] == (
        "missing package transformers (put its wheel in --wheels DIR; scripts/gpu_day_wheels*.txt list them)")
    assert checks["megatron_local"]["detail"].startswith("megatron-core not importable (")
    assert "pip install --no-deps megatron_core-0.16.1-cp311-" in checks["megatron_local"]["detail"]
    assert "traceback" not in checks["dppo_step"]


def test_a_spent_budget_is_a_fail_not_a_skip(tmp_path: Path) -> None:
    rc, doc = run(tmp_path, "--only", "cuda,device_delta", "--budget", "1e-9")
    assert rc == 1
    assert {c["status"] for c in doc["checks"].values()} == {"FAIL"}
    assert doc["checks"]["device_delta"]["detail"] == "not run: the time budget (--budget 1e-09 s) is spent"


def test_the_device_delta_cap_cuts_between_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(gpu_day.CAPS, "device_delta", 0.0)
    rc, doc = run(tmp_path, "--only", "device_delta")
    assert rc == 1
    assert doc["checks"]["device_delta"]["detail"] == "stopped: its cap (0 s) is spent (after 0 of the sampled tensors)"


def test_no_cuda_with_device_cuda_is_a_fail(tmp_path: Path) -> None:
    rc, doc = run(tmp_path, "--only", "cuda,device_delta", "--device", "cuda")
    assert rc == 1
    assert doc["checks"]["cuda"] == {"status": "FAIL", "detail": "no CUDA device (--device cuda)"}
    assert doc["checks"]["device_delta"]["detail"] == "not run: no CUDA device (--device cuda)"


def _wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel: one module and its metadata."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": "VALUE = 7\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for arcname, text in files.items():
            z.writestr(arcname, text)
        z.writestr(f"{info}/RECORD", "".join(f"{a},,\n" for a in files) + f"{info}/RECORD,,\n")
    return path


def test_wheels_are_installed_before_the_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip installs the folder's wheels offline (here into a target folder on sys.path, so the
    test leaves the environment as it was) and this Python then finds them."""
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "stoa_gpu_day_probe", "0.3")
    monkeypatch.setenv("PIP_TARGET", str(target))
    monkeypatch.syspath_prepend(str(target))
    rc, doc = run(tmp_path, "--only", "wheels", "--wheels", str(wheels))
    check = doc["checks"]["wheels"]
    assert rc == 0 and check["status"] == "PASS", check
    assert check["installed"] == {"stoa_gpu_day_probe": "0.3"} and (target / "stoa_gpu_day_probe.py").exists()
    assert set(doc["environment"]["packages"]) >= {"xxhash", "zstandard", "msgspec", "cryptography", "megatron-core"}


def test_a_broken_wheel_fails_and_bad_folders_stop_before_any_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    rc, doc = run(tmp_path, "--only", "wheels", "--wheels", str(wheels))
    assert rc == 1 and doc["checks"]["wheels"]["status"] == "FAIL"
    assert doc["checks"]["wheels"]["detail"].startswith("pip exited ")
    for folder, message in ((tmp_path / "none", "no such folder"), (tmp_path / "empty", "no *.whl files in it")):
        if folder.name == "empty":
            folder.mkdir()
        capsys.readouterr()
        assert gpu_day.main(["--wheels", str(folder), "--json", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "x.json").exists()


def test_the_command_prints_one_line_per_check(tmp_path: Path) -> None:
    out = tmp_path / "day.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_day.py"), *TINY, "--delta-versions", "1", "--only",
                           "cuda,device_delta", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [line.split()[:2] for line in proc.stdout.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")]
    assert results == [["SKIP", "cuda"], ["PASS", "device_delta"]]
    assert json.loads(out.read_text())["checks"]["device_delta"]["deltas_mismatched"] == 0


def _normal(name: str) -> str:
    return name.lower().replace("_", "-")


def _with_requirements(names: set[str]) -> set[str]:
    """`names` and every distribution they require, as installed here (markers evaluated, no extras)."""
    from packaging.requirements import Requirement

    found, todo = set(), [*names]
    while todo:
        name = _normal(todo.pop())
        if name in found:
            continue
        found.add(name)
        for line in importlib.metadata.requires(name) or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def test_the_listed_wheels_are_all_a_bare_box_needs(tmp_path: Path) -> None:
    """Every check runs as on the CPU with only torch, the listed wheels and the checkout:
    no check is a SKIP for a missing package (a cryptography without its cffi was one)."""
    pytest.importorskip("megatron.core")
    listed = {_normal(line.split("==")[0]) for path in gpu_day.WHEEL_LISTS for line in path.read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    allowed = _with_requirements({"torch"}) | listed | {"slime-stoa"}
    out = tmp_path / "day.json"  # a box with only torch and the listed wheels, stoa from the checkout
    proc = run_hiding("gpu_day:main", [*TINY, "--json", str(out)], only=allowed, path=[str(SCRIPTS)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["environment"]["missing"] == []
    assert {n: c["status"] for n, c in doc["checks"].items()} == {
        "wheels": "SKIP", "cuda": "SKIP", "device_delta": "PASS", "dppo_step": "SKIP", "published_bits": "SKIP",
        "megatron_local": "SKIP"}
    for name in ("dppo_step", "published_bits", "megatron_local"):
        assert doc["checks"][name]["detail"].startswith("no CUDA device (CPU rehearsal: "), doc["checks"][name]
    assert len(listed) == sum(1 for path in gpu_day.WHEEL_LISTS for line in path.read_text().splitlines()
                              if line.strip() and not line.startswith("#"))  # no name listed twice


@pytest.mark.slow
def test_every_check_megatron_rehearsed_against_transformers(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    rc, doc = run(tmp_path)
    assert rc == 0, doc
    assert {n: c["status"] for n, c in doc["checks"].items()} == {
        "wheels": "SKIP", "cuda": "SKIP", "device_delta": "PASS", "dppo_step": "SKIP", "published_bits": "SKIP",
        "megatron_local": "SKIP"}
    megatron = doc["checks"]["megatron_local"]
    assert megatron["detail"].startswith("no CUDA device (CPU rehearsal: cpu vs transformers, local spec")
    for family in ("lfm2", "lfm2_moe"):
        got = megatron[family]
        assert got["pass"] and got["same_names"] and got["expert_bias_fp32_unchanged"]
        assert got["max_logit_diff"] < 1e-4 and got["max_rel_grad_diff"] < 1e-4 and got["tensors_compared"] > 10
    assert megatron["lfm2_moe"]["expert_biases"] > 0 and megatron["lfm2"]["expert_biases"] == 0
    assert np.isfinite(doc["seconds"])


def test_loss_metrics_agree_within_one_token_or_the_logprob_tolerance() -> None:
    """A fraction of tokens may move by one token crossing a threshold, a ratio statistic by the
    logprob tolerance (relative), the loss by its own; a count must be equal."""
    excess = gpu_day.metric_excess
    assert excess("gate_frac", 0.25 + 1 / 40, 0.25, 40.0) == pytest.approx(1.0)
    assert excess("gate_frac", 0.25 + 2 / 40, 0.25, 40.0) > 1
    assert excess("ratio_max", 2.0001, 2.0, 40.0) <= 1 < excess("ratio_max", 2.001, 2.0, 40.0)
    assert excess("loss", 0.5 + 5e-6, 0.5, 40.0) <= 1 < excess("loss", 0.5 + 5e-5, 0.5, 40.0)
    assert excess("tokens", 40.0, 40.0, 40.0) == 0 and excess("tokens", 41.0, 40.0, 40.0) > 1
