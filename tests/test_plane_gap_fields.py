"""The plane a worker serves, where the trainer and the operator read it: the signed record's
`plane` (always on the wire; strict), the heartbeat's
`plane` (strict), and the quarantine state's per-worker plane."""

from __future__ import annotations

import dataclasses
import json

import msgspec
import pytest

from slime_stoa.protocol.heartbeat import Heartbeat
from slime_stoa.protocol.records import decode_group, encode_group, encode_payload, frame_payload
from slime_stoa.trainer.consumer.quarantine import Quarantine, QuarantineConfig, records_from_json, records_to_json
from tests.test_records import decode_reason, make_group


def test_a_record_names_its_plane() -> None:
    bf16 = make_group()
    assert msgspec.msgpack.decode(encode_payload(bf16))["plane"] == "bf16"
    assert encode_group(make_group(plane="".join(["bf", "16"]))) == encode_group(bf16)  # equal, not the same str
    for plane in ("int8", "int4"):
        group = make_group(plane=plane)
        data = encode_group(group)
        assert msgspec.msgpack.decode(encode_payload(group))["plane"] == plane
        assert decode_group(data) == group and decode_group(data).plane == plane
        assert data != encode_group(bf16)
    with pytest.raises(ValueError, match="plane must be one of"):
        make_group(plane="fp8")


def test_a_record_with_a_bad_or_missing_plane_is_refused() -> None:
    wire = msgspec.msgpack.decode(encode_payload(make_group(plane="int8")))
    assert decode_reason(frame_payload(msgspec.msgpack.encode({**wire, "plane": "fp8"}))) == "type"
    assert decode_reason(frame_payload(msgspec.msgpack.encode({**wire, "plane": 8}))) == "type"
    # a plane left out (the default, bf16) is not the canonical form (one byte form per record)
    del wire["plane"]
    assert decode_reason(frame_payload(msgspec.msgpack.encode(wire))) == "msgpack"


def test_a_record_on_a_plane_the_run_does_not_offer_is_refused() -> None:
    """The gap limits allow more for a quantized plane, so the plane a record claims is checked
    against the run's: bf16 always, int8 and int4 only when the run serves (`plane`) or publishes them."""
    from slime_stoa.protocol.run_manifest import RunManifest
    from slime_stoa.protocol.validate import RecordRejected, validate_group
    from slime_stoa.trainer.consumer.config import limits_for_run

    group = make_group(plane="int4")
    plain = RunManifest(run=group.run, model="m", task="gsm8k", group_size=len(group.samples))
    offered = RunManifest(run=group.run, model="m", task="gsm8k", group_size=len(group.samples), planes=("int4",))
    assert limits_for_run(plain, vocab_size=1000).allowed_planes == {"bf16"}
    assert limits_for_run(offered, vocab_size=1000).allowed_planes == {"bf16", "int4"}
    limits = limits_for_run(plain, vocab_size=1000)
    with pytest.raises(RecordRejected) as refused:
        validate_group(group, dataclasses.replace(limits, expected_sampling=None))
    assert refused.value.reason == "plane"
    validate_group(make_group(plane="bf16"), dataclasses.replace(limits, expected_sampling=None))
    validate_group(group, dataclasses.replace(limits_for_run(offered, vocab_size=1000), expected_sampling=None))


def test_the_heartbeat_says_which_plane_the_worker_serves() -> None:
    beat = Heartbeat(worker_id="mac-0a1b2c", name="m", status="generating", plane="int4")
    assert Heartbeat.from_bytes(beat.to_bytes()).plane == "int4"
    assert Heartbeat.from_bytes(Heartbeat(worker_id="mac-0a1b2c", name="m", status="s").to_bytes()).plane == "bf16"
    doc = json.loads(beat.to_bytes())
    for bad in ("fp8", 4, None):
        with pytest.raises(ValueError, match="plane must be one of"):
            Heartbeat.from_bytes(json.dumps({**doc, "plane": bad}).encode())


def test_the_quarantine_state_keeps_each_workers_plane() -> None:
    book = Quarantine(QuarantineConfig())
    book.observe_gap("mac-a", 0.9, 100, plane="int4")
    book.observe_gap("mac-b", 0.9, 100)
    back = records_from_json(json.loads(json.dumps(records_to_json(book.records))))
    assert back["mac-a"].plane == "int4" and back["mac-b"].plane == "bf16"
    with pytest.raises(ValueError, match="plane"):
        records_from_json({"mac-a": {"plane": "fp8"}})
    assert QuarantineConfig().allowance("int4") > QuarantineConfig().allowance("int8") > QuarantineConfig().allowance("bf16") == 0


@pytest.mark.slow  # ~3 s: a real worker
async def test_a_worker_told_to_serve_int4_labels_its_records_and_heartbeat(
    store, store_url, tmp_path, tmp_path_factory  # type: ignore[no-untyped-def]
) -> None:
    """The daemon config's `plane` overrides the Mac's pick: on a bf16 run that publishes int4,
    the worker serves int4 and says so in every record and in its heartbeat."""
    pytest.importorskip("mlx_lm")
    import asyncio
    from dataclasses import replace

    from macd.worker import Worker, WorkerOptions
    from slime_stoa.protocol.layout import RunLayout
    from slime_stoa.protocol.pulse.publisher import PublisherConfig
    from slime_stoa.protocol.run_manifest import RunManifest
    from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model
    from tests.conftest import async_wait_until
    from tests.test_worker import RUN, daemon_config, records

    model_dir = tiny_synthetic_model(tmp_path_factory.mktemp("tiny") / "model")
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=4, planes=("int4",))
    await seed_run(store, manifest, model_dir, task_count=50, publisher=PublisherConfig(extras_dir=model_dir, planes=("int4",)))
    config = replace(daemon_config(store_url, tmp_path / "data"), plane="int4")
    worker = Worker(config, store, WorkerOptions(seed=4, heartbeat_s=0.2))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.groups_recorded >= 2 or run.done(), timeout=120, message="two groups")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0
    assert worker.weights.plane == "int4" and worker.sub is not None and worker.sub.layout.plane == "int4"
    got = await records(store)
    assert got and {g.plane for g in got} == {"int4"}
    beat = Heartbeat.from_bytes(await store.get_bytes(RunLayout(RUN).heartbeat(config.worker_id)))
    assert beat.plane == "int4"
