"""The live chain kept whole: what a worker needs to reach the head is put back when a bucket
writer deletes or overwrites it, or replaced by a fresh anchor when it cannot be put back.

Each round of a publishing process's keeper (`keepalive.PointerKeeper`, every
`freshness.REFRESH_S`, holding the lock its publishes hold) calls `keep_chains` on the chains its
publisher serves (the bf16 weights' and each quantized plane's). For a chain whose store notes
what it wrote (`kept_chain.KeptChainStore`) and that has a head, it checks the objects a worker
joining or catching up reads (`live_keys`): each version manifest from the head down to its
anchor's version, the patches they name, and the anchor (its manifest and every file). Each is
one HEAD, compared with the size and ETag its write was answered with; nothing is downloaded.

- A version manifest, patch or anchor manifest gone or changed is written back byte for byte
  from the trainer's copy (`put_back`).
- An anchor shard gone or changed (the trainer may not hold that version's weights any more), or
  a small object the trainer holds no copy of: the chain's next version is published as a fresh
  anchor (the chain's anchor policy `forced`), and that is reported in one line.
- The copies older than the head's anchor are forgotten (`KeptChainStore.forget_below`).

Before a restarted publisher opens (`kept_publisher_store`), every small object it keeps a copy of
is checked the same way and put back (`put_back_kept`): its resume reads the chain back from the
bucket, and a patch deleted while it was down would otherwise refuse that resume. An object
the saved notes do not cover (written after the last save) is checked once by its content (its
size first, so a writer's large object is never read), an anchor file by the size its kept
manifest names; what matches is noted. The walk down the manifests goes through the trainer's
copies; it stops at a manifest it holds none of (one kept folder started mid-chain), whose own
key is still checked: what lies below it is checked from the next anchor on.

What a bucket writer can still cost: one re-upload (one small object, or one anchor at the next
version) per object it deletes or spoils in each check interval, and the workers that need such an
object wait at most one interval (and, for an anchor, until the next version) for it. A writer
that deletes again after each round makes the trainer re-upload once a round, never stops it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import NotFound, ObjectInfo, Store, StoreConfigError, StoreError

from .chain import ChainPublisher
from .kept_chain import KeptChainStore, kept_chain_store
from .manifests import AnchorManifest, ManifestError, VersionManifest
from .publisher import Publisher

log = logging.getLogger("stoa.pulse")

#: HEADs (and put-backs) in flight in one chain's check.
CHECKS_IN_FLIGHT = 8

Verdict = Literal["ok", "put_back", "lost"]
Job = tuple[str, Callable[[], Awaitable[Verdict]]]  # a key and the check that gives its verdict


@dataclass
class ChainCheck:
    """What one round found on one chain."""

    checked: int = 0
    put_back: list[str] = field(default_factory=list)  # written back from the trainer's copy
    lost: list[str] = field(default_factory=list)  # gone or changed, with no copy: a fresh anchor is due
    anchor_forced: bool = False  # this round asked the chain for an anchor at its next version


def live_keys(layout: RunLayout, head: VersionManifest, kept: Callable[[str], bytes | None]) -> list[str]:
    """The small objects a worker reads to reach `head` from its anchor, newest first: each
    version manifest from `head` down to the anchor's version and the patches each names, then
    the anchor's manifest. The walk reads the parents from `kept` (the trainer's copies, its own
    bytes); at a parent it holds no readable copy of, it lists that manifest's key and stops."""
    keys: list[str] = []
    manifest = head
    while True:
        keys.append(layout.version_manifest(manifest.version, manifest.attempt))
        keys += [patch.key for patch in manifest.patches]
        parent = manifest.parent
        if parent is None or parent.version < head.anchor.version:
            break
        data = kept(parent.manifest)
        try:
            if data is None:
                raise ManifestError("no copy")
            manifest = VersionManifest.from_bytes(data, parent.manifest, key=parent.manifest)
        except ManifestError:
            keys.append(parent.manifest)
            break
    keys.append(head.anchor.manifest)
    return keys


def anchor_files(store: KeptChainStore, anchor_manifest: str) -> list[tuple[str, int | None]]:
    """The files of the anchor whose manifest is at `anchor_manifest` (its manifest aside), with
    their sizes: from the trainer's copy of the manifest, else from what this process wrote."""
    data = store.copies.kept(anchor_manifest)
    if data is not None:
        try:
            manifest = AnchorManifest.from_bytes(data, anchor_manifest, key=anchor_manifest)
        except ManifestError:
            pass
        else:
            return [(f.key, f.bytes) for f in (*manifest.weights, *manifest.extras)]
    folder = anchor_manifest.rsplit("/", 1)[0] + "/"
    return [(key, noted.size) for key, noted in store.written.items() if key.startswith(folder) and key != anchor_manifest]


async def _head(store: KeptChainStore, key: str) -> ObjectInfo | None:
    try:
        return await store.inner.head(key)
    except NotFound:
        return None


async def _holds(store: KeptChainStore, key: str, data: bytes) -> bool:
    try:
        return await store.inner.get_bytes(key) == data
    except NotFound:
        return False


