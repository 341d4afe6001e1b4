"""A bucket writer deletes or spoils what the trainer depends on, and the trainer keeps no copy
of its own (no `keep_dir`): nothing stops it, and no honest record is lost.

- a run manifest gone, or a consumer state spoiled: the consumer pauses, says what is wrong and
  how to repair it at tries 1, 2, 4, ... (`consumer.pause`), and resumes by itself once repaired;
- garbage where the consumer's state should be is written over by the next save; a genuine
  newer state of another trainer still stops it;
- a record that needs an object that is gone (the registry, a version manifest) is held, not
  rejected, and admitted once the object is back (`consumer.held`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

import msgspec
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunKeyMismatch, RunManifest
from slime_stoa.protocol.signing import SIGNATURE_FIELD, SigningKey, canonical_json, sign_document
from slime_stoa.protocol.store import Store
from slime_stoa.trainer.consumer import ConsumerTimeout, RolloutConsumer
from slime_stoa.trainer.consumer.pause import is_report_try
from slime_stoa.trainer.consumer.persistence import StateConflict, parse_state, state_bytes, state_key
from tests.test_consumer import RUN, Tiny, make_group, now_ms, publish_versions, tiny
from tests.test_signed_records import open_signed_consumer, put, setup_signed_run, signed
from tests.test_trust_writer import GARBAGE, batches, records

__all__ = ["tiny"]  # the session fixture

#: Tries a test watches a paused consumer make before it repairs the object.
TRIES = 4


async def until(done: Callable[[], bool], work: Awaitable[object]) -> None:
    """Wait until `done()` while `work` runs (work that must not end first)."""
    task = asyncio.ensure_future(work)
    while not done():
        assert not task.done(), "the paused call ended before the repair"
        await asyncio.sleep(0.005)


def paused_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("stoa: paused")]


def resumed_tries(caplog: pytest.LogCaptureFixture) -> list[int]:
    return [int(r.getMessage().split()[3]) for r in caplog.records if r.getMessage().startswith("stoa: resumed after")]


def reported_tries(lines: list[str]) -> list[int]:
    return [int(line.split("(try ")[1].split(",")[0]) for line in lines]


async def test_a_deleted_run_manifest_pauses_the_consumer_until_it_is_back(
    store: Store, store_url: str, tiny: Tiny, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stoa")
    caplog.set_level(logging.INFO, logger="slime_stoa")
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    manifest = RunLayout(RUN).run_manifest
    genuine = await store.get_bytes(manifest)
    await store.delete(manifest)
    await records(store, tiny, run, "mac-a", range(2), now_ms() - 20_000)
    opening = asyncio.ensure_future(open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key))
    await until(lambda: len(paused_lines(caplog)) >= 3, asyncio.shield(opening))  # tries 1, 2 and 4
    lines = paused_lines(caplog)
    assert all(RUN in line and "run.json" in line and "stoa run create" in line and "keep_dir" in line for line in lines)
    await store.put(manifest, genuine)
    c = await opening
    try:
        tries = resumed_tries(caplog)
        assert len(tries) == 1 and tries[0] >= TRIES
        reported = reported_tries(paused_lines(caplog))
        assert all(is_report_try(t) for t in reported) and len(reported) < tries[0]  # not one line per try
        assert await batches(c, 2) == ["mac-a", "mac-a"]
    finally:
        await c.close()


async def test_a_run_manifest_of_another_key_pauses_the_consumer_until_it_is_back(
    store: Store, store_url: str, tiny: Tiny, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's token writes a run manifest naming its own key, signed by it. The run's pointer
    is signed by the configured key, so the manifest is a forgery: the trainer waits for the
    repair instead of stopping. A trainer configured with a key nothing in the bucket is signed
    by is refused at once (its own config is wrong; no wait repairs that)."""
    caplog.set_level(logging.INFO, logger="stoa")
    caplog.set_level(logging.INFO, logger="slime_stoa")
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    manifest = RunLayout(RUN).run_manifest
    genuine = await store.get_bytes(manifest)
    forger = run.workers["mac-a"]
    forged = dataclasses.replace(RunManifest.from_bytes(genuine), run_key=forger.public.to_text())
    await store.put(manifest, forged.to_bytes(forger))
    await records(store, tiny, run, "mac-a", range(2), now_ms() - 20_000)
    opening = asyncio.ensure_future(open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key))
    await until(lambda: len(paused_lines(caplog)) >= 2, asyncio.shield(opening))  # tries 1 and 2
    assert all("run.json" in line and "stoa run create" in line for line in paused_lines(caplog))
    await store.put(manifest, genuine)
    c = await opening
    try:
        assert len(resumed_tries(caplog)) == 1
        assert await batches(c, 2) == ["mac-a", "mac-a"]
    finally:
        await c.close()
    with pytest.raises(RunKeyMismatch):
        await open_signed_consumer(store, tiny, store_url, run, run_key=SigningKey.generate().public.to_text())


