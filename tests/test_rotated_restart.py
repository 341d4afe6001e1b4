"""A trainer restarted with a rotated run key (`stoa keys rotate`, then the new key file as
`stoa_run_key`): it knows only its new key, run.json names the run's first key. Each rotation
carries its new key's acceptance of the key before it, so the new key vouches for the first key
(`run_trust.vouched_first_key`): the consumer pins run.json to it, and the publisher tells a
forged run.json from the genuine one even with no copy kept and an old pointer put back."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.cli.keys_cmd import rotate_in
from slime_stoa.protocol.kept import TrainerCopies
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.history import read_pointer
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig, UntrustedState
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.pulse.sync_result import WeightsRefused
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import (
    RunTrust,
    Untrusted,
    Unvouched,
    first_run_key,
    rotation_document,
    vouched_first_key,
)
from slime_stoa.protocol.signing import SigningKey, canonical_json, sign_document
from slime_stoa.protocol.store import Store
from tests.test_consumer import Tiny, make_group, now_ms, tiny, weights
from tests.test_signed_records import open_signed_consumer, put, setup_signed_run, signed
from tests.test_trust_publisher_manifest import RUN as PUB_RUN
from tests.test_trust_publisher_manifest import forge_manifest, signed_run
from tests.test_trust_writer import batches, records

from .forged_weights import step_state

__all__ = ["tiny"]  # the session fixture

pytestmark = pytest.mark.both_backends

RUN = "rotated"


def test_a_rotation_carries_the_new_keys_acceptance_of_the_key_before_it() -> None:
    first, second, third = (SigningKey.generate() for _ in range(3))
    trust = RunTrust(RUN, first.public)
    trust.learn(rotation_document(RUN, 1, second, 4, first), "keys/1")
    trust.learn(rotation_document(RUN, 2, third, 9, second), "keys/2")
    assert trust.vouched_back_from(third.public) and trust.vouched_back_from(second.public)
    assert not trust.vouched_back_from(SigningKey.generate().public)
    # Without the private half of the new key, a rotation carries no acceptance: learned (readers
    # pinned to the first key need none), but it vouches for nothing.
    legacy = RunTrust(RUN, first.public)
    legacy.learn(rotation_document(RUN, 1, second.public, 4, first), "keys/1")
    assert legacy.newest == second.public and not legacy.vouched_back_from(second.public)
    # An acceptance of another rotation (here naming another key before it) is refused.
    forger = SigningKey.generate()
    moved = dict(rotation_document(RUN, 1, second, 4, forger))  # `second` accepted `forger` before it
    moved.pop("signature")
    with pytest.raises(Untrusted, match="another rotation"):
        RunTrust(RUN, first.public).learn(sign_document(moved, first), "keys/1")
    tampered = rotation_document(RUN, 1, second, 4, first)
    tampered["accepted"] = {**tampered["accepted"], "seq": 2}
    with pytest.raises(Untrusted):
        RunTrust(RUN, first.public).learn(sign_document({k: v for k, v in tampered.items() if k != "signature"}, first), "k")


async def test_the_first_key_is_found_back_from_a_rotated_key(store: Store) -> None:
    first, second, third = (SigningKey.generate() for _ in range(3))
    layout = RunLayout(RUN)
    assert await vouched_first_key(store, RUN, first.public) == first.public  # no rotation names it
    await store.put(layout.key_rotation(1), canonical_json(rotation_document(RUN, 1, second, 4, first)))
    await store.put(layout.key_rotation(2), canonical_json(rotation_document(RUN, 2, third, 9, second)))
    assert await vouched_first_key(store, RUN, third.public) == first.public
    assert await vouched_first_key(store, RUN, second.public) == first.public
    assert await first_run_key(store, RUN, third.public.to_text()) == first.public.to_text()
    # A bucket writer's rotation to the trainer's key, from a key of its own: no acceptance, so the
    # trainer's key vouches for nothing (and the writer cannot make one without that key).
    forger = SigningKey.generate()
    await store.put(layout.key_rotation(1), canonical_json(rotation_document(RUN, 1, second.public, 4, forger)))
    with pytest.raises(Unvouched):
        await vouched_first_key(store, RUN, second.public)
    assert await first_run_key(store, RUN, second.public.to_text()) == second.public.to_text()


async def test_a_consumer_restarted_with_the_rotated_key_admits_records(
    store: Store, store_url: str, tiny: Tiny
) -> None:
    """As the slime plugin configures it: run_key is the public half of the trainer's key file."""
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    new = SigningKey.generate()
    await rotate_in(store, "consume", run.run_key, new)
    await records(store, tiny, run, "mac-a", range(2), now_ms() - 20_000)
    c = await open_signed_consumer(store, tiny, store_url, run_key=new.public.to_text(), state_key=new)
    try:
        assert await batches(c, 2) == ["mac-a", "mac-a"]
    finally:
        await c.close()


