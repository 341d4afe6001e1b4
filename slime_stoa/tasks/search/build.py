"""Build a BM25 index folder from a stream of passages in bounded memory (sharded build + merge).

Passages are read once, in order, and never held together: each is appended to the passage
files (`passages.PassageWriter`) and tokenised (`tokenizer.Tokenizer`); every `shard_docs`
passages, the shard's (term, document, term frequency) triples are sorted by term and written
to a scratch folder beside `folder`. The merge then walks the vocabulary in blocks of at most
`block_entries` postings, reads each shard's next run of postings for the block, scores them
(Lucene BM25: idf = ln(1 + (N - df + 0.5) / (df + 0.5)), tf / (tf + k1 (1 - b + b dl / avgdl)))
and appends them to the index arrays on disk.

What stays in memory: the vocabulary (a dict of the distinct terms) with its document
frequencies, one int32 length per passage, one shard's token ids, and one block of postings.

The folder holds bm25s's files (`BM25.load` reads them; lucene scoring, float32 scores, int32
document ids, columns = terms), the passage files, and `tokenizer.SETTINGS_FILE` (k1, b and the
tokeniser, which queries must use).
"""

from __future__ import annotations

import array
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from slime_stoa.tasks.search import compact
from slime_stoa.tasks.search.passages import BlockPassageWriter, PassageWriter
from slime_stoa.tasks.search.tokenizer import PRESETS, SETTINGS_FILE, Bm25Settings, Tokenizer

PARAMS_FILE = "params.index.json"
VOCAB_FILE = "vocab.index.json"
DATA_FILE, INDICES_FILE, INDPTR_FILE = "data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy"
SHARD_DOCS = 100_000
BLOCK_ENTRIES = 4 << 20
_READ_ENTRIES = 1 << 16  # postings read from one shard at a time during the merge


@dataclass(frozen=True, slots=True)
class BuildStats:
    """What `build_index` indexed: passages, distinct terms, postings (term, passage) pairs."""

    passages: int
    terms: int
    postings: int


class _Shard:
    """One shard's postings on disk (terms, docs, tfs as raw int32 files), read forward by term."""

    def __init__(self, folder: Path, n: int, terms: np.ndarray, docs: np.ndarray, tfs: np.ndarray):
        self.paths = [folder / f"shard{n:05d}.{part}" for part in ("terms", "docs", "tfs")]
        for path, arr in zip(self.paths, (terms, docs, tfs), strict=True):
            arr.astype(np.int32).tofile(path)
        self.size = len(terms)
        self._files: list[BinaryIO] = []
        self._buf = [np.empty(0, np.int32)] * 3
        self._read = 0

    def take_below(self, term_end: int) -> list[np.ndarray]:
        """The shard's next postings whose term is below `term_end` (terms, docs, tfs)."""
        if not self._files:
            self._files = [open(p, "rb") for p in self.paths]  # noqa: SIM115 (closed in close)
        while (not len(self._buf[0]) or self._buf[0][-1] < term_end) and self._read < self.size:
            count = min(_READ_ENTRIES, self.size - self._read)
            fresh = [np.fromfile(f, dtype=np.int32, count=count) for f in self._files]
            self._buf = [np.concatenate((old, new)) for old, new in zip(self._buf, fresh, strict=True)]
            self._read += count
        cut = int(np.searchsorted(self._buf[0], term_end))
        out = [b[:cut] for b in self._buf]
        self._buf = [b[cut:] for b in self._buf]
        return out

    def close(self) -> None:
        for f in self._files:
            f.close()


