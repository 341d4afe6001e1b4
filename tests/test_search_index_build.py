"""The search index's tokeniser, its recorded BM25 settings and the streaming, sharded build:
scores equal bm25s's own index of the same tokens, whatever the shard and block sizes."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import bm25s
import numpy as np
import pytest

from slime_stoa.tasks.search.build import build_index
from slime_stoa.tasks.search.bundle import parse_manifest
from slime_stoa.tasks.search.retriever import Retriever
from slime_stoa.tasks.search.tokenizer import PRESETS, SETTINGS_FILE, Bm25Settings, Tokenizer, TokenizerSpec

WORDS = ["il", "6", "receptor", "vitamin", "d", "b12", "type", "2", "diabetes", "α", "β", "synuclein", "amyloid", "cells", "patient", "cohort", "the", "of", "and"]


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(n)]


@pytest.mark.parametrize(
    ("text", "default", "search_r1"),
    [
        ("IL-6 receptor", ["il", "6", "receptor"], ["il", "6", "receptor"]),
        ("vitamin D", ["vitamin", "d"], ["vitamin", "d"]),
        ("type 2 diabetes", ["type", "2", "diabet"], ["type", "2", "diabet"]),
        ("α-Synuclein and Β-amyloid", ["α", "synuclein", "β", "amyloid"], ["α", "synuclein", "β", "amyloid"]),
        ("The patient's cells in the 1990s", ["patient", "cell", "1990s"], ["patient", "cell", "1990"]),
        ("TNF-α at 5 µg", ["tnf", "α", "5", "μg"], ["tnf", "α", "5", "μg"]),
        ("the of and", [], []),
        ("resp = s.post(f)", ["resp", "s", "post", "f"], ["resp", "s", "post", "f"]),  # Porter empties "s"
    ],
)
def test_tokenizer_keeps_biomedical_meaning(text: str, default: list[str], search_r1: list[str]) -> None:
    assert Tokenizer(PRESETS["default"].tokenizer)(text) == default
    assert Tokenizer(PRESETS["search-r1"].tokenizer)(text) == search_r1
    assert Tokenizer(TokenizerSpec(stemmer="none", stopwords="none"))("The cells") == ["the", "cells"]


def test_settings_round_trip_and_presets() -> None:
    r1 = PRESETS["search-r1"]
    assert (r1.k1, r1.b, r1.tokenizer.stemmer) == (0.9, 0.4, "porter")
    assert (PRESETS["default"].k1, PRESETS["default"].b) == (1.5, 0.75)
    assert Bm25Settings.from_meta(json.loads(json.dumps(r1.as_meta()))) == r1
    bad = [None, {}, {**r1.as_meta(), "format": "stoa.bm25/1"}, {**r1.as_meta(), "k1": -1},
           {**r1.as_meta(), "b": 2}, {**r1.as_meta(), "tokenizer": {"pattern": "words", "stemmer": "x", "stopwords": "lucene"}},
           {**r1.as_meta(), "extra": 1}]
    for meta in bad:
        with pytest.raises(ValueError):
            Bm25Settings.from_meta(meta)


@pytest.mark.parametrize("name", ["default", "search-r1"])
def test_scores_equal_bm25s_on_the_same_tokens(tmp_path: Path, name: str) -> None:
    settings = PRESETS[name]  # type: ignore[index]
    texts = corpus(300)
    tok = Tokenizer(settings.tokenizer)
    reference = bm25s.BM25(k1=settings.k1, b=settings.b, method="lucene")
    reference.index([tok(t) for t in texts], show_progress=False)
    retriever = Retriever.open(build_index_folder(texts, tmp_path / "ix", settings=settings, shard_docs=37, block_entries=5))
    assert retriever.settings == settings
    for query in ["IL-6 receptor", "vitamin D", "type 2 diabetes", "α-synuclein", "β cells of the cohort"]:
        expected = reference.get_scores(tok(query))
        got = np.zeros(len(texts), dtype=np.float32)
        for hit in retriever.search(query, len(texts)):
            got[hit.index] = hit.score
        np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-7)


def build_index_folder(texts: list[str], folder: Path, **kw: object) -> Path:
    build_index(iter(texts), folder, **kw)  # type: ignore[arg-type]
    return folder


def test_shard_and_block_sizes_give_the_same_bytes(tmp_path: Path) -> None:
    texts = corpus(200, seed=3)
    one = build_index_folder(texts, tmp_path / "one", shard_docs=10_000)
    many = build_index_folder(texts, tmp_path / "many", shard_docs=7, block_entries=3)
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in many.iterdir())
    for p in one.iterdir():
        assert p.read_bytes() == (many / p.name).read_bytes(), p.name
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # the scratch shards are gone


def test_build_reads_a_stream_once(tmp_path: Path) -> None:
    reads = []

    def stream() -> Iterator[str]:
        for i, text in enumerate(corpus(50)):
            reads.append(i)
            yield text

    stats = build_index(stream(), tmp_path / "ix", shard_docs=8)
    assert reads == list(range(50)) and stats.passages == 50 and stats.terms > 10
    retriever = Retriever.open(tmp_path / "ix")
    assert [retriever.passages[i] for i in range(50)] == corpus(50)


def test_vitamin_d_and_il6_are_found(tmp_path: Path) -> None:
    texts = [
        "Vitamin B12 deficiency in elderly patients.",
        "Vitamin D deficiency and bone density.",
        "IL-2 signalling in T cells.",
        "The IL-6 receptor mediates inflammation.",
        "Type 1 diabetes is autoimmune.",
        "Type 2 diabetes is linked to obesity.",
        "β-amyloid plaques in the brain.",
        "α-synuclein aggregates in neurons.",
    ]
    retriever = Retriever.open(build_index_folder(texts, tmp_path / "ix"))
    for query, want in [("vitamin D", 1), ("IL-6 receptor", 3), ("type 2 diabetes", 5), ("α-synuclein", 7)]:
        assert retriever.search(query, 1)[0].index == want, query


def test_an_older_index_is_refused_with_a_clear_line(tmp_path: Path) -> None:
    folder = build_index_folder(corpus(20), tmp_path / "ix")
    (folder / SETTINGS_FILE).unlink()
    with pytest.raises(ValueError, match=r"earlier stoa.*rebuild"):
        Retriever.open(folder)
    old = {"format": "stoa.search-index/1", "passages": 1, "files": []}
    with pytest.raises(ValueError, match=r"earlier stoa.*rebuild"):
        parse_manifest(json.dumps(old).encode())


@pytest.mark.parametrize("name", ["default", "search-r1"])
def test_a_word_the_stemmer_empties_is_kept_and_the_index_opens(tmp_path: Path, name: str) -> None:
    """Porter stems "s" to nothing; the word is kept as it is, so the compact term table has no
    empty term (its check refuses one) and a query for it finds its passage."""
    texts = ["The client calls s.post(f) with the file.", "Vitamin D and bone density.", "resp = s"]
    retriever = Retriever.open(build_index_folder(texts, tmp_path / "ix", settings=PRESETS[name]))  # type: ignore[index]
    assert [h.index for h in retriever.search("s", 3)] == [2, 0]


def test_empty_corpus_and_used_folder_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no passages"):
        build_index(iter([]), tmp_path / "empty")
    assert list((tmp_path / "empty").iterdir()) == []
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        build_index(["a"], tmp_path / "used")


def test_stem_cache_starts_over_without_changing_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from slime_stoa.tasks.search import tokenizer

    texts = corpus(50, seed=9)
    expected = [Tokenizer(PRESETS["default"].tokenizer)(t) for t in texts]
    monkeypatch.setattr(tokenizer, "STEM_CACHE_WORDS", 3)
    small = Tokenizer(PRESETS["default"].tokenizer)
    assert [small(t) for t in texts] == expected
    assert len(small._stems) <= 3 + 12  # cleared whenever it passed the cap (one text adds at most 12)
