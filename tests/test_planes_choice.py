"""Which plane a Mac serves a run on: the run's when it fits, else a smaller one the run publishes."""

from __future__ import annotations

from pathlib import Path

import pytest

from macd import config as cfg
from macd.join_cmd import plan_lines
from macd.memory_plan import GIB, HELD_BYTES, LFM2_5_8B_A1B
from macd.plane_choice import choose_plane, weights_bytes
from slime_stoa.protocol.run_manifest import RunManifest


def run(plane: str = "bf16", planes: tuple[str, ...] = ()) -> RunManifest:
    return RunManifest(run="r", model="m", task="t", plane=plane, planes=planes, max_prompt_tokens=1024, max_tokens=1024)  # type: ignore[arg-type]


def test_a_quantized_plane_is_planned_only_where_published_and_held_alone() -> None:
    here, published = weights_bytes(LFM2_5_8B_A1B, run()), weights_bytes(LFM2_5_8B_A1B, run(planes=("int8", "int4")))
    assert here.keys() == {"bf16"} and published.keys() == {"bf16", "int8", "int4"}  # no other plane's records are taken
    assert here["bf16"] == published["bf16"]
    own = weights_bytes(LFM2_5_8B_A1B, run("int8"))  # int8 the run's own plane, unpublished: quantized here
    assert own.keys() == {"bf16", "int8"} and own["int8"] == own["bf16"] + published["int8"]  # beside the master
    assert 23 * GIB < own["int8"] < 25 * GIB  # ~3.06 bytes a weight: fits neither 16 nor 24 GB Macs
    assert choose_plane(LFM2_5_8B_A1B, run("int8"), memory=64 * GIB, sequences=16, device="gpu").plane == "int8"  # type: ignore[union-attr]
    assert published["int4"] < published["int8"] < 0.6 * published["bf16"]
    assert HELD_BYTES["int8"] == 1 + 4 / 64


@pytest.mark.parametrize(
    ("gb", "planes", "expected"),
    [
        (64, ("int8", "int4"), "bf16"),  # the run's plane fits: never a smaller one
        (24, ("int8", "int4"), "int8"),
        (16, ("int8", "int4"), "int8"),
        (16, ("int4",), "int4"),  # int8 not published: not a choice
        (24, (), "bf16"),  # nothing smaller that fits: the run's plane (the plan warns)
    ],
)
def test_the_largest_plane_that_fits_no_larger_than_the_runs(gb: int, planes: tuple[str, ...], expected: str) -> None:
    choice = choose_plane(LFM2_5_8B_A1B, run(planes=planes), memory=gb * GIB, sequences=16, device="gpu")
    assert choice is not None and choice.plane == expected
    assert choice.held == (expected in planes) and choice.fits == (expected != "bf16" or gb == 64)
    assert expected in choice.describe()


def test_a_run_on_int8_is_never_served_on_bf16() -> None:
    choice = choose_plane(LFM2_5_8B_A1B, run("int8", ("int8",)), memory=128 * GIB, sequences=16, device="gpu")
    assert choice is not None and choice.plane == "int8" and choice.held and choice.fits
    tight = choose_plane(LFM2_5_8B_A1B, run("int8", ("int8",)), memory=8 * GIB, sequences=16, device="gpu")
    assert tight is not None and tight.plane == "int8" and not tight.fits
    assert choose_plane({"hidden_size": 8}, run(), memory=GIB, sequences=1) is None


def test_join_says_which_plane_this_mac_serves(tmp_path: Path) -> None:
    config = cfg.DaemonConfig(store=f"file://{tmp_path}", run="r", name="mac", worker_id="mac-1", data_dir=tmp_path, batch=2)
    manifest = run(planes=("int8", "int4"))
    info = cfg.RunInfo(manifest=manifest, version=3, elements=8_470_000_000, model_config=LFM2_5_8B_A1B)
    assert "  plane        int8 (the run's published plane, held alone): " in "\n".join(plan_lines(config, info, 24 * GIB, device="gpu"))
    assert "  plane        bf16 (the bf16 weights): " in "\n".join(plan_lines(config, info, 64 * GIB, device="gpu"))
    plain = cfg.RunInfo(manifest=run(), version=3, elements=8_470_000_000, model_config=LFM2_5_8B_A1B)
    assert not any(line.startswith("  plane ") for line in plan_lines(config, plain, 24 * GIB))  # no planes: the run's


def test_a_cpu_worker_plans_its_float32_copies_and_cache() -> None:
    """On MLX's CPU device the bf16 plane also holds float32 copies of its matmul weights and a
    float32 cache (`memory_plan`'s device terms): more bytes than on a Mac's GPU, all of RAM usable."""
    gpu = choose_plane(LFM2_5_8B_A1B, run(), memory=128 * GIB, sequences=16, device="gpu")
    cpu = choose_plane(LFM2_5_8B_A1B, run(), memory=128 * GIB, sequences=16, device="cpu")
    assert gpu is not None and cpu is not None and gpu.plane == cpu.plane == "bf16"
    assert cpu.needed > 2.5 * gpu.needed  # 6 bytes a matmul weight instead of 2, and a float32 cache
    assert cpu.usable == 128 * GIB > gpu.usable

