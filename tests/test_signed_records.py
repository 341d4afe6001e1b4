"""Signed rollout records: the envelope, the consumer's signature check, and every attack on a
signed run refused and counted, with the trainer keeping its data, on both store backends."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from typing import Any

import msgspec
import pytest

from slime_stoa.protocol.layout import RolloutKey, RunLayout
from slime_stoa.protocol.records import RolloutGroup, encode_group
from slime_stoa.protocol.registry import (
    Registry,
    add_worker,
    registry_bytes,
    release_worker,
    revoke_worker,
    update_registry,
)
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.signed_record import (
    HEADER_LEN,
    SIGNED_MAGIC,
    SignedRecordError,
    is_signed,
    open_signed,
    record_bytes,
    sign_record,
    verify_signed,
)
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store
from slime_stoa.protocol.validate import RecordRejected
from slime_stoa.tasks import make_task
from slime_stoa.tasks.objects import put_task_objects
from slime_stoa.trainer.consumer import ConsumerTimeout, RolloutConsumer
from slime_stoa.trainer.consumer.admission import CONSUMER_REASONS, SIGNATURE_REASONS, check_signature
from slime_stoa.trainer.consumer.persistence import UntrustedState, state_key
from tests.conftest import async_wait_until
from tests.test_consumer import (
    ITEMS,
    MAX_TOKENS,
    RUN,
    G,
    Tiny,
    config,
    digest_of,
    make_group,
    now_ms,
    publish_versions,
    tiny,
)

__all__ = ["tiny"]  # the session fixture

RECORD = b"\x89STOARG\x01" + b"record bytes"


# -- the envelope (pure) -----------------------------------------------------------------------------
def test_envelope_round_trip_and_binding() -> None:
    key = SigningKey.generate()
    data = sign_record(RECORD, key, run="run-a")
    assert is_signed(data) and data.startswith(SIGNED_MAGIC) and len(data) == HEADER_LEN + len(RECORD)
    signed = open_signed(data)
    assert signed.key_id == key.key_id and signed.record == RECORD and len(signed.signature) == 64
    verify_signed(signed, key.public, run="run-a")
    assert record_bytes(data) == RECORD and record_bytes(RECORD) == RECORD
    # The run is bound in: the same bytes do not verify for another run.
    with pytest.raises(SignedRecordError) as exc:
        verify_signed(signed, key.public, run="run-b")
    assert exc.value.reason == "bad_signature"
    # Another key, even when the envelope is rewritten to name it.
    other = SigningKey.generate()
    with pytest.raises(SignedRecordError, match="bad_signature"):
        verify_signed(signed, other.public, run="run-a")
    renamed = open_signed(data[:8] + bytes.fromhex(other.key_id) + data[16:])
    with pytest.raises(SignedRecordError, match="bad_signature"):
        verify_signed(renamed, other.public, run="run-a")
    # One flipped bit of the record.
    flipped = bytearray(data)
    flipped[-1] ^= 1
    with pytest.raises(SignedRecordError, match="bad_signature"):
        verify_signed(open_signed(bytes(flipped)), key.public, run="run-a")


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (RECORD, "unsigned"),
        (b"", "unsigned"),
        (b"{}", "unsigned"),
        (SIGNED_MAGIC + b"\x01" + b"\0" * 10, "bad_signature"),  # truncated
        (SIGNED_MAGIC + b"\x01" + b"\0" * 72, "bad_signature"),  # header only, no record
        (SIGNED_MAGIC + b"\x02" + b"\0" * 72 + RECORD, "bad_signature"),  # unknown format
    ],
)
def test_malformed_envelopes_are_refused_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(SignedRecordError) as exc:
        open_signed(data)
    assert exc.value.reason == reason


def test_signature_reasons_are_consumer_reasons() -> None:
    assert {"unsigned", "unknown_key", "revoked", "key_mismatch", "bad_signature"} == SIGNATURE_REASONS
    assert SIGNATURE_REASONS <= CONSUMER_REASONS


def test_check_signature_against_a_registry() -> None:
    alice, bob, eve = (SigningKey.generate() for _ in range(3))
    registry = Registry(run=RUN)
    registry = add_worker(registry, worker="alice-1", name="alice", key=alice.public, now=1.0)
    registry = add_worker(registry, worker="bob-1", name="bob", key=bob.public, now=1.0)
    registry = revoke_worker(add_worker(registry, worker="eve-1", name="eve", key=eve.public, now=1.0), "eve-1", now=2.0)
    at = RolloutKey("train", 0, "alice-1", 0)

    def reason(data: bytes, key: RolloutKey = at) -> str:
        with pytest.raises(RecordRejected) as exc:
            check_signature(data, key=key, registry=registry)
        return exc.value.reason

    assert check_signature(sign_record(RECORD, alice, run=RUN), key=at, registry=registry) == (RECORD, alice.key_id)
    assert reason(RECORD) == "unsigned"
    assert reason(sign_record(RECORD, SigningKey.generate(), run=RUN)) == "unknown_key"
    assert reason(sign_record(RECORD, eve, run=RUN), RolloutKey("train", 0, "eve-1", 0)) == "revoked"
    assert reason(sign_record(RECORD, bob, run=RUN)) == "key_mismatch"  # bob's key under alice's name
    assert reason(sign_record(RECORD, alice, run="other-run")) == "bad_signature"
    # An unsigned run (no registry): an envelope is unwrapped, a plain record passes as it is.
    assert check_signature(sign_record(RECORD, eve, run=RUN), key=at, registry=None) == (RECORD, None)
    assert check_signature(RECORD, key=at, registry=None) == (RECORD, None)


# -- a signed run, end to end --------------------------------------------------------------------
@dataclasses.dataclass
class SignedRun:
    run_key: SigningKey
    workers: dict[str, SigningKey]


async def setup_signed_run(store: Store, tiny: Tiny, workers: tuple[str, ...] = ("mac-a", "mac-b"), **kw: Any) -> SignedRun:
    """A run whose manifest names a run key, weights v0, and a registry holding `workers`."""
    run_key = SigningKey.generate()
    layout = RunLayout(RUN)
    manifest = RunManifest(
        run=RUN, model="tiny", task="synthetic", group_size=G, temperature=1.0, max_tokens=MAX_TOKENS,
        max_prompt_tokens=64, vocab_size=tiny.vocab, run_key=run_key.public.to_text(), **kw,
    )
    await store.put_if_absent(layout.run_manifest, manifest.to_bytes(run_key))
    await put_task_objects(store, RUN, "synthetic", {"train": make_task("synthetic", ITEMS).encode()}, key=run_key)
    await publish_versions(store, 0, key=run_key)
    keys = {w: SigningKey.generate() for w in workers}
    for worker, key in keys.items():
        await update_registry(store, RUN, run_key, functools.partial(add_worker, worker=worker, name=worker, key=key.public, now=1.0))
    return SignedRun(run_key, keys)


async def put(store: Store, data: bytes, worker: str, seq: int, ts_ms: int) -> str:
    key = RunLayout(RUN).rollout(worker, ts_ms, seq)
    await store.put_if_absent(key, data)
    return key


def signed(group: RolloutGroup, key: SigningKey) -> bytes:
    return sign_record(encode_group(group), key, run=RUN)


async def open_signed_consumer(
    store: Store, tiny: Tiny, store_url: str, run: SignedRun | None = None, *, state_key: SigningKey | None = None, **kw: Any
) -> RolloutConsumer:
    if run is not None:
        kw.setdefault("run_key", run.run_key.public.to_text())
    return await RolloutConsumer.open(
        store, config(store_url, **kw), decode=tiny.decode, eos_ids=frozenset({tiny.eos}), prompt_of=tiny.prompt,
        restore=False, state_key=state_key,
    )


async def test_every_record_attack_is_refused_and_counted(store: Store, store_url: str, tiny: Tiny) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a", "mac-b", "mac-c"))
    a, b, c = (run.workers[w] for w in ("mac-a", "mac-b", "mac-c"))
    await update_registry(store, RUN, run.run_key, lambda r: revoke_worker(r, "mac-c", now=2.0))
    base = now_ms() - 20_000
    good = [make_group(tiny, worker="mac-a", seq=0, prompt_index=0), make_group(tiny, worker="mac-b", seq=0, prompt_index=1)]
    honest = [await put(store, signed(good[0], a), "mac-a", 0, base), await put(store, signed(good[1], b), "mac-b", 0, base + 1)]
    attacks = {
        # a plain record: no signature at all
        "unsigned": (encode_group(make_group(tiny, worker="mac-a", seq=1, prompt_index=2)), "mac-a", 1),
        # signed by a key the run never registered
        "unknown_key": (signed(make_group(tiny, worker="mac-x", seq=0, prompt_index=3), SigningKey.generate()), "mac-x", 0),
        # signed by a revoked worker
        "revoked": (signed(make_group(tiny, worker="mac-c", seq=0, prompt_index=4), c), "mac-c", 0),
        # mac-b signs a record claiming to be mac-a's, uploaded under mac-a's name
        "key_mismatch": (signed(make_group(tiny, worker="mac-a", seq=2, prompt_index=5), b), "mac-a", 2),
        # a signature over other bytes: mac-a's envelope around a record it did not sign
        "bad_signature": (
            signed(make_group(tiny, worker="mac-a", seq=3, prompt_index=6), a)[:HEADER_LEN]
            + encode_group(make_group(tiny, worker="mac-a", seq=3, prompt_index=7)),
            "mac-a", 3,
        ),
    }
    for i, (data, worker, seq) in enumerate(attacks.values()):
        await put(store, data, worker, seq, base + 10 + i)
    # mac-a's signed record copied under another timestamp (a replay), and under mac-b's name
    # with mac-b's sequence number: the signature still verifies, nothing else does.
    original = signed(good[0], a)
    await put(store, original, "mac-a", 0, base + 100)
    await put(store, original, "mac-b", 0, base + 101)
    # A record signed for another run, uploaded into this one.
    await put(store, sign_record(encode_group(good[0]), a, run="other-run"), "mac-a", 9, base + 102)

    consumer = await open_signed_consumer(store, tiny, store_url, run, wait_timeout_s=1.0)
    batch = await consumer.next_batch(2, trainer_version=0)
    assert sorted(g.key for g in batch.groups) == sorted(honest)  # the trainer keeps its data
    with pytest.raises(ConsumerTimeout):
        await consumer.next_batch(1, trainer_version=0)
    counters = consumer.counters
    for reason in attacks:
        assert counters.get(f"rejected/{reason}", 0) >= 1, (reason, counters)
    assert counters["rejected/duplicate"] == 1  # same key, same bytes, another timestamp
    assert counters["rejected/key_mismatch"] == 2  # mac-b's key as mac-a; mac-a's record under mac-b's name
    assert counters["rejected/bad_signature"] == 2  # other bytes; another run
    assert counters["admitted"] == 2 and counters["groups_used"] == 2
    await consumer.close()


async def test_revocation_reaches_groups_waiting_in_the_pool(store: Store, store_url: str, tiny: Tiny) -> None:
    run = await setup_signed_run(store, tiny, reuse_limit=2)
    base = now_ms() - 10_000
    for i, worker in enumerate(("mac-a", "mac-a", "mac-b", "mac-b")):
        group = make_group(tiny, worker=worker, seq=i, prompt_index=i)
        await put(store, signed(group, run.workers[worker]), worker, i, base + i)
    consumer = await open_signed_consumer(store, tiny, store_url, run, wait_timeout_s=1.0, registry_refresh_s=0.01)
    first = await consumer.next_batch(4, trainer_version=0)
    assert {g.worker for g in first.groups} == {"mac-a", "mac-b"}  # all four stay in the pool for a second use
    await update_registry(store, RUN, run.run_key, lambda r: revoke_worker(r, "mac-a", now=3.0))
    await async_wait_until(consumer._trust.signers_due)  # the next batch reads the registry again
    second = await consumer.next_batch(2, trainer_version=0)
    assert {g.worker for g in second.groups} == {"mac-b"} and {g.use for g in second.groups} == {2}
    assert consumer.counters["rejected/revoked"] == 2  # mac-a's two groups, dropped before their second use
    with pytest.raises(ConsumerTimeout):
        await consumer.next_batch(1, trainer_version=0)
    # A record of mac-a signed after the revocation is refused too.
    await put(store, signed(make_group(tiny, worker="mac-a", seq=9, prompt_index=9), run.workers["mac-a"]), "mac-a", 9, now_ms())
    with pytest.raises(ConsumerTimeout):
        await consumer.next_batch(1, trainer_version=0)
    assert consumer.counters["rejected/revoked"] == 3
    await consumer.close()


async def test_a_key_added_after_the_consumer_opened_is_learned(store: Store, store_url: str, tiny: Tiny) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    consumer = await open_signed_consumer(store, tiny, store_url, run, wait_timeout_s=2.0, registry_refresh_s=3600.0)
    await put(store, signed(make_group(tiny, worker="mac-a", seq=0), run.workers["mac-a"]), "mac-a", 0, now_ms() - 1000)
    assert (await consumer.next_batch(1, trainer_version=0)).groups[0].worker == "mac-a"
    late = SigningKey.generate()
    await update_registry(store, RUN, run.run_key, lambda r: add_worker(r, worker="mac-new", name="new", key=late.public, now=5.0))
    await put(store, signed(make_group(tiny, worker="mac-new", seq=0, prompt_index=3), late), "mac-new", 0, now_ms())
    batch = await consumer.next_batch(1, trainer_version=0)  # read again at once: the key was unknown
    assert batch.groups[0].worker == "mac-new" and "rejected/unknown_key" not in consumer.counters
    await consumer.close()


async def test_forged_and_rolled_back_registries_are_ignored(store: Store, store_url: str, tiny: Tiny) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    layout = RunLayout(RUN)
    before_revoke = await store.get_bytes(layout.registry)  # serial 1, mac-a not revoked
    await update_registry(store, RUN, run.run_key, lambda r: revoke_worker(r, "mac-a", now=3.0))
    consumer = await open_signed_consumer(store, tiny, store_url, run, wait_timeout_s=0.5, registry_refresh_s=0.01)
    await put(store, signed(make_group(tiny, worker="mac-a", seq=0), run.workers["mac-a"]), "mac-a", 0, now_ms() - 5000)
    with pytest.raises(ConsumerTimeout):
        await consumer.next_batch(1, trainer_version=0)
    assert consumer.counters["rejected/revoked"] == 1
    # A worker token puts the old signed copy back (before the revocation): refused as older.
    await store.put(layout.registry, before_revoke)
    await put(store, signed(make_group(tiny, worker="mac-a", seq=1, prompt_index=1), run.workers["mac-a"]), "mac-a", 1, now_ms() - 4000)
    with pytest.raises(ConsumerTimeout):
        await consumer.next_batch(1, trainer_version=0)
    assert consumer.counters["rejected/revoked"] == 2 and consumer.counters["registry_rollback"] >= 1
    # A registry signed by a key of the attacker's, naming the attacker's worker key: ignored.
    mallory, forger = SigningKey.generate(), SigningKey.generate()
    forged = add_worker(Registry(run=RUN, serial=99), worker="mac-m", name="m", key=mallory.public, now=1.0)
    await store.put(layout.registry, registry_bytes(forged, forger))
    await put(store, signed(make_group(tiny, worker="mac-m", seq=0, prompt_index=2), mallory), "mac-m", 0, now_ms() - 3000)
    with pytest.raises(ConsumerTimeout):
        await consumer.next_batch(1, trainer_version=0)
    assert consumer.counters["rejected/unknown_key"] == 1 and consumer.counters["registry_invalid"] >= 1
    await consumer.save_state()
    await consumer.close()
    # A restarted trainer resumes from its saved state, which holds the registry serial it had
    # read: the old copy put back before the restart is refused there too.
    await store.put(layout.registry, before_revoke)
    restarted = await open_signed_consumer(store, tiny, store_url, run, wait_timeout_s=0.5, registry_refresh_s=0.01)
    assert await restarted.load_from_bucket()
    await put(store, signed(make_group(tiny, worker="mac-a", seq=2, prompt_index=2), run.workers["mac-a"]), "mac-a", 2, now_ms() - 2000)
    with pytest.raises(ConsumerTimeout):
        await restarted.next_batch(1, trainer_version=0)
    assert restarted.counters["rejected/unknown_key"] == 2  # the revoked key is not back
    assert restarted.counters["registry_rollback"] >= 2 and restarted.state_dict()["registry_serial"] == 2
    await restarted.close()


async def test_the_trainer_refuses_a_manifest_naming_another_run_key(store: Store, store_url: str, tiny: Tiny) -> None:
    await setup_signed_run(store, tiny)
    expected = SigningKey.generate().public.to_text()
    with pytest.raises(ValueError, match="not the pinned key"):
        await open_signed_consumer(store, tiny, store_url, run_key=expected)


async def test_unsigned_runs_take_plain_and_enveloped_records(store: Store, store_url: str, tiny: Tiny) -> None:
    from tests.test_consumer import setup_run

    await setup_run(store, tiny)
    base = now_ms() - 5000
    await put(store, encode_group(make_group(tiny, worker="mac-a", seq=0)), "mac-a", 0, base)
    await put(store, signed(make_group(tiny, worker="mac-b", seq=0, prompt_index=1), SigningKey.generate()), "mac-b", 0, base + 1)
    consumer = await open_signed_consumer(store, tiny, store_url, wait_timeout_s=1.0)
    batch = await consumer.next_batch(2, trainer_version=0)
    assert {g.worker for g in batch.groups} == {"mac-a", "mac-b"}
    assert not [k for k in consumer.counters if k.startswith("rejected/")]
    # A signed trainer never opens it: the run has no key.
    with pytest.raises(ValueError, match="no run key"):
        await open_signed_consumer(store, tiny, store_url, run_key=SigningKey.generate().public.to_text())
    await consumer.close()


async def test_a_forged_pointer_does_not_make_a_forged_version_published(store: Store, store_url: str, tiny: Tiny) -> None:
    """An attacker publishes v1 without the run key and moves the pointer: the consumer reads the
    pointer and manifests through the run's trust, keeps v0 as the published versions, and a
    record claiming the forged v1 is refused as `version` while v0 records are admitted. (A
    forged pointer is denial of service, never corruption: with two buckets a worker's token
    cannot write it at all.)"""
    run = await setup_signed_run(store, tiny)
    base = now_ms() - 10_000
    await put(store, signed(make_group(tiny, worker="mac-a", seq=0, prompt_index=0), run.workers["mac-a"]), "mac-a", 0, base)
    consumer = await open_signed_consumer(store, tiny, store_url, run, wait_timeout_s=1.0)
    assert [g.worker for g in (await consumer.next_batch(1, trainer_version=0)).groups] == ["mac-a"]

    await publish_versions(store, 1)  # the forgery: an unsigned publisher moves the pointer to its own v1
    forged = msgspec.structs.replace(
        make_group(tiny, worker="mac-b", seq=0, prompt_index=1), weight_version=1, state_digest=digest_of(1)
    )
    await put(store, signed(forged, run.workers["mac-b"]), "mac-b", 0, base + 1)
    honest = make_group(tiny, worker="mac-a", seq=1, prompt_index=2)
    await put(store, signed(honest, run.workers["mac-a"]), "mac-a", 1, base + 2)
    batch = await consumer.next_batch(1, trainer_version=0)
    assert [(g.worker, g.weight_version) for g in batch.groups] == [("mac-a", 0)]
    with pytest.raises(ConsumerTimeout):
        await consumer.next_batch(1, trainer_version=0)
    assert consumer.counters["rejected/version"] == 1
    await consumer.close()


async def test_the_trainer_signs_its_state_and_refuses_a_forged_one(store: Store, store_url: str, tiny: Tiny) -> None:
    """With one bucket a worker's token can overwrite the trainer's state object: a forged cursor
    or reuse ledger would make the trainer re-use or skip groups. The trainer holding the run key
    signs the state it saves and refuses one no run key signed; a state restored from elsewhere
    (slime's checkpoint) then replaces the forgery."""
    run = await setup_signed_run(store, tiny)
    base = now_ms() - 10_000
    for seq in range(2):
        await put(store, signed(make_group(tiny, worker="mac-a", seq=seq, prompt_index=seq), run.workers["mac-a"]), "mac-a", seq, base + seq)
    first = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key, wait_timeout_s=1.0)
    assert len((await first.next_batch(2, trainer_version=0)).groups) == 2
    await first.save_state()
    checkpoint = first.state_dict()  # what slime's checkpoint holds
    await first.close()
    saved = json.loads(await store.get_bytes(state_key(RUN)))
    assert saved["signature"]["key"] == run.run_key.key_id

    again = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key)
    assert (await again.bucket_state()) == checkpoint  # its own signed state reads back
    await again.close()

    forged = {k: v for k, v in saved.items() if k != "signature"} | {"cursor": "", "seen": [], "ledger": {}}
    await store.put(state_key(RUN), json.dumps(forged).encode())  # "start over": every group again
    victim = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key, wait_timeout_s=1.0)
    with pytest.raises(UntrustedState, match="not signed"):
        await victim.load_from_bucket()
    victim.load_state_dict(checkpoint)  # resumed from the checkpoint instead
    with pytest.raises(ConsumerTimeout):  # neither group is used again
        await victim.next_batch(1, trainer_version=0)
    await victim.save_state()  # replaces the forgery
    assert json.loads(await store.get_bytes(state_key(RUN)))["signature"]["key"] == run.run_key.key_id
    await victim.close()


