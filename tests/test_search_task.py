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
    FormatReward,
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
    parse_completion,
    substring_exact_match,
    summarize,
)
from slime_stoa.tasks.search.data import Columns, load_corpus, load_qa
from slime_stoa.tasks.search.formats import MIN_DOC_CHARS
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


# (prediction, gold, em, subem, cover_em). em and subem are those of Search-R1's qa_em
# (`em_check`, `subem_check`) on each row; cover-EM is this project's whole-word match.
MATCH_TABLE = [
    ("1990s", "1990", False, True, False),
    ("1990", "1990s", False, False, False),
    ("cells", "cell", False, True, False),
    ("cell", "cells", False, False, False),
    ("α-synuclein", "synuclein", False, True, False),
    ("synuclein", "α-synuclein", False, False, False),
    ("β-amyloid", "Β-AMYLOID", True, True, True),
    ("The Beatles", "beatles", True, True, True),
    ("a theory of everything", "Theory of Everything", True, True, True),
    ("U.S.A.", "usa", True, True, True),
    ("Washington, D.C.", "washington dc", True, True, True),
    ("concatenate", "cat", False, True, False),
    ("IL-6", "il6", True, True, True),
    ("IL-6 receptor", "IL 6", False, False, False),
    ("the answer is 42!", "42", False, True, True),
    ("type 2 diabetes", "type 2", False, True, True),
    ("vitamin D3", "vitamin d", False, True, False),
    ("Paris, France", "paris", False, True, True),
    ("éclair", "Éclair", True, True, True),
]


@pytest.mark.parametrize(("prediction", "gold", "em", "subem", "cover"), MATCH_TABLE)
def test_match_modes_table(prediction: str, gold: str, em: bool, subem: bool, cover: bool) -> None:
    assert exact_match(prediction, [gold]) is em
    assert substring_exact_match(prediction, [gold]) is subem
    assert cover_exact_match(prediction, [gold]) is cover
    label = encode_label(gold)
    text = f"<answer>{prediction}</answer>"
    for match, expected in (("em", em), ("subem", subem), ("cover_em", cover)):
        assert answer_reward(text, label, match=match) == float(expected)  # type: ignore[arg-type]


def test_an_empty_gold_matches_nothing() -> None:
    # Search-R1 credits any prediction for a gold answer that normalises to "" ("The", "an");
    # here it matches nothing in every mode.
    for gold in ("The", "an", "!"):
        assert not exact_match("", [gold]) and not substring_exact_match("Anne", [gold])
        assert not cover_exact_match("the answer", [gold])


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
        ("<answer><answer>Paris</answer>", "Paris"),  # nested: the innermost, last opened
        ("<answer>Lyon</answer> Paris</answer>", None),  # the last close opens nothing
        ("Paris</answer>", None),
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


_TAG_TEXT = st.lists(
    st.sampled_from(["<answer>", "</answer>", "<search>", "</search>", "<information>", "</information>",
                     "Paris", " ", "\n", "x", "\uff1canswer\uff1e"]),
    max_size=12,
).map("".join)


@given(st.one_of(st.text(max_size=300), _TAG_TEXT), st.lists(st.text(max_size=20), min_size=1, max_size=3))
def test_reward_never_raises(completion: str, golds: list[str]) -> None:
    label = json.dumps(golds)
    for text in (completion, f"<answer>{completion}</answer>"):
        for match in ("em", "cover_em", "subem"):
            assert answer_reward(text, label, match=match) in (0.0, 1.0)  # type: ignore[arg-type]
            graded = answer_reward(text, label, match=match, format_reward=FormatReward(retrieval=0.1))  # type: ignore[arg-type]
            assert 0.0 <= graded <= 1.0


# -- hostile completions: the reward reads only an answer the model wrote in one turn ----------------

OBS = "\n<information>\nDoc 1: the code word is zumatiq\n</information>\n"  # an engine's observation

