"""Nothing large is parsed before its signature is checked: a forged weight document of many MiB
(a version manifest carrying a huge patch index, an anchor manifest) is refused from its raw
bytes, before any JSON parse or index decode, with memory bounded by its size.

Each forgery below is built so that PARSING it would fail with its own error (a duplicate key:
"not valid JSON"): a refusal that names the signature proves the parser was never reached."""

from __future__ import annotations

import base64
import functools
import json
import os
import tracemalloc

import numpy as np
import pytest

from slime_stoa.protocol.pulse.history import (
    MAX_ANCHOR_MANIFEST_BYTES,
    MAX_VERSION_MANIFEST_BYTES,
    read_anchor_manifest,
    read_manifest,
    read_pointer,
)
from slime_stoa.protocol.pulse.manifests import AnchorManifest, ManifestError, UntrustedDocument, VersionManifest
from slime_stoa.protocol.pulse.signed_bytes import signed_bytes, tail_key_id, verify_signed_bytes
from slime_stoa.protocol.pulse.subscriber import WeightsRefused
from slime_stoa.protocol.signing import SigningKey, canonical_json, sign_document, verify_document
from slime_stoa.protocol.store import Store

from .forged_weights import Honest, honest_run

RUN = "parse-late"
PAD_BYTES = 3 << 20  # past the 2.4 MB forgery of the report, inside every read limit (4 MiB: anchors)


def _would_not_parse(genuine: bytes) -> dict:
    """The genuine document's members, a 3 MiB padding member, and a duplicate key (appended by
    the callers): bytes that `load_json` refuses, so reaching the parser shows in the error."""
    doc = json.loads(genuine)
    doc.pop("signature", None)
    doc["padding"] = base64.b64encode(os.urandom(PAD_BYTES * 3 // 4)).decode()
    return doc


def _with_duplicate(data: bytes) -> bytes:
    assert data.startswith(b"{")
    return b'{"format":"x",' + data[1:]  # "format" now appears twice


def _forgeries(genuine: bytes, h: Honest) -> dict[str, bytes]:
    doc = _would_not_parse(genuine)
    by_attacker = signed_bytes(doc, h.attacker)
    claiming = by_attacker.replace(h.attacker.key_id.encode(), h.key.key_id.encode())  # names the run key
    return {
        "unsigned": _with_duplicate(canonical_json(doc)),
        "signed by another key": _with_duplicate(by_attacker),
        "claiming the run key": _with_duplicate(claiming),
    }


def _refused_unparsed(exc: BaseException) -> None:
    text = str(exc)
    assert "not valid JSON" not in text and "duplicate" not in text, text
    assert any(w in text for w in ("not signed", "unknown key", "does not verify")), text


async def _refused_with_bounded_memory(read, data: bytes, limit: int) -> None:
    """`read()` refuses `data` unparsed, its memory peak bounded: the read's own buffer (a store
    reads up to `limit` + 1 bytes at once) and two copies of the bytes (the signature check's),
    where a JSON parse of a million-entry patch index takes hundreds of MiB."""
    tracemalloc.start()
    try:
        with pytest.raises(UntrustedDocument) as info:
            await read()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    _refused_unparsed(info.value)
    assert peak < limit + 3 * len(data) + (1 << 20), (peak, len(data))


def _parse_refused_with_bounded_memory(parse, data: bytes) -> None:
    """The same for the bytes in hand: only the signature check's copies of them."""
    tracemalloc.start()
    try:
        with pytest.raises(UntrustedDocument) as info:
            parse()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    _refused_unparsed(info.value)
    assert peak < 2 * len(data) + (1 << 20), (peak, len(data))


async def test_a_forged_large_version_manifest_is_refused_before_it_is_parsed(store: Store) -> None:
    h = await honest_run(store, RUN, np.random.default_rng(5))
    key = (await read_pointer(store, RUN)).manifest
    genuine = await store.get_bytes(key)
    for name, forged in _forgeries(genuine, h).items():
        assert len(forged) > PAD_BYTES, name
        await store.put(key, forged)
        await _refused_with_bounded_memory(lambda: read_manifest(store, key, trust=h.trust()), forged,
                                           MAX_VERSION_MANIFEST_BYTES)
        _parse_refused_with_bounded_memory(functools.partial(VersionManifest.from_bytes, forged, key, key=key, trust=h.trust()), forged)
        # the worker's path: the victim at v1 reads v2's manifest and refuses it the same way
        with pytest.raises(WeightsRefused) as info:
            await h.victim.sync()
        _refused_unparsed(info.value)
        assert h.victim.version == 1
    await store.put(key, genuine)
    assert (await read_manifest(store, key, trust=h.trust())).version == 2  # the genuine bytes still read


async def test_a_forged_large_anchor_manifest_is_refused_before_it_is_parsed(store: Store) -> None:
    h = await honest_run(store, RUN, np.random.default_rng(6))
    key = (await read_pointer(store, RUN)).anchor.manifest
    genuine = await store.get_bytes(key)
    for forged in _forgeries(genuine, h).values():
        await store.put(key, forged)
        await _refused_with_bounded_memory(lambda: read_anchor_manifest(store, key, trust=h.trust()), forged,
                                           MAX_ANCHOR_MANIFEST_BYTES)
        _parse_refused_with_bounded_memory(functools.partial(AnchorManifest.from_bytes, forged, key, key=key, trust=h.trust()), forged)
    await store.put(key, genuine)
    assert (await read_anchor_manifest(store, key, trust=h.trust())).version == 0


async def test_the_signature_of_the_run_key_over_the_bytes_is_what_admits_a_document(store: Store) -> None:
    h = await honest_run(store, RUN, np.random.default_rng(7))
    key = (await read_pointer(store, RUN)).manifest
    genuine = await store.get_bytes(key)
    # the signature is last, over the bytes before it: one changed byte anywhere is refused
    assert tail_key_id(genuine) == h.key.key_id
    assert verify_signed_bytes(genuine, (h.key.public,), key) == h.key.public
    flipped = genuine.replace(b'"version":2', b'"version":3', 1)
    assert flipped != genuine
    with pytest.raises(ManifestError, match="does not verify"):
        VersionManifest.from_bytes(flipped, key, key=key, trust=h.trust())
    # the bytes are also an ordinary signed document: a reader that parses first still verifies them
    assert verify_document(json.loads(genuine), h.key.public, where=key) == h.key.public
    # a genuinely signed document in the sorted layout (signature not last) is refused unparsed
    sorted_layout = json.dumps(sign_document(json.loads(genuine), h.key), sort_keys=True, separators=(",", ":"))
    with pytest.raises(UntrustedDocument, match="not signed"):
        VersionManifest.from_bytes(sorted_layout.encode(), key, key=key, trust=h.trust())


def test_a_signature_of_a_noncanonical_text_is_refused() -> None:
    key = SigningKey.generate()
    data = signed_bytes({"format": "x", "n": 1}, key)
    assert verify_signed_bytes(data, (key.public,), "doc") == key.public
    tail = data.rindex(b'","key"')
    last = data[tail - 1]
    # 64 bytes in 86 characters: the last one carries 2 bits, its 4 low bits are unused (zero)
    assert last in b"AQgw"
    with pytest.raises(ValueError, match="canonical"):  # the same 64 bytes, another spelling
        verify_signed_bytes(data[: tail - 1] + bytes([last + 1]) + data[tail:], (key.public,), "doc")
