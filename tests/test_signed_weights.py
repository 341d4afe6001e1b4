"""Signed weights: every forged or corrupted weight object is refused and counted, the worker's
subscriber keeps its last good weights; rotation; the publisher refuses a state it did not sign."""

from __future__ import annotations

import json

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.anchor import fetch_verified
from slime_stoa.protocol.pulse.history import HistoryError, read_pointer
from slime_stoa.protocol.pulse.manifests import AnchorFile, PatchRef
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig, UntrustedState
from slime_stoa.protocol.pulse.rebuild import rebuild
from slime_stoa.protocol.pulse.subscriber import Subscriber, WeightsRefused
from slime_stoa.protocol.run_manifest import RunKeyMismatch, RunManifest, read_run_manifest
from slime_stoa.protocol.run_trust import (
    ContentMismatch,
    RunTrust,
    Untrusted,
    content_hash,
    load_rotations,
    rotation_document,
)
from slime_stoa.protocol.signing import SigningKey, canonical_json
from slime_stoa.protocol.store import Store

from .forged_weights import CASES, Case, honest_run, random_state, run_case, step_state, tally

RUN = "signed"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_each_forgery_is_refused_counted_and_the_weights_kept(store: Store, case: Case) -> None:
    h = await honest_run(store, RUN, np.random.default_rng(1))
    outcome = await run_case(h, case)
    assert outcome.refused, f"{case.name}: {outcome.message}"
    assert not outcome.applied, case.name
    assert outcome.version == (None if case.fresh else 1), case.name


async def test_the_forgery_tally_counts_every_case(store: Store) -> None:
    async def same_store(run: str) -> Store:
        return store

    counts = await tally(same_store, seed=20)
    assert counts == {"weights_forged_tried": len(CASES), "weights_forged_applied": 0,
                      "weights_forged_refused": len(CASES)}


async def test_the_same_bucket_unforged_is_accepted(store: Store) -> None:
    """The checks refuse forgeries only: a victim reaches the honest v2, fresh ones too."""
    h = await honest_run(store, RUN, np.random.default_rng(2))
    result = await h.victim.sync()
    assert result is not None and h.victim.version == 2 and h.victim.refused == 0
    assert h.victim.state is not None
    assert all(np.array_equal(h.victim.state[k], h.states[2][k]) for k in h.states[2])
    fresh = Subscriber(store, RUN, trust=h.trust())
    assert (await fresh.sync()) is not None and fresh.version == 2 and fresh.refused == 0


async def test_a_refused_object_is_counted_once_and_the_run_recovers(store: Store) -> None:
    h = await honest_run(store, RUN, np.random.default_rng(3))
    signed = await store.get_bytes(RunLayout(RUN).pointer)
    await CASES[2].mutate(h)  # the pointer rewritten unsigned
    with pytest.raises(WeightsRefused, match="not signed"):
        await h.victim.sync()
    assert await h.victim.sync() is None  # the same bytes: skipped until the pointer changes
    assert h.victim.refused == 1 and "not signed" in h.victim.last_refusal and h.victim.version == 1
    # A trainer restarting now keeps no copy of its pointer, but the bucket holds its signed
    # manifests: it resumes at the highest (v2) and writes the pointer again, which the victim follows.
    assert await Publisher(store, RUN, PublisherConfig(), key=h.key).open() == 2
    assert await store.get_bytes(RunLayout(RUN).pointer) != signed  # re-signed: a new updated_at
    assert (await h.victim.sync()) is not None and h.victim.version == 2 and h.victim.refused == 1
    # Once the old signed pointer is back, the trainer resumes from it as well.
    await store.put(RunLayout(RUN).pointer, signed)
    assert await Publisher(store, RUN, PublisherConfig(), key=h.key).open() == 2


async def test_a_deleted_pointer_is_written_again_at_the_highest_signed_version(store: Store) -> None:
    """No copy kept: the publisher does not start the run over at v0 (which its own signed v0
    would refuse), it resumes at the highest signed version and writes the pointer again."""
    h = await honest_run(store, RUN, np.random.default_rng(31))
    await store.delete(RunLayout(RUN).pointer)
    pub = Publisher(store, RUN, PublisherConfig(), key=h.key)
    assert await pub.open() == 2
    assert (await read_pointer(store, RUN, trust=h.trust())).version == 2
    assert (await pub.publish(step_state(h.states[2], np.random.default_rng(32)))).version == 3
    assert (await h.victim.sync()) is not None and h.victim.version == 3


async def test_unsigned_runs_are_not_checked(store: Store) -> None:
    """Back compat: no trust, no key: unsigned documents work as before."""
    rng = np.random.default_rng(4)
    pub, sub = Publisher(store, RUN), Subscriber(store, RUN)
    state = random_state(rng)
    await pub.publish(state)
    await pub.publish(step_state(state, rng))
    assert (await sub.sync()) is not None and sub.version == 1
    raw = json.loads(await store.get_bytes(RunLayout(RUN).pointer))
    assert "signature" not in raw
    with pytest.raises(WeightsRefused, match="not signed"):
        await Subscriber(store, RUN, trust=RunTrust(RUN, SigningKey.generate().public)).sync()