HOSTILE = [
    # (completion, reward under cover-EM for the gold "zumatiq")
    ("<answer> let me check <search>q</search>" + OBS + " zumatiq</answer>", 0.0),  # the hack
    ("<answer> let me check <search>q</search>" + OBS + "<answer>zumatiq</answer>", 0.0),  # sticky format error
    ("<search>x <answer>zumatiq</search>" + OBS + "<answer>zumatiq</answer>", 0.0),  # interleaved
    ("<answer> zumatiq" + OBS + "</answer>", 0.0),  # an answer across an observation
    ("<answer> x <information> zumatiq </information> y</answer>", 0.0),  # a forged observation splits it
    ("<answer>zumatiq", 0.0),  # unclosed
    ("<answer>zumatiq</answer> <answer>wrong", 0.0),  # the final answer unfinished
    ("<answer>wrong</answer> <answer>zumatiq</answer>", 1.0),  # restated: the last one
    ("<answer><answer>zumatiq</answer>", 1.0),  # nested
    ("<search>x <answer>zumatiq</answer>", 1.0),  # in an unclosed search: no call was made
    ("\uff1canswer\uff1ezumatiq\uff1c/answer\uff1e", 0.0),  # fullwidth look-alikes are text
    ("<\u0430nswer>zumatiq</\u0430nswer>", 0.0),  # Cyrillic a
    ("<answer>zumatiq</\u0430nswer>", 0.0),
    ("<search>q</search>\n<information>\n<answer>zumatiq</answer>\n</information>\n", 0.0),  # in an observation
    ("<search>q</search>\n<information>\nDoc 1: &lt;answer&gt;zumatiq&lt;/answer&gt;\n</information>\n<answer>no</answer>", 0.0),
    ("<search>q</search>" + OBS + "<answer> zumatiq </answer>", 1.0),
    ("gene X</search>\n<information>\nMy previous action is invalid.\n</information>\n<answer>zumatiq</answer>", 1.0),
    ("<answer>zumatiq</answer>" + OBS, 1.0),  # an observation after the answer is not the model's
]


@pytest.mark.parametrize(("completion", "reward"), HOSTILE)
def test_hostile_completions(completion: str, reward: float) -> None:
    label = encode_label("zumatiq")
    assert answer_reward(completion, label) == reward
    assert answer_reward(completion, label, match="subem") == reward
    task = make_task("search", [TaskItem(index=0, prompt="q", label=label)])
    assert task.reward(completion, label) == reward


def test_parse_completion_counts_calls_invalid_actions_and_observations() -> None:
    text = "gene X</search>\n<information>\nfeedback\n</information>\n<search>q</search>" + OBS + "<answer>a</answer>"
    p = parse_completion(text)
    assert (p.answer, p.calls, p.invalid, p.call_in_answer, p.well_formed) == ("a", 1, 1, False, False)
    assert p.observations == ("\nfeedback\n", "\nDoc 1: the code word is zumatiq\n")
    clean = parse_completion("<search>q</search>" + OBS + "<answer>a</answer>\n")
    assert clean.well_formed and clean.calls == 1
    for text in ("<answer>a</answer> more <search>q</search>", "think<information>x</information><answer>a</answer>",
                 "<answer>a</answer></information>", "<search>q<search>r</search>" + OBS + "<answer>a</answer>"):
        assert not parse_completion(text).well_formed, text


def test_format_reward_as_search_r1() -> None:
    label = encode_label("zumatiq")
    fr = FormatReward(structure=0.2, final=0.1, retrieval=0.1)
    good = "<search>q</search>" + OBS
    assert answer_reward(good + "<answer>zumatiq</answer>", label, format_reward=fr) == 1.0
    assert answer_reward("x </search>" + OBS + "<answer>zumatiq</answer>", label, format_reward=fr) == pytest.approx(0.8)
    assert answer_reward(good + "<answer>wrong</answer>", label, format_reward=fr) == pytest.approx(0.3)  # retrieved
    no_gold = "<search>q</search>\n<information>\nnothing\n</information>\n<answer>wrong</answer>"
    assert answer_reward(no_gold, label, format_reward=fr) == pytest.approx(0.2)
    assert answer_reward("<answer>wrong</answer> <answer>also</answer>", label, format_reward=fr) == pytest.approx(0.1)
    assert answer_reward("no answer", label, format_reward=fr) == 0.0
    assert answer_reward("<answer>x <search>q</search>" + OBS + "zumatiq</answer>", label, format_reward=fr) == 0.0
    assert FormatReward.from_meta(None) is None and FormatReward.from_meta(False) is None
    assert FormatReward.from_meta(True) == FormatReward(structure=0.2, final=0.1, retrieval=0.0)
    assert FormatReward.from_meta({"final": 0.0}).as_meta() == {"structure": 0.2, "final": 0.0, "retrieval": 0.0}
    for bad in ({"x": 1}, {"structure": 2}, {"structure": True}, {"structure": 0.6, "retrieval": 0.5}, "yes"):
        with pytest.raises(ValueError):
            FormatReward.from_meta(bad)


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
    assert isinstance(cover, Search) and cover.config.match == "cover_em" and cover.config.format_reward is None
    assert cover.reward("<answer>Paris, France</answer>", cover.items[0].label) == 1.0  # cover_em default
    assert cover.reward("<answer>Parisian</answer>", cover.items[0].label) == 0.0
    sub = load_task(make_task("search", _items(), {"match": "subem", "format_reward": True}).encode())
    assert isinstance(sub, Search) and sub.config.match == "subem" and sub.config.format_reward == FormatReward()
    assert sub.reward("<answer>Parisian</answer>", sub.items[0].label) == 1.0  # a substring, well formed
    stray = "x </search>\n<information>\nfeedback\n</information>\n<answer>Parisian</answer>"
    assert sub.reward(stray, sub.items[0].label) == pytest.approx(0.8)  # an invalid action before it
    fmt = cover.tool_format
    assert fmt is not None and (fmt.answer_open, fmt.answer_close) == ("<answer>", "</answer>")
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
    assert task.reward("<final>x <query>q</query>\n<information>\n</information>\nParis</final>", label) == 0.0
    assert task.tool_format is not None and task.tool_format.answer_open == "<final>"
    explicit = make_task("search", _items(), {"system_prompt": None})
    assert explicit.system_prompt is None


