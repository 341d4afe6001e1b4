"""The memory plan of a run that publishes quantized planes: a plane held alone costs its codes
and a bf16 scale and bias per 64 (int8 1 + 4/64, int4 0.5 + 4/64 bytes per quantizable weight),
2 bytes per other weight, and no bf16 master."""

from __future__ import annotations

import pytest

from macd import config as cfg
from macd.join_cmd import plan_lines
from macd.memory_plan import GIB, LFM2_5_8B_A1B, describe, param_count, plan
from slime_stoa.protocol.run_manifest import RunManifest

SHAPE = dict(group_size=16, prompt_tokens=512, response_tokens=1024, mac_sizes_gb=(16, 24))


def test_published_planes_are_planned_without_the_master() -> None:
    counts = param_count(LFM2_5_8B_A1B)
    before = plan(LFM2_5_8B_A1B, **SHAPE)
    assert set(before.weights) == {"bf16"}  # a quantized plane only when published
    both = plan(LFM2_5_8B_A1B, **SHAPE, published=("int8", "int4"))
    assert both.weights["bf16"] == 2 * counts.total
    assert both.weights["int8"] == int((1 + 4 / 64) * counts.quantizable + 2 * counts.other)
    assert both.weights["int4"] == int((0.5 + 4 / 64) * counts.quantizable + 2 * counts.other)
    assert 8 * GIB < both.weights["int8"] < 9 * GIB and 4 * GIB < both.weights["int4"] < 5 * GIB
    fits = {(r["ram_gb"], r["plane"]): r["fits"] for r in both.macs}
    assert fits[(16, "int8")] and fits[(16, "int4")] and not fits[(16, "bf16")]  # the 16 GB tier fits
    assert not any(r["fits"] for r in before.macs if r["ram_gb"] == 16)
    lines = describe(both)
    assert "int8 8.4 GiB (published, held alone)" in lines[1] and "int4 4.4 GiB (published, held alone)" in lines[1]
    assert "int8" not in describe(before)[1]
    assert [line for line in lines if line.startswith("16 GB Mac, int4")]
    only8 = plan(LFM2_5_8B_A1B, **SHAPE, published=("int8",))
    assert set(only8.weights) == {"bf16", "int8"} and only8.weights["int8"] == both.weights["int8"]


# -- the daemon config's plane override ----------------------------------------------------------


def _run(plane: str = "bf16", planes: tuple[str, ...] = ()) -> RunManifest:
    return RunManifest(run="r", model="m", task="t", plane=plane, planes=planes)  # type: ignore[arg-type]


def test_a_plane_override_respects_the_runs_planes() -> None:
    assert cfg.plane_override(_run(), "bf16") == "bf16"
    with pytest.raises(ValueError, match="does not publish the int8 plane"):  # its records would be refused
        cfg.plane_override(_run(), "int8")
    assert cfg.plane_override(_run(planes=("int8",)), "int8") == "int8"
    assert cfg.plane_override(_run("int8"), "int8") == "int8"  # the run's own plane: quantized here
    assert cfg.plane_override(_run(planes=("int4",)), "int4") == "int4"
    with pytest.raises(ValueError, match="does not publish the int4 plane"):
        cfg.plane_override(_run(planes=("int8",)), "int4")
    with pytest.raises(ValueError, match="serves int8; serve it on that plane or a smaller one"):
        cfg.plane_override(_run("int8"), "bf16")
    with pytest.raises(ValueError, match="plane must be one of"):
        cfg.plane_override(_run(), "fp8")


def test_the_daemon_config_keeps_a_checked_plane(tmp_path) -> None:  # type: ignore[no-untyped-def]
    base = dict(store=f"file://{tmp_path}", run="r", name="mac", worker_id="mac-1", data_dir=tmp_path, batch=2)
    assert "plane" not in cfg.DaemonConfig(**base).to_dict()  # empty: picked for this Mac
    config = cfg.DaemonConfig(**base, plane="int4")
    assert cfg.DaemonConfig.from_dict(config.to_dict()).plane == "int4"
    with pytest.raises(ValueError, match="plane must be one of"):
        cfg.DaemonConfig(**base, plane="int2")
    info = cfg.RunInfo(manifest=_run(planes=("int8", "int4")), version=3, elements=8_470_000_000,
                       model_config=LFM2_5_8B_A1B)
    assert "  plane        int4 (this config's `plane`)" in plan_lines(config, info, 64 * GIB, device="gpu")
