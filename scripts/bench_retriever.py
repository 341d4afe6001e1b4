"""Benchmark the search task's BM25 retriever: retrieval quality and speed on real text, and the
streaming index build's peak memory at scale.

Quality and speed (the default). Corpus: real English text present on this machine, cut into
passages of 20-200 words: the paragraphs of the installed packages' METADATA files (their
READMEs) and the docstrings of Python's standard library modules. Queries: a span of 5-9 words
taken from a random passage (its source); recall@1/3/10 is how often the source passage comes
back in the top 1/3/10. Contenders, each on the same corpus and queries:

- `stoa` (the default preset: Snowball English stemming, k1 1.5, b 0.75), `stoa-search-r1`
  (Porter stemming, k1 0.9, b 0.4, as Search-R1's pyserini): this project's index
  (`build.build_index`, `Retriever`, memory-mapped);
- `bm25s-plain`: the index as this project built it before (bm25s's own tokeniser: drops
  one-character tokens, no stemming; k1 1.5, b 0.75);
- `rank-bm25`: rank-bm25's BM25Okapi on the search-r1 tokens with k1 0.9, b 0.4, the reference of
  the top-10 overlap (pyserini, Search-R1's engine, needs Java and does not install here; when it
  is importable it is named in the output but not run).

Top-10 overlap: |top10(contender) & top10(rank-bm25)| / the longer of the two lists (10 unless
fewer passages match), averaged over the queries. Queries/s
are measured in interleaved rounds (one batch of queries per contender per round), reported as
min / median / max with the load average (scripts/benchlib.py).

Build scale (`--build-scale 1000000,4000000`): each size runs in a fresh child process that
streams that many short synthetic passages (40-80 words from a Zipf(1.1) vocabulary of 200k
made-up words) into `build_index` and reports its peak RSS (ru_maxrss) and time; a line
fitted through the sizes projects both to 16M passages.

Query scale (`--query-scale 1000000`): the cost of one query at scale, without a build: a CSC
index of that many synthetic passages (the build-scale corpus's Zipf vocabulary, each passage's
distinct words) made in memory, queried with 5-9 words of a random passage by the full scoring
(bm25s's `get_scores_from_ids` and a top-k over every passage, what `Retriever.search` did) and
by `retriever.top_k` (the same scores, the top picked among the postings' documents); the two
results are checked equal, and ms/query projected linearly to 16M passages.

Beside generation (`--beside-generation`): queries/s of `Retriever.search` on the real corpus
alone and while a tiny MLX model generates on another thread of the same process (a worker's
layout: episodes generate while their tool answers), and the generation's tokens/s alone and
beside the queries, over `--tokens` tokens each time; `--rounds` interleaved rounds.

Usage: python scripts/bench_retriever.py [--quick] [--json PATH] [--passages N] [--queries N]
       [--rounds N] [--build-scale N,M,...] [--query-scale N,...] [--beside-generation]
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib

from slime_stoa.tasks.search.build import build_index
from slime_stoa.tasks.search.retriever import Retriever, top_k
from slime_stoa.tasks.search.tokenizer import PRESETS, Tokenizer

PROJECT_TO = 16_000_000
VOCAB = 200_000
K = 10


# -- the real corpus -------------------------------------------------------------------------------


def _paragraphs(text: str) -> Iterator[str]:
    for para in re.split(r"\n\s*\n", text):
        words = para.split()
        if len(words) >= 20:
            yield " ".join(words[:200])


def real_corpus(limit: int, seed: int) -> list[str]:
    """Passages from the installed packages' METADATA and the standard library's docstrings."""
    seen: set[str] = set()
    out: list[str] = []
    texts: list[str] = []
    for dist in metadata.distributions():
        body = dist.read_text("METADATA") or ""
        texts.append(body.split("\n\n", 1)[1] if "\n\n" in body else "")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    for text in texts:
        for p in _paragraphs(text):
            if p not in seen:
                seen.add(p)
                out.append(p)
    random.Random(seed).shuffle(out)
    return out[:limit]


def make_queries(passages: list[str], count: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed + 1)
    out = []
    for _ in range(count):
        i = rng.randrange(len(passages))
        words = passages[i].split()
        k = rng.randint(5, 9)
        start = rng.randrange(0, len(words) - k + 1)
        out.append((" ".join(words[start : start + k]), i))
    return out


# -- contenders ------------------------------------------------------------------------------------

Search = Callable[[str], list[int]]


def stoa_contender(passages: list[str], preset: str, tmp: Path) -> tuple[Search, float]:
    folder = tmp / preset
    t = time.perf_counter()
    build_index(passages, folder, settings=PRESETS[preset])  # type: ignore[index]
    build_s = time.perf_counter() - t
    retriever = Retriever.open(folder)
    return (lambda q: [h.index for h in retriever.search(q, K)]), build_s


def bm25s_plain_contender(passages: list[str]) -> tuple[Search, float]:
    import bm25s

    t = time.perf_counter()
    bm = bm25s.BM25(method="lucene")
    bm.index(bm25s.tokenize(passages, stopwords="en", show_progress=False), show_progress=False)
    build_s = time.perf_counter() - t

    def search(q: str) -> list[int]:
        tokens = bm25s.tokenize([q], stopwords="en", return_ids=False, show_progress=False)[0]
        ids = [bm.vocab_dict[x] for x in tokens if x in bm.vocab_dict]
        if not ids:
            return []
        scores = np.asarray(bm.get_scores_from_ids(ids))
        top = np.argsort(-scores, kind="stable")[:K]
        return [int(i) for i in top if scores[i] > 0]

    return search, build_s


def rank_bm25_contender(passages: list[str]) -> tuple[Search, float]:
    from rank_bm25 import BM25Okapi

    tok = Tokenizer(PRESETS["search-r1"].tokenizer)
    t = time.perf_counter()
    bm = BM25Okapi([tok(p) for p in passages], k1=0.9, b=0.4)
    build_s = time.perf_counter() - t

    def search(q: str) -> list[int]:
        tokens = tok(q)
        if not tokens:
            return []
        scores = bm.get_scores(tokens)
        top = np.argsort(-scores, kind="stable")[:K]
        return [int(i) for i in top if scores[i] > 0]

    return search, build_s


def pyserini_note() -> str:
    try:
        import pyserini  # noqa: F401
    except ImportError:
        return "pyserini (Search-R1's BM25) is not installed here (it needs Java): the overlap reference is rank-bm25"
    return "pyserini is importable but not run (it needs a Lucene index built with Java): the overlap reference is rank-bm25"


def overlap(a: list[int], b: list[int]) -> float:
    """|a & b| / max(|a|, |b|): 1 when both lists hold the same passages (or none)."""
    return len(set(a) & set(b)) / max(len(a), len(b)) if a or b else 1.0


def quality(search: Search, queries: list[tuple[str, int]], reference: list[list[int]]) -> dict[str, float]:
    hits = [search(q) for q, _ in queries]
    out = {f"recall@{k}": sum(src in h[:k] for h, (_, src) in zip(hits, queries, strict=True)) / len(queries) for k in (1, 3, 10)}
    out["top10_overlap_rank_bm25"] = sum(overlap(h, r) for h, r in zip(hits, reference, strict=True)) / len(queries)
    return out


def bench_quality(args: argparse.Namespace) -> dict[str, Any]:
    passages = real_corpus(args.passages, args.seed)
    if len(passages) < 100:
        raise SystemExit(f"found only {len(passages)} passages of text on this machine; need at least 100")
    queries = make_queries(passages, args.queries, args.seed)
    print(f"corpus: {len(passages):,} passages ({sum(len(p.split()) for p in passages) / len(passages):.0f} words each on "
          f"average) from installed packages' METADATA and the standard library's docstrings; {len(queries)} queries")
    print(pyserini_note())
    with tempfile.TemporaryDirectory(prefix="bench-retriever-") as tmp:
        contenders: dict[str, tuple[Search, float]] = {
            "stoa": stoa_contender(passages, "default", Path(tmp)),
            "stoa-search-r1": stoa_contender(passages, "search-r1", Path(tmp)),
            "bm25s-plain": bm25s_plain_contender(passages),
            "rank-bm25": rank_bm25_contender(passages),
        }
        reference = [contenders["rank-bm25"][0](q) for q, _ in queries]
        rows: dict[str, dict[str, Any]] = {
            name: {"build_s": build_s, **quality(fn, queries, reference)} for name, (fn, build_s) in contenders.items()
        }
        batch = queries[: max(10, len(queries) // 4)]

        def timed(fn: Search, qs: list[tuple[str, int]]) -> Callable[[], float]:
            def run() -> float:
                t = time.perf_counter()
                for q, _ in qs:
                    fn(q)
                return len(qs) / (time.perf_counter() - t)
            return run

        runs = {name: timed(fn, batch if name != "rank-bm25" else batch[: max(5, len(batch) // 10)])
                for name, (fn, _) in contenders.items()}
        qps = benchlib.rounds(runs, args.rounds)
    for name in rows:
        rows[name]["queries_per_s"] = benchlib.spread(qps[name])
    print(f"\n{'contender':<16} {'recall@1':>9} {'recall@3':>9} {'recall@10':>10} {'overlap@10':>11} {'build s':>8}  queries/s median (min-max)")
    for name, r in rows.items():
        q = r["queries_per_s"]
        print(f"{name:<16} {r['recall@1']:>9.3f} {r['recall@3']:>9.3f} {r['recall@10']:>10.3f} "
              f"{r['top10_overlap_rank_bm25']:>11.3f} {r['build_s']:>8.2f}  {q['median']:.0f} ({q['min']:.0f}-{q['max']:.0f}, n={q['n']})")
    return {"passages": len(passages), "queries": len(queries), "overlap_reference": "rank-bm25 (BM25Okapi, search-r1 tokens, k1 0.9, b 0.4)",
            "pyserini": pyserini_note(), "contenders": rows}


# -- build scale -----------------------------------------------------------------------------------


def synthetic_passages(n: int, seed: int) -> Iterator[str]:
    rng = np.random.default_rng(seed)
    words = np.array([f"w{i:x}z" for i in range(VOCAB)], dtype=object)
    done = 0
    while done < n:
        count = min(50_000, n - done)
        lengths = rng.integers(40, 81, size=count)
        ids = (rng.zipf(1.1, size=int(lengths.sum())) - 1) % VOCAB
        for chunk in np.split(words[ids], np.cumsum(lengths)[:-1]):
            yield " ".join(chunk)
        done += count


def peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def build_child(n: int, seed: int) -> None:
    """Build an index of `n` synthetic passages; print one JSON line (peak RSS, time, sizes)."""
    base = peak_rss_mb()
    with tempfile.TemporaryDirectory(prefix="bench-build-") as tmp:
        t = time.perf_counter()
        stats = build_index(synthetic_passages(n, seed), Path(tmp) / "index")
        took = time.perf_counter() - t
        size = sum(p.stat().st_size for p in (Path(tmp) / "index").iterdir())
    print(json.dumps({"passages": n, "build_s": took, "peak_rss_mb": peak_rss_mb(), "rss_before_mb": base,
                      "index_bytes": size, "terms": stats.terms, "postings": stats.postings}))


def fit(xs: list[float], ys: list[float], at: float) -> float:
    if len(xs) == 1:
        return ys[0] * at / xs[0]
    slope, intercept = np.polyfit(xs, ys, 1)
    return float(slope * at + intercept)


def bench_build(sizes: list[int], seed: int) -> dict[str, Any]:
    rows = []
    print(f"\n{'passages':>10} {'build s':>9} {'peak RSS MB':>12} {'index MB':>9} {'terms':>9} {'postings':>12}")
    for n in sizes:
        out = subprocess.run([sys.executable, __file__, "--build-child", str(n), "--seed", str(seed)],
                             check=True, capture_output=True, text=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{n:>10,} {row['build_s']:>9.1f} {row['peak_rss_mb']:>12.0f} {row['index_bytes'] / 1e6:>9.0f} "
              f"{row['terms']:>9,} {row['postings']:>12,}", flush=True)
    xs = [float(r["passages"]) for r in rows]
    proj = {"passages": PROJECT_TO, "peak_rss_mb": fit(xs, [r["peak_rss_mb"] for r in rows], PROJECT_TO),
            "build_s": fit(xs, [r["build_s"] for r in rows], PROJECT_TO),
            "index_bytes": fit(xs, [r["index_bytes"] for r in rows], PROJECT_TO)}
    print(f"{PROJECT_TO:>10,} {proj['build_s']:>9.0f} {proj['peak_rss_mb']:>12.0f} {proj['index_bytes'] / 1e6:>9.0f}   "
          f"(projected: a line through the measured sizes; the vocabulary here is capped at {VOCAB:,} words, "
          "PubMed's is larger and adds ~100 bytes per distinct term)")
    return {"sizes": rows, "projected": proj}


# -- query scale -----------------------------------------------------------------------------------


def synthetic_csc(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(data, indices, indptr, terms) of a CSC index of `n` synthetic passages made in memory:
    each passage's distinct words (Zipf(1.1) over `VOCAB`), BM25-like float32 scores; `terms` is
    each posting's term (to sample queries from a passage's words)."""
    rng = np.random.default_rng(seed)
    keys = []
    for start in range(0, n, 200_000):
        count = min(200_000, n - start)
        lengths = rng.integers(40, 81, size=count)
        terms = (rng.zipf(1.1, size=int(lengths.sum())) - 1) % VOCAB
        docs = np.repeat(np.arange(start, start + count, dtype=np.int64), lengths)
        keys.append(np.unique(terms.astype(np.int64) * n + docs))
    key = np.sort(np.concatenate(keys))
    terms, docs = key // n, (key % n).astype(np.int32)
    indptr = np.searchsorted(terms, np.arange(VOCAB + 1)).astype(np.int64)
    df = np.diff(indptr).astype(np.float64)
    idf = np.log1p((n - df + 0.5) / (df + 0.5))  # Lucene's idf, times a term-frequency part in [0.5, 1.5)
    data = (np.repeat(idf, np.diff(indptr)) * (0.5 + rng.random(len(docs)))).astype(np.float32)
    return data, docs, indptr, terms


