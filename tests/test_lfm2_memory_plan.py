"""macd.memory_plan: the worker's memory for LFM2.5-8B-A1B on 16/24/32/64 GB Macs, a pure function."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from macd.memory_plan import GIB, LFM2_5_8B_A1B, describe, param_count, plan, usable_bytes


@pytest.mark.parametrize("moe", [False, True], ids=["lfm2", "lfm2_moe"])
def test_parameter_count_is_the_checkpoints(tmp_path: Path, moe: bool) -> None:
    pytest.importorskip("tokenizers")
    from slime_stoa.protocol.hf.safetensors_io import read_safetensors
    from slime_stoa.quickstart.tiny_model import build_tiny_lfm2

    folder = build_tiny_lfm2(tmp_path, moe=moe)
    config = json.loads((folder / "config.json").read_text())
    stored = sum(a.size for _, a in read_safetensors(folder / "model.safetensors").values())
    assert param_count(config).total == stored


def test_lfm2_5_8b_a1b_on_macs() -> None:
    counts = param_count(LFM2_5_8B_A1B)
    assert 8.4e9 < counts.total < 8.5e9  # 8.3B published without the 128k vocabulary's growth
    p = plan(LFM2_5_8B_A1B, group_size=8, groups=2, prompt_tokens=512, response_tokens=1536, run_plane="int8")
    assert p.weights["bf16"] == 2 * counts.total and p.weights["int8"] > p.weights["bf16"]  # int8 here keeps the master
    # KV only for the 6 attention layers (8 KV heads x 64, K and V, bf16); conv state for the 18 conv layers
    assert p.kv_bytes_per_token == 6 * 2 * 8 * 64 * 2 and p.conv_bytes_per_sequence == 18 * 2 * 2048 * 2
    assert p.cache == 16 * (p.kv_bytes_per_token * 2048 + p.conv_bytes_per_sequence)
    verdicts = {(r["ram_gb"], r["plane"]): r["fits"] for r in p.macs}
    assert verdicts == {(16, "bf16"): False, (16, "int8"): False, (24, "bf16"): False, (24, "int8"): False,
                        (32, "bf16"): True, (32, "int8"): False, (64, "bf16"): True, (64, "int8"): True}
    row24 = next(r for r in p.macs if (r["ram_gb"], r["plane"]) == (24, "bf16"))
    assert 0 < row24["max_sequences"] < 16  # a 24 GB Mac holds the weights but not this run's batch
    assert len(describe(p)) == 3 + len(p.macs)  # the device, the terms, a row per (RAM, plane)


def test_cache_terms_follow_the_run_shape() -> None:
    base = plan(LFM2_5_8B_A1B, group_size=4, prompt_tokens=100, response_tokens=100)
    assert base.cache == 4 * (base.kv_bytes_per_token * 256 + base.conv_bytes_per_sequence)  # 256-token steps
    longer = plan(LFM2_5_8B_A1B, group_size=4, prompt_tokens=100, response_tokens=300)
    assert longer.cache - base.cache == 4 * base.kv_bytes_per_token * 256  # conv state does not grow
    more = plan(LFM2_5_8B_A1B, group_size=4, groups=3, prompt_tokens=100, response_tokens=100)
    assert more.cache == 3 * base.cache
    indexed = plan(LFM2_5_8B_A1B, group_size=4, prompt_tokens=100, response_tokens=100, index_bytes=2 * GIB)
    assert indexed.total("bf16") == base.total("bf16") + 2 * GIB
    attention_only = dict(LFM2_5_8B_A1B, layer_types=["full_attention"] * 24)
    assert plan(attention_only, group_size=4, prompt_tokens=100, response_tokens=100).kv_bytes_per_token == 4 * base.kv_bytes_per_token
    assert usable_bytes(16) == int(16 * GIB * 2 / 3) and usable_bytes(64) == 48 * GIB
    mac = plan(LFM2_5_8B_A1B, group_size=4, prompt_tokens=100, response_tokens=100, mac_sizes_gb=(24,), usable={24: 20 * GIB})
    assert {r["usable_bytes"] for r in mac.macs} == {20 * GIB}
    with pytest.raises(ValueError):
        plan(LFM2_5_8B_A1B, group_size=0, prompt_tokens=1, response_tokens=1)
