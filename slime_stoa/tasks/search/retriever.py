"""BM25 retrieval over a passage corpus with bm25s: build an index folder once, memory-map it at join.

An index folder (what `build_index` writes, `bundle` ships and `fetch_index` rebuilds on a worker):

    params.index.json  vocab.index.json  data.csc.index.npy  indices.csc.index.npy
    indptr.csc.index.npy                 bm25s's own files (`BM25.save`, lucene scoring)
    passages.txt  passages.offsets.npy   the passage texts (`passages.PassageStore`)

Corpus and queries are tokenised the same way (`tokenize`: bm25s's tokenizer, lowercase, English
stop words, no stemmer). `Retriever.open` maps the arrays read-only (`mmap=True`), so a worker
pays page-cache, not heap, for a large corpus. Because the folder came from the bucket, `open`
checks it before use: only the parameters bm25s is known to write, arrays of the right types whose
shapes and index ranges agree with each other and with the passage count; a damaged or forged
folder fails there with ValueError, never later inside a query.

Queries run on the calling thread (`search`) or, from asyncio code, on an executor thread
(`asearch`, `aobserve`) so the event loop and the generation thread keep running. bm25s is only
imported here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bm25s
import numpy as np

from slime_stoa.protocol.store import Store
from slime_stoa.protocol.strict_json import load_json
from slime_stoa.tasks.search.bundle import fetch_index
from slime_stoa.tasks.search.formats import format_passages
from slime_stoa.tasks.search.passages import OFFSETS_FILE, TEXT_FILE, PassageStore, write_passages
from slime_stoa.tasks.search.task import Search

PARAMS_FILE = "params.index.json"
VOCAB_FILE = "vocab.index.json"
ARRAY_FILES = ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy")
INDEX_FILES = (PARAMS_FILE, VOCAB_FILE, *ARRAY_FILES, TEXT_FILE, OFFSETS_FILE)
MAX_QUERY_CHARS = 1000  # a generated query longer than this is cut: it costs time, not recall
STOPWORDS = "en"

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



def tokenize(texts: list[str]) -> list[list[str]]:
    """Tokens of each text, as the index was built with."""
    tokens = bm25s.tokenize(texts, stopwords=STOPWORDS, return_ids=False, show_progress=False)
    return [list(t) for t in tokens]


def build_index(passages: Sequence[str], folder: Path) -> Path:
    """Index `passages` into the empty (or new) `folder` and store their texts beside it."""
    if not passages:
        raise ValueError("cannot build a search index over no passages")
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise ValueError(f"{folder} is not empty: build an index into a fresh folder")
    corpus = bm25s.tokenize(list(passages), stopwords=STOPWORDS, show_progress=False)
    bm = bm25s.BM25(method="lucene", backend="numpy")
    bm.index(corpus, show_progress=False)
    bm.save(str(folder), show_progress=False)
    write_passages(passages, folder)
    return folder


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
    if bool(np.any(np.diff(indptr) < 0)):
        raise ValueError(f"{ARRAY_FILES[2]} decreases")
    if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= passages):
        raise ValueError(f"{ARRAY_FILES[1]} points outside the {passages} passages")
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


class Retriever:
    """Top-k BM25 search over a memory-mapped index folder (open with `Retriever.open`)."""

    def __init__(self, bm: Any, passages: PassageStore):
        self._bm = bm
        self._columns = len(bm.scores["indptr"]) - 1
        self.passages = passages

    @classmethod
    def open(cls, folder: str | Path) -> Retriever:
        """Map the index folder read-only after checking it (ValueError if it is damaged)."""
        folder = Path(folder)
        missing = [name for name in INDEX_FILES if not (folder / name).is_file()]
        if missing:
            raise ValueError(f"{folder} is not a search index folder: missing {missing}")
        params = _check_params(folder)
        passages = PassageStore(folder)
        try:
            bm = bm25s.BM25.load(str(folder), mmap=True, load_corpus=False, show_progress=False)
        except (OSError, ValueError, TypeError, KeyError) as exc:  # np.load / json on a damaged file
            raise ValueError(f"{folder}: cannot load the index: {exc}") from None
        _check_arrays(bm, params, len(passages))
        return cls(bm, passages)

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, query: str, k: int = 3) -> list[Hit]:
        """The `k` best passages for `query`, best first (ties: lower index first).

        Passages with score 0 (no query word in common) are left out, so an empty, all-stop-word
        or unknown query returns []. The query is cut to `MAX_QUERY_CHARS`."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        tokens = tokenize([query[:MAX_QUERY_CHARS]])[0]
        ids = [i for i in self._bm.get_tokens_ids(tokens) if i < self._columns]
        if not ids:
            return []
        scores = np.asarray(self._bm.get_scores_from_ids(ids))
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
        top = top[np.lexsort((top, -scores[top]))]
        return [Hit(int(i), float(scores[i]), self.passages[int(i)]) for i in top if scores[i] > 0]

    def observe(self, query: str, *, k: int = 3, max_chars: int = 1500) -> str:
        """The observation body for `query`: its top passages within `max_chars` (`format_passages`)."""
        return format_passages([h.text for h in self.search(query, k)], max_chars=max_chars)

    async def asearch(self, query: str, k: int = 3, *, executor: concurrent.futures.Executor | None = None) -> list[Hit]:
        """`search` on an executor thread (the loop's default one unless `executor` is given)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, functools.partial(self.search, query, k))

    async def aobserve(
        self, query: str, *, k: int = 3, max_chars: int = 1500, executor: concurrent.futures.Executor | None = None
    ) -> str:
        """`observe` on an executor thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, functools.partial(self.observe, query, k=k, max_chars=max_chars))


async def open_run_index(store: Store, run: str, task: Search, dest: str | Path) -> Retriever:
    """Fetch (or finish fetching) the index `task` names into `dest` and open it: what a worker
    does at join. The manifest is pinned to the digest in the task meta when there is one."""
    digest = task.config.index.get("manifest_sha256")
    path = await fetch_index(store, run, dest, task=task.name, expected_sha256=digest if isinstance(digest, str) else None)
    return await asyncio.to_thread(Retriever.open, path)


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
