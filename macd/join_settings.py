"""Where each setting of a `macd join` comes from: one row per setting, one rule over the rows.

A setting is the flag's value when one is given; else the previous config's, when the row keeps
it on this re-join (`Keep`); else the row's default (None: the `DaemonConfig` field's own). Adding
a setting to join is adding a row to `JOIN_SETTINGS`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import config as cfg


class Keep(enum.Enum):
    """When a re-join keeps the previous config's value of a setting no flag gives."""

    ANY_RUN = "any run"  # the Mac's own settings: kept whatever run it joins
    SAME_RUN = "same run"  # the run's: kept only on a re-join of the same run (bucket and name)
    SAME_WORKER = "same worker"  # the worker id's: the same run and the same worker id


@dataclass(frozen=True)
class Setting:
    """One row: a `DaemonConfig` field, when a re-join keeps its previous value, and its default
    given the settings merged before it (None: the field's default)."""

    field: str
    keep: Keep
    default: Callable[[Mapping[str, Any]], Any] | None = None


#: The settings join merges, in order (a default may read the settings above it).
JOIN_SETTINGS: tuple[Setting, ...] = (
    Setting("name", Keep.ANY_RUN, lambda _: cfg.default_name()),
    Setting("worker_id", Keep.SAME_RUN, lambda merged: cfg.new_worker_id(merged["name"])),
    Setting("data_dir", Keep.ANY_RUN, lambda _: cfg.default_data_dir()),
    Setting("batch", Keep.ANY_RUN),
    Setting("max_decode", Keep.ANY_RUN),
    Setting("transfer_concurrency", Keep.ANY_RUN),
    Setting("spool_max_mb", Keep.ANY_RUN),
    Setting("log_level", Keep.ANY_RUN),
    Setting("wandb_project", Keep.ANY_RUN),
    Setting("plane", Keep.SAME_RUN),  # a plane override holds for its run only
    Setting("run_key", Keep.SAME_RUN),  # pinned before: kept
    Setting("rollouts_store", Keep.SAME_RUN),
    Setting("rollouts_credentials_file", Keep.SAME_RUN),
    Setting("worker_key", Keep.SAME_WORKER),  # the key of that worker id only
)


def merge_settings(
    table: Sequence[Setting], given: Mapping[str, Any], old: Mapping[str, Any] | None, *, same_run: bool
) -> dict[str, Any]:
    """The value of each row's setting: `given[field]` (the flags; None: not given), else the
    previous config's (`old`, None: there is none) when the row's `Keep` holds, else the row's
    default; a row with none of them is left out (the config's own default applies)."""
    merged: dict[str, Any] = {}
    for row in table:
        if given.get(row.field) is not None:
            merged[row.field] = given[row.field]
        elif old is not None and _kept(row.keep, old, merged, same_run=same_run):
            merged[row.field] = old[row.field]
        elif row.default is not None:
            merged[row.field] = row.default(merged)
    return merged


def _kept(keep: Keep, old: Mapping[str, Any], merged: Mapping[str, Any], *, same_run: bool) -> bool:
    if keep is Keep.ANY_RUN:
        return True
    if keep is Keep.SAME_RUN:
        return same_run
    return same_run and old.get("worker_id") == merged.get("worker_id")
