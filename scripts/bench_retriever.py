"""Benchmark the search task's BM25 retriever (bm25s, memory-mapped) against rank-bm25, in one run.

Corpus: synthetic passages of 40-80 words drawn from a Zipf(1.1) vocabulary of 200k made-up words
(a heavy-tailed word distribution like real text); queries are 3-6 words taken from a random
passage, so every query has matches. Per corpus size:

- bm25s: `build_index` (tokenise, index, save the folder with the passage texts), the folder's
  bytes, `Retriever.open` (memory-mapped), then top-10 queries one at a time (`Retriever.search`:
  what a worker does per `<search>`);
- rank-bm25 (`BM25Okapi`, the pure-Python reference), at the sizes up to `--rank-max` only (its
  queries scan every document in Python): build time, pickled size, top-10 queries.

Tokenisation is the same for both (bm25s's tokenizer; rank-bm25 is given the tokens). Query
latency p50/p99 and queries/s are over `--queries` queries (rank-bm25: a tenth of them, at least
10). Ratios compare the two at the sizes both ran; at larger sizes rank-bm25's figures are
extrapolated linearly from its largest measured size (its build and query costs are linear in
the corpus) and marked as such. A last row projects bm25s to 16M passages (PaperSearchQA's
corpus) from the largest measured size: index bytes and query latency linear in the corpus.

Usage: python scripts/bench_retriever.py [--sizes 100000,1000000] [--rank-max 100000]
       [--queries 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import pickle
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rank_bm25 import BM25Okapi

from slime_stoa.tasks.search.retriever import Retriever, build_index, tokenize

VOCAB = 200_000
PROJECT_TO = 16_000_000


def make_corpus(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(40, 81, size=n)
    ids = (rng.zipf(1.1, size=int(lengths.sum())) - 1) % VOCAB
    words = np.array([f"w{i:x}z" for i in range(VOCAB)], dtype=object)
    cuts = np.cumsum(lengths)[:-1]
    return [" ".join(chunk) for chunk in np.split(words[ids], cuts)]


def make_queries(passages: list[str], count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed + 1)
    out = []
    for i in rng.integers(0, len(passages), size=count):
        words = passages[int(i)].split()
        k = int(rng.integers(3, 7))
        start = int(rng.integers(0, len(words) - k))
        out.append(" ".join(words[start : start + k]))
    return out


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def latencies(fn: Any, queries: list[str]) -> dict[str, float]:
    times = []
    start = time.perf_counter()
    for q in queries:
        t = time.perf_counter()
        fn(q)
        times.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    times.sort()
    return {
        "qps": len(queries) / total,
        "p50_ms": 1000 * statistics.median(times),
        "p99_ms": 1000 * times[min(len(times) - 1, int(0.99 * len(times)))],
    }


def peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def bench_bm25s(passages: list[str], queries: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-bm25s-") as tmp:
        folder = Path(tmp) / "index"
        t = time.perf_counter()
        build_index(passages, folder)
        build = time.perf_counter() - t
        t = time.perf_counter()
        retriever = Retriever.open(folder)
        opened = time.perf_counter() - t
        row = {"impl": "bm25s", "build_s": build, "index_bytes": folder_bytes(folder), "open_s": opened}
        row.update(latencies(lambda q: retriever.search(q, 10), queries))
    row["peak_rss_mb"] = peak_rss_mb()
    return row


def bench_rank(passages: list[str], queries: list[str]) -> dict[str, Any]:
    t = time.perf_counter()
    bm = BM25Okapi(tokenize(passages))
    build = time.perf_counter() - t
    row = {"impl": "rank-bm25", "build_s": build, "index_bytes": len(pickle.dumps(bm)), "open_s": float("nan")}

    def query(q: str) -> None:
        scores = bm.get_scores(tokenize([q])[0])
        np.argpartition(-scores, 9)[:10]

    row.update(latencies(query, queries))
    row["peak_rss_mb"] = peak_rss_mb()
    return row


def scaled(row: dict[str, Any], passages: int, *, impl: str) -> dict[str, Any]:
    """`row`'s figures extrapolated linearly to `passages` (open time unknown: NaN)."""
    f = passages / row["passages"]
    return {
        "passages": passages,
        "impl": impl,
        "build_s": row["build_s"] * f,
        "index_bytes": row["index_bytes"] * f,
        "open_s": float("nan"),
        "qps": row["qps"] / f,
        "p50_ms": row["p50_ms"] * f,
        "p99_ms": row["p99_ms"] * f,
    }


def fmt_row(size: str, r: dict[str, Any]) -> str:
    mb = r["index_bytes"] / 1e6
    open_s = "-" if r["open_s"] != r["open_s"] else f"{r['open_s']:.2f}"
    return (
        f"{size:>10} {r['impl']:<22} {r['build_s']:>9.1f} {mb:>10.1f} {open_s:>7} "
        f"{r['qps']:>9.1f} {r['p50_ms']:>9.2f} {r['p99_ms']:>9.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100000,1000000", help="corpus sizes (passages), comma-separated")
    parser.add_argument("--rank-max", type=int, default=100_000, help="largest size rank-bm25 is run at")
    parser.add_argument("--queries", type=int, default=200, help="queries per size (rank-bm25: a tenth, >= 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if not sizes or sizes[0] < 100:
        raise SystemExit("--sizes: give sizes of at least 100 passages")

    rows: list[dict[str, Any]] = []
    print(f"{'passages':>10} {'impl':<22} {'build s':>9} {'index MB':>10} {'open s':>7} {'q/s':>9} {'p50 ms':>9} {'p99 ms':>9}")
    rank_last: dict[str, Any] | None = None
    for n in sizes:
        passages = make_corpus(n, args.seed)
        queries = make_queries(passages, args.queries, args.seed)
        b = {"passages": n, **bench_bm25s(passages, queries)}
        rows.append(b)
        print(fmt_row(f"{n:,}", b), flush=True)
        if n <= args.rank_max:
            r = {"passages": n, "extrapolated": False, **bench_rank(passages, queries[: max(10, args.queries // 10)])}
            rank_last = r
        elif rank_last is not None:
            r = {"passages": n, "extrapolated": True, **scaled(rank_last, n, impl="rank-bm25")}
        else:
            del passages
            continue
        rows.append(r)
        label = "rank-bm25 (extrapol.)" if r["extrapolated"] else "rank-bm25"
        print(fmt_row(f"{n:,}", {**r, "impl": label}), flush=True)
        print(
            f"{'':>10} {'bm25s speed-up':<22} build {r['build_s'] / b['build_s']:.1f}x, "
            f"queries/s {b['qps'] / r['qps']:.0f}x, p50 latency {r['p50_ms'] / b['p50_ms']:.0f}x",
            flush=True,
        )
        del passages
    last = next(r for r in reversed(rows) if r["impl"] == "bm25s")
    proj = scaled(last, PROJECT_TO, impl="bm25s (projected)")
    rows.append(proj)
    print(fmt_row("16,000,000", proj))
    print(
        f"16M projection from {last['passages']:,}: the index folder ({proj['index_bytes'] / 1e9:.1f} GB of these "
        "60-word passages; PubMed abstracts are ~4x longer) is memory-mapped, so a worker needs that much disk "
        "and page cache, not heap; building it needs the corpus and its tokens in memory "
        f"(peak RSS of this run: {peak_rss_mb():.0f} MB at {last['passages']:,})."
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=float))


if __name__ == "__main__":
    main()
