"""The worker signature on a downloaded record: who signed it, and whether the run trusts that key.

`check_signature` unwraps the signed envelope (`slime_stoa.protocol.signed_record`) and checks
it against the run's worker registry (`signers`), raising `RecordRejected` with a
`SignatureReason` when a signed run's record fails.
"""

from __future__ import annotations

from typing import Literal, get_args

from slime_stoa.protocol.layout import RolloutKey
from slime_stoa.protocol.records import RecordError
from slime_stoa.protocol.registry import Registry
from slime_stoa.protocol.signed_record import open_signed, record_bytes, verify_signed
from slime_stoa.protocol.validate import RecordRejected

#: Why a record of a signed run (its manifest has a run key) fails the signature check.
SignatureReason = Literal[
    "unsigned",  # not a signed envelope
    "unknown_key",  # signed by a key the run's registry does not hold (read again first)
    "revoked",  # signed by a key the registry revoked (also groups admitted before, not yet used)
    "key_mismatch",  # the key's worker is not the worker of the record's object key
    "bad_signature",  # a malformed envelope, or the signature is not over these bytes for this run
]
SIGNATURE_REASONS: frozenset[str] = frozenset(get_args(SignatureReason))


def reject(reason: SignatureReason, detail: str) -> RecordRejected:
    return RecordRejected(reason, detail)


def check_signature(data: bytes, *, key: RolloutKey, registry: Registry | None) -> tuple[bytes, str | None]:
    """(record bytes, signer key id) of a downloaded object, RecordRejected with a
    `SignatureReason` if a signed run's record fails the signature check.

    `registry`: the run's worker registry (verified with the run key), or None for an unsigned
    run, whose records may come in an envelope too: it is unwrapped, its signature not trusted
    (there is no run key to trust it by)."""
    try:
        if registry is None:
            return record_bytes(data), None
        signed = open_signed(data)
        entry = registry.by_key_id(signed.key_id)
        if entry is None:
            raise reject("unknown_key", f"signed by key {signed.key_id}, which the registry (serial {registry.serial}) does not hold")
        if entry.revoked:
            raise reject("revoked", f"signed by the revoked key {signed.key_id} of worker {entry.worker!r}")
        if entry.worker != key.worker:
            raise reject(
                "key_mismatch", f"signed by the key of worker {entry.worker!r}; its key says worker {key.worker!r}"
            )
        verify_signed(signed, entry.key, run=registry.run)
    except RecordRejected:
        raise
    except RecordError as exc:
        raise RecordRejected(exc.reason, exc.detail) from None
    return signed.record, signed.key_id
