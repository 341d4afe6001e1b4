"""A search index in the bucket: its folder cut into chunks, a manifest written last, and a
resumable, verified download onto a worker.

    runs/<run>/tasks/<task>/index/<file>.<nnnnn>     chunk n of one index file
    runs/<run>/tasks/<task>/index/manifest.json      {"format": "stoa.search-index/3",
        "passages": n, "files": [{"name", "size", "sha256",
                                  "chunks": [{"name", "size", "sha256"}, ...]}, ...]}

The operator uploads with put-if-absent (`upload_index`): a re-run writes nothing new and a
chunk that already holds other bytes is an error (an index is immutable within a run). The
manifest is the last object written, so a reader that finds it finds every chunk.

`fetch_index` trusts nothing it reads. The manifest must name exactly the files of a compact
index folder (`compact.INDEX_FILES`: the index, its settings and the zstd passage blocks; an index
of an earlier format is refused with the command that rebuilds it), chunk `n` of file `f` must be
named `f.<nnnnn>` (the layout's name grammar: one safe path component), sizes must add up and
stay under `max_bytes`, and every chunk and every assembled file must match its sha256. The manifest itself is pinned by
`expected_sha256` (the digest `prepare` recorded in the task meta) and its bytes checked against
it before they are parsed; without one nothing authenticates it, and the fetch is refused. Nothing is written outside
`dest`: each file is assembled in place in `dest/<file>.partial` (its final size; each verified
chunk written at its offset, its index then listed in `dest/.parts/<file>.done`), checked whole
once and renamed into place; `dest/manifest.json` and the verified stamp (`dest/.verified.json`:
the manifest's digest, each file's size and mtime) are written last; `dest/.fetch.lock` lets one
process fetch at a time. A download cut short
resumes from the chunks listed. A later start whose stamp still holds (same digest, same sizes
and mtimes) reads and hashes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import re
import threading
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_stoa.protocol.fsutil import atomic_write
from slime_stoa.protocol.layout import RunLayout, check_name
from slime_stoa.protocol.store import PreconditionFailed, Store
from slime_stoa.protocol.store.capped import read_capped_bytes
from slime_stoa.protocol.strict_json import load_json
from slime_stoa.tasks.search import compact

FORMAT = "stoa.search-index/3"
#: What `stoa task prepare search` builds again, named in the refusal of an old index.
REBUILD = "rebuild it with `stoa task prepare search`"
#: The formats of earlier stoas, and why such an index is refused (each a rebuild away).
OLD_FORMATS = {
    "stoa.search-index/1": f"built by an earlier stoa, whose tokeniser dropped numbers and one-letter words; {REBUILD}",
    "stoa.search-index/2": f"built as bm25s arrays by an earlier stoa; {REBUILD}",
}
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 8 << 20  # an index manifest is read no larger (a file list of a few KiB)
PARTS = ".parts"
PARTIAL = ".partial"
STAMP = ".verified.json"
LOCK = ".fetch.lock"  # in the folder, flock: one fetch at a time into it (never deleted: one inode for all)
LOCK_POLL_S = 0.2
DEFAULT_CHUNK_BYTES = 64 << 20
MAX_CHUNK_BYTES = 512 << 20  # one chunk is held in memory while it is checked
DEFAULT_MAX_BYTES = 256 << 30  # a PubMed-sized index (16M passages) is tens of GB
#: The files of an index folder (`build_index(compact_format=True)`): the compact index, its
#: settings and the zstd passage blocks.
INDEX_FILES = frozenset(compact.INDEX_FILES)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_READ = 1 << 20


@dataclass(frozen=True, slots=True)
class Chunk:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class IndexFile:
    name: str
    size: int
    sha256: str
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True, slots=True)
class IndexManifest:
    """A checked index manifest (`parse_manifest`)."""

    passages: int
    files: tuple[IndexFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def chunk_name(file: str, n: int) -> str:
    return check_name("index chunk", f"{file}.{n:05d}")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ):
            h.update(block)
    return h.hexdigest()


# -- the manifest ------------------------------------------------------------------------------


def build_manifest(folder: Path, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, passages: int) -> IndexManifest:
    """The manifest of an index folder cut into chunks of `chunk_bytes` (the last one shorter)."""
    if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
    present = {p.name for p in folder.iterdir()}
    if present != INDEX_FILES:
        raise ValueError(f"{folder}: expected exactly the index files {sorted(INDEX_FILES)}, found {sorted(present)}")
    files = []
    for name in sorted(INDEX_FILES):
        whole = hashlib.sha256()
        chunks: list[Chunk] = []
        with open(folder / name, "rb") as f:
            while block := f.read(chunk_bytes):
                whole.update(block)
                chunks.append(Chunk(chunk_name(name, len(chunks)), len(block), hashlib.sha256(block).hexdigest()))
        size = sum(c.size for c in chunks)
        files.append(IndexFile(name, size, whole.hexdigest(), tuple(chunks)))
    return IndexManifest(passages=passages, files=tuple(files))


def encode_manifest(manifest: IndexManifest) -> bytes:
    doc = {
        "format": FORMAT,
        "passages": manifest.passages,
        "files": [
            {
                "name": f.name,
                "size": f.size,
                "sha256": f.sha256,
                "chunks": [{"name": c.name, "size": c.size, "sha256": c.sha256} for c in f.chunks],
            }
            for f in manifest.files
        ],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("ascii")


def _int(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"index manifest: {what} must be an int in [{low}, {high}], got {value!r}")
    return value


def _digest(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise ValueError(f"index manifest: {what} must be 64 lowercase hex digits")
    return value


def _object(value: Any, keys: set[str], what: str) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) != keys:
        raise ValueError(f"index manifest: {what} must be an object with keys {sorted(keys)}")
    return value


def parse_manifest(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> IndexManifest:
    """Check an index manifest read from the bucket; ValueError naming the first problem."""
    doc = _object(load_json(data), {"format", "passages", "files"}, "the document")
    if doc["format"] in OLD_FORMATS:
        raise ValueError(f"index manifest format is {doc['format']!r}: an index {OLD_FORMATS[doc['format']]}")
    if doc["format"] != FORMAT:
        raise ValueError(f"index manifest format is {doc['format']!r}, expected {FORMAT!r}")
    passages = _int(doc["passages"], "passages", 1, 1 << 40)
    if not isinstance(doc["files"], list):
        raise ValueError("index manifest: files must be a list")
    files = []
    for i, raw in enumerate(doc["files"]):
        f = _object(raw, {"name", "size", "sha256", "chunks"}, f"file {i}")
        name = check_name("index file", f["name"])
        if name not in INDEX_FILES:
            raise ValueError(f"index manifest: {name!r} is not an index file")
        size = _int(f["size"], f"{name} size", 0, max_bytes)
        if not isinstance(f["chunks"], list):
            raise ValueError(f"index manifest: {name} chunks must be a list")
        chunks: list[Chunk] = []
        for n, rc in enumerate(f["chunks"]):
            c = _object(rc, {"name", "size", "sha256"}, f"{name} chunk {n}")
            if c["name"] != chunk_name(name, n):
                raise ValueError(f"index manifest: chunk {n} of {name} must be named {chunk_name(name, n)!r}")
            what = f"{c['name']} size"
            chunks.append(Chunk(c["name"], _int(c["size"], what, 1, MAX_CHUNK_BYTES), _digest(c["sha256"], c["name"])))
        if sum(c.size for c in chunks) != size:
            raise ValueError(f"index manifest: the chunks of {name} do not add up to {size} bytes")
        files.append(IndexFile(name, size, _digest(f["sha256"], name), tuple(chunks)))
    names = [f.name for f in files]
    if sorted(names) != sorted(INDEX_FILES):
        raise ValueError(f"index manifest: expected each of {sorted(INDEX_FILES)} once, got {names}")
    manifest = IndexManifest(passages=passages, files=tuple(files))
    if manifest.total_bytes > max_bytes:
        raise ValueError(f"index is {manifest.total_bytes} bytes, over the limit of {max_bytes} (max_bytes)")
    return manifest


# -- upload (operator) -------------------------------------------------------------------------


async def _put_once(store: Store, key: str, data: bytes) -> None:
    try:
        await store.put_if_absent(key, data)
    except PreconditionFailed:
        if await store.get_bytes(key) != data:
            raise ValueError(f"{key} already holds different data; a run's index is immutable") from None


async def upload_index(
    store: Store, run: str, folder: Path, *, task: str = "search", passages: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> str:
    """Upload an index folder as chunks, then its manifest; returns the manifest's sha256."""
    layout = RunLayout(run)
    manifest = build_manifest(folder, chunk_bytes=chunk_bytes, passages=passages)
    body = encode_manifest(manifest)
    key = layout.task_index_file(task, MANIFEST)
    if await store.exists(key):
        await _put_once(store, key, body)  # complete already: the same index, or an error
        return hashlib.sha256(body).hexdigest()
    for f in manifest.files:
        with open(folder / f.name, "rb") as fh:
            for c in f.chunks:
                await _put_once(store, layout.task_index_file(task, c.name), fh.read(c.size))
    await _put_once(store, key, body)
    return hashlib.sha256(body).hexdigest()


