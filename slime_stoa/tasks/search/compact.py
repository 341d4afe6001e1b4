"""The compact BM25 index: bit-packed postings scored at query time, a memory-mapped sorted term
table, and per-passage length norms, sized to sit beside a model on a 16 GB Mac.

    compact.index.json   format, k1, b, passages, terms, blocks, postings, avgdl
    terms.bin            every distinct term's UTF-8 bytes, sorted, back to back
    terms.offsets.npy    uint64, terms + 1: term r is bytes [off[r], off[r + 1]) of terms.bin
    terms.stats.npy      per term (sorted order): byte offset of its postings, first block,
                         document frequency, idf (float32), largest score of any posting (float32)
    blocks.npy           per block of 128 postings (`packing`): last document, doc and tf widths
    postings.bin         the packed blocks, each term's blocks contiguous (`packing`), PAD bytes after
    norms.npy            float32 per passage: k1 (1 - b + b dl / avgdl)

A term's id is its rank in the sorted table, found by binary search in the mapped file, so no
process holds the vocabulary in its heap. The score of a posting is bm25s's lucene score,
`idf * (tf / (tf + norm[doc]))` in float32, computed with the same float32 operations the
earlier build stored (`build._merge`), so scores and top-k are bit-identical to that index's.

Every file is mapped read-only. `CompactIndex.open` checks what sizes and structure can be
checked without reading every posting (`scan`: the block table against the term table, in
O(terms + blocks)); a decoded document outside the corpus fails the query with ValueError.
"""

from __future__ import annotations

import array
import json
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from slime_stoa.protocol.strict_json import load_json
from slime_stoa.tasks.search import packing, passages
from slime_stoa.tasks.search.tokenizer import SETTINGS_FILE

FORMAT = "stoa.bm25-compact/1"
PARAMS_FILE = "compact.index.json"
TERMS_FILE, TERM_OFFSETS_FILE, TERM_STATS_FILE = "terms.bin", "terms.offsets.npy", "terms.stats.npy"
BLOCKS_FILE, POSTINGS_FILE, NORMS_FILE = "blocks.npy", "postings.bin", "norms.npy"
FILES = (PARAMS_FILE, TERMS_FILE, TERM_OFFSETS_FILE, TERM_STATS_FILE, BLOCKS_FILE, POSTINGS_FILE, NORMS_FILE)
#: Every file of a compact index folder: the index's, the settings (k1, b, tokeniser) and the
#: zstd passage blocks (what a bucket's index manifest must name; this module needs no bm25s).
INDEX_FILES = (*FILES, SETTINGS_FILE, passages.ZST_FILE, passages.BLOCKS_FILE)
STATS_DTYPE = np.dtype([("offset", "<u8"), ("block", "<u8"), ("df", "<u4"), ("idf", "<f4"), ("peak", "<f4")])
BLOCK_DTYPE = np.dtype([("last", "<u4"), ("doc_bits", "u1"), ("tf_bits", "u1")])

CANDIDATE_SHARE = 4  # candidates from postings naming over 1/4 of the passages: score them all instead
BOUND_SLACK = 1 + 1e-5  # float32 sums of a few terms stay well within this of the exact sum
DECODE_BLOCKS = 512  # blocks decoded at once (64k postings: a few MB of temporaries)
# Costs in decoded postings, to choose between the lookups and scoring every passage: zeroing and
# sorting the scores of this many passages, and one candidate's search in one term's blocks.
PASSAGE_COST = 4
CANDIDATE_COST = 2
MAX_ROUNDS = 2  # candidate rounds before scoring every passage: each round rescores the candidates
#: The most queries one process runs at once (`retriever.query_executor`): few, since each in
#: flight holds a score per passage (`macd.index_plan` counts them) and takes a core beside the
#: generation. Here, not in `retriever`, so the memory plan reads it without importing bm25s.
QUERY_THREADS = 2


def encode_term(term: str) -> bytes:
    return term.encode("utf-8", "surrogatepass")


