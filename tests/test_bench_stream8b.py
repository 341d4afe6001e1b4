"""The streamed weight-plane benchmark at the LFM2.5-8B-A1B shape: its plan covers the model, its
smoke size runs to the end, checks its own results and writes the keys its report is built from."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.scripts_loader import load_script

bench = load_script("bench_stream8b")


def check_spread(s: dict[str, Any]) -> None:
    assert s["n"] >= 1
    assert all(math.isfinite(s[k]) for k in ("min", "median", "max"))
    assert 0 <= s["min"] <= s["median"] <= s["max"]


@pytest.mark.parametrize("shape", ["published", "defaults"])
def test_quick_plan_weights_sampled_layers_to_the_whole_model(shape: str) -> None:
    config = bench.config_of(shape)
    shapes = bench.param_shapes(config)
    units, layers = bench.plan_units(shapes, config, quick=True, batch_bytes=256 << 20)
    # the weighted sample counts every element of the model exactly once
    weighted = sum(u.weight * math.prod(shapes[n]) for u in units for n in u.names)
    assert weighted == sum(math.prod(s) for s in shapes.values())
    kinds = bench.layer_kinds(config)
    assert sorted({kinds[i] for i in layers}) == sorted(set(kinds)) and len(layers) == len(set(kinds))
    assert "model.embed_tokens.weight" in {n for u in units for n in u.names}
    full, every = bench.plan_units(shapes, config, quick=False, batch_bytes=256 << 20)
    assert sorted(n for u in full for n in u.names) == sorted(shapes) and {u.weight for u in full} == {1}
    assert every == list(range(int(config["num_hidden_layers"])))


def test_shapes_are_the_checkpoints() -> None:
    published = bench.param_shapes(bench.config_of("published"))
    assert published["model.embed_tokens.weight"] == (128000, 2048)
    assert published["model.layers.3.feed_forward.experts.31.w2.weight"] == (2048, 1792)
    assert "model.layers.1.feed_forward.w1.weight" in published  # dense layers 0 and 1
    assert "model.layers.2.self_attn.q_proj.weight" in published and "model.layers.0.conv.conv.weight" in published
    defaults = bench.param_shapes(bench.config_of("defaults"))
    assert defaults["model.embed_tokens.weight"] == (65536, 2048)
    assert "model.layers.31.self_attn.k_proj.weight" in defaults  # no layer types: all attention


def test_smoke_run_reports_bytes_times_and_memory(tmp_path: Path) -> None:
    out = tmp_path / "stream.json"
    assert bench.main(["--smoke", "--rounds", "2", "--threads", "1,2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["verified"] is True
    assert abs(doc["changed_fraction"] - 0.02) < 0.002
    b = doc["bytes_per_version"]
    for p in ("bf16_step_patch", "int8_plane_patch", "int4_plane_patch"):
        assert 0 < b[p] < 0.2 * b["anchor_bf16"], p
    assert b["anchor_int4"] < b["anchor_int8"] < b["anchor_bf16"] == 2 * doc["elements"]
    per_weight = doc["served_bytes_per_weight"]
    assert per_weight["bf16"] == 2 and 1.0 < per_weight["int8"] < 1.2 and 0.5 < per_weight["int4"] < 0.7
    for key in ("trainer_cpu_s_per_version", "trainer_wall_s_per_version", "worker_wall_s_per_version"):
        assert set(doc[key]) == {"1", "2"}
        for row in doc[key].values():
            for plane in ("bf16", "int8", "int4"):
                check_spread(row[plane])
                assert row[plane]["n"] == 2
    assert "quantize" in doc["trainer_cpu_s_per_version"]["1"]["parts"]["int8"]
    rates = doc["cpu_ns_per_element"]["trainer"]["1"]
    assert rates["int8"] == pytest.approx(1e9 * doc["trainer_cpu_s_per_version"]["1"]["int8"]["median"] / doc["elements"])
    assert set(doc["worker_wall_s_per_version"]["1"]["parts"]["bf16"]) == {"apply", "digest"}
    assert doc["peak_rss_bytes"] > 0 and math.isfinite(doc["load_average_start"])
    assert doc["plane_check"]["tensors"] > 0 and doc["plane_check"]["mismatched_arrays"] == 0
    for q in ("int8", "int4"):  # ~2% of elements touch 1 - 0.98^64 ~ 72% of the groups of 64
        assert 0.6 < doc["plane_update"][q]["groups_touched_fraction"] < 0.85
        assert 0 < doc["plane_update"][q]["whole_tensor_fraction"] <= 1
    assert doc["date"][:2] == "20"
    # the torch path, measured in the same rounds against the numpy baseline, checked bit for bit
    dev = doc["device_path"]
    assert doc["device"] == "cpu" and doc["device_check"]["mismatched"] == 0 and doc["device_check"]["deltas"] > 0
    for key in ("trainer_wall_s_per_version", "trainer_cpu_s_per_version"):
        assert set(dev[key]) == {"1", "2"}
        for row in dev[key].values():
            for plane in ("bf16", "int8", "int4"):
                check_spread(row[plane])
                assert row[plane]["n"] == 2
    assert set(dev["parts_wall_median"]["1"]["int4"]) == {"quantize", "digest", "encode", "sha256"}
    moved = dev["bytes_to_host_per_version"]
    assert moved["numpy"] == b["anchor_bf16"]  # every bf16 weight gathered to the host
    # the torch path hands over the patches and their old bits, and each changed tensor and its
    # plane arrays once for the digests (at 2% of the elements every tensor changes): more than
    # the bf16 state, less than it with both planes' arrays
    assert moved["numpy"] < moved["torch"] < 3 * moved["numpy"], moved


def test_plane_update_is_the_publishers_and_its_check_catches_a_wrong_array() -> None:
    config = bench.SMOKE
    shapes = bench.param_shapes(config)
    names = [n for n in shapes if bench.layer_of(n) == 1]
    prev = {n: bench.previous_bits(n, shapes[n], 0) for n in names}
    new = {n: bench.next_bits(n, prev[n], 0.005, 0) for n in names}  # few groups: the in-place path
    clock = bench.Clock()
    delta, _, _ = bench.publish_step(clock, prev, new, bench.StateDigest.of(prev), 1)
    changed = {n: idx for n, (idx, _) in delta.items()}
    groups, touched, elements, whole = bench.group_counts(delta, {n: shapes[n] for n in names}, "int4")
    assert 0 < touched < 0.5 * groups and whole == 0 and elements > 0
    plane = bench.updated_plane_bits(bench.plane_bits(prev, "int4", bench.MODEL_TYPE), new, changed, "int4", bench.MODEL_TYPE)
    assert bench.plane_mismatches(new, plane, names, "int4") == 0
    scales = next(k for k in plane if k.endswith(".scales"))
    plane[scales] = plane[scales].copy()
    plane[scales].reshape(-1)[0] ^= 1
    assert bench.plane_mismatches(new, plane, names, "int4") == 1
    assert set(clock.cpu) == {"diff", "digest", "encode", "sha256"}


def test_bad_flags_are_refused() -> None:
    for device in ("cuda:99", "nonsense", "meta"):  # cannot run: exits 2 before measuring anything
        assert bench.main(["--smoke", "--device", device]) == 2
    with pytest.raises(SystemExit):
        bench.parse_args(["--density", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--threads", "0"])


@pytest.mark.slow  # importing transformers takes seconds: python -m pytest --slow tests/test_bench_stream8b.py
def test_defaults_are_transformers_lfm2_moe_config() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Lfm2MoeConfig().to_dict()
    for key, value in bench.LFM2_MOE_DEFAULTS.items():
        assert config[key] == value, key