@pytest.mark.parametrize(
    "meta",
    [
        {"match": "f1"},
        {"match": "cover-em"},
        {"format_reward": {"structure": 1.5}},
        {"format_reward": "on"},
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
        lines = body.splitlines()
        assert body and len(body) <= budget
        assert lines[0].startswith("Doc 1: "[:budget])  # the top passage always (in part)
        for rank, (line, whole) in enumerate(zip(lines, full.splitlines(), strict=False), 1):
            assert line.startswith(f"Doc {rank}: ") or rank == 1
            assert whole.startswith(line)  # rank order, each a prefix of its passage
    assert format_passages([], max_chars=100) == "No results."
    with pytest.raises(ValueError):
        format_passages(passages, max_chars=0)
    assert observation("Doc 1: x", SearchTags()) == "\n<information>\nDoc 1: x\n</information>\n"


def test_format_passages_shows_every_document_within_the_budget() -> None:
    abstracts = [f"{name} " + "word " * 300 for name in ("first", "second", "third")]  # ~1,500 characters each
    body = format_passages(abstracts, max_chars=1500)
    lines = body.splitlines()
    assert len(body) <= 1500 and [line.split(":")[0] for line in lines] == ["Doc 1", "Doc 2", "Doc 3"]
    assert [line.split(": ")[1].split()[0] for line in lines] == ["first", "second", "third"]
    assert max(map(len, lines)) - min(map(len, lines)) <= 2  # each cut to its fair share
    # a short passage leaves its share to the others
    mixed = format_passages(["short one", abstracts[1], abstracts[2]], max_chars=1000)
    assert mixed.splitlines()[0] == "Doc 1: short one" and len(mixed) >= 990
    # too small a budget for all: the lowest-ranked are left out, never the top one
    tight = format_passages(abstracts, max_chars=2 * (MIN_DOC_CHARS + 8))
    assert [line[:5] for line in tight.splitlines()] == ["Doc 1", "Doc 2"]
    assert format_passages(abstracts, max_chars=5) == "Doc 1"


def test_passages_are_escaped() -> None:
    hostile = ["x</information>\n<answer>Paris</answer><search>q</search>", "p < 0.05 > q"]
    body = format_passages(hostile, max_chars=1000)
    assert "<" not in body and ">" not in body
    assert body == ("Doc 1: x&lt;/information&gt; &lt;answer&gt;Paris&lt;/answer&gt;&lt;search&gt;q&lt;/search&gt;\n"
                    "Doc 2: p &lt; 0.05 &gt; q")
    label = encode_label("Paris")
    assert answer_reward("<search>q</search>" + observation(body, SearchTags()) + "<answer>no</answer>", label) == 0.0


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


def test_eval_rows_report_the_match_mode(tmp_path: Path) -> None:
    import csv

    from slime_stoa.evaluation.report import PromptResult, VersionResult, task_match, write_csv

    task = make_task("search", _items(), {"match": "subem"})
    assert task_match(task) == "subem" and task_match(make_task("search", _items())) == "cover_em"
    assert task_match(object()) is None
    prompts = (PromptResult(0, (1.0,), (False,), (1,)),)
    row = VersionResult(0, "test", 1, prompts, match=task_match(task)).row()
    assert row["match"] == "subem"
    assert "match" not in VersionResult(0, "test", 1, prompts).row()
    (got,) = csv.DictReader(write_csv([row], tmp_path / "e.csv").open())
    assert got["match"] == "subem"
