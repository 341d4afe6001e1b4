"""The search task's pure parts: answer extraction, SQuAD normalisation, EM / cover-EM, labels,
the registered task and its meta, observations, episode metrics, synthetic data, file reading."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slime_stoa.tasks import TASKS, load_task, make_task
from slime_stoa.tasks.base import TaskItem
from slime_stoa.tasks.search import (
    EpisodeStats,
    Search,
    SearchTags,
    answer_reward,
    cover_exact_match,
    decode_label,
    encode_label,
    exact_match,
    extract_answer,
    format_passages,
    normalize_answer,
    observation,
    summarize,
)
from slime_stoa.tasks.search.data import Columns, load_corpus, load_qa
from slime_stoa.tasks.search.synthetic import generate, task_items

# -- normalisation and matching ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The  Cat!", "cat"),
        ("An apple, a day.", "apple day"),
        ("theory of the ANT", "theory of ant"),  # articles only as whole words
        ("  U.S.A.\t\n", "usa"),
        ("the", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_exact_match() -> None:
    assert exact_match("the Eiffel Tower.", ["Paris", "Eiffel tower"])
    assert not exact_match("Eiffel", ["Eiffel Tower"])
    assert not exact_match("Eiffel Tower in Paris", ["Eiffel Tower"])
    assert not exact_match("", ["the"])  # a gold answer that normalises to nothing matches nothing


def test_cover_exact_match() -> None:
    assert cover_exact_match("It is the Eiffel Tower, in Paris", ["eiffel tower"])
    assert cover_exact_match("BRCA1", ["brca1", "x"])
    assert not cover_exact_match("concatenate", ["cat"])  # whole words, not substrings
    assert not cover_exact_match("Eiffel", ["Eiffel Tower"])
    assert not cover_exact_match("the answer", ["The"])


# -- answer extraction ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>Paris</answer>", "Paris"),
        ("<answer>Lyon</answer> wait <answer> Paris </answer>", "Paris"),  # the last one wins
        ("<answer>Lyon</answer> then <answer>Paris", None),  # the last one is unfinished
        ("<answer>   </answer>", None),
        ("no tags at all", None),
        ("</answer>Paris<answer>", None),
        ("<answer>a <b> c</answer>", "a <b> c"),
    ],
)
def test_extract_answer(completion: str, expected: str | None) -> None:
    assert extract_answer(completion) == expected


def test_extract_answer_custom_tags_and_non_str() -> None:
    assert extract_answer("<ans>x</ans><answer>y</answer>", open_tag="<ans>", close_tag="</ans>") == "x"
    assert extract_answer(None) is None  # type: ignore[arg-type]


def test_labels() -> None:
    assert decode_label(encode_label(["Eiffel Tower", "tour Eiffel"])) == ("Eiffel Tower", "tour Eiffel")
    assert decode_label(encode_label("Paris")) == ("Paris",)
    assert decode_label('"Paris"') == ("Paris",)
    for bad in ("[]", "[1]", "{}", "not json", "[" * 100_000):
        with pytest.raises(ValueError):
            decode_label(bad)
    for bad_answers in ([], [""], "  ", [3]):
        with pytest.raises(ValueError):
            encode_label(bad_answers)  # type: ignore[arg-type]


def test_answer_reward() -> None:
    label = encode_label(["Eiffel Tower"])
    assert answer_reward("<search>x</search> <answer>the eiffel tower</answer>", label) == 1.0
    assert answer_reward("<answer>it is the Eiffel Tower</answer>", label) == 1.0
    assert answer_reward("<answer>it is the Eiffel Tower</answer>", label, match="em") == 0.0
    assert answer_reward("the Eiffel Tower", label) == 0.0  # format error: no answer tag
    assert answer_reward("<answer>Eiffel Tower</answer>", "not json") == 0.0


@given(st.text(max_size=300), st.lists(st.text(max_size=20), min_size=1, max_size=3))
def test_reward_never_raises(completion: str, golds: list[str]) -> None:
    label = json.dumps(golds)
    for text in (completion, f"<answer>{completion}</answer>"):
        assert answer_reward(text, label) in (0.0, 1.0)
        assert answer_reward(text, label, match="em") in (0.0, 1.0)


# -- the registered task --------------------------------------------------------------------------


def _items() -> list[TaskItem]:
    return [TaskItem(index=0, prompt="Where is the Eiffel Tower?", label=encode_label(["Paris"]))]


def test_search_task_registered_and_round_trips() -> None:
    assert TASKS["search"] is Search
    task = make_task("search", _items(), {"match": "em", "top_k": 5})
    back = load_task(task.encode())
    assert isinstance(back, Search) and back.config.match == "em" and back.config.top_k == 5
    assert back.reward("<answer>Paris, France</answer>", back.items[0].label) == 0.0  # em
    cover = make_task("search", _items())
    assert cover.reward("<answer>Paris, France</answer>", cover.items[0].label) == 1.0  # cover_em default
    system = cover.messages(cover.items[0])[0]
    assert system["role"] == "system" and "<search>query</search>" in system["content"]
    assert "<information>" in system["content"] and "<answer>answer</answer>" in system["content"]


def test_search_task_custom_tags() -> None:
    task = make_task("search", _items(), {"tags": {"search": "query", "answer": "final"}})
    assert isinstance(task, Search)
    assert task.config.tags == SearchTags(search="query", information="information", answer="final")
    assert "<query>query</query>" in (task.system_prompt or "")
    label = task.items[0].label
    assert task.reward("<final>Paris</final>", label) == 1.0
    assert task.reward("<answer>Paris</answer>", label) == 0.0
    explicit = make_task("search", _items(), {"system_prompt": None})
    assert explicit.system_prompt is None


@pytest.mark.parametrize(
    "meta",
    [
        {"match": "f1"},
        {"tags": {"search": "<x>"}},
        {"tags": {"search": "answer"}},  # two roles with one tag
        {"tags": {"other": "x"}},
        {"tags": "search"},
        {"top_k": 0},
        {"max_observation_chars": True},
        {"index": []},
    ],
)
def test_search_task_bad_meta(meta: dict) -> None:
    with pytest.raises(ValueError):
        make_task("search", _items(), meta)


# -- observations ----------------------------------------------------------------------------------


def test_format_passages_budget() -> None:
    passages = ["alpha  beta\ngamma", "delta " * 10, "epsilon"]
    full = format_passages(passages, max_chars=10_000)
    assert full.splitlines() == ["Doc 1: alpha beta gamma", "Doc 2: " + " ".join(["delta"] * 10), "Doc 3: epsilon"]
    for budget in range(1, len(full) + 1):
        body = format_passages(passages, max_chars=budget)
        assert len(body) <= budget
        assert body and full.startswith(body)  # rank order, the top passage always (in part)
        assert all(re.fullmatch(r"Doc \d: .*", line) for line in body.splitlines()[1:])
    assert format_passages(passages, max_chars=30) == "Doc 1: alpha beta gamma"  # doc 2 does not fit
    assert format_passages([], max_chars=100) == "No results."
    with pytest.raises(ValueError):
        format_passages(passages, max_chars=0)
    assert observation("Doc 1: x", SearchTags()) == "\n<information>\nDoc 1: x\n</information>\n"


# -- episode metrics -------------------------------------------------------------------------------


def test_summarize_episodes() -> None:
    eps = [
        EpisodeStats(turns=3, searches=2, tool_tokens=300, format_error=False, reward=1.0),
        EpisodeStats(turns=1, searches=0, tool_tokens=0, format_error=True, reward=0.0),
        EpisodeStats(turns=2, searches=1, tool_tokens=150, format_error=False, reward=0.0),
        EpisodeStats(turns=2, searches=1, tool_tokens=50, format_error=False, reward=1.0),
    ]
    m = summarize(eps)
    assert m.episodes == 4
    assert m.search_rate == 0.75 and m.searches_per_episode == 1.0 and m.turns_per_episode == 2.0
    assert m.tool_tokens_per_episode == 125.0 and m.format_error_rate == 0.25 and m.reward == 0.5
    assert m.as_dict()["search/search_rate"] == 0.75
    with pytest.raises(ValueError):
        summarize([])
    for bad in ({"turns": 0}, {"searches": -1}, {"tool_tokens": 1.5}, {"format_error": 1}, {"reward": 2.0}):
        kwargs = {"turns": 1, "searches": 0, "tool_tokens": 0, "format_error": False, "reward": 0.0, **bad}
        with pytest.raises(ValueError):
            EpisodeStats(**kwargs)


# -- synthetic data --------------------------------------------------------------------------------


def test_synthetic_is_deterministic() -> None:
    a, b = generate(40, seed=7), generate(40, seed=7)
    assert a == b
    assert generate(40, seed=8) != a
    assert len(a.qa) == 40 and len(a.passages) == 160
    assert len(generate(5, seed=1, distractors=0).passages) == 5
    for bad in (0, -1, True):
        with pytest.raises(ValueError):
            generate(bad, seed=0)


def test_synthetic_answer_is_only_in_the_corpus() -> None:
    data = generate(200, seed=3)
    words = [set(re.findall(r"\w+", p.lower())) for p in data.passages]
    for q in data.qa:
        answer = q.answer.lower()
        assert answer not in q.question.lower()
        holders = [i for i, w in enumerate(words) if answer in w]
        assert holders == [q.passage]  # exactly one passage states it: the gold one
        entity = q.question.rstrip("?").split()[-1].lower()
        assert entity in words[q.passage]
    items = task_items(data)
    assert [decode_label(i.label) for i in items] == [(q.answer,) for q in data.qa]
    assert [i.index for i in items] == list(range(200))


# -- reading files ---------------------------------------------------------------------------------


def test_load_qa_and_corpus(tmp_path: Path) -> None:
    qa = tmp_path / "train.jsonl"
    qa.write_text(
        json.dumps({"question": " What gene? ", "answer": ["BRCA1", "brca-1"]}) + "\n\n"
        + json.dumps({"q": "x", "question": "Which city?", "answer": "Paris"}) + "\n"
    )
    items = load_qa(qa)
    assert [i.prompt for i in items] == ["What gene?", "Which city?"]
    assert decode_label(items[0].label) == ("BRCA1", "brca-1") and decode_label(items[1].label) == ("Paris",)
    assert len(load_qa(qa, limit=1)) == 1
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text(json.dumps({"Q": "Why?", "golden_answers": ["because"]}) + "\n")
    assert load_qa(renamed, columns=Columns(question="Q", answer="golden_answers"))[0].prompt == "Why?"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        json.dumps({"id": "1", "contents": "Whole passage."}) + "\n"
        + json.dumps({"id": "2", "title": "BRCA1", "text": "A gene."}) + "\n"
        + json.dumps({"id": "3", "title": "", "text": "Untitled."}) + "\n"
    )
    assert load_corpus(corpus) == ["Whole passage.", "(Title: BRCA1) A gene.", "Untitled."]
    for bad_line in ({"question": "", "answer": "x"}, {"question": "q", "answer": []}, {"question": "q", "answer": 3}, [1]):
        qa.write_text(json.dumps(bad_line) + "\n")
        with pytest.raises(ValueError, match=r"train\.jsonl:1"):
            load_qa(qa)
    corpus.write_text(json.dumps({"id": "1", "title": "t"}) + "\n")
    with pytest.raises(ValueError, match="no passage"):
        load_corpus(corpus)


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed")
def test_parquet_without_pyarrow_says_so(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ValueError, match="pyarrow"):
        load_qa(path)
