"""transformers 5's rotary keys reach mlx-lm: a worker computes the positions the trainer does."""

import json

import pytest

pytest.importorskip("mlx_lm")

from macd.generate import build_model
from macd.hf_config import mlx_overrides
from slime_stoa.quickstart.seeding import tiny_synthetic_model


def test_rope_parameters_are_spelled_as_mlx_lm_reads_them() -> None:
    assert mlx_overrides({"rope_parameters": {"rope_theta": 100000, "rope_type": "default"}}) == {"rope_theta": 100000.0}
    scaled = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}
    assert mlx_overrides(scaled) == {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    # the old spelling wins where both are given; a config without either is left alone
    assert mlx_overrides({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 1e6}}) == {}
    assert mlx_overrides({"hidden_size": 8}) == {}
    nested = mlx_overrides({"text_config": {"hidden_size": 8, "rope_parameters": {"rope_theta": 1e6}}})
    assert nested == {"text_config": {"hidden_size": 8, "rope_parameters": {"rope_theta": 1e6}, "rope_theta": 1e6}}


def test_a_worker_model_takes_the_theta_of_a_transformers_5_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_synthetic_model(tmp_path / "model", "llama")
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_theta", None)
    config["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "default"}
    (folder / "config.json").write_text(json.dumps(config))
    model, _ = build_model(folder)
    assert model.args.rope_theta == 100000.0  # mlx-lm's default would be 10,000
