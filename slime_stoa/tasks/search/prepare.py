"""`stoa task prepare search`: build the index once, upload it, then the task data that names it.

The index is uploaded first (chunks, then its manifest) and the task data after, with the
manifest's sha256 in its meta (`index.manifest_sha256`): a worker that can read a split can find
the index and pin the manifest it fetches to that digest.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_stoa.protocol.store import Store
from slime_stoa.tasks.base import TaskItem, encode_task_data
from slime_stoa.tasks.search.bundle import DEFAULT_CHUNK_BYTES, upload_index
from slime_stoa.tasks.search.retriever import build_index
from slime_stoa.tasks.search.task import SearchConfig

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
    passages: Sequence[str],
    *,
    meta: Mapping[str, Any] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> PreparedSearch:
    """Index `passages`, upload the index, and encode each split's task data naming it.

    The index objects are written here (put-if-absent); the task data is returned for the caller
    to write the same way (`slime_stoa.tasks.objects.put_task_objects`), so an identical re-run is a no-op."""
    meta = dict(meta or {})
    SearchConfig.from_meta(meta)  # refuse bad options before the slow part
    with tempfile.TemporaryDirectory(prefix="stoa-index-") as tmp:
        folder = build_index(passages, Path(tmp) / "index")
        digest = await upload_index(store, run, folder, task=TASK, passages=len(passages), chunk_bytes=chunk_bytes)
    meta["index"] = {"manifest_sha256": digest, "passages": len(passages)}
    objects = {split: encode_task_data(TASK, items, meta=meta) for split, items in splits.items()}
    return PreparedSearch(objects=objects, manifest_sha256=digest, passages=len(passages))
