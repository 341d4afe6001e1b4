"""A bucket writer who replaces run.json (a manifest naming another run key, signed by it, or
garbage) never stops the publisher: it puts its own kept copy back, or, without one, publishes on
under its own key when the run's pointer is its own. A key that signed nothing in the bucket is
still refused at once: that is the operator's config, not a writer's doing."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.protocol.kept import TrainerCopies
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.history import read_pointer, read_pointer_etag
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig, UntrustedState
from slime_stoa.protocol.run_manifest import RunManifest, read_run_manifest
from slime_stoa.protocol.run_trust import RunTrust, rotation_document
from slime_stoa.protocol.signing import SigningKey, canonical_json
from slime_stoa.protocol.store import Store

from .forged_weights import random_state, step_state

pytestmark = pytest.mark.both_backends

RUN = "forged-manifest"
MANIFEST = RunLayout(RUN).run_manifest


async def signed_run(store: Store, key: SigningKey, keep: Path | None) -> dict[str, np.ndarray]:
    """Run RUN created with run key `key` (as `stoa run create` writes it) and v0 published by a
    publisher keeping its copies in `keep`; returns v0's state."""
    manifest = RunManifest(run=RUN, model="m", task="synthetic", run_key=key.public.to_text())
    await store.put_if_absent(MANIFEST, manifest.to_bytes(key))
    state = random_state(np.random.default_rng(41))
    await Publisher(store, RUN, PublisherConfig(keep_dir=keep), key=key).publish(state)
    return state


async def forge_manifest(store: Store) -> SigningKey:
    """run.json replaced by one naming the forger's key, signed by it; returns that key."""
    forger = SigningKey.generate()
    genuine = await read_run_manifest(store, RUN)
    await store.put(MANIFEST, replace(genuine, run_key=forger.public.to_text()).to_bytes(forger))
    return forger


async def test_a_forged_manifest_is_put_back_from_the_kept_copy(store: Store, tmp_path: Path) -> None:
    key, keep = SigningKey.generate(), tmp_path / "kept"
    state = await signed_run(store, key, keep)
    genuine = await store.get_bytes(MANIFEST)
    assert TrainerCopies(keep).kept(MANIFEST) == genuine  # kept when the publisher first read it
    await forge_manifest(store)
    pub = Publisher(store, RUN, PublisherConfig(keep_dir=keep), key=key)
    assert await pub.open() == 0
    assert (await pub.publish(step_state(state, np.random.default_rng(42)))).version == 1
    assert await store.get_bytes(MANIFEST) == genuine
    assert pub.trust is not None and pub.trust.newest == key.public


async def test_a_garbage_manifest_is_put_back_from_the_kept_copy(store: Store, tmp_path: Path) -> None:
    key, keep = SigningKey.generate(), tmp_path / "kept"
    await signed_run(store, key, keep)
    genuine = await store.get_bytes(MANIFEST)
    await store.put(MANIFEST, b'{"format": "not a run manifest"}')
    assert await Publisher(store, RUN, PublisherConfig(keep_dir=keep), key=key).open() == 0
    assert await store.get_bytes(MANIFEST) == genuine


async def test_a_deleted_manifest_is_put_back_from_the_kept_copy(store: Store, tmp_path: Path) -> None:
    key, keep = SigningKey.generate(), tmp_path / "kept"
    await signed_run(store, key, keep)
    genuine = await store.get_bytes(MANIFEST)
    await store.delete(MANIFEST)
    assert await Publisher(store, RUN, PublisherConfig(keep_dir=keep), key=key).open() == 0
    assert await store.get_bytes(MANIFEST) == genuine


async def test_without_a_copy_its_own_pointer_lets_the_publisher_go_on(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    key = SigningKey.generate()
    state = await signed_run(store, key, None)
    forged = await forge_manifest(store)
    pub = Publisher(store, RUN, key=key)
    with caplog.at_level(logging.WARNING, logger="stoa.pulse"):
        assert await pub.open() == 0
    warnings = [r.getMessage() for r in caplog.records if "goes on under that key alone" in r.getMessage()]
    assert len(warnings) == 1 and "put " + MANIFEST + " back" in warnings[0] and key.key_id in warnings[0]
    assert (await pub.publish(step_state(state, np.random.default_rng(43)))).version == 1
    # What it published is the run key's: a reader pinned to it follows; the forged manifest stays
    # for the operator to repair (workers pinned to the run key refuse it themselves).
    assert (await read_pointer(store, RUN, trust=RunTrust(RUN, key.public))).version == 1
    assert (await read_run_manifest(store, RUN)).run_key == forged.public.to_text()


async def test_without_a_copy_a_garbage_manifest_does_not_stop_the_publisher(store: Store) -> None:
    key = SigningKey.generate()
    await signed_run(store, key, None)
    await store.put(MANIFEST, b"\x00not json")
    assert await Publisher(store, RUN, key=key).open() == 0


async def test_a_key_that_signed_nothing_here_is_refused_at_once(store: Store, tmp_path: Path) -> None:
    key, keep = SigningKey.generate(), tmp_path / "kept"
    await signed_run(store, key, keep)
    await forge_manifest(store)
    stranger = SigningKey.generate()
    with pytest.raises(UntrustedState, match="not the current key"):
        await Publisher(store, RUN, key=stranger).open()
    # Its kept copy (the run key's manifest) put back does not make a stranger the run's publisher.
    with pytest.raises(UntrustedState, match=f"{stranger.key_id} is not the current key"):
        await Publisher(store, RUN, PublisherConfig(keep_dir=keep), key=stranger).open()


async def test_a_new_run_with_a_foreign_manifest_is_refused(store: Store) -> None:
    """No pointer yet: nothing vouches for the publisher's key, so the manifest stands."""
    key, other = SigningKey.generate(), SigningKey.generate()
    manifest = RunManifest(run=RUN, model="m", task="synthetic", run_key=key.public.to_text())
    await store.put(MANIFEST, manifest.to_bytes(key))
    with pytest.raises(UntrustedState, match="not the current key"):
        await Publisher(store, RUN, key=other).open()


async def test_a_key_rotated_away_is_refused_even_with_a_forged_manifest(store: Store) -> None:
    old, new = SigningKey.generate(), SigningKey.generate()
    await signed_run(store, old, None)
    found = await read_pointer_etag(store, RUN)
    assert found is not None
    pointer, etag = found
    doc = rotation_document(RUN, 1, new.public, pointer.version, old)
    await store.put_if_absent(RunLayout(RUN).key_rotation(1), canonical_json(doc))
    await store.cas(RunLayout(RUN).pointer, pointer.to_bytes(new), etag)  # a rotation re-signs the pointer
    await forge_manifest(store)  # its key did not sign rotation 1 (passed over): `old` is refused either way
    with pytest.raises(UntrustedState, match="not the current key"):
        await Publisher(store, RUN, key=old).open()