async def test_the_publisher_refuses_to_resume_from_a_state_it_did_not_sign(store: Store) -> None:
    rng = np.random.default_rng(5)
    state = random_state(rng)
    await Publisher(store, RUN).publish(state)  # unsigned v0
    key = SigningKey.generate()
    with pytest.raises(UntrustedState, match="not signed"):
        await Publisher(store, RUN, key=key).open()
    other = "signed-2"
    await Publisher(store, other, key=key).publish(state)
    with pytest.raises(UntrustedState, match="unknown key"):
        await Publisher(store, other, key=SigningKey.generate()).open()
    resumed = Publisher(store, other, key=key)
    assert await resumed.open() == 0
    assert (await resumed.publish(step_state(state, rng))).version == 1


async def test_the_publisher_refuses_a_key_that_is_not_the_run_key(store: Store) -> None:
    key, other = SigningKey.generate(), SigningKey.generate()
    manifest = RunManifest(run=RUN, model="m", task="synthetic", run_key=key.public.to_text())
    await store.put(RunLayout(RUN).run_manifest, manifest.to_bytes(key))
    with pytest.raises(UntrustedState, match="not the current key"):
        await Publisher(store, RUN, key=other).publish(random_state(np.random.default_rng(6)))
    assert await Publisher(store, RUN, key=key).open() is None


async def test_rebuild_with_a_trust_refuses_a_forged_state(store: Store) -> None:
    h = await honest_run(store, RUN, np.random.default_rng(7))
    rebuilt = await rebuild(store, RUN, trust=h.trust())
    assert rebuilt.manifest.version == 2
    await CASES[1].mutate(h)  # an attacker-signed anchor of its own weights as v3
    assert (await rebuild(store, RUN)).manifest.version == 3  # unverified: the forgery
    with pytest.raises(HistoryError, match="unknown key"):
        await rebuild(store, RUN, trust=h.trust())


# -- content hashes ------------------------------------------------------------------------------


async def test_a_matching_xxh3_does_not_pass_a_wrong_sha256(store: Store) -> None:
    """xxh3 is not cryptographic: an object whose xxh3 an attacker matched (here: the entry's xxh3
    IS the forged bytes') is still refused on its sha256, before it is used."""
    import xxhash

    honest, forged = b"honest anchor bytes", b"forged anchor bytes"
    await store.put("runs/x/anchors/f", forged)
    entry = AnchorFile(name="model.safetensors", key="runs/x/anchors/f", bytes=len(forged),
                       xxh3=xxhash.xxh3_128_hexdigest(forged), sha256=content_hash(honest))
    with pytest.raises(ContentMismatch):
        await fetch_verified(store, entry)
    ok = AnchorFile(name=entry.name, key=entry.key, bytes=len(forged), xxh3=entry.xxh3, sha256=content_hash(forged))
    assert await fetch_verified(store, ok) == forged


async def test_a_patch_whose_frames_check_but_sha256_does_not_is_refused(store: Store) -> None:
    """The same: a patch body whose frame digests (xxh3) match its index, under a manifest whose
    signed sha256 is another's, is refused by the subscriber before it is applied."""
    h = await honest_run(store, RUN, np.random.default_rng(8))
    sub = h.victim
    manifest = await sub.manifest((await read_pointer(store, RUN)).manifest)
    step = manifest.patch("step")
    assert isinstance(step, PatchRef) and step.sha256 is not None
    wrong = PatchRef(**{**{f: getattr(step, f) for f in PatchRef.__dataclass_fields__}, "sha256": "0" * 64})
    with pytest.raises(ContentMismatch):
        await sub._fetch_frames(wrong)
    assert len(await sub._fetch_frames(step)) == len(step.index.frames)


# -- rotation ------------------------------------------------------------------------------------


async def _rotate(store: Store, run: str, old: SigningKey, new: SigningKey, seq: int) -> None:
    from slime_stoa.protocol.pulse.history import read_pointer_etag

    found = await read_pointer_etag(store, run)
    assert found is not None
    pointer, etag = found
    doc = rotation_document(run, seq, new, pointer.version, old)
    await store.put_if_absent(RunLayout(run).key_rotation(seq), canonical_json(doc))
    await store.cas(RunLayout(run).pointer, pointer.to_bytes(new), etag)


