"""`macd join`'s merge rule over its table of settings (`macd.join_settings`), as a pure function."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from macd.config import DaemonConfig
from macd.join_settings import JOIN_SETTINGS, Keep, Setting, merge_settings

TABLE = (
    Setting("name", Keep.ANY_RUN, lambda _: "host"),
    Setting("worker_id", Keep.SAME_RUN, lambda merged: f"{merged['name']}-new"),
    Setting("batch", Keep.ANY_RUN),
    Setting("plane", Keep.SAME_RUN),
    Setting("worker_key", Keep.SAME_WORKER),
)
OLD = {"name": "old-mac", "worker_id": "old-mac-1", "batch": 3, "plane": "int8", "worker_key": "k.json"}
NOT_GIVEN = dict.fromkeys(OLD)


def merged(given: dict[str, Any] | None = None, old: dict[str, Any] | None = OLD, *, same_run: bool) -> dict[str, Any]:
    return merge_settings(TABLE, {**NOT_GIVEN, **(given or {})}, old, same_run=same_run)


def test_a_first_join_takes_the_flags_then_the_defaults_and_leaves_the_rest_to_the_config() -> None:
    assert merged({"batch": 2}, old=None, same_run=False) == {"name": "host", "worker_id": "host-new", "batch": 2}
    # a default reads the settings merged above it: the given name
    assert merged({"name": "mini"}, old=None, same_run=False)["worker_id"] == "mini-new"


def test_a_rejoin_of_the_same_run_keeps_every_previous_setting_no_flag_gives() -> None:
    assert merged(same_run=True) == OLD
    assert merged({"batch": 5, "plane": "bf16"}, same_run=True) == {**OLD, "batch": 5, "plane": "bf16"}


def test_a_join_of_another_run_keeps_only_the_macs_own_settings() -> None:
    got = merged(same_run=False)
    assert got == {"name": "old-mac", "worker_id": "old-mac-new", "batch": 3}  # no plane, no worker key


def test_the_worker_key_is_kept_only_for_the_same_worker_id() -> None:
    assert merged({"worker_id": "old-mac-1"}, same_run=True)["worker_key"] == "k.json"
    assert "worker_key" not in merged({"worker_id": "other-2"}, same_run=True)
    assert merged({"worker_id": "other-2", "worker_key": "w.json"}, same_run=True)["worker_key"] == "w.json"


def test_a_flag_given_as_a_false_value_still_counts_as_given() -> None:
    # only None means "not given": an explicit 0 or "" is the user's value, not the previous one
    assert merged({"batch": 0, "plane": ""}, same_run=True) == {**OLD, "batch": 0, "plane": ""}


def test_the_table_names_each_daemon_config_field_join_merges_once() -> None:
    names = [row.field for row in JOIN_SETTINGS]
    assert len(names) == len(set(names))
    fields = {f.name for f in dataclasses.fields(DaemonConfig)}
    # the bucket and the run are the join's own arguments; the credentials file has its own order
    assert set(names) == fields - {"store", "run", "credentials_file"}


def test_the_real_table_keeps_a_plane_override_for_its_run_only() -> None:
    old = {f.name: None for f in dataclasses.fields(DaemonConfig)} | {
        "name": "m", "worker_id": "m-1", "data_dir": Path("/d"), "batch": 4, "plane": "int4", "run_key": "ed25519:x",
        "worker_key": "k", "rollouts_store": "s3://w", "rollouts_credentials_file": Path("/w.env"),
    }
    given = {row.field: None for row in JOIN_SETTINGS}
    same = merge_settings(JOIN_SETTINGS, given, old, same_run=True)
    assert {k: same[k] for k in ("plane", "run_key", "worker_key", "rollouts_store", "worker_id")} == {
        "plane": "int4", "run_key": "ed25519:x", "worker_key": "k", "rollouts_store": "s3://w", "worker_id": "m-1",
    }
    other = merge_settings(JOIN_SETTINGS, given, old, same_run=False)
    assert not {"plane", "run_key", "worker_key", "rollouts_store", "rollouts_credentials_file"} & set(other)
    assert other["batch"] == 4 and other["data_dir"] == Path("/d") and other["worker_id"].startswith("m-")
    assert other["worker_id"] != "m-1"
