"""GSM8K: grade-school math word problems with an integer answer after "####".

The reward is 1.0 when the completion's final answer equals the label numerically, else 0.0.
`extract_answer` finds the final answer in this order, each time taking the last occurrence:

1. ``#### X`` (the GSM8K reference format, which the system prompt asks for);
2. ``\\boxed{X}`` (LaTeX; ``\\frac{a}{b}``, ``\\text{...}``, ``$`` and ``\\%`` are cleaned);
3. ``answer is X`` / ``Answer: X`` (any case, optional markdown bold);
4. otherwise the last number in the text.

A number is an optional minus sign (``-`` or U+2212), an optional ``$``, and digits with optional
thousands commas and decimals (``-1,234.50``), or a simple fraction (``3/4``). A number glued to a
preceding letter, digit, ``_`` or ``.`` (``x2``, ``v1.2``) is not one, and a minus sign after a
letter or digit is subtraction (``10-3`` gives 10 and 3). Only ASCII digits count.

Every pattern is linear-time: no nested or ambiguous quantifiers, bounded filler between a
keyword and its number, and ``\\boxed`` content is scanned for at most `MAX_BOXED_CHARS`.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path
from typing import ClassVar

from slime_stoa.tasks.base import Task, TaskItem

SYSTEM_PROMPT = (
    "Solve the math problem. Reason step by step, then write the final answer as a number on "
    'the last line in the form "#### <number>".'
)
MAX_NUMBER_CHARS = 64  # longer numeric strings never equal a label (and int() has a digit limit)
MAX_BOXED_CHARS = 256  # how far past "\boxed{" the closing brace is looked for

# Sign (not after a letter/digit: that is subtraction), optional "$", then a fraction or a number
# whose comma groups are exactly three digits wide ("1,2,3" is three numbers, "1,0000" is none).
_NUMBER = (
    r"(?<![0-9A-Za-z_.])(?P<neg>[-\u2212])?(?:\$[ \t]?)?"
    r"(?P<num>[0-9]+/[0-9]+|[0-9]+(?:,[0-9]{3}(?![0-9]))*(?:\.[0-9]+)?)"
)
_NUMBER_RE = re.compile(_NUMBER)
_HASH_RE = re.compile(r"####[ \t]{0,8}(?:\*\*)?[ \t]{0,8}" + _NUMBER)
_ANSWER_RE = re.compile(
    r"answer(?:\*\*)?(?:[ \t]{1,8}is[ \t]{0,8}:?|[ \t]{0,8}[:=])"
    r"(?:\*\*)?\s{0,8}(?:\*\*)?" + _NUMBER,
    re.IGNORECASE,
)
_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]{0,32})\}\{([^{}]{0,32})\}")
_TEXT_RE = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{[^{}]{0,64}\}")
_PLAIN_RE = re.compile(
    r"[-+\u2212]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|[-+\u2212]?[0-9]+/[0-9]+"
)


def _number_text(m: re.Match[str]) -> str:
    """The normalised text of a `_NUMBER` match: "-" sign, no "$", no commas."""
    return ("-" if m.group("neg") else "") + m.group("num").replace(",", "")


def _last(pattern: re.Pattern[str], text: str) -> str | None:
    last = None
    for match in pattern.finditer(text):
        last = match
    return None if last is None else _number_text(last)


def _boxed(text: str) -> str | None:
    """The last number inside the last ``\\boxed{...}``, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    start += len("\\boxed{")
    depth, end = 1, None
    for i in range(start, min(len(text), start + MAX_BOXED_CHARS)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                end = i
                break
    if end is None:
        return None
    content = _TEXT_RE.sub(" ", text[start:end])
    content = _FRAC_RE.sub(r"\1/\2", content)
    content = content.replace("\\ ", " ")  # a LaTeX space separates
    for junk in ("\\$", "\\%", "\\,", "\\!", "{", "}"):  # "1\\,000" and "1{,}000" are 1000
        content = content.replace(junk, "")
    return _last(_NUMBER_RE, content)


def extract_answer(completion: str) -> str | None:
    """The final numeric answer in `completion` (e.g. "-1234.5", "3/4"), or None if none.

    Tries "#### X", "\\boxed{X}", "answer is X" / "Answer: X", then the last number; within a
    rule the last occurrence wins. Never raises on a str; linear time.
    """
    if not isinstance(completion, str):
        return None
    for find in (
        lambda t: _last(_HASH_RE, t),
        _boxed,
        lambda t: _last(_ANSWER_RE, t),
        lambda t: _last(_NUMBER_RE, t),
    ):
        found = find(completion)
        if found is not None:
            return found
    return None


def parse_number(text: str) -> Fraction | None:
    """`text` as an exact number ("1,000", "-72.50", "$5", "3/4"), or None if it is not one."""
    if not isinstance(text, str):
        return None
    s = text.strip().replace("$", "", 1)
    if len(s) > MAX_NUMBER_CHARS or not _PLAIN_RE.fullmatch(s):
        return None
    s = s.replace(",", "").replace("\u2212", "-")
    if "/" in s:
        num, den = s.split("/")
        return None if int(den) == 0 else Fraction(int(num), int(den))
    whole, _, frac = s.partition(".")
    return Fraction(int(whole + frac), 10 ** len(frac)) if frac else Fraction(int(whole))


def answers_equal(pred: str | None, label: str) -> bool:
    """Whether `pred` and `label` are the same number ("72" == "72.00", "0.5" == "1/2")."""
    if pred is None:
        return False
    a, b = parse_number(pred), parse_number(label)
    return a is not None and b is not None and a == b


def parse_label(answer: str) -> str:
    """The label of a GSM8K "answer" field: the number after the last "####", commas removed."""
    if not isinstance(answer, str) or "####" not in answer:
        raise ValueError('a GSM8K answer must contain "#### <number>"')
    label = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if parse_number(label) is None:
        raise ValueError(f'the text after "####" is not a number: {label[:80]!r}')
    return label


def load_gsm8k_jsonl(path: str | Path, *, limit: int | None = None) -> tuple[TaskItem, ...]:
    """Items from a GSM8K JSON-lines file ({"question", "answer"} per line), blank lines skipped.

    The prompt is the question, the label the normalised number after "####". `limit` keeps the
    first `limit` items. Raises ValueError naming the line for any malformed line.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
    items: list[TaskItem] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(items) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
                question, answer = row.get("question"), row.get("answer")
                if not isinstance(question, str) or not question.strip():
                    raise ValueError('"question" must be a non-empty string')
                if not isinstance(answer, str):
                    raise ValueError('"answer" must be a string')
                label = parse_label(answer)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: bad GSM8K line: {e}") from None
            items.append(TaskItem(index=len(items), prompt=question.strip(), label=label))
    return tuple(items)


class GSM8K(Task):
    """GSM8K with a step-by-step system prompt; reward 1.0 iff the final answer is the label."""

    name: ClassVar[str] = "gsm8k"
    default_system_prompt: ClassVar[str | None] = SYSTEM_PROMPT

    def reward(self, completion: str, label: str) -> float:
        return 1.0 if answers_equal(extract_answer(completion), label) else 0.0