# -- download (worker) -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Stamp:
    """What a completed fetch verified: the manifest's digest and each file's size and mtime."""

    digest: str
    files: dict[str, tuple[int, int]]

    def encode(self) -> bytes:
        doc = {"manifest_sha256": self.digest, "files": {k: list(v) for k, v in self.files.items()}}
        return json.dumps(doc, sort_keys=True).encode("ascii")


def _file_marks(dest: Path, names: Iterable[str]) -> dict[str, tuple[int, int]] | None:
    marks = {}
    for name in names:
        try:
            st = (dest / name).stat()
        except OSError:
            return None
        marks[name] = (st.st_size, st.st_mtime_ns)
    return marks


def _stamp_holds(dest: Path, digest: str | None) -> str | None:
    """The digest of the index verified in `dest` if its stamp still describes the files on disk
    (and matches `digest` when given), else None. Reads only small files and stats."""
    try:
        doc = load_json((dest / STAMP).read_bytes(), max_bytes=1 << 16)
        body = (dest / MANIFEST).read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict) or set(doc["files"]) != INDEX_FILES:
        return None
    stamped = doc.get("manifest_sha256")
    if stamped != hashlib.sha256(body).hexdigest() or (digest is not None and stamped != digest):
        return None
    marks = _file_marks(dest, INDEX_FILES)
    if marks is None or any(list(marks[k]) != v for k, v in doc["files"].items()):
        return None
    return stamped if isinstance(stamped, str) else None