def query_scale(n: int, queries: int, seed: int) -> dict[str, Any]:
    import bm25s

    t = time.perf_counter()
    data, indices, indptr, terms = synthetic_csc(n, seed)
    made = time.perf_counter() - t
    rng = np.random.default_rng(seed + 1)
    picks = rng.integers(0, len(indices), size=queries)  # a posting: (its term's) a random passage's word
    by_doc = np.argsort(indices, kind="stable")  # the postings of each passage
    doc_start = np.searchsorted(indices[by_doc], np.arange(n + 1))
    qs = []
    for p in picks:
        d = int(indices[p])
        own = terms[by_doc[doc_start[d]:doc_start[d + 1]]]
        qs.append(rng.choice(own, size=min(len(own), int(rng.integers(5, 10))), replace=False).tolist())
    del by_doc, doc_start

    def full(ids: list[int]) -> list[int]:
        scores = bm25s.BM25._compute_relevance_from_scores(
            data=data, indptr=indptr, indices=indices, num_docs=n, query_tokens_ids=np.asarray(ids), dtype=np.dtype("float32"))
        top = np.argpartition(-scores, K - 1)[:K]
        top = top[np.lexsort((top, -scores[top]))]
        return [int(i) for i in top if scores[i] > 0]

    column_max: dict[int, float] = {}

    def cached_max(i: int) -> float:
        if i not in column_max:
            column_max[i] = float(data[indptr[i]:indptr[i + 1]].max(initial=0.0))
        return column_max[i]

    def pruned(ids: list[int]) -> list[int]:
        return top_k(data, indices, indptr, n, ids, K, cached_max)[0].tolist()

    same = sum(full(q) == pruned(q) for q in qs[:50])  # also fills the column maxima (as a warm worker has)
    timings = {}
    for name, fn in (("full", full), ("top_k", pruned)):
        t = time.perf_counter()
        for q in qs:
            fn(q)
        timings[name] = (time.perf_counter() - t) / len(qs) * 1000
    postings = float(np.mean([sum(int(indptr[i + 1] - indptr[i]) for i in q) for q in qs]))
    return {"passages": n, "postings": len(indices), "made_s": made, "queries": len(qs),
            "postings_per_query": postings, "same_top10_of_50": same,
            "ms_per_query": timings, "projected_16m_ms": {k: v * PROJECT_TO / n for k, v in timings.items()}}


