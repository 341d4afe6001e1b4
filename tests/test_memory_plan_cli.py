"""The memory plan in `macd doctor --plan-for` and in `macd join`'s report (`macd.memory_plan`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from macd import config as cfg
from macd.cli import main as macd
from macd.join_cmd import plan_lines
from macd.memory_plan import GIB, LFM2_5_8B_A1B, this_mac
from slime_stoa.protocol.run_manifest import RunManifest


def test_this_mac_warns_only_when_the_runs_plane_does_not_fit() -> None:
    shape = {"group_size": 16, "groups": 1, "prompt_tokens": 512, "response_tokens": 1536}
    lines, warning = this_mac(LFM2_5_8B_A1B, memory=24 * GIB, plane="bf16", **shape)
    assert lines[0].startswith("device: the GPU (Metal)")
    assert lines[1].endswith("model: 8.47B parameters; weights bf16 15.8 GiB")  # no plane the run does not publish
    assert "this Mac, bf16: needs 16.3 of 16.0 GiB usable: fits only 2 sequences (the run's plane)" in lines
    assert warning is not None and "at most 2 sequences" in warning
    assert this_mac(LFM2_5_8B_A1B, memory=64 * GIB, plane="bf16", **shape)[1] is None
    _, too_small = this_mac(LFM2_5_8B_A1B, memory=8 * GIB, plane="int8", published=("int8",), **shape)
    assert too_small is not None and "weights alone do not fit" in too_small
    assert this_mac({"model_type": "x"}, memory=GIB, plane="bf16", **shape) == ([], None)  # no sizes: no plan


def test_doctor_plan_for_macs(capsys: pytest.CaptureFixture[str]) -> None:
    assert macd(["doctor", "--plan-for", "16,24,32,64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "memory plan of LFM2.5-8B-A1B: 2 prompts x 8 samples, 512 + 1536 tokens"
    verdicts = {line.split(":")[0].strip(): line.rsplit(": ", 1)[1] for line in out if "GB Mac" in line}
    assert verdicts == {  # bf16 only: the quantized planes are planned where published (--plan-planes)
        "16 GB Mac, bf16": "does not fit", "24 GB Mac, bf16": "fits only 2 sequences",
        "32 GB Mac, bf16": "fits", "64 GB Mac, bf16": "fits",
    }
    assert macd(["doctor", "--plan-for", "16,x"]) == 1
    assert macd(["doctor", "--plan-for", "16", "--plan-batch", "0"]) == 1
    err = capsys.readouterr().err
    assert "--plan-for '16,x': expected memory sizes in GB" in err and "--plan-batch must be 1 or more" in err


def test_the_reference_run_fits_16_and_24_gb_macs_on_its_published_planes_beside_a_16m_index(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The reference run's shape: LFM2.5-8B-A1B on the int8/int4 planes it publishes, held alone,
    beside the compact index of 16M PubMed abstracts (~2.9 GiB counted: postings, term and block
    tables, norms and one query's working memory, projected by scripts/bench_retriever.py)."""
    assert macd(["doctor", "--plan-for", "16,24", "--plan-planes", "int8,int4", "--plan-index-gb", "2.9"]) == 0
    out = capsys.readouterr().out.splitlines()
    verdicts = {line.split(":")[0].strip(): line.split(": ", 1)[1] for line in out if "GB Mac" in line}
    assert verdicts["16 GB Mac, int4"] == "needs 7.9 of 10.7 GiB usable: fits"
    assert verdicts["24 GB Mac, int8"] == "needs 11.8 of 16.0 GiB usable: fits"
    assert verdicts["16 GB Mac, int8"].endswith("does not fit")
    assert macd(["doctor", "--plan-for", "16", "--plan-planes", "int3"]) == 1
    assert "int3 is not a quantized plane (int8, int4)" in capsys.readouterr().err


def test_join_reports_the_plan_of_the_runs_model(tmp_path: Path) -> None:
    config = cfg.DaemonConfig(store=f"file://{tmp_path}", run="r", name="mac", worker_id="mac-1", data_dir=tmp_path, batch=2)
    manifest = RunManifest(run="r", model="LiquidAI/LFM2.5-8B-A1B", task="synthetic", group_size=8, max_tokens=1536,
                           max_prompt_tokens=512)
    info = cfg.RunInfo(manifest=manifest, version=3, elements=8_470_000_000, model_config=LFM2_5_8B_A1B)
    small = plan_lines(config, info, 24 * GIB, device="gpu")
    assert small[small.index("  memory plan  device: the GPU (Metal): bf16 weights, KV cache and activations") + 1].strip().startswith(
        "model: 8.47B parameters")
    assert small[-1].startswith("warning: the run's model does not fit this Mac's usable memory on the bf16 plane")
    assert not plan_lines(config, info, 64 * GIB, device="gpu")[-1].startswith("warning")
    unknown = plan_lines(config, cfg.RunInfo(manifest=manifest), 64 * GIB)
    assert "  memory plan  unknown until the model's config.json is published" in unknown
