"""scripts/check_model_family.py: the family check on a tiny random LFM2-MoE, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent


def test_check_model_family_lfm2_moe(tmp_path: Path) -> None:
    out = tmp_path / "lfm2_moe.json"
    env = {**os.environ, "MLX_DISABLE_COMPILE": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_model_family.py"), "--family", "lfm2_moe", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=180, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    assert result["family"] == result["model_type"] == "lfm2_moe" and result["pass"] and not result["errors"]
    assert {"conv", "full_attention"} <= set(result["layer_types"])
    for key, tolerance in result["tolerances"].items():
        assert result[key] is not None and 0 <= result[key] <= tolerance, key
    assert {"mlx_vs_torch_max_logprob_diff_f32", "mlx_padded_vs_single_max_logprob_diff_f32",
            "mlx_episode_vs_full_prefix_max_logprob_diff_f32", "moe_routing_vs_hf_max_weight_diff_f32"} <= set(result["tolerances"])
    assert result["episode_tool_calls"] > 0
    # the conversion round trip always runs; the Megatron forward where megatron-core is installed
    assert result["hf_megatron_hf_max_abs_diff"] == 0.0
    assert result["megatron_forward"] in ("ran", "megatron-core not installed")
    if result["megatron_forward"] == "ran":
        assert "megatron_vs_hf_max_logit_diff_f32" in result["tolerances"]
    else:
        assert result["megatron_vs_hf_max_logit_diff_f32"] is None
