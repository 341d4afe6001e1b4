"""`stoa fleet` prints a heartbeat's counters only when its signature verified: a forged one
(any token holder can write a heartbeat) shows "unverified" and none of what it claims."""

from __future__ import annotations

import dataclasses
import time

from slime_stoa.cli.fleet_cmd import COLUMNS, UNVERIFIED, fleet_rows, render
from slime_stoa.protocol.heartbeat import Heartbeat, judge_heartbeat
from slime_stoa.protocol.registry import Registry, add_worker
from slime_stoa.protocol.signing import SigningKey

RUN = "fleet-run"
KEY = SigningKey.generate()
# Counters no honest row below shows, so finding one in the table means a claim leaked.
CLAIMS = {"version": 424242, "pointer_version": 424243, "tokens_per_s": 31337.0, "tokens_generated": 987_654_321,
          "groups_uploaded": 55555, "groups_spooled": 66666, "errors": 77777, "last_error": "claimed-error-text"}


def _registry() -> Registry:
    return add_worker(Registry(run=RUN), worker="mac-a", name="mac-a", key=KEY.public, now=1.0)


def test_a_forged_heartbeat_shows_unverified_and_none_of_its_counters() -> None:
    now = time.time()
    honest = Heartbeat(worker_id="mac-a", name="mac-a", status="generating", updated_at=now - 2, version=3,
                       pointer_version=3, groups_uploaded=4, tokens_generated=100)
    data = honest.to_bytes(KEY, run=RUN)
    registry = _registry()
    assert judge_heartbeat(data, Heartbeat.from_bytes(data), registry) == "signed"
    forged_bytes = data.replace(b'"groups_uploaded": 4', b'"groups_uploaded": 55555')
    forged = Heartbeat.from_bytes(forged_bytes)
    assert forged.groups_uploaded == 55555
    trust = judge_heartbeat(forged_bytes, forged, registry)
    assert trust == "forged"
    beat = dataclasses.replace(forged, **CLAIMS)  # what such a forgery may claim, every counter at once
    row = dict(zip(COLUMNS, fleet_rows([(beat, trust)], now, 3)[0], strict=True))
    assert row["version"] == UNVERIFIED and row["status"] == "forged" and row["key"] == "forged"
    for column in ("lag", "tok/s", "tokens", "uploaded", "spool", "last seen", "errors"):
        assert row[column] == "-", (column, row)
    table = render(fleet_rows([(beat, trust)], now, 3))
    for value in ("424242", "31337", "987", "55555", "66666", "77777", "claimed-error-text"):
        assert value not in table, (value, table)
    # The signed heartbeat's counters are shown as it says them.
    signed = dict(zip(COLUMNS, fleet_rows([(honest, "signed")], now, 3)[0], strict=True))
    assert (signed["version"], signed["uploaded"], signed["tokens"], signed["key"]) == ("v3", "4", "100", "signed")