def bench_query_scale(sizes: list[int], queries: int, seed: int) -> list[dict[str, Any]]:
    rows = []
    print(f"\n{'passages':>10} {'postings':>12} {'post/query':>11} {'full ms':>8} {'top_k ms':>9} {'same':>5}   projected to 16M")
    for n in sizes:
        row = query_scale(n, queries, seed)
        ms, proj = row["ms_per_query"], row["projected_16m_ms"]
        print(f"{n:>10,} {row['postings']:>12,} {row['postings_per_query']:>11,.0f} {ms['full']:>8.1f} {ms['top_k']:>9.1f} "
              f"{row['same_top10_of_50']:>3}/50   full {proj['full']:.0f} ms, top_k {proj['top_k']:.0f} ms", flush=True)
        rows.append(row)
    return rows


# -- PubMed scale: the compact index against the bm25s arrays -------------------------------------

PUBMED_WORDS = 233  # words per passage: a PubMed abstract's mean
PUBMED_ZIPF = (1.35, 2.0, 20_000_000)  # p(rank k) ~ (k + 2)^-1.35 over 20M made-up words


def pubmed_corpus(n: int, seed: int, path: Path) -> None:
    """Write `n` PubMed-like passages, one a line: `PUBMED_WORDS` words each drawn from a
    Zipf-Mandelbrot vocabulary calibrated on PubMed (at 1M passages: ~2.5M distinct words and
    ~113 distinct words a passage, against PubMed's 3.2M and 118)."""
    a, q, vocab = PUBMED_ZIPF
    cdf = np.cumsum((np.arange(1, vocab + 1, dtype=np.float64) + q) ** -a)
    cdf /= cdf[-1]
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, n, 20_000):
            count = min(20_000, n - start)
            ranks = np.searchsorted(cdf, rng.random(count * PUBMED_WORDS)).reshape(count, PUBMED_WORDS)
            for row in ranks:
                f.write(" ".join(f"w{r:x}q" for r in row.tolist()) + "\n")


