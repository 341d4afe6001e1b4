"""BM25 retrieval over a passage corpus: build an index folder once, memory-map it at join.

An index folder is the compact format (`compact`), whoever made it: `build_index` here (a local
example's index), `prepare` (the task bundle `bundle` ships and `fetch_index` rebuilds on a
worker), both through the one builder `build.build_index`. Its files (`COMPACT_INDEX_FILES`):

    compact.index.json  terms.bin  terms.offsets.npy  terms.stats.npy  blocks.npy
    postings.bin  norms.npy              `compact`'s packed postings, sorted term table, norms
    stoa.index.json                      k1, b and the tokeniser (`tokenizer.Bm25Settings`)
    passages.zst  passages.blocks.npy    the passage texts in zstd blocks (`passages.BlockPassageStore`)

Its vocabulary is searched in the mapped term table (no dict in any process) and its postings
are scored at query time, with exactly bm25s's lucene scores and a full sort's top k.

`open` still reads a folder of bm25s's arrays (`INDEX_FILES`: ``params.index.json``,
``vocab.index.json``, the ``*.csc.index.npy`` arrays and the raw ``passages.txt`` with its
offsets): what an earlier stoa built, which a local example may still hold on disk, and the
reference the compact format's hits are checked against (`build.build_index(...,
compact_format=False)`). A bucket never serves it: `bundle` refuses such a manifest.

Queries are tokenised with the tokeniser the folder records (`tokenizer.Tokenizer`), so build and
query always agree; a folder without that record (built by an earlier stoa, whose tokeniser
dropped numbers and one-letter words) is refused with a line saying to rebuild it.
`Retriever.open` maps the files read-only, so a worker pays page-cache, not heap, for a large
corpus. Because the folder came from the bucket, `open` checks it before use (`compact`'s checks;
for arrays: only the parameters bm25s is known to write, arrays of the right types whose shapes
and index ranges agree with each other and with the passage count); a damaged or forged folder
fails there with ValueError, never later inside a query.

A query's top k is exactly BM25's scoring and a full sort, computed MaxScore-style: the
documents named by the query's highest-weighing terms are scored first, and the rest of the
corpus is skipped once no other document can reach the k-th score. The processes of one machine
open the same folder (`index_folder`: named by the index's digest, under a folder they share), so
its pages are in memory once, whatever the number of workers.

Queries run on the calling thread (`search`) or, from asyncio code, on this process's query
threads (`asearch`, `aobserve`: `query_executor`, `QUERY_THREADS` of them) so the event loop and
the generation thread keep running. The bound is what a worker's memory plan counts
(`macd.index_plan`): each query in flight holds its own working memory (up to a score per
passage), so a process never holds more than `QUERY_THREADS` of them, however many episodes
call the tool at once. bm25s is only imported here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bm25s
import numpy as np

from slime_stoa.protocol.fsutil import atomic_write
from slime_stoa.protocol.layout import check_name
from slime_stoa.protocol.store import Store
from slime_stoa.protocol.strict_json import load_json
from slime_stoa.tasks.search import build, compact
from slime_stoa.tasks.search.bundle import fetch_index, verified_digest
from slime_stoa.tasks.search.formats import format_passages
from slime_stoa.tasks.search.passages import OFFSETS_FILE, TEXT_FILE, BlockPassageStore, PassageStore
from slime_stoa.tasks.search.task import Search
from slime_stoa.tasks.search.tokenizer import PRESETS, SETTINGS_FILE, Bm25Settings, Tokenizer

logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets its logger to DEBUG on import

PARAMS_FILE, VOCAB_FILE = build.PARAMS_FILE, build.VOCAB_FILE
ARRAY_FILES = (build.DATA_FILE, build.INDICES_FILE, build.INDPTR_FILE)
INDEX_FILES = (PARAMS_FILE, VOCAB_FILE, *ARRAY_FILES, SETTINGS_FILE, TEXT_FILE, OFFSETS_FILE)
#: The files of a compact index folder (`build_index(compact_format=True)`).
COMPACT_INDEX_FILES = compact.INDEX_FILES
QUERY_THREADS = compact.QUERY_THREADS
MAX_QUERY_CHARS = 1000  # a generated query longer than this is cut: it costs time, not recall
_SHA256 = re.compile(r"[0-9a-f]{64}")
SCANNED_FILE = ".scanned"  # in a fetched folder: the manifest digest whose files passed the full check

# The parameters bm25s writes (`BM25.save`) and the values this module accepts: scoring methods
# that need no extra non-occurrence array, numpy backends, and the dtypes `build_index` uses.
_METHODS = ("lucene", "robertson", "atire")
_PARAM_CHECKS: dict[str, Any] = {
    "k1": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 100,
    "b": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1,
    "delta": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 100,
    "method": lambda v: v in _METHODS,
    "idf_method": lambda v: v in _METHODS,
    "dtype": lambda v: v == "float32",
    "int_dtype": lambda v: v in ("int32", "int64"),
    "num_docs": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "version": lambda v: isinstance(v, str) and len(v) <= 32,
    "backend": lambda v: v == "numpy",
}

_REQUIRED_PARAMS = frozenset({"k1", "b", "method", "idf_method", "dtype", "int_dtype", "num_docs"})



def build_index(passages: Iterable[str], folder: Path, *, settings: Bm25Settings = PRESETS["default"]) -> Path:
    """Index `passages` into the empty (or new) `folder` in the compact format, as `prepare`
    builds the bundle's (`build.build_index`, one builder); returns `folder`."""
    build.build_index(passages, folder, settings=settings, compact_format=True)
    return folder


