"""macd.memory_plan sizes dense LFM2's MLP as transformers builds it, with `Lfm2Config`'s defaults
for the keys a config.json leaves out and the original configs' `block_ff_dim`: the parameter count
is transformers' own model's, built on the meta device from the same config."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from macd.memory_plan import _dense_ff, param_count

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BASE = {
    "model_type": "lfm2", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "layer_types": ["conv", "full_attention", "conv"], "conv_L_cache": 3,
    "tie_word_embeddings": True,
}

# (config beyond BASE, the width transformers builds)
CASES: dict[str, tuple[dict[str, Any], int]] = {
    "no block keys": ({"intermediate_size": 192}, 256),  # 2/3 of 192 = 128, rounded up to 256
    "no width at all": ({}, 8192),  # Lfm2Config's intermediate_size 12288
    "all keys": ({"intermediate_size": 192, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
                  "block_multiple_of": 256}, 256),
    "no adjustment": ({"intermediate_size": 192, "block_auto_adjust_ff_dim": False}, 192),
    "multiplier and multiple": ({"intermediate_size": 300, "block_ffn_dim_multiplier": 1.5, "block_multiple_of": 64},
                                320),
    "original block_ff_dim": ({"block_ff_dim": 384, "block_multiple_of": 32}, 256),
    "block_ff_dim wins": ({"block_ff_dim": 96, "intermediate_size": 4096, "block_auto_adjust_ff_dim": False}, 96),
}


def _transformers_model(config: dict[str, Any]) -> Any:
    hf = transformers.Lfm2Config(**{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):  # shapes only
        return transformers.Lfm2ForCausalLM(hf)


@pytest.mark.parametrize("case", list(CASES))
def test_dense_lfm2_width_and_parameters_are_transformers(case: str) -> None:
    extra, width = CASES[case]
    config = {**BASE, **extra}
    model = _transformers_model(config)
    assert model.model.layers[0].feed_forward.w1.out_features == width  # the case states transformers' width
    assert _dense_ff(config) == width
    assert param_count(config).total == sum(p.numel() for p in model.parameters())


def test_other_families_take_intermediate_size_as_it_is() -> None:
    for model_type in ("lfm2_moe", "qwen2"):
        assert _dense_ff({"model_type": model_type, "intermediate_size": 192, "block_auto_adjust_ff_dim": True}) == 192


def test_a_null_multiplier_skips_the_rounding_as_lfm2mlp_does() -> None:
    """`Lfm2MLP` skips the multiplier and the rounding when it is None (this transformers' config
    class refuses a null one; older ones took it): the module, given such a config, is the reference."""
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    config = {**BASE, "intermediate_size": 200, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": None,
              "block_multiple_of": 256}
    with torch.device("meta"):
        width = Lfm2MLP(SimpleNamespace(**config)).w1.out_features  # type: ignore[arg-type]
    assert _dense_ff(config) == width == 133


@pytest.mark.parametrize("absurd", [
    {"block_ffn_dim_multiplier": 1e308, "intermediate_size": 192},  # int(inf)
    {"hidden_size": 10**400},  # too large for a float
    {"vocab_size": 1e308, "intermediate_size": 192},
])
def test_an_absurd_config_gives_no_plan_and_no_crash(absurd: dict[str, Any]) -> None:
    """A config.json from the bucket with sizes no model has: no plan (the run's plane is served),
    never an exception out of join, doctor or the worker's plane choice."""
    from macd.memory_plan import config_plan
    from macd.plane_choice import choose_plane
    from slime_stoa.protocol.run_manifest import RunManifest

    config = {**BASE, **absurd}
    assert config_plan(config, group_size=8, prompt_tokens=64, response_tokens=64) is None
    manifest = RunManifest(run="r", model="m", task="t", planes=("int8",))
    assert choose_plane(config, manifest, memory=16 << 30, sequences=8) is None
