"""The search index in a Mac's memory plan: its size read from the index manifest in the bucket
(`slime_stoa.tasks.search.bundle`: every file's size), never by downloading the index.

A run whose task is a search task (`Search`) has its index at
``runs/<run>/tasks/<task>/index/manifest.json``; the bucket only serves the compact format
(`bundle.parse_manifest` refuses any other manifest). What the plan counts of it
(`COUNTED_FILES`) is what stays resident: its postings, block and term tables and per-passage
norms whole (mapped, read by every query); its vocabulary takes no heap (searched in the mapped
term table) and its zstd passage blocks (`PASSAGE_FILES`) are read per hit, not counted. Plus the
queries' working memory (`QUERY_BYTES_PER_PASSAGE`: the scores of every passage and the decoded
candidates) once per query a worker process runs at once (`compact.QUERY_THREADS`, the bound
of its query threads, `retriever.query_executor`), however many episodes wait on the tool.

The plan is one worker's (`memory_plan`: each macd process plans its own memory against the
Mac's). The mapped files are shared by every macd of the Mac (one verified copy in the shared
folder, one copy in the page cache) yet each worker's plan counts them whole, since they must fit
beside that worker's own memory; the query memory is each process's own, so each plan counts it
for its own query threads.

The manifest is read capped (`MAX_MANIFEST_BYTES`) and checked like a worker checks it
(`bundle.parse_manifest`: the files of an index, sizes bounded and adding up); one that is
missing, too large or malformed gives a plan line saying the size is unknown and why, and 0
counted. The manifest is authenticated before it is parsed: the task data's header pins its
sha256 (`index.manifest_sha256`, recorded by `prepare`), read from the task data's first bytes
(`pinned_manifest_digest`: one ranged GET, its header line decompressed, never the items); a
manifest whose bytes do not match, or a task data that pins none, is refused unparsed (the
unknown plan, one line). In a signed run (its manifest names a run key) the task data is read
as the worker's task load reads it (`task_manifest.read_task_object`: whole, checked against the
run key's signed task manifest): a split a bucket writer replaced to pin a forged manifest is
refused, and the unknown plan carries that refusal (`IndexPlan.refused`, the task load's line)
for the worker to wait on as it waits for its task. When the machine's shared folder
(`shared_dir`) already holds that index, verified (`bundle.verified_digest`), the line says where.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import zstandard

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.store import NotFound, Store, StoreConfigError, StoreError
from slime_stoa.protocol.store.capped import read_capped_bytes
from slime_stoa.protocol.task_manifest import TaskDataRefused, read_task_object
from slime_stoa.tasks import TASKS
from slime_stoa.tasks.search import Search
from slime_stoa.tasks.search.bundle import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    IndexManifest,
    parse_manifest,
    verified_digest,
)
from slime_stoa.tasks.search.compact import FILES as COMPACT_FILES
from slime_stoa.tasks.search.compact import QUERY_THREADS
from slime_stoa.tasks.search.passages import BLOCKS_FILE, ZST_FILE

GIB = 1 << 30
#: The zstd passage blocks and their table: mapped, but a query reads only its top hits.
PASSAGE_FILES = frozenset({ZST_FILE, BLOCKS_FILE})
#: The files counted whole: postings, block and term tables, norms, parameters.
COUNTED_FILES = frozenset(COMPACT_FILES)
#: One query's heap, per passage: float32 scores of every passage when it scores them all, or
#: at most a quarter of the passages decoded as candidates (16 bytes each).
QUERY_BYTES_PER_PASSAGE = 8
#: The task data's first bytes read for its header line (the meta: a few KiB, a system prompt at most).
TASK_HEADER_BYTES = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class IndexPlan:
    """What the memory plan counts for a run's search index (bytes) and its words for it."""

    counted: int
    line: str
    known: bool = True  # False: the manifest could not be read or checked (0 counted)
    refused: TaskDataRefused | None = None  # a signed run's task data refused: what the task load says


def has_index(manifest: RunManifest) -> bool:
    """Whether the run's task searches an index (a `Search` task)."""
    cls = TASKS.get(manifest.task)
    return cls is not None and issubclass(cls, Search)


def index_key(manifest: RunManifest) -> str:
    return RunLayout(manifest.run).task_index_file(manifest.task, MANIFEST)


def known_plan(where: str, index: IndexManifest, fetched: Path | None) -> IndexPlan:
    """The plan of a checked index manifest (module doc): the counted files' bytes and the
    queries' working memory; the passages' named."""
    sizes = {f.name: f.size for f in index.files}
    mapped = sum(size for name, size in sizes.items() if name in COUNTED_FILES)
    passages = sum(size for name, size in sizes.items() if name in PASSAGE_FILES)
    queries = QUERY_THREADS * QUERY_BYTES_PER_PASSAGE * index.passages
    local = f"on this Mac in {fetched}" if fetched is not None else "not fetched to this Mac yet"
    return IndexPlan(
        mapped + queries,
        f"search index: {where}, {index.passages:,} passages: postings, term tables and norms {mapped / GIB:.2f} GiB "
        f"and the memory of {QUERY_THREADS} queries at once {queries / GIB:.2f} GiB counted, passage texts (zstd) "
        f"{passages / GIB:.2f} GiB mapped but read per hit, not counted; {local}",
    )


def unknown_plan(where: str, why: str) -> IndexPlan:
    """No size known: 0 counted, `why` (which may quote the bucket's text) cut to a line."""
    why = why if len(why) <= 200 else why[:200] + "..."
    return IndexPlan(0, f"search index: size unknown ({where}: {why}); 0 GiB counted", known=False)


