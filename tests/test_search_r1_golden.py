"""The `papersearchqa` preset against Search-R1's published behaviour, on golden examples written
by hand from its code (none of it is imported or copied):

- Search-R1 (github.com/PeterGriffinJin/Search-R1, commit a14dc3a4ffc6fe88c1e95038d9738e21ba3f7a06):
  the prompt of `scripts/data_process/nq_search.py` (`make_prefix`, template "base", the question
  stripped and ended with "?"), the observation and the invalid-action feedback of
  `search_r1/llm_agent/generation.py` (`execute_predictions`, `_passages2string`,
  `_process_next_obs`: the observation text encoded whole and cut at `max_obs_length` tokens), and
  the reward of `verl/utils/reward_score/qa_em.py` (`compute_score_em`: strict EM of the last
  `<answer>` of prompt + response, 0 without one).
- PaperSearchRL (github.com/jmhb0/PaperSearchRL, commit 8d4fc1bce6d4d9bc34697bb928a8ce682d94b6e8):
  `run_scripts/202507013_psr1_qwen7b_it_grpo_bm25.sh` (max_turns=2, retriever.topk=3,
  max_obs_length=500, max_response_length=500) and `eval/infer.py` (the same prompt, one user
  message)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from slime_stoa.cli import main
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import open_store
from slime_stoa.tasks import decode_task_data, load_task
from slime_stoa.tasks.base import TaskItem
from slime_stoa.tasks.episode import invalid_action_tokens, observation_tokens
from slime_stoa.tasks.search import Search, encode_label
from slime_stoa.tasks.search.data import Columns, passage_text
from slime_stoa.tasks.search.formats import format_search_r1
from slime_stoa.tasks.search.presets import TASK_PRESETS, resolve
from slime_stoa.tasks.search.tokenizer import PRESETS, Bm25Settings

PRESET = TASK_PRESETS["papersearchqa"]
TASK = Search([TaskItem(index=0, prompt="  Which protein aggregates in Lewy bodies ", label=encode_label(["alpha-synuclein"]))],
              meta=dict(PRESET.meta))

# Search-R1's prompt for that question, written out as its make_prefix renders it.
GOLDEN_PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge needed, "
    "you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. For "
    "example, <answer> Beijing </answer>. Question: Which protein aggregates in Lewy bodies?\n"
)
# Three PubMed rows as PaperSearchQA's pubmed.jsonl holds them (Search-R1's corpus layout).
CONTENTS = [
    '"Lewy bodies"\nLewy bodies are aggregates of alpha-synuclein.\nThey mark Parkinson disease.',
    '"Vitamin B12"\nVitamin B12 deficiency causes anaemia.',
    '"IL-2"\nThe IL-2 receptor on T cells.',
]
# Search-R1's observation of those three hits, ranked as listed: "\n\n<information>" + the
# passages' string stripped + "</information>\n\n", each "Doc i(Title: <first line>) <the rest>\n".
GOLDEN_OBSERVATION = (
    '\n\n<information>Doc 1(Title: "Lewy bodies") Lewy bodies are aggregates of alpha-synuclein.\nThey mark Parkinson disease.\n'
    'Doc 2(Title: "Vitamin B12") Vitamin B12 deficiency causes anaemia.\n'
    'Doc 3(Title: "IL-2") The IL-2 receptor on T cells.</information>\n\n'
)
GOLDEN_FEEDBACK = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n"
)


def chars(text: str) -> list[int]:
    """A character-level tokeniser: token counts are character counts."""
    return [ord(c) for c in text]


def test_prompt_is_search_r1s_one_user_message() -> None:
    assert TASK.messages(TASK.items[0]) == [{"role": "user", "content": GOLDEN_PROMPT}]
    assert TASK.system_prompt is None
    plain = Search(TASK.items)  # without the preset: stoa's system prompt, the question as asked
    assert plain.messages(plain.items[0])[0]["role"] == "system" and plain.messages(plain.items[0])[1]["content"] == TASK.items[0].prompt


def test_observation_is_search_r1s_text_whole_and_cut_at_the_token_cap() -> None:
    fmt = TASK.tool_format
    assert fmt is not None and (fmt.max_turns, fmt.max_observation_tokens, fmt.max_turn_tokens) == (3, 500, 500)
    stored = [passage_text({"contents": c}, Columns(), raw=True) for c in CONTENTS]
    assert stored == CONTENTS  # kept as Search-R1's corpus holds them
    body = format_search_r1([p for p in stored if p is not None])
    assert observation_tokens(fmt, chars, body) == chars(GOLDEN_OBSERVATION)
    # over the cap: exactly cap tokens, the opening tag and the first passage's start, then the closing tag
    small = Search(TASK.items, meta={**PRESET.meta, "max_observation_tokens": 60}).tool_format
    assert small is not None
    cut = "".join(map(chr, observation_tokens(small, chars, body)))
    assert len(cut) == 60 and cut == GOLDEN_OBSERVATION[:60 - len("</information>\n\n")] + "</information>\n\n"
    assert format_search_r1([]) == "" and observation_tokens(fmt, chars, "") == chars("\n\n<information></information>\n\n")


def test_invalid_action_feedback_is_search_r1s_exact_text() -> None:
    fmt = TASK.tool_format
    assert fmt is not None and fmt.no_action == "feedback"
    assert invalid_action_tokens(fmt, chars) == chars(GOLDEN_FEEDBACK)
    # the stoa layout (every other preset) keeps its escaped feedback inside the observation tags
    stoa = Search(TASK.items).tool_format
    assert stoa is not None and "".join(map(chr, invalid_action_tokens(stoa, chars))).startswith("\n<information>My previous action is invalid. If I want to search, I should put the query between &lt;search&gt;")


# (response, gold answers, Search-R1's compute_score_em on prompt + response). Its prompt holds one
# "<answer> Beijing </answer>", so the response's last answer is the one scored.
GOLDEN_REWARDS = [
    ("<think>x</think><answer> alpha-synuclein </answer>", ["α-synuclein", "alpha-synuclein"], 1.0),
    ("<answer>Alpha-Synuclein.</answer>", ["alpha-synuclein"], 1.0),  # normalised: case, punctuation
    ("<answer>the BRCA1 gene</answer>", ["BRCA1"], 0.0),  # strict: cover-EM would give 1
    ("<answer>cells</answer>", ["cell"], 0.0),  # plurals (subem: 1)
    ("<answer>1990s</answer>", ["1990"], 0.0),
    ("<answer>brca12</answer>", ["brca1"], 0.0),  # prefixes (subem: 1)
    ("<answer>IL6R</answer>", ["IL-6 receptor", "IL6R"], 1.0),
    ("<search> q </search>\n\n<information>Doc 1(Title: \"a\") b</information>\n\n<answer> b </answer>", ["b"], 1.0),
    ("<answer>wrong</answer> then <answer>cell</answer>", ["cell"], 1.0),  # the last answer
    ("no answer at all", ["cell"], 0.0),
]


@pytest.mark.parametrize(("response", "golds", "expected"), GOLDEN_REWARDS)
def test_reward_is_search_r1s_strict_em(response: str, golds: list[str], expected: float) -> None:
    assert TASK.config.match == "em"
    assert TASK.reward(response, encode_label(golds)) == expected


def test_eval_metrics_report_em_and_cover_em_whatever_the_reward() -> None:
    label = encode_label(["BRCA1"])
    assert TASK.answer_matches("<answer>the BRCA1 gene</answer>", label) == {"em": 0.0, "cover_em": 1.0}
    assert TASK.answer_matches("<answer>BRCA1</answer>", label) == {"em": 1.0, "cover_em": 1.0}
    assert TASK.answer_matches("<answer>brca12</answer>", label) == {"em": 0.0, "cover_em": 0.0}


def test_the_feedbacks_own_tags_are_not_the_models_answer() -> None:
    """Deliberate difference: Search-R1's regex would read "and" from the feedback's
    "<answer> and </answer>"; stoa's parser skips the feedback text, so an episode that never
    answered scores 0 (and one that answered after it scores its own answer)."""
    label = encode_label(["and"])
    assert TASK.reward("I am unsure" + GOLDEN_FEEDBACK + "still unsure", label) == 0.0
    assert TASK.reward("I am unsure" + GOLDEN_FEEDBACK + "<answer>and</answer>", label) == 1.0


def test_preset_resolution_and_flags_over_it() -> None:
    meta, bm25 = resolve("papersearchqa", {"max_searches": 3, "bm25": None, "match": None})
    assert bm25 == "search-r1" and meta["max_searches"] == 3 and meta["match"] == "em" and meta["no_action"] == "feedback"
    assert resolve(None, {}) == ({"match": "cover_em", "top_k": 3, "max_observation_chars": 1500}, "default")
    with pytest.raises(ValueError, match="unknown search preset"):
        resolve("nope", {})
    with pytest.raises(ValueError, match="max_turn_tokens"):
        resolve("papersearchqa", {"max_turn_tokens": 0})


def _prepare(tmp_path: Path, run: str, *flags: str) -> dict:
    qa, corpus = tmp_path / "test.jsonl", tmp_path / "pubmed.jsonl"
    qa.write_text(json.dumps({"question": "Which protein aggregates in Lewy bodies?", "answer": "alpha-synuclein"}) + "\n")
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": c}) + "\n" for i, c in enumerate(CONTENTS)))
    url = f"file://{tmp_path / 'bucket'}"
    (tmp_path / "bucket").mkdir(exist_ok=True)
    assert main(["task", "prepare", "search", str(qa), str(corpus), "--store", url, "--run", run, *flags]) == 0

    async def read() -> bytes:
        async with open_store(url) as store:
            return await store.get_bytes(RunLayout(run).task_data("search", "test"))

    data = asyncio.run(read())
    header, _ = decode_task_data(data)
    task = load_task(data)
    assert isinstance(task, Search)
    return {"header": header, "task": task}


def test_prepare_with_the_preset_records_every_setting(tmp_path: Path) -> None:
    got = _prepare(tmp_path, "psqa", "--preset", "papersearchqa")
    header, task = got["header"], got["task"]
    for key, value in PRESET.meta.items():
        assert header[key] == value, key
    assert Bm25Settings.from_meta(task.config.index["bm25"]) == PRESETS["search-r1"]
    assert task.messages(task.items[0])[0]["content"].startswith("Answer the given question.")
    # without a preset the task meta holds exactly the keys it always held
    plain = _prepare(tmp_path, "plain")["header"]
    assert set(plain) == {"format", "task", "count", "match", "top_k", "max_observation_chars", "source", "index"}
    assert (plain["match"], plain["top_k"], plain["max_observation_chars"]) == ("cover_em", 3, 1500)
    over = _prepare(tmp_path, "over", "--preset", "papersearchqa", "--max-searches", "3", "--bm25", "default")
    assert over["header"]["max_searches"] == 3 and Bm25Settings.from_meta(over["task"].config.index["bm25"]) == PRESETS["default"]


def test_stoa_eval_rows_report_em_and_cover_em_beside_the_reward() -> None:
    from slime_stoa.evaluation.report import PromptResult, VersionResult, answer_matches

    label = encode_label(["BRCA1"])
    texts = ["<answer>the BRCA1 gene</answer>", "<answer>BRCA1</answer>"]
    result = VersionResult(3, "test", 2, (PromptResult(
        prompt_index=0, rewards=tuple(TASK.reward(t, label) for t in texts), truncated=(False, False),
        matches=tuple(m for t in texts if (m := answer_matches(TASK, t, label)) is not None)),), match="em")
    row = result.row()
    assert (row["pass@1"], row["pass@1_em"], row["pass@1_cover_em"], row["match"]) == (0.5, 0.5, 1.0, "em")
    assert answer_matches(object(), "x", label) is None  # a task without them: not reported
