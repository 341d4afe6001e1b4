"""Small trust items: numbers from the bucket stay short in every log line, and the quickstart's
table counts what is truly lost and what was merely a repeat."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from slime_stoa.protocol.heartbeat import Heartbeat
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.manifests import ManifestError, Pointer, Ref
from slime_stoa.protocol.records import RolloutGroup, Sample, SamplingParams
from slime_stoa.protocol.registry import Registry, add_worker
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import open_store
from slime_stoa.protocol.strict_json import MAX_TIMESTAMP, check_timestamp
from slime_stoa.protocol.validate import RecordLimits, RecordRejected, validate_group
from slime_stoa.quickstart.report import REFUSED_ROW, REPEATED_ROW, ConsoleReport, split_refusals
from slime_stoa.quickstart.run import count_lost, count_spooled, read_judged_states, read_worker_states, worker_id
from slime_stoa.trainer.tracking import UNTRUSTED_TOTAL, fleet_metrics

NOW = 1_700_000_000.0
HOSTILE_TIMES = [1e308, -1e308, 1e300, MAX_TIMESTAMP * 1000]


def heartbeat_doc(**fields: object) -> bytes:
    doc = json.loads(Heartbeat(worker_id="mac-a", name="mac-a", status="generating", updated_at=NOW).to_bytes())
    return json.dumps({**doc, **fields}).encode()


@pytest.mark.parametrize("field", ["updated_at", "started_at", "tokens_per_s", "last_swap_s", "memory_gb"])
@pytest.mark.parametrize("value", HOSTILE_TIMES)
def test_a_heartbeat_with_a_huge_or_negative_number_is_refused_in_one_short_line(field: str, value: float) -> None:
    with pytest.raises(ValueError) as caught:
        Heartbeat.from_bytes(heartbeat_doc(**{field: value}), worker="mac-a")
    message = str(caught.value)
    assert field in message and len(message) < 200 and "\n" not in message


def test_a_heartbeat_with_ordinary_numbers_still_parses() -> None:
    beat = Heartbeat.from_bytes(heartbeat_doc(tokens_per_s=1234.5, started_at=NOW - 60), worker="mac-a")
    assert (beat.updated_at, beat.started_at, beat.tokens_per_s) == (NOW, NOW - 60, 1234.5)


@pytest.mark.parametrize("started, finished", [(NOW, 1e308), (1e308, 1e308), (-1e308, NOW), (NOW - 1, 1e20)])
def test_a_record_with_a_hostile_time_is_rejected_with_a_short_reason(started: float, finished: float) -> None:
    sampling = SamplingParams(temperature=0.7, top_p=1.0, max_tokens=16, stop=())
    sample = Sample(response_tokens=np.array([5, 6], np.int32), logprobs=np.array([-0.1, -0.2], np.float32),
                    finish_reason="stop", reward=1.0)  # fmt: skip
    group = RolloutGroup(
        kind="train", run="run-1", task_id="gsm8k", prompt_index=1, prompt_tokens=np.array([1, 2], np.int32),
        samples=(sample,),
        weight_version=1, state_digest="0" * 64, sampling=sampling, worker_id="mac-01", seq=0,
        started_at=started, finished_at=finished,
    )  # fmt: skip
    with pytest.raises(RecordRejected) as caught:
        validate_group(group, RecordLimits(vocab_size=100), now=NOW)
    assert caught.value.reason == "timestamps"
    assert len(str(caught.value)) < 200, str(caught.value)[:300]


def test_check_timestamp_takes_times_and_refuses_the_rest() -> None:
    assert check_timestamp(NOW, "t") == NOW and check_timestamp(0, "t") == 0.0
    for bad in (*HOSTILE_TIMES, float("nan"), True, "1", None):
        with pytest.raises(ValueError, match=r"^t "):
            check_timestamp(bad, "t")


# -- the quickstart's summary: lost, spooled, repeated, refused ------------------------------------
def final_beat(worker: str, *, spooled: int, quarantined: int) -> Heartbeat:
    return Heartbeat(worker_id=worker, name=worker, status="stopped", groups_spooled=spooled,
                     groups_quarantined=quarantined, updated_at=NOW)  # fmt: skip


def test_groups_still_in_a_spool_are_not_counted_lost() -> None:
    beats = [final_beat("quickstart-0", spooled=3, quarantined=1), final_beat("quickstart-1", spooled=2, quarantined=0)]
    assert count_lost(beats) == 1  # only what was set aside for good
    assert count_spooled(beats) == 5


def summary_rows(**summary: object) -> dict[str, str]:
    base: dict[str, object] = dict(
        first_version=1, reward_first=0.1, window=5, reward_last=0.5, search_rate_first=0.0, search_rate_last=0.0,
        eval_prompts=8, last_version=9, eval_pass1_first=0.1, eval_pass1_last=0.4, versions=8, versions_run=8,
        groups_used=64, groups_used_run=64, groups_lost=0, digests_checked=4, digest_mismatches=0,
        logprob_gap_versions=3, mean_abs_logprob_gap=1e-3, patch_bytes_mean=1e3, full_bytes=1e4, seconds=10.0,
        seconds_run=10.0,
    )  # fmt: skip
    console = Console(record=True, width=200)
    ConsoleReport(console).summary({**base, **summary})
    rows = {}
    for line in console.export_text().splitlines():
        cells = [c.strip() for c in line.strip("│┃| ").split("│")]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


def test_the_summary_counts_honest_repeats_apart_from_refused_records() -> None:
    repeats, failed = split_refusals({"duplicate": 5, "signature": 2, "prompt": 1})
    assert (repeats, failed) == (5, {"prompt": 1, "signature": 2})
    rows = summary_rows(groups_lost=1, groups_spooled=4, groups_repeated=repeats, records_refused=failed)
    assert rows[REPEATED_ROW] == "5"
    assert rows[REFUSED_ROW] == "3 (signature 2, prompt 1)"
    assert rows["groups still in a worker's spool (uploaded when it starts again)"] == "4"
    assert rows["groups lost (set aside: their key held other bytes)"] == "1"
    assert not any("duplicate" in k or "duplicate" in v for k, v in rows.items())  # no reason code shown as an alert


def test_a_run_with_only_repeats_shows_no_refused_record() -> None:
    repeats, failed = split_refusals({"duplicate": 2})
    rows = summary_rows(groups_repeated=repeats, records_refused=failed)
    assert rows[REPEATED_ROW] == "2" and rows[REFUSED_ROW] == "0"


# -- the quickstart's heartbeat metrics in a signed run ---------------------------------------------
async def test_the_quickstart_judges_its_workers_heartbeats_as_stoa_fleet_does(tmp_path: Path) -> None:
    run = "qs-signed"
    keys = {worker_id(i): SigningKey.generate() for i in range(3)}
    reg = Registry(run=run)
    for worker, key in list(keys.items())[:2]:  # quickstart-2 is not registered
        reg = add_worker(reg, worker=worker, name=worker, key=key.public, now=1.0)
    layout = RunLayout(run)
    async with open_store(f"file://{tmp_path}") as store:
        for i, (worker, key) in enumerate(keys.items()):
            beat = Heartbeat(worker_id=worker, name=worker, status="generating", tokens_per_s=100.0,
                             version=1, pointer_version=1, updated_at=time.time())  # fmt: skip
            signer = None if i == 1 else key  # quickstart-1 registered but writes unsigned
            await store.put(layout.heartbeat(worker), beat.to_bytes(signer, run=run))
        beats, trust = await read_judged_states(store, run, 3, reg)
        assert trust == {"quickstart-0": "signed", "quickstart-1": "unsigned", "quickstart-2": "unknown"}
        assert [b.worker_id for b in await read_worker_states(store, run, 3, reg)] == ["quickstart-0"]
        metrics = fleet_metrics(beats, time.time(), head=1, trust=trust)
        assert metrics[UNTRUSTED_TOTAL] == 2
        assert metrics["worker/quickstart-1/running"] == 0 and metrics["worker/quickstart-0/running"] == 1
        assert (await read_judged_states(store, run, 3))[1] is None
        assert len(await read_worker_states(store, run, 3)) == 3  # an unsigned run: every heartbeat counts


@pytest.mark.parametrize("value", [1e308, -1.0, MAX_TIMESTAMP * 1000])
def test_a_pointer_with_a_hostile_time_is_malformed_not_a_date_that_crashes(value: float) -> None:
    layout = RunLayout("r")
    pointer = Pointer(run="r", version=1, state_digest="0" * 64, manifest=layout.version_manifest(1, "deadbeef"),
                      anchor=Ref(version=0, manifest=layout.anchor_manifest(0, "deadbeef"), state_digest="1" * 64),
                      updated_at=NOW)  # fmt: skip
    doc = json.loads(pointer.to_bytes())
    assert Pointer.from_bytes(json.dumps(doc).encode()).updated_at == NOW
    with pytest.raises(ManifestError, match="updated_at") as caught:
        Pointer.from_bytes(json.dumps({**doc, "updated_at": value}).encode())
    assert len(str(caught.value)) < 200


def test_an_identical_group_is_logged_as_info_and_a_failed_check_as_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """An honest repeat (a group identical to an admitted one) is nothing to act on: it is counted
    like any refusal but logged as info, so a run's output does not read like an attack alert."""
    from types import SimpleNamespace

    from slime_stoa.trainer.consumer.shared import Shared
    from slime_stoa.trainer.consumer.state import ConsumerState

    shared = Shared(None, SimpleNamespace(run="r"), ConsumerState(run="r"))  # type: ignore[arg-type]
    with caplog.at_level("INFO", logger="slime_stoa.trainer.consumer.shared"):
        shared.reject("1-w-0000000001.rec", "duplicate", "the same prompt and samples were already admitted")
        shared.reject("1-w-0000000002.rec", "signature", "does not verify")
    levels = {r.getMessage().split("(")[1].split(",")[0]: r.levelname for r in caplog.records}
    assert levels == {"duplicate": "INFO", "signature": "WARNING"}
    assert shared.state.counters["rejected/duplicate"] == shared.state.counters["rejected/signature"] == 1
