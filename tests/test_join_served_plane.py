"""`macd join` (and `macd doctor`'s plan) speak of the plane this Mac will serve: when the run's plane
does not fit and a smaller plane the run publishes does, one line names that plane and says it
fits, and no warning talks of the run's plane; the warning is the served plane's when that one does
not fit either."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from macd import config as cfg
from macd.join_cmd import memory_plan_lines, plan_lines, plane_line, served_plane
from macd.memory_plan import GIB, LFM2_5_8B_A1B
from slime_stoa.protocol.run_manifest import Plane, QuantPlane, RunManifest

SERVED = "this Mac will serve the "


def _run(plane: Plane = "bf16", planes: tuple[QuantPlane, ...] = ("int8", "int4")) -> cfg.RunInfo:
    manifest = RunManifest(run="r", model="m", task="t", plane=plane, planes=planes, max_prompt_tokens=1024,
                           max_tokens=1024)
    return cfg.RunInfo(manifest=manifest, version=3, elements=8_470_000_000, model_config=LFM2_5_8B_A1B,
                       kv_bytes_per_token=12 * 1024)


def _config(tmp_path: Path, **fields: object) -> cfg.DaemonConfig:
    return cfg.DaemonConfig(store=f"file://{tmp_path}", run="r", name="mac", worker_id="mac-1", data_dir=tmp_path,
                            batch=2, **fields)  # type: ignore[arg-type]


def test_a_smaller_published_plane_that_fits_is_named_once_and_nothing_warns(tmp_path: Path) -> None:
    config, info = _config(tmp_path), _run()
    lines = plan_lines(config, info, 24 * GIB, device="gpu")
    assert served_plane(config, info, 24 * GIB, device="gpu")[0] == "int8"
    served = [line.strip() for line in lines if line.strip().startswith(SERVED)]
    assert served == ["this Mac will serve the int8 plane: needs 9.1 of 16.0 GiB usable: fits "
                      "(the run's bf16 plane: does not fit)"]
    assert not any(line.startswith("warning") for line in lines)
    assert memory_plan_lines(config, info, 24 * GIB, device="gpu")[1] is None  # doctor: no failing row either
    rows = [line.strip() for line in lines if line.strip().startswith("this Mac, ")]
    assert rows[:2] == ["this Mac, bf16: needs 16.5 of 16.0 GiB usable: does not fit (the run's plane)",
                        "this Mac, int8: needs 9.1 of 16.0 GiB usable: fits (served here)"]
    assert plane_line(config, info, 24 * GIB, device="gpu") == (
        "  plane        int8 (the run's published plane, held alone): 9.1 of 16.0 GiB usable, fits")
    # one account of memory: the plan, from the model's config (no coarse estimate beside it)
    assert not any(line.startswith("  memory       ") for line in lines)


def test_the_runs_plane_that_fits_is_served_without_another_line(tmp_path: Path) -> None:
    lines = plan_lines(_config(tmp_path), _run(), 64 * GIB, device="gpu")
    assert not any(SERVED in line or "served here" in line or line.startswith("warning") for line in lines)
    assert any(line.strip() == "this Mac, bf16: needs 16.5 of 48.0 GiB usable: fits (the run's plane)" for line in lines)
    assert not any(line.startswith("  memory       ") for line in lines)


def test_a_served_plane_that_does_not_fit_is_what_the_warning_names(tmp_path: Path) -> None:
    config = _config(tmp_path, plane="int8")  # this config's plane, on a Mac too small for it
    lines = plan_lines(config, _run(), 12 * GIB, device="gpu")
    assert "  plane        int8 (this config's `plane`)" in lines
    assert lines[-2].strip() == ("this Mac will serve the int8 plane: needs 9.1 of 8.0 GiB usable: does not fit "
                                 "(the run's bf16 plane: does not fit)")
    assert lines[-1] == ("warning: the run's model does not fit this Mac's usable memory on the int8 plane it serves "
                         "(9.1 of 8.0 GiB): its weights alone do not fit; join a run of a smaller model or use a Mac "
                         "with more memory")
    # nothing smaller fits: the run's plane is served, and its warning is as before
    nothing = plan_lines(_config(tmp_path), _run(planes=()), 12 * GIB, device="gpu")
    assert nothing[-1].startswith("warning: the run's model does not fit this Mac's usable memory on the bf16 plane (")
    assert not any(SERVED in line for line in nothing)


def test_a_plane_the_run_cannot_be_served_on_plans_the_runs(tmp_path: Path) -> None:
    info = replace(_run(), manifest=replace(_run().manifest, planes=()))
    assert served_plane(_config(tmp_path, plane="int4"), info, 64 * GIB) == ("bf16", None)  # no int4 published
