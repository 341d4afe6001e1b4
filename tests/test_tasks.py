"""The task layer: GSM8K answer extraction and equivalence, the real GSM8K files, the synthetic
quickstart task, hostile completions, and the task-data wire format."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_stoa.tasks import (
    GSM8K,
    TASKS,
    Synthetic,
    TaskItem,
    answers_equal,
    decode_task_data,
    encode_task_data,
    extract_answer,
    generate_items,
    load_gsm8k_jsonl,
    load_task,
    make_task,
    warmup_pairs,
)
from slime_stoa.tasks.gsm8k import SYSTEM_PROMPT, parse_label, parse_number
from slime_stoa.tasks.synthetic import baseline_reward, parse_prompt
from tests.shared_data import GSM8K_DIR, needs_gsm8k

# ---------------------------------------------------------------------------------------------
# GSM8K answer extraction

EXTRACT_CASES = [
    # "#### X" wins over everything, last one wins
    ("She has 3 apples, then 5 more.\n#### 8", "8"),
    ("#### 72", "72"),
    ("####72", "72"),
    ("Step 1: 12 + 30 = 42\n#### 1,000", "1000"),
    ("#### $1,234.", "1234"),
    ("#### -5", "-5"),
    ("#### **18**", "18"),
    ("First guess #### 4, corrected: #### 6. So 99 is wrong.", "6"),
    ("The answer is 5.\n#### 7", "7"),
    ("\\boxed{3}\n#### 9", "9"),
    ("#### none\nThe answer is 12", "12"),  # "####" without a number falls through
    # \boxed{...}
    ("So the total is \\boxed{42}.", "42"),
    ("12 cookies... \\boxed{1,000} and then 7 more words", "1000"),
    ("\\boxed{\\$18}", "18"),
    ("\\boxed{-3}", "-3"),
    ("\\boxed{\\frac{3}{4}}", "3/4"),
    ("\\boxed{\\dfrac{1}{2}}", "1/2"),
    ("\\boxed{25\\%}", "25"),
    ("\\boxed{72 \\text{ apples}}", "72"),
    ("\\boxed{1{,}500}", "1500"),
    ("\\boxed{1\\,500\\text{ m}}", "1500"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("The answer is 5. Check: \\boxed{6}", "6"),
    # "answer is X" / "Answer: X"
    ("There are 4 boxes of 6 pens. The answer is 24 pens, not 25.", "24"),
    ("Answer: 17\nBecause 10 + 7 = 17 and 3 spares.", "17"),
    ("**Answer:** 42 (from 6 * 7)", "42"),
    ("**Answer**: 9 out of 10", "9"),
    ("The final answer is: $2,500.00, after 3 weeks", "2500.00"),
    ("THE ANSWER IS -8 degrees, 5 more than before", "-8"),
    ("answer = 0.75 of 4 items", "0.75"),
    ("The answer is 3 at first, but the answer is 4 after 2 days.", "4"),
    ("The answer is 3/4 of the 12 cups", "3/4"),
    # last number in the text
    ("He pays 5 + 7 = 12 dollars", "12"),
    ("Total: $1,234.56.", "1234.56"),
    ("It was 2.5 hours.", "2.5"),
    ("The temperature is -4 today.", "-4"),
    ("It dropped to \u22127.", "-7"),  # U+2212 minus sign
    ("10-3=7", "7"),
    ("10 - 3", "3"),  # a spaced minus is subtraction, not a sign
    ("a-5", "5"),
    ("The numbers are 1,2,3", "3"),
    ("about 50% of them", "50"),
    ("so 48/2 = 24", "24"),
    ("she ate 3/4", "3/4"),
    ("Version v1.2 of CO2 x2", None),
    ("no numbers at all", None),
    ("", None),
    ("\u0663\u0664 (Arabic-Indic digits are not ASCII)", None),
]


@pytest.mark.parametrize(("completion", "expected"), EXTRACT_CASES)
def test_extract_answer(completion: str, expected: str | None) -> None:
    assert extract_answer(completion) == expected


def test_extract_answer_rejects_non_strings() -> None:
    assert extract_answer(None) is None  # type: ignore[arg-type]
    assert extract_answer(b"#### 5") is None  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Numeric equivalence

EQUAL = [
    ("72", "72"),
    ("72", "72.0"),
    ("72.00", "72"),
    ("1,000", "1000"),
    ("1,234,567.5", "1234567.50"),
    ("0.5", "1/2"),
    ("3/4", "0.75"),
    ("-5", "-5.0"),
    ("$18", "18"),
    (" 18 ", "18"),
    ("-0", "0"),
    ("\u22127", "-7"),
    ("6/3", "2"),
]
NOT_EQUAL = [
    ("72", "73"),
    ("-5", "5"),
    ("0.5", "0.05"),
    ("1/3", "0.33"),
    ("1,00", "100"),  # not a thousands grouping
    ("1/0", "0"),
    ("abc", "abc"),  # numeric comparison only
    ("", "0"),
    ("1e3", "1000"),  # no exponents
    ("7" * 100, "7" * 100),  # absurdly long numbers never match
]


@pytest.mark.parametrize(("a", "b"), EQUAL)
def test_answers_equal(a: str, b: str) -> None:
    assert answers_equal(a, b) and answers_equal(b, a)


@pytest.mark.parametrize(("a", "b"), NOT_EQUAL)
def test_answers_not_equal(a: str, b: str) -> None:
    assert not answers_equal(a, b) and not answers_equal(b, a)


def test_answers_equal_none_prediction() -> None:
    assert not answers_equal(None, "5")


def test_parse_number_is_exact() -> None:
    assert parse_number("0.1") == Fraction(1, 10)
    assert parse_number("-1,234.5") == Fraction(-2469, 2)
    assert parse_number("1.") is None and parse_number("--1") is None


def test_gsm8k_reward() -> None:
    task = GSM8K([TaskItem(index=0, prompt="What is 6 * 7?", label="42")])
    assert task.reward("6 * 7 = 42\n#### 42", "42") == 1.0
    assert task.reward("The answer is 42.0", "42") == 1.0
    assert task.reward("6 * 7 = 42\n#### 41", "42") == 0.0
    assert task.reward("#### 42", "1,000") == 0.0
    assert task.reward("#### 1000", "1,000") == 1.0
    assert task.reward(None, "42") == 0.0  # type: ignore[arg-type]


def test_gsm8k_messages_have_system_prompt() -> None:
    item = TaskItem(index=0, prompt="What is 6 * 7?", label="42")
    msgs = GSM8K([item]).messages(item)
    assert msgs == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "What is 6 * 7?"},
    ]
    assert "####" in SYSTEM_PROMPT
    plain = GSM8K([item], meta={"system_prompt": None}).messages(item)
    assert plain == [{"role": "user", "content": "What is 6 * 7?"}]


# ---------------------------------------------------------------------------------------------
# The real GSM8K files


def _rows(name: str) -> list[dict]:
    with open(GSM8K_DIR / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@needs_gsm8k
@pytest.mark.parametrize(("name", "count"), [("train.jsonl", 7473), ("test.jsonl", 1319)])
def test_gsm8k_files_load(name: str, count: int) -> None:
    items = load_gsm8k_jsonl(GSM8K_DIR / name)
    rows = _rows(name)
    assert len(items) == len(rows) == count
    assert [it.index for it in items] == list(range(count))
    for item, row in zip(items, rows, strict=False):
        assert item.prompt == row["question"].strip()
        assert parse_number(item.label) is not None, item
        assert "," not in item.label
        assert parse_number(item.label) == parse_number(row["answer"].rsplit("####", 1)[1])
    assert load_gsm8k_jsonl(GSM8K_DIR / name, limit=5) == items[:5]


@needs_gsm8k
def test_reference_solutions_score_one() -> None:
    items = load_gsm8k_jsonl(GSM8K_DIR / "train.jsonl")
    task = GSM8K(items)
    rows = _rows("train.jsonl")
    failures = [
        it.index for it, row in zip(items, rows, strict=False) if task.reward(row["answer"], it.label) != 1.0
    ]
    assert failures == []
    # and a shifted label scores 0 for every item
    wrong = [
        it.index
        for it, row in zip(items, rows, strict=False)
        if task.reward(row["answer"], str(parse_number(it.label) + 1)) != 0.0
    ]
    assert wrong == []


def test_load_gsm8k_rejects_bad_lines(tmp_path: Path) -> None:
    good = json.dumps({"question": "q?", "answer": "so\n#### 1,200"})
    path = tmp_path / "g.jsonl"
    path.write_text(good + "\n\n" + good + "\n")
    items = load_gsm8k_jsonl(path)
    assert [(it.index, it.label) for it in items] == [(0, "1200"), (1, "1200")]
    for bad in (
        "not json",
        "[1, 2]",
        json.dumps({"question": "q?", "answer": "no marker"}),
        json.dumps({"question": "q?", "answer": "#### twelve"}),
        json.dumps({"question": "", "answer": "#### 1"}),
        json.dumps({"answer": "#### 1"}),
    ):
        path.write_text(good + "\n" + bad + "\n")
        with pytest.raises(ValueError, match=r"g\.jsonl:2"):
            load_gsm8k_jsonl(path)
    with pytest.raises(ValueError, match="limit"):
        load_gsm8k_jsonl(path, limit=-1)
    assert parse_label("x\n#### -3") == "-3"


# ---------------------------------------------------------------------------------------------
# Hostile completions: 0.0, quickly, never an exception

HOSTILE = [
    "a" * 1_000_000,
    "9" * 1_000_000,
    "#### " * 200_000,
    "####" + " " * 1_000_000,
    "\\boxed{" * 150_000,
    "\\boxed{" + "{" * 1_000_000,
    "answer is " * 100_000,
    "Answer:" + " " * 1_000_000 + "x",
    "1," * 500_000,
    "1." * 500_000,
    "1/" * 500_000,
    "-" * 1_000_000,
    "$ " * 500_000,
    "\u2212" * 500_000,
    "\U0001f600\u200b\u202e\ufffd\x00" * 200_000,
    "\ud800" * 100_000,  # lone surrogates
    "<|im_end|>" * 100_000,
]


def test_hostile_completions_score_zero_quickly() -> None:
    gsm, syn = GSM8K([]), Synthetic([])
    for text in HOSTILE:
        for task, label in ((gsm, "72"), (syn, "7")):
            start = time.process_time()
            assert task.reward(text, label) == 0.0, text[:20]
            # This process's CPU time, which other processes' load does not inflate: linear scans of
            # these ~1 MB texts take milliseconds, a backtracking blow-up would take hours.
            assert time.process_time() - start < 10.0, text[:20]


_NOISE = "0123456789,.-$/ #*:\\{}boxedanswer is\u2212\n"  # characters the extractor cares about


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(_NOISE), max_size=60))
def test_reward_never_raises_on_numeric_noise(text: str) -> None:
    for task in (GSM8K([]), Synthetic([])):
        assert task.reward(text, "5") in (0.0, 1.0)
    pred = extract_answer(text)
    # what it extracts is a normalised number (a zero denominator is left to answers_equal)
    assert pred is None or re.fullmatch(r"-?[0-9]+(\.[0-9]+)?|-?[0-9]+/[0-9]+", pred), pred


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200), st.text(max_size=20))
def test_reward_never_raises_on_any_text(text: str, label: str) -> None:
    for task in (GSM8K([]), Synthetic([])):
        assert task.reward(text, label) in (0.0, 1.0)


# ---------------------------------------------------------------------------------------------
# The synthetic task


def test_synthetic_generation_is_deterministic() -> None:
    a = generate_items(200, seed=3)
    assert a == generate_items(200, seed=3)
    assert a != generate_items(200, seed=4)
    assert generate_items(50, seed=3) == a[:50]  # a prefix of a longer list
    assert a[0] == generate_items(1, seed=3)[0]


def test_synthetic_items_are_correct() -> None:
    items = generate_items(300, seed=0, length=5, ops=("max", "min"))
    ops = set()
    for i, item in enumerate(items):
        op, digits = parse_prompt(item.prompt)
        ops.add(op)
        assert item.index == i
        assert len(digits) == len(set(digits)) == 5
        assert item.label == str(max(digits) if op == "max" else min(digits))
        assert len(item.prompt) <= 16
    assert ops == {"max", "min"}


def test_synthetic_prompt_blind_answers_stay_below_the_rule() -> None:
    """With uniform digits the answer is skewed to 9 (40% of prompts with 4 digits): an easy
    first step for the policy, but far from what the rule earns."""
    items = generate_items(4000, seed=0)
    counts = Counter(item.label for item in items)
    assert 0.36 < counts["9"] / len(items) < 0.44
    assert set(counts) <= {str(d) for d in range(3, 10)}  # the max of 4 distinct digits is >= 3


def test_synthetic_rejects_bad_parameters() -> None:
    for kwargs in ({"length": 1}, {"length": 11}, {"ops": ()}, {"ops": ("sum",)}):
        with pytest.raises(ValueError):
            generate_items(3, seed=0, **kwargs)
    with pytest.raises(ValueError):
        generate_items(-1, seed=0)
    with pytest.raises(ValueError, match="not a synthetic prompt"):
        parse_prompt("max 12 3")


def test_synthetic_reward() -> None:
    items = generate_items(20, seed=1)
    task = Synthetic(items)
    item = items[0]
    assert task.messages(item) == [{"role": "user", "content": item.prompt}]
    lab = item.label
    for ok in (lab, f" {lab}\n", f"{lab}<|im_end|>", f"{lab}<|endoftext|>", f"{lab}\n<|im_end|>\n"):
        assert task.reward(ok, lab) == 1.0, ok
    other = str((int(lab) + 1) % 10)
    bads = (other, f"{lab}{lab}", f"{lab}.", f"answer {lab}", "", "<|im_end|>", f"<|im_end|>{lab}")
    for bad in bads:
        assert task.reward(bad, lab) == 0.0, bad


def test_warmup_pairs_teach_format_only() -> None:
    items = generate_items(2000, seed=0)
    pairs = warmup_pairs(items, seed=0)
    assert pairs == warmup_pairs(items, seed=0)
    task = Synthetic(items)
    hits = 0
    for item, (prompt, target) in zip(items, pairs, strict=False):
        assert prompt == item.prompt
        _, digits = parse_prompt(prompt)
        assert int(target) in digits  # the right format: one of the shown digits
        hits += task.reward(target, item.label)
    # A model imitating the warm start scores about 1/length: signal for GRPO, far from 1.0.
    assert baseline_reward(items) == pytest.approx(0.25)
    assert 0.2 < hits / len(items) < 0.3
    assert baseline_reward(generate_items(100, seed=0, length=8)) == pytest.approx(1 / 8)


# ---------------------------------------------------------------------------------------------
# Task data: encode / decode, registry


def _items() -> tuple[TaskItem, ...]:
    return (
        TaskItem(index=0, prompt="What is 2 + 2?\nThink.", label="4"),
        TaskItem(index=1, prompt='quotes " and \\ and \u00e9\U0001f600 and \ud800', label="-1.5"),
        TaskItem(index=2, prompt="", label=""),
    )


def test_task_data_round_trip() -> None:
    meta = {"source": "unit", "seed": 7, "system_prompt": "Be brief."}
    data = encode_task_data("gsm8k", _items(), meta=meta)
    assert data == encode_task_data("gsm8k", list(_items()), meta=dict(reversed(meta.items())))
    header, items = decode_task_data(data)
    assert items == _items()
    assert header == {**meta, "format": "stoa.task/1", "task": "gsm8k", "count": 3}
    task = load_task(data)
    assert isinstance(task, GSM8K) and task.items == _items()
    assert task.system_prompt == "Be brief." and task.meta["seed"] == 7
    assert load_task(task.encode()).items == task.items
    empty = decode_task_data(encode_task_data("synthetic", [], meta={}))
    assert empty == ({"format": "stoa.task/1", "task": "synthetic", "count": 0}, ())


def test_make_task_registry() -> None:
    assert set(TASKS) == {"gsm8k", "math", "search", "synthetic"}
    items = generate_items(5, seed=0)
    task = make_task("synthetic", items, {"format": "stoa.task/1", "task": "synthetic", "count": 5})
    assert isinstance(task, Synthetic) and task.system_prompt is None and len(task) == 5
    assert task.item(4) == items[4]
    with pytest.raises(ValueError, match="no item"):
        task.item(5)
    with pytest.raises(ValueError, match="no item"):
        task.item(-1)
    with pytest.raises(ValueError, match="unknown task"):
        make_task("nope", items, {})
    with pytest.raises(ValueError, match=r"indices must be 0\.\.n-1"):
        make_task("synthetic", items[1:], {})
    with pytest.raises(ValueError, match="system_prompt"):
        make_task("gsm8k", [], {"system_prompt": 3})


def test_encode_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="task name"):
        encode_task_data("bad/name", _items(), meta={})
    with pytest.raises(ValueError, match="may not set"):
        encode_task_data("gsm8k", _items(), meta={"count": 1})
    with pytest.raises(ValueError, match="JSON"):
        encode_task_data("gsm8k", _items(), meta={"x": object()})
    with pytest.raises(ValueError, match="JSON"):
        encode_task_data("gsm8k", _items(), meta={"x": float("nan")})
    with pytest.raises(ValueError, match="index"):
        encode_task_data("gsm8k", [dataclasses.replace(_items()[0], index=1)], meta={})
    with pytest.raises(ValueError):
        TaskItem(index=-1, prompt="", label="")
    with pytest.raises(ValueError):
        TaskItem(index=0, prompt=b"x", label="")  # type: ignore[arg-type]


def _frame(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return zstandard.ZstdCompressor(write_content_size=True, write_checksum=True).compress(raw)


_HEADER = '{"count":1,"format":"stoa.task/1","task":"gsm8k"}\n'
_ITEM = '{"index":0,"label":"1","prompt":"p"}\n'


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ("not bytes", "must be bytes"),
        (b"", "not a zstd frame"),
        (b"plain text, not zstd", "not a zstd frame"),
        (_frame(_HEADER + _ITEM)[:-5], "corrupt"),
        (_frame(_HEADER + _ITEM) + b"\x00", "corrupt"),
        (zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * 10), "content size"),
        (_frame(b"\xff\xfe\n"), "UTF-8"),
        (_frame(_HEADER + _ITEM.rstrip("\n")), "newline"),
        (_frame("[1]\n" + _ITEM), "JSON object"),
        (_frame("{oops\n" + _ITEM), "not valid JSON"),
        (_frame("[" * 100_000 + "\n"), "not valid JSON"),
        (_frame(_HEADER.replace("stoa.task/1", "stoa.task/2") + _ITEM), "format"),
        (_frame(_HEADER.replace('"gsm8k"', '"../x"') + _ITEM), "task name"),
        (_frame(_HEADER.replace('"count":1', '"count":2') + _ITEM), "count"),
        (_frame(_HEADER.replace('"count":1', '"count":true') + _ITEM), "count"),
        (_frame(_HEADER + _ITEM + _ITEM), "count"),
        (_frame(_HEADER.replace("{", '{"system_prompt":5,') + _ITEM), "system_prompt"),
        (_frame(_HEADER + _ITEM.replace('"index":0', '"index":1')), "index"),
        (_frame(_HEADER + _ITEM.replace('"index":0', '"index":0.0')), "index"),
        (_frame(_HEADER + _ITEM.replace('"label":"1"', '"label":1')), "label must be str"),
        (_frame(_HEADER + _ITEM.replace("}", ',"extra":1}')), "keys"),
        (_frame(_HEADER + "[0]\n"), "keys"),
        (_frame(_HEADER + '{"index":' + "9" * 5000 + "}\n"), "not valid JSON"),
    ],
)
def test_decode_rejects_malformed(data: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_task_data(data)  # type: ignore[arg-type]


def test_decode_enforces_size_limits() -> None:
    data = encode_task_data("synthetic", generate_items(1000, seed=0), meta={})
    assert len(decode_task_data(data, max_bytes=10**6)[1]) == 1000
    with pytest.raises(ValueError, match="over the limit"):
        decode_task_data(data, max_bytes=len(data) - 1)  # the object itself
    with pytest.raises(ValueError, match="declares"):
        decode_task_data(data, max_bytes=len(data) + 10)  # its decompressed size
    bomb = _frame(b"\n" * 50_000_000)  # 50 MB of newlines compresses to a few KB
    with pytest.raises(ValueError, match="declares"):
        decode_task_data(bomb, max_bytes=1_000_000)


def test_task_layer_imports_no_heavy_frameworks() -> None:
    code = (
        "import sys, slime_stoa.tasks; "
        "mods = ('torch', 'mlx', 'mlx_lm', 'slime', 'transformers'); "
        "heavy = [m for m in mods if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
