"""Build a BM25 index folder from a stream of passages in bounded memory (sharded build + merge).

Passages are read once, in order, and never held together: each is appended to the passage
files (`passages.PassageWriter`) and tokenised (`tokenizer.Tokenizer`); every `shard_docs`
passages, the shard's words are sorted and written (one a line) and its (word, document, term
frequency) triples, by the word's rank in the shard, to a scratch folder (`work_dir`, default
beside `folder`). The vocabulary is then merged from the shards' sorted words (a heap merge,
streamed): a term's id is its rank among all the terms, so ids follow the terms' order, and
each shard gets the map from its ranks to those ids (ascending, so its postings stay in term
order). The merge then walks the terms in blocks of at most `block_entries` postings, reads
each shard's next run of postings for the block, scores them (Lucene BM25: idf =
ln(1 + (N - df + 0.5) / (df + 0.5)), tf / (tf + k1 (1 - b + b dl / avgdl))) and appends them to
the index on disk.

What stays in memory: one shard's words (a dict) and token ids, one int32 length per passage,
per term its document frequency (and a few numbers of the compact index's term table), per
(shard, word) pair its term id (4 bytes), and one block of postings; never a dict of every term.

The folder holds the compact index (`compact`: packed postings, the sorted term table, norms),
the zstd passage blocks (`passages.BlockPassageWriter`) and `tokenizer.SETTINGS_FILE` (k1, b and
the tokeniser, which queries must use): the files `bundle` ships (`compact.INDEX_FILES`), whoever
builds it (`prepare` for the bucket, `retriever.build_index` for a local example). Only on request
(`compact_format=False`) does it write bm25s's arrays and the raw passage files instead (lucene
scoring, float32 scores, int32 document ids, columns = terms; `BM25.load` reads them): the format
an earlier stoa shipped, kept as the reference the compact index's hits and scores are checked
against and for the benchmarks that compare the two.
"""

from __future__ import annotations

import array
import heapq
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
    """One shard's postings on disk (word ranks, docs, tfs as raw int32 files), read forward by
    term, and its sorted words (one a line) with their document frequencies."""

    def __init__(self, folder: Path, n: int, words: list[str], terms: np.ndarray, docs: np.ndarray, tfs: np.ndarray):
        self.paths = [folder / f"shard{n:05d}.{part}" for part in ("terms", "docs", "tfs")]
        for path, arr in zip(self.paths, (terms, docs, tfs), strict=True):
            arr.astype(np.int32).tofile(path)
        self.words_path, self.df_path = folder / f"shard{n:05d}.words", folder / f"shard{n:05d}.df"
        # \w+ tokens hold no line break; lone surrogates pass through as they came
        self.words_path.write_bytes("".join(w + "\n" for w in words).encode("utf-8", "surrogatepass"))
        np.bincount(terms, minlength=len(words)).astype(np.int32).tofile(self.df_path)
        self.size = len(terms)
        self.to_term = array.array("i")  # this shard's word rank -> term id (`_Postings.merge_vocabulary`)
        self._files: list[BinaryIO] = []
        self._buf = [np.empty(0, np.int32)] * 3
        self._read = 0

    def words(self) -> Iterator[str]:
        with open(self.words_path, encoding="utf-8", errors="surrogatepass", newline="\n") as f:
            for line in f:
                yield line[:-1]

    def take_below(self, term_end: int) -> list[np.ndarray]:
        """The shard's next postings whose term is below `term_end` (terms, docs, tfs)."""
        if not self._files:
            self._files = [open(p, "rb") for p in self.paths]  # noqa: SIM115 (closed in close)
        while (not len(self._buf[0]) or self._buf[0][-1] < term_end) and self._read < self.size:
            count = min(_READ_ENTRIES, self.size - self._read)
            fresh = [np.fromfile(f, dtype=np.int32, count=count) for f in self._files]
            fresh[0] = np.frombuffer(self.to_term, dtype=np.int32)[fresh[0]]
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
        self.words: dict[str, int] = {}  # the current shard's words, by first sight
        self.df = np.zeros(0, dtype=np.int64)  # per term, once `merge_vocabulary` has run
        self.lengths = array.array("i")
        self.shards: list[_Shard] = []
        self._ids = array.array("i")
        self._doc_lengths = array.array("i")

    @property
    def pending(self) -> int:
        """Passages added since the last flush."""
        return len(self._doc_lengths)

    def add(self, text: str) -> None:
        words = self.words
        ids = [words.setdefault(t, len(words)) for t in self.tokenize(text)]
        self._ids.extend(ids)
        self._doc_lengths.append(len(ids))

    def flush(self) -> None:
        n = len(self._doc_lengths)
        if not n:
            return
        words = list(self.words)
        order = np.argsort(np.array(words, dtype=object), kind="stable")  # code point (UTF-8 byte) order
        rank = np.empty(len(words), dtype=np.int64)
        rank[order] = np.arange(len(words))
        ids = rank[np.frombuffer(self._ids, dtype=np.int32)]
        lens = np.frombuffer(self._doc_lengths, dtype=np.int32)
        keys, tfs = np.unique(ids * n + np.repeat(np.arange(n, dtype=np.int64), lens), return_counts=True)
        base = len(self.lengths)
        sorted_words = [words[i] for i in order.tolist()]
        self.shards.append(_Shard(self.scratch, len(self.shards), sorted_words, keys // n, keys % n + base, tfs))
        self.lengths.extend(self._doc_lengths)
        self.words, self._ids, self._doc_lengths = {}, array.array("i"), array.array("i")

    def merge_vocabulary(self, on_term: Callable[[str], None]) -> int:
        """Merge the shards' sorted words into the terms, calling `on_term` with each in order
        (its id: how many came before); sets each shard's map and every term's document
        frequency. Returns the number of terms."""
        def tagged(shard: _Shard, i: int) -> Iterator[tuple[str, int]]:
            return ((w, i) for w in shard.words())

        last: str | None = None
        terms = 0
        for word, i in heapq.merge(*(tagged(s, i) for i, s in enumerate(self.shards))):
            if word != last:
                on_term(word)
                last, terms = word, terms + 1
            self.shards[i].to_term.append(terms - 1)
        self.df = np.zeros(terms, dtype=np.int64)
        for shard in self.shards:
            np.add.at(self.df, np.frombuffer(shard.to_term, dtype=np.int32), np.fromfile(shard.df_path, dtype=np.int32))
        return terms


def _npy_writer(path: Path, dtype: np.dtype, count: int) -> BinaryIO:
    f = open(path, "wb")  # noqa: SIM115 (the caller closes it)
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (count,)})
    return f