async def test_a_revocation_read_while_a_record_waits_for_its_version_refuses_it(
    store: Store, store_url: str, tiny: Tiny
) -> None:
    """A record claiming a version the consumer has not read yet waits for a read of the published
    versions; a registry read during that wait that revokes its key refuses it (it never reaches
    the pool, where the revocation's sweep has already run)."""
    run = await setup_signed_run(store, tiny)
    consumer = await open_signed_consumer(store, tiny, store_url, run, wait_timeout_s=1.0)
    versions, trust = consumer._versions, consumer._trust
    real_refresh = versions.refresh
    revoked_during: list[int] = []

    async def refresh(after: int) -> None:
        if inspect.stack()[1].function == "take" and not revoked_during:  # the record's own wait
            await publish_versions(store, 1, key=run.run_key)  # what it waits for
            await update_registry(store, RUN, run.run_key, lambda r: revoke_worker(r, "mac-a", now=3.0))
            await trust.refresh_signers()  # another download's registry read, landing during this one
            revoked_during.append(after)
        await real_refresh(after)

    versions.refresh = refresh  # type: ignore[method-assign]
    group = make_group(tiny, worker="mac-a", seq=0, prompt_index=0, weight_version=1)
    await put(store, signed(group, run.workers["mac-a"]), "mac-a", 0, now_ms() - 10_000)
    with pytest.raises(ConsumerTimeout):
        await consumer.next_batch(1, trainer_version=1)
    assert revoked_during, "the record never waited for a read of the published versions"
    assert consumer.counters["rejected/revoked"] == 1 and consumer.counters.get("admitted", 0) == 0
    await consumer.close()


