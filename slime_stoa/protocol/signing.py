"""Ed25519 signatures: keys, key files, signed JSON documents and signed byte strings.

The one place stoa's two halves sign and verify. Everything the bucket holds can be written by
any worker's token, so trust comes from keys kept off the bucket:

- the run key (the trainer's): signs the run manifest, the pointer, version and anchor manifests,
  key rotations and the worker registry; its public half is in the run manifest and pinned by
  every worker at `macd join`;
- worker keys (one per worker, issued by `stoa worker add`): sign rollout records; their public
  halves are in the worker registry, which the run key signs.

Wire forms, fixed here:

- a public key as text: `ed25519:<base64url of the 32 raw bytes, no padding>`;
- a key id: the first 16 hex digits of sha256 over the raw public key;
- a fingerprint for people: `SHA256:<base64 of sha256 over the raw key, no padding>` (ssh's form);
- every signature is over `b"stoa-sig/1\\0" + context + b"\\0" + message`, so a signature made for
  one purpose ("doc", "record", ...) never verifies for another;
- a signed JSON document is the document with one more member,
  `"signature": {"key": <key id>, "ed25519": <base64url signature>}`, made over the canonical JSON
  of the document without that member (`canonical_json`: sorted keys, no spaces, UTF-8). A reader
  verifies the parsed document, so the bytes' spacing does not matter, their content does.

Private keys never enter the bucket. A key file is PKCS#8 PEM, written 0600 and refused when its
mode lets anyone but its owner read it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from slime_stoa.protocol.fsutil import atomic_write

SIGNATURE_FIELD = "signature"
_DOMAIN = b"stoa-sig/1\0"
_PUBLIC_PREFIX = "ed25519:"
SIGNATURE_BYTES = 64
KEY_ID_HEX = 16


class SignatureError(ValueError):
    """A signature is missing, names an unknown key, or does not verify."""


class KeyFileError(ValueError):
    """A key file is missing, unreadable, malformed, or readable by others."""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str, what: str, size: int) -> bytes:
    if not isinstance(text, str) or len(text) > 4 * size:
        raise ValueError(f"{what}: expected base64 text")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise ValueError(f"{what}: not base64") from None
    if len(raw) != size or _b64(raw) != text:
        raise ValueError(f"{what}: expected {size} bytes in canonical base64url")
    return raw


def _message(context: str, message: bytes | bytearray | memoryview) -> bytes:
    assert context and "\0" not in context, context
    return _DOMAIN + context.encode() + b"\0" + bytes(message)


@dataclass(frozen=True, slots=True)
class PublicKey:
    """An Ed25519 public key (32 raw bytes)."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != 32:
            raise ValueError("an Ed25519 public key is 32 bytes")

    @property
    def key_id(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()[:KEY_ID_HEX]

    @property
    def fingerprint(self) -> str:
        return "SHA256:" + base64.b64encode(hashlib.sha256(self.raw).digest()).rstrip(b"=").decode()

    def to_text(self) -> str:
        return _PUBLIC_PREFIX + _b64(self.raw)

    @classmethod
    def from_text(cls, text: Any) -> PublicKey:
        """Parse `ed25519:<base64url>`; ValueError naming the problem otherwise."""
        if not isinstance(text, str) or not text.startswith(_PUBLIC_PREFIX):
            raise ValueError(f"public key {str(text)[:80]!r} is not of the form 'ed25519:<base64url>'")
        return cls(_unb64(text[len(_PUBLIC_PREFIX) :], "public key", 32))

    def verify(self, signature: bytes, message: bytes | bytearray | memoryview, *, context: str) -> None:
        """SignatureError unless `signature` is this key's over `message` for `context`."""
        if len(signature) != SIGNATURE_BYTES:
            raise SignatureError("signature is not 64 bytes")
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, _message(context, message))
        except InvalidSignature:
            raise SignatureError(f"signature does not verify with key {self.key_id}") from None


class SigningKey:
    """An Ed25519 private key. Never serialised except into a 0600 key file."""

    __slots__ = ("_private", "public")

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public = PublicKey(raw)

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @property
    def key_id(self) -> str:
        return self.public.key_id

    def sign(self, message: bytes | bytearray | memoryview, *, context: str) -> bytes:
        return self._private.sign(_message(context, message))

    def to_pem(self) -> bytes:
        return self._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    @classmethod
    def from_pem(cls, data: bytes, where: str = "key") -> SigningKey:
        try:
            private = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise KeyFileError(f"{where}: not an unencrypted PEM private key ({exc})") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise KeyFileError(f"{where}: not an Ed25519 key")
        return cls(private)

    def __repr__(self) -> str:  # never the private half
        return f"SigningKey(id={self.key_id})"


