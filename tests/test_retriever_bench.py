"""scripts/bench_retriever.py at a tiny size: real text found on this machine, recall@k and top-10
overlap per contender, queries/s spreads, and one small streaming build measured in a child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~30 s on two cores (it reads the standard library's docstrings)
def test_bench_retriever_tiny(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ["--quick", "--passages", "400", "--queries", "40", "--rounds", "2", "--build-scale", "2000", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_retriever.py"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pyserini" in proc.stdout
    doc = json.loads(out.read_text())
    rows = doc["quality"]["contenders"]
    assert set(rows) == {"stoa", "stoa-search-r1", "bm25s-plain", "rank-bm25"}
    for row in rows.values():
        assert 0 <= row["recall@1"] <= row["recall@3"] <= row["recall@10"] <= 1
        assert row["queries_per_s"]["n"] == 2 and row["queries_per_s"]["min"] <= row["queries_per_s"]["max"]
    assert rows["rank-bm25"]["top10_overlap_rank_bm25"] == 1.0
    assert rows["stoa-search-r1"]["recall@10"] >= 0.9  # a query is a span of its source passage
    build = doc["build"]["sizes"][0]
    assert build["passages"] == 2000 and build["peak_rss_mb"] > 0 and build["postings"] > 2000
    assert doc["build"]["projected"]["passages"] == 16_000_000
    assert "load_average_start" in doc


@pytest.mark.slow  # ~40 s on two cores: four builds in child processes
def test_bench_retriever_pubmed_scale_tiny(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ["--pubmed-scale", "1500", "--queries", "20", "--rank-bm25-passages", "300", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_retriever.py"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())["pubmed_scale"]
    small, arrays = doc["compact"], doc["arrays"]
    assert small["passages"] == arrays["passages"] == 1500 and small["postings"] == arrays["postings"]
    assert small["bytes_per_posting"] < arrays["bytes_per_posting"] / 3 and small["download_bytes"] < arrays["download_bytes"]
    for row in (small, arrays):  # the pruned top k and scoring every passage agree on every query
        assert row["keyword_same_top10"] == row["keyword_top_k_ms"]["n"] == 20
        assert row["phrase_same_top10"] == row["phrase_top_k_ms"]["n"] == 20
        assert row["peak_rss_mb"] >= row["rss_before_mb"] > 0
    assert doc["compact_quarter"]["passages"] == 1000 and doc["rank_bm25"]["passages"] == 300
    assert doc["projected_16m"]["passages"] == 16_000_000 and doc["projected_16m"]["download_bytes"] > 0


@pytest.mark.slow  # ~20 s on two cores: a tiny MLX model generating beside the queries
def test_beside_generation_is_bounded_by_work_with_spreads(tmp_path: Path) -> None:
    pytest.importorskip("mlx_lm")
    out = tmp_path / "beside.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ["--beside-generation", "--passages", "300", "--queries", "30", "--rounds", "2", "--tokens", "32",
            "--json", str(out)]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_retriever.py"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.loads(out.read_text())["beside_generation"]
    assert row["queries"] == 30 and row["tokens_alone"] == 32 and row["rounds"] == 2
    for key in ("queries_per_s_alone", "queries_per_s_beside_generation", "tokens_per_s_alone",
                "tokens_per_s_beside_queries"):
        assert row[key]["n"] == 2 and 0 < row[key]["min"] <= row[key]["median"] <= row[key]["max"], key
    assert "medians of 2 rounds" in proc.stdout