async def test_stoa_worker_release_lifts_a_quarantine_through_the_registry(store: Store, store_url: str, tiny: Tiny) -> None:
    """`stoa worker release` raises the worker's `releases` in the signed registry; the consumer's
    next registry read lifts the quarantine and the worker's groups are used again."""
    run = await setup_signed_run(store, tiny)
    consumer = await open_signed_consumer(store, tiny, store_url, run, wait_timeout_s=1.0, registry_refresh_s=0.01)
    assert consumer.observe_logprob_gap("mac-a", 5.0, 4096) == ["mac-a"]  # far off the learner: quarantined
    base = now_ms() - 10_000
    await put(store, signed(make_group(tiny, worker="mac-a", seq=0, prompt_index=0), run.workers["mac-a"]), "mac-a", 0, base)
    with pytest.raises(ConsumerTimeout):
        await consumer.next_batch(1, trainer_version=0)
    assert "mac-a" in consumer.quarantined and consumer.counters["rejected/quarantined"] == 1

    await update_registry(store, RUN, run.run_key, lambda r: release_worker(r, "mac-a"))
    await async_wait_until(consumer._trust.signers_due)  # the next batch reads the registry again
    await put(store, signed(make_group(tiny, worker="mac-a", seq=1, prompt_index=1), run.workers["mac-a"]), "mac-a", 1, base + 1)
    batch = await consumer.next_batch(1, trainer_version=0)
    assert [g.worker for g in batch.groups] == ["mac-a"] and "mac-a" not in consumer.quarantined
    await consumer.close()