# -- key files ---------------------------------------------------------------------------------------


def check_private_mode(path: Path) -> None:
    """KeyFileError unless `path` is a regular file that only its owner can read or write."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise KeyFileError(f"{path}: no such key file") from None
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise KeyFileError(f"{path}: not a regular file (a key file may not be a link)")
    if info.st_mode & 0o077:
        raise KeyFileError(
            f"{path}: mode {stat.S_IMODE(info.st_mode):04o} lets others read a private key; run `chmod 600 {path}`"
        )
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise KeyFileError(f"{path}: owned by another user")


def write_private_file(path: Path, data: bytes, *, overwrite: bool = False) -> Path:
    """Write secret bytes to `path` with mode 0600 (atomic; its folder is made 0700 if missing).
    Refuses to replace an existing file unless `overwrite`."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise KeyFileError(f"{path}: already exists; refusing to overwrite a key")
    return atomic_write(path, data, mode=0o600, parents_mode=0o700)


def read_private_file(path: Path) -> bytes:
    """The bytes of a 0600 key file (KeyFileError if its mode lets others read it)."""
    path = Path(path)
    check_private_mode(path)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read ({exc.strerror})") from None


def write_key_file(path: Path, key: SigningKey, *, overwrite: bool = False) -> Path:
    """Write `key` as PKCS#8 PEM to a 0600 file."""
    return write_private_file(path, key.to_pem(), overwrite=overwrite)


def read_key_file(path: Path) -> SigningKey:
    """Load a key file written by `write_key_file` (KeyFileError if readable by others or malformed)."""
    return SigningKey.from_pem(read_private_file(path), str(path))


# -- signed JSON documents ---------------------------------------------------------------------------


def canonical_json(doc: Any) -> bytes:
    """The one byte form of a JSON value that signatures cover: sorted keys, no spaces, UTF-8."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def sign_document(doc: Mapping[str, Any], key: SigningKey) -> dict[str, Any]:
    """`doc` with a `signature` member over its canonical JSON (any old signature replaced)."""
    body = {k: v for k, v in doc.items() if k != SIGNATURE_FIELD}
    sig = key.sign(canonical_json(body), context="doc")
    return {**body, SIGNATURE_FIELD: {"key": key.key_id, "ed25519": _b64(sig)}}


def document_key_id(doc: Any) -> str | None:
    """The key id a document's signature names, or None when it carries no well-formed signature."""
    sig = doc.get(SIGNATURE_FIELD) if isinstance(doc, Mapping) else None
    if not isinstance(sig, Mapping) or set(sig) != {"key", "ed25519"}:
        return None
    key_id = sig.get("key")
    if not isinstance(key_id, str) or len(key_id) != KEY_ID_HEX or any(c not in "0123456789abcdef" for c in key_id):
        return None
    return key_id


def verify_document(doc: Any, keys: Mapping[str, PublicKey] | Iterable[PublicKey] | PublicKey, *, where: str) -> PublicKey:
    """Check a parsed document's signature against trusted keys; returns the key that signed it.

    SignatureError (naming `where`) if the document is unsigned, its signature is malformed,
    names a key not in `keys`, or does not verify over the document's canonical JSON.
    """
    trusted = _keyring(keys)
    if not isinstance(doc, Mapping) or SIGNATURE_FIELD not in doc:
        raise SignatureError(f"{where}: not signed")
    key_id = document_key_id(doc)
    if key_id is None:
        raise SignatureError(f"{where}: malformed signature")
    key = trusted.get(key_id)
    if key is None:
        raise SignatureError(f"{where}: signed by unknown key {key_id}")
    try:
        raw = _unb64(doc[SIGNATURE_FIELD]["ed25519"], "signature", SIGNATURE_BYTES)
        body = canonical_json({k: v for k, v in doc.items() if k != SIGNATURE_FIELD})
    except ValueError as exc:
        raise SignatureError(f"{where}: malformed signature ({exc})") from None
    try:
        key.verify(raw, body, context="doc")
    except SignatureError as exc:
        raise SignatureError(f"{where}: {exc}") from None
    return key


def _keyring(keys: Mapping[str, PublicKey] | Iterable[PublicKey] | PublicKey) -> Mapping[str, PublicKey]:
    if isinstance(keys, PublicKey):
        return {keys.key_id: keys}
    if isinstance(keys, Mapping):
        return keys
    return {k.key_id: k for k in keys}

