"""The signing core: keys, key files, signed documents (slime_stoa/protocol/signing.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slime_stoa.protocol.signing import (
    KeyFileError,
    PublicKey,
    SignatureError,
    SigningKey,
    canonical_json,
    document_key_id,
    read_key_file,
    sign_document,
    verify_document,
    write_key_file,
)


def test_public_key_text_round_trips_and_rejects_junk() -> None:
    key = SigningKey.generate()
    text = key.public.to_text()
    assert text.startswith("ed25519:") and PublicKey.from_text(text) == key.public
    assert len(key.key_id) == 16 and key.public.fingerprint.startswith("SHA256:")
    for bad in ["", "ed25519:", "rsa:abcd", text + "A", text[:-2], text.replace("ed25519:", "ed25519: "), 7, None]:
        with pytest.raises(ValueError):
            PublicKey.from_text(bad)


def test_a_signed_document_verifies_whatever_its_spacing_and_fails_on_any_change() -> None:
    key = SigningKey.generate()
    doc = sign_document({"format": "x/1", "version": 3, "name": "é", "nested": {"b": [1, 2.5], "a": None}}, key)
    assert document_key_id(doc) == key.key_id
    assert verify_document(doc, key.public, where="doc") == key.public
    assert verify_document(dict(reversed(list(doc.items()))), [key.public], where="doc") == key.public
    for change in ({"version": 4}, {"name": "e"}, {"nested": {"b": [1, 2.5]}}, {"extra": 1}):
        with pytest.raises(SignatureError, match="does not verify"):
            verify_document({**doc, **change}, key.public, where="doc")


def test_unsigned_unknown_and_malformed_signatures_are_refused() -> None:
    key, other = SigningKey.generate(), SigningKey.generate()
    doc = sign_document({"a": 1}, key)
    with pytest.raises(SignatureError, match="not signed"):
        verify_document({"a": 1}, key.public, where="doc")
    with pytest.raises(SignatureError, match="unknown key"):
        verify_document(doc, other.public, where="doc")
    forged = sign_document({"a": 2}, other)
    forged["signature"]["key"] = key.key_id  # claims the trusted key, signed by another
    with pytest.raises(SignatureError, match="does not verify"):
        verify_document(forged, key.public, where="doc")
    for sig in ["x", {}, {"key": key.key_id}, {"key": key.key_id, "ed25519": "AAAA"}, {"key": 1, "ed25519": ""},
                {"key": key.key_id, "ed25519": doc["signature"]["ed25519"], "more": 1}]:
        with pytest.raises(SignatureError, match="malformed"):
            verify_document({"a": 1, "signature": sig}, key.public, where="doc")


def test_signatures_are_bound_to_their_context() -> None:
    key = SigningKey.generate()
    sig = key.sign(b"payload", context="record")
    key.public.verify(sig, b"payload", context="record")
    with pytest.raises(SignatureError):
        key.public.verify(sig, b"payload", context="doc")
    with pytest.raises(SignatureError):
        key.public.verify(sig, b"payloaD", context="record")


def test_canonical_json_is_sorted_compact_and_refuses_nan() -> None:
    assert canonical_json({"b": 1, "a": [1, "é"]}) == '{"a":[1,"é"],"b":1}'.encode()
    with pytest.raises(ValueError):
        canonical_json({"a": float("nan")})


def test_key_files_are_0600_and_refused_when_others_can_read_them(tmp_path: Path) -> None:
    key = SigningKey.generate()
    path = write_key_file(tmp_path / "keys" / "run.key", key)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(path.parent).st_mode & 0o777 == 0o700
    assert read_key_file(path).public == key.public
    assert "PRIVATE" not in repr(read_key_file(path))
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        write_key_file(path, SigningKey.generate())
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        read_key_file(path)
    os.chmod(path, 0o600)
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(KeyFileError, match="link"):
        read_key_file(link)
    with pytest.raises(KeyFileError, match="no such key file"):
        read_key_file(tmp_path / "missing.key")
    junk = tmp_path / "junk.key"
    junk.write_bytes(b"not a key")
    junk.chmod(0o600)
    with pytest.raises(KeyFileError, match="PEM"):
        read_key_file(junk)
