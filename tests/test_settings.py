"""Plugin settings are derived from the config dataclasses, field by field, by type."""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from pathlib import Path
from typing import Literal

import pytest

from slime_stoa.protocol.pulse.publisher import PublisherConfig
from slime_stoa.trainer.consumer.config import ConsumerConfig
from slime_stoa.trainer.slime import publish, rollout
from slime_stoa.trainer.slime.settings import field_parsers


@dataclasses.dataclass(frozen=True)
class _Example:
    count: int = 1
    rate: float = 0.5
    on: bool = True
    mode: Literal["a", "b"] = "a"
    limit: int | None = None
    folder: Path | None = None


def test_parsers_follow_the_field_types() -> None:
    parsers = field_parsers(_Example)
    assert parsers["count"]("k", "3") == 3 and parsers["rate"]("k", 2) == 2.0
    assert parsers["on"]("k", "off") is False and parsers["mode"]("k", "b") == "b"
    assert parsers["limit"]("k", None) is None and parsers["limit"]("k", 4.0) == 4
    assert parsers["folder"]("k", "") is None and parsers["folder"]("k", "~/x") == Path("~/x").expanduser()
    for name, bad in [("count", 1.5), ("on", "maybe"), ("mode", ""), ("limit", True)]:
        with pytest.raises(ValueError, match="k must be"):
            parsers[name]("k", bad)


def test_a_field_of_an_unknown_type_is_a_programming_error() -> None:
    @dataclasses.dataclass
    class Odd:
        pairs: dict[str, int]

    with pytest.raises(AssertionError, match=r"Odd\.pairs"):
        field_parsers(Odd)
    assert field_parsers(Odd, exclude=("pairs",)) == {}


def test_every_config_field_is_a_setting_and_defaults_round_trip() -> None:
    """A YAML that spells out every default gives the default configs back."""
    consumer_defaults = ConsumerConfig(store_url="file:///b", run="r")
    args = Namespace(stoa_bucket="file:///b", stoa_run="r")
    for name in rollout.CONFIG_FIELDS:
        value = getattr(consumer_defaults, name)
        if value is not None:
            setattr(args, "stoa_" + name, value)
    assert rollout.config_from_args(args) == consumer_defaults
    # run_key comes from the run key file (stoa_run_key), rollouts_url from stoa_rollouts_bucket
    derived = {"store_url", "run", "record_limits", "run_key", "rollouts_url"}
    settable = {f.name for f in dataclasses.fields(ConsumerConfig)} - derived
    assert set(rollout.CONFIG_FIELDS) == settable
    assert {"rollouts_bucket", "run_key"} <= set(rollout.OTHER_SETTINGS)

    for name in publish.CONFIG_FIELDS:
        setattr(args, "stoa_" + name, getattr(PublisherConfig(), name))
    assert publish.publisher_config_from_args(args) == ("file:///b", "r", PublisherConfig())
    assert set(publish.CONFIG_FIELDS) == {f.name for f in dataclasses.fields(PublisherConfig)}