def term_scores(idf: np.ndarray | np.float32, tfs: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """bm25s's lucene score of postings with frequencies `tfs` and their passages' `norms`
    (float32 throughout: the build and the queries must round alike)."""
    tf = tfs.astype(np.float32)
    return (idf * (tf / (tf + norms))).astype(np.float32)


# -- writing -----------------------------------------------------------------------------------


class CompactWriter:
    """Writes a compact index into `folder` from postings given a block of whole terms at a time,
    in column order (the build's term ids, which are the terms' ranks in the term table)."""

    def __init__(self, folder: Path, *, norms: np.ndarray, df: np.ndarray, idf: np.ndarray):
        self.folder = folder
        self.df, self.idf = df, idf
        self._norms = norms
        np.save(folder / NORMS_FILE, norms.astype(np.float32), allow_pickle=False)
        self._postings: BinaryIO = open(folder / POSTINGS_FILE, "wb")  # noqa: SIM115 (closed in close)
        self._blocks: BinaryIO = open(folder / (BLOCKS_FILE + ".raw"), "wb")  # noqa: SIM115 (closed in close)
        self._offset = np.zeros(len(df), dtype=np.uint64)
        self._first_block = np.zeros(len(df), dtype=np.uint64)
        self._peak = np.zeros(len(df), dtype=np.float32)
        self._bytes = self._block_count = self._postings_count = 0

    def add(self, terms: np.ndarray, docs: np.ndarray, tfs: np.ndarray, scores: np.ndarray) -> None:
        """Postings of consecutive columns `terms[0]..terms[-1]`, sorted by term then document."""
        if not len(terms):
            return
        term_starts = np.flatnonzero(np.diff(terms, prepend=terms[0] - 1))
        cols = terms[term_starts]
        packed, last, doc_bits, tf_bits, offsets = packing.encode(docs, tfs, term_starts)
        counts = np.diff(np.append(term_starts, len(terms)))
        blocks = (counts + packing.BLOCK - 1) // packing.BLOCK
        first = np.cumsum(blocks) - blocks
        self._first_block[cols] = self._block_count + first
        self._offset[cols] = self._bytes + offsets[first]
        self._peak[cols] = np.maximum.reduceat(scores, term_starts)
        table = np.empty(len(last), dtype=BLOCK_DTYPE)
        table["last"], table["doc_bits"], table["tf_bits"] = last, doc_bits, tf_bits
        self._blocks.write(table.tobytes())
        self._postings.write(packed)
        self._bytes += len(packed)
        self._block_count += len(last)
        self._postings_count += len(terms)

    def close(self, *, k1: float, b: float, avgdl: float) -> dict[str, Any]:
        """Finish the files (the term table is `TermTableWriter`'s, its order the columns'). Returns the parameters."""
        self._postings.write(b"\0" * packing.PAD)
        self._postings.close()
        self._blocks.close()
        raw = self.folder / (BLOCKS_FILE + ".raw")
        np.save(self.folder / BLOCKS_FILE, np.fromfile(raw, dtype=BLOCK_DTYPE), allow_pickle=False)
        raw.unlink()
        stats = np.empty(len(self.df), dtype=STATS_DTYPE)
        stats["offset"], stats["block"] = self._offset, self._first_block
        stats["df"], stats["idf"], stats["peak"] = self.df, self.idf, self._peak
        np.save(self.folder / TERM_STATS_FILE, stats, allow_pickle=False)
        params = {"format": FORMAT, "k1": float(k1), "b": float(b), "passages": len(self._norms),
                  "terms": len(stats), "blocks": self._block_count, "postings": self._postings_count, "avgdl": float(avgdl)}
        (self.folder / PARAMS_FILE).write_text(json.dumps(params, indent=1))
        return params


class TermTableWriter:
    """Writes the sorted term table (`TERMS_FILE`, `TERM_OFFSETS_FILE`) a term at a time, in
    order (the caller sorts: the build merges its shards' sorted words)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._f: BinaryIO = open(folder / TERMS_FILE, "wb")  # noqa: SIM115 (closed in close)
        self._ends = array.array("Q", [0])

    def add(self, term: str) -> None:
        self._ends.append(self._ends[-1] + self._f.write(encode_term(term)))

    def close(self) -> None:
        self._f.close()
        np.save(self.folder / TERM_OFFSETS_FILE, np.frombuffer(self._ends, dtype=np.uint64), allow_pickle=False)


# -- reading -----------------------------------------------------------------------------------


def _load(folder: Path, name: str, dtype: np.dtype, length: int) -> np.ndarray:
    try:
        arr = np.load(folder / name, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{name}: cannot map it: {exc}") from None
    if arr.dtype != dtype or arr.shape != (length,):
        raise ValueError(f"{name}: expected {length} entries of {dtype}, got {arr.dtype} {arr.shape}")
    return arr.view(np.ndarray)  # the same mapped pages, without np.memmap's cost on every slice


def _int(params: dict[str, Any], key: str) -> int:
    v = params.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 40:
        raise ValueError(f"{PARAMS_FILE}: {key} must be a non-negative int")
    return v


def _float(params: dict[str, Any], key: str, low: float, high: float) -> float:
    v = params.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
        raise ValueError(f"{PARAMS_FILE}: {key} must be a number in [{low}, {high}]")
    return float(v)


@dataclass(frozen=True, slots=True)
class _Term:
    """One query term's postings as the query needs them."""

    rank: int
    df: int
    idf: np.float32
    peak: float
    offset: int
    block: int


class CompactIndex:
    """A compact index folder, mapped read-only (open with `CompactIndex.open`)."""

    def __init__(self, folder: Path, params: dict[str, Any]):
        self.params = params
        self.passages = _int(params, "passages")
        n_terms, n_blocks = _int(params, "terms"), _int(params, "blocks")
        self.k1, self.b = _float(params, "k1", 0, 100), _float(params, "b", 0, 1)
        self.term_offsets = _load(folder, TERM_OFFSETS_FILE, np.dtype("<u8"), n_terms + 1)
        self.stats = _load(folder, TERM_STATS_FILE, STATS_DTYPE, n_terms)
        self.blocks = _load(folder, BLOCKS_FILE, BLOCK_DTYPE, n_blocks)
        self.norms = _load(folder, NORMS_FILE, np.dtype("<f4"), self.passages)
        self.postings = np.memmap(folder / POSTINGS_FILE, dtype=np.uint8, mode="r").view(np.ndarray)
        with open(folder / TERMS_FILE, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # mmap cannot map an empty file (an index of no terms)
            self._terms: mmap.mmap | bytes = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        if len(self.postings) < packing.PAD:
            raise ValueError(f"{POSTINGS_FILE}: shorter than its padding")
        if int(self.term_offsets[0]) != 0 or int(self.term_offsets[-1]) != size:
            raise ValueError(f"{TERM_OFFSETS_FILE} does not describe {TERMS_FILE}")

    @classmethod
    def open(cls, folder: Path, *, scanned: bool = False) -> CompactIndex:
        params = load_json((folder / PARAMS_FILE).read_bytes(), max_bytes=1 << 16)
        if not isinstance(params, dict) or params.get("format") != FORMAT:
            raise ValueError(f"{PARAMS_FILE}: not a {FORMAT} index")
        index = cls(folder, params)
        if not scanned:
            index.scan()
        return index

    def scan(self) -> None:
        """The checks that read the whole term and block tables (not the postings)."""
        if bool(np.any(np.diff(self.term_offsets.astype(np.int64)) <= 0)):
            raise ValueError(f"{TERM_OFFSETS_FILE}: terms must be non-empty and in order")
        stats, blocks = self.stats, self.blocks
        df = stats["df"].astype(np.int64)
        if bool(np.any(df < 1)) or int(df.sum()) != _int(self.params, "postings") or bool(np.any(df > self.passages)):
            raise ValueError(f"{TERM_STATS_FILE}: document frequencies disagree with the index size")
        if not (np.all(np.isfinite(self.norms)) and np.all(self.norms > 0)):
            raise ValueError(f"{NORMS_FILE}: norms must be positive")
        if len(blocks) and (int(blocks["doc_bits"].max()) > packing.MAX_BITS or int(blocks["tf_bits"].max()) > packing.MAX_BITS
                            or int(blocks["last"].max()) >= self.passages):
            raise ValueError(f"{BLOCKS_FILE}: widths or documents out of range")
        # the terms' blocks tile the block table and their bytes tile postings.bin, in one order
        nb = (df + packing.BLOCK - 1) // packing.BLOCK
        order = np.argsort(stats["block"], kind="stable")
        first = stats["block"].astype(np.int64)[order]
        if int(nb.sum()) != len(blocks) or bool(np.any(first != np.cumsum(nb[order]) - nb[order])):
            raise ValueError(f"{TERM_STATS_FILE}: the terms' blocks do not tile {BLOCKS_FILE}")
        counts = np.full(len(blocks), packing.BLOCK, dtype=np.int64)
        ends = np.cumsum(nb[order])
        if len(ends):
            counts[ends - 1] = df[order] - (nb[order] - 1) * packing.BLOCK
        sizes = packing.block_bytes(counts, blocks["doc_bits"].astype(np.int64), blocks["tf_bits"].astype(np.int64))
        term_bytes = np.add.reduceat(sizes, first) if len(first) else sizes[:0]
        offsets = stats["offset"].astype(np.int64)[order]
        if bool(np.any(offsets != np.cumsum(term_bytes) - term_bytes)) or int(sizes.sum()) + packing.PAD != len(self.postings):
            raise ValueError(f"{TERM_STATS_FILE}: the terms' bytes do not tile {POSTINGS_FILE}")

    def __len__(self) -> int:
        return len(self.stats)

    def lookup(self, term: str) -> int | None:
        """The rank (id) of `term`, or None: binary search in the mapped sorted terms."""
        key = encode_term(term)
        offsets, data = self.term_offsets, self._terms
        lo, hi = 0, len(self.stats)
        while lo < hi:
            mid = (lo + hi) // 2
            probe = data[int(offsets[mid]):int(offsets[mid + 1])]
            if probe < key:
                lo = mid + 1
            elif probe > key:
                hi = mid
            else:
                return mid
        return None

    def term(self, rank: int) -> _Term:
        s = self.stats[rank]
        return _Term(rank, int(s["df"]), np.float32(s["idf"]), float(s["peak"]), int(s["offset"]), int(s["block"]))

    def postings_of(self, t: _Term, which: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The documents and frequencies of term `t`'s blocks `which` (positions among its
        blocks, ascending; all when None)."""
        docs, tfs = zip(*self.chunks_of(t, which), strict=True)
        return np.concatenate(docs), np.concatenate(tfs)

    def chunks_of(self, t: _Term, which: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """`postings_of` in pieces of at most `DECODE_BLOCKS` blocks (at least one piece): the
        decoder's temporaries stay a few MB whatever the term's document frequency."""
        nb = (t.df + packing.BLOCK - 1) // packing.BLOCK
        table = self.blocks[t.block:t.block + nb]
        doc_bits, tf_bits = table["doc_bits"].astype(np.int64), table["tf_bits"].astype(np.int64)
        counts = np.full(nb, packing.BLOCK, dtype=np.int64)
        counts[-1] = t.df - (nb - 1) * packing.BLOCK
        sizes = packing.block_bytes(counts, doc_bits, tf_bits)
        offsets = t.offset + np.cumsum(sizes) - sizes
        prev = np.empty(nb, dtype=np.int64)
        prev[0] = -1
        prev[1:] = table["last"][:-1]
        if which is not None:
            offsets, counts, doc_bits, tf_bits, prev = offsets[which], counts[which], doc_bits[which], tf_bits[which], prev[which]
        for lo in range(0, max(len(counts), 1), DECODE_BLOCKS):
            part = slice(lo, lo + DECODE_BLOCKS)
            try:
                docs, tfs = packing.decode(self.postings, offsets[part], counts[part], doc_bits[part], tf_bits[part], prev[part])
            except IndexError:
                raise ValueError(f"{POSTINGS_FILE}: a block reads past the end (damaged index)") from None
            if len(docs) and int(docs[-1]) >= self.passages:  # ascending: the last is the largest
                raise ValueError(f"{POSTINGS_FILE}: a posting names a passage past the {self.passages} (damaged index)")
            yield docs, tfs

    def scores_of(self, t: _Term, docs: np.ndarray, tfs: np.ndarray) -> np.ndarray:
        return term_scores(t.idf, tfs, self.norms[docs])

    def lookup_scores(self, t: _Term, docs: np.ndarray) -> np.ndarray:
        """Term `t`'s score for each of `docs` (ascending; 0 where it has no posting), decoding
        only the blocks that can hold them."""
        nb = (t.df + packing.BLOCK - 1) // packing.BLOCK
        last = self.blocks["last"][t.block:t.block + nb]
        at = np.searchsorted(last, docs)
        which = np.unique(at[at < nb])
        out = np.zeros(len(docs), dtype=np.float32)
        if not len(which):
            return out
        pdocs, ptfs = self.postings_of(t, which)
        pos = np.minimum(np.searchsorted(pdocs, docs), len(pdocs) - 1)
        hit = pdocs[pos] == docs
        out[hit] = self.scores_of(t, pdocs[pos[hit]], ptfs[pos[hit]])
        return out

    def top_k(self, ranks: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
        return top_k(self, ranks, k)


def _select(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the `k` highest positive `scores`, best first, ties: lower position first."""
    if k < len(scores):
        kth = np.partition(scores, len(scores) - k)[len(scores) - k]
        pos = np.flatnonzero(scores >= kth) if kth > 0 else np.flatnonzero(scores > 0)
    else:
        pos = np.flatnonzero(scores > 0)
    return pos[np.lexsort((pos, -scores[pos]))][:k]


def _kth(values: np.ndarray, k: int) -> float:
    """The k-th largest of `values` (0 when there are fewer)."""
    return float(np.partition(values, len(values) - k)[len(values) - k]) if k <= len(values) else 0.0


def top_k(index: CompactIndex, ranks: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The `k` (>= 1) best passages for the query terms `ranks` (in query order, repeats
    counting again), best first (ties: lower passage first), with their scores; passages scoring
    0 are left out. Exactly bm25s's scores (float32 adds, term by term in query order) and a
    full sort (`score_all`), at less cost (MaxScore):

    - the terms are weighed by the most they add to a passage (largest score times repeats); the
      heaviest ones, until they outweigh the rest, are decoded whole: the passages they name are
      the candidates, no other passage can score above the rest's weight;
    - the k-th best candidate so far is a floor under the k-th best score; each other term, the
      heaviest first, is looked up only for the candidates that can still reach the floor
      (decoding only the blocks that hold them), which raises the floor;
    - the survivors are scored exactly, term by term in query order, and sorted.

    When the floor does not clear the rest's weight, the next heaviest term joins the decoded
    ones (a new round); every passage is scored instead when the decoded terms name over
    1/`CANDIDATE_SHARE` of the corpus, after `MAX_ROUNDS` rounds, or when the lookups would cost
    more than scoring all (`PASSAGE_COST`, `CANDIDATE_COST`: the many candidates of
    mid-frequency terms, where pruning saves nothing). Bounds carry
    `BOUND_SLACK` for float32 rounding, so a passage is dropped only when strictly below."""
    terms = {r: index.term(r) for r in ranks}
    times = {r: ranks.count(r) for r in terms}
    weight = {r: terms[r].peak * times[r] for r in terms}
    order = sorted(terms, key=lambda r: -weight[r])
    decoded: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    taken = rounds = 0
    for n_taken in range(1, len(order) + 1):
        taken += terms[order[n_taken - 1]].df
        if taken * CANDIDATE_SHARE > index.passages or rounds >= MAX_ROUNDS:
            break
        rest = sum(weight[r] for r in order[n_taken:]) * BOUND_SLACK
        if n_taken < len(order) and sum(weight[r] for r in order[:n_taken]) <= rest:
            continue  # the candidates would hardly beat the rest's weight: take the next term first
        rounds += 1
        for r in order[:n_taken]:
            if r not in decoded:
                decoded[r] = index.postings_of(terms[r])
        docs = np.unique(np.concatenate([decoded[r][0] for r in order[:n_taken]]))
        partial = np.zeros(len(docs), dtype=np.float32)
        for r in order[:n_taken]:
            partial += _scores_at(index, terms[r], decoded[r], docs) * np.float32(times[r])
        floor = _kth(partial, k) / BOUND_SLACK
        if n_taken < len(order) and floor <= rest:
            continue
        # the lookups (the blocks they decode, and each candidate's search in each term) would
        # cost more than scoring every passage: score them all
        lookups = sum(min(terms[r].df, len(docs) * packing.BLOCK) for r in order[n_taken:])
        lookups += len(docs) * (len(order) - n_taken) * CANDIDATE_COST
        if lookups > sum(t.df for t in terms.values()) + index.passages / PASSAGE_COST:
            break
        alive = np.arange(len(docs))
        looked: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        remaining = sum(weight[r] for r in order[n_taken:])
        for r in order[n_taken:]:
            alive = alive[(partial[alive] + np.float32(remaining)) * BOUND_SLACK >= floor]
            found = index.lookup_scores(terms[r], docs[alive])
            looked[r] = (docs[alive], found)
            partial[alive] += found * np.float32(times[r])
            remaining -= weight[r]
            floor = max(floor, _kth(partial[alive], k) / BOUND_SLACK)
        alive = alive[partial[alive] * BOUND_SLACK >= floor]
        survivors = docs[alive]
        exact = np.zeros(len(survivors), dtype=np.float32)
        for r in ranks:  # query order: the same float32 adds as scoring every passage
            if r in decoded:
                exact += _scores_at(index, terms[r], decoded[r], survivors)
            else:
                at_docs, found = looked[r]
                exact += found[np.searchsorted(at_docs, survivors)]
        pos = _select(exact, k)
        return survivors[pos].astype(np.int64), exact[pos]
    return score_all(index, ranks, k)


def _scores_at(index: CompactIndex, t: _Term, postings: tuple[np.ndarray, np.ndarray], docs: np.ndarray) -> np.ndarray:
    """Term `t`'s score for each of `docs` (ascending) from its decoded `postings` (0: none)."""
    pdocs, ptfs = postings
    out = np.zeros(len(docs), dtype=np.float32)
    if len(pdocs) and len(docs):
        pos = np.minimum(np.searchsorted(pdocs, docs), len(pdocs) - 1)
        hit = pdocs[pos] == docs
        out[hit] = index.scores_of(t, pdocs[pos[hit]], ptfs[pos[hit]])
    return out


def score_all(index: CompactIndex, ranks: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """`top_k` by scoring every passage: bm25s's adds (`BM25._compute_relevance_from_scores`),
    term by term in query order, each term's postings decoded a piece at a time."""
    scores = np.zeros(index.passages, dtype=np.float32)
    for r in ranks:
        t = index.term(r)
        for docs, tfs in index.chunks_of(t):
            scores[docs] += index.scores_of(t, docs, tfs)  # a term names a passage once: no np.add.at needed
    top = _select(scores, k)
    return top.astype(np.int64), scores[top]
