"""Signed rollout records: a worker key's signature around the record bytes.

Wire form (one object per record, under the same key as an unsigned record):

    SIGNED_MAGIC (7 bytes) | SIGNED_FORMAT (1 byte) | key id (8 bytes) | signature (64 bytes) | record

`record` is exactly what `records.encode_group` wrote. The key id is the signer's
`PublicKey.key_id` (16 hex digits) as its 8 raw bytes. The signature is the worker key's, with
context "record", over `run + b"\\0" + record`: the run name is bound in, so a record signed for
one run never verifies for another, whatever its bytes say.

`open_signed` checks the frame only; who the key belongs to and whether the signature verifies
is the reader's business (`verify_signed`, with the key from the run's worker registry).
Every problem is a `SignedRecordError` (a `RecordError`) with a stable reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime_stoa.protocol.layout import check_name
from slime_stoa.protocol.records import DEFAULT_MAX_RECORD_BYTES, MAGIC, RecordError
from slime_stoa.protocol.signing import KEY_ID_HEX, SIGNATURE_BYTES, PublicKey, SignatureError, SigningKey

SIGNED_MAGIC = b"\x89STOASR"  # like the record magic: a text file never looks like one
SIGNED_FORMAT = 1
_KEY_ID_BYTES = KEY_ID_HEX // 2
HEADER_LEN = len(SIGNED_MAGIC) + 1 + _KEY_ID_BYTES + SIGNATURE_BYTES
CONTEXT = "record"


class SignedRecordError(RecordError):
    """A signed record's envelope is missing or malformed, or its signature does not verify."""


@dataclass(frozen=True, slots=True)
class SignedRecord:
    key_id: str  # 16 hex digits: the signer's PublicKey.key_id
    signature: bytes  # 64 bytes
    record: bytes  # the record bytes the signature covers (`encode_group` output)


def _message(run: str, record: bytes) -> bytes:
    return check_name("run", run).encode() + b"\0" + record


def sign_record(record: bytes, key: SigningKey, *, run: str, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
    """Wrap `record` (encoded record bytes) in a signed envelope for `run`.

    ValueError when the envelope would be over `max_bytes`: a reader caps the whole object."""
    record = bytes(record)
    if HEADER_LEN + len(record) > max_bytes:
        raise ValueError(f"signed record is {HEADER_LEN + len(record)} bytes, over the record limit {max_bytes}")
    signature = key.sign(_message(run, record), context=CONTEXT)
    return SIGNED_MAGIC + bytes([SIGNED_FORMAT]) + bytes.fromhex(key.key_id) + signature + record


def is_signed(data: bytes | bytearray | memoryview) -> bool:
    """True when `data` starts like a signed envelope (it may still be malformed)."""
    return bytes(data[: len(SIGNED_MAGIC)]) == SIGNED_MAGIC


def open_signed(data: bytes | bytearray | memoryview) -> SignedRecord:
    """Split a signed envelope into its key id, signature and record bytes (not verified).

    SignedRecordError "unsigned" for anything that is not an envelope (a plain record
    included), "bad_signature" for a truncated envelope or an unknown envelope format."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SignedRecordError("not_bytes", f"record must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if not is_signed(data):
        what = "a plain record" if data[: len(MAGIC)] == MAGIC else "not a signed record"
        raise SignedRecordError("unsigned", f"{what}: the run requires records signed by a worker key")
    if len(data) <= HEADER_LEN:
        raise SignedRecordError("bad_signature", f"signed envelope truncated ({len(data)} bytes)")
    if data[len(SIGNED_MAGIC)] != SIGNED_FORMAT:
        raise SignedRecordError(
            "bad_signature", f"signed envelope format {data[len(SIGNED_MAGIC)]}, expected {SIGNED_FORMAT}"
        )
    at = len(SIGNED_MAGIC) + 1
    key_id = data[at : at + _KEY_ID_BYTES].hex()
    at += _KEY_ID_BYTES
    return SignedRecord(key_id=key_id, signature=data[at : at + SIGNATURE_BYTES], record=data[HEADER_LEN:])


def verify_signed(signed: SignedRecord, key: PublicKey, *, run: str) -> None:
    """SignedRecordError "bad_signature" unless `key` (whose id the envelope names) signed
    `signed.record` for `run`."""
    if key.key_id != signed.key_id:
        raise SignedRecordError("bad_signature", f"envelope names key {signed.key_id}, not {key.key_id}")
    try:
        key.verify(signed.signature, _message(run, signed.record), context=CONTEXT)
    except SignatureError as exc:
        raise SignedRecordError("bad_signature", f"{exc} over this record for run {run!r}") from None


def record_bytes(data: bytes | bytearray | memoryview) -> bytes:
    """The record inside a signed envelope, or `data` itself when it is not one (not verified:
    for a writer's own checks, never for admitting a record)."""
    return open_signed(data).record if is_signed(data) else bytes(data)
