"""`stoa task prepare search` on PaperSearchQA's released formats: its question rows (question,
answer, golden_answers, pmid, cat, ...) and its PubMed corpus in Search-R1's layout (contents: a
quoted title line, then the abstract); the BM25 preset and k1/b recorded in the task meta and
checked by the worker; the build streams the corpus."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import pytest

from slime_stoa.cli import main
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import open_store
from slime_stoa.tasks import load_task
from slime_stoa.tasks.search import Search, decode_label
from slime_stoa.tasks.search.data import Columns, iter_corpus, load_qa, passage_text
from slime_stoa.tasks.search.retriever import open_run_index
from slime_stoa.tasks.search.tokenizer import PRESETS, Bm25Settings

RUN = "psqa"

# Rows in the published column layout (values written for this test, abstracts abridged).
QUESTIONS = [
    {"question": "Which cytokine receptor does tocilizumab block?", "answer": "IL-6 receptor", "cat_num": "3",
     "cat": "therapeutics", "pmid": "100001", "paper_title": "Tocilizumab in rheumatoid arthritis",
     "golden_answers": ["IL-6 receptor", "interleukin-6 receptor", "IL6R"],
     "question_original": "Which receptor is blocked by tocilizumab?", "is_paraphrased": True},
    {"question": "Deficiency of which vitamin is linked to rickets in the cohort?", "answer": "vitamin D", "cat_num": "5",
     "cat": "disease mechanisms", "pmid": "100002", "paper_title": "Rickets and vitamin D",
     "golden_answers": ["vitamin D", "calciferol"], "question_original": "Which vitamin deficiency causes rickets?",
     "is_paraphrased": True},
    {"question": "Which protein aggregates in Lewy bodies?", "answer": "alpha-synuclein", "cat_num": "1",
     "cat": "protein function", "pmid": "100003", "paper_title": "Lewy bodies", "golden_answers": ["α-synuclein", "alpha-synuclein"],
     "question_original": "What aggregates in Lewy bodies?", "is_paraphrased": False},
]
CORPUS = [
    {"id": "0", "contents": '"Tocilizumab in rheumatoid arthritis"\nTocilizumab, a humanised antibody against the IL-6 receptor, '
                            "reduced disease activity in rheumatoid arthritis."},
    {"id": "1", "contents": '"Rickets and vitamin D"\nVitamin D deficiency caused rickets in 12 of 40 children of the cohort.'},
    {"id": "2", "contents": '"Lewy bodies"\nLewy bodies are aggregates of α-synuclein in neurons of patients with Parkinson disease.'},
    {"id": "3", "contents": '"Vitamin B12"\nVitamin B12 deficiency causes anaemia.'},
    {"id": "4", "contents": '"IL-2"\nThe IL-2 receptor on T cells.'},
]


def write_fixture(folder: Path) -> tuple[Path, Path]:
    qa, corpus = folder / "test.jsonl", folder / "pubmed.jsonl"
    qa.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in QUESTIONS), encoding="utf-8")
    corpus.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in CORPUS), encoding="utf-8")
    return qa, corpus


def test_reads_the_published_formats(tmp_path: Path) -> None:
    qa, corpus = write_fixture(tmp_path)
    items = load_qa(qa)
    assert [decode_label(i.label) for i in items] == [tuple(r["golden_answers"]) for r in QUESTIONS]
    assert decode_label(load_qa(qa, columns=Columns(golden_answers=None))[0].label) == ("IL-6 receptor",)
    passages = list(iter_corpus(corpus))
    assert passages[1] == "(Title: Rickets and vitamin D) Vitamin D deficiency caused rickets in 12 of 40 children of the cohort."
    assert passage_text({"contents": '"Quoted" on one line'}, Columns()) == '"Quoted" on one line'  # no title line
    assert passage_text({"contents": "Plain\nsecond line"}, Columns()) == "Plain\nsecond line"


def test_corpus_is_a_stream_and_a_bad_row_names_its_line(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps(CORPUS[0]) + "\n" + json.dumps({"id": "1"}) + "\n")
    stream = iter_corpus(corpus)
    assert next(stream).startswith("(Title: Tocilizumab")
    with pytest.raises(ValueError, match=r"c\.jsonl:2: no passage"):
        next(stream)


def test_prepare_papersearchqa_with_the_search_r1_preset(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    qa, corpus = write_fixture(tmp_path)
    url = f"file://{tmp_path / 'bucket'}"
    (tmp_path / "bucket").mkdir()
    args = ["task", "prepare", "search", str(qa), str(corpus), "--store", url, "--run", RUN, "--bm25", "search-r1",
            "--match", "subem"]
    assert main(args) == 0, capsys.readouterr().err
    assert "index: 5 passages" in capsys.readouterr().out

    async def check() -> None:
        async with open_store(url) as store:
            task = load_task(await store.get_bytes(RunLayout(RUN).task_data("search", "test")))
            assert isinstance(task, Search) and len(task) == 3 and task.config.match == "subem"
            assert Bm25Settings.from_meta(task.config.index["bm25"]) == PRESETS["search-r1"]
            retriever = await open_run_index(store, RUN, task, tmp_path / "cache")
            assert retriever.settings == PRESETS["search-r1"]
            for item, want in zip(task.items, (0, 1, 2), strict=True):
                assert retriever.search(item.prompt, 1)[0].index == want, item.prompt
            assert task.reward("<answer>the IL6R</answer>", task.items[0].label) == 1.0
            # meta that disagrees with the index folder is refused by the worker
            meta = {**task.meta, "index": {**task.config.index, "bm25": PRESETS["default"].as_meta()}}
            with pytest.raises(ValueError, match="differ"):
                await open_run_index(store, RUN, Search(task.items, meta=meta), tmp_path / "cache")

    asyncio.run(check())
    assert not [r for r in caplog.records if r.name.startswith("bm25s")]  # no stray DEBUG bm25s lines


def test_bm25_options_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    qa, corpus = write_fixture(tmp_path)
    url = f"file://{tmp_path / 'bucket'}"
    (tmp_path / "bucket").mkdir()
    base = ["task", "prepare", "search", str(qa), str(corpus), "--store", url, "--run", RUN]
    assert main([*base, "--b", "1.5"]) == 1
    assert "BM25 b must be" in capsys.readouterr().err
    assert main([*base[:4], str(tmp_path / "nope.jsonl"), *base[5:]]) == 1
    assert "nope.jsonl" in capsys.readouterr().err
    assert main([*base, "--k1", "1.2"]) == 0
    task = asyncio.run(_load(url))
    assert (task.config.index["bm25"]["k1"], task.config.index["bm25"]["b"]) == (1.2, 0.75)


async def _load(url: str) -> Search:
    async with open_store(url) as store:
        task = load_task(await store.get_bytes(RunLayout(RUN).task_data("search", "test")))
    assert isinstance(task, Search)
    return task


def test_build_progress_is_quiet_off_a_terminal_and_counts_on_one(capsys: pytest.CaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from slime_stoa.tasks.search.progress import passage_meter

    with passage_meter(total=10) as advance:
        advance(4)
    assert capsys.readouterr() == ("", "")
    from rich.progress import Progress

    moved: list[float] = []
    real_advance = Progress.advance
    monkeypatch.setattr(Progress, "advance", lambda self, task, n=1: (moved.append(n), real_advance(self, task, n)))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with passage_meter(total=10) as advance:
        advance(4)
        advance(6)
    assert moved == [4, 6]  # on a terminal the passages move a rich bar