class _VocabWriter:
    """bm25s's vocabulary file ({term: id}), written a term at a time in id order."""

    def __init__(self, path: Path):
        self._f = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed in close)
        self._count = 0
        self._f.write("{")

    def add(self, term: str) -> None:
        self._f.write(("," if self._count else "") + json.dumps(term, ensure_ascii=False) + ":" + str(self._count))
        self._count += 1

    def close(self) -> None:
        self._f.write("}")
        self._f.close()


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
    params = writer.close(k1=settings.k1, b=settings.b, avgdl=avgdl)
    return int(params["postings"])


def build_index(
    passages: Iterable[str],
    folder: Path,
    *,
    settings: Bm25Settings = PRESETS["default"],
    shard_docs: int = SHARD_DOCS,
    block_entries: int = BLOCK_ENTRIES,
    on_passages: Callable[[int], None] | None = None,
    compact_format: bool = True,
    work_dir: Path | None = None,
) -> BuildStats:
    """Index `passages` (any iterable, read once) into the empty (or new) `folder`.

    `on_passages(count)` is called as passages are read (with how many since the last call).
    `compact_format`: the compact index (`compact`, zstd passage blocks), the format `bundle`
    ships; False: bm25s's arrays and raw passages instead (the reference, module doc).
    `work_dir`: where the shards go (a scratch folder made and removed there; default: beside
    `folder`); it holds about 12 bytes per posting at the peak."""
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
            term_table = compact.TermTableWriter(folder)
            terms = postings.merge_vocabulary(term_table.add)
            term_table.close()
            total = _merge_compact(postings, folder, settings, block_entries)
            (folder / SETTINGS_FILE).write_text(json.dumps(settings.as_meta(), indent=1, sort_keys=True))
            return BuildStats(passages=count, terms=terms, postings=total)
        vocab = _VocabWriter(folder / VOCAB_FILE)
        terms = postings.merge_vocabulary(vocab.add)
        vocab.close()
        total = _merge(postings, folder, settings, block_entries)
        params = {"k1": float(settings.k1), "b": float(settings.b), "delta": 0.5, "method": "lucene",
                  "idf_method": "lucene", "dtype": "float32", "int_dtype": "int32", "num_docs": count,
                  "version": "stoa-stream", "backend": "numpy"}
        (folder / PARAMS_FILE).write_text(json.dumps(params, indent=1))
        (folder / SETTINGS_FILE).write_text(json.dumps(settings.as_meta(), indent=1, sort_keys=True))
        return BuildStats(passages=count, terms=terms, postings=total)
    except BaseException:
        for p in folder.iterdir():
            p.unlink()
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

