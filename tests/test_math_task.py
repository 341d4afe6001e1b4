"""The MATH task: boxed-answer extraction, MATH's normalisation, symbolic equivalence through
math-verify in a grading child, the time bound on hostile answers (in any thread), the loader and
`stoa task prepare math`."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slime_stoa.cli import main
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import open_store
from slime_stoa.tasks import TASKS, load_task
from slime_stoa.tasks.math_answer import as_number, last_boxed, normalize, too_complex
from slime_stoa.tasks.math_data import load_math
from slime_stoa.tasks.math_grader import MathGrader
from slime_stoa.tasks.math_task import MathTask, answers_equivalent

pytest.importorskip("math_verify")


@pytest.fixture(scope="module")
def grader() -> Iterator[MathGrader]:
    g = MathGrader(timeout_s=5.0, processes=1)
    yield g
    g.close()


# -- extraction and normalisation (pure) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so \\boxed{5}.", "5"),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # multiple boxed: the last
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\fbox{7}", "7"),
        ("\\boxed {x+1}", "x+1"),
        ("$\\boxed 42$", "42"),
        ("\\boxed{\\frac{1}{2}", None),  # never closed
        ("no box here: 5", None),
        ("\\boxed{" + "{" * 3000 + "}" * 3000 + "}", None),  # closes past the scan bound
    ],
)
def test_last_boxed(text: str, answer: str | None) -> None:
    assert last_boxed(text) == answer


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("\\dfrac{3}{4}", "\\frac{3}{4}"),
        ("\\frac34", "\\frac{3}{4}"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("10\\%", "10"),
        ("5\\text{ cm}", "5"),
        ("5 \\text{ cm}^2", "5"),
        ("\\text{(C)}", "(C)"),
        ("x = 5", "5"),
        ("\\$1,000", "1000"),
        ("90^\\circ", "90"),
        ("\\left( 1, 2 \\right]", "(1,2]"),
        (".5", "0.5"),
        ("1\\,000", "1000"),
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ],
)
def test_normalize_follows_math_conventions(raw: str, canonical: str) -> None:
    assert normalize(raw) == canonical


def test_exact_numbers() -> None:
    assert as_number("\\frac{1}{2}") == as_number("0.5") == as_number("1/2")
    assert as_number("-\\frac{3}{4}") == as_number("\\frac{-3}{4}") == as_number("-0.75")
    assert as_number("1/0") is None and as_number("x") is None and as_number("\\sqrt{2}") is None


# -- equivalence: a table of pairs through the real grader ---------------------------------------------

EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"),
    ("\\frac{\\sqrt{2}}{2}", "1/\\sqrt{2}"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
    ("2\\sqrt{3}", "\\sqrt{12}"),
    ("(1,2]", "\\left(1, 2\\right]"),
    ("(-\\infty, 3)", "(-\\infty,3)"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("1,2", "2,1"),  # a list of solutions is a set
    ("10\\%", "10"),  # MATH's convention: the percent sign is dropped
    ("5\\text{ cm}", "5"),
    ("\\dfrac{3}{4}", "\\frac34"),
    ("x^2+1", "1+x^2"),
    ("y=2x+1", "2x+1"),
    ("\\text{(C)}", "C"),
    ("3+2i", "2i+3"),
    ("\\$18.90", "18.9"),
    ("1000", "1,000"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
]
NOT_EQUIVALENT = [
    ("10\\%", "0.1"),  # ... so 10% is 10, not 0.1
    ("[1,2)", "(1,2]"),
    ("(-\\infty, 3)", "(-\\infty,3]"),
    ("(1,2)", "(2,1)"),  # an ordered pair is not a set
    ("2", "3"),
    ("x+1", "x+2"),
    ("\\frac{1}{3}", "0.333"),  # exact numbers compare exactly
    ("\\pi", "3.14159"),
    ("\\text{(C)}", "\\text{(B)}"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}2\\\\1\\end{pmatrix}"),
    ("5", ""),
]


@pytest.mark.parametrize(("label", "pred"), EQUIVALENT)
def test_equivalent_pairs(label: str, pred: str, grader: MathGrader) -> None:
    assert answers_equivalent(pred, label, grader)


@pytest.mark.parametrize(("label", "pred"), NOT_EQUIVALENT)
def test_not_equivalent_pairs(label: str, pred: str, grader: MathGrader) -> None:
    assert not answers_equivalent(pred, label, grader)


def test_reward_reads_the_last_boxed_answer(grader: MathGrader) -> None:
    task = MathTask([], grader=grader)
    assert task.reward("I think \\boxed{3}, no wait: \\boxed{\\dfrac{1}{2}}", "0.5") == 1.0
    assert task.reward("\\boxed{0.5} and then \\boxed{3}", "0.5") == 0.0
    assert task.reward("the answer is 0.5", "0.5") == 0.0  # MATH answers are boxed
    assert task.reward("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}") == 1.0


# -- hostile answers: graded 0 within a bound -----------------------------------------------------------

HOSTILE = [
    "10^{10^{10}}",
    "10^10^10",
    "2^{2^{2^{2^{2}}}}",
    "10^{99999}",
    "100000!",
    "(10^{5})!",
    "{" * 1000 + "1" + "}" * 1000,
    "\\frac{" * 40 + "1" + "}{2}" * 40,
    "9" * 100_000,
    "x+" * 50_000 + "1",
]


@pytest.mark.parametrize("answer", HOSTILE, ids=lambda a: a[:16])
def test_hostile_answers_are_refused_before_any_computation(answer: str) -> None:
    """Each is refused by the bounds (or its length) without a grading child: a grader whose
    child could never answer shows nothing was asked."""
    never = MathGrader(timeout_s=30.0, processes=1, command=[sys.executable, "-c", "import time; time.sleep(60)"])
    task = MathTask([], grader=never)
    assert task.reward(f"\\boxed{{{answer}}}", "5") == 0.0
    assert task.reward(f"\\boxed{{{answer}}}", answer + "0") == 0.0  # a hostile label too
    assert never.children[0].starts == 0  # no child was asked: nothing waited on it
    n = normalize(answer)
    assert len(answer) > 2048 or too_complex(n), n


def test_answer_past_the_bounds_is_killed_at_the_timeout() -> None:
    """An answer within the bounds whose evaluation would run for minutes ((9999^9999)^9999) gets no
    answer in time: the child is killed, the reward is 0 after about the timeout, and the next
    question gets a fresh child."""
    g = MathGrader(timeout_s=0.5, processes=1)
    try:
        assert answers_equivalent("x+1", "1+x", g)  # the child has started
        started = time.monotonic()
        assert not answers_equivalent("(9999^{9999})^{9999}", "5", g)
        assert time.monotonic() - started >= 0.5  # it waited out the timeout ...
        assert g.children[0].proc is None  # ... then killed the child rather than wait for its answer
        assert answers_equivalent("x+2", "2+x", g)
        assert g.children[0].starts == 2
    finally:
        g.close()


def test_a_child_that_never_answers_or_dies_grades_zero() -> None:
    silent = MathGrader(timeout_s=0.3, processes=1, command=[
        sys.executable, "-c", "import sys, time; print('ready', flush=True); sys.stdin.readline(); time.sleep(60)",
    ])
    dead = MathGrader(timeout_s=0.3, processes=1, start_timeout_s=5.0, command=[sys.executable, "-c", "pass"])
    try:
        for g in (silent, dead):
            assert not g.equivalent("x", "x")
            assert g.children[0].proc is None
        assert not silent.equivalent("x", "x")
        assert silent.children[0].starts == 2  # a fresh child per question after a kill
    finally:
        silent.close()
        dead.close()


def test_grading_from_other_threads(grader: MathGrader) -> None:
    """Workers grade off the main thread (where math-verify's own SIGALRM timeout cannot run)."""
    task = MathTask([], grader=grader)
    pairs = [("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", 1.0), ("x^2+1", "1+x^2", 1.0), ("[1,2)", "(1,2]", 0.0)] * 2
    results: dict[int, float] = {}

    def grade(i: int, label: str, pred: str) -> None:
        results[i] = task.reward(f"\\boxed{{{pred}}}", label)

    threads = [threading.Thread(target=grade, args=(i, label, pred)) for i, (label, pred, _) in enumerate(pairs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {i: want for i, (_, _, want) in enumerate(pairs)}


# -- data and `stoa task prepare math` -------------------------------------------------------------------

PROBLEMS = [
    ("algebra/1.json", {"problem": "What is $1+1$?", "level": "Level 1", "type": "Algebra", "solution": "It is $\\boxed{2}$."}),
    ("algebra/2.json", {"problem": "Halve 1.", "solution": "We get \\boxed{1} \\div 2 = \\boxed{\\dfrac{1}{2}}."}),
    ("geometry/1.json", {"problem": "Interval?", "solution": "So $x \\in \\boxed{(1,2]}$."}),
]


def math_folder(root: Path) -> Path:
    """A small MATH-format split folder (subject subfolders of problem files)."""
    for name, row in PROBLEMS:
        path = root / "MATH" / "test" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(row), encoding="utf-8")
    return root / "MATH" / "test"


def read(url: str, key: str) -> bytes:
    async def go() -> bytes:
        async with open_store(url) as store:
            return await store.get_bytes(key)

    return asyncio.run(go())


def test_load_math_folder_and_jsonl(tmp_path: Path) -> None:
    items = load_math(math_folder(tmp_path))
    assert [(i.prompt, i.label) for i in items] == [
        ("What is $1+1$?", "2"), ("Halve 1.", "\\dfrac{1}{2}"), ("Interval?", "(1,2]"),
    ]
    jsonl = tmp_path / "math500.jsonl"
    jsonl.write_text('{"problem": "p", "answer": "\\\\frac{1}{2}", "solution": "\\\\boxed{9}"}\n\n{"problem": "q", "answer": 3}\n')
    assert [(i.prompt, i.label) for i in load_math(jsonl)] == [("p", "\\frac{1}{2}"), ("q", "3")]
    assert len(load_math(jsonl, limit=1)) == 1


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ('{"problem": "p"}', "answer"),
        ('{"problem": "p", "solution": "no box"}', "boxed"),
        ('{"problem": "", "answer": "1"}', "problem"),
        ("[1]", "JSON object"),
        ("{", "not valid JSON"),
    ],
)
def test_load_math_refuses_bad_lines(tmp_path: Path, line: str, error: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "ok", "answer": "1"}\n' + line + "\n")
    with pytest.raises(ValueError, match=error) as info:
        load_math(path)
    assert "bad.jsonl:2" in str(info.value)


def test_prepare_math(tmp_path: Path, capsys: pytest.CaptureFixture[str], grader: MathGrader) -> None:
    (tmp_path / "bucket").mkdir()
    url = f"file://{tmp_path / 'bucket'}"
    folder = math_folder(tmp_path)
    assert main(["task", "prepare", "math", str(folder), "--store", url, "--run", "r"]) == 0
    task = load_task(read(url, RunLayout("r").task_file("math", "test.jsonl.zst")))
    assert isinstance(task, MathTask) and len(task) == 3 and "math" in TASKS
    task.grader = grader
    assert task.reward("... \\boxed{0.5}", task.item(1).label) == 1.0
    assert task.messages(task.item(0))[0]["content"].endswith("\\boxed{}.")
    assert main(["task", "prepare", "math", str(tmp_path / "missing"), "--store", url, "--run", "r"]) == 1
    assert "error:" in capsys.readouterr().err