def corpus_lines(path: Path, limit: int | None = None) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                return
            yield line.rstrip("\n")


def anon_rss() -> int:
    """This process's anonymous resident bytes (heap, not mapped files); 0 off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def pubmed_build_child(corpus: Path, n: int, folder: Path, compact_format: bool) -> None:
    """Build one index of the first `n` passages of `corpus`; print one JSON line: time, peak RSS,
    the scratch folder's largest size (sampled every 0.2 s) and each file's bytes."""
    import threading

    work = folder.parent / (folder.name + ".work")
    work.mkdir()
    peak_scratch = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            size = sum(p.stat().st_size for p in work.rglob("*") if p.is_file())
            peak_scratch[0] = max(peak_scratch[0], size)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    before = peak_rss_mb()  # the interpreter and its imports
    t = time.perf_counter()
    stats = build_index(corpus_lines(corpus, n), folder, compact_format=compact_format, work_dir=work)
    took = time.perf_counter() - t
    done.set()
    sampler.join()
    files = {p.name: p.stat().st_size for p in folder.iterdir()}
    print(json.dumps({"passages": stats.passages, "terms": stats.terms, "postings": stats.postings, "build_s": took,
                      "peak_rss_mb": peak_rss_mb(), "rss_before_mb": before, "peak_scratch_bytes": peak_scratch[0], "files": files}))


def pubmed_query_child(folder: Path, corpus: Path, n: int, queries: int, seed: int) -> None:
    """Open the index (heap and time), then time keyword and phrase-like queries: the retriever's
    top k and full scoring of every passage; print one JSON line."""
    from slime_stoa.tasks.search import compact

    rng = random.Random(seed)
    t = time.perf_counter()
    Retriever.open(folder)  # the first open: the checks that read whole tables
    first_open = time.perf_counter() - t
    heap0 = anon_rss()
    t = time.perf_counter()
    retriever = Retriever.open(folder, scanned=True)  # a verified folder: what every later start does
    start_s = time.perf_counter() - t
    heap_open = anon_rss() - heap0
    picks = sorted(rng.sample(range(n), min(n, queries)))
    texts = dict(zip(picks, (line for i, line in enumerate(corpus_lines(corpus, n)) if i in set(picks)), strict=False))
    keyword, phrase = [], []
    for i in picks:
        words = texts[i].split()
        keyword.append(" ".join(rng.sample(words, rng.randint(2, 4))))  # the passage's words: common and rare mixed
        at = rng.randrange(len(words) - 9)
        phrase.append(" ".join(words[at:at + rng.randint(5, 9)]))
    tok = retriever.tokenize

    def ids(q: str) -> list[int]:
        if retriever._index is not None:
            return [r for w in tok(q) if (r := retriever._index.lookup(w)) is not None]
        return [i for w in tok(q) if (i := retriever._vocab.get(w)) is not None]

    def top(q: str) -> list[int]:
        return [h.index for h in retriever.search(q, K)]

    def full(q: str) -> list[int]:
        if retriever._index is not None:
            return compact.score_all(retriever._index, ids(q), K)[0].tolist()
        m = retriever._bm.scores
        return top_k(m["data"], m["indices"], m["indptr"], len(retriever), ids(q), K)[0].tolist()

    out: dict[str, Any] = {"first_open_s": first_open, "start_s": start_s, "heap_open_bytes": heap_open}
    for kind, qs in (("keyword", keyword), ("phrase", phrase)):
        times: dict[str, list[float]] = {"top_k": [], "full": []}
        same = 0
        for q in qs:  # the two ways in turn on each query: a load change touches both alike
            got = {}
            for name, fn in (("top_k", top), ("full", full)):
                s = time.perf_counter()
                got[name] = fn(q)
                times[name].append((time.perf_counter() - s) * 1000)
            same += got["top_k"] == got["full"]
        for name, ms in times.items():
            out[f"{kind}_{name}_ms"] = {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
                                        "max": max(ms), "n": len(ms)}
        out[f"{kind}_same_top10"] = same
    out["heap_after_queries_bytes"] = anon_rss() - heap0
    print(json.dumps(out))


def rank_bm25_latency(corpus: Path, n: int, queries: int, seed: int) -> dict[str, Any]:
    """rank-bm25's BM25Okapi over the first `n` passages: ms a query (keyword-like), p50/p99."""
    from rank_bm25 import BM25Okapi

    tok = Tokenizer(PRESETS["default"].tokenizer)
    docs = [tok(p) for p in corpus_lines(corpus, n)]
    bm = BM25Okapi(docs, k1=1.5, b=0.75)
    rng = random.Random(seed)
    times = []
    for _ in range(queries):
        words = docs[rng.randrange(n)]
        q = rng.sample(words, min(len(words), rng.randint(2, 4)))
        s = time.perf_counter()
        bm.get_scores(q)
        times.append((time.perf_counter() - s) * 1000)
    return {"passages": n, "p50": float(np.percentile(times, 50)), "p99": float(np.percentile(times, 99)), "n": len(times)}


