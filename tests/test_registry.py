"""The worker registry: strict parsing, the run key's signature, pure edits, and conditional-put
updates that never lose an edit, on both store backends."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.registry import (
    Registry,
    RegistryError,
    add_worker,
    find_worker,
    load_registry,
    parse_registry,
    read_registry,
    registry_bytes,
    release_worker,
    revoke_worker,
    update_registry,
)
from slime_stoa.protocol.signing import SigningKey, sign_document
from slime_stoa.protocol.store import Store

RUN = "reg-run"
RUN_KEY = SigningKey.generate()
W1, W2 = SigningKey.generate(), SigningKey.generate()


def two_workers() -> Registry:
    reg = add_worker(Registry(run=RUN), worker="alice-0a1b2c", name="alice", key=W1.public, now=10.0)
    return add_worker(reg, worker="bob-0a1b2c", name="bob", key=W2.public, now=11.0)


def doc_of(reg: Registry) -> dict[str, Any]:
    return json.loads(registry_bytes(reg, RUN_KEY))


def resign(doc: dict[str, Any], key: SigningKey = RUN_KEY) -> bytes:
    return json.dumps(sign_document(doc, key)).encode()


def test_round_trip_lookup_and_edits() -> None:
    reg = two_workers()
    assert reg.serial == 2 and list(reg.workers) == ["alice-0a1b2c", "bob-0a1b2c"]
    loaded = load_registry(registry_bytes(reg, RUN_KEY), run=RUN, run_key=RUN_KEY.public)
    assert loaded == reg
    assert loaded.by_key_id(W2.key_id) == reg.workers["bob-0a1b2c"] and loaded.by_key_id("0" * 16) is None
    revoked = revoke_worker(loaded, "alice", now=12.0)  # by display name
    assert revoked.serial == 3 and revoked.workers["alice-0a1b2c"].revoked_at == 12.0
    assert revoked.by_key_id(W1.key_id).revoked  # type: ignore[union-attr]
    released = release_worker(release_worker(revoked, "bob-0a1b2c"), "bob")
    assert released.serial == 5 and released.workers["bob-0a1b2c"].releases == 2
    assert load_registry(registry_bytes(released, RUN_KEY), run=RUN, run_key=RUN_KEY.public) == released


def test_refused_edits() -> None:
    reg = two_workers()
    with pytest.raises(ValueError, match="already registered"):
        add_worker(reg, worker="alice-0a1b2c", name="again", key=SigningKey.generate().public, now=1.0)
    with pytest.raises(ValueError, match="already registered"):
        add_worker(reg, worker="carol-000000", name="carol", key=W1.public, now=1.0)  # alice's key
    with pytest.raises(ValueError, match="invalid worker id"):
        add_worker(reg, worker="Carol", name="carol", key=SigningKey.generate().public, now=1.0)
    with pytest.raises(ValueError, match="printable"):
        add_worker(reg, worker="carol-000000", name=" carol\n", key=SigningKey.generate().public, now=1.0)
    with pytest.raises(ValueError, match="no worker"):
        revoke_worker(reg, "nobody", now=1.0)
    with pytest.raises(ValueError, match="already revoked"):
        revoke_worker(revoke_worker(reg, "alice", now=1.0), "alice-0a1b2c", now=2.0)
    same_name = add_worker(reg, worker="alice-ffffff", name="alice", key=SigningKey.generate().public, now=1.0)
    with pytest.raises(ValueError, match="2 workers are named"):
        find_worker(same_name, "alice")


def _mutations() -> list[tuple[str, Any]]:
    def entry(**kw: Any) -> Any:
        def mutate(doc: dict[str, Any]) -> None:
            doc["workers"]["alice-0a1b2c"].update(kw)
        return mutate

    return [
        ("unknown field", lambda d: d.update(extra=1)),
        ("another run", lambda d: d.update(run="other")),
        ("format", lambda d: d.update(format="stoa.registry/9")),
        ("serial bool", lambda d: d.update(serial=True)),
        ("serial negative", lambda d: d.update(serial=-1)),
        ("workers list", lambda d: d.update(workers=[])),
        ("bad worker id", lambda d: d["workers"].update({"../x": d["workers"]["bob-0a1b2c"]})),
        ("same key twice", lambda d: d["workers"]["bob-0a1b2c"].update(key=d["workers"]["alice-0a1b2c"]["key"])),
        ("bad key", entry(key="ed25519:AAAA")),
        ("rsa key", entry(key="ssh-rsa AAAA")),
        ("releases float", entry(releases=1.5)),
        ("releases bool", entry(releases=False)),
        ("added_at string", entry(added_at="yesterday")),
        ("revoked_at negative", entry(revoked_at=-1)),
        ("missing field", lambda d: d["workers"]["alice-0a1b2c"].pop("releases")),
        ("extra entry field", entry(admin=True)),
        ("name too long", entry(name="x" * 65)),
    ]


@pytest.mark.parametrize(("what", "mutate"), _mutations(), ids=[m[0] for m in _mutations()])
def test_malformed_registries_are_refused_even_when_signed(what: str, mutate: Any) -> None:
    doc = doc_of(two_workers())
    del doc["signature"]
    mutate(doc)
    with pytest.raises(RegistryError):
        load_registry(resign(doc), run=RUN, run_key=RUN_KEY.public)


def test_only_the_run_key_signs_a_registry() -> None:
    reg = two_workers()
    data = registry_bytes(reg, RUN_KEY)
    forged = registry_bytes(reg, SigningKey.generate())
    with pytest.raises(RegistryError, match="unknown key"):
        load_registry(forged, run=RUN, run_key=RUN_KEY.public)
    doc = json.loads(data)
    del doc["signature"]
    with pytest.raises(RegistryError, match="not signed"):
        load_registry(json.dumps(doc).encode(), run=RUN, run_key=RUN_KEY.public)
    tampered = json.loads(data)
    tampered["workers"]["alice-0a1b2c"]["revoked_at"] = None
    tampered["workers"]["bob-0a1b2c"]["key"] = SigningKey.generate().public.to_text()
    with pytest.raises(RegistryError, match="does not verify"):
        load_registry(json.dumps(tampered).encode(), run=RUN, run_key=RUN_KEY.public)
    with pytest.raises(RegistryError, match="JSON"):
        load_registry(b"{\"format\": ", run=RUN, run_key=RUN_KEY.public)
    with pytest.raises(RegistryError, match="for run"):
        parse_registry(doc_of(reg), run="another-run")
    # Any of several trusted run keys (a rotation) may sign it.
    assert load_registry(data, run=RUN, run_key=[SigningKey.generate().public, RUN_KEY.public]) == reg


# -- in the bucket ------------------------------------------------------------------------------------
async def test_update_reads_and_conditional_writes(store: Store) -> None:
    read = await read_registry(store, RUN, RUN_KEY.public)
    assert read is not None and read.etag is None and read.registry == Registry(run=RUN)
    written = await update_registry(
        store, RUN, RUN_KEY, functools.partial(add_worker, worker="alice-0a1b2c", name="alice", key=W1.public, now=1.0)
    )
    read = await read_registry(store, RUN, RUN_KEY.public)
    assert read is not None and read.registry == written and read.etag
    assert await read_registry(store, RUN, RUN_KEY.public, if_none_match=read.etag) is None  # unchanged: 304
    await update_registry(store, RUN, RUN_KEY, functools.partial(revoke_worker, worker="alice", now=2.0))
    again = await read_registry(store, RUN, RUN_KEY.public, if_none_match=read.etag)
    assert again is not None and again.registry.serial == 2 and again.registry.workers["alice-0a1b2c"].revoked


async def test_concurrent_edits_are_all_kept(store: Store) -> None:
    keys = [SigningKey.generate() for _ in range(6)]
    await asyncio.gather(*(
        update_registry(store, RUN, RUN_KEY, functools.partial(add_worker, worker=f"mac-{i}", name=f"mac {i}", key=k.public, now=1.0))
        for i, k in enumerate(keys)
    ))
    read = await read_registry(store, RUN, RUN_KEY.public)
    assert read is not None
    assert read.registry.serial == 6 and sorted(read.registry.workers) == [f"mac-{i}" for i in range(6)]


async def test_a_forged_registry_in_the_bucket_is_never_overwritten(store: Store) -> None:
    key = RunLayout(RUN).registry
    forged = registry_bytes(two_workers(), SigningKey.generate())
    await store.put(key, forged)
    with pytest.raises(RegistryError, match="unknown key"):
        await update_registry(store, RUN, RUN_KEY, functools.partial(release_worker, worker="bob"))
    assert await store.get_bytes(key) == forged
