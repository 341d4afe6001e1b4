"""What a publishing process wrote to its weight chains, noted at the store edge.

A publishing process wraps its store in `KeptChainStore` (`kept_chain_store`). Every call passes
through unchanged; on top, for each weight object of its run it writes (the bf16 chain's and each
quantized plane's: `RunLayout.weight_object_version`):

- it notes the size and ETag the store answered (`written`): what `chain_keeper` compares a HEAD
  with, so a deleted or overwritten object is found without downloading it;
- for the small ones (version manifests, patches, anchor manifests) it also keeps the bytes, on
  the trainer's disk (`TrainerCopies` under `<keep_dir>/live-chain`), so they can be put back byte
  for byte. Anchor shards are only noted: they are large, and a lost one is replaced by a fresh
  anchor (`chain_keeper`), not put back.

The copies live in their own folder beside the committer's (`commit.Committer.put_back_window`
forgets version manifests past the records' window; a joining worker walks every manifest back to
the anchor). What the publisher deletes itself (retention) is forgotten here too, and
`forget_below` drops what precedes a chain's newest anchor, so the folder holds one anchor
interval of patches and manifests per chain. The notes are saved beside the copies
(`save_notes`, after each check) and read back when the store is wrapped again, so a restarted
publisher still checks by HEAD what it wrote before; a notes file it cannot read is ignored (the
objects are then checked once by their content).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from pathlib import Path

from slime_stoa.protocol.fsutil import atomic_write
from slime_stoa.protocol.kept import TrainerCopies
from slime_stoa.protocol.layout import QUANT_PLANES, RunLayout
from slime_stoa.protocol.store import GetResult, ObjectInfo, ServerDate, Store
from slime_stoa.protocol.store.base import Payload

#: The folder under `keep_dir` holding the live chains' small objects (never a bucket key's first
#: segment, which is always "runs").
LIVE_CHAIN_FOLDER = "live-chain"
#: The notes' file of a run, in the run's folder there (`runs/<run>/notes.json`: no weight key).
NOTES_FILE = "notes.json"

log = logging.getLogger("stoa.pulse")


@dataclass(frozen=True, slots=True)
class Noted:
    """An object as the store answered its write: size (None: a streamed payload) and ETag."""

    size: int | None
    etag: str

    def matches(self, info: ObjectInfo) -> bool:
        return info.etag == self.etag and (self.size is None or info.size == self.size)


class KeptChainStore(Store):
    """`inner`, noting (and keeping the small ones of) the weight objects of run `run` written
    through it (module doc). The notes are read and changed on the event loop only."""

    def __init__(self, inner: Store, run: str, copies: TrainerCopies) -> None:
        self.inner = inner
        self.url = inner.url
        self.copies = copies
        self.layouts = tuple(RunLayout(run, plane) for plane in (None, *QUANT_PLANES))
        self.written: dict[str, Noted] = self._load_notes()

    # -- the notes on the trainer's disk ------------------------------------------------------
    @property
    def notes_path(self) -> Path:
        return self.copies.path(self.layouts[0].root + NOTES_FILE)

    def _load_notes(self) -> dict[str, Noted]:
        """The notes saved by an earlier process (this run's weight objects only); none when
        there are none or they cannot be read."""
        try:
            doc = json.loads(self.notes_path.read_bytes())
            notes = {
                key: Noted(size, etag) for key, (size, etag) in doc.items()
                if self.layout_of(key) is not None and isinstance(etag, str)
                and (size is None or (isinstance(size, int) and not isinstance(size, bool)))
            }
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.warning("stoa: ignoring unreadable notes %s (%s): the chain's objects are checked by content once",
                        self.notes_path, exc)
            return {}
        return notes

    def save_notes(self) -> None:
        """Save the notes beside the copies (read back by the next process that wraps the store)."""
        doc = {key: [noted.size, noted.etag] for key, noted in sorted(self.written.items())}
        self.notes_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.notes_path, json.dumps(doc).encode())

    # -- what is noted ------------------------------------------------------------------------
    def layout_of(self, key: str) -> RunLayout | None:
        """The chain layout a weight object `key` belongs to; None for any other key."""
        return next((lay for lay in self.layouts if lay.weight_object_version(key) is not None), None)

    def small(self, key: str) -> bool:
        """Whether `key` is a weight object kept byte for byte (not an anchor shard)."""
        lay = self.layout_of(key)
        return lay is not None and (
            lay.parse_version_manifest(key) is not None
            or lay.parse_patch(key) is not None
            or lay.parse_anchor_manifest(key) is not None
        )

    async def _note(self, key: str, data: Payload, etag: str) -> None:
        if self.layout_of(key) is None:
            return
        whole = data if isinstance(data, bytes | bytearray | memoryview) else None
        self.written[key] = Noted(None if whole is None else memoryview(whole).nbytes, etag)
        if whole is not None and self.small(key):
            await asyncio.to_thread(self.copies.keep, key, bytes(whole))

    def note(self, key: str, info: ObjectInfo) -> None:
        """Take `info` as the object written at `key` (one checked by its content, or by its size
        against its manifest, after a restart emptied `written`)."""
        self.written[key] = Noted(info.size, info.etag)

    def forget(self, key: str) -> None:
        self.written.pop(key, None)
        if self.small(key):
            self.copies.forget(key)

    def kept_keys(self, layout: RunLayout) -> Iterator[str]:
        """The keys of `layout`'s chain with a copy on disk."""
        for prefix in (layout.versions_prefix, layout.patches_prefix, layout.anchors_prefix):
            folder = self.copies.path(prefix.rstrip("/"))
            if folder.is_dir():
                for path in folder.rglob("*"):
                    key = prefix + path.relative_to(folder).as_posix()
                    if path.is_file() and layout.weight_object_version(key) is not None:
                        yield key

    def forget_below(self, layout: RunLayout, version: int) -> int:
        """Forget the notes and copies of `layout`'s chain older than `version` (its newest
        anchor: nothing a worker needs to reach the head); how many copies went."""
        def older(key: str) -> bool:
            parsed = layout.weight_object_version(key)
            return parsed is not None and parsed[0] < version

        for key in [k for k in self.written if older(k)]:
            del self.written[key]
        doomed = [k for k in self.kept_keys(layout) if older(k)]
        for key in doomed:
            self.copies.forget(key)
        return len(doomed)

    # -- the store, passed through ------------------------------------------------------------
    async def get(
        self, key: str, *, offset: int = 0, length: int | None = None, if_none_match: str | None = None
    ) -> GetResult | None:
        return await self.inner.get(key, offset=offset, length=length, if_none_match=if_none_match)

    async def put(self, key: str, data: Payload, *, if_match: str | None = None) -> str:
        etag = await self.inner.put(key, data, if_match=if_match)
        await self._note(key, data, etag)
        return etag

    async def put_if_absent(self, key: str, data: Payload) -> str:
        etag = await self.inner.put_if_absent(key, data)
        await self._note(key, data, etag)
        return etag

    async def head(self, key: str) -> ObjectInfo:
        return await self.inner.head(key)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncGenerator[ObjectInfo, None]:
        return self.inner.list(prefix, start_after=start_after)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)
        self.forget(key)  # the publisher's own delete (retention): nothing to put back

    def server_date(self) -> ServerDate | None:
        return self.inner.server_date()

    async def close(self) -> None:
        await self.inner.close()


def kept_chain_store(store: Store, run: str, keep_dir: str | Path | None) -> Store:
    """`store` as a publishing process of run `run` uses it: wrapped in a `KeptChainStore` when
    it keeps copies (`PublisherConfig.keep_dir`), else as it is."""
    copies = TrainerCopies.at(keep_dir)
    if copies is None:
        return store
    return KeptChainStore(store, run, TrainerCopies(copies.folder / LIVE_CHAIN_FOLDER))
