"""The slime stand-ins the rollout tests run against match slime's real types: field names,
order and defaults of `Sample`, its `Status` values, and the rollout output types' fields. Runs
whenever slime is importable (a trainer box); the stand-in `Sample` itself refuses fields slime's
does not have, so every rollout test checks stoa's field dicts against slime's names."""

from __future__ import annotations

import dataclasses

import pytest

from tests import slime_standins


def _defaults(cls: type) -> dict[str, object]:
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_the_stand_in_sample_refuses_a_field_slime_does_not_have() -> None:
    with pytest.raises(TypeError):
        slime_standins.Sample(prompt="p", stoa_weight_version=3)  # type: ignore[call-arg]
    sample = slime_standins.Sample(prompt="p", status=slime_standins.Sample.Status("truncated"))
    assert sample.status is slime_standins.Sample.Status.TRUNCATED and sample.group_index is None


def test_the_stand_ins_match_slimes_real_types() -> None:
    real_types = pytest.importorskip("slime.utils.types", reason="slime is not installed here")
    base_types = pytest.importorskip("slime.rollout.base_types")
    real, stand_in = real_types.Sample, slime_standins.Sample
    assert [f.name for f in dataclasses.fields(real)] == [f.name for f in dataclasses.fields(stand_in)]
    plain = {k: v for k, v in _defaults(stand_in).items() if k not in ("spec_info", "prefix_cache_info")}
    real_defaults = _defaults(real)
    assert {k: real_defaults[k] for k in plain if k != "status"} == {k: v for k, v in plain.items() if k != "status"}
    assert real_defaults["status"].value == plain["status"].value  # type: ignore[attr-defined]
    assert {s.name: s.value for s in real.Status} == {s.name: s.value for s in stand_in.Status}
    train = base_types.RolloutFnTrainOutput(samples=[[real()]])
    assert train.metrics is None and slime_standins.rollout_fn_train_output([[real()]]).metrics is None
    assert [f.name for f in dataclasses.fields(base_types.RolloutFnTrainOutput)] == ["samples", "metrics"]
    assert [f.name for f in dataclasses.fields(base_types.RolloutFnEvalOutput)] == ["data", "metrics"]
