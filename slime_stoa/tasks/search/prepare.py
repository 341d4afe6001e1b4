"""`stoa task prepare search`: build the index once, upload it, then the task data that names it.

The index is uploaded first (chunks, then its manifest) and the task data after, with the
manifest's sha256 in its meta (`index.manifest_sha256`): a worker that can read a split can find
the index and pin the manifest it fetches to that digest. The meta also records the index's
BM25 settings (`index.bm25`: k1, b, the tokeniser), which the worker checks against the folder.

The passages are streamed into the build (`build.build_index`), never held as a list. The index
is the compact format (`compact`: packed postings, zstd passage blocks), the one a bucket's
index manifest names (`bundle.INDEX_FILES`).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_stoa.protocol.store import Store
from slime_stoa.tasks.base import TaskItem, encode_task_data
from slime_stoa.tasks.search.build import build_index
from slime_stoa.tasks.search.bundle import DEFAULT_CHUNK_BYTES, upload_index
from slime_stoa.tasks.search.task import SearchConfig
from slime_stoa.tasks.search.tokenizer import PRESETS, Bm25Settings

TASK = "search"


@dataclass(frozen=True, kw_only=True, slots=True)
class PreparedSearch:
    """What `prepare_search` wrote: task data per split and the index manifest's digest."""

    objects: Mapping[str, bytes]
    manifest_sha256: str
    passages: int


async def prepare_search(
    store: Store,
    run: str,
    splits: Mapping[str, Sequence[TaskItem]],
    passages: Iterable[str],
    *,
    meta: Mapping[str, Any] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    settings: Bm25Settings = PRESETS["default"],
    on_passages: Callable[[int], None] | None = None,
    work_dir: Path | None = None,
) -> PreparedSearch:
    """Index `passages` (read once), upload the index, and encode each split's task data naming it.

    The index objects are written here (put-if-absent); the task data is returned for the caller
    to write the same way (`slime_stoa.tasks.objects.put_task_objects`), so an identical re-run is a no-op.
    The index and the build's scratch go in a temporary folder under `work_dir` (default: $TMPDIR)."""
    meta = dict(meta or {})
    SearchConfig.from_meta(meta)  # refuse bad options before the slow part
    if work_dir is not None and not work_dir.is_dir():
        raise ValueError(f"the work folder {work_dir} does not exist: make it, or leave --work-dir out for $TMPDIR")
    with tempfile.TemporaryDirectory(prefix="stoa-index-", dir=work_dir) as tmp:
        folder = Path(tmp) / "index"
        stats = await asyncio.to_thread(
            build_index, passages, folder, settings=settings, on_passages=on_passages, compact_format=True
        )
        digest = await upload_index(store, run, folder, task=TASK, passages=stats.passages, chunk_bytes=chunk_bytes)
    meta["index"] = {"manifest_sha256": digest, "passages": stats.passages, "bm25": settings.as_meta()}
    objects = {split: encode_task_data(TASK, items, meta=meta) for split, items in splits.items()}
    return PreparedSearch(objects=objects, manifest_sha256=digest, passages=stats.passages)