async def test_a_run_manifest_of_hostile_field_names_pauses_with_one_bounded_line(
    store: Store, store_url: str, tiny: Tiny, caplog: pytest.LogCaptureFixture
) -> None:
    """A bucket writer's run manifest whose field names are long, many and full of newlines and
    escapes: the pause line quotes a few of them, cut, on one printable line."""
    caplog.set_level(logging.INFO, logger="stoa")
    caplog.set_level(logging.INFO, logger="slime_stoa")
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    manifest = RunLayout(RUN).run_manifest
    genuine = await store.get_bytes(manifest)
    forger = run.workers["mac-a"]  # signs it, so that the fields are what gets refused
    doc = {k: v for k, v in msgspec.json.decode(genuine).items() if k != SIGNATURE_FIELD}
    doc.update({f"\nstoa: resumed after 1 tries\x1b[2J{i}" + "x" * 3000: 1 for i in range(15)})
    doc["run_key"] = forger.public.to_text()
    await store.put(manifest, canonical_json(sign_document(doc, forger)))
    opening = asyncio.ensure_future(open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key))
    await until(lambda: len(paused_lines(caplog)) >= 2, asyncio.shield(opening))
    for line in paused_lines(caplog):
        assert "run.json" in line and "unknown fields" in line and "and 10 more" in line
        assert len(line) < 1200 and line.isprintable()
    assert resumed_tries(caplog) == []  # the forged line inside a field name is not a log line of its own
    await store.put(manifest, genuine)
    c = await opening
    await c.close()


async def test_a_spoiled_state_pauses_the_restart_until_it_is_back(
    store: Store, store_url: str, tiny: Tiny, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slime_stoa")
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    await records(store, tiny, run, "mac-a", range(4), now_ms() - 20_000)
    first = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key)
    assert await batches(first, 2) == ["mac-a"] * 2
    await first.save_state()
    mine = first.state_dict()
    await first.close()
    genuine = await store.get_bytes(state_key(RUN))
    forged = state_bytes(parse_state(genuine, RUN, None), SigningKey.generate())  # signed, by another key
    for spoiled in (GARBAGE, forged):
        await store.put(state_key(RUN), spoiled)
        again = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key)
        try:
            loading = asyncio.ensure_future(again.resume_from_bucket())
            await until(lambda c=again: c.counters.get("paused/consumer_state", 0) >= TRIES, asyncio.shield(loading))
            assert "consumer.json" in paused_lines(caplog)[-1] and "keep_dir" in paused_lines(caplog)[-1]
            await store.put(state_key(RUN), genuine)
            assert await loading
            assert again.state_dict()["cursor"] == mine["cursor"]
            assert await batches(again, 2) == ["mac-a"] * 2  # the other two, none used twice
        finally:
            await again.close()


async def test_garbage_under_a_save_is_written_over_another_trainers_state_stops_it(
    store: Store, store_url: str, tiny: Tiny
) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    await records(store, tiny, run, "mac-a", range(2), now_ms() - 20_000)
    live = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key)
    other: RolloutConsumer | None = None
    try:
        await batches(live, 2)
        await live.save_state()
        await store.put(state_key(RUN), GARBAGE)
        await live.save_state()  # no copies: written over all the same
        saved = parse_state(await store.get_bytes(state_key(RUN)), RUN, [run.run_key.public])
        assert saved.cursor == live.state_dict()["cursor"]
        other = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key)
        assert await other.load_from_bucket()
        await other.save_state()  # a genuine newer save: another trainer
        with pytest.raises(StateConflict, match="another trainer"):
            await live.save_state()
    finally:
        await live.close()
        if other is not None:
            await other.close()


def rejected(c: RolloutConsumer) -> dict[str, int]:
    return {k: n for k, n in c.counters.items() if k.startswith("rejected/")}


async def test_records_wait_for_a_deleted_registry_and_are_admitted_once_it_is_back(
    store: Store, store_url: str, tiny: Tiny, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slime_stoa")
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    registry = RunLayout(RUN).registry
    genuine = await store.get_bytes(registry)
    await store.delete(registry)
    await records(store, tiny, run, "mac-a", range(4), now_ms() - 20_000)
    c = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key)
    try:
        batch = asyncio.ensure_future(c.next_batch(4, trainer_version=0, timeout_s=None))
        await until(lambda: c.counters.get("held", 0) == 4 and c.counters.get("held_looks", 0) >= TRIES, asyncio.shield(batch))
        assert rejected(c) == {}
        assert any("registry.json" in line and "keep_dir" in line for line in
                   (r.getMessage() for r in caplog.records if "held" in r.getMessage()))
        await store.put(registry, genuine)  # its owner restores it
        got = await batch
        assert [g.group.worker_id for g in got.groups] == ["mac-a"] * 4  # every honest record, none lost
        assert rejected(c) == {} and c.counters["held_released"] == 4
    finally:
        await c.close()