def verified_digest(dest: str | Path) -> str | None:
    """The manifest digest of the index a completed `fetch_index` verified in `dest`, while its
    stamp still describes the files there (None otherwise). Stats only, no hashing."""
    return _stamp_holds(Path(dest), None)


def _have(path: Path, f: IndexFile) -> bool:
    return path.is_file() and path.stat().st_size == f.size and _sha256_file(path) == f.sha256


class _InPlace:
    """One index file assembled in place: `<name>.partial` has the file's final size and each
    verified chunk is written at its offset; `.parts/<name>.done` lists the chunks written (each
    flushed to disk before it is listed) with the file's digest, so an interrupted fetch of the
    same file resumes where it stopped."""

    def __init__(self, dest: Path, f: IndexFile):
        self.f, self.dest = f, dest
        self.partial = dest / f"{f.name}{PARTIAL}"
        self.record = dest / PARTS / f"{f.name}.done"
        self.offsets = list(itertools.accumulate((c.size for c in f.chunks[:-1]), initial=0))
        self.done: set[int] = set()
        if self.partial.is_file() and self.partial.stat().st_size == f.size:
            try:
                raw = load_json(self.record.read_bytes(), max_bytes=1 << 24)
            except (OSError, ValueError):
                raw = None
            if isinstance(raw, dict) and raw.get("sha256") == f.sha256 and isinstance(raw.get("done"), list):
                self.done = {i for i in raw["done"] if isinstance(i, int) and 0 <= i < len(f.chunks)}
        else:
            self.record.unlink(missing_ok=True)
        with open(self.partial, "ab") as out:
            out.truncate(f.size)
        self._lock = threading.Lock()

    def write(self, i: int, data: bytes) -> None:
        with open(self.partial, "r+b") as out:
            out.seek(self.offsets[i])
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        with self._lock:
            self.done.add(i)
            atomic_write(self.record, json.dumps({"sha256": self.f.sha256, "done": sorted(self.done)}).encode("ascii"))

    def finish(self) -> None:
        """Check the whole file once and move it into place (ValueError, and the partial file
        dropped, if it does not match its digest)."""
        if _sha256_file(self.partial) != self.f.sha256:
            self.partial.unlink(missing_ok=True)
            self.record.unlink(missing_ok=True)
            raise ValueError(f"index file {self.f.name} does not match its manifest digest (refused)")
        os.replace(self.partial, self.dest / self.f.name)
        self.record.unlink(missing_ok=True)


