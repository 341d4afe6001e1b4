"""One search index per machine: every worker process maps the same verified folder read-only
(one copy in memory), that folder is the machine's (`macd.shared_dir`), named by the index's
manifest digest, and two processes fetching it at once download it once (a lock beside it)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("bm25s")

from macd.shared_dir import SHARED_DIR_ENV, machine_shared_dir
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import Store
from slime_stoa.tasks import tools
from slime_stoa.tasks.search import Search, build, bundle
from slime_stoa.tasks.search.build import DATA_FILE, INDICES_FILE, INDPTR_FILE
from slime_stoa.tasks.search.bundle import LOCK, MANIFEST, fetch_index, parse_manifest, upload_index
from slime_stoa.tasks.search.retriever import Retriever, SearchTool, index_folder
from slime_stoa.tasks.search.synthetic import generate
from tests.test_retriever import CountingStore

RUN = "r"
SMALL_CHUNK = 4096
POSTINGS_PER_TERM = 16_384  # the enlarged index's arrays: 8 bytes a posting, tens of MB in all

# What a second worker process does: open the same folder, read every page of the index arrays,
# and say how its memory grew (/proc/self/smaps_rollup, kB) and what a query finds.
_SECOND_PROCESS = r"""
import json, sys
import numpy as np
from slime_stoa.tasks.search.retriever import Retriever

def rollup():
    fields = {}
    for line in open("/proc/self/smaps_rollup"):
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            fields[parts[0].rstrip(":")] = int(parts[1])
    return fields

r = Retriever.open(sys.argv[1], scanned=True)
before = rollup()
touched = sum(float(np.asarray(a).sum(dtype=np.float64)) for a in r._bm.scores.values())
after = rollup()
print(json.dumps({"delta": {k: after[k] - before.get(k, 0) for k in after}, "touched": touched,
                  "hit": r.search(sys.argv[2], 1)[0].index}))
"""


@pytest.fixture(scope="module")
def big_index(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A real index folder whose arrays are enlarged (every term's column holds
    `POSTINGS_PER_TERM` postings) so the pages a process maps dwarf its other memory; returns
    the folder and the arrays' size in bytes. bm25s's arrays (`compact_format=False`), not the
    compact format the bundle ships, because only plain arrays can be enlarged in place; both
    formats map their files read-only the same way."""
    data = generate(20, seed=5)
    folder = tmp_path_factory.mktemp("shared") / "index"
    build.build_index(data.passages, folder, compact_format=False)
    terms = len(np.load(folder / INDPTR_FILE)) - 1
    rng = np.random.default_rng(0)
    n = len(data.passages)
    indices = np.sort(rng.integers(0, n, size=(terms, POSTINGS_PER_TERM), dtype=np.int32), axis=1).ravel()
    scores = rng.random(indices.size, dtype=np.float32) + np.float32(0.1)
    np.save(folder / DATA_FILE, scores, allow_pickle=False)
    np.save(folder / INDICES_FILE, indices, allow_pickle=False)
    np.save(folder / INDPTR_FILE, np.arange(terms + 1, dtype=np.int64) * POSTINGS_PER_TERM, allow_pickle=False)
    return folder, scores.nbytes + indices.nbytes


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux's /proc/<pid>/smaps_rollup")
def test_two_processes_share_one_copy_of_the_index(big_index: tuple[Path, int]) -> None:
    folder, size = big_index
    first = Retriever.open(folder)  # this process: the first worker, every page read
    touched = sum(float(np.asarray(a).sum(dtype=np.float64)) for a in first._bm.scores.values())
    query = "code word"
    done = subprocess.run([sys.executable, "-c", _SECOND_PROCESS, str(folder), query],
                          capture_output=True, text=True, timeout=120, check=True)
    second = json.loads(done.stdout)
    delta, kb = second["delta"], size / 1024
    assert second["touched"] == pytest.approx(touched) and second["hit"] == first.search(query, 1)[0].index
    # every page of the arrays is now mapped in the second process too, but as pages it shares
    # with the first (the page cache): its private memory grows by a sliver of the index, and
    # its proportional share (Pss) by about half of it
    assert delta["Rss"] >= 0.9 * kb, delta
    assert delta["Shared_Clean"] >= 0.9 * kb, delta
    assert delta["Private_Clean"] + delta["Private_Dirty"] <= 0.1 * kb, delta
    assert delta["Pss"] <= 0.6 * kb, delta


