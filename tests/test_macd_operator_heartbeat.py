"""The heartbeat's progress fields (`tokens_generated`, a `tokens_per_s` that moves during a
cohort) and the instance id of the process writing it: added compatibly (older heartbeats still
parse), bounded, covered by the worker's signature, shown by `stoa fleet` and `macd status`."""

from __future__ import annotations

import json
import time

import pytest

from macd.reporting import Reporter
from macd.service_cmd import heartbeat_line
from slime_stoa.cli.fleet_cmd import COLUMNS, count_text, fleet_rows
from slime_stoa.protocol.heartbeat import MAX_TEXT_CHARS, Heartbeat, judge_heartbeat, worker_metrics
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.registry import Registry, add_worker
from slime_stoa.protocol.signing import SigningKey

RUN = "beat-run"
KEY = SigningKey.generate()


def beat(**kw: object) -> Heartbeat:
    fields: dict = {"status": "generating", "version": 3, "pointer_version": 3, "updated_at": time.time(), **kw}
    return Heartbeat(worker_id="mac-a", name="mac-a", **fields)


def test_round_trip_with_the_progress_fields_and_the_instance() -> None:
    b = beat(tokens_generated=123_456, tokens_per_s=812.5, instance="0a1b2c3d4e5f6071")
    assert Heartbeat.from_bytes(b.to_bytes(), worker="mac-a") == b
    assert Heartbeat.from_bytes(b.to_bytes(KEY, run=RUN), worker="mac-a") == b


def test_a_heartbeat_of_an_older_worker_without_them_still_parses() -> None:
    doc = json.loads(beat().to_bytes())
    for name in ("tokens_generated", "instance"):
        del doc[name]
    old = Heartbeat.from_bytes(json.dumps(doc).encode(), worker="mac-a")
    assert (old.tokens_generated, old.instance) == (0, "")


@pytest.mark.parametrize("value", [-1, 1.5, True, "12", 2**63, None])
def test_tokens_generated_is_a_bounded_count(value: object) -> None:
    doc = {**json.loads(beat().to_bytes()), "tokens_generated": value}
    with pytest.raises(ValueError, match="tokens_generated"):
        Heartbeat.from_bytes(json.dumps(doc).encode())


def test_the_instance_is_bounded_printable_text() -> None:
    doc = {**json.loads(beat().to_bytes()), "instance": "\x1b[2J" + "a" * 10_000}
    got = Heartbeat.from_bytes(json.dumps(doc).encode()).instance
    assert len(got) == MAX_TEXT_CHARS and got.isprintable()
    with pytest.raises(ValueError, match="instance"):
        Heartbeat.from_bytes(json.dumps({**doc, "instance": 7}).encode())


def test_the_signature_covers_the_new_fields() -> None:
    registry = add_worker(Registry(run=RUN), worker="mac-a", name="mac-a", key=KEY.public, now=1.0)
    data = beat(tokens_generated=1000, instance="aaaa").to_bytes(KEY, run=RUN)
    assert judge_heartbeat(data, Heartbeat.from_bytes(data), registry) == "signed"
    for old, new in ((b'"tokens_generated": 1000', b'"tokens_generated": 9000'), (b'"instance": "aaaa"', b'"instance": "bbbb"')):
        tampered = data.replace(old, new)
        assert tampered != data and judge_heartbeat(tampered, Heartbeat.from_bytes(tampered), registry) == "forged"


def test_fleet_and_status_show_tokens_so_far_and_the_moving_rate() -> None:
    now = time.time()
    b = beat(tokens_per_s=41.7, tokens_generated=52_300, updated_at=now - 2)
    cells = dict(zip(COLUMNS, fleet_rows([b], now, 3)[0], strict=True))
    assert (cells["tok/s"], cells["tokens"]) == ("42", "52k")
    untrusted = dict(zip(COLUMNS, fleet_rows([(b, "forged")], now, 3)[0], strict=True))
    assert (untrusted["tok/s"], untrusted["tokens"]) == ("-", "-")
    assert [count_text(n) for n in (0, 999, 1000, 9999, 12_345, 4_500_000)] == ["0", "999", "1.0k", "9.9k", "12k", "4.5M"]
    assert "42 tok/s (52,300 tokens so far)" in heartbeat_line(b, now, 3)
    assert "tok/s not measured yet" in heartbeat_line(beat(updated_at=now), now, 3)
    assert worker_metrics(b, now)["worker/tokens_generated"] == 52_300.0
    assert worker_metrics(b, now, trust="forged")["worker/tokens_generated"] == 0.0


def test_the_reporter_counts_across_generators_and_rates_the_recent_tokens() -> None:
    reporter = Reporter(None, RunLayout(RUN), "mac-a", "mac-a", repeat_log_s=60.0)  # type: ignore[arg-type]
    assert reporter.progress() == (0, 0.0) and reporter.beat.instance == reporter.instance != ""
    assert Reporter(None, RunLayout(RUN), "mac-a", "mac-a", repeat_log_s=60.0).instance != reporter.instance  # type: ignore[arg-type]
    counted = [0]
    reporter.count_tokens(lambda: counted[0])
    counted[0] = 500
    tokens, rate = reporter.progress()
    assert tokens == 500 and rate > 0
    reporter.count_tokens(None)  # that generator is gone: what it counted stays
    counted[0] = 10**6
    assert reporter.tokens_generated() == 500
    reporter.count_tokens(lambda: 7)  # a new one starts where it is
    assert reporter.tokens_generated() == 500