async def _fetch_chunk(store: Store, layout: RunLayout, task: str, target: _InPlace, i: int, gate: asyncio.Semaphore) -> None:
    c = target.f.chunks[i]
    async with gate:
        data = await store.get_bytes(layout.task_index_file(task, c.name))
    if len(data) != c.size or hashlib.sha256(data).hexdigest() != c.sha256:
        raise ValueError(f"index chunk {c.name} does not match its manifest digest (refused)")
    await asyncio.to_thread(target.write, i, data)


@contextlib.asynccontextmanager
async def _fetch_lock(dest: Path) -> AsyncIterator[None]:
    """Hold `dest`'s fetch lock inside the block: another process (or task) fetching into the same
    folder waits here, polling, and is cancellable while it waits. The kernel lets go of a flock
    when its process ends, however it ends, so a crashed fetch never leaves the folder locked."""
    dest.mkdir(parents=True, exist_ok=True)
    fd = os.open(dest / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # closing the descriptor lets go of the lock


async def fetch_index(
    store: Store,
    run: str,
    dest: str | Path,
    *,
    task: str = "search",
    expected_sha256: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    parallel: int = 4,
) -> Path:
    """Download (or finish downloading) the run's index into `dest`; returns `dest`, ready for
    `Retriever.open`. ValueError for a manifest or chunk that fails its checks, and without
    `expected_sha256` (the task meta's pin: nothing else authenticates the manifest).

    Verified once: a completed fetch writes a stamp (`STAMP`: the manifest's digest, each file's
    size and mtime). When the stamp still holds and names `expected_sha256`, nothing is read from
    the bucket and nothing is hashed. Files are assembled in place (`_InPlace`): the disk holds the index once,
    not chunks and a copy.

    Several processes may fetch into one `dest` at once (the workers of one machine share its
    index): the fetch holds `dest/.fetch.lock` (flock), so one downloads while the others wait, then find
    its stamp and return without reading a chunk."""
    dest = Path(dest)
    if expected_sha256 is None:  # nothing would authenticate the manifest: refused before it is read
        raise ValueError("the task pins no index manifest (its meta's index.manifest_sha256): "
                         "refusing an unauthenticated index; prepare the task again (stoa task prepare search)")
    if _stamp_holds(dest, expected_sha256):
        return dest  # the usual start: no lock, no bucket, no hashing
    async with _fetch_lock(dest):
        return await _fetch_locked(store, run, dest, task=task, expected_sha256=expected_sha256,
                                   max_bytes=max_bytes, parallel=parallel)


async def _fetch_locked(
    store: Store, run: str, dest: Path, *, task: str, expected_sha256: str, max_bytes: int, parallel: int
) -> Path:
    """`fetch_index` once `dest`'s fetch lock is held: the manifest read, checked against
    `expected_sha256` before it is parsed."""
    if _stamp_holds(dest, expected_sha256):
        return dest  # fetched by the process that held the lock before
    layout = RunLayout(run)
    body = await read_capped_bytes(store, layout.task_index_file(task, MANIFEST), MAX_MANIFEST_BYTES)
    digest = hashlib.sha256(body).hexdigest()
    if digest != expected_sha256:
        raise ValueError("the index manifest in the bucket is not the one the task names (refused)")
    manifest = parse_manifest(body, max_bytes=max_bytes)
    (dest / PARTS).mkdir(parents=True, exist_ok=True)
    (dest / STAMP).unlink(missing_ok=True)  # complete again only once every file checks out
    (dest / MANIFEST).unlink(missing_ok=True)
    gate = asyncio.Semaphore(max(1, parallel))
    for f in manifest.files:
        if await asyncio.to_thread(_have, dest / f.name, f):
            continue
        (dest / f.name).unlink(missing_ok=True)
        target = await asyncio.to_thread(_InPlace, dest, f)
        todo = [i for i in range(len(f.chunks)) if i not in target.done]
        # every chunk settles (written and listed, or failed) before an error is raised: no write
        # is left running behind a failed fetch
        results = await asyncio.gather(*(_fetch_chunk(store, layout, task, target, i, gate) for i in todo), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        await asyncio.to_thread(target.finish)
    for stale in [*(dest / PARTS).iterdir(), *dest.glob(f"*{PARTIAL}")]:  # left by an earlier, different index
        if stale.is_file():
            stale.unlink()
    atomic_write(dest / MANIFEST, body)
    marks = _file_marks(dest, INDEX_FILES)
    if marks is None:
        raise ValueError(f"{dest}: an index file vanished while the fetch finished")
    atomic_write(dest / STAMP, _Stamp(digest, marks).encode())
    return dest