def _child(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


INDEX_OF_POSTINGS = {True: ("postings.bin", "blocks.npy"), False: ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy")}
PASSAGE_FILES = {"passages.txt", "passages.offsets.npy", "passages.zst", "passages.blocks.npy"}


def bench_pubmed(n: int, queries: int, seed: int, arrays_up_to: int, rank_bm25_passages: int) -> dict[str, Any]:
    """Both formats built from the same PubMed-like corpus (a child process each, for a clean peak
    RSS), a smaller compact build to fit the vocabulary's growth, the query times, and the
    projection to 16M passages."""
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-pubmed-") as tmp_name:
        tmp = Path(tmp_name)
        corpus = tmp / "corpus.txt"
        t = time.perf_counter()
        pubmed_corpus(n, seed, corpus)
        print(f"\nPubMed-like corpus: {n:,} passages of {PUBMED_WORDS} words ({time.perf_counter() - t:.0f} s to write)", flush=True)
        formats = [("compact", True)] + ([("arrays", False)] if n <= arrays_up_to else [])
        for name, compact_format in formats:
            folder = tmp / name
            row = _child("--pubmed-build", str(corpus), "--passages", str(n), "--folder", str(folder),
                         *(["--compact"] if compact_format else []))
            row.update(_child("--pubmed-query", str(corpus), "--passages", str(n), "--folder", str(folder),
                              "--queries", str(queries), "--seed", str(seed)))
            files = row["files"]
            row["download_bytes"] = sum(files.values())
            row["postings_bytes"] = sum(files[f] for f in INDEX_OF_POSTINGS[compact_format])
            row["bytes_per_posting"] = row["postings_bytes"] / row["postings"]
            row["index_bytes_per_posting"] = sum(v for f, v in files.items() if f not in PASSAGE_FILES) / row["postings"]
            row["passage_bytes_per_passage"] = sum(v for f, v in files.items() if f in PASSAGE_FILES) / row["passages"]
            rows[name] = row
            shutil.rmtree(folder)
            print(f"{name}: built in {row['build_s']:.0f} s, peak RSS {row['peak_rss_mb']:.0f} MB ({row['rss_before_mb']:.0f} before), scratch {row['peak_scratch_bytes'] / 1e6:.0f} MB; "
                  f"download {row['download_bytes'] / 1e6:.0f} MB; postings {row['bytes_per_posting']:.2f} B each "
                  f"({row['index_bytes_per_posting']:.2f} B with the term tables); passages {row['passage_bytes_per_passage']:.0f} B each; "
                  f"heap at open {row['heap_open_bytes'] / 1e6:.1f} MB, start {row['start_s'] * 1000:.0f} ms (first open {row['first_open_s']:.2f} s)", flush=True)
            for kind in ("keyword", "phrase"):
                a, b = row[f"{kind}_top_k_ms"], row[f"{kind}_full_ms"]
                print(f"  {kind:<8} top_k p50 {a['p50']:.1f} ms p99 {a['p99']:.1f} ms | full scoring p50 {b['p50']:.1f} ms p99 {b['p99']:.1f} ms"
                      f" | same top 10 {row[f'{kind}_same_top10']}/{a['n']}", flush=True)
        small = max(1000, n // 4)
        row = _child("--pubmed-build", str(corpus), "--passages", str(small), "--folder", str(tmp / "small"), "--compact")
        rows["compact_quarter"] = {k: row[k] for k in ("passages", "terms", "postings")}
        if rank_bm25_passages:
            rows["rank_bm25"] = rank_bm25_latency(corpus, min(n, rank_bm25_passages), min(queries, 50), seed)
            r = rows["rank_bm25"]
            print(f"rank-bm25 over {r['passages']:,} passages: p50 {r['p50']:.0f} ms, p99 {r['p99']:.0f} ms", flush=True)
    rows["projected_16m"] = project_pubmed(rows)
    return rows


BUILD_TERM_BYTES = 40  # the build's state per term: df, idf, peak, postings offset, first block, term end
BUILD_PASSAGE_BYTES = 16  # per passage: its length (int32), its norm and the float32 copies computing it


def build_growth_mb(c: dict[str, Any], terms: float, beta: float) -> float:
    """What the build holds beyond the measured peak at 16M passages: the per-term and
    per-passage state, and the shards' maps (4 bytes a shard's word; a shard's words by Heaps'
    law at `SHARD_DOCS` passages). The shard flush and the merge blocks do not grow."""
    from slime_stoa.tasks.search.build import SHARD_DOCS

    def pairs(n: float) -> float:
        return max(1.0, n / SHARD_DOCS) * c["terms"] * (min(n, SHARD_DOCS) / c["passages"]) ** beta

    grow = (BUILD_TERM_BYTES * (terms - c["terms"]) + BUILD_PASSAGE_BYTES * (PROJECT_TO - c["passages"])
            + 4 * (pairs(PROJECT_TO) - pairs(c["passages"])))
    return grow / (1 << 20)


def project_pubmed(rows: dict[str, Any]) -> dict[str, Any]:
    """16M passages: postings and passage bytes linear in the passages; distinct terms by Heaps'
    law fitted through the two compact builds (terms ~ passages^beta); term tables per term."""
    c, q = rows["compact"], rows["compact_quarter"]
    scale = PROJECT_TO / c["passages"]
    beta = math.log(c["terms"] / q["terms"]) / math.log(c["passages"] / q["passages"])
    terms = c["terms"] * scale ** beta
    files = c["files"]
    term_bytes = sum(files[f] for f in ("terms.bin", "terms.offsets.npy", "terms.stats.npy")) / c["terms"]
    postings = c["postings"] * scale
    # the block table: one 6-byte row a term plus one per further 128 postings of a term
    further_blocks_per_posting = ((files["blocks.npy"] - 128) / 6 - c["terms"]) / c["postings"]
    out = {"passages": PROJECT_TO, "terms": terms, "heaps_beta": beta, "postings": postings,
           "postings_bytes": files["postings.bin"] / c["postings"] * postings + 6 * (terms + further_blocks_per_posting * postings),
           "term_table_bytes": term_bytes * terms, "norms_bytes": 4 * PROJECT_TO,
           "passage_bytes": c["passage_bytes_per_passage"] * PROJECT_TO,
           "build_peak_rss_mb": c["peak_rss_mb"] + build_growth_mb(c, terms, beta),
           "scratch_bytes": c["peak_scratch_bytes"] * scale}
    out["download_bytes"] = out["postings_bytes"] + out["term_table_bytes"] + out["norms_bytes"] + out["passage_bytes"]
    print(f"projected to {PROJECT_TO:,} passages: {terms / 1e6:.1f}M terms (Heaps beta {beta:.2f}), download "
          f"{out['download_bytes'] / 1e9:.1f} GB (postings {out['postings_bytes'] / 1e9:.1f}, term tables {out['term_table_bytes'] / 1e9:.2f}, "
          f"norms {out['norms_bytes'] / 1e9:.2f}, passages {out['passage_bytes'] / 1e9:.1f}); build scratch {out['scratch_bytes'] / 1e9:.1f} GB, "
          f"build peak RSS {out['build_peak_rss_mb'] / 1024:.1f} GiB", flush=True)
    return out


# -- beside generation -----------------------------------------------------------------------------


def bench_beside_generation(args: argparse.Namespace) -> dict[str, Any]:
    """Queries/s alone and while an MLX model generates on another thread, and tokens/s alone and
    beside the queries. Bounded by work: the `--queries` searches alone, and `--tokens` generated
    tokens alone and beside the queries (which cycle until the generation is done); `--rounds`
    rounds, the three measurements interleaved in each, reported as min / median / max."""
    import threading

    import mlx_lm

    from slime_stoa.quickstart.tiny_model import build_tiny_model

    passages = real_corpus(args.passages, args.seed)
    queries = [q for q, _ in make_queries(passages, args.queries, args.seed)]
    with tempfile.TemporaryDirectory(prefix="bench-beside-") as tmp:
        build_index(passages, Path(tmp) / "index")
        retriever = Retriever.open(Path(tmp) / "index")
        model_dir = build_tiny_model(Path(tmp) / "model", texts=passages[:2000], hidden_size=256, num_layers=4,
                                     intermediate_size=512, vocab_size=2048)
        loaded = mlx_lm.load(str(model_dir))
        model, tokenizer = loaded[0], loaded[1]
        prompt = tokenizer.encode(passages[0][:200])

        def generate(counts: list[int], limit: int) -> None:
            """`limit` tokens (64 a call), counted in `counts[0]` as they come."""
            while counts[0] < limit:
                for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=64):
                    counts[0] += 1
                    if counts[0] >= limit:
                        break

        def search_all() -> float:
            """Queries/s over every query."""
            t = time.perf_counter()
            for query in queries:
                retriever.search(query, 3)
            return len(queries) / (time.perf_counter() - t)

        def tokens_alone() -> float:
            counts, t = [0], time.perf_counter()
            generate(counts, args.tokens)
            return counts[0] / (time.perf_counter() - t)

        beside_tokens: list[float] = []

        def queries_beside() -> float:
            """Queries/s while the model makes `--tokens` tokens on another thread (the queries
            cycle until it is done); the tokens/s it made meanwhile."""
            counts, done = [0], 0
            thread = threading.Thread(target=generate, args=(counts, args.tokens))
            t = time.perf_counter()
            thread.start()
            while thread.is_alive() or not done:
                retriever.search(queries[done % len(queries)], 3)
                done += 1
            thread.join()
            elapsed = time.perf_counter() - t
            beside_tokens.append(counts[0] / elapsed)
            return done / elapsed

        measured = benchlib.rounds(
            {"queries_alone": search_all, "tokens_alone": tokens_alone, "queries_beside": queries_beside}, args.rounds
        )
    row = {"passages": len(passages), "queries": len(queries), "tokens_alone": args.tokens, "rounds": args.rounds,
           "queries_per_s_alone": benchlib.spread(measured["queries_alone"]),
           "queries_per_s_beside_generation": benchlib.spread(measured["queries_beside"]),
           "tokens_per_s_alone": benchlib.spread(measured["tokens_alone"]),
           "tokens_per_s_beside_queries": benchlib.spread(beside_tokens)}
    med = {k: v["median"] for k, v in row.items() if isinstance(v, dict)}
    print(f"\nqueries/s alone {med['queries_per_s_alone']:.0f}, beside generation "
          f"{med['queries_per_s_beside_generation']:.0f}; generation tokens/s alone {med['tokens_per_s_alone']:.0f}, "
          f"beside the queries {med['tokens_per_s_beside_queries']:.0f} (medians of {args.rounds} rounds; "
          f"{len(passages):,} passages, {len(queries)} queries, {args.tokens} tokens)")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run: 3000 passages, 200 queries, 3 rounds")
    parser.add_argument("--passages", type=int, default=None, help="passages of real text (default 30000; --quick 3000)")
    parser.add_argument("--queries", type=int, default=None, help="queries (default 1000; --quick 200)")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (default 5; --quick 3)")
    parser.add_argument("--build-scale", default="", help="also measure the streaming build at these sizes (e.g. 1000000,4000000)")
    parser.add_argument("--query-scale", default="", help="only time one query at these corpus sizes (e.g. 1000000)")
    parser.add_argument("--beside-generation", action="store_true",
                        help="only measure queries/s beside a tiny MLX model generating in the same process")
    parser.add_argument("--tokens", type=int, default=512,
                        help="--beside-generation: tokens generated per measurement, alone and beside the queries")
    parser.add_argument("--pubmed-scale", type=int, default=None,
                        help="only compare the compact index with the bm25s arrays on this many PubMed-like passages")
    parser.add_argument("--arrays-up-to", type=int, default=300_000, help="--pubmed-scale: build the bm25s arrays up to this size")
    parser.add_argument("--rank-bm25-passages", type=int, default=20_000, help="--pubmed-scale: rank-bm25 over this many (0: skip)")
    parser.add_argument("--build-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pubmed-build", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pubmed-query", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compact", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    if args.build_child is not None:
        build_child(args.build_child, args.seed)
        return
    if args.pubmed_build is not None:
        pubmed_build_child(args.pubmed_build, args.passages, args.folder, args.compact)
        return
    if args.pubmed_query is not None:
        pubmed_query_child(args.folder, args.pubmed_query, args.passages, args.queries, args.seed)
        return
    args.passages = args.passages or (3000 if args.quick else 30_000)
    args.queries = args.queries or (200 if args.quick else 1000)
    args.rounds = args.rounds or (3 if args.quick else 5)
    session = benchlib.Session()
    doc: dict[str, Any]
    with benchlib.exit_on_signals():
        if args.pubmed_scale:
            doc = {"pubmed_scale": bench_pubmed(args.pubmed_scale, args.queries, args.seed, args.arrays_up_to,
                                                args.rank_bm25_passages)}
            if args.json:  # the figures are written even if a later part fails
                args.json.write_text(json.dumps(doc, indent=2))
        elif args.query_scale:
            doc = {"query_scale": bench_query_scale([int(x) for x in args.query_scale.split(",")], args.queries, args.seed)}
        elif args.beside_generation:
            doc = {"beside_generation": bench_beside_generation(args)}
        else:
            doc = {"quality": bench_quality(args)}
        sizes = sorted(int(s) for s in args.build_scale.split(",") if s)
        if sizes:
            doc["build"] = bench_build(sizes, args.seed)
    doc.update(session.meta())
    session.print_load()
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v))


if __name__ == "__main__":
    main()
