"""The consumer's signed heads: how far the trainer's consumer state got, where a put-back old
state cannot hide it.

Every save of the consumer state in a signed run (`persistence.SavedState`) gives the state the
next sequence number (`ConsumerState.seq`) and then writes a small head object, signed by the run
key, under a key of its own: `runs/<run>/trainer/heads/<seq, 12 digits>.json` =
`{"format": "stoa.consumer-head/1", "run", "seq", "registry_serial"}`. Old genuine objects put
back can replace `consumer.json` or a head, but cannot remove the newest head from the listing,
so a reader (`read_head`: the highest-numbered head that verifies and names its own key's
sequence number) refuses:

- a consumer state whose `seq` is below the head's (an old genuine state put back: its cursor and
  replay ledger rewound), fresh or restored;
- a worker registry whose serial is below the head's `registry_serial` (a registry from before
  a revocation put back), even for a consumer that has no state yet.

The state is written before its head, so a crash between the two leaves a head below the state,
never above it. The trainer keeps the newest `KEEP` heads and deletes older ones (best effort).
A reader that can delete objects can remove heads too; the heads hold against writers of old
objects.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from slime_stoa.protocol.layout import RunLayout, check_name
from slime_stoa.protocol.signing import PublicKey, SignatureError, SigningKey, sign_document, verify_document
from slime_stoa.protocol.store import NotFound, Store, StoreError
from slime_stoa.protocol.store.capped import TooLarge, read_capped_bytes
from slime_stoa.protocol.strict_json import load_json

log = logging.getLogger(__name__)

HEAD_FORMAT = "stoa.consumer-head/1"
MAX_HEAD_BYTES = 4096
SEQ_DIGITS = 12
KEEP = 4  # heads kept behind the newest
MAX_CANDIDATES = 16  # highest-numbered heads tried before giving up (junk under high numbers)


@dataclass(frozen=True, slots=True, order=True)
class ConsumerHead:
    seq: int  # the state sequence number of the save it follows
    registry_serial: int  # the registry serial that state was judged by


def heads_prefix(run: str) -> str:
    return f"{RunLayout(run).root}trainer/heads/"


def head_key(run: str, seq: int) -> str:
    return f"{heads_prefix(run)}{seq:0{SEQ_DIGITS}d}.json"


def key_seq(run: str, key: str) -> int | None:
    """The sequence number a head's key names, or None when it is not a head's key."""
    name = key[len(heads_prefix(run)) :]
    digits = name.removesuffix(".json")
    if not key.startswith(heads_prefix(run)) or len(digits) != SEQ_DIGITS or not digits.isdigit() or digits == name:
        return None
    return int(digits)


def head_bytes(run: str, head: ConsumerHead, key: SigningKey) -> bytes:
    doc = {"format": HEAD_FORMAT, "run": check_name("run", run), "seq": head.seq, "registry_serial": head.registry_serial}
    return json.dumps(sign_document(doc, key), sort_keys=True).encode()


def parse_head(data: bytes, *, run: str, seq: int, keys: Iterable[PublicKey]) -> ConsumerHead:
    """The head in `data` read under the key of `seq`; ValueError unless a run key signed it
    for this run and this sequence number."""
    doc = load_json(data, max_bytes=MAX_HEAD_BYTES)
    try:
        verify_document(doc, list(keys), where="consumer head")
    except SignatureError as exc:
        raise ValueError(str(exc)) from None
    serial = doc.get("registry_serial")
    if doc.get("format") != HEAD_FORMAT or doc.get("run") != run or doc.get("seq") != seq:
        raise ValueError(f"not the consumer head {seq} of run {run!r}")
    if isinstance(serial, bool) or not isinstance(serial, int) or serial < 0:
        raise ValueError(f"consumer head {seq}: bad registry_serial")
    return ConsumerHead(seq, serial)


async def read_head(store: Store, run: str, keys: Iterable[PublicKey]) -> ConsumerHead | None:
    """The newest head of `run` signed by one of the run `keys` (at most MAX_CANDIDATES of the
    highest-numbered tried, each read capped), or None when there is none. A head that does not
    verify is skipped; a failed listing raises its StoreError."""
    keys = list(keys)
    listed = [(key_seq(run, info.key), info.key) async for info in store.list(heads_prefix(run))]
    found = sorted(((seq, key) for seq, key in listed if seq is not None), reverse=True)
    for seq, key in found[:MAX_CANDIDATES]:
        try:
            return parse_head(await read_capped_bytes(store, key, MAX_HEAD_BYTES), run=run, seq=seq, keys=keys)
        except (NotFound, TooLarge, ValueError) as exc:
            log.warning("stoa: skipping consumer head %s: %s", key, exc)
    return None


async def write_head(store: Store, run: str, head: ConsumerHead, key: SigningKey) -> None:
    """Write `head`, then delete heads older than the newest KEEP (best effort)."""
    await store.put(head_key(run, head.seq), head_bytes(run, head, key))
    try:
        old = [info.key async for info in store.list(heads_prefix(run))
               if (seq := key_seq(run, info.key)) is not None and seq <= head.seq - KEEP]
        for stale in old:
            await store.delete(stale)
    except StoreError as exc:
        log.debug("stoa: old consumer heads not deleted: %s", exc)
