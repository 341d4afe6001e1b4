"""A search index in the bucket: its folder cut into chunks, a manifest written last, and a
resumable, verified download onto a worker.

    runs/<run>/tasks/<task>/index/<file>.<nnnnn>     chunk n of one index file
    runs/<run>/tasks/<task>/index/manifest.json      {"format": "stoa.search-index/1",
        "passages": n, "files": [{"name", "size", "sha256",
                                  "chunks": [{"name", "size", "sha256"}, ...]}, ...]}

The operator uploads with put-if-absent (`upload_index`): a re-run writes nothing new and a
chunk that already holds other bytes is an error (an index is immutable within a run). The
manifest is the last object written, so a reader that finds it finds every chunk.

`fetch_index` trusts nothing it reads. The manifest must name exactly the files of an index
folder (`retriever.INDEX_FILES`), chunk `n` of file `f` must be named `f.<nnnnn>` (the layout's
name grammar: one safe path component), sizes must add up and stay under `max_bytes`, and every
chunk and every assembled file must match its sha256. With `expected_sha256` (the digest
`prepare` recorded in the task meta) the manifest itself is pinned. Nothing is written outside
`dest`: chunks go to `dest/.parts/` (each an atomic write, `protocol.fsutil`), verified files are
assembled into `dest` atomically and their chunks removed, and `dest/manifest.json` is written
last. A download cut short resumes: verified files and chunks on disk are kept (re-hashed, never
re-fetched), anything damaged is fetched again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_stoa.protocol.fsutil import atomic_file, atomic_write
from slime_stoa.protocol.layout import RunLayout, check_name
from slime_stoa.protocol.store import PreconditionFailed, Store
from slime_stoa.protocol.strict_json import load_json
from slime_stoa.tasks.search.passages import OFFSETS_FILE, TEXT_FILE

FORMAT = "stoa.search-index/1"
MANIFEST = "manifest.json"
PARTS = ".parts"
DEFAULT_CHUNK_BYTES = 64 << 20
MAX_CHUNK_BYTES = 512 << 20  # one chunk is held in memory while it is checked
DEFAULT_MAX_BYTES = 256 << 30  # a PubMed-sized index (16M passages) is tens of GB
#: The files of an index folder: bm25s's (retriever.INDEX_FILES, kept here so this module stays
#: free of bm25s) and the passage texts.
INDEX_FILES = frozenset(
    {
        "params.index.json",
        "vocab.index.json",
        "data.csc.index.npy",
        "indices.csc.index.npy",
        "indptr.csc.index.npy",
        TEXT_FILE,
        OFFSETS_FILE,
    }
)
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


async def _fetch_chunk(store: Store, layout: RunLayout, task: str, c: Chunk, parts: Path, gate: asyncio.Semaphore) -> None:
    path = parts / c.name
    if path.is_file() and path.stat().st_size == c.size and _sha256_file(path) == c.sha256:
        return
    async with gate:
        data = await store.get_bytes(layout.task_index_file(task, c.name))
    if len(data) != c.size or hashlib.sha256(data).hexdigest() != c.sha256:
        raise ValueError(f"index chunk {c.name} does not match its manifest digest (refused)")
    await asyncio.to_thread(atomic_write, path, data)


def _assemble(f: IndexFile, parts: Path, dest: Path) -> None:
    h = hashlib.sha256()
    with atomic_file(dest / f.name) as out:
        for c in f.chunks:
            with open(parts / c.name, "rb") as src:
                while block := src.read(_READ):
                    h.update(block)
                    out.write(block)
        if h.hexdigest() != f.sha256:
            raise ValueError(f"index file {f.name} does not match its manifest digest (refused)")
    for c in f.chunks:
        (parts / c.name).unlink(missing_ok=True)


def _have(path: Path, f: IndexFile) -> bool:
    return path.is_file() and path.stat().st_size == f.size and _sha256_file(path) == f.sha256


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
    `Retriever.open`. ValueError for a manifest or chunk that fails its checks."""
    dest = Path(dest)
    layout = RunLayout(run)
    body = await store.get_bytes(layout.task_index_file(task, MANIFEST))
    if expected_sha256 is not None and hashlib.sha256(body).hexdigest() != expected_sha256:
        raise ValueError("the index manifest in the bucket is not the one the task names (refused)")
    manifest = parse_manifest(body, max_bytes=max_bytes)
    parts = dest / PARTS
    parts.mkdir(parents=True, exist_ok=True)
    (dest / MANIFEST).unlink(missing_ok=True)  # complete again only once every file checks out
    gate = asyncio.Semaphore(max(1, parallel))
    for f in manifest.files:
        if await asyncio.to_thread(_have, dest / f.name, f):
            continue
        await asyncio.gather(*(_fetch_chunk(store, layout, task, c, parts, gate) for c in f.chunks))
        await asyncio.to_thread(_assemble, f, parts, dest)
    for stale in parts.iterdir():  # chunks of an earlier, different index
        if stale.is_file():
            stale.unlink()
    atomic_write(dest / MANIFEST, body)
    return dest