async def test_concurrent_fetches_download_once(store: Store, tmp_path: Path) -> None:
    data = generate(40, seed=3)
    folder = tmp_path / "built"
    build.build_index(data.passages, folder, compact_format=True)  # the format `prepare` ships
    digest = await upload_index(store, RUN, folder, passages=len(data.passages), chunk_bytes=SMALL_CHUNK)
    counting = CountingStore(store)
    dest = tmp_path / "shared" / "search-index" / f"sha256-{digest}"
    # two workers of one Mac start at once: one downloads, the other waits for its lock, then
    # finds the verified stamp and reads nothing more
    got = await asyncio.gather(*(fetch_index(counting, RUN, dest, expected_sha256=digest) for _ in range(2)))
    assert got == [dest, dest]
    manifest = parse_manifest((dest / MANIFEST).read_bytes())
    chunk_keys = {RunLayout(RUN).task_index_file("search", c.name) for f in manifest.files for c in f.chunks}
    assert all(counting.gets[k] == 1 for k in chunk_keys), counting.gets
    assert bundle.verified_digest(dest) == digest and (dest / LOCK).is_file()
    assert Retriever.open(dest).search(data.qa[0].question, 1)[0].index == data.qa[0].passage


async def test_a_fetch_waits_for_the_lock_and_can_be_cancelled(store: Store, tmp_path: Path) -> None:
    data = generate(10, seed=4)
    folder = tmp_path / "built"
    build.build_index(data.passages, folder, compact_format=True)  # the format `prepare` ships
    digest = await upload_index(store, RUN, folder, passages=len(data.passages), chunk_bytes=SMALL_CHUNK)
    dest = tmp_path / "index"
    async with bundle._fetch_lock(dest):  # another process is fetching
        waiting = asyncio.create_task(fetch_index(store, RUN, dest, expected_sha256=digest))
        done, _ = await asyncio.wait({waiting}, timeout=3 * bundle.LOCK_POLL_S)
        assert not done and not (dest / MANIFEST).exists()  # it waits, writing nothing
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    assert await fetch_index(store, RUN, dest, expected_sha256=digest) == dest  # the lock was let go


def test_the_index_folder_is_named_by_its_digest(tmp_path: Path) -> None:
    digest = "ab" * 32
    task = Search([], meta={"index": {"manifest_sha256": digest}})
    assert index_folder(tmp_path, task, "run-1") == tmp_path / f"sha256-{digest}"
    assert index_folder(tmp_path, Search([], meta={}), "run-1") == tmp_path / "run-1"
    for bad in ("../../etc", "AB" * 32, "ab" * 31, 7):
        with pytest.raises(ValueError, match="manifest_sha256"):
            index_folder(tmp_path, Search([], meta={"index": {"manifest_sha256": bad}}), "run-1")


def test_the_search_tool_keeps_its_index_in_the_shared_folder(tmp_path: Path) -> None:
    task = Search([], meta={"index": {"manifest_sha256": "cd" * 32}})
    shared = tools.tool_for(task, tools.ToolContext(run=RUN, data_dir=tmp_path / "data", shared_dir=tmp_path / "mac"))
    alone = tools.tool_for(task, tools.ToolContext(run=RUN, data_dir=tmp_path / "data"))
    assert isinstance(shared, SearchTool) and isinstance(alone, SearchTool)
    assert shared.cache_dir == tmp_path / "mac" / "search-index" / f"sha256-{'cd' * 32}"
    assert alone.cache_dir == tmp_path / "data" / "search-index" / f"sha256-{'cd' * 32}"


def test_machine_shared_dir() -> None:
    assert machine_shared_dir({SHARED_DIR_ENV: "/srv/stoa"}, "darwin") == Path("/srv/stoa")
    assert machine_shared_dir({}, "darwin") == Path("~/Library/Caches/stoa").expanduser()
    assert machine_shared_dir({"XDG_CACHE_HOME": "/c"}, "linux") == Path("/c/stoa")
    assert machine_shared_dir({}, "linux") == Path("~/.cache/stoa").expanduser()