async def check_small(store: KeptChainStore, key: str) -> Verdict:
    """One small object: as written ("ok"), written back from the trainer's copy ("put_back"),
    or gone or changed with no copy to put back ("lost")."""
    info = await _head(store, key)
    noted = store.written.get(key)
    if info is not None and noted is not None and noted.matches(info):
        return "ok"
    data = await asyncio.to_thread(store.copies.kept, key)
    # Not written by this process (a restart): checked once by content, its size first.
    if info is not None and noted is None and (data is None or (info.size == len(data) and await _holds(store, key, data))):
        store.note(key, info)
        return "ok"
    if data is None:
        return "lost"
    await store.put(key, data)  # through the wrapper: its new ETag is noted
    log.warning("stoa: %s was %s; put the trainer's own copy back", key, "gone" if info is None else "changed")
    return "put_back"


async def check_anchor_file(store: KeptChainStore, key: str, size: int | None) -> Verdict:
    """One anchor file: as written ("ok") or gone or changed ("lost"; never put back)."""
    info = await _head(store, key)
    if info is None:
        return "lost"
    noted = store.written.get(key)
    if noted is not None:
        return "ok" if noted.matches(info) else "lost"
    if size is not None and info.size != size:
        return "lost"
    store.note(key, info)  # after a restart: the size its manifest names
    return "ok"


async def keep_chain(chain: ChainPublisher) -> ChainCheck:
    """One round on one chain (module doc). StoreError when the store fails; the next round
    checks again."""
    store, head, check = chain.store, chain.head, ChainCheck()
    if not isinstance(store, KeptChainStore) or head is None:
        return check
    layout = chain.layout
    small = await asyncio.to_thread(live_keys, layout, head, store.copies.kept)
    files = anchor_files(store, head.anchor.manifest)  # on the loop, as every use of the notes
    jobs: list[Job] = [(key, partial(check_small, store, key)) for key in small]
    jobs += [(key, partial(check_anchor_file, store, key, size)) for key, size in files]
    for key, verdict in await _verdicts(jobs):
        check.checked += 1
        if verdict == "put_back":
            check.put_back.append(key)
        elif verdict == "lost":
            check.lost.append(key)
    if check.lost and not chain.anchor_forced:  # reported once: until the anchor lands it stays forced
        chain.force_anchor()
        check.anchor_forced = True
        on = "" if layout.plane is None else f" plane {layout.plane}"
        log.warning(
            "stoa: run %s%s: %d object(s) a worker needs to reach v%d are gone or changed and cannot be put back "
            "(%s%s); the next version is published as a fresh anchor",
            layout.run, on, len(check.lost), head.version, check.lost[0], ", ..." if len(check.lost) > 1 else "",
        )
    store.forget_below(layout, head.anchor.version)  # a few files: one anchor interval
    store.save_notes()
    return check


async def _verdicts(jobs: Iterable[Job]) -> list[tuple[str, Verdict]]:
    """Each job's verdict, at most CHECKS_IN_FLIGHT of them running at once."""
    limit = asyncio.Semaphore(CHECKS_IN_FLIGHT)

    async def bounded(key: str, job: Callable[[], Awaitable[Verdict]]) -> tuple[str, Verdict]:
        async with limit:
            return key, await job()

    return list(await asyncio.gather(*(bounded(key, job) for key, job in jobs)))


async def put_back_kept(store: KeptChainStore) -> list[str]:
    """Before the publisher opens: every small object of the run kept on the trainer's disk that
    the bucket lacks or holds changed is put back (module doc); the keys put back. A store that
    fails is logged: the keeper's rounds check again once the publisher is open."""
    keys = [key for layout in store.layouts for key in await asyncio.to_thread(list, store.kept_keys(layout))]
    try:
        verdicts = await _verdicts((key, partial(check_small, store, key)) for key in keys if store.small(key))
    except StoreConfigError:
        raise
    except StoreError as exc:
        log.warning("stoa: could not check the kept weight objects before opening (%s); the keeper checks them", exc)
        return []
    store.save_notes()
    return [key for key, verdict in verdicts if verdict == "put_back"]


async def kept_publisher_store(store: Store, run: str, keep_dir: str | Path | None) -> Store:
    """`store` as a publishing process of run `run` opens it: wrapped (`kept_chain.kept_chain_store`)
    when it keeps copies in `keep_dir`, and what it kept put back (`put_back_kept`)."""
    wrapped = kept_chain_store(store, run, keep_dir)
    if isinstance(wrapped, KeptChainStore):
        await put_back_kept(wrapped)
    return wrapped


async def keep_chains(chains: Iterable[ChainPublisher]) -> list[ChainCheck]:
    """`keep_chain` on each chain; a store that fails one is logged (the next round checks
    again), a wrong store configuration is raised."""
    checks = []
    for chain in chains:
        try:
            checks.append(await keep_chain(chain))
        except StoreConfigError:
            raise
        except StoreError as exc:
            log.warning("run %s: could not check the weight chain (%s); checking again next round", chain.layout.run, exc)
    return checks


def publisher_chains(publisher: Publisher) -> list[ChainPublisher]:
    """The chains `publisher` serves: its bf16 weights' and each quantized plane's."""
    return [publisher.weights, *publisher.planes.values()]