async def test_a_publisher_with_the_rotated_key_outlives_a_forged_manifest_and_an_old_pointer(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """No copy kept, run.json replaced by the forger's, and the pointer the old key signed put
    back over the one the rotation re-signed: the new key's rotation vouches for the first key,
    so the publisher goes on under the run's genuine keys, and a worker pinned to the first key
    follows what it publishes."""
    old, new = SigningKey.generate(), SigningKey.generate()
    state = await signed_run(store, old, None)
    before = await store.get_bytes(RunLayout(PUB_RUN).pointer)  # v0's pointer, signed by `old`
    await rotate_in(store, PUB_RUN, old, new)
    await forge_manifest(store)
    await store.put(RunLayout(PUB_RUN).pointer, before)
    pub = Publisher(store, PUB_RUN, key=new)
    with caplog.at_level(logging.WARNING, logger="stoa.pulse"):
        assert await pub.open() == 0
    assert any("forgery" in r.getMessage() and old.key_id in r.getMessage() for r in caplog.records)
    assert pub.trust is not None and pub.trust.pinned == old.public and pub.trust.newest == new.public
    assert (await pub.publish(step_state(state, np.random.default_rng(5)))).version == 1
    follower = Subscriber(store, PUB_RUN, trust=RunTrust(PUB_RUN, old.public))
    assert await follower.sync() is not None and follower.version == 1
    # The key rotated away is still refused, forged manifest or not.
    with pytest.raises(UntrustedState):
        await Publisher(store, PUB_RUN, key=old).open()


async def test_a_writers_rotation_to_the_trainers_key_does_not_make_its_key_the_runs(store: Store) -> None:
    """run.json and rotation 1 replaced by a writer's (its own key first, then a rotation to the
    trainer's new key, which any key can sign, claiming every version up to 10^9): nothing
    vouches for the writer's key, so the publisher trusts nothing it signed. With no copy kept,
    nothing vouches for what the old key signed either: it refuses to resume, and resumes once
    the genuine rotation is back."""
    old, new = SigningKey.generate(), SigningKey.generate()
    state = await signed_run(store, old, None)
    await rotate_in(store, PUB_RUN, old, new)
    rotation = RunLayout(PUB_RUN).key_rotation(1)
    genuine = await store.get_bytes(rotation)
    forger = await forge_manifest(store)
    await store.put(rotation, canonical_json(rotation_document(PUB_RUN, 1, new.public, 10**9, forger)))
    with pytest.raises(UntrustedState, match="from v0"):
        await Publisher(store, PUB_RUN, key=new).open()
    await store.put(rotation, genuine)
    pub = Publisher(store, PUB_RUN, key=new)
    assert await pub.open() == 0
    assert pub.trust is not None and pub.trust.pinned == old.public and not pub.trust.knows(forger.key_id)
    assert (await pub.publish(step_state(state, np.random.default_rng(6)))).version == 1


async def test_a_kept_rotation_is_put_back_over_a_writers(store: Store, tmp_path: Path) -> None:
    """With a keep_dir the trainer keeps each rotation it verified, and puts it back (with its
    run manifest) when a bucket writer replaces both: the run's genuine keys are in the bucket
    again for every reader, a worker that never ran before included."""
    old, new, keep = SigningKey.generate(), SigningKey.generate(), tmp_path / "kept"
    state = await signed_run(store, old, None)
    await rotate_in(store, PUB_RUN, old, new)
    assert await Publisher(store, PUB_RUN, PublisherConfig(keep_dir=keep), key=new).open() == 0  # keeps both
    layout = RunLayout(PUB_RUN)
    genuine = {key: await store.get_bytes(key) for key in (layout.key_rotation(1), layout.run_manifest)}
    forger = await forge_manifest(store)
    await store.put(layout.key_rotation(1), canonical_json(rotation_document(PUB_RUN, 1, new.public, 10**9, forger)))
    pub = Publisher(store, PUB_RUN, PublisherConfig(keep_dir=keep), key=new)
    assert await pub.open() == 0
    assert {key: await store.get_bytes(key) for key in genuine} == genuine
    assert (await pub.publish(step_state(state, np.random.default_rng(7)))).version == 1
    newcomer = Subscriber(store, PUB_RUN, trust=RunTrust(PUB_RUN, old.public))
    assert await newcomer.sync() is not None and newcomer.version == 1
    await store.delete(layout.key_rotation(1))  # gone: put back as well
    assert await Publisher(store, PUB_RUN, PublisherConfig(keep_dir=keep), key=new).open() == 1
    assert await store.get_bytes(layout.key_rotation(1)) == genuine[layout.key_rotation(1)]


async def test_a_running_publisher_puts_back_the_run_documents_at_its_next_version(store: Store, tmp_path: Path) -> None:
    """Mid-run, no restart: a writer replaces rotation 1 and run.json (or deletes them); the
    publisher's next version puts its kept copies back, so a worker that joins after it finds
    the run's genuine keys."""
    old, new, keep = SigningKey.generate(), SigningKey.generate(), tmp_path / "kept"
    state = await signed_run(store, old, None)
    await rotate_in(store, PUB_RUN, old, new)
    pub = Publisher(store, PUB_RUN, PublisherConfig(keep_dir=keep), key=new)
    assert await pub.open() == 0
    layout = RunLayout(PUB_RUN)
    genuine = {key: await store.get_bytes(key) for key in (layout.key_rotation(1), layout.run_manifest)}
    rng = np.random.default_rng(8)
    for spoil in ("replace", "delete"):
        if spoil == "replace":
            forger = await forge_manifest(store)
            await store.put(layout.key_rotation(1), canonical_json(rotation_document(PUB_RUN, 1, new.public, 10**9, forger)))
        else:
            for key in genuine:
                await store.delete(key)
        newcomer = Subscriber(store, PUB_RUN, trust=RunTrust(PUB_RUN, old.public))
        with pytest.raises(WeightsRefused):  # the pointer is signed by a key nothing vouches for now
            await newcomer.sync()
        state = step_state(state, rng)
        await pub.publish(state)
        assert {key: await store.get_bytes(key) for key in genuine} == genuine, spoil
        newcomer = Subscriber(store, PUB_RUN, trust=RunTrust(PUB_RUN, old.public))
        assert await newcomer.sync() is not None and newcomer.version == pub.version


async def test_preflight_takes_the_rotated_key_for_the_runs(store: Store, tmp_path: Path) -> None:
    """`stoa preflight` reads the run's rotations: the new key file is the run's, the old one is
    named as the key a rotation replaced."""
    import argparse

    from slime_stoa.protocol.run_manifest import read_run_manifest
    from slime_stoa.protocol.signing import write_key_file
    from slime_stoa.trainer.slime.preflight import check_run_key, run_keys

    old, new = SigningKey.generate(), SigningKey.generate()
    await signed_run(store, old, None)
    await rotate_in(store, PUB_RUN, old, new)
    manifest = await read_run_manifest(store, PUB_RUN)
    keys = await run_keys(store, PUB_RUN, manifest)
    assert keys == (old.public.to_text(), new.public.to_text())

    def finding(key: SigningKey, name: str) -> tuple[str, str]:
        path = write_key_file(tmp_path / name, key)
        found = check_run_key(argparse.Namespace(stoa_publish=True, stoa_run_key=str(path)), manifest, keys)
        return found.status, found.message

    assert finding(new, "new.key") == ("ok", f"stoa_run_key is the run's key {new.key_id}, rotation 1 (mode 0600)")
    status, message = finding(old, "old.key")
    assert status == "fix" and "rotation 1 replaced" in message and new.key_id in message


async def test_the_consumer_puts_back_a_kept_rotation_before_the_publisher_runs(
    store: Store, store_url: str, tiny: Tiny, tmp_path: Path
) -> None:
    """The consumer keeps the rotations too (its own keep_dir): restarted before the publisher,
    it puts back run.json and the rotation a writer replaced, and admits records drawn from a
    version the new key signed."""
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    new = SigningKey.generate()
    await rotate_in(store, "consume", run.run_key, new)
    pub = Publisher(store, "consume", PublisherConfig(catchup=False), key=new)
    await pub.open()
    await pub.publish(weights(1))  # v1, signed by the new key
    keep = str(tmp_path / "consumer-kept")
    first = await open_signed_consumer(store, tiny, store_url, run_key=new.public.to_text(), state_key=new, keep_dir=keep)
    await first.close()  # kept run.json and rotation 1
    layout = RunLayout("consume")
    genuine = {key: await store.get_bytes(key) for key in (layout.run_manifest, layout.key_rotation(1))}
    forger = SigningKey.generate()
    await store.put(layout.run_manifest, replace(RunManifest.from_bytes(genuine[layout.run_manifest]),
                                                 run_key=forger.public.to_text()).to_bytes(forger))
    await store.put(layout.key_rotation(1), canonical_json(rotation_document("consume", 1, new.public, 10**9, forger)))
    base = now_ms() - 20_000
    for seq in range(2):
        group = make_group(tiny, worker="mac-a", seq=seq, prompt_index=seq, weight_version=1)
        await put(store, signed(group, run.workers["mac-a"]), "mac-a", seq, base + seq)
    c = await open_signed_consumer(store, tiny, store_url, run_key=new.public.to_text(), state_key=new, keep_dir=keep)
    try:
        assert {key: await store.get_bytes(key) for key in genuine} == genuine
        assert [g.group.worker_id for g in (await c.next_batch(2, trainer_version=1)).groups] == ["mac-a", "mac-a"]
    finally:
        await c.close()


def racing_rotation(monkeypatch: pytest.MonkeyPatch, store: Store, run: str, new: SigningKey, forger: SigningKey) -> None:
    """A writer flipping rotation 1 between the publisher's reads: gone while the acceptances are
    followed (`vouched_first_key`), its own rotation to the trainer's key (no acceptance) when the
    rotations are learned."""
    from slime_stoa.protocol.pulse import commit

    rotation, real = RunLayout(run).key_rotation(1), commit.vouched_first_key

    async def flipped(store_: Store, run_: str, key: object) -> object:
        await store.delete(rotation)
        first = await real(store_, run_, key)  # type: ignore[arg-type]
        await store.put(rotation, canonical_json(rotation_document(run, 1, new.public, 10**9, forger)))
        return first

    monkeypatch.setattr(commit, "vouched_first_key", flipped)


async def test_a_rotation_flipped_between_reads_does_not_make_a_writers_key_the_runs(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The acceptances are judged on the rotations learned, not on an earlier read: with or
    without a keep_dir, the writer's key is never trusted, and the kept run manifest is never
    replaced by the writer's."""
    old, new, keep = SigningKey.generate(), SigningKey.generate(), tmp_path / "kept"
    await signed_run(store, old, None)
    await rotate_in(store, PUB_RUN, old, new)
    assert await Publisher(store, PUB_RUN, PublisherConfig(keep_dir=keep), key=new).open() == 0
    genuine = TrainerCopies(keep).kept(RunLayout(PUB_RUN).run_manifest)
    forger = await forge_manifest(store)
    racing_rotation(monkeypatch, store, PUB_RUN, new, forger)
    for config in (PublisherConfig(), PublisherConfig(keep_dir=keep)):
        pub = Publisher(store, PUB_RUN, config, key=new)
        with contextlib.suppress(UntrustedState):  # nothing vouches for v0 then: a refusal is fine, a forger's key is not
            await pub.open()
        assert pub.trust is None or not pub.trust.knows(forger.key_id)
        assert TrainerCopies(keep).kept(RunLayout(PUB_RUN).run_manifest) == genuine


async def test_a_legacy_rotation_is_taken_from_the_kept_run_manifest(store: Store, tmp_path: Path) -> None:
    """A rotation written by an older stoa (no acceptance): a trainer that kept the run manifest
    before resumes with its new key; one that kept nothing is not led by the bucket's word."""
    old, new, keep = SigningKey.generate(), SigningKey.generate(), tmp_path / "kept"
    await signed_run(store, old, keep)  # the old key's publisher kept run.json
    layout = RunLayout(PUB_RUN)
    await store.put(layout.key_rotation(1), canonical_json(rotation_document(PUB_RUN, 1, new.public, 0, old)))
    pointer = await read_pointer(store, PUB_RUN)
    await store.put(layout.pointer, pointer.to_bytes(new))  # a rotation re-signs the pointer
    pub = Publisher(store, PUB_RUN, PublisherConfig(keep_dir=keep), key=new)
    assert await pub.open() == 0
    assert pub.trust is not None and pub.trust.pinned == old.public and pub.trust.newest == new.public
    with pytest.raises(UntrustedState):  # nothing kept, nothing of the new key's in the bucket
        await Publisher(store, PUB_RUN, key=new).open()


async def test_a_kept_pointer_from_before_the_rotation_is_not_put_back(store: Store, tmp_path: Path) -> None:
    """The trainer's copy of the pointer was signed by the key a rotation replaced: garbage over
    the pointer is not answered with that copy (refused by every reader), the pointer is written
    again at the highest signed version, signed by the new key."""
    old, new, keep = SigningKey.generate(), SigningKey.generate(), tmp_path / "kept"
    state = await signed_run(store, old, keep)  # keeps the pointer the old key signed
    await rotate_in(store, PUB_RUN, old, new)
    await store.put(RunLayout(PUB_RUN).pointer, b'{"format": "garbage"}')
    pub = Publisher(store, PUB_RUN, PublisherConfig(keep_dir=keep), key=new)
    assert await pub.open() == 0
    assert (await read_pointer(store, PUB_RUN, trust=RunTrust(PUB_RUN, old.public))).version == 0
    assert (await pub.publish(step_state(state, np.random.default_rng(8)))).version == 1


async def test_a_rotation_replaces_a_writers_junk_at_its_number(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Junk at keys/000001.json (readers pass it over) does not block `stoa keys rotate`; a
    rotation the old key signed there (another rotation meanwhile) does."""
    from slime_stoa.protocol.store import PreconditionFailed

    old, new = SigningKey.generate(), SigningKey.generate()
    await signed_run(store, old, None)
    await store.put(RunLayout(PUB_RUN).key_rotation(1), b"junk")
    assert await rotate_in(store, PUB_RUN, old, new) == (1, 0)
    assert await vouched_first_key(store, PUB_RUN, new.public) == old.public
    racing = canonical_json(rotation_document(PUB_RUN, 2, SigningKey.generate(), 0, new))
    put_if_absent = store.put_if_absent

    async def after_another(key: str, data: bytes) -> object:  # another rotation lands first
        await store.put(key, racing)
        return await put_if_absent(key, data)

    monkeypatch.setattr(store, "put_if_absent", after_another)
    with pytest.raises(PreconditionFailed):
        await rotate_in(store, PUB_RUN, new, SigningKey.generate())
    assert await store.get_bytes(RunLayout(PUB_RUN).key_rotation(2)) == racing