async def test_a_rotated_key_is_learned_and_the_old_one_refused_for_later_versions(store: Store) -> None:
    h = await honest_run(store, RUN, np.random.default_rng(9))
    new = SigningKey.generate()
    await _rotate(store, RUN, h.key, new, 1)
    # The trainer restarts with the new key and publishes v3; the victim, pinned to the old key,
    # learns the rotation from the bucket and follows.
    pub = Publisher(store, RUN, key=new)
    assert await pub.open() == 2
    await pub.publish(step_state(h.states[2], np.random.default_rng(10)))
    assert (await h.victim.sync()) is not None and h.victim.version == 3
    assert h.victim.trust is not None and h.victim.trust.newest == new.public
    # The old key can no longer sign anything new: neither publish nor sign the pointer.
    with pytest.raises(UntrustedState, match="not the current key"):
        await Publisher(store, RUN, key=h.key).open()
    head = await read_pointer(store, RUN)
    await store.put(RunLayout(RUN).pointer, head.to_bytes(h.key))  # v3's pointer, signed by the old key
    late = Subscriber(store, RUN, trust=h.trust())
    with pytest.raises(WeightsRefused, match="refused the pointer"):
        await late.sync()
    assert late.state is None and late.refused == 1
    trust = h.trust()
    await load_rotations(store, trust)
    assert trust.key_for(2) == h.key.public and trust.key_for(3) == new.public and trust.key_for(None) == new.public


async def test_a_forged_rotation_is_refused(store: Store) -> None:
    h = await honest_run(store, RUN, np.random.default_rng(11))
    mine = SigningKey.generate()
    await _rotate(store, RUN, h.attacker, mine, 1)  # "rotation" signed by the attacker's key
    with pytest.raises(WeightsRefused):
        await h.victim.sync()
    assert h.victim.version == 1 and h.victim.trust is not None and h.victim.trust.rotations == 0
    trust = h.trust()  # a reader passes it over (no genuine rotation is one the newest key did not sign)
    assert await load_rotations(store, trust) == 0 and trust.rotations == 0
    assert trust.passed_over is not None and "unknown key" in trust.passed_over[1]


def test_rotation_documents_must_follow_in_order() -> None:
    old, new, newer = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    trust = RunTrust(RUN, old.public)
    with pytest.raises(Untrusted, match="not rotation 1"):
        trust.learn(rotation_document(RUN, 2, new.public, 5, old), "k")
    with pytest.raises(Untrusted, match="not rotation 1"):
        trust.learn(rotation_document("other", 1, new.public, 5, old), "k")
    assert trust.learn(rotation_document(RUN, 1, new.public, 5, old), "k") == new.public
    with pytest.raises(Untrusted, match="goes back"):
        trust.learn(rotation_document(RUN, 2, newer.public, 4, new), "k")
    with pytest.raises(Untrusted, match="already"):
        trust.learn(rotation_document(RUN, 2, old.public, 6, new), "k")
    assert trust.key_for(5) == old.public and trust.key_for(6) == new.public


# -- the run manifest ----------------------------------------------------------------------------


async def test_a_signed_run_manifest_is_pinned(store: Store) -> None:
    key, other = SigningKey.generate(), SigningKey.generate()
    manifest = RunManifest(run=RUN, model="m", task="synthetic", run_key=key.public.to_text())
    await store.put(RunLayout(RUN).run_manifest, manifest.to_bytes(key))
    assert (await read_run_manifest(store, RUN, pinned=key.public.to_text())).run_key == key.public.to_text()
    with pytest.raises(RunKeyMismatch):
        await read_run_manifest(store, RUN, pinned=other.public.to_text())
    # A manifest naming the attacker's key (and signed by it) is refused by a pinned reader.
    forged = RunManifest(run=RUN, model="m", task="synthetic", run_key=other.public.to_text())
    await store.put(RunLayout(RUN).run_manifest, forged.to_bytes(other))
    with pytest.raises(RunKeyMismatch):
        await read_run_manifest(store, RUN, pinned=key.public.to_text())
    # An unsigned manifest too.
    await store.put(RunLayout(RUN).run_manifest, RunManifest(run=RUN, model="m", task="synthetic").to_bytes())
    with pytest.raises(RunKeyMismatch, match="unsigned"):
        await read_run_manifest(store, RUN, pinned=key.public.to_text())


def test_run_manifest_signatures_must_verify() -> None:
    key, other = SigningKey.generate(), SigningKey.generate()
    manifest = RunManifest(run=RUN, model="m", task="synthetic", run_key=key.public.to_text())
    signed = manifest.to_bytes(key)
    assert RunManifest.from_bytes(signed) == manifest
    with pytest.raises(ValueError, match="not this run's run_key"):
        manifest.to_bytes(other)
    doc = json.loads(signed)
    with pytest.raises(ValueError, match="does not verify"):
        RunManifest.from_bytes(json.dumps({**doc, "group_size": 16}).encode())
    with pytest.raises(ValueError, match="not signed"):
        RunManifest.from_bytes(manifest.to_bytes())
    unsigned = RunManifest(run=RUN, model="m", task="synthetic")
    assert "run_key" not in json.loads(unsigned.to_bytes()) and RunManifest.from_bytes(unsigned.to_bytes()) == unsigned
