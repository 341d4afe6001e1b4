"""The plugin's settings: one `StoaSettings`, read from slime's args by walking its fields."""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from pathlib import Path
from typing import Literal, get_type_hints

import pytest

from slime_stoa.protocol.pulse.publisher import PublisherConfig
from slime_stoa.trainer.consumer.config import ConsumerConfig
from slime_stoa.trainer.loss_config import DPPOConfig
from slime_stoa.trainer.slime import loss, settings
from slime_stoa.trainer.slime.settings import StoaSettings, settings_from_args
from slime_stoa.trainer.slime.settings_parsers import parser_for
from slime_stoa.trainer.slime.settings_walk import Section, read

# Every key users set: renaming one would silently ignore it in existing YAML files.
KEYS = {
    "stoa_bucket", "stoa_run", "stoa_rollouts_bucket", "stoa_run_key", "stoa_tokenizer_dir", "stoa_state_in_bucket",
    "stoa_check_publishing", "stoa_publish_grace_s", "stoa_worker_metrics", "stoa_eval_prompts",
    "stoa_staleness_limit", "stoa_reuse_limit", "stoa_wait_timeout_s", "stoa_poll_interval_s", "stoa_skew_window_ms",
    "stoa_sweep_interval_s", "stoa_late_window_ms", "stoa_late_sweep_interval_s", "stoa_download_concurrency", "stoa_download_deadline_s",
    "stoa_max_download_attempts", "stoa_filter_all_equal", "stoa_verify_prompts", "stoa_reward_tolerance",
    "stoa_quarantine_enabled", "stoa_quarantine_min_samples", "stoa_quarantine_window_samples",
    "stoa_quarantine_max_disagreement_rate", "stoa_quarantine_min_gap_tokens", "stoa_quarantine_window_tokens",
    "stoa_quarantine_max_logprob_gap", "stoa_quarantine_max_gap_ratio", "stoa_quarantine_gap_floor",
    "stoa_quarantine_canary_strikes", "stoa_quarantine_int8_gap_allowance", "stoa_quarantine_int4_gap_allowance",
    "stoa_canary_rate", "stoa_canary_key_file", "stoa_canary_max_logprob_gap",
    "stoa_canary_min_format_rate", "stoa_admission_order", "stoa_max_pool_groups", "stoa_prefetch_groups",
    "stoa_version_ahead_slack", "stoa_progress_interval_s", "stoa_store_retry_max_delay_s", "stoa_registry_refresh_s", "stoa_keep_dir",
    "stoa_publish", "stoa_publish_retries", "stoa_publish_backoff_s", "stoa_background_publish", "stoa_device_budget_bytes",
    "stoa_anchor_every", "stoa_anchor_fraction", "stoa_catchup", "stoa_catchup_budget",
    "stoa_frame_bytes", "stoa_shard_bytes",
    "stoa_retain_anchors", "stoa_retain_versions", "stoa_extras_dir", "stoa_concurrency", "stoa_threads",
    "stoa_planes", "stoa_model_type",
    "dppo_delta_low", "dppo_delta_high", "dppo_ratio_cap", "dppo_dual_clip", "dppo_eps_clip", "dppo_eps_clip_high",
    "dppo_reduction", "dppo_drgrpo_max_len",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Example:
    count: int = 1
    rate: float = 0.5
    on: bool = True
    mode: Literal["a", "b"] = "a"
    limit: int | None = None
    folder: Path | None = None


def test_parsers_follow_the_field_types() -> None:
    parsers = {name: parser_for(hint) for name, hint in get_type_hints(_Example).items()}
    assert parsers["count"]("k", "3") == 3 and parsers["rate"]("k", 2) == 2.0
    assert parsers["on"]("k", "off") is False and parsers["mode"]("k", "b") == "b"
    assert parsers["limit"]("k", None) is None and parsers["limit"]("k", 4.0) == 4
    assert parsers["folder"]("k", "") is None and parsers["folder"]("k", "~/x") == Path("~/x").expanduser()
    for name, bad in [("count", 1.5), ("on", "maybe"), ("mode", ""), ("limit", True)]:
        with pytest.raises(ValueError, match="k must be"):
            parsers[name]("k", bad)
    assert parser_for(dict[str, int]) is None


def test_every_key_users_set_is_still_read() -> None:
    assert StoaSettings.keys() == KEYS
    from slime_stoa.trainer.slime.preflight import known_settings

    assert known_settings() == KEYS


def test_a_yaml_spelling_out_every_default_gives_the_defaults_back() -> None:
    defaults = StoaSettings.from_args(Namespace(stoa_bucket="file:///b", stoa_run="r"))
    assert defaults.consumer == ConsumerConfig(store_url="file:///b", run="r")
    assert defaults.publisher == PublisherConfig() and defaults.dppo == DPPOConfig(reduction="seq_mean")
    args = Namespace(stoa_bucket="file:///b", stoa_run="r")
    for leaf in settings.leaves():
        obj = defaults
        for name in leaf.path:
            obj = getattr(obj, name)
        if leaf.key not in ("stoa_bucket", "stoa_run") and obj is not None:
            setattr(args, leaf.key, obj)
    assert StoaSettings.from_args(args) == defaults


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
    min_records: int = 3
    cap: float | None = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
    quarantine: Inner = Inner()
    flat: bool = False


def test_nested_dataclasses_are_keys_with_their_field_name_as_prefix() -> None:
    keys = {leaf.key for leaf in settings.leaves(Outer, Section(prefix="stoa_"))}
    assert keys == {"stoa_quarantine_min_records", "stoa_quarantine_cap", "stoa_flat"}
    args = Namespace(stoa_quarantine_min_records="5", stoa_quarantine_cap=None, stoa_flat="yes")
    values, errors = read(Outer, args, Section(prefix="stoa_"))
    assert not errors and values == {"quarantine": Inner(min_records=5, cap=None), "flat": True}
    values, _ = read(Outer, args, Section(prefix="stoa_", null_is_default=True))
    assert values["quarantine"] == Inner(min_records=5)  # null keeps the default
    _, errors = read(Outer, Namespace(stoa_quarantine_min_records=1.5), Section(prefix="stoa_"))
    assert [e.key for e in errors] == ["stoa_quarantine_min_records"]


def test_errors_name_the_key() -> None:
    base = {"stoa_bucket": "file:///b", "stoa_run": "r"}
    for extra, key in [
        ({"stoa_staleness_limit": -1}, "stoa_staleness_limit"),
        ({"stoa_quarantine_min_samples": -1}, "stoa_quarantine_min_samples"),
        ({"stoa_catchup_budget": -1}, "stoa_catchup_budget"),
        ({"stoa_publish_retries": -1}, "stoa_publish_retries"),
        ({"dppo_eps_clip_high": 0.3}, "dppo_eps_clip_high"),
        ({"stoa_bucket": "ftp://x"}, "stoa_bucket"),
    ]:
        with pytest.raises(settings.SettingError, match=f"^{key}") as info:
            StoaSettings.from_args(Namespace(**{**base, **extra}))
        assert info.value.key == key
    with pytest.raises(ValueError, match="needs the setting 'stoa_run'"):
        StoaSettings.from_args(Namespace(stoa_bucket="file:///b"))
    errors = StoaSettings.check(Namespace(stoa_run="r", stoa_anchor_every=0, dppo_delta_low=-1))
    assert [(e.part, e.key) for e in errors] == [
        ("shared", "stoa_bucket"), ("publisher", "stoa_anchor_every"), ("loss", "dppo_delta_low"),
    ]


def test_defaults_derived_from_slime_flags(tmp_path: Path) -> None:
    args = Namespace(
        stoa_bucket="file:///b", stoa_run="r", hf_checkpoint=str(tmp_path), use_wandb=True,
        dppo_reduction="drgrpo", rollout_max_response_len=64,
    )
    got = StoaSettings.from_args(args)
    assert got.publisher.extras_dir == tmp_path and got.worker_metrics is True and got.dppo.drgrpo_max_len == 64
    args.stoa_extras_dir, args.stoa_worker_metrics = "", False
    got = StoaSettings.from_args(args)
    assert got.publisher.extras_dir is None and got.worker_metrics is False


def test_the_trainers_copies_default_to_beside_slimes_checkpoints(tmp_path: Path) -> None:
    """Both the rollout's consumer and rank 0's publisher keep their copies under `--save`
    unless told otherwise; a YAML null means the same to both, `""` means no copies."""
    base = {"stoa_bucket": "file:///b", "stoa_run": "r"}
    got = StoaSettings.from_args(Namespace(**base, save=str(tmp_path)))
    assert got.consumer.keep_dir == str(tmp_path / "stoa-kept") and got.publisher.keep_dir == tmp_path / "stoa-kept"
    got = StoaSettings.from_args(Namespace(**base, save=str(tmp_path), stoa_keep_dir=None))
    assert got.consumer.keep_dir == str(tmp_path / "stoa-kept") and got.publisher.keep_dir == tmp_path / "stoa-kept"
    got = StoaSettings.from_args(Namespace(**base, save=str(tmp_path), stoa_keep_dir="/mine"))
    assert got.consumer.keep_dir == "/mine" and got.publisher.keep_dir == Path("/mine")
    for args in (Namespace(**base, save=str(tmp_path), stoa_keep_dir=""), Namespace(**base)):
        got = StoaSettings.from_args(args)
        assert got.consumer.keep_dir is None and got.publisher.keep_dir is None


def test_parsed_once_while_the_settings_stay_the_same() -> None:
    args = Namespace(stoa_bucket="file:///b", stoa_run="r", calculate_per_token_loss=True)
    first = settings_from_args(args)
    assert settings_from_args(Namespace(**vars(args))) is first
    args.stoa_staleness_limit = 3
    assert settings_from_args(args) is not first and settings_from_args(args).consumer.staleness_limit == 3
    dppo = loss.config_from_args(args)
    assert loss.config_from_args(args) is dppo  # not parsed again for every micro-batch
    args.dppo_delta_low = 0.1
    assert loss.config_from_args(args).delta_low == 0.1


def test_the_plugins_own_fields_carry_their_help_and_the_table_shows_it() -> None:
    """One form: every StoaSettings field is a `setting` whose help (metadata, not a docstring) is
    the meaning column of its key in the reference table."""
    import dataclasses

    from slime_stoa.protocol.cli_fields import help_of

    own = {f.name: help_of(f) for f in dataclasses.fields(settings.StoaSettings)}
    assert all(own.values()), [name for name, text in own.items() if not text]
    rows = {leaf.key: leaf.doc for leaf in settings.leaves()}
    assert rows["stoa_device_budget_bytes"] == " ".join(own["device_budget_bytes"].split())
    assert rows["stoa_bucket"].startswith("Required: the store URL of the run's bucket")


def test_every_key_of_the_nested_configs_is_a_setting_with_its_help() -> None:
    """One form for the nested configs too: each field a `setting` whose help is the meaning
    column of its key (a field documented otherwise would show an empty meaning)."""
    from slime_stoa.protocol.cli_fields import help_of
    from slime_stoa.trainer.consumer.canary import CanaryConfig
    from slime_stoa.trainer.consumer.quarantine import QuarantineConfig

    for cls in (ConsumerConfig, QuarantineConfig, CanaryConfig, PublisherConfig, DPPOConfig):
        assert all(help_of(f) for f in dataclasses.fields(cls)), cls
    rows = {leaf.key: leaf.doc for leaf in settings.leaves()}
    assert all(rows.values()), [key for key, doc in rows.items() if not doc]
    assert rows["stoa_quarantine_min_samples"] == " ".join(help_of(
        next(f for f in dataclasses.fields(QuarantineConfig) if f.name == "min_samples")).split())
    assert rows["dppo_reduction"] == '"token_mean", "seq_mean" or "drgrpo"; see `reduce_per_token`.'