class _Postings:
    """The shards of one build and the statistics the scores need."""

    def __init__(self, scratch: Path, tokenizer: Tokenizer):
        self.scratch, self.tokenize = scratch, tokenizer
        self.vocab: dict[str, int] = {}
        self.df = np.zeros(0, dtype=np.int64)
        self.lengths = array.array("i")
        self.shards: list[_Shard] = []
        self._ids = array.array("i")
        self._doc_lengths = array.array("i")

    @property
    def pending(self) -> int:
        """Passages added since the last flush."""
        return len(self._doc_lengths)

    def add(self, text: str) -> None:
        vocab = self.vocab
        ids = [vocab.setdefault(t, len(vocab)) for t in self.tokenize(text)]
        self._ids.extend(ids)
        self._doc_lengths.append(len(ids))

    def flush(self) -> None:
        n = len(self._doc_lengths)
        if not n:
            return
        ids = np.frombuffer(self._ids, dtype=np.int32).astype(np.int64)
        lens = np.frombuffer(self._doc_lengths, dtype=np.int32)
        keys, tfs = np.unique(ids * n + np.repeat(np.arange(n, dtype=np.int64), lens), return_counts=True)
        terms = keys // n
        base = len(self.lengths)
        if len(self.df) < len(self.vocab):
            self.df = np.concatenate((self.df, np.zeros(len(self.vocab) - len(self.df), dtype=np.int64)))
        self.df += np.bincount(terms, minlength=len(self.df))
        self.shards.append(_Shard(self.scratch, len(self.shards), terms, keys % n + base, tfs))
        self.lengths.extend(self._doc_lengths)
        self._ids, self._doc_lengths = array.array("i"), array.array("i")


def _npy_writer(path: Path, dtype: np.dtype, count: int) -> BinaryIO:
    f = open(path, "wb")  # noqa: SIM115 (the caller closes it)
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (count,)})
    return f