@functools.cache
def query_executor() -> concurrent.futures.ThreadPoolExecutor:
    """This process's query threads (`QUERY_THREADS`, made at the first async query): every
    `asearch` and `aobserve` without an executor of its own runs here (module doc: the bound the
    memory plan counts)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=QUERY_THREADS, thread_name_prefix="stoa-search")


def read_settings(folder: Path) -> Bm25Settings:
    """The k1, b and tokeniser an index folder was built with (ValueError for an older index)."""
    path = folder / SETTINGS_FILE
    if not path.is_file():
        raise ValueError(
            f"{folder}: this search index was built by an earlier stoa whose tokeniser dropped numbers, "
            "one-letter words and Greek letters: rebuild it with `stoa task prepare search`"
        )
    return Bm25Settings.from_meta(load_json(path.read_bytes(), max_bytes=1 << 16))


@dataclass(frozen=True, slots=True)
class Hit:
    """One retrieved passage: its position in the corpus, its BM25 score and its text."""

    index: int
    score: float
    text: str


def _check_params(folder: Path) -> dict[str, Any]:
    params = load_json((folder / PARAMS_FILE).read_bytes(), max_bytes=1 << 16)
    if not isinstance(params, dict) or not _REQUIRED_PARAMS <= set(params) <= set(_PARAM_CHECKS):
        raise ValueError(f"{PARAMS_FILE}: expected the keys {sorted(_REQUIRED_PARAMS)}, others only among {sorted(_PARAM_CHECKS)}")
    bad = [k for k, v in params.items() if not _PARAM_CHECKS[k](v)]
    if bad:
        raise ValueError(f"{PARAMS_FILE}: unsupported values for {bad}")
    return params


def _check_arrays(bm: Any, params: dict[str, Any], passages: int) -> None:
    scores = bm.scores
    data, indices, indptr = scores["data"], scores["indices"], scores["indptr"]
    vocab = bm.vocab_dict
    if params["num_docs"] != passages:
        raise ValueError(f"index covers {params['num_docs']} documents but the folder holds {passages} passages")
    for name, arr in zip(ARRAY_FILES, (data, indices, indptr), strict=True):
        if not isinstance(arr, np.ndarray) or arr.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D array")
    if data.dtype != np.float32 or indices.dtype.kind != "i" or indptr.dtype.kind != "i":
        raise ValueError(f"index arrays have dtypes {data.dtype}, {indices.dtype}, {indptr.dtype}")
    if len(data) != len(indices) or len(indptr) < 1 or indptr[0] != 0 or indptr[-1] != len(data):
        raise ValueError("index arrays disagree on the number of entries")
    if not isinstance(vocab, dict) or not all(isinstance(k, str) for k in vocab):
        raise ValueError(f"{VOCAB_FILE}: expected an object of token ids")
    ids = list(vocab.values())
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{VOCAB_FILE}: token ids must be integers")
    # bm25s adds the empty token "" after the last indexed one, with no column of its own
    arr = np.asarray(ids, dtype=np.int64)
    columns = len(indptr) - 1
    if len(arr) not in (columns, columns + 1) or (len(arr) and (arr.min() < 0 or np.bincount(arr).max() != 1)):
        raise ValueError(f"{VOCAB_FILE}: token ids must be 0..{columns - 1} (and one for ''), each once")


def _scan_arrays(bm: Any, passages: int) -> None:
    """The checks that read every posting (seconds and the whole index's pages at PubMed scale)."""
    indices, indptr = bm.scores["indices"], bm.scores["indptr"]
    if bool(np.any(np.diff(indptr) < 0)):
        raise ValueError(f"{ARRAY_FILES[2]} decreases")
    if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= passages):
        raise ValueError(f"{ARRAY_FILES[1]} points outside the {passages} passages")