def refused_plan(refused: TaskDataRefused) -> IndexPlan:
    """No size known, the task data refused: 0 counted, the refusal said whole (its words are
    bounded and name the object and end with the repair command, as the task load says them)."""
    return IndexPlan(0, f"search index: size unknown ({refused}); 0 GiB counted", known=False, refused=refused)


def override_plan(gb: float, flag: str) -> IndexPlan:
    """The index size given on the command line (`flag`), in GiB, counted as given."""
    counted = int(gb * GIB)
    return IndexPlan(counted, f"search index: {counted / GIB:.2f} GiB counted, as {flag} says")


def fetched_folder(shared_dir: Path, manifest: RunManifest, digest: str) -> Path | None:
    """The folder under `shared_dir` where this machine's workers verified the index of manifest
    `digest` (`retriever.index_folder`'s names: by digest, or by run), or None."""
    root = shared_dir / "search-index"
    for folder in (root / f"sha256-{digest}", root / manifest.run):
        if verified_digest(folder) == digest:
            return folder
    return None


def task_header_digest(prefix: bytes) -> str:
    """The index manifest digest (`index.manifest_sha256`) in the header line of task data whose
    first bytes are `prefix` (`encode_task_data`: one zstd frame, the header its first line),
    decompressing at most `TASK_HEADER_BYTES`; ValueError naming what is wrong."""
    out = b""
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(prefix)) as reader:
            while b"\n" not in out and len(out) <= TASK_HEADER_BYTES:
                block = reader.read(TASK_HEADER_BYTES + 1 - len(out))
                if not block:
                    break
                out += block
    except zstandard.ZstdError as exc:
        raise ValueError(f"the task data is not a zstd frame ({exc})") from None
    if b"\n" not in out:
        raise ValueError(f"the task data has no header line in its first {TASK_HEADER_BYTES:,} bytes")
    try:
        header = json.loads(out.split(b"\n", 1)[0])
    except (ValueError, RecursionError):
        raise ValueError("the task data's header is not valid JSON") from None
    index = header.get("index") if isinstance(header, dict) else None
    digest = index.get("manifest_sha256") if isinstance(index, dict) else None
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise ValueError("the task data pins no index manifest (index.manifest_sha256): "
                         "refusing to plan from an unauthenticated manifest; prepare the task again")
    return digest


def run_trust(manifest: RunManifest) -> RunTrust | None:
    """The trust a signed run's task data is checked under (its run key), None for an unsigned run."""
    return RunTrust.from_text(manifest.run, manifest.run_key) if manifest.run_key else None


async def pinned_manifest_digest(store: Store, manifest: RunManifest, trust: RunTrust | None = None) -> str:
    """The index manifest digest the run's task data pins (`task_header_digest`). An unsigned
    run's (`trust` None) is read with one ranged GET of its first bytes; a signed run's whole,
    checked as the task load checks it (TaskDataRefused when refused). NotFound when the task
    data is missing."""
    if trust is not None:
        data = await read_task_object(store, manifest.run, manifest.task, manifest.task_split, trust)
        return task_header_digest(data[:TASK_HEADER_BYTES])
    key = manifest.layout.task_data(manifest.task, manifest.task_split)
    got = await store.get(key, length=TASK_HEADER_BYTES)
    assert got is not None
    return task_header_digest(got.data[:TASK_HEADER_BYTES])


def plan_of_manifest(manifest: RunManifest, body: bytes, pinned: str, shared_dir: Path | None = None) -> IndexPlan:
    """The plan of the index manifest `body` read from the bucket (untrusted): refused unparsed
    unless its sha256 is `pinned` (the task data's); a malformed one gives the unknown plan, its
    problem in words."""
    where = index_key(manifest).removesuffix(f"/{MANIFEST}")
    digest = hashlib.sha256(body).hexdigest()
    if digest != pinned:
        return unknown_plan(f"{where}/{MANIFEST}", "not the manifest the task data pins (index.manifest_sha256): refused unread")
    try:
        index = parse_manifest(body)
    except ValueError as exc:
        return unknown_plan(f"{where}/{MANIFEST}", str(exc))
    return known_plan(where, index, None if shared_dir is None else fetched_folder(shared_dir, manifest, digest))


async def run_index_plan(
    store: Store, manifest: RunManifest, shared_dir: Path | None = None, trust: RunTrust | None = None
) -> IndexPlan | None:
    """The plan of the run's search index (module docstring); None when its task has no index.
    A signed run's task data is checked under `trust` (default: the manifest's run key).
    StoreConfigError (a wrong store configuration) is raised; any other failure to read the
    manifest gives the unknown plan (with `refused` when a signed run's task data is refused)."""
    if not has_index(manifest):
        return None
    key = index_key(manifest)
    task_key = manifest.layout.task_data(manifest.task, manifest.task_split)
    try:
        pinned = await pinned_manifest_digest(store, manifest, trust if trust is not None else run_trust(manifest))
    except StoreConfigError:
        raise
    except TaskDataRefused as exc:  # a replaced split may pin a forged manifest: nothing planned from it
        return refused_plan(exc)
    except NotFound:
        return unknown_plan(task_key, "the task data is missing from the bucket: its index manifest cannot be authenticated")
    except (StoreError, ValueError) as exc:
        return unknown_plan(task_key, str(exc))
    try:
        body = await read_capped_bytes(store, key, MAX_MANIFEST_BYTES)
    except StoreConfigError:
        raise
    except NotFound:
        return unknown_plan(key, "missing from the bucket: a worker cannot fetch the index either")
    except (StoreError, ValueError) as exc:  # TooLarge is a ValueError
        return unknown_plan(key, str(exc))
    return plan_of_manifest(manifest, body, pinned, shared_dir)