def _write_vocab(path: Path, vocab: dict[str, int]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("{")
        for i, (token, tid) in enumerate(vocab.items()):
            f.write(("," if i else "") + json.dumps(token, ensure_ascii=False) + ":" + str(tid))
        f.write("}")


def _scoring(postings: _Postings, settings: Bm25Settings) -> tuple[np.ndarray, np.ndarray, float]:
    """Every passage's length norm, every term's idf (float32, the order of operations the
    stored scores were always computed in) and the mean passage length."""
    df, n_docs = postings.df, len(postings.lengths)
    lengths = np.frombuffer(postings.lengths, dtype=np.int32).astype(np.float32)
    avgdl = float(lengths.mean()) if n_docs else 1.0
    norm = (settings.k1 * (1 - settings.b + settings.b * lengths / (avgdl or 1.0))).astype(np.float32)
    idf = np.log1p((n_docs - df + 0.5) / (df + 0.5)).astype(np.float32)
    return norm, idf, avgdl


def _blocks(postings: _Postings, block_entries: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The postings (terms, docs, tfs) in blocks of whole terms of at most `block_entries`
    postings (one term at least), by term then document."""
    df = postings.df
    indptr = np.concatenate(([0], np.cumsum(df)))
    start = 0
    while start < len(df):
        end = max(start + 1, int(np.searchsorted(indptr, indptr[start] + block_entries, side="right")) - 1)
        parts = [s.take_below(end) for s in postings.shards]
        terms = np.concatenate([p[0] for p in parts])
        order = np.argsort(terms, kind="stable")  # shards hold increasing passages: docs stay sorted
        yield terms[order], np.concatenate([p[1] for p in parts])[order], np.concatenate([p[2] for p in parts])[order]
        start = end
    for s in postings.shards:
        s.close()


def _merge(postings: _Postings, folder: Path, settings: Bm25Settings, block_entries: int) -> int:
    """Write bm25s's arrays (scores stored per posting)."""
    norm, idf, _ = _scoring(postings, settings)
    total = int(postings.df.sum())
    np.save(folder / INDPTR_FILE, np.concatenate(([0], np.cumsum(postings.df))).astype(np.int64), allow_pickle=False)
    with _npy_writer(folder / DATA_FILE, np.dtype(np.float32), total) as data, \
            _npy_writer(folder / INDICES_FILE, np.dtype(np.int32), total) as indices:
        for terms, docs, tfs in _blocks(postings, block_entries):
            data.write(compact.term_scores(idf[terms], tfs, norm[docs]).tobytes())
            indices.write(docs.astype(np.int32).tobytes())
    return total


def _merge_compact(postings: _Postings, folder: Path, settings: Bm25Settings, block_entries: int) -> int:
    """Write the compact index (`compact`: packed postings, scored at query time)."""
    norm, idf, avgdl = _scoring(postings, settings)
    writer = compact.CompactWriter(folder, norms=norm, df=postings.df, idf=idf)
    for terms, docs, tfs in _blocks(postings, block_entries):
        writer.add(terms, docs, tfs, compact.term_scores(idf[terms], tfs, norm[docs]))
    del norm
    columns = [""] * len(postings.vocab)
    for term, column in postings.vocab.items():
        columns[column] = term
    params = writer.close(columns, k1=settings.k1, b=settings.b, avgdl=avgdl)
    return int(params["postings"])


def build_index(
    passages: Iterable[str],
    folder: Path,
    *,
    settings: Bm25Settings = PRESETS["default"],
    shard_docs: int = SHARD_DOCS,
    block_entries: int = BLOCK_ENTRIES,
    on_passages: Callable[[int], None] | None = None,
    compact_format: bool = False,
    work_dir: Path | None = None,
) -> BuildStats:
    """Index `passages` (any iterable, read once) into the empty (or new) `folder`.

    `on_passages(count)` is called as passages are read (with how many since the last call).
    `compact_format`: write the compact index (`compact`, zstd passage blocks) instead of
    bm25s's arrays. `work_dir`: where the shards go (a scratch folder made and removed there;
    default: beside `folder`); it holds about 12 bytes per posting at the peak."""
    if shard_docs < 1 or block_entries < 1:
        raise ValueError("shard_docs and block_entries must be at least 1")
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise ValueError(f"{folder} is not empty: build an index into a fresh folder")
    scratch = Path(tempfile.mkdtemp(prefix=".stoa-index-build-", dir=work_dir or folder.parent))
    try:
        writer: PassageWriter | BlockPassageWriter = BlockPassageWriter(folder) if compact_format else PassageWriter(folder)
        postings = _Postings(scratch, Tokenizer(settings.tokenizer))
        pending = 0
        try:
            for text in passages:
                writer.add(text)
                postings.add(text)
                pending += 1
                if postings.pending >= shard_docs:
                    postings.flush()
                if on_passages is not None and pending >= 1000:
                    on_passages(pending)
                    pending = 0
        finally:
            count = writer.close()
        postings.flush()
        if on_passages is not None and pending:
            on_passages(pending)
        if not count:
            raise ValueError("cannot build a search index over no passages")
        if compact_format:
            total = _merge_compact(postings, folder, settings, block_entries)
            (folder / SETTINGS_FILE).write_text(json.dumps(settings.as_meta(), indent=1, sort_keys=True))
            return BuildStats(passages=count, terms=len(postings.vocab), postings=total)
        total = _merge(postings, folder, settings, block_entries)
        _write_vocab(folder / VOCAB_FILE, postings.vocab)
        params = {"k1": float(settings.k1), "b": float(settings.b), "delta": 0.5, "method": "lucene",
                  "idf_method": "lucene", "dtype": "float32", "int_dtype": "int32", "num_docs": count,
                  "version": "stoa-stream", "backend": "numpy"}
        (folder / PARAMS_FILE).write_text(json.dumps(params, indent=1))
        (folder / SETTINGS_FILE).write_text(json.dumps(settings.as_meta(), indent=1, sort_keys=True))
        return BuildStats(passages=count, terms=len(postings.vocab), postings=total)
    except BaseException:
        for p in folder.iterdir():
            p.unlink()
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