CANDIDATE_SHARE = 4  # candidates from postings naming over 1/4 of the passages: score them all instead
# Rounds of candidates before scoring every passage: each round rescores every candidate against
# every term (a binary search per candidate and term), which is what made queries mixing
# mid-frequency and very common words 10x slower than scoring all.
MAX_ROUNDS = 2
BOUND_SLACK = 1 + 1e-5  # float32 sums of a few terms stay well within this of the exact sum


def _select(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the `k` highest positive `scores`, best first, ties: lower position first."""
    if k < len(scores):  # every position scoring at least the k-th score (k and its ties), none at 0
        kth = np.partition(scores, len(scores) - k)[len(scores) - k]
        pos = np.flatnonzero(scores >= kth) if kth > 0 else np.flatnonzero(scores > 0)
    else:
        pos = np.flatnonzero(scores > 0)
    return pos[np.lexsort((pos, -scores[pos]))][:k]


def _score_candidates(data: np.ndarray, indices: np.ndarray, spans: list[tuple[int, int]], docs: np.ndarray) -> np.ndarray:
    """The exact scores of `docs` (ascending): each term's posting of each document looked up by
    binary search in its column, added term by term in query order (bm25s's float32 sums)."""
    sub = np.zeros(len(docs), dtype=np.float32)
    for start, end in spans:
        column = indices[start:end]
        if len(column):
            at = np.minimum(np.searchsorted(column, docs), len(column) - 1)
            hit = column[at] == docs
            sub[hit] += data[start:end][at[hit]]
    return sub


def top_k(
    data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, n_docs: int, ids: list[int], k: int,
    column_max: Callable[[int], float] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The `k` (>= 1) best documents for the query term columns `ids` of a CSC BM25 index (each
    column's documents ascending, as `build` and bm25s write them), best first (ties: lower index
    first), with their scores; documents scoring 0 are left out.

    Exactly bm25s's scoring (`BM25.get_scores_from_ids`: float32 adds, term by term in query
    order) and a full sort, at less cost (MaxScore): the terms are taken in the order of their
    largest posting (`column_max`), highest first; the documents the terms taken so far name are
    scored exactly (`_score_candidates`), and once the k-th best of them beats the most any
    other document can score (the sum of the other terms' largest postings), those are the top
    k. Every document is scored (`_score_all`) when the candidates grow past a quarter of the
    corpus, after `MAX_ROUNDS` rounds of candidates, or with no `column_max`."""
    spans = [(int(indptr[i]), int(indptr[i + 1])) for i in ids]
    if column_max is not None:
        peaks = [column_max(i) for i in ids]
        order = sorted(range(len(ids)), key=lambda j: -peaks[j])
        taken = rounds = 0
        for n_taken in range(1, len(order) + 1):
            taken += spans[order[n_taken - 1]][1] - spans[order[n_taken - 1]][0]
            if taken * CANDIDATE_SHARE > n_docs or rounds >= MAX_ROUNDS:
                break
            bound = sum(peaks[j] for j in order[n_taken:]) * BOUND_SLACK
            if n_taken < len(order) and sum(peaks[j] for j in order[:n_taken]) <= bound:
                continue  # the candidates would hardly beat the bound: take the next term first
            rounds += 1
            docs = np.unique(np.concatenate([indices[slice(*spans[j])] for j in order[:n_taken]]))
            sub = _score_candidates(data, indices, spans, docs)
            kth = np.partition(sub, len(sub) - k)[len(sub) - k] if k <= len(sub) else 0.0
            if n_taken == len(order) or kth > bound:
                pos = _select(sub, k)
                return docs[pos].astype(np.int64), sub[pos]
    scores = _score_all(data, indices, n_docs, spans)
    top = _select(scores, k)
    return top.astype(np.int64), scores[top]


def _score_all(data: np.ndarray, indices: np.ndarray, n_docs: int, spans: list[tuple[int, int]]) -> np.ndarray:
    """Every document's score: bm25s's adds (`BM25._compute_relevance_from_scores`)."""
    scores = np.zeros(n_docs, dtype=np.float32)
    for start, end in spans:  # a column names a document once: a plain indexed add, not np.add.at
        scores[indices[start:end]] += data[start:end]
    return scores


class Retriever:
    """Top-k BM25 search over a memory-mapped index folder (open with `Retriever.open`): a
    compact one (`compact.CompactIndex`, its vocabulary searched in the mapped file) or bm25s's
    arrays (`bm`, its vocabulary a dict in this process)."""

    def __init__(
        self, bm: Any | None, passages: PassageStore | BlockPassageStore, settings: Bm25Settings,
        index: compact.CompactIndex | None = None,
    ):
        self._bm = bm
        self._index = index
        self._vocab: dict[str, int] = bm.vocab_dict if bm is not None else {}
        self._columns = len(bm.scores["indptr"]) - 1 if bm is not None else 0
        self._column_max: dict[int, float] = {}  # a term's largest posting, read at its first query
        self.passages = passages
        self.settings = settings
        self.tokenize = Tokenizer(settings.tokenizer)

    @classmethod
    def open(cls, folder: str | Path, *, scanned: bool = False) -> Retriever:
        """Map the index folder read-only after checking it (ValueError if it is damaged).

        `scanned`: these very files passed the full check before (`open_run_index` knows it from
        the verified stamp), so the checks that read every posting are skipped."""
        folder = Path(folder)
        settings = read_settings(folder)
        if (folder / compact.PARAMS_FILE).is_file():
            return cls._open_compact(folder, settings, scanned)
        missing = [name for name in INDEX_FILES if not (folder / name).is_file()]
        if missing:
            raise ValueError(f"{folder} is not a search index folder: missing {missing}")
        params = _check_params(folder)
        if (params["k1"], params["b"]) != (settings.k1, settings.b):
            raise ValueError(f"{folder}: {PARAMS_FILE} and {SETTINGS_FILE} disagree on k1 and b")
        passages = PassageStore(folder)
        try:
            bm = bm25s.BM25.load(str(folder), mmap=True, load_corpus=False, show_progress=False)
        except (OSError, ValueError, TypeError, KeyError) as exc:  # np.load / json on a damaged file
            raise ValueError(f"{folder}: cannot load the index: {exc}") from None
        _check_arrays(bm, params, len(passages))
        if not scanned:
            _scan_arrays(bm, len(passages))
        return cls(bm, passages, settings)

    @classmethod
    def _open_compact(cls, folder: Path, settings: Bm25Settings, scanned: bool) -> Retriever:
        missing = [name for name in COMPACT_INDEX_FILES if not (folder / name).is_file()]
        if missing:
            raise ValueError(f"{folder} is not a compact search index folder: missing {missing}")
        index = compact.CompactIndex.open(folder, scanned=scanned)
        if (index.k1, index.b) != (settings.k1, settings.b):
            raise ValueError(f"{folder}: {compact.PARAMS_FILE} and {SETTINGS_FILE} disagree on k1 and b")
        passages = BlockPassageStore(folder)
        if len(passages) != index.passages:
            raise ValueError(f"index covers {index.passages} documents but the folder holds {len(passages)} passages")
        return cls(None, passages, settings, index)

    def __len__(self) -> int:
        return len(self.passages)

    def column_max(self, term: int) -> float:
        """The largest score a passage gets from `term` (cached: one read of its postings)."""
        best = self._column_max.get(term)
        if best is None:
            bm = self._bm
            assert bm is not None  # a compact index keeps its largest scores in its term table
            data, indptr = bm.scores["data"], bm.scores["indptr"]
            start, end = int(indptr[term]), int(indptr[term + 1])
            best = self._column_max[term] = float(data[start:end].max(initial=0.0))
        return best

    def search(self, query: str, k: int = 3) -> list[Hit]:
        """The `k` best passages for `query`, best first (ties: lower index first).

        Passages with score 0 (no query word in common) are left out, so an empty, all-stop-word
        or unknown query returns []. The query is cut to `MAX_QUERY_CHARS`."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if self._index is not None:
            index = self._index
            ranks = [r for t in self.tokenize(query[:MAX_QUERY_CHARS]) if (r := index.lookup(t)) is not None]
            if not ranks:
                return []
            top, scores = index.top_k(ranks, k)
            return [Hit(int(i), float(s), self.passages[int(i)]) for i, s in zip(top, scores, strict=True)]
        vocab = self._vocab
        ids = [i for t in self.tokenize(query[:MAX_QUERY_CHARS]) if (i := vocab.get(t)) is not None and i < self._columns]
        if not ids:
            return []
        assert self._bm is not None  # the compact index answered above
        m = self._bm.scores
        top, scores = top_k(m["data"], m["indices"], m["indptr"], len(self.passages), ids, k, self.column_max)
        return [Hit(int(i), float(s), self.passages[int(i)]) for i, s in zip(top, scores, strict=True)]

    def observe(self, query: str, *, k: int = 3, max_chars: int = 1500) -> str:
        """The observation body for `query`: its top passages within `max_chars` (`format_passages`)."""
        return format_passages([h.text for h in self.search(query, k)], max_chars=max_chars)

    async def asearch(self, query: str, k: int = 3, *, executor: concurrent.futures.Executor | None = None) -> list[Hit]:
        """`search` on a query thread (`query_executor` unless `executor` is given)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor or query_executor(), functools.partial(self.search, query, k))

    async def aobserve(
        self, query: str, *, k: int = 3, max_chars: int = 1500, executor: concurrent.futures.Executor | None = None
    ) -> str:
        """`observe` on a query thread (`query_executor` unless `executor` is given)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            executor or query_executor(), functools.partial(self.observe, query, k=k, max_chars=max_chars)
        )


async def open_run_index(store: Store, run: str, task: Search, dest: str | Path) -> Retriever:
    """Fetch (or finish fetching) the index `task` names into `dest` and open it: what a worker
    does at join. The manifest is pinned to the digest in the task meta when there is one."""
    digest = task.config.index.get("manifest_sha256")
    path = await fetch_index(store, run, dest, task=task.name, expected_sha256=digest if isinstance(digest, str) else None)
    verified = verified_digest(path)  # the fetch's stamp: these files match that manifest
    mark = path / SCANNED_FILE
    scanned = verified is not None and mark.is_file() and mark.read_text(encoding="ascii", errors="replace") == verified
    retriever = await asyncio.to_thread(Retriever.open, path, scanned=scanned)
    if verified is not None and not scanned:
        atomic_write(mark, verified.encode("ascii"))
    recorded = task.config.index.get("bm25")
    if recorded is not None and Bm25Settings.from_meta(recorded) != retriever.settings:
        raise ValueError("the task meta's BM25 settings (index.bm25) differ from the index folder's (refused)")
    return retriever


def index_folder(root: str | Path, task: Search, run: str) -> Path:
    """Where a worker keeps the index `task` names under `root` (a machine's shared folder):
    `sha256-<digest>` when the task meta pins the manifest (every run and bucket naming the same
    index shares one copy), else the run's name. A digest that is not 64 hex digits (the meta
    comes from the bucket) is refused."""
    digest = task.config.index.get("manifest_sha256")
    if digest is None:
        return Path(root) / check_name("run", run)
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise ValueError("the task meta's index.manifest_sha256 is not 64 lowercase hex digits (refused)")
    return Path(root) / f"sha256-{digest}"


class SearchTool:
    """The search task's tool for an episode runner: `await tool(query)` gives the observation
    body (top `config.top_k` passages within `config.max_observation_chars`).

    The index is fetched into `cache_dir` and opened on the first call (once, under a lock), so
    building the tool costs nothing; queries run on an executor thread."""

    def __init__(self, task: Search, store: Store, run: str, cache_dir: str | Path):
        self.task, self.store, self.run, self.cache_dir = task, store, run, Path(cache_dir)
        self._retriever: Retriever | None = None
        self._lock = asyncio.Lock()

    async def retriever(self) -> Retriever:
        async with self._lock:
            if self._retriever is None:
                self._retriever = await open_run_index(self.store, self.run, self.task, self.cache_dir)
            return self._retriever

    async def prepare(self) -> None:
        """Fetch and open the index now (a worker does this at join, before generating)."""
        await self.retriever()

    async def __call__(self, query: str) -> str:
        cfg = self.task.config
        return await (await self.retriever()).aobserve(query, k=cfg.top_k, max_chars=cfg.max_observation_chars)