async def test_records_wait_for_a_deleted_version_manifest_and_are_admitted_once_it_is_republished(
    store: Store, store_url: str, tiny: Tiny
) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    await publish_versions(store, 1, key=run.run_key)
    layout = RunLayout(RUN)
    [v1] = [i.key async for i in store.list(layout.version_manifests_prefix(1))]
    genuine = await store.get_bytes(v1)
    await store.delete(v1)
    base = now_ms() - 20_000
    for seq in range(2):
        group = make_group(tiny, worker="mac-a", seq=seq, prompt_index=seq, weight_version=1)
        await put(store, signed(group, run.workers["mac-a"]), "mac-a", seq, base + seq)
    c = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key)
    try:
        batch = asyncio.ensure_future(c.next_batch(2, trainer_version=1, timeout_s=None))
        await until(lambda: c.counters.get("held", 0) == 2 and c.counters.get("held_looks", 0) >= TRIES, asyncio.shield(batch))
        assert rejected(c) == {}
        await store.put(v1, genuine)  # republished
        got = await batch
        assert [g.group.weight_version for g in got.groups] == [1, 1] and rejected(c) == {}
    finally:
        await c.close()


async def test_a_record_of_a_version_never_published_is_still_rejected(store: Store, store_url: str, tiny: Tiny) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    group = make_group(tiny, worker="mac-a", seq=0, prompt_index=0, weight_version=0)
    forged = msgspec.structs.replace(group, state_digest="f" * len(group.state_digest))
    await put(store, signed(forged, run.workers["mac-a"]), "mac-a", 0, now_ms() - 20_000)
    c = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key, wait_timeout_s=0.5)
    try:
        with pytest.raises(ConsumerTimeout):
            await c.next_batch(1, trainer_version=0)
        assert rejected(c) == {"rejected/digest": 1} and c.counters.get("held", 0) == 0
    finally:
        await c.close()


async def test_held_records_are_bounded_the_oldest_dropped(store: Store, store_url: str, tiny: Tiny) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    await store.delete(RunLayout(RUN).registry)
    await records(store, tiny, run, "mac-a", range(5), now_ms() - 20_000)
    c = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key, wait_timeout_s=0.5)
    c._held.max_records = 3
    try:
        with pytest.raises(ConsumerTimeout):
            await c.next_batch(5, trainer_version=0)
        assert c.counters["held"] == 5 and c.counters["held_dropped"] == 2 and len(c._held) == 3
        assert len(c.state_dict()["pending"]) == 3  # the dropped ones left the queue; the held stay in it
    finally:
        await c.close()


@pytest.mark.parametrize("planes", [(), ("int8", "int4")])
async def test_a_records_plane_is_one_the_run_publishes(planes: tuple[str, ...], store: Store, store_url: str, tiny: Tiny) -> None:
    """The plane widens the logprob-gap limits, so the trainer takes it from the run manifest,
    not from the record: a bf16-only run refuses "int4" and "int8" claims; an int8+int4 run admits
    them; a gap fed for a plane the run does not offer gets no allowance."""
    run = await setup_signed_run(store, tiny, workers=("mac-a",), planes=planes)
    base = now_ms() - 20_000
    for seq, plane in enumerate(("int4", "int8", "int8")):
        group = msgspec.structs.replace(make_group(tiny, worker="mac-a", seq=seq, prompt_index=seq), plane=plane)
        await put(store, signed(group, run.workers["mac-a"]), "mac-a", seq, base + seq)
    c = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key, wait_timeout_s=1.0)
    try:
        if planes:
            got = await c.next_batch(3, trainer_version=0)
            assert sorted(g.group.plane for g in got.groups) == ["int4", "int8", "int8"]
        else:
            with pytest.raises(ConsumerTimeout):
                await c.next_batch(1, trainer_version=0)
        assert rejected(c) == ({} if planes else {"rejected/plane": 3})
        allowed = c.config.quarantine.allowance("int4") if planes else 0.0
        gap = 0.05 + allowed  # over the bf16 limit unless int4's allowance counts
        assert c.observe_logprob_gap("mac-a", gap, 10_000, plane="int4") == [] or not planes
        assert c.counters.get("gap_plane_not_offered", 0) == (0 if planes else 1)
    finally:
        await c.close()
