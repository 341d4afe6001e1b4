"""The byte layout of a signed weight-plane document, checked before anything is parsed.

A signed pointer, version manifest or anchor manifest is the canonical JSON of its body
(`signing.canonical_json`) with the `signature` member appended LAST:

    <canonical JSON of the body, without its closing brace>,"signature":{"ed25519":"<86 chars>","key":"<16 hex>"}}

The signature is the usual document signature (`signing.sign_document`: over the body's
canonical JSON), so a reader that parses first and verifies the parsed document still accepts
it. Putting it last, in a fixed-size tail, lets a reader verify the RAW bytes before parsing
any of them: a forged 16 MiB manifest costs one regex over its last ~130 bytes and one
signature check over its bytes (linear, no allocation per element), never a JSON parse or a
patch-index decode. A signed document in any other layout is refused unparsed.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from typing import Any

from slime_stoa.protocol.signing import SIGNATURE_FIELD, PublicKey, SignatureError, SigningKey, canonical_json

_TAIL = re.compile(rb',"signature":\{"ed25519":"([A-Za-z0-9_-]{86})","key":"([0-9a-f]{16})"\}\}\Z')
#: The tail is exactly this long (86 base64url characters of signature, 16 hex of key id).
_TAIL_BYTES = len(b',"signature":{"ed25519":"","key":""}}') + 86 + 16


class Unsigned(ValueError):
    """The bytes do not end in a signature tail (unsigned, or signed in another layout)."""


def signed_bytes(doc: Mapping[str, Any], key: SigningKey) -> bytes:
    """`doc` (any `signature` member dropped) as canonical JSON, signed by `key`, the signature last."""
    body = canonical_json({k: v for k, v in doc.items() if k != SIGNATURE_FIELD})
    if not body.endswith(b"}") or body == b"{}":
        raise ValueError("only a non-empty JSON object can be signed")
    signature = base64.urlsafe_b64encode(key.sign(body, context="doc")).rstrip(b"=")
    return body[:-1] + b',"signature":{"ed25519":"' + signature + b'","key":"' + key.key_id.encode() + b'"}}'


def tail_key_id(data: bytes) -> str | None:
    """The key id the signature tail of `data` names (None: no tail). Reads only the tail."""
    match = _TAIL.search(data[-_TAIL_BYTES:])
    return None if match is None else match.group(2).decode()


def verify_signed_bytes(data: bytes, keys: tuple[PublicKey, ...], where: str) -> PublicKey:
    """The key of `keys` whose signature the tail of `data` carries over the rest of `data`.

    Unsigned when there is no tail; SignatureError when the tail names a key not in `keys` or
    does not verify. Nothing of `data` is parsed: call this before `load_json`."""
    match = _TAIL.search(data[-_TAIL_BYTES:])
    if match is None:
        raise Unsigned(f"{where}: not signed (no signature at the end of the document)")
    key_id = match.group(2).decode()
    key = next((k for k in keys if k.key_id == key_id), None)
    if key is None:
        raise SignatureError(f"{where}: signed by unknown key {key_id}")
    body = data[: len(data) - len(match.group(0))] + b"}"
    signature = base64.urlsafe_b64decode(match.group(1) + b"==")
    if base64.urlsafe_b64encode(signature).rstrip(b"=") != match.group(1):  # one text per signature
        raise SignatureError(f"{where}: malformed signature (not canonical base64url)")
    try:
        key.verify(signature, body, context="doc")
    except SignatureError as exc:
        raise SignatureError(f"{where}: {exc}") from None
    return key
