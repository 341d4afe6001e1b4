"""`retriever.top_k`, the query path: exactly bm25s's full scoring and a full sort by (score,
index), at the cost of the query's postings rather than of the whole corpus."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

bm25s = pytest.importorskip("bm25s")

from slime_stoa.tasks.search import retriever
from slime_stoa.tasks.search.retriever import top_k

score_all = retriever._score_all


def _index(rng: np.random.Generator, n_docs: int, terms: int, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A CSC index: term t holds a random set of documents (each once), from a handful up to
    most of the corpus; scores drawn from `levels` values, so ties abound."""
    sizes = np.minimum(n_docs, (rng.pareto(0.6, terms) * 3).astype(np.int64) + 1)
    cols = [np.sort(rng.choice(n_docs, size=int(s), replace=False)) for s in sizes]
    indices = np.concatenate(cols).astype(np.int32)
    idf = np.repeat(np.round(2 * np.log1p(n_docs / sizes)) / 2, sizes)  # rarer terms weigh more, as in BM25
    data = (idf * rng.integers(1, levels + 1, indices.size) / 4).astype(np.float32)
    indptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return data, indices, indptr


def _reference(data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, n: int, ids: list[int], k: int) -> tuple[list[int], list[float]]:
    scores = bm25s.BM25._compute_relevance_from_scores(
        data=data, indptr=indptr, indices=indices, num_docs=n, query_tokens_ids=np.asarray(ids), dtype=np.dtype("float32"))
    order = np.lexsort((np.arange(n), -scores))[:k]
    order = order[scores[order] > 0]
    return order.tolist(), scores[order].tolist()


@pytest.mark.parametrize("levels", [3, 1000])
def test_top_k_is_exactly_the_full_scoring(levels: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(levels)
    n = 3000
    data, indices, indptr = _index(rng, n, 400, levels)
    terms = len(indptr) - 1
    full_scorings: list[int] = []

    def counted(*args: Any) -> np.ndarray:
        full_scorings.append(1)
        return score_all(*args)

    monkeypatch.setattr(retriever, "_score_all", counted)

    def column_max(i: int) -> float:
        return float(data[indptr[i]:indptr[i + 1]].max(initial=0.0))

    for n_query in range(400):
        ids = rng.integers(0, terms, int(rng.integers(1, 7))).tolist()  # repeats included
        k = int(rng.choice([1, 3, 10, 50, n + 5]))
        top, scores = top_k(data, indices, indptr, n, ids, k, column_max if n_query % 4 else None)
        want = _reference(data, indices, indptr, n, ids, k)
        assert (top.tolist(), scores.tolist()) == want, (ids, k)
    assert 40 <= len(full_scorings) <= 360  # both ways were taken: the candidates alone, and every document


def test_top_k_edges() -> None:
    data = np.array([1.0, 2.0, 2.0], dtype=np.float32)
    indices = np.array([4, 1, 3], dtype=np.int32)
    indptr = np.array([0, 1, 3, 3], dtype=np.int64)  # term 2 has no postings
    assert top_k(data, indices, indptr, 10, [2], 3)[0].tolist() == []
    top, scores = top_k(data, indices, indptr, 10, [1, 0], 2)
    assert top.tolist() == [1, 3] and scores.tolist() == [2.0, 2.0]  # a tie: the lower index first
